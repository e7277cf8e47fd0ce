"""Lab 02: BucketedDDP's gradients, from hook to all-reduce. Read Note [buckets] first.

Seams "ddp.grad_hook" (BucketedDDP._on_grad_ready), "ddp.launch" (._launch_ready_buckets).
Check: python -m minifsdp.labs 02   (start: --start)   Hints: --hint (1, 2, 3)
Bar: losses, gradients and parameters equal torch DDP's bit for bit at N = 2 and 3 (several
parameters per bucket at N = 3: the package's BucketedDDP), also with no_sync, an unused branch
and a process group of 2 ranks; every bucket all-reduced once per synced backward, in bucket
order, started as soon as it may be and never waited for inside backward.
"""

from torch.autograd import Variable

from minifsdp import comm

# given: ddp.buckets[k] is a minifsdp.ddp.Bucket (index, params, buffer, pending, work), in
# launch order; ddp._slot[i] = (bucket, view): where parameter i's gradient goes, a view shaped
# like it into bucket.buffer; ddp._next_bucket: the first bucket not started in this backward;
# ddp.world_size and ddp.process_group: the group to average over. Before each synced forward
# _reset() sets every bucket's pending to its number of parameters, work to None and
# _next_bucket to 0. After backward, _finish_backward (Note [when backward ends]) fills the
# slots of parameters that got no gradient (Note [unused parameters]), counting them in pending,
# calls launch_ready_buckets once more, then waits for every bucket and copies the averages
# back to .grad.


def on_grad_ready(ddp, i, param):
    """Runs when ``param.grad`` (``ddp._params[i] is param``, same shape) holds this rank's
    gradient for this backward -- accumulated over earlier ``no_sync`` backwards, if any.

    Must hold afterwards: parameter i's slot holds its gradient scaled by 1/N the way torch
    does it (Note [divide first]); its bucket counts it as arrived; every bucket that may
    start now has started (call ``ddp._launch_ready_buckets()``, the other seam); nothing
    waits for an all-reduce.
    """
    if not ddp._armed:  # inside no_sync: the gradient just stays in .grad (Note [no_sync])
        return
    if not ddp._queued:  # the first gradient of this backward (Note [when backward ends])
        ddp._queued = True
        Variable._execution_engine.queue_callback(ddp._finish_backward)
    if ddp._ready[i]:
        raise RuntimeError(f"BucketedDDP: {ddp._names[i]} received a gradient twice")
    ddp._ready[i] = True
    # TODO(lab 02): the hook's part of Note [buckets].
    raise NotImplementedError("lab 02: on_grad_ready in labs/lab02_ddp.py")


def launch_ready_buckets(ddp):
    """Called by the hook and once more when backward ends. Starts, without waiting, the
    all-reduce (SUM, over ``ddp.process_group``) of every bucket that may start now:
    ``b.work = comm.all_reduce(b.buffer, ..., async_op=True, tag=f"bucket {b.index}")``
    (the checker reads the tags).

    Must hold afterwards: buckets start strictly in bucket order, each exactly once per synced
    backward, as soon as all its gradients have arrived and all earlier buckets have started;
    ``ddp._next_bucket`` is the first bucket not started. Ranks match collectives by their
    order of issue (Note [buckets]).
    """
    # TODO(lab 02): the launch's part of Note [buckets].
    raise NotImplementedError("lab 02: launch_ready_buckets in labs/lab02_ddp.py")
