"""Chapter 02 (DDP): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

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
