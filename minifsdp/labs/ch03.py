"""Chapter 03 (ZeRO): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.notebook import check


def flat_partition(numels: list[int], rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """``(parameter index, start, stop)``: the elements of each parameter that ``rank`` owns in
    ZeRO's flat partition (one bucket; Note [flat partition]), from ``minifsdp.zero``."""
    from minifsdp.zero import flatten_into_buckets

    params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
    [b] = flatten_into_buckets(params, rank, world_size, cap_bytes=float("inf"))
    lo, hi = rank * b.shard.numel(), (rank + 1) * b.shard.numel()
    owned = []
    for i, (p, o) in enumerate(zip(b.params, b.offsets)):
        start, stop = max(lo, o) - o, min(hi, o + p.numel()) - o
        if start < stop:
            owned.append((i, start, stop))
    return owned


def check_flat_partition(fn) -> bool:
    """``fn(numels, rank, world_size)`` -> list of ``(param index, start, stop)`` slices of the
    parameters (flattened) that ``rank`` owns, in parameter order."""
    shapes = [[8], [6, 2], [5, 5, 5], [1, 1000, 3], [7], [4, 4, 4, 4]]
    cases = [((s, r, n), flat_partition(s, r, n)) for s in shapes for n in (1, 2, 3, 4)
             for r in range(n)]
    return check("flat partition", cases, fn)


def zero_model_state_bytes(psi: int, n: int, stage: str) -> dict[str, int]:
    """Per-rank bytes of our fp32 Adam ZeRO (one bucket) after a step's backward, from step 2
    on: padded flat parameters, gradients, Adam's two shard-sized states and its ``step``."""
    shard = -(-psi // n)
    grads = 4 * n * shard if stage == "zero1" else 4 * shard
    return {"params": 4 * n * shard, "grads": grads, "optimizer": 8 * shard + 4}


def check_zero_model_state_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(psi, n, stage)`` -> ``{"params", "grads", "optimizer"}`` bytes on one rank
    (``stage`` is ``"zero1"`` or ``"zero2"``; Note [ZeRO memory categories]). ``measured``:
    ``((psi, n, stage), bytes)`` pairs from real runs, checked too."""
    cases = [((psi, n, st), zero_model_state_bytes(psi, n, st))
             for psi in (1_199_882, 30_592, 10) for n in (1, 2, 3, 4, 8)
             for st in ("zero1", "zero2")]
    return check("ZeRO model-state bytes", [*cases, *(measured or [])], fn)


def zero_step_wire_bytes(psi: int, n: int, stage: str) -> float:
    """Bytes one rank sends per fp32 step (one bucket; ``minifsdp.comm``'s accounting):
    DDP all-reduces 4 psi; ZeRO-1 all-reduces and all-gathers the padded flat buffer; ZeRO-2
    reduce-scatters and all-gathers it (Note [ZeRO-1 traffic])."""
    if stage == "ddp":
        return 2 * (n - 1) / n * 4 * psi
    flat = 4 * n * -(-psi // n)
    return (2 if stage == "zero1" else 1) * (n - 1) / n * flat + (n - 1) / n * flat


def check_zero_step_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(psi, n, stage)`` -> wire bytes one rank sends per step under ``"ddp"``,
    ``"zero1"`` or ``"zero2"``. ``measured``: ``((psi, n, stage), bytes)`` from real runs."""
    cases = [((psi, n, st), zero_step_wire_bytes(psi, n, st))
             for psi in (1_199_882, 30_592, 10) for n in (1, 2, 3, 4)
             for st in ("ddp", "zero1", "zero2")]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("ZeRO bytes per step", [*cases, *(measured or [])], fn, close=close)
