"""A group's all-gather and reduce-scatter as replaceable objects (torch 2.14's ``AllGather`` /
``ReduceScatter``): ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``.

Note [custom collectives] (torch: ``_fsdp_api.py``, ``_fsdp_collectives.py``): each group
holds two comm objects, ``group.all_gather_comm`` and ``group.reduce_scatter_comm``, and
every buffer a collective writes into or reads from comes from one of them::

    all-gather:     out = ag.allocate((N * S,), dtype=..., device=...)       the group buffer
                    copy-in into out's slot r, then
                    ag(output_tensor=out, input_tensor=slot r, group=..., async_op=...)
    reduce-scatter: inp = rs.allocate((N * S,), dtype=reduce dtype, ...)  the copy-in target
                    out = rs.allocate((S,), ...)                          my slot, the .grad's
                    rs(output_tensor=out, input_tensor=inp, group=..., op=...)   (blocking)

``allocate(size, *, dtype, device)`` must return a contiguous tensor of that one-dim size,
dtype and device (we check, and name the comm otherwise); the call must leave
``output_tensor`` holding what ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` would
(computed any way it likes) and return a work handle when ``async_op=True`` (or ``None``
once finished). Everything else -- which buffers, the copy-in and copy-out, the divisions,
HSDP's all-reduce across replicas (always ours, as in torch) -- stays FSDP's. Every
all-gather of the group goes through its comm: the k-rank one after
``reshard_after_forward=k`` too, and an extension group's ``uint8`` buffer. The defaults,
``DefaultAllGather`` / ``DefaultReduceScatter``, do what a group always did. Both setters act
on the module's own group only, not its children's, as torch's.

Why the seam exists: *where* the bytes live and *how* they travel are what GPU systems tune.
A symmetric-memory comm allocates from a pool every rank has mapped (NCCL's zero-copy and
copy-engine collectives), a registered-buffer comm from the process group's allocator (both
built in, as torch's: ``comm_buffers.py``), and ZeRO++'s quantized all-gather
and reduce-scatter move int8 blocks with scales instead of bf16 and dequantize into the
output. None of them changes FSDP's layout, so they plug in here without a fork.

Ownership: a buffer from our default ``allocate`` is freed by us at once (``resize_(0)``:
``_free`` in ``fsdp_param_group.py`` says why *now*). A buffer from a custom ``allocate``
belongs to that comm -- a persistent buffer, or a pool's block it hands out again -- so we
only drop our references, as torch does with every buffer. (The reduce-scatter output is
viewed by the sharded ``.grad``s, as in torch: a comm that reuses it must not hand it out
again while those gradients live.)

Logging: ``minifsdp.comm`` logs the calls made through its wrappers. The group calls its comm
inside ``comm.tagged("fsdp2 params <group>")`` (``"fsdp2 grads <group>"``): the default's
record is the one it always was, and a custom comm that calls ``minifsdp.comm``'s wrappers is
logged under the group's tag, with the bytes *it* sends (a quantized all-gather's int8, say).
Its raw ``torch.distributed`` calls are not logged: we cannot know what such a comm moves,
and a record of bytes that never crossed the wire would be wrong.

Where ours differs from torch: torch runs no collective in a shard group of one (its
all-gather allocates nothing, its reduce-scatter allocates both buffers and copies); we call
the comm on the group of one. Ours passes ``async_op=True`` for a prefetch's all-gather and
waits later (Note [issue and wait] in ``prefetch.py``); torch passes ``False`` and overlaps
in its all-gather stream. torch checks nothing when a comm is set; we refuse an object
without the protocol's methods (``check_comm``).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
import torch.distributed as dist

from minifsdp import comm as logged


class AllGather(ABC):
    """torch's ``AllGather`` protocol: ``allocate`` the group buffer, then fill it."""

    @abstractmethod
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor: ...

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, async_op: bool = False) -> dist.Work | None: ...


class ReduceScatter(ABC):
    """torch's ``ReduceScatter`` protocol: ``allocate`` the input and the output, then reduce."""

    @abstractmethod
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor: ...

    @abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: dist.ReduceOp,
                 async_op: bool = False) -> dist.Work | None: ...


class _DefaultAlloc:
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class DefaultAllGather(_DefaultAlloc, AllGather):
    """A fresh buffer and ``minifsdp.comm``'s logged all-gather (torch's
    ``DefaultAllGather``)."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return logged.all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


class DefaultReduceScatter(_DefaultAlloc, ReduceScatter):
    """Fresh buffers and ``minifsdp.comm``'s logged reduce-scatter (torch's
    ``DefaultReduceScatter``)."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return logged.reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op)


# the keywords FSDP passes to each kind of comm's __call__
_CALL_KEYWORDS = {"set_custom_all_gather": ("output_tensor", "input_tensor", "group", "async_op"),
                  "set_custom_reduce_scatter": ("output_tensor", "input_tensor", "group", "op")}


def check_comm(comm: object, method: str, where: str) -> None:
    """Refuse, naming ``method`` and the module ``where``, an object FSDP could not call as
    Note [custom collectives] does: no ``allocate(size, *, dtype, device)``, or no
    ``__call__`` taking the keywords FSDP passes. (torch checks nothing.)"""
    name, keywords = type(comm).__name__, _CALL_KEYWORDS[method]
    protocol = (f"a custom comm implements allocate(size, *, dtype, device) and "
                f"__call__({', '.join(keywords)}) (Note [custom collectives])")
    calls = (("allocate", getattr(comm, "allocate", None), (None,), ("dtype", "device")),
             ("__call__", comm, (), keywords))
    for attr, fn, args, kwargs in calls:
        if not callable(fn):
            raise TypeError(f"{where}.{method}: {name} has no method {attr}(); {protocol}")
        try:
            inspect.signature(fn).bind(*args, **dict.fromkeys(kwargs))
        except TypeError as e:
            raise TypeError(f"{where}.{method}: {name}.{attr}() cannot be called as FSDP calls "
                            f"it ({e}); {protocol}") from None
        except ValueError:  # no signature to inspect (a builtin): trust it
            pass


def allocate(comm: AllGather | ReduceScatter, numel: int, dtype: torch.dtype,
             device: torch.device, what: str) -> torch.Tensor:
    """``comm.allocate((numel,), dtype=dtype, device=device)``, checked; ``what`` names the
    buffer and its group in the error (Note [custom collectives])."""
    out = comm.allocate((numel,), dtype=dtype, device=device)
    if not (isinstance(out, torch.Tensor) and out.shape == (numel,) and out.dtype == dtype
            and out.device == device and out.is_contiguous()):
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}"
               f"{'' if out.is_contiguous() else ', not contiguous'}"
               if isinstance(out, torch.Tensor) else f"a {type(out).__name__}")
        raise ValueError(f"{type(comm).__name__}.allocate for {what} returned {got}; FSDP "
                         f"asked for a contiguous ({numel},) {dtype} on {device}")
    return out


def release(buffer: torch.Tensor, comm: AllGather | ReduceScatter) -> None:
    """Done with ``buffer`` from ``comm.allocate``: free it now if ours made it (the
    default's, or a process-group comm's ``torch.empty`` where the backend has no allocator:
    Note [comm buffers from the process group] in ``comm_buffers.py``), else leave it to the
    comm that did (Note [custom collectives], ownership)."""
    if type(comm).allocate is _DefaultAlloc.allocate or getattr(comm, "plain_buffers", False):
        buffer.untyped_storage().resize_(0)
