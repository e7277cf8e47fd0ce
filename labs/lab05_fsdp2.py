"""Lab 05: FSDP2's copy-out and copy-in. Read Note [copy-in and copy-out] and Note [padding].

Write the two layout copies of one parameter group: seam "fsdp2.all_gather_copy_out" (replaces
FSDPParamGroup._all_gather_copy_out) and seam "fsdp2.reduce_scatter_copy_in" (replaces
minifsdp.fsdp2.reduce.reduce_scatter_copy_in).
Check: python -m minifsdp.labs 05      (start: python -m minifsdp.labs 05 --start)
Bar: the unsharded weights in forward, losses, gradients and parameters of 3 Adam steps equal
torch's fully_shard bit for bit at N = 2 and 3 (uneven rows; an empty shard at N = 3).
"""

import torch

from minifsdp.fsdp2.fsdp_param import chunk_dim0  # rank r's rows: chunk_dim0(t, N)[r]
from minifsdp.memory import tag


@torch.no_grad()
def all_gather_copy_out(group, gathered, world):
    """After the all-gather: each parameter's padded pieces into its own unsharded buffer.

    Shapes: ``gathered`` 1-D, ``world * S`` elements, rank-major: ``gathered.view(world, S)``
    row r is rank r's slot, and within every row parameter i's piece is the i-th block of
    ``p.padded_shard_numel * N // world`` elements (``world`` is N, or k after
    ``reshard_after_forward=k``). ``outs[i]`` is parameter i's unsharded buffer as
    ``(world, its piece size)``: its first ``numel`` elements are the parameter (Note [padding]).
    """
    outs = []
    for p in group.fsdp_params:
        buf = p.alloc_unsharded()  # the same storage every time (Note [freeing with resize_])
        tag(buf, "params", label=group.name)
        outs.append(buf.view(world, -1))
    # TODO(lab 05): copy column block i of every row of gathered.view(world, S) into outs[i],
    # in place, without autograd noticing the write into tensors it saved in forward
    # (Note [version counter]). (about 3 lines)
    raise NotImplementedError("lab 05: all_gather_copy_out in labs/lab05_fsdp2.py")


@torch.no_grad()
def reduce_scatter_copy_in(group, params, grads, dtype):
    """Before the reduce-scatter: the unsharded gradients into one rank-major buffer.

    Shapes: ``grads[i]`` has parameter ``params[i]``'s full shape; returns ``flat``, 1-D,
    ``N * S`` elements in ``dtype`` (S = the padded shard sizes' sum): slot r holds chunk r
    (``chunk_dim0``) of every gradient in order, each zero-padded to its
    ``p.padded_shard_numel`` elements, so that rank r receives exactly its rows.
    """
    n = group.world_size
    slot_numel = sum(p.padded_shard_numel for p in params)
    flat = grads[0].new_empty(n * slot_numel, dtype=dtype)
    tag(flat, "comm")
    # TODO(lab 05): fill slot r of flat.view(n, slot_numel) for every r: chunk r of each
    # gradient, flattened, at that parameter's offset in the slot, then zeros up to its
    # padded size; copying into `flat` casts to `dtype`. Return flat. (about 7 lines)
    raise NotImplementedError("lab 05: reduce_scatter_copy_in in labs/lab05_fsdp2.py")
