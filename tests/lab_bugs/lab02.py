"""Lab 02's planted bugs: a DDP hook or bucket launch a learner plausibly gets wrong (Notes
[buckets] and [divide first] in minifsdp/ddp.py).

Each function replaces one seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

import torch
import torch.distributed as dist

from minifsdp import comm
from minifsdp.labs.seams import replaces


@replaces("ddp.grad_hook")
def divides_by_n(ddp, i, param):
    """``param.grad / N`` instead of torch's ``param.grad * (1/N)``: exact at N = 2, the last
    bit differs at N = 3 (Note [divide first])."""
    if not ddp._armed:
        return
    if not ddp._queued:
        ddp._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(ddp._finish_backward)
    ddp._ready[i] = True
    bucket, view = ddp._slot[i]
    torch.div(param.grad, ddp.world_size, out=view)
    bucket.pending -= 1
    ddp._launch_ready_buckets()


@replaces("ddp.grad_hook")
def never_scales(ddp, i, param):
    """Copies ``param.grad`` as it is: the all-reduce (SUM) then hands every rank N times the
    mean gradient (Note [divide first])."""
    if not ddp._armed:
        return
    if not ddp._queued:
        ddp._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(ddp._finish_backward)
    ddp._ready[i] = True
    bucket, view = ddp._slot[i]
    view.copy_(param.grad)
    bucket.pending -= 1
    ddp._launch_ready_buckets()


@replaces("ddp.grad_hook")
def forgets_to_count(ddp, i, param):
    """Copies the gradient into its slot but never decrements ``bucket.pending``: no bucket
    ever fills, so none starts (Note [buckets]); the final callback must say so, not hang."""
    if not ddp._armed:
        return
    if not ddp._queued:
        ddp._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(ddp._finish_backward)
    ddp._ready[i] = True
    bucket, view = ddp._slot[i]
    torch.mul(param.grad, 1 / ddp.world_size, out=view)
    ddp._launch_ready_buckets()


@replaces("ddp.launch")
def launches_as_they_fill(ddp):
    """Starts every full bucket at once, in the order they fill, not in bucket order: where
    gradients arrive in another order on each rank, ranks pair different buckets in their
    all-reduces (Note [buckets]). gloo stops it within seconds: the
    paired all-reduces differ in size."""
    for b in ddp.buckets:
        if b.pending == 0 and b.work is None:
            b.work = comm.all_reduce(b.buffer, group=ddp.process_group, async_op=True,
                                     tag=f"bucket {b.index}")
    ddp._next_bucket = sum(b.work is not None for b in ddp.buckets)


@replaces("ddp.launch")
def waits_in_the_hook(ddp):
    """Waits for each all-reduce right after starting it: the same numbers, but backward stalls
    on every bucket and nothing overlaps (Note [buckets])."""
    while ddp._next_bucket < len(ddp.buckets):
        b = ddp.buckets[ddp._next_bucket]
        if b.pending:
            return
        b.work = comm.all_reduce(b.buffer, group=ddp.process_group, async_op=True,
                                 tag=f"bucket {b.index}")
        b.work.wait()
        ddp._next_bucket += 1


@replaces("ddp.launch")
def launches_one_bucket_per_call(ddp):
    """``if`` where a ``while`` belongs: each call starts at most the next bucket, so when one
    gradient completes several buckets (or the final callback fills several), the rest are
    left behind although every gradient has arrived (Note [buckets])."""
    if ddp._next_bucket < len(ddp.buckets):
        b = ddp.buckets[ddp._next_bucket]
        if b.pending:
            return
        b.work = comm.all_reduce(b.buffer, group=ddp.process_group, async_op=True,
                                 tag=f"bucket {b.index}")
        ddp._next_bucket += 1


@replaces("ddp.launch")
def ready_when_every_hook_fired(ddp):
    """Calls a bucket full when every parameter's hook has fired (``ddp._ready``) instead of
    reading ``pending``: a bucket with a parameter unused in this backward, whose slot the
    final callback fills, never starts (Note [unused parameters])."""
    while ddp._next_bucket < len(ddp.buckets):
        b = ddp.buckets[ddp._next_bucket]
        if not all(ddp._ready[i] for i in b.params):
            return
        b.work = comm.all_reduce(b.buffer, group=ddp.process_group, async_op=True,
                                 tag=f"bucket {b.index}")
        ddp._next_bucket += 1


@replaces("ddp.launch")
def all_reduces_over_the_default_group(ddp):
    """Leaves out ``group=ddp.process_group``: right whenever the group is every rank, wrong
    (here: stuck) for a DDP over ranks 1 and 2 of 3."""
    while ddp._next_bucket < len(ddp.buckets):
        b = ddp.buckets[ddp._next_bucket]
        if b.pending:
            return
        b.work = comm.all_reduce(b.buffer, async_op=True, tag=f"bucket {b.index}")
        ddp._next_bucket += 1


@replaces("ddp.grad_hook")
def scales_by_the_world_size(ddp, i, param):
    """Scales by ``1 / dist.get_world_size()``, the default group's size, not
    ``ddp.world_size``: over 2 ranks of 3 every gradient comes out 2/3 of the mean."""
    if not ddp._armed:
        return
    if not ddp._queued:
        ddp._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(ddp._finish_backward)
    ddp._ready[i] = True
    bucket, view = ddp._slot[i]
    torch.mul(param.grad, 1 / dist.get_world_size(), out=view)
    bucket.pending -= 1
    ddp._launch_ready_buckets()


EXPECTED = {
    "divides_by_n": dict(status="diverged", world_sizes=(3,), step=0, phase="backward",
                         hint="Note [divide first]"),
    "never_scales": dict(status="diverged", world_sizes=(2,), step=0, phase="backward",
                         hint="a sum where a mean is expected"),
    "forgets_to_count": dict(status="crash", world_sizes=(2,), hint="were never launched"),
    "launches_as_they_fill": dict(status="crash", world_sizes=(2,),
                                  hint="Received data size doesn't match"),
    "waits_in_the_hook": dict(status="diverged", world_sizes=(2,), step=0,
                              name="bucket all-reduces waited for inside backward"),
    "launches_one_bucket_per_call": dict(status="crash", world_sizes=(2,),
                                         hint="although their pending counts reached 0"),
    "ready_when_every_hook_fired": dict(status="crash", world_sizes=(2,),
                                        hint="although their pending counts reached 0"),
    "all_reduces_over_the_default_group": dict(status="hang", world_sizes=(3,)),
    "scales_by_the_world_size": dict(status="diverged", world_sizes=(3,), step=0,
                                     phase="backward", hint="yours = expected × 2/3"),
}
