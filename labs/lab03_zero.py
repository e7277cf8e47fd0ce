"""Lab 03: the ZeRO-2 step. Read Note [flat partition] and Note [ZeRO-1 traffic] first.

Write reduce (seam "zero.reduce", replaces ZeroOptimizer._reduce: a full bucket's gradient
becomes my shard's) and step (seam "zero.step", replaces ZeroOptimizer.step).
Check: python -m minifsdp.labs 03      (start: python -m minifsdp.labs 03 --start)
Bar: losses, shard gradients, parameters and the collectives equal the package's ZeroOptimizer
bit for bit at N = 2 and 3, and torch DDP's losses and parameters at N = 2; each bucket's full
gradient is freed once reduced (stage 2 keeps 1/N of the gradients).
"""

import torch
from torch.distributed import ReduceOp

from minifsdp import comm
from minifsdp.memory import tag

# given: opt.buckets[i] is a minifsdp.zero.Bucket: flat (N * shard_numel,) holds the bucket's
# parameters back to back, zero-padded (Note [flat partition]); shard is my slice of flat, as
# an nn.Parameter of the inner optimizer (opt.inner); grad is this rank's full flat gradient,
# shaped like flat, filled by the gradient hooks during backward. opt.rank, opt.world_size,
# opt.group, opt.stage (1 or 2). The hooks call reduce(opt, i) as soon as bucket i is full.


def reduce(opt, i):
    """Average bucket ``i``'s gradient over the ranks, leaving my slice of it, shape
    ``(shard_numel,)``, in ``b.shard.grad``, added to what is there (gradient accumulation)."""
    b = opt.buckets[i]
    b.pending = 0
    n = b.shard.numel()
    if opt.stage == 1:  # DDP's all-reduce: every rank gets the whole average, and uses 1/N
        comm.all_reduce(b.grad, ReduceOp.AVG, opt.group, tag=f"zero1 grads {i}")
        b.shard.grad = b.grad[opt.rank * n:(opt.rank + 1) * n]
        return
    # TODO(lab 03): stage 2. Reduce-scatter the average of b.grad straight into a new tensor of
    # my slice's size (tag it "grads" for the MemoryTracker), free the full bucket gradient,
    # then set or accumulate b.shard.grad. (about 7 lines)
    raise NotImplementedError("lab 03: reduce in labs/lab03_zero.py")


@torch.no_grad()
def step(opt, closure=None):
    """Step my shards with the inner optimizer, then make every rank's parameters whole again:
    after it, every rank holds the same updated ``flat`` in every bucket."""
    if closure is not None:
        raise NotImplementedError("ZeroOptimizer.step takes no closure")
    for i, b in enumerate(opt.buckets):
        if b.pending:  # a parameter got no gradient: reduce what the bucket has
            opt._reduce(i)
    # TODO(lab 03): step the shards, then one all-gather per bucket, in bucket order, written
    # in place into b.flat (Note [flat partition] says why no copy is needed). (about 3 lines)
    raise NotImplementedError("lab 03: step in labs/lab03_zero.py")
