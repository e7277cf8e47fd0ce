"""Where a group's collective buffers come from -- the process group's own allocator, or
symmetric memory (torch 2.14's ``ProcessGroupAlloc*`` and ``SymmMem*`` comms) -- and how many
reduce-scatter inputs may be in flight. The three ``FSDPModule`` setters::

    m.set_allocate_memory_from_process_group_for_comm(True)   # this module's group
    m.set_symm_mem_for_comm()                                  # CUDA + NCCL only
    model.set_reduce_scatter_max_input_buffers(2)              # every group below model

Note [comm buffers from the process group] (torch: ``ProcessGroupAllocMixin`` in
``_fsdp_collectives.py``): the all-gather buffer and the reduce-scatter's input and output
are asked of the process group's backend -- ``backend.allocate_tensor(numel, dtype=,
device=)`` where ``backend.supports_tensor_alloc(device)`` -- instead of ``torch.empty``.
NCCL (2.19+) answers from ``ncclMemAlloc``: memory it can register once, so a collective on
it can skip the copy into NCCL's own staging buffers (zero-copy over NVLink SHARP or
InfiniBand). gloo has no allocator: the buffers are ``torch.empty``'s, the same as without
the setting, and so are every byte and every value (tests/test_fsdp2_custom_comm.py, N = 2
and 3, against torch's). The collectives themselves are the defaults'. It *replaces* the
group's comms, so it is refused after ``set_custom_all_gather`` / ``set_custom_reduce_scatter``
(torch refuses too): a custom comm chose its buffers already.

Note [symmetric memory] (torch: ``SymmMemAllocMixin``): a buffer every rank of the group has
mapped into its address space, from ``torch.distributed._symmetric_memory``'s pool, and
"rendezvoused" (each rank learns the others' addresses) before the collective. NCCL then
all-gathers by copying straight between GPUs' memories -- with its copy engines when the
process group runs with the zero-CTA policy (``NCCL_CTA_POLICY=2``), with no SM busy -- or
with its symmetric kernels across nodes. It exists only for CUDA and NCCL: torch 2.14 accepts
the call on a CPU mesh and fails at the first forward ("SymmetricMemory MemPool did not find
backend for device type cpu"); ours refuses at the call, naming the module. The all-gather
always moves to symmetric memory; the reduce-scatter only when the group reduces with SUM
(``set_force_sum_reduction_for_comms(True)`` before this call: NCCL's symmetric
reduce-scatter sums only), as torch's. (The CUDA path follows torch's code and has not run
yet: ``minifsdp.gpucheck``'s pair "fsdp2 fp32, symmetric memory" runs it where a GPU machine
is lent; CI has none. So does the pair for the process group's allocator, which NCCL has.)

Note [reduce-scatter inputs in flight] (torch: ``FSDPParamGroup.post_backward`` and the root's
final callback): torch copies a group's gradients in on the compute stream and reduce-scatters
on a stream of its own, so the input is still being read while backward goes on. Rather than
``record_stream``, it keeps a reference to each input until the compute stream has waited on
that reduce-scatter: before the next group's copy-in, while ``K`` or more are held, it waits
on the oldest and drops it; the last ones at the end of backward.
``set_reduce_scatter_max_input_buffers(K)`` sets that cap (default 1; the largest over all
groups wins). ``K = 1``: the next copy-in waits for the previous reduce-scatter (a stall when
communication is slower than the backward compute hiding it); ``K > 1``: no stall, K inputs
of ``N * S`` elements alive -- memory for overlap. Ours holds none in flight: its
reduce-scatter is finished, for the current stream, when the call returns (Note [prefetch on
GPUs] in ``prefetch.py``), and the input is freed right there (``reduce.py``). Every cap is
met with one input alive at a time, whatever ``K``: the setting is checked and kept as
torch's, and changes no byte of ours (tests count the inputs alive at each copy-in). What
torch's default keeps -- one group's input into the next group's backward -- shows at the
step's peak. ``benchmarks/rs_input_buffers.py`` (the benchmark GPT, gloo on 2 cores, two runs,
2026-12-05) measured torch's peak at N = 2: 38.2-38.9 MiB with K = 1, 40.7-42.0 MiB with
K = 2, and 36.4-36.9 MiB with nothing kept (torch's list of kept inputs patched to keep
none, an experiment). Ours was 36.4 MiB with either K. At N = 4: 27.97, 30.98 and 27.46 MiB
against ours 26.21 MiB. So the kept input is the whole of the gap between the two at N = 2,
within run-to-run noise, and a third of it at N = 4. Torch's totals moved between runs by up
to 0.8 MiB, through untagged memory that gloo's thread frees late; ours did not move.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from minifsdp import comm as logged
from minifsdp.fsdp2.custom_comm import AllGather, ReduceScatter


class _FromProcessGroup:
    """``allocate`` from ``group``'s backend where it has an allocator, else ``torch.empty``
    (Note [comm buffers from the process group]). ``plain_buffers`` says which, once known:
    FSDP frees a plain buffer at once, as the default's (``custom_comm.release``)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.plain_buffers = group, False

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        backend = self.group._get_backend(device)
        self.plain_buffers = not backend.supports_tensor_alloc(device)
        if self.plain_buffers:
            return torch.empty(*size, dtype=dtype, device=device)
        return backend.allocate_tensor(math.prod(int(s) for s in size), dtype=dtype,
                                       device=device)


class ProcessGroupAllocAllGather(_FromProcessGroup, AllGather):
    """The default all-gather into a buffer from the process group's allocator."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return logged.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


class ProcessGroupAllocReduceScatter(_FromProcessGroup, ReduceScatter):
    """The default reduce-scatter on buffers from the process group's allocator."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return logged.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)


def check_symm_mem(device: torch.device, group: dist.ProcessGroup, backend: str,
                   where: str) -> None:
    """Refuse symmetric memory where it cannot exist, naming the module (Note [symmetric
    memory]): not CUDA, not an NCCL process group, or a backend other than ``"NCCL"``."""
    how = f"{where}.set_symm_mem_for_comm"
    if backend != "NCCL":
        raise ValueError(f"{how}: backend={backend!r}; torch 2.14 supports only \"NCCL\"")
    pg_backend = dist.get_backend(group)
    if device.type != "cuda" or pg_backend != "nccl":
        raise ValueError(
            f"{how}: symmetric memory is GPU memory every rank maps, for NCCL on CUDA; this "
            f"group's parameters are on {device.type} and it communicates over {pg_backend} "
            "(torch would accept the call and fail at the first forward). Leave it out on a "
            "CPU run (Note [symmetric memory] in minifsdp/fsdp2/comm_buffers.py)")


class _SymmetricMemory:
    """``allocate`` from the symmetric-memory pool (Note [symmetric memory]). Building one is
    collective over ``group`` (a barrier, as torch's: the pool's first rendezvous must find
    the communicator up). The pool owns the buffers: FSDP only drops its references."""

    def __init__(self, group: dist.ProcessGroup, backend: str = "NCCL"):
        import torch.distributed._symmetric_memory as symm_mem

        self.group, self.symm_mem = group, symm_mem
        symm_mem.set_backend(backend)
        dist.barrier(group=group)

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        with torch.cuda.use_mem_pool(self.symm_mem.get_mem_pool(device)):
            return torch.empty(*size, dtype=dtype, device=device)


class SymmMemAllGather(_SymmetricMemory, AllGather):
    """All-gather in place into a symmetric buffer: only the output is rendezvoused (the
    input is this rank's slot of it)."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.symm_mem.rendezvous(output_tensor, group=group.group_name)
        return logged.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


class SymmMemReduceScatter(_SymmetricMemory, ReduceScatter):
    """Reduce-scatter between symmetric buffers (input and output both rendezvoused)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.symm_mem.rendezvous(input_tensor, group=group.group_name)
        self.symm_mem.rendezvous(output_tensor, group=group.group_name)
        return logged.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)


def check_max_input_buffers(max_input_buffers: object) -> int:
    """torch's checks, with torch's messages: an int (``True`` is not 1), at least 1."""
    if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
        raise TypeError(f"max_input_buffers must be an int, got "
                        f"{type(max_input_buffers).__name__}")
    if max_input_buffers < 1:
        raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
    return max_input_buffers


def refuse_symm_mem_with_buffers(name: str, max_input_buffers: int, *,
                                 symmetric: bool) -> None:
    """torch's rule: the symmetric pool hands out one buffer again and again, so a
    ``symmetric`` reduce-scatter cannot keep K > 1 inputs (torch checks at lazy init; we at
    either setter, before changing anything)."""
    if max_input_buffers > 1 and symmetric:
        raise ValueError(
            f"set_reduce_scatter_max_input_buffers(>1) is not supported with the "
            f"symmetric-memory reduce-scatter comm, but got {max_input_buffers} for module "
            f"'{name}' using SymmMemReduceScatter. Keep max_input_buffers=1 with symmetric "
            "memory, or use the default reduce-scatter comm.")
