"""Chapter 02 (DDP): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check


def _bucket_cases():
    """Parameter lists (in ``model.parameters()`` order) and caps for the bucket exercises."""
    from minifsdp.models import MnistCNN

    e = torch.empty
    return [
        ([e(100), e(300), e(50)], 1000),                  # the docstring's example
        ([e(100), e(300), e(50)], 4000),                  # everything fits in one bucket
        ([e(10)] * 7, 80),                                # closes on *reaching* the cap
        ([e(1000), e(1), e(1), e(1000)], 100),            # a big tensor overshoots the cap
        ([e(8), e(8, dtype=torch.float64), e(8)], 10**6),  # a dtype change closes a bucket
        (list(MnistCNN().parameters()), 25 * 2**20),      # torch's default cap: one bucket
        (list(MnistCNN().parameters()), 2**20),
    ]


def check_assign_buckets(fn) -> bool:
    """``fn(params, cap_bytes)`` -> lists of parameter indices, one list per bucket, in the
    order backward fills them (``minifsdp.ddp.assign_buckets``, Note [buckets])."""
    from minifsdp.ddp import assign_buckets

    cases = [((ps, cap), assign_buckets(ps, cap)) for ps, cap in _bucket_cases()]
    return check("bucket assignment", cases, fn)


def ddp_step_comm(numels: list[int], world_size: int, cap_bytes: int) -> tuple[int, float]:
    """``(all-reduces per step, bytes one rank sends per step)`` for fp32 ``BucketedDDP``,
    counting wire bytes as ``minifsdp.comm`` does (2(N-1)/N of each bucket's bytes)."""
    from minifsdp.ddp import assign_buckets

    buckets = assign_buckets([torch.empty(n) for n in numels], cap_bytes)
    sent = sum(2 * (world_size - 1) / world_size * 4 * sum(numels[i] for i in b)
               for b in buckets)
    return len(buckets), sent


def check_ddp_step_comm(fn) -> bool:
    """``fn(numels, world_size, cap_bytes)`` -> ``(number of all-reduces, wire bytes sent by
    one rank)`` in one step of fp32 ``BucketedDDP`` (Notes [buckets] and [ring bytes])."""
    from minifsdp.models import GPT, GPTConfig, MnistCNN

    models = [MnistCNN(), GPT(GPTConfig(n_layer=4, d_model=128))]
    cases = []
    for m in models:
        numels = [p.numel() for p in m.parameters()]
        for n, cap in [(2, 25 * 2**20), (4, 2**20), (8, 2**18), (1, 2**20)]:
            cases.append(((numels, n, cap), ddp_step_comm(numels, n, cap)))
    close = lambda a, b: a[0] == b[0] and abs(a[1] - b[1]) <= 1e-9 * max(1.0, b[1])
    return check("DDP bytes per step", cases, fn, close=close)


def stalled_buckets(buckets: list[list[int]], used: set[int]) -> list[int]:
    """Buckets that cannot be all-reduced during backward when only ``used`` get gradients:
    the first bucket with a missing gradient never fills, and later ones wait behind it
    because buckets are launched in order (Notes [buckets] and [unused parameters])."""
    for k, b in enumerate(buckets):
        if any(i not in used for i in b):
            return list(range(k, len(buckets)))
    return []


def check_stalled_buckets(fn) -> bool:
    """``fn(buckets, used)`` -> indices of the buckets that backward cannot launch."""
    cases = [(([[3, 2], [1], [0]], {0, 1, 2, 3}), []),
             (([[3, 2], [1], [0]], {0, 1, 2}), [0, 1, 2]),
             (([[3, 2], [1], [0]], {1, 2, 3}), [2]),
             (([[5, 4], [3, 2], [1, 0]], {0, 1, 4, 5, 2}), [1, 2]),
             (([[7], [6, 5, 4], [3], [2, 1, 0]], {7, 6, 5, 4, 3, 2, 0}), [3]),
             (([[0]], set()), [0])]
    return check("stalled buckets", cases, fn)


# ---- lab 02: BucketedDDP's gradient hook and in-order bucket launch ---------------------------

HOOK, LAUNCH = "ddp.grad_hook", "ddp.launch"
ORDER = "bucket all-reduces, in issue order"
EARLY = "bucket all-reduces issued during backward"
WAITED = "bucket all-reduces waited for inside backward"


def _crossed_model(rank: int):
    """Parameters defined in one order, used in another: ``out`` comes first in
    ``parameters()`` but runs last, so its gradient arrives first while its bucket is the last
    to launch; ``a`` and ``b`` run in a rank-dependent order, so their gradients arrive in
    another order on each rank; ``frozen`` trains not (no slot, no bucket)."""
    import torch.nn as nn

    class Crossed(nn.Module):
        def __init__(self):
            super().__init__()
            self.out, self.inp = nn.Linear(6, 3), nn.Linear(5, 6)
            self.frozen = nn.Linear(6, 6).requires_grad_(False)
            self.a, self.b, self.mix = nn.Linear(6, 7, bias=False), nn.Linear(6, 7), nn.Linear(7, 6)

        def forward(self, x):
            h = self.frozen(torch.relu(self.inp(x)))
            z = self.a(h) + self.b(h) if rank % 2 == 0 else self.b(h) + self.a(h)
            return self.out(torch.tanh(self.mix(z)))

    torch.manual_seed(0)
    return Crossed()


def _ddp_steps(model, steps: int, rank: int, on_step=None) -> list[dict]:
    """``steps`` AdamW steps on this rank's (4, 5) batches; each step's loss, gradients and
    parameters. ``on_step(step, log, record)`` sees the step's comm log after backward."""
    from minifsdp import comm

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        with comm.logging_comm() as log:
            loss = (model(x) - y).square().mean()
            loss.backward()
        rec = {"loss": loss.detach().clone(),
               "grads": [p.grad.clone() for p in model.module.parameters() if p.requires_grad]}
        if on_step:
            on_step(step, log, rec)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["params"] = [p.detach().clone() for p in model.module.parameters()]
        out.append(rec)
    return out


def run_lab(t, info) -> None:
    """Lab 02's cases: the crossed model, one parameter per bucket (torch DDP is bitwise at
    every N) and several per bucket (torch at N = 2, the package's BucketedDDP at N = 3)."""
    from torch.nn.parallel import DistributedDataParallel

    from minifsdp.ddp import FINAL_SPAN, BucketedDDP
    from minifsdp.labs import seams

    n, r = info.world_size, info.rank

    class Reference(BucketedDDP):  # the package's own hook and launch: the oracle at N = 3
        _on_grad_ready = seams.reference(HOOK)
        _launch_ready_buckets = seams.reference(LAUNCH)

    cases = [("one parameter per bucket", 1e-9, "torch"),
             ("several parameters per bucket", 4e-4, "torch" if n == 2 else "reference")]
    for title, cap, oracle in cases:
        vs = "torch DDP" if oracle == "torch" else "the package's BucketedDDP"
        with t.case(f"{title}, 3 AdamW steps vs {vs}", (HOOK, LAUNCH)):
            if oracle == "torch":  # bucket_cap_mb_list: torch's buckets = ours from step 0 on
                k = sum(p.requires_grad for p in _crossed_model(r).parameters())
                kwargs = ({"bucket_cap_mb_list": [cap] * k} if cap < 1e-6
                          else {"bucket_cap_mb": cap})
                want = _ddp_steps(DistributedDataParallel(_crossed_model(r), **kwargs), 3, r)
            else:
                want = _ddp_steps(Reference(_crossed_model(r), bucket_cap_mb=cap), 3, r)
            ours = BucketedDDP(_crossed_model(r), bucket_cap_mb=cap)
            n_buckets = len(ours.buckets)
            names = [nm for nm, p in ours.module.named_parameters() if p.requires_grad]

            def after_backward(step, log, rec, n_buckets=n_buckets, want=want, names=names):
                t.expect("loss", rec["loss"], want[step]["loss"], step=step, phase="forward")
                final = [x for x in log.records if x.kind == "compute" and x.op == FINAL_SPAN]
                end = final[0].t_start if final else float("inf")
                ars = log.comms("all_reduce")
                t.expect(ORDER, [x.tag for x in ars], [f"bucket {k}" for k in range(n_buckets)],
                         step=step, phase="backward")
                t.expect(EARLY, sum(x.t_start < end for x in ars), n_buckets, step=step,
                         phase="backward")
                t.expect(WAITED, sum(x.t_wait is not None and x.t_wait < end for x in ars), 0,
                         step=step, phase="backward")
                for name, got, exp in zip(names, rec["grads"], want[step]["grads"]):
                    t.expect(f"{name}.grad", got, exp, step=step, phase="backward")

            got = _ddp_steps(ours, 3, r, after_backward)
            all_names = [nm for nm, _ in ours.module.named_parameters()]
            for step, rec in enumerate(got):
                for name, p, exp in zip(all_names, rec["params"], want[step]["params"]):
                    t.expect(name, p, exp, step=step, phase="optimizer step")


def hint(name: str, got, expected, n: int) -> str | None:
    if name == ORDER and sorted(got) == sorted(expected):
        return ("every bucket started, in another order: ranks match collectives by their order "
                "of issue, so buckets start strictly 0, 1, 2, ... (Note [buckets])")
    if name == EARLY and isinstance(got, int):
        return (f"{expected - got} bucket(s) started only in the final callback: a bucket must "
                "start as soon as its last gradient arrives (Note [buckets])")
    if name == WAITED and isinstance(got, int):
        return ("waiting in the hook stalls backward until the all-reduce is done, so nothing "
                "overlaps; the final callback waits (Notes [buckets], [when backward ends])")
    if name.endswith(".grad") and isinstance(got, torch.Tensor) and n > 2 \
            and torch.allclose(got, expected, rtol=1e-5, atol=1e-7):
        return ("last-bit differences at N = 3: g / 3 and g * (1/3), or dividing after the sum, "
                "round differently; torch multiplies by 1/N first (Note [divide first])")
    return None


LAB = Lab(
    id="02",
    title="DDP gradient hook and in-order buckets",
    skeleton="labs/lab02_ddp.py",
    seams=(Seam(HOOK, "minifsdp.ddp", "BucketedDDP._on_grad_ready"),
           Seam(LAUNCH, "minifsdp.ddp", "BucketedDDP._launch_ready_buckets")),
    notes=("buckets", "divide first", "when backward ends"),
    run=run_lab,
    hint=hint,
    oracle="torch DDP",
)
