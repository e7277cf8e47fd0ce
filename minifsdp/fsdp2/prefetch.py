"""Prefetching: issue a group's all-gather *before* its module needs it, so that the transfer
overlaps the computation of the module running now (chapter 06).

Without prefetching every all-gather sits on the critical path: the module waits for its
parameters, computes, the next module waits for its parameters, ...::

    no prefetch     AG b1 | bwd b1 | AG b0 | bwd b0          (AG = all-gather, on the wire)
    prefetch        AG b1 | bwd b1          | bwd b0
                            AG b0 ~~~~~~~~~~^ wait: already there

Note [issue and wait]: ``FSDPParamGroup.unshard`` is split in two. ``unshard(async_op=True)``
*issues*: copy-in into the group buffer, then ``all_gather_into_tensor(..., async_op=True)``,
keeping the work handle and the buffer (``group._in_flight``). ``wait_for_unshard()``
*finishes*: ``work.wait()``, copy-out into the unsharded parameters, register them, state
UNSHARDED, drop the buffer. Both are idempotent -- ``unshard`` does nothing while the group is
unsharded or its all-gather is in flight, ``wait_for_unshard`` nothing when none is -- so the
group's own pre-forward / pre-backward simply calls both, whether or not someone prefetched.
On gloo the collective runs on gloo's worker thread while the main thread computes; but on a
CPU that thread copies the bytes with the cores the compute needs, so on few cores a timing
measures contention for them, not overlap. Chapter 06 shows the overlap on a simulated link
instead (Note [simulated link] in ``minifsdp/simulated_link.py``), with gloo's own time beside
it; on GPUs NCCL's stream makes it real.

Note [which group is next]: a prefetch must guess the next group. Three sources, as in torch:
  * implicit backward (on by default, torch's behaviour): backward runs the groups in the
    reverse of their *post-forward* order, which this forward recorded (with multiplicity:
    a module run twice is there twice). A group's pre-backward, after waiting for its own
    all-gather, issues the one before it in that order. For the GPT: the root's pre-backward
    (on the logits) issues the last block's, block i's issues block i-1's.
  * implicit forward (off by default): the previous forward's *pre-forward* order is the
    guess for this one; a group's pre-forward issues the group that followed it last time, as
    long as this forward has matched the last one so far. Off by default because torch has
    no such switch: on GPUs its forward overlaps without one (Note [prefetch on GPUs]); on
    CPU torch's forward does not overlap at all. ``FSDPModule.set_implicit_prefetch`` (ours
    only) turns it on.
  * explicit: ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` give
    a module the list of modules to issue after its own all-gather; a list *replaces* the
    implicit guess of that module (also for more than one module ahead, at more memory).
    The first block has no predecessor to prefetch it: ``model.blocks[0].unshard(
    async_op=True)`` before the forward does, or the root's list.

Note [same order on every rank]: a prefetch is a collective, so every rank must issue the
same prefetches in the same order -- else rank 0's all-gather of block 3 meets rank 1's of
block 2 (gloo: a size mismatch or a hang; NCCL: a hang or garbage). The guesses above depend
only on the modules' execution order, which data parallelism keeps identical across ranks
(as it must: the non-prefetched all-gathers have the same requirement). Explicit lists must
be set alike on every rank. Nothing here depends on timing: prefetches are issued at fixed
points of the hooks, never "when the network looks idle".

Note [mistargeted prefetches]: a guess can be wrong (a module skipped this time, an eval
forward that never runs backward). An all-gather in flight must still be waited for -- every
rank issued it -- but its result is stale once the optimizer has changed the shards, so it
is *discarded* (``group.discard_unshard()``): at the end of the root's forward for forward
prefetches that no forward consumed, at the end of backward for backward ones, and in
``reshard()``. Then the group unshards normally when it runs.

Note [prefetch memory]: a prefetched group's all-gather buffer (N padded shards: the size of
its unsharded parameters) lives from the issue to the copy-out, i.e. while the current group
is unsharded and computing: two groups' parameters at once instead of one (three with a
list of two). The peak of what we allocate grows by up to one group's unsharded size when it
falls in such a window (tests/test_fsdp2_prefetch.py measures it). On CPU the *total* peak
also moves between runs, by up to about a group, through untagged memory (``other``) freed at
moments no program order fixes (gloo's worker thread holds tensors past ``wait()``: ``_free``
in fsdp_param_group.py); the test compares the peak of the tagged categories, which is
deterministic (measured: the same bytes in every run, on a loaded machine too).

Note [prefetch on GPUs] (untested here: this machine has no GPU). torch uses two extra
streams. ``unshard`` runs the copy-in on ``all_gather_copy_in_stream`` and the NCCL
all-gather on ``all_gather_stream`` (each waiting on the previous copy-out's event);
``wait_for_unshard`` makes the current (compute) stream wait on the all-gather's event and
copies out there. Since the CPU enqueues kernels far ahead of the GPU, the next group's
copy-in and all-gather are already queued on their streams while the current group's
kernels run: forward overlaps with no prefetch logic at all ("implicit forward prefetch").
Tensors made on one stream and used on another must not be recycled by the caching
allocator too early; rather than ``record_stream``, torch keeps the previous all-gather
output alive (``comm_ctx.all_gather_state``) until the next copy-out's event.
We use one stream plus NCCL's own: the copy-in runs on the current stream, the async
collective on ProcessGroupNCCL's internal stream -- which first waits for everything queued on
the current stream, the copy-in included -- and ``work.wait()`` makes the current stream wait
for the collective, so the copy-out and everything after it are ordered after it. We hold the
buffer until the copy-out is queued and only then free it (``resize_(0)``); the allocator can
hand the block only to later work on the current stream, which runs after the copy-out: no
``record_stream`` needed. The consequence: an all-gather issued *before* the current
group's kernels are queued (a prefetch, issued in the pre-forward/pre-backward hook) overlaps
them; one issued just in time (no prefetch) waits for all earlier kernels, so on GPUs our
forward overlaps only with forward prefetch (implicit or explicit), and our copy-in never
overlaps compute.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from minifsdp.fsdp2.fsdp_param_group import FSDPParamGroup
    from minifsdp.fsdp2.fsdp_state import FSDPState, _RootContext


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns (torch: ``UnshardHandle``).

    Example (prefetch the first block before the forward; its pre-forward waits, or wait by
    hand)::

        handle = model.blocks[0].unshard(async_op=True)   # the all-gather is on the wire
        loss = loss_fn(model(x), y)                        # blocks.0's pre-forward waits
    """

    def __init__(self, groups: list[FSDPParamGroup]):
        self._groups = groups

    def wait(self) -> None:
        """Wait for the all-gather and register the unsharded parameters on the module."""
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []  # keep no reference (torch does the same)


def issue(groups: Iterable[FSDPParamGroup | None]) -> None:
    """Issue each group's all-gather, async, in the given order (Note [same order on every
    rank]); no-ops for groups unsharded or in flight already, and, inside a backward, for
    those that do not unshard there (Note [no all-gather in backward] in fsdp_param_group.py)."""
    # fsdp_state._in_backward's test, inline: fsdp_state imports this module, not the reverse
    in_backward = torch._C._current_graph_task_id() != -1
    for group in groups:
        if group is not None and (group.unshard_in_backward or not in_backward):
            group.unshard(async_op=True)


# ---- the hooks' share (called by FSDPState) --------------------------------------------------

def begin_forward(ctx: _RootContext) -> None:
    """The root's pre-forward: the forward that just ended becomes the guess for this one."""
    ctx.last_forward_order, ctx.forward_order, ctx.on_track = ctx.forward_order, [], True


def after_pre_forward(state: FSDPState) -> None:
    """A pre-forward, after its own all-gather finished: record the group's place in this
    forward, then issue the next all-gather(s) (Note [which group is next])."""
    ctx = state.ctx
    if state.group is not None:
        k, last = len(ctx.forward_order), ctx.last_forward_order
        ctx.on_track = ctx.on_track and k < len(last) and last[k] is state.group
        ctx.forward_order.append(state.group)
    if state.forward_prefetch:  # explicit lists replace the guess
        issue(s.group for s in state.forward_prefetch)
    elif state.implicit_forward_prefetch and ctx.on_track:
        k = len(ctx.forward_order)
        issue(ctx.last_forward_order[k:k + 1])


def after_post_forward(state: FSDPState) -> None:
    """A post-forward: record the group's place in the order backward will reverse."""
    if state.group is not None and torch.is_grad_enabled():
        state.post_forward_indices.append(len(state.ctx.post_forward_order))
        state.ctx.post_forward_order.append(state.group)


def end_forward(ctx: _RootContext) -> None:
    """The root's post-forward: drop forward prefetches no module used (Note [mistargeted
    prefetches])."""
    for state in ctx.states:
        if state.group is not None:
            state.group.discard_unshard()


def after_pre_backward(state: FSDPState) -> None:
    """A pre-backward, after its own all-gather finished: issue the group(s) whose backward
    comes next."""
    indices = state.post_forward_indices
    i = indices.pop() if indices else None
    if state.backward_prefetch:
        issue(s.group for s in state.backward_prefetch)
    elif state.implicit_backward_prefetch and i:  # i = 0: the first group, none before it
        issue([state.ctx.post_forward_order[i - 1]])


def end_backward(ctx: _RootContext) -> None:
    """End of backward: drop backward prefetches no module used, forget this forward's
    order."""
    for state in ctx.states:
        if state.group is not None:
            state.group.discard_unshard()
        state.post_forward_indices.clear()
    ctx.post_forward_order.clear()
