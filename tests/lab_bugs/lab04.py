"""Lab 04's planted bugs: FlatParameter mistakes a learner plausibly makes (Note [flat layout],
Note [views, not copies], Note [freeing storage]).

Each function replaces one seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

import torch

from minifsdp.labs.seams import replaces


@replaces("flat_param.layout")
def no_padding_to_n(numels, world_size, align=1):
    """Aligns every start but forgets to pad the total to a multiple of N: the N shards are no
    longer equal (Note [flat layout]). Unit 0's 2,213 elements are odd, so N = 2 shows it."""
    offsets, total = [], 0
    for n in numels:
        total = -(-total // align) * align
        offsets.append(total)
        total += n
    return offsets, total


@replaces("flat_param.layout")
def padding_in_front(numels, world_size, align=1):
    """Puts the padding to a multiple of N before the first parameter instead of after the last:
    the same padded numel, but rank 0 holds the padding and every element sits elsewhere than in
    torch's layout (Note [flat layout])."""
    offsets, total = [], 0
    for n in numels:
        total = -(-total // align) * align
        offsets.append(total)
        total += n
    pad = -total % world_size
    return [o + pad for o in offsets], total + pad


@replaces("flat_param.shard")
def shard_one_element_late(full, rank, world_size):
    """Starts each shard one element late (``rank * s + 1``), as when counting from 1: the
    shards overlap and the first element is nobody's; the last rank's is one short."""
    s = full.numel() // world_size
    return full[rank * s + 1:(rank + 1) * s + 1]


@replaces("flat_param.views")
def views_are_copies(handle, flat):
    """Copies each parameter's slice out of the flat tensor (``clone``): the values are right,
    but the modules no longer share the unsharded storage and backward never reaches the flat
    tensor, so the FlatParameter gets no gradient (Note [views, not copies])."""
    chunks = torch.split(flat, handle._split_sizes)
    return [chunks[c].clone().view(info.shape) for c, info in zip(handle._chunk_of, handle.infos)]


@replaces("flat_param.views")
def views_ignore_alignment(handle, flat):
    """Cuts the flat tensor into the parameters' numels back to back, forgetting the alignment
    gaps: every parameter after the first reads its neighbour's tail (Note [alignment])."""
    out, start = [], 0
    for info in handle.infos:
        out.append(flat[start:start + info.numel].view(info.shape))
        start += info.numel
    return out


@replaces("flat_param.reshard")
def never_frees_the_storage(handle):
    """Marks the handle resharded but keeps the gathered bytes: ``del`` or ``= None`` frees
    nothing while autograd holds views, only ``untyped_storage().resize_(0)`` does
    (Note [freeing storage])."""
    if handle._owns_buffer and handle.is_unsharded:
        handle.is_unsharded = False


EXPECTED = {
    "no_padding_to_n": dict(status="diverged", world_sizes=(2,),
                            case="flatten, align, pad and shard each unit",
                            name="unit 0: padded numel", hint="Note [flat layout]"),
    "padding_in_front": dict(status="diverged", world_sizes=(2,),
                             case="flatten, align, pad and shard each unit",
                             name="unit 0: shard (padding zeroed)", hint="on the last rank"),
    "shard_one_element_late": dict(status="diverged", world_sizes=(2,), rank=1,
                                   case="flatten, align, pad and shard each unit",
                                   name="unit (root): shard numel"),
    "views_are_copies": dict(status="diverged", world_sizes=(2,),
                             name="unit (root): 2.weight shares the unsharded storage",
                             hint="Note [views, not copies]"),
    "views_ignore_alignment": dict(status="diverged", world_sizes=(2,),
                                   name="unit (root): 2.bias (values)", hint="Note [alignment]"),
    "never_frees_the_storage": dict(status="diverged", world_sizes=(2,),
                                    name="unit (root): unsharded storage bytes after construction",
                                    hint="resize_(0)"),
}
