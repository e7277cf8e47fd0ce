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


@replaces("fsdp2.all_gather_copy_in")
@torch.no_grad()
def casts_to_fp16(group):
    """Casts the shards to ``torch.half`` ("half precision") instead of the policy's
    param_dtype: the same bytes on the wire, but fp16 (5 exponent bits, 10 mantissa bits) is
    not bf16 (8 and 7), and the copy-out rebuilds parameters of the wrong dtype (Note [mixed
    precision]: the copy-in casts to ``group.dtypes.gather``)."""
    inputs = [p.all_gather_input() for p in group.fsdp_params]
    slot_numel = sum(t.numel() for t in inputs)
    gathered = torch.empty(group.world_size * slot_numel, dtype=torch.float16)
    tag(gathered, "comm", label="all-gather buffers")
    my_slot = gathered.narrow(0, group.rank * slot_numel, slot_numel)
    torch.cat(inputs, out=my_slot)
    return my_slot, gathered


@replaces("fsdp2.all_gather_copy_in")
@torch.no_grad()
def rounds_to_bf16_but_gathers_fp32(group):
    """Rounds each shard to bf16 and back, then all-gathers the fp32 buffer: every value the
    forward sees is right, and the all-gather moves fp32's 4 bytes per element for bf16's
    information (Note [mixed precision]: the buffer itself is param_dtype)."""
    inputs = [p.all_gather_input().to(group.dtypes.gather).float() for p in group.fsdp_params]
    slot_numel = sum(t.numel() for t in inputs)
    gathered = inputs[0].new_empty(group.world_size * slot_numel)
    tag(gathered, "comm", label="all-gather buffers")
    my_slot = gathered.narrow(0, group.rank * slot_numel, slot_numel)
    torch.cat(inputs, out=my_slot)
    return my_slot, gathered


@replaces("fsdp2.reduce_dtype")
@torch.no_grad()
def reduces_in_master_dtype(group, grads):
    """Always reduces in the master weights' dtype (fp32, ``group.dtypes.orig``), reasoning
    that the optimizer wants fp32 anyway: right under reduce_dtype=fp32, but a policy that
    asks for a bf16 reduce-scatter gets an fp32 one of twice the bytes (Note [mixed
    precision]: the reduce dtype is reduce_dtype, else param_dtype)."""
    dtype = group.dtypes.orig
    grads[:] = [g.to(dtype) for g in grads]
    return dtype


@replaces("fsdp2.grads_to_shards")
@torch.no_grad()
def assigns_instead_of_accumulating(group, params, out):
    """Casts back to fp32 and sets every sharded ``.grad`` anew: right with one backward per
    step, but a second backward before the optimizer step replaces the first one's gradient
    instead of adding to it (Note [who owns the shard's storage]: an existing ``.grad`` is
    added into)."""
    if out.dtype != group.dtypes.orig:
        low, out = out, out.to(group.dtypes.orig)
        low.untyped_storage().resize_(0)
    offset = 0
    for p in params:
        mine = out[offset: offset + p.sharded_numel].view(p.sharded_size)
        offset += p.padded_shard_numel
        p.sharded_param.grad = p.to_sharded_dtensor(mine)


@replaces("fsdp2.grads_to_shards")
@torch.no_grad()
def adds_in_the_reduce_dtype(group, params, out):
    """Adds a second backward's reduced rows to the ``.grad`` in the reduce dtype (bf16), then
    casts the sum up: every accumulation rounds to 8 significant bits, where torch adds the
    cast-up rows in fp32 (Note [accumulating in the reduce dtype])."""
    low, offset = out, 0
    if out.dtype != group.dtypes.orig:
        out = low.to(group.dtypes.orig)
        tag(out, "grads")
    for p in params:
        mine = out[offset: offset + p.sharded_numel].view(p.sharded_size)
        mine_low = low[offset: offset + p.sharded_numel].view(p.sharded_size)
        offset += p.padded_shard_numel
        if p.sharded_param.grad is None:
            p.sharded_param.grad = p.to_sharded_dtensor(mine)
        else:
            local = p.sharded_param.grad._local_tensor
            local.copy_(local.to(low.dtype) + mine_low)
    if low is not out:
        low.untyped_storage().resize_(0)


@replaces("fsdp2.grads_to_shards")
@torch.no_grad()
def keeps_the_low_precision_slot(group, params, out):
    """Casts the reduced bf16 slot up to fp32 and leaves the bf16 one to the garbage
    collector: gloo's thread may still hold it, so half a slot of bytes lives on for as long
    as it likes (Note [freeing with resize_]: free it at once)."""
    if out.dtype != group.dtypes.orig:
        out = out.to(group.dtypes.orig)
        tag(out, "grads")
    offset = 0
    for p in params:
        mine = out[offset: offset + p.sharded_numel].view(p.sharded_size)
        offset += p.padded_shard_numel
        if p.sharded_param.grad is None:
            p.sharded_param.grad = p.to_sharded_dtensor(mine)
        else:
            p.sharded_param.grad._local_tensor.add_(mine)


@replaces("fsdp2.reduce_dtype")
@torch.no_grad()
def casts_accumulators_to_the_first_dtype(group, grads):
    """Brings gradients of two dtypes to one by casting them all to the first one's: after a
    backward without sync that is this backward's bf16 gradient, and the fp32 accumulators of
    the others lose 16 bits before the reduce-scatter (Note [accumulating in the reduce
    dtype])."""
    if len({g.dtype for g in grads}) > 1:
        grads[:] = [g.to(grads[0].dtype) for g in grads]
    return group.dtypes.reduce or grads[0].dtype


@replaces("fsdp2.all_gather_copy_in")
@torch.no_grad()
def gathers_from_a_separate_slot(group):
    """Builds this rank's slot as a tensor of its own (the shards concatenated and cast) and
    all-gathers from it into the buffer: the right bytes on the wire and in the buffer, but the
    slot is a second allocation the caller never frees, not a view of the buffer (Note
    [copy-in and copy-out])."""
    inputs = [p.all_gather_input() for p in group.fsdp_params]
    my_slot = torch.cat(inputs).to(group.dtypes.gather)
    gathered = my_slot.new_empty(group.world_size * my_slot.numel())
    tag(gathered, "comm", label="all-gather buffers")
    return my_slot, gathered


# What the checker must say about each bug: the report's status, the jobs to run (the smallest
# that shows the bug), and where the first divergence is (case, checked value) or the line.
REDUCE_CASE = ("the reduce dtype and the sharded gradients of one group (bf16 gradients, fp32 "
               "accumulators beside bf16 ones, a bf16 slot added twice)")
EXPECTED = {
    "casts_after_the_all_gather": dict(
        status="diverged", world_sizes=(2,), case="the all-gather copy-in of each group, "
        "bf16 params", name="body: all-gather wire bytes", hint="yours moved 2× the bytes"),
    "gathers_a_stale_bf16_copy": dict(
        status="diverged", world_sizes=(2,), step=1, phase="forward",
        name="body.0.weight, unsharded"),
    "reduces_in_param_dtype": dict(
        status="diverged", world_sizes=(2,), case=REDUCE_CASE, phase="backward",
        name="reduce dtype (bf16 params, fp32 reduce, bf16 gradients)", hint="reduce_dtype"),
    "keeps_the_reduced_dtype": dict(status="crash", world_sizes=(2,), where="lab07.py:70"),
    "casts_to_fp16": dict(
        status="diverged", world_sizes=(2,), case="the all-gather copy-in of each group, "
        "bf16 params", name="body: all-gathered buffer"),
    "rounds_to_bf16_but_gathers_fp32": dict(
        status="diverged", world_sizes=(2,), case="the all-gather copy-in of each group, "
        "bf16 params", name="body: all-gather wire bytes", hint="yours moved 2× the bytes"),
    "reduces_in_master_dtype": dict(
        status="diverged", world_sizes=(2,), case=REDUCE_CASE, phase="backward",
        name="reduce dtype (bf16 reduce, bf16 gradients)", hint="reduce_dtype"),
    "assigns_instead_of_accumulating": dict(
        status="diverged", world_sizes=(2,), case=REDUCE_CASE, phase="backward",
        name="0.weight.grad, the local rows (bf16 reduce, backward 2 of 2)",
        hint="added to the fp32 .grad"),
    "adds_in_the_reduce_dtype": dict(
        status="diverged", world_sizes=(2,), case=REDUCE_CASE, phase="backward",
        name="0.weight.grad, the local rows (bf16 reduce, backward 2 of 2)",
        hint="added to the fp32 .grad in fp32"),
    "keeps_the_low_precision_slot": dict(
        status="diverged", world_sizes=(2,), case=REDUCE_CASE, phase="backward",
        name="bytes behind the bfloat16 slot after to_sharded_grads (bf16 reduce, backward 1 "
             "of 2)", hint="Note [freeing with resize_]"),
    "casts_accumulators_to_the_first_dtype": dict(
        status="diverged", world_sizes=(2,), case=REDUCE_CASE, phase="backward",
        name="gradient 0 (bf16 params, fp32 reduce, fp32 accumulators beside bf16 gradients)",
        hint="Note [accumulating in the reduce dtype]"),
    "gathers_from_a_separate_slot": dict(
        status="diverged", world_sizes=(2,), step=0, phase="forward",
        case="3 Adam steps against torch's fully_shard, param_dtype=bf16, reduce_dtype=fp32",
        name="all-gather buffers and slots: bytes after forward", hint="a view of gathered"),
}
