"""Lab 06: the prefetch schedule. Read Note [which group is next] and Note [issue and wait].

Decide which group's all-gather a hook issues next, in forward and in backward. FSDPState's
hooks call yours through seams "prefetch.forward" (minifsdp.fsdp2.prefetch.after_pre_forward)
and "prefetch.backward" (minifsdp.fsdp2.prefetch.after_pre_backward).
Check: python -m minifsdp.labs 06      (start: python -m minifsdp.labs 06 --start)
Bar: at N = 2 and 3, each step's all-gathers and reduce-scatters are issued in the order
torch's fully_shard issues them (its default; the same explicit lists of one and of two
modules ahead, and lists that name a unit that is not next; the package's own order for
implicit forward prefetch, also when a step runs the units in a new order, and for none), and
losses and parameters equal torch's bit for bit.
"""

# given: issue(groups) issues each group's all-gather, async, in order; None and groups already
# unsharded or in flight are no-ops (Note [issue and wait]). Every rank must issue the same
# prefetches in the same order (Note [same order on every rank]).
from minifsdp.fsdp2.prefetch import issue


def after_pre_forward(state):
    """A group's pre-forward hook, after its own all-gather finished: issue what runs next.

    ``state`` (an ``FSDPState``): ``state.group``, its ``FSDPParamGroup`` (None for a module
    with no parameters of its own); ``state.forward_prefetch``, a list of FSDPStates (explicit,
    from ``set_modules_to_forward_prefetch``; ``[]`` when none) whose ``.group`` to issue;
    ``state.implicit_forward_prefetch``, a bool (off by default). ``state.ctx`` is shared by
    every state under the root: ``ctx.forward_order`` (groups whose pre-forward ran so far in
    this forward, k of them), ``ctx.last_forward_order`` (the previous forward's, the guess),
    ``ctx.on_track`` (this forward has matched the last one so far).
    """
    ctx = state.ctx
    if state.group is not None:  # given: record this group's place in this forward
        k, last = len(ctx.forward_order), ctx.last_forward_order
        ctx.on_track = ctx.on_track and k < len(last) and last[k] is state.group
        ctx.forward_order.append(state.group)
    # TODO(lab 06): issue (through issue()) the all-gathers this hook owes, and nothing else.
    # Contract: an explicit list, when set, decides alone: all of its groups, in its order.
    # Without one, and only with implicit forward prefetch on, the guess of Note [which group
    # is next] -- never a group past the end of the last forward, never off its track.
    # Same calls on every rank (Note [same order on every rank]); never wait.
    raise NotImplementedError("lab 06: after_pre_forward in labs/lab06_prefetch.py")


def after_pre_backward(state):
    """A group's pre-backward hook, after its own all-gather finished: issue what runs next.

    ``state.post_forward_indices``: this group's places in ``state.ctx.post_forward_order``
    (the groups in the order their forwards *ended*, one entry per forward run); backward runs
    them in reverse. ``state.backward_prefetch`` (explicit, from
    ``set_modules_to_backward_prefetch``) and ``state.implicit_backward_prefetch`` (on by
    default, torch's behaviour) as in forward.
    """
    indices = state.post_forward_indices  # given: the forward whose backward runs now
    i = indices.pop() if indices else None  # (None: this module has no group, or ran no forward)
    # TODO(lab 06): issue (through issue()) the all-gathers this hook owes, and nothing else.
    # Contract: an explicit list, when set, decides alone: all of its groups, in its order.
    # Without one, and only with implicit backward prefetch on, the group whose backward runs
    # next (Note [which group is next]) -- none after the last backward of this step.
    # Same calls on every rank; never wait.
    raise NotImplementedError("lab 06: after_pre_backward in labs/lab06_prefetch.py")
