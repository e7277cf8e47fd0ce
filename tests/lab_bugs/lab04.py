"""Lab 04's planted bugs: FlatParameter mistakes a learner plausibly makes (Note [flat layout],
Note [alignment], Note [views, not copies], Note [freeing storage]).

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


@replaces("flat_param.reshard")
def frees_even_the_flat_parameter(handle):
    """Frees the buffer's storage whenever the handle is unsharded, forgetting that NO_SHARD
    computes on the FlatParameter itself (``_owns_buffer`` False): the unit's only copy of its
    parameters is gone (Note [freeing storage])."""
    if handle.is_unsharded:
        handle._buffer.untyped_storage().resize_(0)
        handle.is_unsharded = False


@replaces("flat_param.layout")
def aligns_to_four_elements(numels, world_size, align=1):
    """Reads "16-byte boundaries" as "multiples of 4 elements" and ignores ``align``: right for
    fp32, wrong for bf16, whose 16 bytes are 8 elements (Note [alignment])."""
    offsets, total = [], 0
    for n in numels:
        total = -(-total // 4) * 4
        offsets.append(total)
        total += n
    return offsets, -(-total // world_size) * world_size


@replaces("flat_param.shard")
def shard_of_the_global_rank(full, rank, world_size):
    """Takes this process's rank and the world's size from ``torch.distributed`` instead of
    the arguments: right on the default group, wrong on any other (Note [flat layout])."""
    import torch.distributed as dist

    s = full.numel() // dist.get_world_size()
    r = dist.get_rank()
    return full[r * s:(r + 1) * s]


@replaces("flat_param.views")
def views_of_the_detached_tensor(handle, flat):
    """Slices ``flat.detach()`` (or ``flat.data``): the views share the storage and hold the
    right values, but autograd no longer links them to the flat tensor, so backward never
    produces the flat gradient (Note [views, not copies])."""
    return [flat.detach()[i.offset:i.offset + i.numel].view(i.shape) for i in handle.infos]


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
                             case="flatten, align, pad and shard each unit",
                             name="unit (root): storage bytes behind the modules' views after "
                                  "construction",
                             hint="Note [views, not copies]"),
    "views_ignore_alignment": dict(status="diverged", world_sizes=(2,),
                                   name="unit (root): 2.bias (values)", hint="Note [alignment]"),
    "never_frees_the_storage": dict(status="diverged", world_sizes=(2,),
                                    name="unit (root): unsharded storage bytes after construction",
                                    hint="resize_(0)"),
    "frees_even_the_flat_parameter": dict(
        status="diverged", world_sizes=(2,),
        case="NO_SHARD keeps its bytes; a bf16 unit on a process group of one rank",
        name="NO_SHARD unit: FlatParameter bytes after reshard", hint="_owns_buffer"),
    "aligns_to_four_elements": dict(
        status="diverged", world_sizes=(2,),
        case="NO_SHARD keeps its bytes; a bf16 unit on a process group of one rank",
        name="bf16 unit on a group of one rank: padded numel", hint="8 in bf16"),
    "shard_of_the_global_rank": dict(
        status="diverged", world_sizes=(2,),
        case="NO_SHARD keeps its bytes; a bf16 unit on a process group of one rank",
        name="bf16 unit on a group of one rank: shard (padding zeroed)"),
    "views_of_the_detached_tensor": dict(
        status="diverged", world_sizes=(2,),
        name="unit (root): 2.weight is made by autograd from the unsharded flat tensor",
        hint="Note [views, not copies]"),
}
