"""Lab 00: ring all-reduce from send/recv. Read Note [ring all-reduce] and Note [ring bytes].

Write the two halves of the ring below; minifsdp.ring.ring_all_reduce (pad, then these two)
calls them through seams "ring.reduce_scatter" and "ring.all_gather".
Check: python -m minifsdp.labs 00      (start: python -m minifsdp.labs 00 --start)
Bar: equal to dist.reduce_scatter_tensor / all_gather_into_tensor / all_reduce bit for bit at
N = 2 and 3, and each rank sends exactly N-1 chunks per phase: 2(N-1)/N of the padded bytes.
"""

import torch
from torch.distributed import ReduceOp

# given: _ring(group) -> (N, me, right, left); _exchange(send_buf, recv_buf, right, left, group,
# tag) posts one send to the right and one receive from the left, then waits for both
# (Note [ring deadlock]); _COMBINE[op] folds a received chunk into yours, e.g. Tensor.add_.
from minifsdp.ring import _COMBINE, _exchange, _ring


@torch.no_grad()
def ring_reduce_scatter(output, input, op=ReduceOp.SUM, group=None):
    """Same contract as ``dist.reduce_scatter_tensor``, in N-1 ring steps.

    Shapes: ``input`` N*k elements, ``output`` k. Rank r's ``output`` becomes chunk r of the
    elementwise reduction over every rank's ``input``; leave ``input`` untouched.
    """
    n, me, right, left = _ring(group)
    combine = _COMBINE[op]
    chunks = input.detach().reshape(-1).clone().view(n, -1)  # scratch: your partial sums
    received = torch.empty_like(chunks[0])
    # TODO(lab 00): N-1 steps. In each, send one of your chunks to the right while receiving
    # into `received` from the left, then combine `received` into the chunk it belongs to.
    # The table in Note [ring all-reduce] says which chunk rank r sends at step k; chunk r
    # must end complete on rank r. Then AVG divides once, and your chunk goes to `output`.
    # (about 7 lines)
    raise NotImplementedError("lab 00: ring_reduce_scatter in labs/lab00_ring.py")


@torch.no_grad()
def ring_all_gather(output, input, group=None):
    """Same contract as ``dist.all_gather_into_tensor``, in N-1 ring steps.

    Shapes: ``input`` k elements, ``output`` N*k: chunk j of ``output`` becomes rank j's input.
    """
    n, me, right, left = _ring(group)
    chunks = output.view(n, -1)  # received chunks land directly in the output
    # TODO(lab 00): put your input in your own chunk, then N-1 steps: send the chunk you got
    # most recently (at first, your own) to the right while receiving the next one from the
    # left straight into its place in `chunks`. (about 4 lines)
    raise NotImplementedError("lab 00: ring_all_gather in labs/lab00_ring.py")
