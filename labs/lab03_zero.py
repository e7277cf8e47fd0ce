"""Lab 03: the ZeRO-2 step. Read Note [flat partition] and Note [ZeRO-1 traffic] first.

Seams "zero.reduce" (ZeroOptimizer._reduce, stage 2's half) and "zero.step" (ZeroOptimizer.step).
Check: python -m minifsdp.labs 03   (start: --start)   Hints: --hint (1, 2, 3)
Bar: losses, shard gradients, parameters and the collectives (op, shape, dtype, group size, in
issue order) equal the package's ZeroOptimizer bit for bit at N = 2 and 3 (torch DDP's losses
and parameters too at N = 2), with two backwards per step, in bf16 and over a process group of
2 ranks; stage 2 keeps only the slice: no tensor bigger than it stays alive behind shard.grad.
"""

import torch
from torch.distributed import ReduceOp

from minifsdp import comm
from minifsdp.memory import tag

# given: opt.buckets[i] is a minifsdp.zero.Bucket: flat (N * shard_numel,) holds the bucket's
# parameters back to back, zero-padded (Note [flat partition]); shard is my slice of flat, as
# an nn.Parameter of the inner optimizer (opt.inner); grad is this rank's full flat gradient,
# shaped like flat, filled by the gradient hooks during backward. opt.rank and opt.world_size
# are *within* opt.group, the process group to use; opt.stage is 1 or 2. The hooks call
# reduce(opt, i) as soon as bucket i is full; zero_grad() sets shard.grad and grad to None.


def reduce(opt, i):
    """Bucket ``i``'s gradient is complete on every rank (``b.grad``, shaped like ``b.flat``).

    Must hold afterwards (stage 2): ``b.shard.grad`` (shape ``(shard_numel,)``, the bucket's
    dtype) holds my slice of the average over the group's ranks, *added* to what it held before
    (several backwards per step); the full bucket gradient is freed (``b.grad is None``, and no
    view of it survives); the slice's new tensor is tagged "grads" for the MemoryTracker
    (``tag(t, "grads")``); one collective, through ``minifsdp.comm``, with tag=f"zero2 grads {i}".
    Note [ZeRO memory categories] says what stage 2 may keep.
    """
    b = opt.buckets[i]
    b.pending = 0
    n = b.shard.numel()
    if opt.stage == 1:  # DDP's all-reduce: every rank gets the whole average, and uses 1/N
        comm.all_reduce(b.grad, ReduceOp.AVG, opt.group, tag=f"zero1 grads {i}")
        b.shard.grad = b.grad[opt.rank * n:(opt.rank + 1) * n]
        return
    # TODO(lab 03): stage 2's reduce (Note [ZeRO-1 traffic] says which collective).
    raise NotImplementedError("lab 03: reduce in labs/lab03_zero.py")


@torch.no_grad()
def step(opt, closure=None):
    """The optimizer step, after every bucket was reduced.

    Must hold afterwards: every rank holds the same updated ``flat`` in every bucket (so the
    model's parameters, views of it, are updated everywhere); the collectives are the same on
    every rank, in bucket order, through ``minifsdp.comm`` with tag=f"zero params {i}"; no copy
    of the parameters is made (Note [flat partition] says why none is needed).
    """
    if closure is not None:
        raise NotImplementedError("ZeroOptimizer.step takes no closure")
    for i, b in enumerate(opt.buckets):
        if b.pending:  # a parameter got no gradient: reduce what the bucket has
            opt._reduce(i)
    # TODO(lab 03): step my shards, then make every rank's buckets whole again.
    raise NotImplementedError("lab 03: step in labs/lab03_zero.py")
