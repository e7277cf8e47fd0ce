"""The error models behind the claims (minifsdp/numerics.py, Note [error models]), checked
against what they model: torch's own Adam fed the worst gradients, and reordered fp32 sums."""

import doctest

import pytest
import torch

from minifsdp import numerics


def test_doctests():
    assert doctest.testmod(numerics).failed == 0


def _adam_steps(grads: list[float], opt_cls=torch.optim.Adam) -> list[float]:
    p = torch.zeros(1, requires_grad=True)
    opt = opt_cls([p], lr=1.0, eps=0.0, weight_decay=0.0)
    values = []
    for g in grads:
        p.grad = torch.tensor([g])
        opt.step()
        values.append(p.item())
    return values


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.AdamW])
def test_adams_step_never_exceeds_the_bound_and_reaches_it(opt_cls):
    b1, b2 = 0.9, 0.999
    gen = torch.Generator().manual_seed(0)
    for t in (1, 2, 3, 10):
        bound = numerics.adam_ratio_bound(t)
        # the maximiser from Cauchy-Schwarz: gradient i proportional to a_i / b_i
        worst = [((1 - b1) * b1 ** (t - i)) / ((1 - b2) * b2 ** (t - i)) for i in range(1, t + 1)]
        steps = _adam_steps(worst, opt_cls)
        last = abs(steps[-1] - (steps[-2] if t > 1 else 0.0))
        assert last == pytest.approx(bound, rel=1e-5)  # reached (to fp32 rounding)
        for _ in range(200):  # and never exceeded, by any gradients
            g = torch.randn(t, generator=gen) * 10.0 ** torch.randint(-8, 3, (t,), generator=gen)
            steps = _adam_steps(g.tolist(), opt_cls)
            last = abs(steps[-1] - (steps[-2] if t > 1 else 0.0))
            assert last <= bound * (1 + 1e-4), (t, g)


def test_two_adam_runs_stay_within_the_divergence_bound():
    """Two AdamW runs on one model, one fed gradients and the other those gradients rounded to
    bf16 with random sign flips of the small ones: never further apart than the bound."""
    gen = torch.Generator().manual_seed(1)
    lr, steps = 1e-2, 5
    a = torch.zeros(1000, requires_grad=True)
    b = torch.zeros(1000, requires_grad=True)
    oa, ob = torch.optim.AdamW([a], lr=lr), torch.optim.AdamW([b], lr=lr)
    for _ in range(steps):
        g = torch.randn(1000, generator=gen) * torch.rand(1000, generator=gen) ** 8
        flip = torch.where(g.abs() < 1e-3, -1.0, 1.0)
        a.grad, b.grad = g, (g * flip).bfloat16().float()
        oa.step()
        ob.step()
    gap = (a - b).abs().max().item()
    assert 0.5 * numerics.adam_divergence_bound(lr, steps) < gap
    assert gap <= numerics.adam_divergence_bound(lr, steps)


def test_reordered_sums_stay_within_the_bound():
    gen = torch.Generator().manual_seed(2)
    for k in (3, 100, 10_000):
        x = torch.randn(k, generator=gen)
        forward = torch.zeros((), dtype=torch.float32)
        for v in x:
            forward += v
        backward = torch.zeros((), dtype=torch.float32)
        for v in x.flip(0):
            backward += v
        gap = (forward - backward).abs().item()
        assert gap <= numerics.reordered_sum_bound(k, x.abs().sum().item()), k
    assert numerics.unit_roundoff(torch.bfloat16) == 2.0**-8
