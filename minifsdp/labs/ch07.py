"""Chapter 07 (mixed precision): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import math

import torch

from minifsdp.labs.ch05 import FSDP2_SHAPES, dim0_rows
from minifsdp.notebook import check


def check_bf16_round(fn) -> bool:
    """``fn(x)`` -> the bfloat16 value nearest to the float ``x`` (ties to even), as a Python
    float: what ``torch.tensor(x).to(torch.bfloat16)`` keeps of an fp32 number."""
    xs = [1.0, 1.00390625, 1.005859375, 1.01171875, 3.14159265, -2.71828, 1e-3, 65504.0, 0.1,
          1 + 2**-8, 1 + 3 * 2**-8, 255.5, 256.5, -0.0078125 * 3]
    cases = [((x,), torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).item()) for x in xs]
    return check("bf16 rounding", cases, fn)


def unsharded_group_bytes(shapes: list[tuple], world_size: int, element_size: int) -> int:
    """Bytes of one FSDP2 group's unsharded parameters: N padded shards of each parameter in
    the all-gather dtype (``param_dtype`` under mixed precision)."""
    n = world_size
    return element_size * n * sum(dim0_rows(s[0], n)[0] * math.prod(s[1:]) for s in shapes)


def check_unsharded_group_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, element_size)`` -> bytes of a group's unsharded parameters.
    ``measured``: ``((shapes, n, element_size), bytes)`` from real runs' label timelines."""
    cases = [((shapes, n, e), unsharded_group_bytes(shapes, n, e))
             for shapes, ns in FSDP2_SHAPES for n in ns for e in (4, 2)]
    return check("unsharded group bytes", [*cases, *(measured or [])], fn)


def mp_group_wire_bytes(shapes: list[tuple], world_size: int, param_bytes: int,
                        reduce_bytes: int, reshard_after_forward: bool) -> float:
    """Bytes one rank sends per step for one FSDP2 group under a mixed-precision policy:
    all-gathers move ``param_bytes`` per element, the reduce-scatter ``reduce_bytes``."""
    n = world_size
    elems = n * sum(dim0_rows(s[0], n)[0] * math.prod(s[1:]) for s in shapes)
    gathers = 2 if reshard_after_forward else 1
    return (n - 1) / n * elems * (gathers * param_bytes + reduce_bytes)


def check_mp_group_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, param_bytes, reduce_bytes, reshard_after_forward)`` -> wire
    bytes per step for one group. ``measured``: ``(args, bytes)`` from real runs."""
    cases = [((shapes, n, p, r, raf), mp_group_wire_bytes(shapes, n, p, r, raf))
             for shapes, ns in FSDP2_SHAPES for n in ns for p, r in ((4, 4), (2, 4), (2, 2))
             for raf in (True, False)]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("mixed-precision group bytes", [*cases, *(measured or [])], fn, close=close)
