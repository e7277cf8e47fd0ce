"""Lab 03's planted bugs: a ZeRO-2 reduce or step a learner plausibly gets wrong (Notes [flat
partition], [ZeRO-1 traffic] and [ZeRO memory categories] in minifsdp/zero.py).

Each function replaces one seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from minifsdp import comm
from minifsdp.labs.seams import replaces


def _stage1(opt, b, i, n):
    comm.all_reduce(b.grad, ReduceOp.AVG, opt.group, tag=f"zero1 grads {i}")
    b.shard.grad = b.grad[opt.rank * n:(opt.rank + 1) * n]


@replaces("zero.reduce")
def sums_instead_of_averaging(opt, i):
    """Reduce-scatters with SUM (the default op): every shard's gradient is N times the mean
    of the ranks' gradients, so the step is the step of an N-times larger loss."""
    b = opt.buckets[i]
    b.pending = 0
    n = b.shard.numel()
    if opt.stage == 1:
        return _stage1(opt, b, i, n)
    mine = b.flat.new_empty(n)
    comm.reduce_scatter_tensor(mine, b.grad, group=opt.group, tag=f"zero2 grads {i}")
    b.grad = None
    b.shard.grad = mine if b.shard.grad is None else b.shard.grad + mine


@replaces("zero.reduce")
def all_reduce_then_slice(opt, i):
    """Stage 1's all-reduce and a slice of it: the right numbers, but the whole averaged
    bucket travels and stays alive as long as the shard's gradient (a view of it) does
    (Notes [ZeRO-1 traffic] and [ZeRO memory categories])."""
    b = opt.buckets[i]
    b.pending = 0
    n = b.shard.numel()
    comm.all_reduce(b.grad, ReduceOp.AVG, opt.group, tag=f"zero2 grads {i}")
    mine = b.grad[opt.rank * n:(opt.rank + 1) * n]
    b.shard.grad = mine if b.shard.grad is None else b.shard.grad + mine


@replaces("zero.reduce")
def overwrites_accumulated_grad(opt, i):
    """``b.shard.grad = mine`` on every backward: with several backwards per step, only the
    last one's gradient survives."""
    b = opt.buckets[i]
    b.pending = 0
    n = b.shard.numel()
    if opt.stage == 1:
        return _stage1(opt, b, i, n)
    mine = b.flat.new_empty(n)
    comm.reduce_scatter_tensor(mine, b.grad, ReduceOp.AVG, opt.group, tag=f"zero2 grads {i}")
    b.grad = None
    b.shard.grad = mine


@replaces("zero.reduce")
def reduces_to_itself(opt, i):
    """Each rank ``dist.reduce``s the bucket to itself to collect "its" sum: a reduce has one
    root that every rank must name, so each rank waits for the others' data. Must end as a
    hang within seconds."""
    b = opt.buckets[i]
    b.pending = 0
    n = b.shard.numel()
    if opt.stage == 1:
        return _stage1(opt, b, i, n)
    dist.reduce(b.grad, dst=opt.rank, op=ReduceOp.SUM, group=opt.group)
    mine = b.grad[opt.rank * n:(opt.rank + 1) * n] / opt.world_size
    b.grad = None
    b.shard.grad = mine if b.shard.grad is None else b.shard.grad + mine


@replaces("zero.step")
@torch.no_grad()
def gathers_before_stepping(opt, closure=None):
    """All-gathers first, then steps: every rank's parameters hold the other ranks' slices of
    the *previous* step (Note [flat partition])."""
    for i, b in enumerate(opt.buckets):
        if b.pending:
            opt._reduce(i)
    for i, b in enumerate(opt.buckets):
        comm.all_gather_into_tensor(b.flat, b.shard, opt.group, tag=f"zero params {i}")
    opt.inner.step()


@replaces("zero.step")
@torch.no_grad()
def never_gathers(opt, closure=None):
    """Steps the shards and stops: each rank's parameters are updated only in its own slice."""
    for i, b in enumerate(opt.buckets):
        if b.pending:
            opt._reduce(i)
    opt.inner.step()


EXPECTED = {
    "sums_instead_of_averaging": dict(status="diverged", world_sizes=(2,), step=0,
                                      name="bucket 0: shard.grad",
                                      hint="a sum where a mean is expected"),
    "all_reduce_then_slice": dict(status="diverged", world_sizes=(2,), step=0,
                                  name="bucket 0: " + "full bucket gradient freed after backward "
                                  "(b.grad is None)"),
    "overwrites_accumulated_grad": dict(status="diverged", world_sizes=(2,), step=0,
                                        case="ZeRO-2, 3 buckets, 2 AdamW steps, 2 backwards "
                                        "per step", name="bucket 0: shard.grad"),
    "reduces_to_itself": dict(status="hang", world_sizes=(2,), where="lab03.py:74"),
    "gathers_before_stepping": dict(status="diverged", world_sizes=(2,), step=0,
                                    phase="optimizer step"),
    "never_gathers": dict(status="diverged", world_sizes=(2,), step=0,
                          name="collectives of the step, in issue order",
                          hint="fewer all-gathers"),
}
