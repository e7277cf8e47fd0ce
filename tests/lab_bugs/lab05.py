"""Lab 05's planted bugs: layout copies a learner plausibly gets wrong (Note [copy-in and
copy-out], Note [padding], Note [version counter]).

Each function replaces one seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

import torch

from minifsdp.fsdp2.fsdp_param import chunk_dim0
from minifsdp.labs.seams import replaces
from minifsdp.memory import tag


def _outs(group, world):
    outs = []
    for p in group.fsdp_params:
        buf = p.alloc_unsharded()
        tag(buf, "params", label=group.name)
        outs.append(buf.view(world, -1))
    return outs


@replaces("fsdp2.all_gather_copy_out")
@torch.no_grad()
def reads_the_buffer_parameter_major(group, gathered, world):
    """Takes parameter i's N pieces as one contiguous block of the buffer, as if the
    all-gather had put all of parameter 0 first: but the buffer is rank-major (Note [copy-in
    and copy-out])."""
    outs = _outs(group, world)
    with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
        for out, piece in zip(outs, gathered.split([o.numel() for o in outs])):
            out.copy_(piece.view(out.shape))


@replaces("fsdp2.all_gather_copy_out")
@torch.no_grad()
def overwrites_saved_tensors_unseen(group, gathered, world):
    """The right copy, but not under ``_unsafe_preserve_version_counter``: the backward's
    all-gather writes into the weights autograd saved in forward, and autograd refuses them
    (Note [version counter])."""
    outs = _outs(group, world)
    sizes = [p.padded_shard_numel * group.world_size // world for p in group.fsdp_params]
    torch.split_with_sizes_copy(gathered.view(world, -1), sizes, dim=1, out=outs)


@replaces("fsdp2.reduce_scatter_copy_in")
@torch.no_grad()
def drops_the_padding(group, params, grads, dtype):
    """Lays each slot's chunks back to back without padding them to the padded shard size:
    on the rank whose chunk is short, every later parameter's rows start too early (Note
    [padding])."""
    n = group.world_size
    slot_numel = sum(p.padded_shard_numel for p in params)
    flat = grads[0].new_zeros(n * slot_numel, dtype=dtype)
    tag(flat, "comm")
    for r, slot in enumerate(flat.view(n, slot_numel)):
        mine = torch.cat([chunk_dim0(g, n)[r].reshape(-1) for g in grads])
        slot[: mine.numel()].copy_(mine)
    return flat


@replaces("fsdp2.reduce_scatter_copy_in")
@torch.no_grad()
def chunk_r_into_the_next_slot(group, params, grads, dtype):
    """Puts chunk r into slot r + 1 (an offset of ``(r + 1) * slot_numel``): rank r then
    receives, and keeps as its gradient, its left neighbour's rows (Note [copy-in and
    copy-out])."""
    n = group.world_size
    slot_numel = sum(p.padded_shard_numel for p in params)
    flat = grads[0].new_zeros(n * slot_numel, dtype=dtype)
    tag(flat, "comm")
    slots = flat.view(n, slot_numel)
    for r in range(n):
        offset = 0
        for p, g in zip(params, grads):
            chunk = chunk_dim0(g, n)[r].reshape(-1)
            slots[(r + 1) % n, offset: offset + chunk.numel()].copy_(chunk)
            offset += p.padded_shard_numel
    return flat


# What the checker must say about each bug: the report's status, the jobs to run (the smallest
# that shows the bug), and where the first divergence is (case, checked value) or the line.
EXPECTED = {
    "reads_the_buffer_parameter_major": dict(
        status="diverged", world_sizes=(2,), phase="copy-out",
        name="body.0.weight, unsharded (element = rank * 1000 + index in the slot)",
        hint="the all-gather buffer is rank-major"),
    "overwrites_saved_tensors_unseen": dict(status="crash", world_sizes=(2,),
                                            hint="modified by an inplace operation"),
    "drops_the_padding": dict(status="diverged", world_sizes=(2,), phase="copy-in",
                              name="reduce-scatter input (N slots, padding zero)"),
    "chunk_r_into_the_next_slot": dict(status="diverged", world_sizes=(2,), phase="copy-in",
                                       name="reduce-scatter input (N slots, padding zero)",
                                       hint="rank blocks permuted"),
}
