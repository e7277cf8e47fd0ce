"""Lab 05's planted bugs: layout copies and state changes a learner plausibly gets wrong (Note
[copy-in and copy-out], Note [padding], Note [dim-0 chunks], Note [version counter], Note
[freeing with resize_], Note [issue and wait], Note [reshard to k ranks]).

Each function replaces one seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

import torch

from minifsdp import comm
from minifsdp.fsdp2.fsdp_param import chunk_dim0
from minifsdp.fsdp2.fsdp_param_group import ShardedState
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


def _copy_in(params, grads, n, dtype, slot_of=lambda r: r, chunks=chunk_dim0,
             alloc=torch.Tensor.new_zeros):
    """Note [copy-in and copy-out]'s layout, chunk r of each gradient (``chunks``; right:
    ``chunk_dim0``) into slot ``slot_of(r)`` (right: r), each padded to its padded shard
    numel, in a buffer from ``alloc`` (right: zeros)."""
    slot_numel = sum(p.padded_shard_numel for p in params)
    flat = alloc(grads[0], n * slot_numel, dtype=dtype)
    tag(flat, "comm")
    slots = flat.view(n, slot_numel)
    for r in range(n):
        offset = 0
        for p, g in zip(params, grads):
            chunk = chunks(g, n)[r].reshape(-1)
            slots[slot_of(r), offset: offset + chunk.numel()].copy_(chunk)
            offset += p.padded_shard_numel
    return flat


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
    return _copy_in(params, grads, n, dtype, slot_of=lambda r: (r + 1) % n)


@replaces("fsdp2.reduce_scatter_copy_in")
@torch.no_grad()
def lays_out_every_parameter_of_the_group(group, params, grads, dtype):
    """Walks ``group.fsdp_params`` instead of the ``params`` it was given: right while every
    parameter has a gradient, but a frozen one (or one unused in this backward) has none, and
    then every slot is too long and later gradients land in earlier parameters' places."""
    return _copy_in(group.fsdp_params, grads, group.world_size, dtype)


@replaces("fsdp2.reduce_scatter_copy_in")
@torch.no_grad()
def leaves_the_padding_unwritten(group, params, grads, dtype):
    """Allocates the buffer with ``new_empty`` and writes only the chunks: the padding holds
    whatever the allocator handed back -- often zeros, so this passed by luck -- and is
    reduced into the padded rows (Note [padding]: padding is zero)."""
    return _copy_in(params, grads, group.world_size, dtype, alloc=torch.Tensor.new_empty)


@replaces("fsdp2.all_gather_copy_out")
@torch.no_grad()
def never_copies(group, gathered, world):
    """Allocates the unsharded buffers and stops, as if alloc_unsharded() already held the
    gathered values: every parameter keeps whatever the buffer held before (Note [copy-in and
    copy-out]). The old checker filled that very buffer with the expected values first."""
    _outs(group, world)


@replaces("fsdp2.all_gather_copy_out")
@torch.no_grad()
def slots_of_the_group_not_the_buffer(group, gathered, world):
    """Views the buffer as ``group.world_size`` rows instead of ``world``: right at N slots,
    wrong after ``reshard_after_forward=k``, whose buffer has k (Note [reshard to k ranks])."""
    outs = _outs(group, world)
    n = group.world_size
    rows = gathered.view(n, -1).split([p.padded_shard_numel for p in group.fsdp_params], dim=1)
    with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
        for out, piece in zip(outs, rows):
            out.copy_(piece.reshape(out.shape))


@replaces("fsdp2.all_gather_copy_out")
@torch.no_grad()
def new_storage_through_data(group, gathered, world):
    """Builds each parameter in fresh memory and swaps it in with ``.data =``: the values are
    right, but reshard's ``resize_(0)`` frees the old buffer, not this one, so every step
    keeps the unsharded parameters alive (Note [freeing with resize_])."""
    outs = _outs(group, world)
    rows = gathered.view(world, -1).split([o.shape[1] for o in outs], dim=1)
    for p, piece in zip(group.fsdp_params, rows):
        full = piece.reshape(-1).clone()
        p.unsharded_param.data = full[: p.unsharded_param.numel()].view(p.unsharded_param.shape)


@replaces("fsdp2.reduce_scatter_copy_in")
@torch.no_grad()
def rows_split_by_tensor_split(group, params, grads, dtype):
    """Splits each gradient's rows with ``torch.tensor_split`` (sizes differ by at most one)
    instead of ``torch.chunk`` (ceil-sized, the last short or empty): the same for 5 or 6 rows
    at N = 3, not for 7 (3, 2, 2 against 3, 3, 1) (Note [dim-0 chunks])."""
    return _copy_in(params, grads, group.world_size, dtype, chunks=torch.tensor_split)


# ---- unshard, wait_for_unshard, reshard ---------------------------------------------------------


def _register(p, param):
    for module, name in p.owners:
        setattr(module, name, param)


def _unshard(group, async_op, *, skip_unsharded=True, use_piece=True, wait=True,
             skip_one_rank=True):
    """The package's unshard, with one of its decisions switched off by a bug below."""
    if group._in_flight is not None or (
            skip_unsharded and group.sharded_state is ShardedState.UNSHARDED):
        return
    if use_piece and group.sharded_state is ShardedState.SHARDED_POST_FORWARD:
        my_slot, gathered = group._post_forward_copy_in()
        pg, world = group.post_forward_ranks.group, group.post_forward_ranks.size
    else:
        my_slot, gathered = group._all_gather_copy_in()
        pg, world = group.process_group, group.world_size
    work = None
    if world > 1 or not skip_one_rank:
        work = comm.all_gather_into_tensor(gathered, my_slot, pg, async_op and not wait,
                                           tag=f"fsdp2 params {group.name}")
    group._in_flight = (work, gathered, world)
    if not async_op or wait:
        group.wait_for_unshard()


@replaces("fsdp2.unshard")
def waits_even_when_asked_not_to(group, async_op=False):
    """Always finishes the all-gather before returning, ignoring ``async_op``: right values,
    but a prefetch then waits where it meant only to issue, and nothing overlaps (Note [issue
    and wait])."""
    _unshard(group, async_op, wait=True)


@replaces("fsdp2.unshard")
def gathers_again_while_unsharded(group, async_op=False):
    """Returns early only while an all-gather is in flight, not when the group is already
    unsharded: the root's pre-backward (unsharded since forward) all-gathers again, the
    same values for a whole collective's bytes (Note [issue and wait])."""
    _unshard(group, async_op, skip_unsharded=False, wait=not async_op)


@replaces("fsdp2.unshard")
def ignores_the_piece_kept_for_k_ranks(group, async_op=False):
    """Gathers the shards over all N ranks whatever the state: the values are right, but after
    ``reshard_after_forward=k`` the backward all-gather should stay within k ranks, from the
    piece kept for it (Note [reshard to k ranks])."""
    _unshard(group, async_op, use_piece=False, wait=not async_op)


@replaces("fsdp2.unshard")
def gathers_over_one_rank(group, async_op=False):
    """All-gathers whatever the group's size: right values, but over one rank (a mesh (R, 1),
    one GPU, the piece kept for k = 1) the copy-in already filled the buffer, and the
    collective is one more call per group per step that torch does not make (Note [a shard
    group of one rank])."""
    _unshard(group, async_op, skip_one_rank=False, wait=not async_op)


def _wait(group, *, free=True, only_trainable=False):
    if group._in_flight is None:
        return
    work, gathered, world = group._in_flight
    if work is not None:
        work.wait()
    group._all_gather_copy_out(gathered, world)
    if free:
        gathered.untyped_storage().resize_(0)
    group._post_forward_data = None
    for p in group.fsdp_params:
        if not only_trainable or p.sharded_param.requires_grad:
            _register(p, p.unsharded_param)
    group.sharded_state = ShardedState.UNSHARDED
    group._in_flight = None


@replaces("fsdp2.wait_for_unshard")
def drops_the_buffer_instead_of_freeing_it(group):
    """Lets the all-gather buffer go by dropping ``_in_flight``, trusting the garbage
    collector: gloo's thread may still hold it, so its bytes die at a moment no one chose
    (Note [freeing with resize_])."""
    _wait(group, free=False)


@replaces("fsdp2.wait_for_unshard")
def registers_only_trainable_parameters(group):
    """Puts the unsharded parameter on the modules only where it requires grad, as if frozen
    parameters could stay sharded: the frozen layer computes with its DTensor shard (Note
    [the tensors of one parameter])."""
    _wait(group, only_trainable=True)


def _reshard(group, *, free=True, drop=False):
    group.discard_unshard()
    group._post_forward_data = None
    if group.sharded_state is ShardedState.UNSHARDED:
        for p in group.fsdp_params:
            _register(p, p.sharded_param)
            if free:
                p._unsharded_data.untyped_storage().resize_(0)
            if drop:
                p.unsharded_param = p._unsharded_data = None
    group.sharded_state = ShardedState.SHARDED


@replaces("fsdp2.reshard")
def registers_the_shards_but_keeps_the_storage(group):
    """Puts the sharded DTensors back on the modules and stops: the values are right and the
    modules look resharded, but every unsharded parameter keeps its bytes (Note [freeing
    with resize_])."""
    _reshard(group, free=False)


@replaces("fsdp2.reshard")
def drops_the_unsharded_tensors(group):
    """Frees by forgetting the unsharded tensors (``p.unsharded_param = None``): the tensors
    autograd saved in forward keep the bytes alive, and the next unshard makes new tensors
    that backward never sees (Note [freeing with resize_])."""
    _reshard(group, free=False, drop=True)


# What the checker must say about each bug: the report's status, the jobs to run (the smallest
# that shows the bug), and where the first divergence is (case, checked value) or the line.
COPY_OUT_CASE = "copy-out of one group (7 and 10 rows; N slots and 1; fp32 and bf16)"
UNSHARD_CASE = ("unshard and reshard of one group (blocking, issued then waited, dropped in "
                "flight, from a piece kept for k ranks)")
EXPECTED = {
    "reads_the_buffer_parameter_major": dict(
        status="diverged", world_sizes=(2,), phase="copy-out", case=COPY_OUT_CASE,
        name="0.weight, unsharded from a 2-rank buffer, fp32",
        hint="the all-gather buffer is rank-major"),
    "overwrites_saved_tensors_unseen": dict(
        status="diverged", world_sizes=(2,), phase="copy-out", case=COPY_OUT_CASE,
        name="0.weight: version counter unchanged by the copy-out (2-rank buffer, fp32)",
        hint="Note [version counter]"),
    "drops_the_padding": dict(status="diverged", world_sizes=(2,), phase="copy-in",
                              name="reduce-scatter input (2 slots, padding zero, fp32)"),
    "chunk_r_into_the_next_slot": dict(status="diverged", world_sizes=(2,), phase="copy-in",
                                       name="reduce-scatter input (2 slots, padding zero, fp32)",
                                       hint="rank blocks permuted"),
    "leaves_the_padding_unwritten": dict(status="diverged", world_sizes=(2,), phase="copy-in",
                                         name="reduce-scatter input (2 slots, padding zero, "
                                              "fp32)", hint="uninitialised memory"),
    "lays_out_every_parameter_of_the_group": dict(
        status="diverged", world_sizes=(2,), phase="copy-in",
        name="reduce-scatter input (2 slots, padding zero, fp32, only 5 of 6 parameters with a "
             "gradient)", hint="lay out the parameters you are given"),
    "never_copies": dict(status="diverged", world_sizes=(2,), phase="copy-out",
                         case=COPY_OUT_CASE, name="0.weight, unsharded from a 2-rank buffer, fp32",
                         hint="never wrote"),
    "slots_of_the_group_not_the_buffer": dict(
        status="diverged", world_sizes=(2,), phase="copy-out", case=COPY_OUT_CASE,
        name="0.weight, unsharded from a 1-rank buffer, fp32 (reshard_after_forward=k)",
        hint="Note [reshard to k ranks]"),
    "new_storage_through_data": dict(
        status="diverged", world_sizes=(2,), phase="copy-out", case=COPY_OUT_CASE,
        name="0.weight: the unsharded parameter still views its own buffer (2-rank buffer, fp32)",
        hint="Note [freeing with resize_]"),
    "rows_split_by_tensor_split": dict(
        status="diverged", world_sizes=(3,), phase="copy-in",
        name="reduce-scatter input (3 slots, padding zero, fp32)", hint="Note [dim-0 chunks]"),
    "waits_even_when_asked_not_to": dict(
        status="diverged", world_sizes=(2,), case=UNSHARD_CASE, phase="unshard",
        name="fp32: sharded_state after unshard(async_op=True), twice",
        hint="only issues"),
    "gathers_again_while_unsharded": dict(
        status="diverged", world_sizes=(2,), case=UNSHARD_CASE, phase="unshard",
        name="fp32: the collectives of unshard() while unsharded (op, tag, ranks, input bytes)",
        hint="none otherwise"),
    "ignores_the_piece_kept_for_k_ranks": dict(
        status="diverged", world_sizes=(2,), case=UNSHARD_CASE, phase="unshard",
        name="fp32: the collectives of unshard() from SHARDED_POST_FORWARD (k = 1) (op, tag, "
             "ranks, input bytes)", hint="Note [reshard to k ranks]"),
    "gathers_over_one_rank": dict(
        status="diverged", world_sizes=(2,), case=UNSHARD_CASE, phase="unshard",
        name="fp32: the collectives of unshard() from SHARDED_POST_FORWARD (k = 1) (op, tag, "
             "ranks, input bytes)", hint="over a group of one rank it issues none"),
    "drops_the_buffer_instead_of_freeing_it": dict(
        status="diverged", world_sizes=(2,), case=UNSHARD_CASE, phase="unshard",
        name="fp32: bytes behind the all-gather buffer after unshard()",
        hint="Note [freeing with resize_]"),
    "registers_only_trainable_parameters": dict(
        status="diverged", world_sizes=(2,), case=UNSHARD_CASE, phase="unshard",
        name="1.bias: its module holds the unsharded parameter after unshard()",
        hint="p.owners"),
    "registers_the_shards_but_keeps_the_storage": dict(
        status="diverged", world_sizes=(2,), case=UNSHARD_CASE, phase="reshard",
        name="fp32: bytes behind the unsharded parameters after reshard()",
        hint="resize_(0)"),
    "drops_the_unsharded_tensors": dict(
        status="diverged", world_sizes=(2,), case=UNSHARD_CASE, phase="reshard",
        name="0.weight: the same unsharded tensor object after reshard() (autograd saved it)",
        hint="never replaced"),
}
