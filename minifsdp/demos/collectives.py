"""Chapter 00's worker: what each collective does, and a ring all-reduce measured against
``dist.all_reduce``. Run under torchrun, e.g. from a notebook::

    run = torchrun("minifsdp.demos.collectives", "--demo", "collectives", nproc=4)
    run.ranks[2]["collectives"]["all_to_all"]    # {"input": [...], "output": [...]}

``--demo collectives``: rank r holds ``[10r, 10r+1, ..., 10r+2N-1]`` (int64, so the numbers
read as written) and every collective's input and output are recorded, together with the
wire bytes of each call and the identity all_reduce == reduce_scatter + all_gather.

It also runs the package's ring (``minifsdp.ring``) reduce-scatter, all-gather and all-reduce
on the same tensor and counts the bytes each hands to ``isend`` (``"ring_sent"``): measured
bytes to hold the comm log's formula wire bytes against.

``--demo ring``: ``ring_all_reduce`` vs ``dist.all_reduce`` for 1e3..1e6 fp32 elements:
measured bytes sent vs 2(N-1)/N * S, largest difference, and median times.

``--demo rs_memory``: the bytes of new storage a ``MemoryTracker`` sees while
``reduce_scatter_tensor``, ``all_gather_into_tensor`` and ``all_reduce`` run on a 1 MiB-per-rank
fp32 tensor: on gloo a reduce-scatter copies its whole input (ProcessGroupGloo's
``reduce_scatter_tensor_coalesced``: clone the input, all-reduce the clone, copy this rank's
chunk into the output); NCCL reduce-scatters straight into the output.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minifsdp import comm
from minifsdp.dist import dist_setup, finish, seed_everything
from minifsdp.memory import MemoryTracker
from minifsdp.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter, ring_wire_bytes


def collectives_demo(rank: int, n: int) -> dict:
    """Each collective on readable integers. Returns ``{op: {"input", "output"}}`` plus the
    identity check and the comm log."""
    x = torch.arange(2 * n) + 10 * rank  # (2N,): two elements per rank's chunk
    out: dict[str, dict] = {}
    with comm.logging_comm() as log:
        t = x.clone()
        comm.broadcast(t, src=0)
        out["broadcast"] = {"input": x, "output": t}

        t = x.clone()
        comm.all_reduce(t)
        out["all_reduce"] = {"input": x, "output": t}

        shard = torch.empty(2, dtype=x.dtype)
        comm.reduce_scatter_tensor(shard, x)
        out["reduce_scatter"] = {"input": x, "output": shard}

        mine = x[:2].clone()
        gathered = torch.empty(2 * n, dtype=x.dtype)
        comm.all_gather_into_tensor(gathered, mine)
        out["all_gather"] = {"input": mine, "output": gathered}

        t = torch.empty_like(x)
        comm.all_to_all_single(t, x)  # chunk j goes to rank j: a distributed transpose
        out["all_to_all"] = {"input": x, "output": t}

        # all_reduce == reduce_scatter + all_gather, on the same input.
        reduced, both = torch.empty(2, dtype=x.dtype), torch.empty(2 * n, dtype=x.dtype)
        comm.reduce_scatter_tensor(reduced, x, tag="identity")
        comm.all_gather_into_tensor(both, reduced, tag="identity")
    identity = {"all_reduce": out["all_reduce"]["output"], "reduce_scatter": reduced,
                "reduce_scatter_then_all_gather": both,
                "equal": torch.equal(both, out["all_reduce"]["output"])}
    # The package's ring on the same tensors: the bytes it actually hands to isend.
    ring_sent = {}
    for op, run in (("reduce_scatter",
                     lambda: ring_reduce_scatter(torch.empty(2, dtype=x.dtype), x)),
                    ("all_gather",
                     lambda: ring_all_gather(torch.empty(2 * n, dtype=x.dtype), x[:2].clone())),
                    ("all_reduce", lambda: ring_all_reduce(x.clone()))):
        with comm.logging_comm() as ring_log:
            run()
        ring_sent[op] = int(ring_log.total_bytes("send"))
    return {"collectives": out, "identity": identity, "comm_log": log.to_list(),
            "ring_sent": ring_sent}


def rs_memory_demo(rank: int, n: int, device: torch.device) -> dict:
    """Bytes of storage beyond the collective's own input and output that a ``MemoryTracker``
    sees at the peak while each collective runs (2**18 fp32 per rank and chunk, 1 MiB)."""
    k = 2**18
    out = {}
    for op in ("reduce_scatter", "all_gather", "all_reduce"):
        big = torch.ones(n * k, device=device)
        small = torch.empty(k, device=big.device) if op == "reduce_scatter" else \
            torch.ones(k, device=big.device)
        with MemoryTracker(device=big.device) as mt:
            mt.register([big, small] if op != "all_reduce" else [big], "comm")
            own = mt.current()["total"]  # the input and output themselves
            mt.reset_peak()
            if op == "reduce_scatter":
                comm.reduce_scatter_tensor(small, big)
            elif op == "all_gather":
                comm.all_gather_into_tensor(big, small)
            else:
                comm.all_reduce(big)
        out[op] = {"extra_bytes": mt.peak - own,
                   "input_bytes": 4 * (k if op == "all_gather" else n * k),
                   "by_category": mt.peak_by_category}
    return {"rs_memory": out}


def _median_time(all_reduce_fn, x: torch.Tensor, reps: int) -> float:
    """Median wall seconds of ``all_reduce_fn`` on a fresh copy of ``x``; a barrier first,
    so every rank starts together."""
    times = []
    for _ in range(reps):
        buf = x.clone()
        dist.barrier()
        t = time.perf_counter()
        all_reduce_fn(buf)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def ring_demo(rank: int, n: int, sizes: list[int], reps: int) -> dict:
    """``ring_all_reduce`` vs ``dist.all_reduce`` per size (fp32 elements). Returns a list of
    rows with measured and theoretical bytes, max |difference| and median seconds."""
    rows = []
    for numel in sizes:
        seed_everything(1000 + rank)  # different data on every rank
        x = torch.randn(numel)
        ref, ours = x.clone(), x.clone()
        dist.all_reduce(ref)
        with comm.logging_comm() as log:
            ring_all_reduce(ours)
        s = x.numel() * x.element_size()
        rows.append({
            "numel": numel,
            "bytes": s,
            "measured_wire_bytes": log.total_bytes("send", wire=True),
            "theory_wire_bytes": 2 * (n - 1) / n * s,  # Note [ring bytes] in minifsdp/ring.py
            "padded_wire_bytes": ring_wire_bytes(numel, x.element_size(), n),
            "sends": len(log.comms("send")),
            "max_abs_diff": (ours - ref).abs().max().item(),
            "ring_s": _median_time(ring_all_reduce, x, reps),
            "torch_s": _median_time(dist.all_reduce, x, reps),
        })
    return {"ring": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", choices=["collectives", "ring", "rs_memory"], required=True)
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_001, 100_000, 1_000_000])
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    info = dist_setup()
    if args.demo == "collectives":
        results = collectives_demo(info.rank, info.world_size)
    elif args.demo == "rs_memory":
        results = rs_memory_demo(info.rank, info.world_size, info.device)
    else:
        results = ring_demo(info.rank, info.world_size, args.sizes, args.reps)
    finish({"rank": info.rank, "world_size": info.world_size, **results})


if __name__ == "__main__":
    main()
