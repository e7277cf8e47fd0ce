"""Chapter 00 (collectives and torchrun): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check
from minifsdp.ring import ring_wire_bytes


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


# ---- lab 00: ring all-reduce from send/recv ----------------------------------------------------


def _ints(shape, seed: int) -> torch.Tensor:
    """Integer-valued floats: every order of additions gives the same bits, so torch's own
    collectives (whatever algorithm gloo picks) are an exact oracle."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=g).float()


def run_lab(t, info) -> None:
    """Lab 00's cases, on every rank: reduce-scatter, all-gather and all-reduce against torch's
    collectives, the bytes each rank sends, and random floats against the package's ring."""
    import torch.distributed as dist

    from minifsdp import comm, ring
    from minifsdp.labs import seams

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
    with t.case("reduce-scatter, MAX", (RS,)):
        inp = _ints((n * 3,), 20 + r)
        out, want = torch.empty(3), torch.empty(3)
        ring.ring_reduce_scatter(out, inp, dist.ReduceOp.MAX)
        dist.reduce_scatter_tensor(want, inp.clone(), dist.ReduceOp.MAX)
        t.expect("output", out, want)
    for k in (5, 1):
        with t.case(f"all-gather, {k} element(s) per rank", (AG,)):
            mine = torch.randn(k, generator=torch.Generator().manual_seed(30 + r))
            out, want = torch.full((n * k,), float("nan")), torch.empty(n * k)
            with comm.logging_comm() as log:
                ring.ring_all_gather(out, mine)
            dist.all_gather_into_tensor(want, mine)
            t.expect("output", out, want)
            t.expect("bytes sent", int(log.total_bytes("send", wire=True)), (n - 1) * k * 4)
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


def hint(name: str, got, expected, n: int) -> str | None:
    if name == "bytes sent" and isinstance(got, int) and expected:
        return (f"yours sent {got / expected:.3g}× the ring's bytes: one chunk per step, N-1 "
                "steps per phase (Note [ring bytes])")
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
)
