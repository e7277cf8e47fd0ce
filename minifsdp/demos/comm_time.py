"""Chapter 09's worker: what gloo's collectives cost, beside the messages of a real FSDP2 step.

``minifsdp.scale_time`` predicts a collective's time from two numbers per link, a latency
and a bus bandwidth. This worker measures both, in the same job, and times the collectives
that one real FSDP2 training step issues, so that the model's prediction for those messages
can be set against a measurement (Note [checking the time model on gloo] in scale_time.py)::

    run = torchrun("minifsdp.demos.comm_time", nproc=4,       # measures N = 2 and N = 4
                   env={"MINIFSDP_BACKEND": "gloo"})
    run.ranks[0]["by_n"]["2"]["busbw"]["all_gather"]            # bytes/s, nccl-tests' busbw
    run.ranks[0]["by_n"]["2"]["messages"][0]                    # {"op", "bytes", ..., "seconds"}

For each N in ``--sizes`` (the largest is the world; a smaller one runs on ranks ``0..N-1``
as a subgroup while the others wait at a barrier, which costs them no CPU):

1. the real step: chapter 09's GPT (fp32), ``minifsdp.fsdp2.fully_shard`` on each block and
   the root over the N ranks, one forward + backward under ``comm.logging_comm``; its log is
   the list of messages (op, payload bytes, wire bytes, dtype);
2. ``--reps`` rounds (after one warm-up round), each: a tiny collective of each op (its
   latency), a ``--probe-mb`` one (its bandwidth), then the step's messages one after another,
   blocking, each timed. Interleaving the rounds makes load on the machine hit the probes
   and the messages alike; medians over rounds keep single hiccups out.

Note [timing after a barrier]: ranks leave a barrier at different moments (on a loaded CPU by
milliseconds), and the first collective after it absorbs that skew: timed alone, a tiny
collective measured mostly the skew, several times gloo's real latency. So the latency is
the median of three tiny calls that follow an untimed one, the probe follows a tiny call,
and the step's messages follow one too, as in a step, where the previous collective
already lined the ranks up.

Times are rank 0's clock for rank 0's call. ``busbw`` follows nccl-tests: wire bytes over
time, with all-gather / reduce-scatter sending (N-1)/N of the full tensor. On gloo that is the
ring algorithm's count, not what gloo does for a reduce-scatter: torch's
``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` clones the input, all-reduces the clone
and copies this rank's chunk out, so gloo's reduce-scatter "busbw" is an all-reduce's time
priced at half an all-reduce's bytes (chapter 03, section 6).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from minifsdp import comm
from minifsdp.dist import dist_setup, finish, seed_everything
from minifsdp.models import build_model
from minifsdp.train import shard_units

GPT = dict(n_layer=4, d_model=256, n_head=8, vocab_size=64, seq_len=32)  # chapter 09's GPT
OPS = ("all_gather", "reduce_scatter")  # what an fp32 FSDP step issues


def step_messages(mesh, batch: int = 2) -> list[dict]:
    """The collectives of one FSDP2 forward + backward of ``GPT`` over ``mesh``, in order:
    ``[{"op", "bytes", "wire_bytes", "group_size", "dtype", "tag"}]`` (``minifsdp.comm``'s
    record fields: ``bytes`` is the input payload, Note [bytes vs wire bytes])."""
    from minifsdp.fsdp2 import fully_shard

    seed_everything(0)
    model = build_model("gpt", **GPT)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    idx = torch.randint(0, GPT["vocab_size"], (batch, GPT["seq_len"]))
    with comm.logging_comm() as log:
        logits = model(idx)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    keys = ("op", "bytes", "wire_bytes", "group_size", "dtype", "tag")
    return [{k: getattr(r, k) for k in keys} for r in log.comms()]


def _buffers(op: str, nbytes: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(output, input) for one call whose *input* payload is ``nbytes`` (the log's ``bytes``)."""
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    if op == "all_gather":
        return torch.empty(n * numel, dtype=dtype), torch.ones(numel, dtype=dtype)
    if op == "reduce_scatter":
        return torch.empty(numel // n, dtype=dtype), torch.ones(numel, dtype=dtype)
    raise ValueError(f"comm_time: no replay for {op!r}; expected one of {OPS}")


def _timed(op: str, bufs: tuple[torch.Tensor, ...], group) -> float:
    call = comm.all_gather_into_tensor if op == "all_gather" else comm.reduce_scatter_tensor
    t = time.perf_counter()
    call(*bufs, group=group)
    return time.perf_counter() - t


def measure(n: int, group, messages: list[dict], reps: int, probe_bytes: int) -> dict:
    """Interleaved rounds of probes and the step's messages; medians (module docstring)."""
    f32 = torch.float32
    # Tiny: one fp32 element per rank moves; probe: ``probe_bytes`` is the full tensor S.
    tiny = {op: _buffers(op, 4 if op == "all_gather" else 4 * n, n, f32) for op in OPS}
    probe = {op: _buffers(op, probe_bytes // n if op == "all_gather" else probe_bytes, n, f32)
             for op in OPS}
    dtypes = {"float32": f32, "bfloat16": torch.bfloat16}  # comm records name them so
    bufs = [_buffers(m["op"], m["bytes"], n, dtypes[m["dtype"]]) for m in messages]
    lat: dict[str, list[float]] = {op: [] for op in OPS}
    big: dict[str, list[float]] = {op: [] for op in OPS}
    per_msg: list[list[float]] = [[] for _ in messages]
    for rnd in range(reps + 1):  # round 0 warms up connections and allocations
        times = {}
        for op in OPS:  # Note [timing after a barrier]: an untimed call lines the ranks up
            dist.barrier(group=group)
            ts = [_timed(op, tiny[op], group) for _ in range(4)][1:]
            _timed(op, tiny[op], group)
            times[op] = statistics.median(ts), _timed(op, probe[op], group)
        dist.barrier(group=group)
        _timed(messages[0]["op"], tiny[messages[0]["op"]], group)
        msg_times = [_timed(m["op"], b, group) for m, b in zip(messages, bufs)]
        if rnd == 0:
            continue
        for op, (t_tiny, t_big) in times.items():
            lat[op].append(t_tiny)
            big[op].append(t_big)
        for i, t in enumerate(msg_times):
            per_msg[i].append(t)
    med = statistics.median
    wire = (n - 1) / n * probe_bytes
    return {
        "n": n, "reps": reps, "probe_bytes": probe_bytes,
        "latency": {op: med(lat[op]) for op in OPS},
        "probe_seconds": {op: med(big[op]) for op in OPS},
        "busbw": {op: wire / med(big[op]) for op in OPS},
        "messages": [{**m, "seconds": med(ts)} for m, ts in zip(messages, per_msg)],
        # The step's messages back to back: the median over rounds of each round's sum.
        "step_seconds": med([sum(ts[r] for ts in per_msg) for r in range(reps)]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help="group sizes to measure (default: 2 and the world size)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--probe-mb", type=float, default=8.0)
    args = p.parse_args()
    info = dist_setup()
    if info.device.type != "cpu":  # host clocks time host tensors; a GPU needs stream syncs
        raise RuntimeError(f"comm_time times gloo on CPU tensors, not {info.backend} on "
                           f"{info.device}: run it with MINIFSDP_BACKEND=gloo")
    from torch.distributed.device_mesh import DeviceMesh

    sizes = sorted(set(args.sizes or [2, info.world_size]))
    if sizes[-1] > info.world_size or sizes[0] < 2:
        raise ValueError(f"--sizes {sizes}: each must be in 2..{info.world_size} (the world)")
    by_n = {}
    for n in sizes:
        # new_group is collective over the whole world: every rank creates every subgroup.
        group = dist.group.WORLD if n == info.world_size else dist.new_group(list(range(n)))
        if info.rank < n:
            mesh = DeviceMesh.from_group(group, info.device.type)
            messages = step_messages(mesh)
            by_n[str(n)] = measure(n, group, messages, args.reps,
                                   int(args.probe_mb * 2**20) // (4 * n) * 4 * n)
        dist.barrier()  # ranks outside the subgroup wait here (blocked, not spinning)
    finish({"rank": info.rank, "world_size": info.world_size, "gpt": GPT, "by_n": by_n})


if __name__ == "__main__":
    main()
