"""Lab 00: ring all-reduce from send/recv. Read Note [ring all-reduce] and Note [ring bytes].

Seams "ring.reduce_scatter", "ring.all_gather" (ring.ring_all_reduce pads, then calls both).
Check: python -m minifsdp.labs 00   (start: --start)   Hints: --hint (1, 2, 3)
Bar: torch's reduce_scatter_tensor / all_gather_into_tensor / all_reduce bit for bit at N = 2
and 3 (SUM, AVG, MAX, MIN, PRODUCT; fp32 and bf16; 1-D and 2-D; the default group and a group
of ranks 1..N-1), each rank sending N-1 chunks per phase in the input's dtype: 2(N-1)/N of the
padded bytes."""

import torch
from torch.distributed import ReduceOp

# given: _ring(group) -> (N, me, right, left), ranks *within* group; _exchange(send_buf, recv_buf,
# right, left, group, tag) posts one send to the right and one receive from the left, then waits
# for both (Note [ring deadlock]); _COMBINE[op](acc, x) folds x into acc in place for op.
from minifsdp.ring import _COMBINE, _exchange, _ring


@torch.no_grad()
def ring_reduce_scatter(output, input, op=ReduceOp.SUM, group=None):
    """Same contract as ``dist.reduce_scatter_tensor(output, input, op, group)``.

    Inputs: ``input``, N*k elements of any shape and dtype; ``output``, k elements (any shape,
    same dtype); ``op`` one of SUM, AVG, MAX, MIN, PRODUCT; ``group`` the ranks to reduce over
    (None: all of them). N, your rank and your neighbours are the group's.
    Output: the group's rank r holds in ``output`` chunk r (elements r*k .. r*k+k-1 of the
    flattened input) of the elementwise reduction of every rank's ``input``; AVG is the sum
    divided by N once.
    Invariants: ``input`` is left untouched; every message goes through ``_exchange``: N-1
    steps, one chunk of k elements of ``input``'s dtype sent per step (Note [ring bytes]).
    """
    n, me, right, left = _ring(group)
    # TODO(lab 00): the reduce-scatter half of the ring (Note [ring all-reduce]).
    raise NotImplementedError("lab 00: ring_reduce_scatter in labs/lab00_ring.py")


@torch.no_grad()
def ring_all_gather(output, input, group=None):
    """Same contract as ``dist.all_gather_into_tensor(output, input, group)``.

    Inputs: ``input``, k elements of any shape; ``output``, N*k elements, contiguous, any shape,
    the same dtype; ``group`` as in ``ring_reduce_scatter``.
    Output: chunk j of the flattened ``output`` holds the group's rank j's ``input``.
    Invariants: every message goes through ``_exchange``: N-1 steps, one chunk sent per step.
    """
    n, me, right, left = _ring(group)
    # TODO(lab 00): the all-gather half of the ring (Note [ring all-reduce]).
    raise NotImplementedError("lab 00: ring_all_gather in labs/lab00_ring.py")
