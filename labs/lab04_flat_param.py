"""Lab 04: the FlatParameter: flatten, pad, shard, view, free. Read Note [flat layout] first.

Seams "flat_param.layout" (flat_layout), "flat_param.shard" (rank_shard), "flat_param.views"
(FlatParamHandle.unflatten), "flat_param.reshard" (FlatParamHandle.reshard), in
minifsdp.fsdp1.flat_param.
Check: python -m minifsdp.labs 04   (start: --start)   Hints: --hint (1, 2, 3)
Bar: bit for bit against torch FSDP1 (use_orig_params=True) at N = 2 and 3: every unit's padded
numel and shard (fp32; bf16 on a process group of one rank), the views' values, three Adam steps
of 2 micro-batches each; 0 bytes behind the unsharded tensor and the modules' views once freed,
a NO_SHARD unit's FlatParameter untouched by reshard.
Also read Note [alignment], Note [views, not copies] and Note [freeing storage].
"""

import torch  # noqa: F401


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
