"""Lab 04's planted bugs: FlatParameter mistakes a learner plausibly makes (Note [flat layout],
Note [alignment], Note [views, not copies], Note [freeing storage], Note [two tensors, one
storage]; Note [divide before and after] and Note [final callback] in fully_sharded.py).

Each function replaces one seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

import torch

from minifsdp import comm
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



@replaces("flat_param.unshard")
def gathers_into_a_new_tensor(handle, tag_=None):
    """All-gathers into a freshly allocated tensor and points the handle at it: the modules'
    new views are right, but the views made before the free -- those autograd saved for
    backward -- still point at the old, empty storage (Note [freeing storage], Note [two
    tensors, one storage])."""
    if handle.is_unsharded:
        return
    full = torch.empty(handle.padded_numel, dtype=handle.compute_dtype, device=handle.device)
    with torch.no_grad():
        if handle.sharded:
            comm.all_gather_into_tensor(full, handle.gather_input(), handle.process_group,
                                        tag=tag_)
        else:
            full.copy_(handle.flat_param)
    handle._buffer = full
    handle.unsharded.data = full
    handle.is_unsharded = True


@replaces("flat_param.unshard")
def gathers_over_the_default_group(handle, tag_=None):
    """Leaves out ``group=``: right while the unit is sharded over every rank, a shard of the
    wrong size for any other group (Note [flat layout])."""
    if handle.is_unsharded:
        return
    buf = handle._buffer
    buf.untyped_storage().resize_(buf.numel() * buf.element_size())
    with torch.no_grad():
        if handle.sharded:
            comm.all_gather_into_tensor(buf, handle.gather_input(), tag=tag_)
        else:
            buf.copy_(handle.flat_param)
    handle.is_unsharded = True


@replaces("flat_param.unshard")
def gathers_even_when_unsharded(handle, tag_=None):
    """Forgets the early return: a unit that is already whole (the root between its forward and
    its backward, a prefetched unit) is all-gathered again, one collective too many."""
    buf = handle._buffer
    buf.untyped_storage().resize_(buf.numel() * buf.element_size())
    with torch.no_grad():
        if handle.sharded:
            comm.all_gather_into_tensor(buf, handle.gather_input(), handle.process_group,
                                        tag=tag_)
        else:
            buf.copy_(handle.flat_param)
    handle.is_unsharded = True


@replaces("flat_param.unshard")
def gathers_into_the_leaf(handle, tag_=None):
    """All-gathers into ``handle.unsharded``, the leaf the views are made from, instead of
    ``handle._buffer``: the same storage and the same values, but the write bumps the version
    counter the leaf shares with every view autograd saved, and backward refuses them
    (Note [two tensors, one storage])."""
    if handle.is_unsharded:
        return
    buf = handle._buffer
    buf.untyped_storage().resize_(buf.numel() * buf.element_size())
    with torch.no_grad():
        if handle.sharded:
            comm.all_gather_into_tensor(handle.unsharded, handle.gather_input(),
                                        handle.process_group, tag=tag_)
        else:
            buf.copy_(handle.flat_param)
    handle.is_unsharded = True


def _reduce(handle, grad, before, after, tag_, *, free=True, wait_now=False,
            op="reduce_scatter"):
    """The reference's shape with knobs for the bugs below."""
    if before != 1:
        grad.div_(before)
    if op == "reduce_scatter" and handle.sharded:
        out = grad.new_empty(handle.shard_numel)
        work = comm.reduce_scatter_tensor(out, grad, group=handle.process_group,
                                          async_op=not wait_now, tag=tag_)
    else:
        out = grad
        work = comm.all_reduce(grad, group=handle.process_group, async_op=not wait_now,
                               tag=tag_)
        if handle.sharded:  # all-reduced, then sliced
            s = handle.shard_numel
            out = grad[handle.rank * s:(handle.rank + 1) * s]

    def finish():
        if work is not None:
            work.wait()
        if free and out.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr():
            grad.untyped_storage().resize_(0)
        if after != 1:
            out.div_(after)
        return out
    return finish


@replaces("flat_param.reduce_scatter")
def never_divides(handle, grad, divide, tag_=None):
    """Reduce-scatters with SUM and stops there: each shard holds the sum over ranks, not the
    average (Note [divide before and after])."""
    return _reduce(handle, grad, 1.0, 1.0, tag_)


@replaces("flat_param.reduce_scatter")
def divides_by_n_twice(handle, grad, divide, tag_=None):
    """Divides by N before the sum and by N again after it, reading "divide before and after"
    as "divide by N before and after": the average over N ranks, divided by N once more."""
    n = handle.world_size
    return _reduce(handle, grad, float(n), float(n), tag_)


@replaces("flat_param.reduce_scatter")
def divides_only_after_the_sum(handle, grad, divide, tag_=None):
    """Sums first and divides by N after (what ReduceOp.AVG does on gloo): the same bits in
    fp32, but a low-precision sum overflows that torch's pre-division keeps in range
    (Note [divide before and after])."""
    return _reduce(handle, grad, 1.0, float(handle.world_size), tag_)


@replaces("flat_param.reduce_scatter")
def waits_inside_reduce_grad(handle, grad, divide, tag_=None):
    """Issues a blocking reduce-scatter and returns a ``finish`` with nothing left to wait for:
    right values, but nothing can overlap the collective where devices have streams
    (Note [final callback])."""
    return _reduce(handle, grad, *divide, tag_, wait_now=True)


@replaces("flat_param.reduce_scatter")
def keeps_the_flat_gradient(handle, grad, divide, tag_=None):
    """Never frees the unsharded gradient's storage: on gloo it lives until gloo's thread lets
    go of the work, a second unit's worth of gradient at the peak (Note [final callback])."""
    return _reduce(handle, grad, *divide, tag_, free=False)


@replaces("flat_param.reduce_scatter")
def all_reduces_and_slices(handle, grad, divide, tag_=None):
    """All-reduces the whole flat gradient, as DDP would, and keeps this rank's slice: the right
    numbers for 2(N-1)/N of the bytes where a reduce-scatter sends (N-1)/N, and every rank
    holds the whole sum for a while."""
    return _reduce(handle, grad, *divide, tag_, op="all_reduce")


@replaces("flat_param.reduce_scatter")
def forgets_the_padding(handle, grad, divide, tag_=None):
    """Reduce-scatters only the parameters' elements, up to the end of the last one, as if the
    padding were not part of the flat gradient: N parts of that are not the N equal shards the
    padding exists for (Note [flat layout])."""
    before, after = divide
    end = max(i.offset + i.numel for i in handle.infos)
    grad = grad[:end].div_(before)
    out = grad.new_empty(-(-end // handle.world_size))
    work = comm.reduce_scatter_tensor(out, grad, group=handle.process_group, async_op=True,
                                      tag=tag_)

    def finish():
        work.wait()
        return out.div_(after)
    return finish

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
    "gathers_into_a_new_tensor": dict(
        status="diverged", world_sizes=(2,),
        case="unshard: the original names are views of the gathered flat tensor",
        name="unit (root): 2.weight, through the view made before the free: storage bytes after "
             "unshard", hint="Note [two tensors, one storage]"),
    "gathers_into_the_leaf": dict(
        status="diverged", world_sizes=(2,),
        name="unit (root): version counter of handle.unsharded (and of the views autograd "
             "saved) after unshard", hint="Note [two tensors, one storage]"),
    "gathers_over_the_default_group": dict(status="crash", world_sizes=(2,),
                                           where="lab04.py:150"),
    "gathers_even_when_unsharded": dict(
        status="diverged", world_sizes=(2,),
        name="unit (root): collectives of two unshard() calls (op, tag, input shape, dtype, "
             "group size)", hint="already unsharded"),
    "never_divides": dict(status="diverged", world_sizes=(2,),
                          name="reduce_grad, fp32: this rank's part of the average",
                          hint="not divided by N at all"),
    "divides_by_n_twice": dict(status="diverged", world_sizes=(3,),
                               name="reduce_grad, fp32: this rank's part of the average",
                               hint="divided by N twice"),
    "divides_only_after_the_sum": dict(
        status="diverged", world_sizes=(2,),
        name="reduce_grad, fp16 near overflow: this rank's part of the average",
        hint="overflowed"),
    "waits_inside_reduce_grad": dict(
        status="diverged", world_sizes=(2,),
        name="reduce_grad, fp32: collectives issued before finish() (op, not yet waited for)",
        hint="async_op=True"),
    "keeps_the_flat_gradient": dict(
        status="diverged", world_sizes=(2,),
        name="reduce_grad, fp32: storage bytes behind the flat gradient after finish()",
        hint="resize_(0)"),
    "all_reduces_and_slices": dict(
        status="diverged", world_sizes=(2,),
        name="reduce_grad, fp32: collectives issued before finish() (op, not yet waited for)",
        hint="a reduce-scatter of the whole padded"),
    "forgets_the_padding": dict(status="crash", world_sizes=(2,),
                                where="lab04.py:273"),
}
