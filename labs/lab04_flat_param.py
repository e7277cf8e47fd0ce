"""Lab 04: the FlatParameter: flatten, pad, shard, gather, view, free, reduce-scatter. Read Note
[flat layout] first.
Seams "flat_param.layout" (flat_layout), "flat_param.shard" (rank_shard), "flat_param.unshard"
(FlatParamHandle.unshard), "flat_param.views" (FlatParamHandle.unflatten), "flat_param.reshard"
(FlatParamHandle.reshard), "flat_param.reduce_scatter" (FlatParamHandle.reduce_grad), in
minifsdp.fsdp1.flat_param.
Check: python -m minifsdp.labs 04   (start: --start)   Hints: --hint (1, 2, 3)
Bar: bit for bit against torch FSDP1 (use_orig_params=True) at N = 2 and 3: every unit's padded
numel and shard (fp32; bf16 on a process group of one rank), the gathered views' values, each
shard's gradient after 2 micro-batches and the parameters after three Adam steps; one all-gather
and one reduce-scatter per unit and use, as the model implies; 0 bytes behind the unsharded
tensor and the modules' views once freed; a NO_SHARD unit's FlatParameter untouched by reshard.
Also read Note [alignment], Note [views, not copies], Note [freeing storage], Note [two tensors,
one storage] and, in minifsdp/fsdp1/fully_sharded.py, Note [divide before and after].
"""

import torch  # noqa: F401

from minifsdp import comm  # noqa: F401  (its collectives are torch.distributed's, logged)


def flat_layout(numels, world_size, align=1):
    """Where each of the unit's parameters (``numels[i]`` elements each, in order) sits in the
    one flat tensor, and how long that tensor is. Returns ``(offsets, padded_numel)``.

    Must hold: every offset is a multiple of ``align`` (elements, not bytes: Note [alignment]);
    parameters keep their order and never overlap; ``padded_numel`` is the smallest multiple of
    ``world_size`` that holds them all, so the N shards are equal (Note [flat layout]).
    Example: ``flat_layout([70, 7, 21, 3], world_size=3, align=4)`` -> ``([0, 72, 80, 104], 108)``.
    """
    # TODO(lab 04): the contract above; `python -m minifsdp.labs 04 --hint` when stuck.
    raise NotImplementedError("lab 04: flat_layout in labs/lab04_flat_param.py")


def rank_shard(full, rank, world_size):
    """This rank's part of the padded flat tensor ``full`` (1-D, a multiple of ``world_size``).

    ``rank`` and ``world_size`` are the unit's process group's, which need not be the default
    group's. Returns a view of ``full`` (the caller clones it into the FlatParameter) such that
    the N parts, in rank order, are equal and concatenate back to ``full`` (Note [flat layout]).
    """
    # TODO(lab 04): the contract above.
    raise NotImplementedError("lab 04: rank_shard in labs/lab04_flat_param.py")


def unshard(handle, tag_=None):
    """Make the unit's parameters whole again, before its forward or its backward computes.

    Given: ``handle.is_unsharded``; ``handle._buffer``, 1-D, ``handle.padded_numel`` elements,
    whose storage ``reshard`` freed (0 bytes) and which ``handle.unsharded``, the modules' views
    and the views autograd saved for backward all share; ``handle.sharded`` and
    ``handle.process_group``; ``handle.gather_input()``, what this rank contributes (its shard
    on the compute device, in the compute dtype); ``handle.flat_param``, the shard itself.
    Must hold afterwards: that same storage has its bytes again and holds the padded flat
    tensor, the group's N shards in rank order, so every tensor that shared it before the free
    reads the parameters again (Note [freeing storage], Note [two tensors, one storage]);
    ``handle.is_unsharded`` is True. Not sharded (NO_SHARD under CPU offload or mixed
    precision): the buffer holds the FlatParameter's values and nothing is communicated.
    Already unsharded: nothing happens, no collective. Communicate through ``minifsdp.comm``
    (``torch.distributed``'s signatures, plus ``tag=tag_``): the checker reads its log.
    """
    # TODO(lab 04): the contract above.
    raise NotImplementedError("lab 04: unshard in labs/lab04_flat_param.py")


def unflatten(handle, flat):
    """The unit's parameters (or their gradients) as tensors of their original shapes, one per
    ``handle.infos`` entry, in that order.

    Given: ``flat``, 1-D, ``handle.padded_numel`` elements (the unsharded parameters, or their
    gradient); ``handle.infos[i]`` with ``.offset``, ``.numel``, ``.shape``.
    Must hold: each result shares ``flat``'s storage and is made by autograd from ``flat``, so
    that backward through the modules fills one flat gradient (Note [views, not copies]).
    """
    # TODO(lab 04): the contract above.
    raise NotImplementedError("lab 04: unflatten in labs/lab04_flat_param.py")


def reshard(handle):
    """Free the unit's unsharded parameters after use (Note [freeing storage]).

    Given: ``handle._buffer`` (the gathered 1-D tensor; ``handle.unsharded`` and the modules'
    views share its storage, and autograd holds views of it), ``handle.is_unsharded``, and
    ``handle._owns_buffer`` (False for NO_SHARD, which computes on the FlatParameter itself).
    Must hold afterwards: when the handle owns its buffer, 0 bytes remain behind the buffer and
    every view of it, which keep their shapes (``handle.unshard()`` gives the same storage its
    bytes back); otherwise nothing is freed; ``handle.is_unsharded`` is False if something was
    freed. Calling it twice is harmless. Note [two tensors, one storage].
    """
    # TODO(lab 04): the contract above.
    raise NotImplementedError("lab 04: reshard in labs/lab04_flat_param.py")


def reduce_grad(handle, grad, divide, tag_=None):
    """Start averaging this rank's flat gradient over the unit's process group (the post-backward
    hook calls this once the unit's gradient is complete); return ``finish``, a function of no
    arguments that waits for the average and returns this rank's part of it.

    Given: ``grad``, 1-D, ``handle.padded_numel`` elements, this rank's gradient of the padded
    flat tensor (zeros in the gaps and the padding) in the reduce dtype, yours to consume;
    ``divide``, ``(before, after)`` with ``before * after == N``, the factors of Note [divide
    before and after] (fully_sharded.py); ``handle.sharded``, ``handle.shard_numel`` and
    ``handle.process_group``; ``minifsdp.comm``'s collectives (``tag=tag_``; ``async_op=True``
    returns a work whose ``wait()`` blocks).
    Must hold: one collective per call, issued before ``reduce_grad`` returns and waited for
    only in ``finish()`` (on a GPU the package calls it later, overlapping the next unit's
    backward). ``finish()`` returns a ``(handle.shard_numel,)`` tensor: this rank's elements
    ``[rank * s, (rank + 1) * s)`` of the average over the group's ranks, with torch FSDP1's
    float operations, so bit for bit torch's, also where a low-precision sum would overflow;
    not sharded (NO_SHARD): the whole average. On the CPU, once ``finish()`` returns, ``grad``'s
    storage holds 0 bytes unless ``grad`` is the result (Note [final callback]).
    """
    # TODO(lab 04): the contract above.
    raise NotImplementedError("lab 04: reduce_grad in labs/lab04_flat_param.py")
