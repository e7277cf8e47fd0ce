"""Ring all-reduce from point-to-point sends and receives: the algorithm behind every
``dist.all_reduce`` of a large tensor, and the reason FSDP costs no more bandwidth than DDP.

    ring_all_reduce = ring_reduce_scatter + ring_all_gather

Each phase takes N-1 steps; in every step each rank sends one chunk (1/N of the tensor) to
its right neighbour while receiving one from its left neighbour. All sends go through the
logged ``minifsdp.comm.batch_isend_irecv``, so the bytes are *measured*, not assumed::

    with comm.logging_comm() as log:
        ring_all_reduce(t)                        # in place, like dist.all_reduce(t)
    log.total_bytes("send", wire=True)            # == 2(N-1)/N * t's bytes

Device-agnostic: the same code runs on gloo (CPU) and NCCL (CUDA tensors); only gloo is
tested in this repo.

Note [ring all-reduce]: split the tensor into N chunks C0..C(N-1). Chunk indices (mod N) that
rank r sends at step k, shown for N=3:

    reduce-scatter   rank 0   rank 1   rank 2
      step 0         C2       C0       C1      its own values
      step 1         C1       C2       C0      the partial sum it just received, plus its own
      after          owns C0  owns C1  owns C2 (each the sum over all 3 ranks)
    all-gather
      step 0         C0       C1       C2      the chunk it owns
      step 1         C2       C0       C1      the chunk it just received
      after          every rank holds every summed chunk

Chunk c starts at rank c+1 and travels once around the ring, picking up every rank's
contribution, until it lands, complete, at rank c. Then the owners pass the finished chunks
once more around. With rank r owning chunk r, the two phases are exactly
``dist.reduce_scatter_tensor`` and ``dist.all_gather_into_tensor``, which is what FSDP calls:
it runs the same two halves at different moments of the step.

Note [ring bytes]: every rank sends one chunk of S/N bytes per step, for 2(N-1) steps:
2(N-1)/N * S bytes in total, *almost independent of N* (at most 2S). That is why the ring is
bandwidth-optimal. The price is 2(N-1) sequential steps of latency, which is why libraries
switch to trees for small messages. When N does not divide the number of elements, we pad to
k = ceil(numel/N) elements per chunk, i.e. p = N*k - numel < N padding elements. Each rank still
sends 2(N-1) chunks of k elements: 2(N-1)*k = 2(N-1)/N * (numel + p) elements, so the padding
adds 2(N-1)/N * p elements, fewer than 2(N-1), whatever the size of the tensor (e.g. 10,001
fp32 over N = 4: k = 2501, p = 3, 60,024 bytes sent instead of 60,006).

Note [ring deadlock]: the obvious step, ``send(right); recv(left)`` with blocking calls,
hangs. A blocking send returns only once the receiver has taken the data, and in a ring every
rank is inside ``send`` waiting for a neighbour that is itself inside ``send``: nobody ever
reaches ``recv``. On gloo this happens for every size (measured here: a one-float naive ring at
world size 2 times out). Transports that buffer small messages (NCCL's and MPI's eager
protocols) let small tensors through and hang on large ones -- the worst kind of bug. The fix
is to *post* both halves before waiting on either: a non-blocking isend and irecv, then wait
for both. ``batch_isend_irecv`` does exactly that; on NCCL it also launches the pair as one
group, which torch recommends so that a send and a receive with the same peer (N=2) cannot
queue behind one another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from minifsdp import comm

# How to fold a received chunk into ours. AVG sums first and divides once at the end.
_COMBINE = {
    ReduceOp.SUM: torch.Tensor.add_,
    ReduceOp.AVG: torch.Tensor.add_,
    ReduceOp.PRODUCT: torch.Tensor.mul_,
    ReduceOp.MAX: lambda acc, x: torch.maximum(acc, x, out=acc),
    ReduceOp.MIN: lambda acc, x: torch.minimum(acc, x, out=acc),
}


def _ring(group: dist.ProcessGroup | None) -> tuple[int, int, int, int]:
    """``(N, me, right, left)`` as ranks *within* ``group``."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    return n, me, (me + 1) % n, (me - 1) % n


def _exchange(send_buf: torch.Tensor, recv_buf: torch.Tensor, right: int, left: int,
              group: dist.ProcessGroup | None, tag: str) -> None:
    """One ring step: send ``send_buf`` right while receiving ``recv_buf`` from the left.
    Both are posted before we wait on either (Note [ring deadlock])."""
    ops = [dist.P2POp(dist.isend, send_buf, group=group, group_peer=right),
           dist.P2POp(dist.irecv, recv_buf, group=group, group_peer=left)]
    for work in comm.batch_isend_irecv(ops, tag=tag):
        work.wait()


@torch.no_grad()
def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                        group: dist.ProcessGroup | None = None) -> None:
    """Same contract as ``dist.reduce_scatter_tensor``, in N-1 ring steps.

    Shapes: ``input`` has N*k elements (any shape), ``output`` k elements. Rank r's ``output``
    becomes chunk r of the elementwise reduction of every rank's ``input``; ``input`` is left
    untouched.

    Example (2 ranks): rank 0 has input [1, 2], rank 1 has [3, 4] -> rank 0's output is [4],
    rank 1's is [6].
    """
    n, me, right, left = _ring(group)
    if input.numel() != n * output.numel():
        raise ValueError(f"input has {input.numel()} elements, expected N * output = "
                         f"{n} * {output.numel()}")
    if op not in _COMBINE:
        raise ValueError(f"unsupported reduce op {op}")
    if op == ReduceOp.AVG and not input.is_floating_point():
        raise ValueError("ReduceOp.AVG needs a floating-point tensor")
    combine = _COMBINE[op]
    # A scratch copy accumulates the partial sums, so the caller's input stays intact (a
    # fused kernel like NCCL's adds on the fly and needs no copy).
    chunks = input.detach().reshape(-1).clone().view(n, -1)
    received = torch.empty_like(chunks[0])
    for step in range(n - 1):
        _exchange(chunks[(me - step - 1) % n], received, right, left, group,
                  tag=f"ring reduce-scatter step {step}")
        combine(chunks[(me - step - 2) % n], received)
    if op == ReduceOp.AVG:
        chunks[me].div_(n)
    output.copy_(chunks[me].view(output.shape))


@torch.no_grad()
def ring_all_gather(output: torch.Tensor, input: torch.Tensor,
                    group: dist.ProcessGroup | None = None) -> None:
    """Same contract as ``dist.all_gather_into_tensor``, in N-1 ring steps.

    Shapes: ``input`` k elements, ``output`` N*k elements (contiguous, any shape): chunk j of
    ``output`` becomes rank j's ``input``.

    Example (2 ranks): inputs [1] and [2] -> output [1, 2] on both ranks.
    """
    n, me, right, left = _ring(group)
    if output.numel() != n * input.numel():
        raise ValueError(f"output has {output.numel()} elements, expected N * input = "
                         f"{n} * {input.numel()}")
    chunks = output.view(n, -1)  # received chunks land directly in the output
    chunks[me].copy_(input.reshape(-1))
    for step in range(n - 1):
        _exchange(chunks[(me - step) % n], chunks[(me - step - 1) % n], right, left, group,
                  tag=f"ring all-gather step {step}")


@torch.no_grad()
def ring_all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM,
                    group: dist.ProcessGroup | None = None) -> None:
    """Same contract as ``dist.all_reduce``: in place, every rank ends with the elementwise
    reduction of all ranks' ``tensor``. Any shape, any number of elements (padded to a
    multiple of N, Note [ring bytes]), any dtype the backend can send.

    Example (2 ranks): rank 0 has [[1, 2], [3, 4]], rank 1 has [[10, 20], [30, 40]] -> both
    end with [[11, 22], [33, 44]].
    """
    n = dist.get_world_size(group)
    numel = tensor.numel()
    shard = -(-numel // n)  # ceil(numel / N) elements per chunk
    flat = tensor.new_zeros(n * shard)  # the padding never mixes with real elements
    flat[:numel] = tensor.reshape(-1)
    mine = tensor.new_empty(shard)
    ring_reduce_scatter(mine, flat, op, group)
    ring_all_gather(flat, mine, group)
    tensor.copy_(flat[:numel].view(tensor.shape))


def ring_wire_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes each rank sends in ``ring_all_reduce``, padding included: 2(N-1) chunks of
    ceil(numel/N) elements. Equals 2(N-1)/N * S exactly when N divides ``numel``.

    Example: ``ring_wire_bytes(1000, 4, 4)`` -> 6000 (= 2*3/4 * 4000).
    """
    return 2 * (world_size - 1) * -(-numel // world_size) * element_size
