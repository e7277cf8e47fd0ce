"""Chapter 11 (FSDP2's pitfalls): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from a small
autograd experiment or from the rule of a collective, prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_11.py`` checks that every checker
accepts a correct solution and rejects wrong ones.
"""

from __future__ import annotations

import torch

from minifsdp.notebook import check


def measured_token_weights(real_tokens: list[int], mode: str) -> list[float]:
    """The weight of one token of each rank in the averaged gradient, measured: every token's
    loss is the same scalar parameter ``w``, each rank's loss is formed as ``mode`` says, each
    rank's gradient is taken by autograd, and the ranks' gradients are reduced as FSDP2 does
    (``mean``: AVG over N; ``global``: divide factor 1, a SUM). Float64, so the weights come out
    to the last digit of the exact fractions."""
    n, total = len(real_tokens), sum(real_tokens)
    grads = []
    for tokens in real_tokens:
        w = torch.ones((), dtype=torch.float64, requires_grad=True)
        token_losses = w * torch.ones(tokens, dtype=torch.float64)
        loss = token_losses.sum() / (tokens if mode == "mean" else total)
        loss.backward()
        grads.append(w.grad / tokens)  # per token of this rank
    reduced = [g / n if mode == "mean" else g for g in grads]
    return [float(g) for g in reduced]


def check_token_weights(fn) -> bool:
    """``fn(real_tokens, mode)`` -> for each rank, the weight one of its real tokens has in the
    reduced gradient: ``mode="mean"`` when each rank's loss is the mean over its own tokens and
    FSDP averages over the N ranks; ``"global"`` when each rank's loss is its token sum over the
    global token count and ``set_gradient_divide_factor(1.0)`` (Section 2)."""
    cases = [((tokens, mode), measured_token_weights(tokens, mode))
             for tokens in ([16, 3], [5, 5], [7, 1, 4], [1, 2, 3, 10])
             for mode in ("mean", "global")]
    return check("token weights", cases, fn,
                 close=lambda a, b: len(a) == len(b) and all(
                     abs(x - y) <= 1e-12 * abs(y) for x, y in zip(a, b)))


# What one reduce-scatter over every rank does when the ranks send what they send (Section 1):
# one parameter list everywhere -> "ok"; lists that differ but have the same total size -> the
# collective runs and sums different parameters, "silently wrong"; different sizes -> "hang"
# (NCCL waits for bytes that never come; gloo aborts).
REDUCE_SCATTER_CASES = [
    ([[("a", 8), ("b", 4)], [("a", 8), ("b", 4)]], "ok"),
    ([[("e0", 16)], [("e1", 16)]], "silently wrong"),
    ([[("e0", 16)], [("e1", 12)]], "hang"),
    ([[("a", 8), ("e0", 16)], [("a", 8), ("e1", 16)], [("a", 8), ("e0", 16)]], "silently wrong"),
    ([[("a", 8)], [("a", 8)], [("a", 8), ("b", 4)]], "hang"),
    ([[("a", 4), ("b", 8)], [("b", 8), ("a", 4)]], "silently wrong"),
    ([[], []], "ok"),
    ([[("x", 6)], [("x", 6)], [("x", 6)]], "ok"),
]


def check_reduce_scatter_outcome(fn) -> bool:
    """``fn(sends)`` -> ``"ok"``, ``"silently wrong"`` or ``"hang"``: what one reduce-scatter
    does when rank r's input is laid out from ``sends[r]``, its list of (parameter, padded
    numel) in order."""
    return check("reduce-scatter outcome", [((s,), want) for s, want in REDUCE_SCATTER_CASES],
                 fn)
