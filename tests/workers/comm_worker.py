"""Worker for tests/test_comm.py: runs every check of minifsdp.comm / minifsdp.ring at one
world size and reports raw values; the test asserts on them (so a failure shows numbers).
Where ours is compared with torch's collective bit for bit, the worker reports
``minifsdp.parity``'s first-divergence line (None when equal); where the claim is a bound, it
reports both sides' values and the test holds them to it (Note [parity])."""

import time

import torch
import torch.distributed as dist

from minifsdp import comm
from minifsdp.dist import dist_setup, finish, seed_everything
from minifsdp.parity import divergence_line
from minifsdp.ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter

info = dist_setup()
rank, n = info.rank, info.world_size
out: dict = {"rank": rank, "world_size": n}


def ranks_differ(t: torch.Tensor, what: str) -> str | None:
    """Where some rank's ``t`` first differs from rank 0's, bit for bit, or None."""
    everyone = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(everyone, t.contiguous())
    lines = (divergence_line(everyone[q], everyone[0], names=(f"rank {q}", "rank 0"), where=what)
             for q in range(1, n))
    return next((line for line in lines if line), None)


def vs_torch(ours: torch.Tensor, ref: torch.Tensor, what: str, ours_name: str = "ring",
             ref_name: str = "torch") -> str | None:
    """The first difference between ours and torch's collective (Note [parity]), or None."""
    return divergence_line(ours, ref, names=(ours_name, ref_name), where=f"rank {rank}, {what}")


# 1. Exact: integer-valued tensors, rank r holds arange * (r + 1). Shapes cover numel
#    divisible and not divisible by N, smaller than N, 2-D, and a non-contiguous view.
exact = {}
cases = {"7": (7,), "12": (12,), "1": (1,), "3x5": (3, 5), "5x3_t": (5, 3)}
for name, shape in cases.items():
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        x = (torch.arange(torch.Size(shape).numel()) * (rank + 1)).to(dtype).reshape(shape)
        if name.endswith("_t"):
            x = x.t()  # (3, 5), non-contiguous
        ref, ours = x.clone(), x.clone()
        dist.all_reduce(ref)
        ring_all_reduce(ours)
        case = f"{name}/{dtype}"
        exact[case] = {"ring": ours.float().tolist(), "ref": ref.float().tolist(),
                       "vs_torch": vs_torch(ours, ref, case)}
out["exact"] = exact

# 2. Random fp32: summation order differs from gloo's, so the test holds both to a bound.
seed_everything(100 + rank)
rand = {}
for numel in (1000, 4097):
    x = torch.randn(numel)
    ref, ours = x.clone(), x.clone()
    dist.all_reduce(ref)
    ring_all_reduce(ours)
    rand[numel] = {"ring": ours.tolist(), "ref": ref.tolist(),
                   "ranks_differ": ranks_differ(ours, f"numel {numel}")}
out["random"] = rand

# 3. Other ops (their values: the test holds them to a bound), and each phase against its
#    torch counterpart.
x = torch.randn(2 * n + 1)
ops = {}
for op_name in ("AVG", "MAX", "MIN"):
    op = getattr(dist.ReduceOp, op_name)
    ref, ours = x.clone(), x.clone()
    dist.all_reduce(ref, op)
    ring_all_reduce(ours, op)
    ops[op_name] = {"ring": ours.tolist(), "ref": ref.tolist()}
out["ops"] = ops
full = torch.arange(3 * n, dtype=torch.float32) + 100 * rank
rs_ref, rs_ours = torch.empty(3), torch.empty(3)
dist.reduce_scatter_tensor(rs_ref, full)
ring_reduce_scatter(rs_ours, full)
ag_ref, ag_ours = torch.empty(3 * n), torch.empty(n, 3)  # ours takes any contiguous shape
dist.all_gather_into_tensor(ag_ref, rs_ref)
ring_all_gather(ag_ours, rs_ref)
out["phases"] = {  # each the first difference's line, None if bit for bit
    "reduce_scatter": vs_torch(rs_ours, rs_ref, "reduce_scatter"),
    "input_untouched": vs_torch(full, torch.arange(3 * n) + 100.0 * rank, "reduce_scatter's input",
                                "after", "before"),
    "all_gather": vs_torch(ag_ours.view(-1), ag_ref, "all_gather")}

# 4. Bytes each rank actually sent in a ring all-reduce, divisible and padded.
wire = {}
for numel in (12_000, 1001):
    with comm.logging_comm() as log:
        ring_all_reduce(torch.ones(numel))
    wire[numel] = {"sent": log.total_bytes("send", wire=True), "sends": len(log.comms("send")),
                   "received": log.total_bytes("recv"),
                   "tags": sorted({r.tag for r in log.comms()})}
out["wire"] = wire

# 5. A subgroup: the ring over the even ranks only (group ranks != global ranks).
evens = list(range(0, n, 2))
group = dist.new_group(evens)
if rank in evens:
    t = torch.full((5,), float(rank))
    ring_all_reduce(t, group=group)
    out["subgroup"] = t.tolist()

# 6. The log: formulas of the logged collectives, nesting, spans, and async end times.
with comm.logging_comm() as log:
    with comm.logging_comm() as inner:
        big = torch.ones(1000 * n)
        comm.all_reduce(big, tag="bucket 0")
        comm.reduce_scatter_tensor(torch.empty(1000), big)
        comm.all_gather_into_tensor(big, torch.ones(1000))
        comm.broadcast(big, src=0)
        comm.all_to_all_single(torch.empty_like(big), big)
    with log.span("compute"):
        time.sleep(0.05)
    work = comm.all_reduce(torch.ones(10), async_op=True, tag="async")
    end_before_wait = log.records[-1].t_end
    time.sleep(0.2)
    t_wait = time.perf_counter() - log.t0
    work.wait()
out["log"] = {
    "ops": [(r.kind, r.op, r.bytes, r.wire_bytes, r.group_size, r.tag) for r in log.records],
    "inner_ops": [r.op for r in inner.records],
    "json_keys": sorted(log.to_list()[0]),
    "async_end_before_wait": end_before_wait,
    "async_t_wait": t_wait,
    "async_t_end": log.records[-1].t_end,
    "async_t_start": log.records[-1].t_start,
    "async_t_done": log.records[-1].t_done,
    "sync_done_is_end": all(r.t_done == r.t_end for r in inner.records),
    "async_rec_t_wait": log.records[-1].t_wait,
    "async_exposed": log.records[-1].exposed,
    "sync_exposed_is_duration": all(r.exposed == r.t_end - r.t_start for r in inner.records),
    "exposed_total": comm.exposed_seconds(log.to_list()),
    "exposed_inner_plus_async": sum(r.exposed for r in log.comms()),
    "span": [log.records[-2].t_start, log.records[-2].t_end],
    "process_log_has_them": len(comm.comm_log().comms()) >= len(log.comms()),
}
finish(out)
