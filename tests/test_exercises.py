"""Every exercise checker accepts a correct solution, rejects plausible wrong ones, and reports
a stub that raises ``NotImplementedError`` as not done yet instead of crashing.

The correct solutions below are written from the formulas in the Notes (and, for the Adam
state, by measuring a real optimizer), never by calling the checkers' own references.
"""

import importlib
import inspect
import math
import re
import types

import pytest
import torch
import torch.nn as nn

# One module per chapter (minifsdp/labs/chNN.py); seen here as one namespace of checkers.
CHAPTERS = [importlib.import_module(f"minifsdp.labs.ch{c:02d}") for c in range(11)]
exercises = types.SimpleNamespace(**{n: f for m in CHAPTERS for n, f in vars(m).items()
                                     if n.startswith("check_")})

# ---- chapter 00 ----------------------------------------------------------------------------


def ring_bytes(numel, element_size, world_size):
    """Note [ring bytes]: 2(N-1) steps, each sending one chunk of ceil(numel/N) elements."""
    return 2 * (world_size - 1) * math.ceil(numel / world_size) * element_size


def ring_bytes_unpadded(numel, element_size, world_size):
    return 2 * (world_size - 1) / world_size * numel * element_size  # 2(N-1)/N * S, no padding


def ring_bytes_2n_steps(numel, element_size, world_size):
    return 2 * world_size * math.ceil(numel / world_size) * element_size  # N steps per phase


def ring_bytes_padding_times_n(numel, element_size, world_size):
    """The formula Note [ring bytes] once printed: padding p counted 2(N-1) times, not 2(N-1)/N."""
    n = world_size
    p = n * math.ceil(numel / n) - numel
    return (2 * (n - 1) / n * numel + 2 * (n - 1) * p) * element_size


def reduce_scatter(inputs):
    """Rank r gets chunk r of the elementwise sum of every rank's list."""
    n = len(inputs)
    k = len(inputs[0]) // n
    total = [sum(column) for column in zip(*inputs)]
    return [total[r * k:(r + 1) * k] for r in range(n)]


def reduce_scatter_full_sum(inputs):
    total = [sum(column) for column in zip(*inputs)]
    return [total for _ in inputs]  # an all_reduce: nothing is scattered


def reduce_scatter_own_chunk(inputs):
    n = len(inputs)
    k = len(inputs[0]) // n
    return [x[r * k:(r + 1) * k] for r, x in enumerate(inputs)]  # scattered, never reduced


# The right answer is the package's ring itself: ch00 reads the schedule off
# minifsdp.ring (one copy of the answer key); the test below ties it to the Note's table.
chunk_sent = CHAPTERS[0].ring_schedule


def chunk_sent_off_by_one(rank, step, world_size, phase):
    return (rank - step) % world_size  # the all-gather schedule in both phases


def chunk_sent_leftwards(rank, step, world_size, phase):
    first = 1 if phase == "reduce_scatter" else 0
    return (rank + first + step) % world_size  # the ring run the wrong way round


def test_chunk_sent_reproduces_the_table_in_the_ring_note():
    # minifsdp/ring.py, Note [ring all-reduce], N = 3: row = step, column = rank
    table = {"reduce_scatter": [[2, 0, 1], [1, 2, 0]], "all_gather": [[0, 1, 2], [2, 0, 1]]}
    for phase, rows in table.items():
        assert [[chunk_sent(r, s, 3, phase) for r in range(3)] for s in range(2)] == rows


def collectives_run(n, corrupt=False):
    """A ``--demo collectives`` run's ``ranks`` (only what the checker reads): rank r holds
    [10r, 10r + 1, ..., 10r + 2N - 1]; reduce_scatter gives rank r elements 2r and 2r + 1 of
    the sum, sum_r (j + 10r) = N j + 5 N (N - 1)."""
    ranks = []
    for r in range(n):
        out = [n * j + 5 * n * (n - 1) for j in (2 * r, 2 * r + 1)]
        if corrupt and r == 1:
            out = out[::-1]
        ranks.append({"collectives": {"reduce_scatter": {
            "input": [10 * r + j for j in range(2 * n)], "output": out}}})
    return ranks


# ---- chapter 01 ----------------------------------------------------------------------------


def model_states(psi, n, stage):
    """ZeRO paper, section 3.1: fp16 weights (2 psi) and gradients (2 psi), K = 12 psi of fp32
    master weights, momentum and variance; stage 1 shards K, stage 2 also the gradients,
    stage 3 also the weights."""
    p, g, k = 2 * psi, 2 * psi, 12 * psi
    return {"ddp": p + g + k, "zero1": p + g + k / n, "zero2": p + (g + k) / n,
            "zero3": (p + g + k) / n}[stage]


def model_states_zero1_shards_grads(psi, n, stage):
    return model_states(psi, n, "zero2" if stage == "zero1" else stage)


def model_states_no_master_copy(psi, n, stage):
    p, g, k = 2 * psi, 2 * psi, 8 * psi  # K = 8: momentum and variance only
    return {"ddp": p + g + k, "zero1": p + g + k / n, "zero2": p + (g + k) / n,
            "zero3": (p + g + k) / n}[stage]


def test_model_states_reproduces_the_zero_paper():
    # Figure 1 of the ZeRO paper: Psi = 7.5B, N = 64 -> 120, 31.4, 16.6, 1.9 GB per device
    gb = {s: model_states(7.5e9, 64, s) / 1e9 for s in ["ddp", "zero1", "zero2", "zero3"]}
    assert {s: round(v, 1) for s, v in gb.items()} == {
        "ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


def adam_state_bytes(model):
    """Measured: take one real Adam step and add up every tensor in its state."""
    opt = torch.optim.Adam(model.parameters())
    sum(p.sum() for p in model.parameters()).backward()
    opt.step()
    return sum(t.numel() * t.element_size() for state in opt.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def adam_state_bytes_no_step(model):
    return sum(8 * p.numel() for p in model.parameters())  # exp_avg + exp_avg_sq only


def adam_state_bytes_k12(model):
    return sum(12 * p.numel() for p in model.parameters())  # mixed precision's K, not fp32's


def _peak(batch):
    from minifsdp.analytic import predict_step_peak

    return predict_step_peak("cnn", batch, "adam", dropout=0.0)


def largest_batch(budget_bytes):
    """Every moment of the step costs a + s * batch bytes: solve each for the largest batch,
    take the smallest, then make sure it fits and one more sample does not."""
    m0, m1 = _peak(0)["moments"], _peak(1)["moments"]
    batch = min((budget_bytes - m0[k]) // (m1[k] - m0[k]) for k in m0 if m1[k] > m0[k])
    while _peak(batch)["peak"] > budget_bytes:
        batch -= 1
    while _peak(batch + 1)["peak"] <= budget_bytes:
        batch += 1
    return batch


def largest_batch_end_of_forward(budget_bytes):
    """The textbook guess: the peak is at the end of the forward pass."""
    batch = 0
    while _peak(batch + 1)["moments"]["end of forward"] <= budget_bytes:
        batch += 1
    return batch


def largest_batch_plus_one(budget_bytes):
    return largest_batch(budget_bytes) + 1  # the first batch that does *not* fit


# ---- chapter 02: buckets -------------------------------------------------------------------


def assign_buckets(params, cap_bytes):
    buckets, current, size, key = [], [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        if current and (p.dtype, p.device) != key:
            buckets.append(current)
            current, size = [], 0
        key = (p.dtype, p.device)
        current.append(i)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def assign_buckets_forward_order(params, cap_bytes):
    """Fills buckets from the first parameter: the last layers' gradients would wait."""
    return [list(reversed(b)) for b in reversed(assign_buckets(params[::-1], cap_bytes))]


def assign_buckets_cap_exclusive(params, cap_bytes):
    """Never lets a bucket reach the cap: closes it before the parameter that would."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if current and size + nbytes >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + ([current] if current else [])


def ddp_step_comm(numels, world_size, cap_bytes):
    buckets = assign_buckets([torch.empty(n) for n in numels], cap_bytes)
    return len(buckets), 2 * (world_size - 1) / world_size * 4 * sum(numels)


def ddp_step_comm_per_tensor(numels, world_size, cap_bytes):
    """Counts one all-reduce per parameter, as NaiveDDP does."""
    return len(numels), 2 * (world_size - 1) / world_size * 4 * sum(numels)


def ddp_step_comm_gather_bytes(numels, world_size, cap_bytes):
    """Counts only the reduce-scatter half of the ring."""
    n, _ = ddp_step_comm(numels, world_size, cap_bytes)
    return n, (world_size - 1) / world_size * 4 * sum(numels)


def stalled_buckets(buckets, used):
    stalled = False
    out = []
    for k, b in enumerate(buckets):
        stalled = stalled or not set(b) <= used
        if stalled:
            out.append(k)
    return out


def stalled_buckets_only_incomplete(buckets, used):
    """Forgets that buckets launch in order."""
    return [k for k, b in enumerate(buckets) if not set(b) <= used]


def stalled_buckets_from_the_end(buckets, used):
    """Thinks the last incomplete bucket blocks the ones before it."""
    bad = [k for k, b in enumerate(buckets) if not set(b) <= used]
    return list(range(0, bad[-1] + 1)) if bad else []


# ---- chapter 03: ZeRO ----------------------------------------------------------------------


def flat_partition(numels, rank, world_size):
    shard = -(-sum(numels) // world_size)
    lo, hi = rank * shard, (rank + 1) * shard
    out, offset = [], 0
    for i, n in enumerate(numels):
        start, stop = max(lo, offset), min(hi, offset + n)
        if start < stop:
            out.append((i, start - offset, stop - offset))
        offset += n
    return out


def flat_partition_floor(numels, rank, world_size):
    """Rounds the shard size down: the last elements belong to nobody."""
    shard = sum(numels) // world_size
    out, offset = [], 0
    for i, n in enumerate(numels):
        start, stop = max(rank * shard, offset), min((rank + 1) * shard, offset + n)
        if start < stop:
            out.append((i, start - offset, stop - offset))
        offset += n
    return out


def flat_partition_per_tensor(numels, rank, world_size):
    """Splits every parameter N ways instead of the flat buffer."""
    out = []
    for i, n in enumerate(numels):
        k = -(-n // world_size)
        start, stop = min(rank * k, n), min((rank + 1) * k, n)
        if start < stop:
            out.append((i, start, stop))
    return out


def zero_model_state_bytes(psi, n, stage):
    shard = math.ceil(psi / n)
    return {"params": 4 * n * shard, "grads": 4 * (n * shard if stage == "zero1" else shard),
            "optimizer": 8 * shard + 4}


def zero_model_state_bytes_unpadded(psi, n, stage):
    """The paper's formulas: right only when N divides psi."""
    return {"params": 4 * psi, "grads": 4 * psi if stage == "zero1" else 4 * psi // n,
            "optimizer": 8 * psi // n + 4}


def zero_model_state_bytes_no_step(psi, n, stage):
    """Forgets Adam's 4-byte step counter."""
    out = zero_model_state_bytes(psi, n, stage)
    return {**out, "optimizer": out["optimizer"] - 4}


def zero_step_wire_bytes(psi, n, stage):
    if stage == "ddp":
        return 2 * (n - 1) / n * 4 * psi
    flat = 4 * n * math.ceil(psi / n)
    reduce = 2 * (n - 1) / n * flat if stage == "zero1" else (n - 1) / n * flat
    return reduce + (n - 1) / n * flat


def zero_step_wire_bytes_no_gather(psi, n, stage):
    """Forgets the all-gather of the updated parameters."""
    flat = 4 * n * math.ceil(psi / n) if stage != "ddp" else 4 * psi
    return (1 if stage == "zero2" else 2) * (n - 1) / n * flat


def zero_step_wire_bytes_unpadded(psi, n, stage):
    """Ignores the padding of the flat buffer."""
    return {"ddp": 2, "zero1": 3, "zero2": 2}[stage] * (n - 1) / n * 4 * psi


# ---- chapter 04: FSDP1 ---------------------------------------------------------------------


def flat_layout(numels, world_size, align):
    offsets, total = [], 0
    for n in numels:
        total = math.ceil(total / align) * align
        offsets.append(total)
        total += n
    return offsets, math.ceil(total / world_size) * world_size


def flat_layout_unaligned(numels, world_size, align):
    """Packs parameters tightly: ZeRO's layout, not FSDP1's."""
    return flat_layout(numels, world_size, 1)


def flat_layout_pads_each(numels, world_size, align):
    """Pads every parameter to a multiple of world_size instead of the total."""
    offsets, total = [], 0
    for n in numels:
        total = math.ceil(total / align) * align
        offsets.append(total)
        total += math.ceil(n / world_size) * world_size
    return offsets, math.ceil(total / world_size) * world_size


def size_wrap(model, min_num_params):
    units = []

    def visit(name, m):  # returns the elements of m that a unit took
        taken = sum(visit(f"{name}.{c}" if name else c, child)
                    for c, child in m.named_children())
        left = sum(p.numel() for p in m.parameters()) - taken
        if name and left >= min_num_params and not isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            units.append(name)
            return taken + left
        return taken

    visit("", model)
    return units


def size_wrap_counts_all(model, min_num_params):
    """Compares the module's *total* size, ignoring what its children's units took."""
    return [name for name, m in model.named_modules()
            if name and sum(p.numel() for p in m.parameters()) >= min_num_params
            and not isinstance(m, (nn.ModuleList, nn.ModuleDict))][::-1]


def size_wrap_leaves_only(model, min_num_params):
    """Only modules without children can be units."""
    return [name for name, m in model.named_modules()
            if name and not list(m.children())
            and sum(p.numel() for p in m.parameters()) >= min_num_params]


def fsdp1_step_wire_bytes(padded_numels, n, strategy):
    share = (n - 1) / n * 4
    if strategy == "no_shard":
        return 2 * share * sum(padded_numels)
    gathers = 2 * sum(padded_numels) - padded_numels[-1] if strategy == "full_shard" else \
        sum(padded_numels)
    return share * (gathers + sum(padded_numels))


def fsdp1_step_wire_bytes_root_regathered(padded_numels, n, strategy):
    """Forgets that the root keeps its parameters between forward and backward."""
    share = (n - 1) / n * 4
    if strategy == "no_shard":
        return 2 * share * sum(padded_numels)
    k = 3 if strategy == "full_shard" else 2
    return k * share * sum(padded_numels)


def fsdp1_step_wire_bytes_regathers_for_backward(padded_numels, n, strategy):
    """Thinks SHARD_GRAD_OP also gathers again before backward. (Treating NO_SHARD as
    SHARD_GRAD_OP would be right: an all-reduce is a reduce-scatter plus an all-gather.)"""
    return fsdp1_step_wire_bytes(padded_numels, n,
                                 "full_shard" if strategy == "shard_grad_op" else strategy)


def dim0_rows(d0, world_size):
    per = -(-d0 // world_size)
    return [max(0, min(per, d0 - r * per)) for r in range(world_size)]


def dim0_rows_floor(d0, world_size):
    """Splits as evenly as possible (np.array_split), which is not torch.chunk's rule."""
    return [d0 // world_size + (r < d0 % world_size) for r in range(world_size)]


def dim0_rows_no_empty(d0, world_size):
    """Returns only torch.chunk's chunks, forgetting the empty shards."""
    per = -(-d0 // world_size)
    return [min(per, d0 - r * per) for r in range(world_size) if d0 - r * per > 0]


def fsdp2_rest_bytes(shapes, world_size, rank):
    total = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        rows = dim0_rows(shape[0], world_size)
        total += 4 * rows[0] * rest + 8 * rows[rank] * rest + 4
    return total


def fsdp2_rest_bytes_unpadded(shapes, world_size, rank):
    """Counts the parameter's own rows, not the padded shard behind them."""
    return sum(12 * dim0_rows(s[0], world_size)[rank] * math.prod(s[1:]) + 4 for s in shapes)


def fsdp2_rest_bytes_with_grads(shapes, world_size, rank):
    """Keeps sharded gradients between steps (zero_grad sets them to None)."""
    return fsdp2_rest_bytes(shapes, world_size, rank) + sum(
        4 * dim0_rows(s[0], world_size)[rank] * math.prod(s[1:]) for s in shapes)


def fsdp2_group_wire_bytes(shapes, world_size, reshard_after_forward):
    n = world_size
    buffer = 4 * n * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)
    return (3 if reshard_after_forward else 2) * (n - 1) / n * buffer


def fsdp2_group_wire_bytes_unpadded(shapes, world_size, reshard_after_forward):
    """Sends the parameters' own elements, without the padding of short shards."""
    n = world_size
    buffer = 4 * sum(math.prod(s) for s in shapes)
    return (3 if reshard_after_forward else 2) * (n - 1) / n * buffer


def fsdp2_group_wire_bytes_always_regather(shapes, world_size, reshard_after_forward):
    """Forgets that a group kept after forward needs no second all-gather."""
    return fsdp2_group_wire_bytes(shapes, world_size, True)


def bf16_round(x):
    import struct

    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000   # round to nearest, ties to even
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bf16_truncate(x):
    """Drops the low 16 bits: rounds toward zero."""
    import struct

    bits = struct.unpack("<I", struct.pack("<f", x))[0] & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bf16_round_half_up(x):
    """Rounds ties away from zero instead of to even."""
    import struct

    bits = (struct.unpack("<I", struct.pack("<f", x))[0] + 0x8000) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def unsharded_group_bytes(shapes, world_size, element_size):
    n = world_size
    return element_size * n * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)


def unsharded_group_bytes_unpadded(shapes, world_size, element_size):
    """The parameters' own elements: forgets the padding of short shards."""
    return element_size * sum(math.prod(s) for s in shapes)


def unsharded_group_bytes_fp32(shapes, world_size, element_size):
    """Ignores the gather dtype: unsharded parameters are param_dtype under mixed precision."""
    return unsharded_group_bytes(shapes, world_size, 4)


def mp_group_wire_bytes(shapes, world_size, param_bytes, reduce_bytes, reshard_after_forward):
    n = world_size
    elems = n * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)
    return (n - 1) / n * elems * ((2 if reshard_after_forward else 1) * param_bytes
                                  + reduce_bytes)


def mp_group_wire_bytes_all_param(shapes, world_size, param_bytes, reduce_bytes,
                                  reshard_after_forward):
    """Reduce-scatters in the param dtype too, whatever reduce_dtype says."""
    return mp_group_wire_bytes(shapes, world_size, param_bytes, param_bytes,
                               reshard_after_forward)


def mp_group_wire_bytes_fp32_gather(shapes, world_size, param_bytes, reduce_bytes,
                                    reshard_after_forward):
    """Gathers the fp32 shards and casts after: the cast belongs in the copy-in."""
    return mp_group_wire_bytes(shapes, world_size, 4, reduce_bytes, reshard_after_forward)


def backward_collectives(order, prefetch):
    *units, root = order
    rev, out = units[::-1], []
    for k, g in enumerate(rev):
        if not prefetch or k == 0:
            out.append(("all_gather", g))
        if prefetch and k + 1 < len(rev):
            out.append(("all_gather", rev[k + 1]))
        out.append(("reduce_scatter", g))
    return out + [("reduce_scatter", root)]


def backward_collectives_gathers_root(order, prefetch):
    """Forgets that the root keeps its parameters from forward to backward."""
    return [("all_gather", order[-1])] + backward_collectives(order, prefetch)


def backward_collectives_prefetch_after_reduce(order, prefetch):
    """Issues the prefetch only after the group's own reduce-scatter: no overlap with its
    backward."""
    *units, root = order
    out = []
    for g in units[::-1]:
        out += [("all_gather", g), ("reduce_scatter", g)]
    return out + [("reduce_scatter", root)]


def forward_events(order, prefetch):
    out = []
    for k, g in enumerate(order):
        if k == 0 or not prefetch:
            out.append(("issue", g))
        out.append(("wait", g))
        if prefetch and k + 1 < len(order):
            out.append(("issue", order[k + 1]))
        out.append(("compute", g))
    return out


def forward_events_issue_after_compute(order, prefetch):
    """Prefetches after the group's compute: too late to overlap it."""
    out = []
    for k, g in enumerate(order):
        if k == 0 or not prefetch:
            out.append(("issue", g))
        out += [("wait", g), ("compute", g)]
        if prefetch and k + 1 < len(order):
            out.append(("issue", order[k + 1]))
    return out


def forward_events_all_upfront(order, prefetch):
    """Issues every all-gather at the start (unbounded memory)."""
    if not prefetch:
        return forward_events(order, False)
    return [("issue", g) for g in order] + [e for g in order
                                            for e in (("wait", g), ("compute", g))]


def exposed_ms(compute_ms, comm_ms, prefetch):
    if not prefetch:
        return float(sum(comm_ms))
    t = exposed = comm_ms[0]
    for c, m in zip(compute_ms, comm_ms[1:]):
        arrive = t + m
        t += c
        exposed += max(0.0, arrive - t)
        t = max(t, arrive)
    return exposed


def exposed_ms_no_first(compute_ms, comm_ms, prefetch):
    """Thinks prefetch hides the first all-gather too."""
    return exposed_ms(compute_ms, comm_ms, prefetch) - (comm_ms[0] if prefetch else 0)


def exposed_ms_in_aggregate(compute_ms, comm_ms, prefetch):
    """Overlaps the totals, as if any compute could hide any transfer."""
    if not prefetch:
        return float(sum(comm_ms))
    return max(float(comm_ms[0]), sum(comm_ms) - sum(compute_ms[:-1]))


def _bounds(d0, n):
    per = -(-d0 // n)
    return [(min(d0, r * per), min(d0, (r + 1) * per)) for r in range(n)]


def reshard_reads(d0, saved_world, new_world, new_rank):
    lo, hi = _bounds(d0, new_world)[new_rank]
    return [(r, max(lo, a), min(hi, b)) for r, (a, b) in enumerate(_bounds(d0, saved_world))
            if min(hi, b) > max(lo, a)]


def reshard_reads_even_split(d0, saved_world, new_world, new_rank):
    """Splits rows as evenly as possible, not torch.chunk's way."""
    def bounds(n):
        cuts = [d0 * r // n for r in range(n + 1)]
        return list(zip(cuts, cuts[1:]))
    lo, hi = bounds(new_world)[new_rank]
    return [(r, max(lo, a), min(hi, b)) for r, (a, b) in enumerate(bounds(saved_world))
            if min(hi, b) > max(lo, a)]


def reshard_reads_whole_files(d0, saved_world, new_world, new_rank):
    """Reads every overlapping saved shard whole instead of just the overlap."""
    lo, hi = _bounds(d0, new_world)[new_rank]
    return [(r, a, b) for r, (a, b) in enumerate(_bounds(d0, saved_world))
            if min(hi, b) > max(lo, a)]


def shard_payload_bytes(shapes, world_size, rank):
    return sum(12 * (lambda b: b[1] - b[0])(_bounds(s[0], world_size)[rank]) * math.prod(s[1:])
               for s in shapes)


def shard_payload_bytes_padded(shapes, world_size, rank):
    """Stores the padded shard: DCP writes the DTensor's local rows only."""
    return sum(12 * -(-s[0] // world_size) * math.prod(s[1:]) for s in shapes)


def shard_payload_bytes_params_only(shapes, world_size, rank):
    """Forgets Adam's two states."""
    return shard_payload_bytes(shapes, world_size, rank) // 3


def after_saves(events, keep=2):
    latest, dirs = None, []
    for ev in events:
        kind, step = ev.split()
        name = f"step_{int(step):06d}"
        if kind == "crash":
            dirs.append(name + ".tmp")
        else:
            done = sorted({d for d in dirs if not d.endswith(".tmp")} | {name})
            dirs, latest = done[-keep:], name
    return latest, sorted(set(dirs))


def after_saves_latest_moves_on_crash(events, keep=2):
    """Points `latest` at a save that never completed."""
    latest, dirs = after_saves(events, keep)
    crashed = [e for e in events if e.startswith("crash")]
    if crashed and events[-1] == crashed[-1]:
        latest = f"step_{int(crashed[-1].split()[1]):06d}"
    return latest, dirs


def after_saves_keeps_tmp(events, keep=2):
    """Never cleans up a crashed save's .tmp directory."""
    latest, dirs = after_saves(events, keep)
    tmps = {f"step_{int(e.split()[1]):06d}.tmp" for e in events if e.startswith("crash")}
    return latest, sorted(set(dirs) | tmps)


def fits(psi, n, strategy, gpu_bytes):
    per_gpu = {"ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / n,
               "zero2": 2 * psi + 14 * psi / n, "fsdp": 16 * psi / n}[strategy]
    return per_gpu <= gpu_bytes


def fits_zero2_shards_params(psi, n, strategy, gpu_bytes):
    """Treats ZeRO-2 as if it sharded the parameters too."""
    return fits(psi, n, "fsdp" if strategy == "zero2" else strategy, gpu_bytes)


def fits_fp32(psi, n, strategy, gpu_bytes):
    """Counts 4-byte parameters and gradients on top of the 12 bytes of optimizer state."""
    per_gpu = {"ddp": 20 * psi, "zero1": 8 * psi + 12 * psi / n,
               "zero2": 4 * psi + 16 * psi / n, "fsdp": 20 * psi / n}[strategy]
    return per_gpu <= gpu_bytes


def hsdp_wire_bytes(psi, replicate, shard):
    full = 4 * psi
    return 3 * (shard - 1) / shard * full, 2 * (replicate - 1) / replicate * full / shard


def hsdp_wire_bytes_full_allreduce(psi, replicate, shard):
    """All-reduces the whole gradient across nodes, not the node's 1/shard slice."""
    intra, _ = hsdp_wire_bytes(psi, replicate, shard)
    return intra, 2 * (replicate - 1) / replicate * 4 * psi


def hsdp_wire_bytes_no_regather(psi, replicate, shard):
    """Forgets the second all-gather, before backward."""
    _, inter = hsdp_wire_bytes(psi, replicate, shard)
    return 2 * (shard - 1) / shard * 4 * psi, inter


def min_gpus(psi, gpu_bytes):
    n = 1
    while n <= 2**20:
        if 16 * psi / n <= gpu_bytes:
            return n
        n *= 2
    return None


def min_gpus_strict(psi, gpu_bytes):
    """Demands strictly less than the budget."""
    n = 1
    while n <= 2**20:
        if 16 * psi / n < gpu_bytes:
            return n
        n *= 2
    return None


def min_gpus_exact_division(psi, gpu_bytes):
    """Returns ceil(16 psi / budget) instead of a power of two."""
    return max(1, -(-int(16 * psi) // int(gpu_bytes)))


# ---- the checkers --------------------------------------------------------------------------

# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_ring_bytes": ("ring bytes", ring_bytes, [ring_bytes_unpadded, ring_bytes_2n_steps,
                                                    ring_bytes_padding_times_n]),
    "check_reduce_scatter": ("reduce_scatter", reduce_scatter,
                             [reduce_scatter_full_sum, reduce_scatter_own_chunk]),
    "check_ring_schedule": ("ring schedule", chunk_sent,
                            [chunk_sent_off_by_one, chunk_sent_leftwards]),
    "check_model_states": ("model states", model_states,
                           [model_states_zero1_shards_grads, model_states_no_master_copy]),
    "check_adam_state_bytes": ("Adam state bytes", adam_state_bytes,
                               [adam_state_bytes_no_step, adam_state_bytes_k12]),
    "check_largest_batch": ("largest batch", largest_batch,
                            [largest_batch_end_of_forward, largest_batch_plus_one]),
    "check_assign_buckets": ("bucket assignment", assign_buckets,
                             [assign_buckets_forward_order, assign_buckets_cap_exclusive]),
    "check_ddp_step_comm": ("DDP bytes per step", ddp_step_comm,
                            [ddp_step_comm_per_tensor, ddp_step_comm_gather_bytes]),
    "check_stalled_buckets": ("stalled buckets", stalled_buckets,
                              [stalled_buckets_only_incomplete, stalled_buckets_from_the_end]),
    "check_flat_partition": ("flat partition", flat_partition,
                             [flat_partition_floor, flat_partition_per_tensor]),
    "check_zero_model_state_bytes": ("ZeRO model-state bytes", zero_model_state_bytes,
                                     [zero_model_state_bytes_unpadded,
                                      zero_model_state_bytes_no_step]),
    "check_zero_step_wire_bytes": ("ZeRO bytes per step", zero_step_wire_bytes,
                                   [zero_step_wire_bytes_no_gather,
                                    zero_step_wire_bytes_unpadded]),
    "check_flat_layout": ("flat layout", flat_layout,
                          [flat_layout_unaligned, flat_layout_pads_each]),
    "check_size_wrap": ("size-based wrap", size_wrap,
                        [size_wrap_counts_all, size_wrap_leaves_only]),
    "check_fsdp1_step_wire_bytes": ("FSDP1 bytes per step", fsdp1_step_wire_bytes,
                                    [fsdp1_step_wire_bytes_root_regathered,
                                     fsdp1_step_wire_bytes_regathers_for_backward]),
}
SOLUTIONS.update({
    "check_dim0_rows": ("dim-0 rows", dim0_rows, [dim0_rows_floor, dim0_rows_no_empty]),
    "check_fsdp2_rest_bytes": ("FSDP2 bytes at rest", fsdp2_rest_bytes,
                               [fsdp2_rest_bytes_unpadded, fsdp2_rest_bytes_with_grads]),
    "check_fsdp2_group_wire_bytes": ("FSDP2 group bytes per step", fsdp2_group_wire_bytes,
                                     [fsdp2_group_wire_bytes_unpadded,
                                      fsdp2_group_wire_bytes_always_regather]),
})
SOLUTIONS.update({
    "check_bf16_round": ("bf16 rounding", bf16_round, [bf16_truncate, bf16_round_half_up]),
    "check_unsharded_group_bytes": ("unsharded group bytes", unsharded_group_bytes,
                                    [unsharded_group_bytes_unpadded, unsharded_group_bytes_fp32]),
    "check_mp_group_wire_bytes": ("mixed-precision group bytes", mp_group_wire_bytes,
                                  [mp_group_wire_bytes_all_param,
                                   mp_group_wire_bytes_fp32_gather]),
})
SOLUTIONS.update({
    "check_backward_collectives": ("backward collectives", backward_collectives,
                                   [backward_collectives_gathers_root,
                                    backward_collectives_prefetch_after_reduce]),
    "check_forward_events": ("forward events", forward_events,
                             [forward_events_issue_after_compute, forward_events_all_upfront]),
    "check_exposed_ms": ("exposed all-gather time", exposed_ms,
                         [exposed_ms_no_first, exposed_ms_in_aggregate]),
})
SOLUTIONS.update({
    "check_reshard_reads": ("reshard reads", reshard_reads,
                            [reshard_reads_even_split, reshard_reads_whole_files]),
    "check_shard_payload_bytes": ("checkpoint bytes per rank", shard_payload_bytes,
                                  [shard_payload_bytes_padded, shard_payload_bytes_params_only]),
    "check_after_saves": ("checkpoint directory after saves", after_saves,
                          [after_saves_latest_moves_on_crash, after_saves_keeps_tmp]),
})
SOLUTIONS.update({
    "check_fits": ("fits", fits, [fits_zero2_shards_params, fits_fp32]),
    "check_hsdp_wire_bytes": ("HSDP bytes per step", hsdp_wire_bytes,
                              [hsdp_wire_bytes_full_allreduce, hsdp_wire_bytes_no_regather]),
    "check_min_gpus": ("fewest GPUs", min_gpus, [min_gpus_strict, min_gpus_exact_division]),
})
# ---- chapter 10 ----------------------------------------------------------------------------


def forward_all_gathers(n_blocks, bucketed):
    """Note [one collective per parameter]: a GPT reads 2 + 12 per block + 3 parameters, each
    gathered alone; the bucketing pass makes one all-gather per block, plus the root's two runs."""
    return n_blocks + 2 if bucketed else 5 + 12 * n_blocks


def forward_all_gathers_one_root_run(n_blocks, bucketed):
    return n_blocks + 1 if bucketed else 5 + 12 * n_blocks  # the root's reads are not one run


def forward_all_gathers_blocks_only(n_blocks, bucketed):
    return n_blocks + 2 if bucketed else 12 * n_blocks  # forgets the root's 5 parameters


def bucket_numel(shapes, world_size):
    """Each shard padded to ceil(d0 / N) rows, concatenated, N ranks' buckets gathered."""
    return world_size * sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in shapes)


def bucket_numel_unpadded(shapes, world_size):
    return sum(math.prod(s) for s in shapes)  # the sum of the full sizes: no padding


def bucket_numel_floor(shapes, world_size):
    return world_size * sum(s[0] // world_size * math.prod(s[1:]) for s in shapes)


SOLUTIONS.update({
    "check_forward_all_gathers": ("forward all-gathers", forward_all_gathers,
                                  [forward_all_gathers_one_root_run,
                                   forward_all_gathers_blocks_only]),
    "check_bucket_numel": ("bucket elements", bucket_numel,
                           [bucket_numel_unpadded, bucket_numel_floor]),
})
WRONG = [(c, w) for c, (_, _, wrongs) in SOLUTIONS.items() for w in wrongs]
WRONG_IDS = [w.__name__ for _, w in WRONG]

def checkers() -> list[str]:
    return sorted(n for m in CHAPTERS for n, f in inspect.getmembers(m, inspect.isfunction)
                  if n.startswith("check_") and f.__module__ == m.__name__)


def one_line(capsys) -> str:
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_every_checker_has_solutions_here():
    assert sorted(SOLUTIONS) == checkers(), "add the new checker's solutions to SOLUTIONS"


@pytest.mark.parametrize("checker", sorted(SOLUTIONS))
def test_accepts_a_correct_solution(checker, capsys):
    label, right, _ = SOLUTIONS[checker]
    assert getattr(exercises, checker)(right) is True
    assert re.fullmatch(rf"✓ {re.escape(label)}: all \d+ cases pass", one_line(capsys))


@pytest.mark.parametrize("checker,wrong", WRONG, ids=WRONG_IDS)
def test_rejects_a_wrong_solution(checker, wrong, capsys):
    label = SOLUTIONS[checker][0]
    assert getattr(exercises, checker)(wrong) is False
    out = capsys.readouterr().out  # names the failing call, what it returned, what was expected
    assert out.startswith(f"✗ {label}: {wrong.__name__}("), out
    assert re.search(r"\) returned .+, expected .+\n$", out), out
    assert "✓" not in out


@pytest.mark.parametrize("checker,wrong", [pytest.param(c, w, id=w.__name__) for c, w in WRONG])
def test_a_wrong_solution_gets_a_one_line_verdict(checker, wrong, capsys):
    getattr(exercises, checker)(wrong)
    assert one_line(capsys).startswith("✗ ")


@pytest.mark.parametrize("checker", sorted(SOLUTIONS))
def test_a_stub_is_not_implemented_yet(checker, capsys):
    def stub(*args):
        raise NotImplementedError("your code here")

    label = SOLUTIONS[checker][0]
    assert getattr(exercises, checker)(stub) is False
    assert one_line(capsys) == f"✗ {label}: not implemented yet"


def test_first_failing_case_is_the_one_shown(capsys):
    # 1000 elements split evenly over 4 and 2 ranks, so the unpadded count is right until
    # 10,001 elements over 4 ranks: 2*3*2501*4 = 60024 bytes sent, not 60006
    assert exercises.check_ring_bytes(ring_bytes_unpadded) is False
    assert one_line(capsys) == ("✗ ring bytes: ring_bytes_unpadded(10001, 4, 4) returned "
                                "60006.0, expected 60024")


def test_ring_bytes_answers_are_counted_and_match_the_note():
    """The checker's answers are bytes counted from the package's ring; they equal Note [ring
    bytes]'s 2(N-1) chunks of ceil(numel/N) elements, and not the old formula's count."""
    ch00 = CHAPTERS[0]
    for numel, e, n in [(10_001, 4, 4), (7, 2, 3), (1003, 8, 5), (1, 4, 8), (1000, 4, 1)]:
        assert ch00.counted_ring_bytes(numel, e, n) == ring_bytes(numel, e, n)
    old = ring_bytes_padding_times_n(10_001, 4, 4)
    assert ch00.counted_ring_bytes(10_001, 4, 4) == 60024 != old


def test_reduce_scatter_is_also_checked_against_a_measured_run(capsys):
    assert exercises.check_reduce_scatter(reduce_scatter, measured=collectives_run(4)) is True
    assert re.fullmatch(r"✓ reduce_scatter: all \d+ cases pass", one_line(capsys))
    # a run whose outputs disagree with the sum (rank 1's two elements swapped) is flagged
    assert exercises.check_reduce_scatter(reduce_scatter,
                                          measured=collectives_run(4, corrupt=True)) is False
    assert one_line(capsys).startswith("✗ reduce_scatter: reduce_scatter([[0, 1, 2")


def test_checker_survives_odd_answers(capsys):
    """A partial, a None and a tensor answer get a verdict, never a crash."""
    import functools

    import torch

    from minifsdp.ring import ring_wire_bytes

    assert exercises.check_ring_bytes(functools.partial(ring_wire_bytes))
    assert not exercises.check_model_states(lambda psi, n, stage: None)
    assert exercises.check_reduce_scatter(
        lambda ins: list(torch.tensor(ins).sum(0).chunk(len(ins))))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("✓") and out[1].startswith("✗ model states: <lambda>(")
    assert out[2].startswith("✓")
