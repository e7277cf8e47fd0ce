"""Chapter 10 (SimpleFSDP and its graph passes): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own rules (and, where the notebook passes them, from a real run's graphs), prints one
line (✓ or ✗ with the first failing case) and returns True/False.
"""

from __future__ import annotations

import math

from minifsdp.notebook import check

GPT_ROOT_FRONT, GPT_ROOT_BACK, GPT_BLOCK = 2, 3, 12  # minifsdp.models.GPT's parameters, untied


def forward_all_gathers(n_blocks: int, bucketed: bool) -> int:
    """All-gathers in the forward graph of a SimpleFSDP ``GPT`` with ``n_blocks`` blocks: one
    per parameter read; bucketed, one per run of one block's (or the root's) consecutive reads:
    the embeddings, each block, then ``ln_f`` + ``head``."""
    if bucketed:
        return n_blocks + 2
    return GPT_ROOT_FRONT + GPT_BLOCK * n_blocks + GPT_ROOT_BACK


def check_forward_all_gathers(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(n_blocks, bucketed)`` -> the forward graph's all-gathers. ``measured``:
    ``((n_blocks, bucketed), count)`` from real graphs."""
    cases = [((b, k), forward_all_gathers(b, k)) for b in (1, 2, 4, 12, 32) for k in (False, True)]
    return check("forward all-gathers", [*cases, *(measured or [])], fn)


def bucket_numel(shapes: list[tuple], world_size: int) -> int:
    """Elements of one bucketed all-gather's output: each parameter's shard is padded to chunk
    0's rows (``ceil(d0 / N)``), the shards are concatenated, and N ranks' buckets gathered."""
    n = world_size
    return n * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)


def check_bucket_numel(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size)`` -> elements of the bucketed all-gather of parameters of
    ``shapes``. ``measured``: ``((shapes, n), numel)`` read from a real graph."""
    block = [(32,), (32,), (96, 32), (96,), (32, 32), (32,), (32,), (32,), (128, 32), (128,),
             (32, 128), (32,)]
    cases = [((shapes, n), bucket_numel(shapes, n))
             for shapes in (block, [(64, 32), (16, 32)], [(7, 10), (7,), (3, 7)], [(1,), (5, 2)])
             for n in (1, 2, 3, 4, 8)]
    return check("bucket elements", [*cases, *(measured or [])], fn)
