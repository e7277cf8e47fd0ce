"""Lab 04: the FlatParameter: flatten, pad, shard, view, free. Read Note [flat layout] first.

Write the four pieces of minifsdp.flat_param.FlatParamHandle below; the real minifsdp.fsdp1
calls them through seams "flat_param.layout" (flat_layout), "flat_param.shard" (rank_shard),
"flat_param.views" (FlatParamHandle.unflatten) and "flat_param.reshard" (.reshard).
Check: python -m minifsdp.labs 04      (start: python -m minifsdp.labs 04 --start)
Bar: every unit's shard (padding included) and three Adam steps equal torch FSDP1's
(use_orig_params=True) bit for bit at N = 2 and 3; the unsharded storage holds 0 bytes when freed.
Also read Note [alignment], Note [views, not copies] and Note [freeing storage].
"""

import torch


def flat_layout(numels, world_size, align=1):
    """Offsets of parameters of ``numels`` elements laid out back to back in one flat tensor,
    each start rounded up to a multiple of ``align`` elements (Note [alignment]), and the total
    padded to a multiple of ``world_size``. Returns ``(offsets, padded_numel)``.

    Example: ``flat_layout([70, 7, 21, 3], world_size=3, align=4)`` -> ``([0, 72, 80, 104], 108)``.
    """
    # TODO(lab 04): walk the numels with a running total: round it up to a multiple of align,
    # record it as the offset, add the numel. Then pad the total up to a multiple of world_size.
    # (about 6 lines)
    raise NotImplementedError("lab 04: flat_layout in labs/lab04_flat_param.py")


def rank_shard(full, rank, world_size):
    """Rank ``rank``'s shard of the padded flat tensor ``full``, shape ``(padded_numel,)``
    (a multiple of ``world_size``): a *view* of ``padded_numel / world_size`` elements; the
    caller clones it into the FlatParameter. The padding, at the end, lands on the last rank.
    """
    # TODO(lab 04): slice rank's equal part out of full. (about 2 lines)
    raise NotImplementedError("lab 04: rank_shard in labs/lab04_flat_param.py")


def unflatten(handle, flat):
    """Views of ``flat`` (shape ``(handle.padded_numel,)``: the unsharded parameters, or their
    gradient) with the original shapes, one per ``handle.infos`` entry, in that order.

    ``handle.infos[i]`` has ``.offset``, ``.numel`` and ``.shape`` (Note [flat layout]). The
    result must share ``flat``'s storage and keep autograd's link to it: backward through the
    views must fill ``flat.grad`` (Note [views, not copies]). Alignment gaps are skipped.
    """
    # TODO(lab 04): one view per info: the info's slice of flat, viewed as its shape.
    # (about 1 line)
    raise NotImplementedError("lab 04: unflatten in labs/lab04_flat_param.py")


def reshard(handle):
    """Free the unsharded flat tensor's memory after use (Note [freeing storage]).

    ``handle._buffer`` is the gathered ``(padded_numel,)`` tensor; views of it are still held
    by autograd, so dropping references frees nothing: the *storage* must shrink to 0 bytes
    (``handle.unshard()`` resizes it back before the next all-gather). Only when
    ``handle._owns_buffer`` (NO_SHARD computes on the FlatParameter itself) and
    ``handle.is_unsharded``; afterwards ``handle.is_unsharded`` is False.
    """
    # TODO(lab 04): free the buffer's storage and record that it is free. (about 3 lines)
    raise NotImplementedError("lab 04: reshard in labs/lab04_flat_param.py")
