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
from minifsdp.memory import tag


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


@replaces("zero.reduce")
def reduce_scatters_into_the_bucket(opt, i):
    """Saves an allocation: reduce-scatters into its own slice of ``b.grad`` and keeps that
    slice as the shard's gradient, then sets ``b.grad = None``. The values are right and
    ``b.grad is None``, yet the view keeps the whole bucket gradient alive (Note [ZeRO memory
    categories])."""
    b = opt.buckets[i]
    b.pending = 0
    n = b.shard.numel()
    if opt.stage == 1:
        return _stage1(opt, b, i, n)
    mine = b.grad[opt.rank * n:(opt.rank + 1) * n]
    comm.reduce_scatter_tensor(mine, b.grad.clone(), ReduceOp.AVG, opt.group,
                               tag=f"zero2 grads {i}")
    tag(mine, "grads")
    b.grad = None
    b.shard.grad = mine if b.shard.grad is None else b.shard.grad + mine


@replaces("zero.reduce")
def allocates_the_slice_in_fp32(opt, i):
    """``torch.zeros(n)`` for the slice: fp32 whatever the parameters' dtype, fine until the
    model is bf16."""
    b = opt.buckets[i]
    b.pending = 0
    n = b.shard.numel()
    if opt.stage == 1:
        return _stage1(opt, b, i, n)
    mine = torch.zeros(n)
    tag(mine, "grads")
    comm.reduce_scatter_tensor(mine, b.grad, ReduceOp.AVG, opt.group, tag=f"zero2 grads {i}")
    b.grad = None
    b.shard.grad = mine if b.shard.grad is None else b.shard.grad + mine


@replaces("zero.reduce")
def divides_by_the_world_size(opt, i):
    """Reduce-scatters the SUM over ``opt.group``, then divides by ``dist.get_world_size()``,
    the default group's size, not ``opt.world_size``: over 2 ranks of 3 every shard's
    gradient is 2/3 of the mean."""
    b = opt.buckets[i]
    b.pending = 0
    n = b.shard.numel()
    if opt.stage == 1:
        return _stage1(opt, b, i, n)
    mine = b.flat.new_empty(n)
    tag(mine, "grads")
    comm.reduce_scatter_tensor(mine, b.grad, ReduceOp.SUM, opt.group, tag=f"zero2 grads {i}")
    mine /= dist.get_world_size()
    b.grad = None
    b.shard.grad = mine if b.shard.grad is None else b.shard.grad + mine


@replaces("zero.step")
@torch.no_grad()
def gathers_over_the_default_group(opt, closure=None):
    """Leaves out ``opt.group`` in the all-gather: right whenever the group is every rank."""
    for i, b in enumerate(opt.buckets):
        if b.pending:
            opt._reduce(i)
    opt.inner.step()
    for i, b in enumerate(opt.buckets):
        comm.all_gather_into_tensor(b.flat, b.shard, tag=f"zero params {i}")



@replaces("zero.step")
@torch.no_grad()
def gathers_into_a_copy(opt, closure=None):
    """All-gathers each bucket into a new tensor and copies it into ``b.flat``: the same
    values, one bucket's bytes more and a second pass, where the parameters are views of
    ``flat`` and one all-gather into it updates them (Note [flat partition])."""
    for i, b in enumerate(opt.buckets):
        if b.pending:
            opt._reduce(i)
    opt.inner.step()
    for i, b in enumerate(opt.buckets):
        full = torch.empty_like(b.flat)
        comm.all_gather_into_tensor(full, b.shard.detach().clone(), opt.group,
                                    tag=f"zero params {i}")
        b.flat.copy_(full)

EXPECTED = {
    "sums_instead_of_averaging": dict(status="diverged", world_sizes=(2,), step=0,
                                      name="bucket 0: shard.grad",
                                      hint="a sum where a mean is expected"),
    "all_reduce_then_slice": dict(status="diverged", world_sizes=(2,), step=0,
                                  name="bucket 0: " + "full bucket gradient freed after backward "
                                  "(b.grad is None)"),
    "overwrites_accumulated_grad": dict(status="diverged", world_sizes=(2,), step=0,
                                        case="ZeRO-2, 3 buckets, 2 AdamW steps, 2 backwards "
                                        "per step, bf16, over a process group of ranks [0, 1]",
                                        name="bucket 0: shard.grad"),
    "reduces_to_itself": dict(status="hang", world_sizes=(2,), where="lab03.py:75"),
    "gathers_before_stepping": dict(status="diverged", world_sizes=(2,), step=0,
                                    phase="optimizer step"),
    "never_gathers": dict(status="diverged", world_sizes=(2,), step=0,
                          name="collectives of the step, in issue order",
                          hint="fewer all-gathers"),
    "reduce_scatters_into_the_bucket": dict(status="diverged", world_sizes=(2,), step=0,
                                            name="bucket 0: bytes of the storage behind "
                                            "shard.grad", hint="keeps a bigger tensor alive"),
    "allocates_the_slice_in_fp32": dict(status="crash", world_sizes=(2,), where="lab03.py:134",
                                        hint="dtype"),
    "divides_by_the_world_size": dict(status="diverged", world_sizes=(3,), step=0,
                                      name="bucket 0: shard.grad", hint="yours = expected × 2/3"),
    "gathers_over_the_default_group": dict(status="crash", world_sizes=(3,),
                                           where="lab03.py:166"),
    "gathers_into_a_copy": dict(status="diverged", world_sizes=(2,), step=0, phase="step",
                                name="each all-gather of the step writes into a bucket's flat",
                                hint="straight into b.flat"),
}
