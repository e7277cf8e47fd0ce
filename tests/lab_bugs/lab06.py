"""Lab 06's planted bugs: prefetch schedules a learner plausibly gets wrong (Note [which group
is next], Note [same order on every rank]).

Each function replaces one seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

import torch.distributed as dist

from minifsdp.fsdp2.prefetch import issue
from minifsdp.labs.seams import replaces


@replaces("prefetch.backward")
def prefetches_its_own_group(state):
    """Issues ``post_forward_order[i]``, the group whose backward runs now, instead of the one
    before it: a no-op (its all-gather is done), so nothing is ever prefetched in backward."""
    indices = state.post_forward_indices
    i = indices.pop() if indices else None
    if state.backward_prefetch:
        issue(s.group for s in state.backward_prefetch)
    elif state.implicit_backward_prefetch and i is not None:
        issue([state.ctx.post_forward_order[i]])


@replaces("prefetch.backward")
def forward_order_in_backward(state):
    """Prefetches the group that comes *after* this one in post-forward order, as forward
    would: in backward that group has already run, so its all-gather is stale and thrown away
    (Note [mistargeted prefetches]), and the group that does run next waits for its own."""
    indices = state.post_forward_indices
    i = indices.pop() if indices else None
    if state.backward_prefetch:
        issue(s.group for s in state.backward_prefetch)
    elif state.implicit_backward_prefetch and i is not None:
        issue(state.ctx.post_forward_order[i + 1:i + 2])


@replaces("prefetch.backward")
def wraps_around_at_the_first_group(state):
    """Tests ``i is not None`` where the reference tests ``i`` (i > 0): the first group's
    backward, which comes last, issues ``order[-1]``. With a root holding parameters that is
    the root (unsharded: a no-op, the bug hides); under a parameter-less root it is the last
    unit, all-gathered for nothing (Note [which group is next])."""
    indices = state.post_forward_indices
    i = indices.pop() if indices else None
    if state.backward_prefetch:
        issue(s.group for s in state.backward_prefetch)
    elif state.implicit_backward_prefetch and i is not None:
        issue([state.ctx.post_forward_order[i - 1]])


@replaces("prefetch.backward")
def never_prefetches(state):
    """Keeps the bookkeeping, forgets the prefetch: each all-gather waits until its own group's
    hook, on the critical path (the ladder at the top of prefetch.py)."""
    indices = state.post_forward_indices
    if indices:
        indices.pop()


@replaces("prefetch.forward")
def prefetches_past_the_last_group(state):
    """Indexes ``last_forward_order[k]`` without asking whether the last forward had a k-th
    group: the last group's pre-forward reads one past the end (Note [which group is next])."""
    ctx = state.ctx
    if state.group is not None:
        k, last = len(ctx.forward_order), ctx.last_forward_order
        ctx.on_track = ctx.on_track and k < len(last) and last[k] is state.group
        ctx.forward_order.append(state.group)
    if state.forward_prefetch:
        issue(s.group for s in state.forward_prefetch)
    elif state.implicit_forward_prefetch and ctx.on_track:
        issue([ctx.last_forward_order[len(ctx.forward_order)]])


@replaces("prefetch.backward")
def only_rank_0_prefetches(state):
    """Lets one rank "lead" the prefetching: rank 0 issues the next all-gather, the others wait
    for their own group's hook. Rank 0's all-gather meets the others' reduce-scatter (Note
    [same order on every rank]): a hang, or gloo's error, within seconds."""
    indices = state.post_forward_indices
    i = indices.pop() if indices else None
    if state.backward_prefetch:
        issue(s.group for s in state.backward_prefetch)
    elif state.implicit_backward_prefetch and i and dist.get_rank() == 0:
        issue([state.ctx.post_forward_order[i - 1]])



@replaces("prefetch.forward")
def prefetches_only_the_first_of_a_list(state):
    """Reads an explicit list as "the next module": issues ``forward_prefetch[0]`` and drops the
    rest. With lists of one module it is right; a list of two (two blocks ahead, more memory
    for more overlap) loses its second entry (Note [which group is next]: a list *replaces*
    the guess, all of it)."""
    ctx = state.ctx
    if state.group is not None:
        k, last = len(ctx.forward_order), ctx.last_forward_order
        ctx.on_track = ctx.on_track and k < len(last) and last[k] is state.group
        ctx.forward_order.append(state.group)
    if state.forward_prefetch:
        issue([state.forward_prefetch[0].group])
    elif state.implicit_forward_prefetch and ctx.on_track:
        k = len(ctx.forward_order)
        issue(ctx.last_forward_order[k:k + 1])


@replaces("prefetch.backward")
def reverses_the_backward_list(state):
    """"Backward runs in reverse", so it reverses the backward list too: the list is already in
    backward order, and torch issues it as given. Invisible with one module per list; with two,
    the later group's all-gather goes first (Note [which group is next], Note [same order on
    every rank]: the order of issue is part of the contract)."""
    indices = state.post_forward_indices
    i = indices.pop() if indices else None
    if state.backward_prefetch:
        issue(s.group for s in state.backward_prefetch[::-1])
    elif state.implicit_backward_prefetch and i:
        issue([state.ctx.post_forward_order[i - 1]])


@replaces("prefetch.backward")
def ignores_the_backward_list(state):
    """Prefetches in forward as asked but treats backward as implicit only: the explicit
    backward list is never read. With one-ahead lists the implicit guess issues the same
    groups (the bug hides); a list two ahead shows it (Note [which group is next])."""
    indices = state.post_forward_indices
    i = indices.pop() if indices else None
    if state.implicit_backward_prefetch and i:
        issue([state.ctx.post_forward_order[i - 1]])


@replaces("prefetch.forward")
def never_prefetches_the_last_block(state):
    """Off by one at the end: asks ``k + 1 < len(last)`` for "is there a next group" after
    this group was appended (k counts it already), so the group before the last prefetches
    nothing and the last block's all-gather waits on the critical path (Note [which group is
    next])."""
    ctx = state.ctx
    if state.group is not None:
        k, last = len(ctx.forward_order), ctx.last_forward_order
        ctx.on_track = ctx.on_track and k < len(last) and last[k] is state.group
        ctx.forward_order.append(state.group)
    if state.forward_prefetch:
        issue(s.group for s in state.forward_prefetch)
    elif state.implicit_forward_prefetch and ctx.on_track:
        k = len(ctx.forward_order)
        if k + 1 < len(ctx.last_forward_order):
            issue(ctx.last_forward_order[k:k + 1])


@replaces("prefetch.forward")
def skips_modules_without_parameters(state):
    """Returns early when ``state.group`` is None ("no group, nothing to do"): a root whose
    parameters all live in its children still has its own prefetch list, the first blocks'
    all-gathers, and they are never issued (Note [which group is next])."""
    ctx = state.ctx
    if state.group is None:
        return
    k, last = len(ctx.forward_order), ctx.last_forward_order
    ctx.on_track = ctx.on_track and k < len(last) and last[k] is state.group
    ctx.forward_order.append(state.group)
    if state.forward_prefetch:
        issue(s.group for s in state.forward_prefetch)
    elif state.implicit_forward_prefetch and ctx.on_track:
        issue(ctx.last_forward_order[k + 1:k + 2])

_GPT = "GPT, torch's default: implicit backward prefetch, vs torch"
_TWO = "4 units under a root with no parameters, explicit lists two ahead, vs torch"
# What the checker must say about each bug: the report's status, the jobs to run (the smallest
# that shows the bug), and where the first divergence is (case, checked value) or the line.

@replaces("prefetch.forward")
def prefetches_off_the_track(state):
    """Guesses from the last forward's order even after this forward left it (ignores
    ``ctx.on_track``): when a step runs the units in another order, it prefetches groups that
    do not run next (Note [which group is next])."""
    ctx = state.ctx
    if state.group is not None:
        k, last = len(ctx.forward_order), ctx.last_forward_order
        ctx.on_track = ctx.on_track and k < len(last) and last[k] is state.group
        ctx.forward_order.append(state.group)
    if state.forward_prefetch:
        issue(s.group for s in state.forward_prefetch)
    elif state.implicit_forward_prefetch:
        k = len(ctx.forward_order)
        issue(ctx.last_forward_order[k:k + 1])


@replaces("prefetch.backward")
def explicit_list_and_the_guess(state):
    """Issues the explicit list *and* the implicit guess, as if the list were a hint: a module
    whose list names a unit that is not next also prefetches the next one, which torch does not
    (an explicit list replaces the default, Note [which group is next])."""
    indices = state.post_forward_indices
    i = indices.pop() if indices else None
    if state.backward_prefetch:
        issue(s.group for s in state.backward_prefetch)
    if state.implicit_backward_prefetch and i:
        issue([state.ctx.post_forward_order[i - 1]])

EXPECTED = {
    "prefetches_its_own_group": dict(status="diverged", world_sizes=(2,), case=_GPT, step=0,
                                     phase="backward", name="collectives in backward",
                                     hint="never prefetched"),
    "forward_order_in_backward": dict(status="diverged", world_sizes=(2,), case=_GPT, step=0,
                                      phase="backward", name="collectives in backward",
                                      hint="more all-gathers than the reference"),
    "wraps_around_at_the_first_group": dict(
        status="diverged", world_sizes=(2,), step=0, phase="backward",
        case="4 units under a root with no parameters, default prefetch, vs torch",
        name="collectives in backward", hint="Note [mistargeted prefetches]"),
    "never_prefetches": dict(status="diverged", world_sizes=(2,), case=_GPT, step=0,
                             phase="backward", name="collectives in backward",
                             hint="never prefetched"),
    "prefetches_past_the_last_group": dict(status="crash", world_sizes=(2,),
                                           where="lab06.py:74"),
    "only_rank_0_prefetches": dict(status="hang", world_sizes=(2,)),
    "prefetches_only_the_first_of_a_list": dict(
        status="diverged", world_sizes=(2,), case=_TWO, step=0, phase="forward",
        name="collectives in forward"),
    "reverses_the_backward_list": dict(status="diverged", world_sizes=(2,), case=_TWO, step=0,
                                       phase="backward", name="collectives in backward"),
    "ignores_the_backward_list": dict(status="diverged", world_sizes=(2,), case=_TWO, step=0,
                                      phase="backward", name="collectives in backward"),
    "never_prefetches_the_last_block": dict(
        status="diverged", world_sizes=(2,), step=1, phase="forward",
        case="GPT, implicit forward prefetch (minifsdp only), vs the reference",
        name="collectives in forward"),
    "skips_modules_without_parameters": dict(status="diverged", world_sizes=(2,), case=_TWO,
                                             step=0, phase="forward",
                                             name="collectives in forward"),
    "prefetches_off_the_track": dict(
        status="diverged", world_sizes=(2,), step=1, phase="forward",
        case="4 units, implicit forward prefetch, step 1 runs them as 0, 2, 1, 3 (minifsdp "
             "only), vs the reference",
        name="collectives in forward", hint="ctx.on_track"),
    "explicit_list_and_the_guess": dict(
        status="diverged", world_sizes=(2,), step=0, phase="backward",
        case="4 units, two explicit lists naming units that are not next (the root's in "
             "forward: unit 2; unit 3's in backward: unit 0), vs torch",
        name="collectives in backward", hint="an explicit list decides alone"),
}
