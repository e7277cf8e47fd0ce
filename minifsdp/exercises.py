"""One-line checkers for the notebooks' exercises.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.notebook import check
from minifsdp.ring import ring_wire_bytes

# ---- chapter 00 -----------------------------------------------------------------------------


def check_ring_bytes(fn) -> bool:
    """``fn(numel, element_size, world_size)`` -> bytes one rank sends in a ring all-reduce,
    padding included (see Note [ring bytes])."""
    cases = [((n, e, w), ring_wire_bytes(n, e, w))
             for n, e, w in [(1000, 4, 4), (1000, 4, 2), (10_001, 4, 4), (7, 2, 3), (1, 4, 8),
                             (1_000_000, 2, 1)]]
    return check("ring bytes", cases, fn)


def check_reduce_scatter(fn, measured: list[dict] | None = None) -> bool:
    """``fn(inputs)``: ``inputs[r]`` is rank r's list; return every rank's reduce_scatter
    output (sum). ``measured``: a collectives demo run's ``ranks`` to check against too."""
    g = torch.Generator().manual_seed(0)
    cases = []
    for n, k in [(2, 1), (3, 2), (4, 3)]:
        inputs = torch.randint(0, 50, (n, n * k), generator=g)
        cases.append(((inputs.tolist(),), list(inputs.sum(0).view(n, k).tolist())))
    if measured:
        ins = [r["collectives"]["reduce_scatter"]["input"] for r in measured]
        cases.append(((ins,), [r["collectives"]["reduce_scatter"]["output"] for r in measured]))
    return check("reduce_scatter", cases, fn)


def ring_schedule(rank: int, step: int, world_size: int, phase: str) -> int:
    """Chunk index that ``rank`` sends at ``step`` of ``phase`` in ``minifsdp.ring``."""
    if phase == "reduce_scatter":
        return (rank - 1 - step) % world_size
    return (rank - step) % world_size


def check_ring_schedule(fn) -> bool:
    """``fn(rank, step, world_size, phase)`` -> chunk index sent (Note [ring all-reduce])."""
    cases = [((r, s, n, ph), ring_schedule(r, s, n, ph))
             for n in (2, 3, 5) for ph in ("reduce_scatter", "all_gather")
             for r in range(n) for s in range(n - 1)]
    return check("ring schedule", cases, fn)
