"""Lab 07: the mixed-precision casts of one FSDP2 group. Read Note [mixed precision] first.

Write where the dtypes change: seam "fsdp2.all_gather_copy_in" (FSDPParamGroup._all_gather_copy_in,
the cast before the all-gather), "fsdp2.reduce_dtype" and "fsdp2.grads_to_shards"
(reduce_scatter_dtype / to_sharded_grads in minifsdp/fsdp2/reduce.py: the gradients' dtypes).
Check: python -m minifsdp.labs 07      (start: python -m minifsdp.labs 07 --start)
Bar: losses, fp32 gradients and fp32 parameters of 3 Adam steps equal torch's fully_shard with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, then None with 2 backwards a step) bit
for bit at N = 2 and 3, and each step's all-gathers / reduce-scatters are the ones the model's
groups imply, each in its dtype with its bytes (bf16: half of fp32's).
"""

import torch

from minifsdp.memory import tag


@torch.no_grad()
def all_gather_copy_in(group):
    """Before the all-gather: this rank's padded shards into its slot of the group buffer.

    Returns ``(my_slot, gathered)``: ``gathered`` 1-D, ``N * S`` elements (S = the padded
    shards' total numel) in ``group.dtypes.gather`` (the policy's param_dtype, else the
    shards' own); ``my_slot`` = elements ``r*S .. (r+1)*S`` of it, a view, holding
    ``p.all_gather_input()`` (1-D, fp32, ``p.padded_shard_numel``) of every parameter in order.
    Read each shard fresh from ``all_gather_input()`` on every call: the optimizer updates it
    in place between steps (Note [who owns the shard's storage]).
    """
    inputs = [p.all_gather_input() for p in group.fsdp_params]
    n, r = group.world_size, group.rank
    # TODO(lab 07): allocate `gathered` (tag it "comm", label="all-gather buffers"), take your
    # slot as a view, copy each input into its place in it: the copy is the cast, so that the
    # wire carries param_dtype. Return (my_slot, gathered). (about 6 lines)
    raise NotImplementedError("lab 07: all_gather_copy_in in labs/lab07_mixed_precision.py")


@torch.no_grad()
def reduce_scatter_dtype(group, grads):
    """The dtype the gradients are reduce-scattered in.

    ``group.dtypes.reduce`` is the policy's reduce_dtype, else param_dtype (``None`` when the
    group trains nothing: then the gradients' own). ``grads``: the unsharded gradients, bf16
    under ``param_dtype=bf16`` -- or, after accumulation without sync, some fp32 (Note
    [accumulating in the reduce dtype]): if their dtypes differ, replace them in ``grads`` by
    copies in the returned dtype.
    """
    # TODO(lab 07): choose the dtype; make mixed gradients agree. (about 4 lines)
    raise NotImplementedError("lab 07: reduce_scatter_dtype in labs/lab07_mixed_precision.py")


@torch.no_grad()
def to_sharded_grads(group, params, out):
    """After the reduce-scatter (and averaging): the reduced slot becomes each sharded
    parameter's ``.grad``.

    Shapes: ``out`` 1-D, S elements in the reduce dtype; parameter i's gradient is its
    ``p.sharded_numel`` elements at offset ``sum of the earlier p.padded_shard_numel``, viewed
    as ``p.sharded_size``. ``.grad`` must have the sharded parameter's dtype
    (``group.dtypes.orig``, fp32: the optimizer steps the fp32 master shards); once cast, free
    the low-precision ``out`` at once (``untyped_storage().resize_(0)``) and tag the cast copy
    "grads". A new ``.grad`` is ``p.to_sharded_dtensor(rows)``; an existing one is added into
    (``p.sharded_param.grad._local_tensor``).
    """
    # TODO(lab 07): cast if needed, then give each parameter its rows. (about 12 lines)
    raise NotImplementedError("lab 07: to_sharded_grads in labs/lab07_mixed_precision.py")
