"""Lab 05: FSDP2's copy-out and copy-in. Read Note [copy-in and copy-out] and Note [padding].

Seams "fsdp2.all_gather_copy_out" (FSDPParamGroup._all_gather_copy_out) and
"fsdp2.reduce_scatter_copy_in" (minifsdp.fsdp2.reduce.reduce_scatter_copy_in).
Check: python -m minifsdp.labs 05   (start: --start)   Hints: --hint (1, 2, 3)
Bar: bit for bit at N = 2 and 3: each parameter from buffers of N slots and of 1 (fp32, bf16), the
reduce-scatter input (fp32, a bf16 reduce dtype, a shard group of one rank), and 3 Adam steps of 2
micro-batches each against torch's fully_shard (uneven rows, empty shards); the unsharded storage
freed after forward and backward, the version counter untouched.
Also read Note [dim-0 chunks], Note [freeing with resize_] and Note [version counter].
"""

import torch

from minifsdp.fsdp2.fsdp_param import chunk_dim0  # noqa: F401  rank r's rows: chunk_dim0(t, N)[r]
from minifsdp.memory import tag  # noqa: F401  tag(t, "params" / "comm"): the memory tracker's books


@torch.no_grad()
def all_gather_copy_out(group, gathered, world):
    """After the all-gather: every parameter of ``group`` gets its unsharded values.

    Given: ``gathered``, 1-D, ``world`` slots of S elements, as the all-gather left it
    (``world`` is the shard group's N, or k after ``reshard_after_forward=k``); per parameter
    ``p`` in ``group.fsdp_params`` (in slot order): ``p.padded_shard_numel`` (its piece of one
    rank's slot when world == N), ``p.orig_size``, and ``p.alloc_unsharded()``, its 1-D unsharded
    buffer of ``N * p.padded_shard_numel`` elements whose first ``numel`` elements are
    ``p.unsharded_param`` (tag it "params", label=group.name).
    Must hold afterwards: ``p.unsharded_param`` equals the full parameter, written in place into
    that buffer's storage (the same storage every step); its version counter has not moved;
    nothing refers to ``gathered`` (the caller frees it). Notes [copy-in and copy-out],
    [padding], [freeing with resize_], [version counter].
    """
    # TODO(lab 05): the contract above; `python -m minifsdp.labs 05 --hint` when stuck.
    raise NotImplementedError("lab 05: all_gather_copy_out in labs/lab05_fsdp2.py")


@torch.no_grad()
def reduce_scatter_copy_in(group, params, grads, dtype):
    """Before the reduce-scatter: the unsharded gradients, laid out so that each rank receives
    exactly its rows. Returns the reduce-scatter's input.

    Given: ``grads[i]``, parameter ``params[i]``'s full-shape gradient; ``group.world_size`` N
    (the shard group's, which need not be the world's); ``p.padded_shard_numel`` per parameter;
    ``dtype``, the reduce dtype. Returns: a new 1-D tensor of ``N * S`` elements in ``dtype``
    (S = the sum of the padded shard numels; tag it "comm") whose slot r, in ``params`` order,
    holds rank r's rows of every gradient (Note [dim-0 chunks]), each zero-padded to its padded
    shard numel. The caller frees it. Notes [copy-in and copy-out], [padding].
    """
    # TODO(lab 05): the contract above; `python -m minifsdp.labs 05 --hint` when stuck.
    raise NotImplementedError("lab 05: reduce_scatter_copy_in in labs/lab05_fsdp2.py")
