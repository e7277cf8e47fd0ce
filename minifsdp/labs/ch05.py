"""Chapter 05 (FSDP2's per-parameter sharding): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import math

import torch

from minifsdp.notebook import check

FSDP2_SHAPES = [  # (shapes, world sizes) the checkers try: uneven rows, fewer rows than ranks
    ([(7, 10), (7,), (3, 7), (3,)], (1, 2, 3, 4)),
    ([(512, 256), (32, 256), (256,), (768, 256), (1024, 256), (256, 1024)], (2, 3, 4, 8)),
    ([(1,), (2, 5), (10, 8)], (3, 4)),
]


def dim0_rows(d0: int, world_size: int) -> list[int]:
    from minifsdp.fsdp2 import chunk_dim0

    return [c.shape[0] for c in chunk_dim0(torch.empty(d0, 0), world_size)]


def check_dim0_rows(fn) -> bool:
    """``fn(d0, world_size)`` -> rows each rank holds of a ``d0``-row parameter under FSDP2
    (``minifsdp.fsdp2.chunk_dim0``: ``torch.chunk``, then empty shards)."""
    cases = [((d0, n), dim0_rows(d0, n))
             for d0, n in [(10, 4), (12, 4), (2, 3), (5, 4), (1, 8), (7, 3), (1024, 3), (9, 1)]]
    return check("dim-0 rows", cases, fn)


def fsdp2_rest_bytes(shapes: list[tuple], world_size: int, rank: int) -> int:
    """Bytes one rank holds between FSDP2 steps with fp32 Adam(W): padded shards (4 B per
    element of chunk 0's size), ``exp_avg`` + ``exp_avg_sq`` of its own rows, one 4-byte step
    per parameter."""
    total = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        rows = dim0_rows(shape[0], world_size)
        total += 4 * rows[0] * rest + 8 * rows[rank] * rest + 4
    return total


def check_fsdp2_rest_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, rank)`` -> model-state bytes of ``rank`` at rest under FSDP2
    with fp32 Adam. ``measured``: ``((shapes, n, rank), bytes)`` from real runs."""
    cases = [((shapes, n, r), fsdp2_rest_bytes(shapes, n, r))
             for shapes, ns in FSDP2_SHAPES for n in ns for r in range(n)]
    return check("FSDP2 bytes at rest", [*cases, *(measured or [])], fn)


def fsdp2_group_wire_bytes(shapes: list[tuple], world_size: int,
                           reshard_after_forward: bool) -> float:
    """Bytes one rank sends per fp32 step for one FSDP2 group: the all-gather buffer is N padded
    shards; forward all-gather, a second one for backward if resharded, one reduce-scatter."""
    n = world_size
    buffer = 4 * n * sum(dim0_rows(s[0], n)[0] * math.prod(s[1:]) for s in shapes)
    return (3 if reshard_after_forward else 2) * (n - 1) / n * buffer


def check_fsdp2_group_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, reshard_after_forward)`` -> wire bytes one rank sends per step
    for one group. ``measured``: ``((shapes, n, reshard), bytes)`` from real runs."""
    cases = [((shapes, n, raf), fsdp2_group_wire_bytes(shapes, n, raf))
             for shapes, ns in FSDP2_SHAPES for n in ns for raf in (True, False)]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("FSDP2 group bytes per step", [*cases, *(measured or [])], fn, close=close)
