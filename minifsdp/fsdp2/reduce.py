"""A group's gradient reduction after its backward: reduce-scatter within the shard group,
HSDP's all-reduce across replicas, the mixed-precision dtypes and torch's division rules
(torch: ``foreach_reduce`` in ``_fsdp_collectives.py``)::

    unsharded grads --copy-in (cast to the reduce dtype)--> [rank 0 | rank 1 | ...]
        --reduce-scatter--> my slot  (HSDP: --all-reduce across replicas-->)
        --divide, cast to the shards' dtype--> views: each sharded parameter's .grad

``FSDPParamGroup.post_backward`` (``fsdp_param_group.py``) decides whether to reduce at all
(Note [accumulating without communication]) and hands the gradients over.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minifsdp import comm
from minifsdp.fsdp2.custom_comm import allocate, release
from minifsdp.fsdp2.fsdp_param import FSDPParam
from minifsdp.fsdp2.mixed_precision import all_reduce_op, divide_if_needed, gradient_divide_factors
from minifsdp.fsdp2.shard_placement import grads_to_dim0_layout
from minifsdp.memory import tag

if TYPE_CHECKING:
    from minifsdp.fsdp2.fsdp_param_group import FSDPParamGroup


@torch.no_grad()
def foreach_reduce(group: FSDPParamGroup, params: list[FSDPParam],
                   grads: list[torch.Tensor]) -> None:
    """Average ``grads`` (the unsharded gradients of ``params``, in order) over the ranks,
    keeping this rank's rows of each as the sharded parameter's ``.grad`` (a DTensor viewing
    the output), or adding into it. ``grads`` is emptied: the gradients die at the copy-in.

    In the reduce dtype (the copy-in casts), averaged as torch does
    (``gradient_divide_factors``: the backend's AVG for fp32 / bf16, else SUM between a
    pre- and a post-division), then cast to the shards' dtype (Note [mixed precision]).
    HSDP: reduce-scatter within the shard group, then all-reduce the output across the
    replicate group, both with ``op``; the divisions are sized for all R S ranks.

    Example (what ``post_backward`` does; N ranks, a group of one ``Linear(8, 4)``)::

        grads = [p.take_unsharded_grad() for p in group.fsdp_params]   # (4, 8), (4,)
        foreach_reduce(group, group.fsdp_params, grads)
        lin.weight.grad.to_local().shape                    # (4 / N rows, 8), averaged
    """
    if group.dtypes.orig is None:  # Note [frozen parameters' dtypes] in mixed_precision.py
        raise RuntimeError(
            f"fully_shard({group.name}): {', '.join(p.name for p in params)} got gradients, but "
            "the group's parameters were all frozen at its first forward and of several dtypes "
            "(torch 2.14.1 resolves no reduce dtype then either): give them one dtype, or shard "
            "the ones you unfreeze in a fully_shard call of their own")
    dtype = reduce_scatter_dtype(group, grads)  # seam "fsdp2.reduce_dtype" (lab 07)
    grads_to_dim0_layout(params, grads, group.world_size)  # Note [Shard(i) layout]
    # seam "fsdp2.reduce_scatter_copy_in" (lab 05)
    flat = reduce_scatter_copy_in(group, params, grads, dtype)
    grads.clear()  # the unsharded gradients die here
    out = reduce_grads(group, flat)  # seam "fsdp2.reduce_grads" (lab 09)
    if out is not None:  # None: kept for a later all-reduce (Note [HSDP accumulation])
        to_sharded_grads(group, params, out)  # seam "fsdp2.grads_to_shards" (lab 07)


@torch.no_grad()
def reduce_grads(group: FSDPParamGroup, flat: torch.Tensor) -> torch.Tensor | None:
    """The reduction itself: ``flat`` (the copy-in, ``(S * slot,)`` in the reduce dtype) in,
    this rank's slot averaged over all R S ranks out -- or None while HSDP keeps a partial sum
    (Note [HSDP accumulation]). Reduce-scatter within the shard group, then (HSDP) all-reduce
    the slot across the replicate group, with torch's divide factors
    (``gradient_divide_factors``; Note [HSDP] in hsdp.py). ``flat``'s storage is freed."""
    pre, post, op = gradient_divide_factors(group.world_size, flat.dtype,
                                            group.mesh_info.replicate_size,
                                            group.gradient_divide_factor,
                                            group.force_sum_reduction_for_comms)
    divide_if_needed(flat, pre)
    rs = group.reduce_scatter_comm  # ours, or a custom one (Note [custom collectives])
    out = allocate(rs, flat.numel() // group.world_size, flat.dtype, flat.device,
                   f"{group.name}'s reduce-scatter output")
    # the sharded grads view the output -- unless it is cast up later, then it is transient
    tag(out, "grads" if out.dtype == group.dtypes.orig else "comm")
    if group.world_size == 1:  # Note [a shard group of one rank] in fsdp_param_group.py
        out.copy_(flat)
    else:
        with comm.tagged(f"fsdp2 grads {group.name}"):
            rs(output_tensor=out, input_tensor=flat, group=group.reduce_scatter_group, op=op)
    # Free the input here and now, not by dropping our reference: gloo's worker thread holds
    # it for a moment after the (blocking) collective returns, and a free at a time of its
    # choosing would move the step's peak from run to run (as ``_free`` in
    # fsdp_param_group.py does for the all-gather buffer); a custom comm's is its own.
    release(flat, rs)
    if group.replicate_group is not None:  # Note [HSDP]: only my 1/S slot crosses nodes
        if not group.all_reduce_grads:  # Note [HSDP accumulation]: keep it, reduced over S
            if group.partial_reduce_output is None:
                group.partial_reduce_output = out
            else:
                group.partial_reduce_output += out
            return None
        if group.partial_reduce_output is not None:
            out += group.partial_reduce_output
            group.partial_reduce_output = None
        comm.all_reduce(out, all_reduce_op(op, group.gradient_divide_factor),
                        group.replicate_group, tag=f"fsdp2 grads-allreduce {group.name}")
    if group.all_reduce_hook is not None:  # FSDPModule.set_all_reduce_hook, as torch: here
        group.all_reduce_hook(out)
    divide_if_needed(out, post)
    return out


@torch.no_grad()
def to_sharded_grads(group: FSDPParamGroup, params: list[FSDPParam], out: torch.Tensor) -> None:
    """The reduced slot ``out`` (1-D, S elements, the reduce dtype) becomes each sharded
    parameter's ``.grad``: cast to the shards' dtype if it differs (the fp32 master weights'
    optimizer needs fp32 gradients, Note [mixed precision]), then parameter i's rows -- its
    ``sharded_numel`` elements at offset ``sum of the earlier padded_shard_numel`` -- as a
    DTensor view, or added into an existing ``.grad`` (accumulation over backwards); under CPU
    offload each parameter's rows are first copied to the host (``FSDPParam.grad_to_host``)."""
    if out.dtype != group.dtypes.orig:
        low = out
        out = low.to(group.dtypes.orig)  # e.g. a bf16 reduce: fp32 .grad for the optimizer
        tag(out, "grads")
        release(low, group.reduce_scatter_comm)  # now, not when gloo lets go (as flat)
    offset = 0
    for p in params:
        mine = out[offset: offset + p.sharded_numel].view(p.sharded_size)
        offset += p.padded_shard_numel  # skip this parameter's padding
        # Note [FSDP2 CPU offload] (fsdp_param.py): a host copy if offloading, else ``mine``
        mine = p.grad_to_host(mine, accumulate=p.sharded_param.grad is not None)
        if p.sharded_param.grad is None:
            p.sharded_param.grad = p.to_sharded_grad(mine)
        else:  # gradient accumulation over several backwards
            p.sharded_param.grad._local_tensor.add_(mine)


@torch.no_grad()
def reduce_scatter_dtype(group: FSDPParamGroup, grads: list[torch.Tensor]) -> torch.dtype:
    """The dtype the gradients are reduce-scattered in: the group's reduce dtype (the
    policy's ``reduce_dtype``, else ``param_dtype``: Note [mixed precision]), or the
    gradients' own. Gradients of two dtypes (fp32 accumulators next to fresh bf16 ones, Note
    [accumulating in the reduce dtype]) are first cast to it, in place in ``grads``."""
    dtype = group.dtypes.reduce or grads[0].dtype
    if len({g.dtype for g in grads}) > 1:  # fp32 accumulators next to fresh bf16 grads
        grads[:] = [g.to(dtype) for g in grads]  # (torch refuses this case)
    return dtype


@torch.no_grad()
def reduce_scatter_copy_in(group: FSDPParamGroup, params: list[FSDPParam],
                           grads: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The gradients in rank-major order, ``(N * S,)``: slot r holds chunk r of every
    gradient, each zero-padded to its padded shard size (S = their sum), in ``dtype`` (the
    reduce dtype): ``_chunk_cat`` casts as it copies (Note [mixed precision]). The buffer is
    the group's reduce-scatter comm's (Note [custom collectives])."""
    slot_numel = sum(p.padded_shard_numel for p in params)
    flat = allocate(group.reduce_scatter_comm, group.world_size * slot_numel, dtype,
                    grads[0].device, f"{group.name}'s reduce-scatter input")
    tag(flat, "comm")
    torch._chunk_cat(grads, dim=0, num_chunks=group.world_size,
                     out=flat.view(group.world_size, slot_numel))
    return flat
