"""Error models behind the series' claims: how far two computations may differ, derived rather
than measured, so that a bound holds on the next reader's CPU or GPU too.

Note [error models]: a claim that two results agree is one of two kinds (Note [what a notebook
prints] in minifsdp/notebook.py). Either it is exact by construction -- the same operations in
the same order, or an integer count -- or it is a bound that comes from one of these models
and has at least 10x margin over the largest value measured under every CPU profile:

- **Unit roundoff** ``u``: the largest relative error of one rounding, half the spacing of
  floats at 1 (fp32 2^-24 ~ 6.0e-8, bf16 2^-8 ~ 3.9e-3, fp16 2^-11 ~ 4.9e-4). One ulp of a
  value x is ``2 u |x|`` at most.
- **A reordered sum.** Summing K terms in any order gives ``|s_hat - s| <= gamma_{K-1}
  sum|x_i|`` with ``gamma_k = k u / (1 - k u)`` (Higham, *Accuracy and Stability of Numerical
  Algorithms*, 2nd ed., eq. 4.4), so two orders -- a ring all-reduce against one process, two
  CPUs' matmul blockings -- differ by at most twice that. This is why "bitwise" is claimed
  only where the order is the same by construction (e.g. ``a + b == b + a``: Note [bitwise
  parity] in minifsdp/train.py).
- **Adam's step is bounded, whatever the gradients.** Adam moves a weight by ``lr * m_hat /
  (sqrt(v_hat) + eps)``; by Cauchy-Schwarz over the exponential averages, ``|m_hat| /
  sqrt(v_hat) <= R_t = sqrt(sum_i a_i^2 / b_i)``, with ``a_i``, ``b_i`` the bias-corrected
  weights of gradient i in the first and second moments (Kingma & Ba 2015, section 2.1, state
  the looser-worded "|step| <= lr (1 - beta1) / sqrt(1 - beta2)"). R_1 = 1, R_3 = 1.004,
  R_10 = 1.043. Two runs fed *any* different gradients -- fp32 and bf16, one process and N --
  are therefore at most ``2 lr sum_t R_t`` apart after t steps (decoupled weight decay only
  shrinks the gap; a factor 1 + 1e-4 covers Adam's own fp32 rounding, which can exceed R_t
  by a few ulps). A bound by construction, so it holds on every machine; it is loose where
  the gradients agree, and tight where rounding flips the sign of a gradient near zero, which
  is exactly what mixed precision and reordered sums do to some elements.
"""

from __future__ import annotations

import math

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """Half the gap between 1 and the next float of ``dtype``.

    Example:
        >>> unit_roundoff(torch.float32), unit_roundoff(torch.bfloat16)
        (5.960464477539063e-08, 0.00390625)
    """
    return torch.finfo(dtype).eps / 2


def reordered_sum_bound(k: int, abs_sum: float, dtype: torch.dtype = torch.float32) -> float:
    """The most two evaluation orders of a sum of ``k`` terms can differ, given ``sum |x_i|``:
    ``2 gamma_{k-1} sum|x_i|`` (Note [error models]).

    Example:
        >>> f"{reordered_sum_bound(4, 1.0):.3e}"    # four terms of total magnitude 1, fp32
        '3.576e-07'
    """
    u = unit_roundoff(dtype)
    n = (k - 1) * u
    return 2 * n / (1 - n) * abs_sum


def adam_ratio_bound(step: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """``R_t``: the largest ``|m_hat| / sqrt(v_hat)`` Adam can reach at ``step`` (1-based),
    over all gradient sequences (Note [error models]).

    Example:
        >>> round(adam_ratio_bound(1), 6), round(adam_ratio_bound(3), 4)
        (1.0, 1.0036)
    """
    b1, b2 = betas
    total = 0.0
    for i in range(1, step + 1):
        a = (1 - b1) * b1 ** (step - i) / (1 - b1**step)
        b = (1 - b2) * b2 ** (step - i) / (1 - b2**step)
        total += a * a / b
    return math.sqrt(total)


def adam_divergence_bound(lr: float, steps: int,
                          betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The farthest any weight of two Adam/AdamW runs from the same start can be apart after
    ``steps`` steps, whatever their gradients: ``2 lr sum_t R_t`` and 1e-4 of it for Adam's
    own rounding (Note [error models]).

    Example:
        >>> round(adam_divergence_bound(1e-2, 3), 4)    # 3 steps at lr 1e-2
        0.0601
    """
    return 2 * lr * sum(adam_ratio_bound(t, betas) for t in range(1, steps + 1)) * (1 + 1e-4)
