"""Lab 07's planted bugs: casts a learner plausibly puts in the wrong place (Note [mixed
precision], Note [who owns the shard's storage]).

Each function replaces one seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

import torch

from minifsdp.labs.seams import replaces
from minifsdp.memory import tag


@replaces("fsdp2.all_gather_copy_in")
@torch.no_grad()
def casts_after_the_all_gather(group):
    """Gathers the fp32 shards as they are, meaning to cast the gathered parameters later:
    the same bf16 values in the end, but the wire and the N-slot buffer carry 4 bytes per
    element instead of 2 (Note [mixed precision])."""
    inputs = [p.all_gather_input() for p in group.fsdp_params]
    slot_numel = sum(t.numel() for t in inputs)
    gathered = inputs[0].new_empty(group.world_size * slot_numel)  # the shards' fp32
    tag(gathered, "comm", label="all-gather buffers")
    my_slot = gathered.narrow(0, group.rank * slot_numel, slot_numel)
    torch.cat(inputs, out=my_slot)
    return my_slot, gathered


@replaces("fsdp2.all_gather_copy_in")
@torch.no_grad()
def gathers_a_stale_bf16_copy(group):
    """Casts the shards to bf16 once and keeps that copy to save the cast every step: the
    optimizer steps the fp32 master shards, and the next forward gathers the old weights
    (Note [who owns the shard's storage]: read the shard fresh on every all-gather)."""
    if not hasattr(group, "_bf16_shards"):
        group._bf16_shards = [p.all_gather_input().to(group.dtypes.gather)
                              for p in group.fsdp_params]
    inputs = group._bf16_shards
    slot_numel = sum(t.numel() for t in inputs)
    gathered = inputs[0].new_empty(group.world_size * slot_numel)
    tag(gathered, "comm", label="all-gather buffers")
    my_slot = gathered.narrow(0, group.rank * slot_numel, slot_numel)
    torch.cat(inputs, out=my_slot)
    return my_slot, gathered


@replaces("fsdp2.reduce_dtype")
@torch.no_grad()
def reduces_in_param_dtype(group, grads):
    """Reduce-scatters the gradients in the dtype they arrive in (bf16, the param_dtype),
    ignoring reduce_dtype=fp32: every partial sum on the wire is rounded to 8 bits (Note
    [mixed precision])."""
    dtype = grads[0].dtype
    if len({g.dtype for g in grads}) > 1:
        grads[:] = [g.to(dtype) for g in grads]
    return dtype


@replaces("fsdp2.grads_to_shards")
@torch.no_grad()
def keeps_the_reduced_dtype(group, params, out):
    """Hands the optimizer the reduced gradient in the reduce dtype: with reduce_dtype bf16
    the fp32 master shard gets a bf16 ``.grad``, which torch refuses (Note [mixed
    precision]: the sharded gradient is cast back to the shards' dtype)."""
    offset = 0
    for p in params:
        mine = out[offset: offset + p.sharded_numel].view(p.sharded_size)
        offset += p.padded_shard_numel
        if p.sharded_param.grad is None:
            p.sharded_param.grad = p.to_sharded_dtensor(mine)
        else:
            p.sharded_param.grad._local_tensor.add_(mine)


# What the checker must say about each bug: the report's status, the jobs to run (the smallest
# that shows the bug), and where the first divergence is (case, checked value) or the line.
EXPECTED = {
    "casts_after_the_all_gather": dict(
        status="diverged", world_sizes=(2,), case="the all-gather copy-in of each group, "
        "bf16 params", name="body: all-gather wire bytes", hint="yours moved 2× the bytes"),
    "gathers_a_stale_bf16_copy": dict(
        status="diverged", world_sizes=(2,), step=1, phase="forward",
        name="body.0.weight, unsharded"),
    "reduces_in_param_dtype": dict(
        status="diverged", world_sizes=(2,), step=0, phase="backward",
        name="reduce-scatters of the step (tag, dtype, input bytes)", hint="reduce_dtype"),
    "keeps_the_reduced_dtype": dict(status="crash", world_sizes=(2,), where="lab07.py:70"),
}
