"""Chapter 01 (memory anatomy): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_01.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.notebook import check


def check_model_states(fn) -> bool:
    """``fn(psi, n, stage)`` -> per-rank bytes of model states for mixed-precision Adam
    (K = 12) under ``stage`` in ``ddp``/``zero1``/``zero2``/``zero3`` (the ZeRO paper)."""
    from minifsdp.analytic import model_state_bytes

    cases = [((psi, n, st), model_state_bytes(psi, n, st)["total"])
             for psi in (7.5e9, 1e6) for n in (1, 8, 64)
             for st in ("ddp", "zero1", "zero2", "zero3")]
    return check("model states", cases, fn, close=lambda a, b: abs(a - b) <= 1e-6 * b)


def check_adam_state_bytes(fn) -> bool:
    """``fn(model)`` -> exact bytes of ``torch.optim.Adam``'s state for ``model`` after a step
    (Note [Adam's step counter])."""
    from minifsdp.analytic import optimizer_state_bytes
    from minifsdp.models import GPT, GPTConfig, MnistCNN

    models = [MnistCNN(), GPT(GPTConfig(n_layer=1, d_model=32)), torch.nn.Linear(10, 3)]
    cases = [((m,), optimizer_state_bytes(m.parameters(), "adam")) for m in models]
    return check("Adam state bytes", cases, fn)


def largest_cnn_batch(budget_bytes: int) -> int:
    """Largest batch whose predicted MnistCNN training-step peak (Adam) fits in the budget."""
    from minifsdp.analytic import predict_step_peak

    fits = lambda b: predict_step_peak("cnn", b, "adam", dropout=0.0)["peak"] <= budget_bytes
    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # invariant: fits(lo) (or lo == 0), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def check_largest_batch(fn) -> bool:
    """``fn(budget_bytes)`` -> the largest MnistCNN batch whose step peak fits the budget."""
    cases = [((b,), largest_cnn_batch(b)) for b in (40 * 2**20, 64 * 2**20, 256 * 2**20, 2**30)]
    return check("largest batch", cases, fn)
