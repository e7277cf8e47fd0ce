"""Chapter 00 (collectives and torchrun): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_00.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import functools

import torch

from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check

_DTYPE_OF_SIZE = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@functools.cache
def counted_ring_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes rank 0 hands to ``isend`` in the package's ``ring_all_reduce`` of ``numel``
    elements of ``element_size`` bytes: the ring itself is run, in one process, with ``_ring``
    and ``_exchange`` replaced by a recorder that sums ``send_buf``'s bytes. Counted, not
    computed from Note [ring bytes]'s formula (``ring_wire_bytes``), so the exercise's answers
    do not come from the formula the reader is asked to derive."""
    from unittest import mock

    from minifsdp import ring

    n, sent = world_size, [0]

    def exchange(send_buf, recv_buf, right, left, group, tag):
        sent[0] += send_buf.numel() * send_buf.element_size()
        recv_buf.zero_()

    with mock.patch.object(ring, "_ring", lambda group: (n, 0, 1 % n, (0 - 1) % n)), \
            mock.patch.object(ring, "_exchange", exchange), \
            mock.patch.object(ring.dist, "get_world_size", lambda group=None: n):
        ring.ring_all_reduce(torch.zeros(numel, dtype=_DTYPE_OF_SIZE[element_size]))
    return sent[0]


def check_ring_bytes(fn) -> bool:
    """``fn(numel, element_size, world_size)`` -> bytes one rank sends in a ring all-reduce,
    padding included (see Note [ring bytes]). The answers are counted from the package's ring
    (``counted_ring_bytes``); ``tests/test_exercises_00.py`` ties them to the Note's formula."""
    cases = [((n, e, w), counted_ring_bytes(n, e, w))
             for n, e, w in [(1000, 4, 4), (1000, 4, 2), (10_001, 4, 4), (7, 2, 3), (1, 4, 8),
                             (1_000_000, 2, 1), (1003, 8, 5)]]
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
    """Chunk index that ``rank`` sends at ``step`` of ``phase`` in ``minifsdp.ring``.

    Read off the package's own ring, not typed again: ``_traced_schedule`` runs
    ``ring_reduce_scatter`` / ``ring_all_gather`` in one process with a recording exchange."""
    return _traced_schedule(world_size, phase)[rank][step]


@functools.cache
def _traced_schedule(n: int, phase: str) -> tuple[tuple[int, ...], ...]:
    """``[rank][step]`` -> chunk sent: the package's ring, run for each rank with ``_ring`` and
    ``_exchange`` replaced. Chunk c holds the value c (reduce-scatter: the exchange receives
    zeros, so sums never change it; all-gather: slot c starts as c and nothing lands)."""
    from unittest import mock

    from minifsdp import ring

    rows = []
    for me in range(n):
        sent: list[int] = []

        def exchange(send_buf, recv_buf, right, left, group, tag, sent=sent):
            sent.append(int(send_buf.reshape(-1)[0]))
            if phase == "reduce_scatter":
                recv_buf.zero_()

        with mock.patch.object(ring, "_ring", lambda group, me=me: (n, me, (me + 1) % n,
                                                                  (me - 1) % n)), \
                mock.patch.object(ring, "_exchange", exchange):
            if phase == "reduce_scatter":
                ring.ring_reduce_scatter(torch.empty(1), torch.arange(n, dtype=torch.float32))
            else:
                ring.ring_all_gather(torch.arange(n, dtype=torch.float32),
                                     torch.tensor([float(me)]))
        rows.append(tuple(sent))
    return tuple(rows)


def check_ring_schedule(fn) -> bool:
    """``fn(rank, step, world_size, phase)`` -> chunk index sent (Note [ring all-reduce])."""
    cases = [((r, s, n, ph), ring_schedule(r, s, n, ph))
             for n in (2, 3, 5) for ph in ("reduce_scatter", "all_gather")
             for r in range(n) for s in range(n - 1)]
    return check("ring schedule", cases, fn)


# ---- lab 00: ring all-reduce from send/recv ----------------------------------------------------


def _ints(shape, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Integer-valued floats: every order of additions gives the same bits (in bf16 too, at
    these sizes), so torch's own collectives (whatever algorithm gloo picks) are an exact
    oracle."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def _subgroup(n: int) -> list[int]:
    """The ranks of the group case: ranks 1..N-1 at N >= 3, so that a group rank is never the
    global rank (a solution using the default group or ``dist.get_rank()`` fails); all
    ranks, as a group object, at N = 2."""
    return list(range(1, n)) if n >= 3 else list(range(n))


def run_lab(t, info) -> None:
    """Lab 00's cases, on every rank: reduce-scatter (SUM, MAX, MIN, PRODUCT; fp32 and bf16,
    1-D and 2-D), all-gather and all-reduce against torch's collectives, the bytes each rank
    sends, random floats against the package's ring, and all three over a process group that
    is not the default one."""
    import torch.distributed as dist

    from minifsdp import comm, ring
    from minifsdp.labs import heartbeat, seams

    n, r = info.world_size, info.rank
    RS, AG = "ring.reduce_scatter", "ring.all_gather"
    for k in (4, 1):
        with t.case(f"reduce-scatter, {k} element(s) per rank", (RS,)):
            inp = _ints((n * k,), 10 + r)
            kept = inp.clone()
            out, want = torch.empty(k), torch.empty(k)
            with comm.logging_comm() as log:
                ring.ring_reduce_scatter(out, inp)
            dist.reduce_scatter_tensor(want, kept.clone())
            t.expect("output", out, want)
            t.expect("input after the call (leave it untouched)", inp, kept)
            t.expect("bytes sent", int(log.total_bytes("send", wire=True)), (n - 1) * k * 4)
    with t.case("reduce-scatter, MAX, MIN and PRODUCT", (RS,)):
        for op_name in ("MAX", "MIN", "PRODUCT"):
            op = getattr(dist.ReduceOp, op_name)
            inp = _ints((n * 3,), 20 + r)
            out, want = torch.empty(3), torch.empty(3)
            ring.ring_reduce_scatter(out, inp, op)
            dist.reduce_scatter_tensor(want, inp.clone(), op)
            t.expect(f"output ({op_name})", out, want)
    with t.case("reduce-scatter, bf16, output (2, 3)", (RS,)):
        inp = _ints((n * 2, 3), 25 + r, torch.bfloat16)
        out, want = torch.empty(2, 3, dtype=torch.bfloat16), torch.empty(2, 3, dtype=torch.bfloat16)
        with comm.logging_comm() as log:
            ring.ring_reduce_scatter(out, inp)
        dist.reduce_scatter_tensor(want, inp.clone())
        t.expect("output", out, want)
        t.expect("bytes sent", int(log.total_bytes("send", wire=True)), (n - 1) * 6 * 2)
    for k in (5, 1):
        with t.case(f"all-gather, {k} element(s) per rank", (AG,)):
            mine = torch.randn(k, generator=torch.Generator().manual_seed(30 + r))
            out, want = torch.full((n * k,), float("nan")), torch.empty(n * k)
            with comm.logging_comm() as log:
                ring.ring_all_gather(out, mine)
            dist.all_gather_into_tensor(want, mine)
            t.expect("output", out, want)
            t.expect("bytes sent", int(log.total_bytes("send", wire=True)), (n - 1) * k * 4)
    with t.case("all-gather, bf16, input (2, 3)", (AG,)):
        mine = torch.randn(2, 3, generator=torch.Generator().manual_seed(35 + r)).bfloat16()
        out = torch.full((n * 2, 3), float("nan"), dtype=torch.bfloat16)
        want = torch.empty(n * 2, 3, dtype=torch.bfloat16)
        with comm.logging_comm() as log:
            ring.ring_all_gather(out, mine)
        dist.all_gather_into_tensor(want, mine)
        t.expect("output", out, want)
        t.expect("bytes sent", int(log.total_bytes("send", wire=True)), (n - 1) * 6 * 2)
    for shape in ((n * 4,), (7,), (3, 5)):
        with t.case(f"all-reduce, shape {shape}", (RS, AG)):
            x = _ints(shape, 40 + r)
            want = x.clone()
            with comm.logging_comm() as log:
                ring.ring_all_reduce(x)
            dist.all_reduce(want)
            t.expect("result", x, want)
            t.expect("bytes sent", int(log.total_bytes("send", wire=True)),
                     ring.ring_wire_bytes(x.numel(), 4, n))
    with t.case("all-reduce, AVG of random floats vs the package's ring (same additions)",
                (RS, AG)):
        x = torch.randn(n * 6, generator=torch.Generator().manual_seed(50 + r))
        shard = torch.empty(6)
        want = torch.empty(n * 6)
        seams.reference(RS)(shard, x, dist.ReduceOp.AVG)
        seams.reference(AG)(want, shard)
        ring.ring_all_reduce(x, dist.ReduceOp.AVG)
        t.expect("result", x, want)
    ranks = _subgroup(n)
    group = dist.new_group(ranks)  # every rank takes part in creating it
    if r not in ranks:  # nothing to do here: wait for the members at the final barrier,
        heartbeat.set_timeout(120.0)  # however long a loaded machine makes them take
    else:
        with t.case(f"over a process group of ranks {ranks}", (RS, AG)):
            m = len(ranks)
            inp = _ints((m * 3,), 60 + r)
            out, want = torch.empty(3), torch.empty(3)
            ring.ring_reduce_scatter(out, inp, group=group)
            dist.reduce_scatter_tensor(want, inp.clone(), group=group)
            t.expect("reduce-scatter output", out, want)
            mine = _ints((2,), 70 + r)
            out, want = torch.full((m * 2,), float("nan")), torch.empty(m * 2)
            ring.ring_all_gather(out, mine, group=group)
            dist.all_gather_into_tensor(want, mine, group=group)
            t.expect("all-gather output", out, want)
            x = _ints((7,), 80 + r)
            want = x.clone()
            ring.ring_all_reduce(x, group=group)
            dist.all_reduce(want, group=group)
            t.expect("all-reduce result", x, want)


GROUP_VALUES = ("reduce-scatter output", "all-gather output", "all-reduce result")


def hint(name: str, got, expected, n: int) -> str | None:
    if name == "bytes sent" and isinstance(got, int) and expected:
        if got == 2 * expected:
            return ("yours sent 2× the ring's bytes: twice the steps, or your buffers are fp32 "
                    "where the input is bf16? Send in the input's dtype (Note [ring bytes])")
        return (f"yours sent {got / expected:.3g}× the ring's bytes: one chunk per step, N-1 "
                "steps per phase (Note [ring bytes])")
    if name in GROUP_VALUES:
        return ("over a group, N, your rank and your neighbours are the group's (_ring(group)) "
                "and every send and receive takes group=; dist.get_rank() is the global rank")
    if name.startswith("output (") and isinstance(got, torch.Tensor):
        return ("the right op? fold a received chunk with _COMBINE[op], whichever op was asked "
                "(Note [ring all-reduce])")
    return None


LAB = Lab(
    id="00",
    title="ring all-reduce from send/recv",
    skeleton="labs/lab00_ring.py",
    seams=(Seam("ring.reduce_scatter", "minifsdp.ring", "ring_reduce_scatter",
                "ring_reduce_scatter"),
           Seam("ring.all_gather", "minifsdp.ring", "ring_all_gather", "ring_all_gather")),
    notes=("ring all-reduce", "ring bytes", "ring deadlock"),
    run=run_lab,
    hint=hint,
    oracle="torch.distributed's collectives (and the package's ring)",
    hints=(
        "Cut the tensor into N chunks. In the reduce-scatter, chunk c starts at the rank after "
        "c and travels once around the ring, one rank to the right per step, each rank adding "
        "its own values, until it arrives, complete, at rank c. In the all-gather the owners "
        "pass the finished chunks once more around. Every step every rank sends one chunk and "
        "receives one, posted together. Read Note [ring all-reduce] (its table), Note [ring "
        "bytes] and Note [ring deadlock] in minifsdp/ring.py.",
        "Reduce-scatter: a scratch copy of the input seen as (N, k) -- the partial sums, so the "
        "input stays untouched -- and one chunk-sized receive buffer, both in the input's dtype. "
        "All-gather: the output seen as (N, k); received chunks land straight in their row. "
        "Invariants: N, me, right and left all come from _ring(group), and group goes to every "
        "_exchange; after N-1 steps of the reduce-scatter row `me` holds the reduction of every "
        "rank's row `me`; _COMBINE[op] is the only way values are combined; AVG divides once, "
        "at the end.",
        "reduce_scatter: chunks = copy of input as (N, k); for s in 0 .. N-2: exchange(send "
        "chunks[the row the Note's table names for (me, s)], receive into tmp); combine tmp "
        "into the row your left neighbour just sent (one row before the one you sent); then "
        "AVG: divide row me by N; output <- row me, in output's shape. all_gather: rows = "
        "output as (N, k); row me <- input flattened; for s in 0 .. N-2: exchange(send the "
        "row you received last -- at first your own --, receive into the row one before it).",
    ),
)
