"""One-line checkers for the notebooks' exercises.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import math

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


# ---- chapter 01 -----------------------------------------------------------------------------


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


# ---- chapter 02 -----------------------------------------------------------------------------


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


# ---- chapter 03 -----------------------------------------------------------------------------


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


# ---- chapter 04 -----------------------------------------------------------------------------


def check_flat_layout(fn) -> bool:
    """``fn(numels, world_size, align)`` -> ``(offsets, padded_numel)``: each parameter starts
    at a multiple of ``align`` elements, the total is padded to a multiple of ``world_size``
    (``minifsdp.flat_param.flat_layout``, Note [flat layout])."""
    from minifsdp.flat_param import flat_layout

    layouts = [([70, 7, 21, 3], 3, 4), ([70, 7, 21, 3], 1, 4), ([5], 4, 1), ([8, 8], 2, 4),
               ([1, 1, 1], 2, 4), ([288, 32, 18432, 64], 4, 4), ([3, 5, 7], 8, 2), ([0, 4], 2, 4)]
    return check("flat layout", [(args, flat_layout(*args)) for args in layouts], fn)


def check_size_wrap(fn) -> bool:
    """``fn(model, min_num_params)`` -> names of the units that a size-based auto-wrap policy
    picks, children before parents (``minifsdp.wrap.plan_units``, Note [policy contract]): a
    module becomes a unit when the elements of it that no unit below took are at least
    ``min_num_params``; a ``ModuleList``/``ModuleDict`` is never a unit, nor is the root."""
    from minifsdp.models import GPT, GPTConfig, MnistCNN
    from minifsdp.wrap import plan_units, size_based_auto_wrap_policy

    nested = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(30, 30), torch.nn.ReLU(),
                                                     torch.nn.Linear(30, 2)),
                                 torch.nn.Linear(2, 40), torch.nn.Linear(40, 40))
    cases = []
    for model, sizes in [(MnistCNN(), (100, 20_000, 1_000_000, 2_000_000)),
                         (GPT(GPTConfig()), (1_000, 10_000, 20_000)),
                         (nested, (100, 1_000, 1_500, 3_000))]:
        for n in sizes:
            plan = plan_units(model, size_based_auto_wrap_policy(n))
            cases.append(((model, n), [name for name, _ in plan]))
    return check("size-based wrap", cases, fn)


def fsdp1_step_wire_bytes(padded_numels: list[int], n: int, strategy: str) -> float:
    """Bytes one rank sends per fp32 step of ``minifsdp.fsdp1`` (``minifsdp.comm``'s
    accounting). ``padded_numels``: each unit's flat parameter, padded; the *last* is the root."""
    ag = rs = lambda numel: (n - 1) / n * 4 * numel
    if strategy == "no_shard":
        return sum(2 * (n - 1) / n * 4 * p for p in padded_numels)
    forward = sum(ag(p) for p in padded_numels)
    # FULL_SHARD frees every unit but the root after forward, so gathers them again
    backward = sum(ag(p) for p in padded_numels[:-1]) if strategy == "full_shard" else 0.0
    return forward + backward + sum(rs(p) for p in padded_numels)


def check_fsdp1_step_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(padded_numels, n, strategy)`` -> wire bytes one rank sends per step, ``strategy``
    one of ``full_shard``, ``shard_grad_op``, ``no_shard`` (Note [sharding strategies]).
    ``measured``: ``((padded_numels, n, strategy), bytes)`` from real runs."""
    cases = [((units, n, st), fsdp1_step_wire_bytes(units, n, st))
             for units in ([1_199_884], [18_752, 1_179_776, 1_396], [8_448, 8_448, 12_544])
             for n in (1, 2, 4) for st in ("full_shard", "shard_grad_op", "no_shard")]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("FSDP1 bytes per step", [*cases, *(measured or [])], fn, close=close)


# ---- chapter 05 -----------------------------------------------------------------------------

_FSDP2_SHAPES = [  # (shapes, world sizes) the checkers try: uneven rows, fewer rows than ranks
    ([(7, 10), (7,), (3, 7), (3,)], (1, 2, 3, 4)),
    ([(512, 256), (32, 256), (256,), (768, 256), (1024, 256), (256, 1024)], (2, 3, 4, 8)),
    ([(1,), (2, 5), (10, 8)], (3, 4)),
]


def _dim0_rows(d0: int, world_size: int) -> list[int]:
    from minifsdp.fsdp2 import chunk_dim0

    return [c.shape[0] for c in chunk_dim0(torch.empty(d0, 0), world_size)]


def check_dim0_rows(fn) -> bool:
    """``fn(d0, world_size)`` -> rows each rank holds of a ``d0``-row parameter under FSDP2
    (``minifsdp.fsdp2.chunk_dim0``: ``torch.chunk``, then empty shards)."""
    cases = [((d0, n), _dim0_rows(d0, n))
             for d0, n in [(10, 4), (12, 4), (2, 3), (5, 4), (1, 8), (7, 3), (1024, 3), (9, 1)]]
    return check("dim-0 rows", cases, fn)


def fsdp2_rest_bytes(shapes: list[tuple], world_size: int, rank: int) -> int:
    """Bytes one rank holds between FSDP2 steps with fp32 Adam(W): padded shards (4 B per
    element of chunk 0's size), ``exp_avg`` + ``exp_avg_sq`` of its own rows, one 4-byte step
    per parameter."""
    total = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        rows = _dim0_rows(shape[0], world_size)
        total += 4 * rows[0] * rest + 8 * rows[rank] * rest + 4
    return total


def check_fsdp2_rest_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, rank)`` -> model-state bytes of ``rank`` at rest under FSDP2
    with fp32 Adam. ``measured``: ``((shapes, n, rank), bytes)`` from real runs."""
    cases = [((shapes, n, r), fsdp2_rest_bytes(shapes, n, r))
             for shapes, ns in _FSDP2_SHAPES for n in ns for r in range(n)]
    return check("FSDP2 bytes at rest", [*cases, *(measured or [])], fn)


def fsdp2_group_wire_bytes(shapes: list[tuple], world_size: int,
                           reshard_after_forward: bool) -> float:
    """Bytes one rank sends per fp32 step for one FSDP2 group: the all-gather buffer is N padded
    shards; forward all-gather, a second one for backward if resharded, one reduce-scatter."""
    n = world_size
    buffer = 4 * n * sum(_dim0_rows(s[0], n)[0] * math.prod(s[1:]) for s in shapes)
    return (3 if reshard_after_forward else 2) * (n - 1) / n * buffer


def check_fsdp2_group_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, reshard_after_forward)`` -> wire bytes one rank sends per step
    for one group. ``measured``: ``((shapes, n, reshard), bytes)`` from real runs."""
    cases = [((shapes, n, raf), fsdp2_group_wire_bytes(shapes, n, raf))
             for shapes, ns in _FSDP2_SHAPES for n in ns for raf in (True, False)]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("FSDP2 group bytes per step", [*cases, *(measured or [])], fn, close=close)


# ---- chapter 07 -----------------------------------------------------------------------------


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
    return element_size * n * sum(_dim0_rows(s[0], n)[0] * math.prod(s[1:]) for s in shapes)


def check_unsharded_group_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, element_size)`` -> bytes of a group's unsharded parameters.
    ``measured``: ``((shapes, n, element_size), bytes)`` from real runs' label timelines."""
    cases = [((shapes, n, e), unsharded_group_bytes(shapes, n, e))
             for shapes, ns in _FSDP2_SHAPES for n in ns for e in (4, 2)]
    return check("unsharded group bytes", [*cases, *(measured or [])], fn)


def mp_group_wire_bytes(shapes: list[tuple], world_size: int, param_bytes: int,
                        reduce_bytes: int, reshard_after_forward: bool) -> float:
    """Bytes one rank sends per step for one FSDP2 group under a mixed-precision policy:
    all-gathers move ``param_bytes`` per element, the reduce-scatter ``reduce_bytes``."""
    n = world_size
    elems = n * sum(_dim0_rows(s[0], n)[0] * math.prod(s[1:]) for s in shapes)
    gathers = 2 if reshard_after_forward else 1
    return (n - 1) / n * elems * (gathers * param_bytes + reduce_bytes)


def check_mp_group_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, param_bytes, reduce_bytes, reshard_after_forward)`` -> wire
    bytes per step for one group. ``measured``: ``(args, bytes)`` from real runs."""
    cases = [((shapes, n, p, r, raf), mp_group_wire_bytes(shapes, n, p, r, raf))
             for shapes, ns in _FSDP2_SHAPES for n in ns for p, r in ((4, 4), (2, 4), (2, 2))
             for raf in (True, False)]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("mixed-precision group bytes", [*cases, *(measured or [])], fn, close=close)


# ---- chapter 06 -----------------------------------------------------------------------------


def backward_collectives(post_forward_order: list[str], prefetch: bool) -> list[tuple[str, str]]:
    """The collectives one backward issues, in order, for groups whose forwards ended in
    ``post_forward_order`` (the root last; it keeps its parameters, so it is not gathered):
    ``[("all_gather", "blocks.3"), ("reduce_scatter", "blocks.3"), ...]``. With implicit
    backward prefetch each group's pre-backward issues the previous group's all-gather right
    after its own (the root's issues the last unit's); Note [which group is next]."""
    *units, root = post_forward_order
    rev, events = units[::-1], []
    if prefetch and rev:
        events.append(("all_gather", rev[0]))
    for k, g in enumerate(rev):
        if not prefetch:
            events.append(("all_gather", g))
        elif k + 1 < len(rev):
            events.append(("all_gather", rev[k + 1]))
        events.append(("reduce_scatter", g))
    return events + [("reduce_scatter", root)]


def check_backward_collectives(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(post_forward_order, prefetch)`` -> ``[(op, group), ...]`` issued in one backward.
    ``measured``: ``((order, prefetch), events)`` read from real runs' comm logs."""
    orders = [["blocks.0", "blocks.1", "blocks.2", "blocks.3", "root"], ["a", "root"],
              ["conv", "fc1", "fc2", "root"], ["root"]]
    cases = [((o, p), backward_collectives(o, p)) for o in orders for p in (False, True)]
    return check("backward collectives", [*cases, *(measured or [])], fn)


def forward_events(forward_order: list[str], prefetch: bool) -> list[tuple[str, str]]:
    """Issue / wait / compute events of one forward over groups in ``forward_order`` (the root
    first; its forward runs around everyone else's, so its own compute starts right after
    its pre-forward). With implicit forward prefetch a pre-forward issues the next group's
    all-gather right after waiting for its own."""
    events = []
    for k, g in enumerate(forward_order):
        if not (prefetch and k > 0):
            events.append(("issue", g))
        events.append(("wait", g))
        if prefetch and k + 1 < len(forward_order):
            events.append(("issue", forward_order[k + 1]))
        events.append(("compute", g))
    return events


def check_forward_events(fn) -> bool:
    """``fn(forward_order, prefetch)`` -> ``[("issue"|"wait"|"compute", group), ...]``."""
    orders = [["root", "blocks.0", "blocks.1", "blocks.2"], ["root", "a"], ["root"],
              ["root", "conv", "fc1", "fc2"]]
    return check("forward events", [((o, p), forward_events(o, p)) for o in orders
                                    for p in (False, True)], fn)


def exposed_ms(compute_ms: list[float], comm_ms: list[float], prefetch: bool) -> float:
    """Milliseconds a forward waits for all-gathers: group i needs ``comm_ms[i]`` on the wire
    and computes ``compute_ms[i]``. Without prefetch every all-gather is waited for in full;
    with one-ahead prefetch group i+1's transfer overlaps group i's compute (the first cannot
    hide), and one transfer at a time is on the wire."""
    if not prefetch:
        return float(sum(comm_ms))
    # group i+1's all-gather is issued when group i starts computing: only what outlasts
    # that compute is waited for
    return comm_ms[0] + sum(max(0.0, m - c) for c, m in zip(compute_ms, comm_ms[1:]))


def check_exposed_ms(fn) -> bool:
    """``fn(compute_ms, comm_ms, prefetch)`` -> exposed all-gather milliseconds of a forward."""
    cases = [((c, m, p), exposed_ms(c, m, p))
             for c, m in [([5, 5, 5, 5], [2, 2, 2, 2]), ([1, 1, 1], [3, 3, 3]),
                          ([4, 1, 4], [1, 5, 2]), ([10], [3]), ([2, 8, 2, 8], [6, 6, 6, 6]),
                          ([8, 1, 8], [1, 1, 9])]
             for p in (False, True)]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("exposed all-gather time", cases, fn, close=close)


# ---- chapter 08 -----------------------------------------------------------------------------


def reshard_reads(d0: int, saved_world: int, new_world: int,
                  new_rank: int) -> list[tuple[int, int, int]]:
    """``[(saved_rank, start_row, stop_row), ...]``: the global rows that ``new_rank`` of a
    ``new_world``-rank run reads from each saving rank's file, for a parameter of ``d0`` rows
    sharded with ``chunk_dim0`` (Note [resharding] in ``minifsdp/checkpoint.py``)."""
    def bounds(n):
        rows, out, lo = _dim0_rows(d0, n), [], 0
        for r in rows:
            out.append((lo, lo + r))
            lo += r
        return out

    lo, hi = bounds(new_world)[new_rank]
    reads = []
    for r, (a, b) in enumerate(bounds(saved_world)):
        if min(hi, b) > max(lo, a):
            reads.append((r, max(lo, a), min(hi, b)))
    return reads


def check_reshard_reads(fn) -> bool:
    """``fn(d0, saved_world, new_world, new_rank)`` -> ``[(saved_rank, start, stop), ...]``."""
    cases = [((d0, s, n, r), reshard_reads(d0, s, n, r))
             for d0, s, n in [(10, 4, 3), (10, 4, 2), (10, 2, 4), (2, 4, 3), (768, 2, 3),
                              (7, 3, 1), (5, 1, 4)] for r in range(n)]
    return check("reshard reads", cases, fn)


def shard_payload_bytes(shapes: list[tuple], world_size: int, rank: int) -> int:
    """Tensor bytes of one rank's rows in a sharded FSDP2 checkpoint with fp32 Adam(W): the
    parameter, ``exp_avg`` and ``exp_avg_sq`` rows it owns (no padding: DCP stores each
    DTensor's local rows). Replicated values (Adam's ``step``) and DCP's metadata not counted."""
    return sum(12 * _dim0_rows(s[0], world_size)[rank] * math.prod(s[1:]) for s in shapes)


def check_shard_payload_bytes(fn) -> bool:
    """``fn(shapes, world_size, rank)`` -> bytes of the rank's rows (params + Adam state)."""
    cases = [((shapes, n, r), shard_payload_bytes(shapes, n, r))
             for shapes, ns in _FSDP2_SHAPES for n in ns for r in range(n)]
    return check("checkpoint bytes per rank", cases, fn)


def after_saves(events: list[str], keep: int = 2) -> tuple[str | None, list[str]]:
    """What a checkpoint directory holds after ``events`` -- ``"save 3"`` (a completed save of
    step 3) or ``"crash 9"`` (a save of step 9 killed before its rename) -- with ``keep``:
    ``(latest, sorted directory names)`` (Note [atomic save]). A crashed save leaves
    ``step_000009.tmp``; the next completed save deletes every ``.tmp``."""
    latest, dirs = None, set()
    for ev in events:
        kind, step = ev.split()
        name = f"step_{int(step):06d}"
        if kind == "crash":
            dirs.add(name + ".tmp")
            continue
        dirs = {d for d in dirs if not d.endswith(".tmp")} | {name}
        latest = name
        done = sorted(d for d in dirs if not d.endswith(".tmp"))
        dirs -= set(done[:-keep])
    return latest, sorted(dirs)


def check_after_saves(fn) -> bool:
    """``fn(events, keep)`` -> ``(latest, sorted directory names)``."""
    runs = [["save 3", "save 6", "save 9"], ["save 3", "crash 6"], ["save 3", "crash 6", "save 6"],
            ["crash 3"], ["save 2", "save 4", "crash 6", "crash 8"], ["save 5", "save 10"]]
    cases = [((ev, k), after_saves(ev, k)) for ev in runs for k in (1, 2, 3)]
    return check("checkpoint directory after saves", cases, fn)


# ---- chapter 09 -----------------------------------------------------------------------------


def fits(psi: float, n: int, strategy: str, gpu_bytes: float) -> bool:
    """Do mixed-precision Adam's model states (the ZeRO table, 2 + 2 + 12 bytes per parameter)
    fit on each of ``n`` GPUs (``minifsdp.analytic.model_state_bytes``)?"""
    from minifsdp.analytic import model_state_bytes

    return model_state_bytes(psi, n, strategy)["total"] <= gpu_bytes


def check_fits(fn) -> bool:
    """``fn(psi, n, strategy, gpu_bytes)`` -> bool, strategy in ddp / zero1 / zero2 / fsdp."""
    cases = [((psi, n, s, g), fits(psi, n, s, g))
             for psi in (7.5e9, 70e9, 405e9) for n in (1, 8, 64, 1024)
             for s in ("ddp", "zero1", "zero2", "fsdp") for g in (40e9, 80e9)]
    return check("fits", cases, fn)


def hsdp_wire_bytes(psi: float, replicate: int, shard: int) -> tuple[float, float]:
    """``(intra_node, inter_node)`` bytes one rank sends per fp32 step for one unit of
    ``psi`` parameters under HSDP: all-gather (x2) and reduce-scatter among ``shard`` ranks, an
    all-reduce of the 1/shard slice among ``replicate`` ranks."""
    full = 4 * psi
    return (3 * (shard - 1) / shard * full, 2 * (replicate - 1) / replicate * full / shard)


def check_hsdp_wire_bytes(fn) -> bool:
    """``fn(psi, replicate, shard)`` -> ``(intra_node, inter_node)`` wire bytes per step."""
    cases = [((psi, r, s), hsdp_wire_bytes(psi, r, s))
             for psi in (1e6, 3_429_888) for r, s in ((1, 8), (2, 2), (8, 1), (4, 8), (16, 8))]
    close = lambda a, b: all(abs(x - y) <= 1e-9 * max(1.0, y) for x, y in zip(a, b))
    return check("HSDP bytes per step", cases, fn, close=close)


def min_gpus(psi: float, gpu_bytes: float) -> int | None:
    """The smallest power of two N <= 2**20 with FSDP's 16 psi / N <= ``gpu_bytes``."""
    n = 1
    while n <= 2**20:
        if 16 * psi / n <= gpu_bytes:
            return n
        n *= 2
    return None


def check_min_gpus(fn) -> bool:
    """``fn(psi, gpu_bytes)`` -> the fewest GPUs (a power of two) for FSDP's model states."""
    cases = [((psi, g), min_gpus(psi, g)) for psi in (1e6, 5e9, 10e9, 7e9, 70e9, 405e9, 1e15)
             for g in (16e9, 80e9, 192e9)]
    return check("fewest GPUs", cases, fn)
