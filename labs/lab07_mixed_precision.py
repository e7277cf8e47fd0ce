"""Lab 07: the mixed-precision casts of one FSDP2 group. Read Note [mixed precision] first.

Write the three places where a group's dtypes change: seam "fsdp2.all_gather_copy_in"
(FSDPParamGroup._all_gather_copy_in, before the all-gather), "fsdp2.reduce_dtype" and
"fsdp2.grads_to_shards" (reduce_scatter_dtype / to_sharded_grads in minifsdp/fsdp2/reduce.py,
around the reduce-scatter). Also read Note [accumulating in the reduce dtype] (fsdp_param.py).
Check: python -m minifsdp.labs 07      (start: python -m minifsdp.labs 07 --start)
Bar: losses, fp32 gradients and fp32 parameters of 3 Adam steps equal torch's fully_shard with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, then None with 2 backwards a step) bit
for bit at N = 2 and 3, and each step's all-gathers / reduce-scatters are the ones the model's
groups imply, each in its dtype with its bytes (bf16: half of fp32's).
"""

import torch

# given: tag(t, category, label=None) files tensor t under a MemoryTracker category.
from minifsdp.memory import tag  # noqa: F401


@torch.no_grad()
def all_gather_copy_in(group):
    """Before the all-gather: the group buffer, with this rank's padded shards in its slot.

    ``group`` (an ``FSDPParamGroup``): ``group.fsdp_params``, each ``p.all_gather_input()``
    this rank's padded shard of ``p``, 1-D, ``p.padded_shard_numel`` elements, in the shards'
    own dtype (fp32); ``group.world_size`` N, ``group.rank`` r; ``group.dtypes.gather``, the
    dtype the group is all-gathered and computed in (the policy's param_dtype, else the
    shards' own). The caller all-gathers from ``my_slot`` into ``gathered``, then the
    copy-out views each parameter in it (Note [copy-in and copy-out]).
    """
    inputs = [p.all_gather_input() for p in group.fsdp_params]  # given: fresh on every call
    n, r = group.world_size, group.rank
    # TODO(lab 07): return (my_slot, gathered). The contract, which the checker holds you to:
    #   - gathered: a new 1-D tensor on the inputs' device, N * S elements (S = the inputs'
    #     total numel), in group.dtypes.gather: the all-gather moves that dtype (bf16: half of
    #     fp32's bytes on the wire and in the buffer, Note [mixed precision]);
    #   - my_slot: a view of gathered, its elements [r * S, (r + 1) * S), holding the inputs
    #     back to back in group order, each value as .to(gathered's dtype) rounds it; the
    #     other slots' contents do not matter (the all-gather writes them);
    #   - the values are this call's inputs: the optimizer updates the shards in place
    #     between steps (Note [who owns the shard's storage]);
    #   - gathered is tagged for the memory tracker: category "comm", label "all-gather buffers".
    #   Stuck? python -m minifsdp.labs 07 --hint (three graded hints).
    raise NotImplementedError("lab 07: all_gather_copy_in in labs/lab07_mixed_precision.py")


@torch.no_grad()
def reduce_scatter_dtype(group, grads):
    """The dtype the group's gradients are reduce-scattered in; the reduce-scatter's copy-in
    (lab 05's) then lays ``grads`` into one buffer of that dtype.

    ``group.dtypes.reduce``: the group's reduce dtype (the policy's reduce_dtype, else its
    param_dtype; ``None`` when the group trains nothing). ``grads``: the unsharded gradients,
    a list you may change in place: bf16 under ``param_dtype=bf16`` -- or, after backwards
    without sync, fp32 accumulators beside fresh bf16 gradients (Note [accumulating in the
    reduce dtype]).
    """
    # TODO(lab 07): return the dtype. The contract:
    #   - it is the group's reduce dtype (Note [mixed precision]), else the gradients' own;
    #   - afterwards the tensors in grads (the same list object) share one dtype: gradients
    #     that arrived in two dtypes are replaced by copies in the returned dtype; gradients
    #     that arrived in one are left as they are (the copy-in casts them).
    raise NotImplementedError("lab 07: reduce_scatter_dtype in labs/lab07_mixed_precision.py")


@torch.no_grad()
def to_sharded_grads(group, params, out):
    """After the reduce-scatter (and averaging): the reduced slot becomes each sharded
    parameter's ``.grad``.

    ``out``: this rank's reduced slot, 1-D, S elements in the reduce dtype; parameter i's
    gradient is its ``p.sharded_numel`` elements at offset ``sum of the earlier
    p.padded_shard_numel`` (the rest of its padded shard is padding), shaped
    ``p.sharded_size``. ``group.dtypes.orig``: the sharded parameters' dtype (fp32, the master
    weights). Given: ``p.to_sharded_dtensor(t)`` makes a local tensor ``t`` of that shape p's
    sharded DTensor; an existing ``.grad``'s local rows are
    ``p.sharded_param.grad._local_tensor``.
    """
    # TODO(lab 07): set the gradients. The contract:
    #   - each p.sharded_param.grad is a DTensor of p's sharded shape in group.dtypes.orig
    #     (the optimizer steps the fp32 master shards, Note [mixed precision]), padding
    #     dropped;
    #   - a parameter without a .grad gets its rows of out; one that has a .grad (a second
    #     backward before the optimizer step) keeps it, with its rows of out added;
    #   - when out is not in group.dtypes.orig: its storage holds 0 bytes when you return
    #     (Note [freeing with resize_]; gloo may still hold a reference), and the tensor in
    #     orig's dtype that now holds the rows is tagged "grads" for the memory tracker.
    raise NotImplementedError("lab 07: to_sharded_grads in labs/lab07_mixed_precision.py")
