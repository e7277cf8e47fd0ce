"""Lab 02: BucketedDDP's gradient hook and in-order bucket launch. Read Note [buckets] first.

Write on_grad_ready (seam "ddp.grad_hook", replaces BucketedDDP._on_grad_ready) and
launch_ready_buckets (seam "ddp.launch", replaces BucketedDDP._launch_ready_buckets).
Check: python -m minifsdp.labs 02      (start: python -m minifsdp.labs 02 --start)
Bar: losses, gradients and parameters equal torch DDP's bit for bit at N = 2 and 3 (N = 3 with
one parameter per bucket; several per bucket: the package's BucketedDDP), every bucket's
all-reduce issued during backward, in bucket order, and waited for only once backward ends.
"""

from torch.autograd import Variable

from minifsdp import comm

# given: ddp.buckets[k] is a minifsdp.ddp.Bucket (index, params, buffer, pending, work), in
# launch order; ddp._slot[i] = (bucket, view): where parameter i's gradient goes, a view shaped
# like it into bucket.buffer; ddp._next_bucket: the first bucket not launched yet in this
# backward; ddp.world_size: N. _reset() refills every bucket's pending count before a forward,
# and _finish_backward (Note [when backward ends]) fills what never arrived, calls your
# launch_ready_buckets once more, then waits for every bucket and copies the averages to .grad.


def on_grad_ready(ddp, i, param):
    """Post-accumulate-grad hook of parameter ``i`` (``ddp._params[i] is param``): ``param.grad``
    (shaped like ``param``) now holds this rank's gradient for this backward."""
    if not ddp._armed:  # inside no_sync: the gradient just stays in .grad (Note [no_sync])
        return
    if not ddp._queued:  # the first gradient of this backward (Note [when backward ends])
        ddp._queued = True
        Variable._execution_engine.queue_callback(ddp._finish_backward)
    if ddp._ready[i]:
        raise RuntimeError(f"BucketedDDP: {ddp._names[i]} received a gradient twice")
    ddp._ready[i] = True
    # TODO(lab 02): put param.grad scaled by 1/N into its slot of its bucket, the way torch
    # does it (Note [divide first]), count it as arrived, and launch what is now ready.
    # (about 4 lines)
    raise NotImplementedError("lab 02: on_grad_ready in labs/lab02_ddp.py")


def launch_ready_buckets(ddp):
    """Start the all-reduce (SUM) of every bucket that may start now, without waiting for it:

        b.work = comm.all_reduce(b.buffer, group=ddp.process_group, async_op=True,
                                 tag=f"bucket {b.index}")

    Ranks match collectives by their order of issue, so which buckets may start, and in which
    order, is the whole lesson (Note [buckets])."""
    # TODO(lab 02): from ddp._next_bucket on, launch each bucket whose gradients have all
    # arrived, and stop at the first one still waiting for some. (about 6 lines)
    raise NotImplementedError("lab 02: launch_ready_buckets in labs/lab02_ddp.py")
