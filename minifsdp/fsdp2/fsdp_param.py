"""``FSDPParam``: one parameter, sharded on dim 0 across a ``DeviceMesh``, as a DTensor
(or on another dim that ``fully_shard``'s ``shard_placement_fn`` picks: Note [Shard(i)
layout] in ``shard_placement.py``; the Notes below speak of dim 0).

FSDP1 flattened a whole unit into one FlatParameter and cut *that*. FSDP2 cuts every
parameter on its own, along its first dimension, and hands the module the cut as a
``DTensor`` -- a tensor that knows its global shape and how it is split::

    weight (10, 8) on 4 ranks:   rows 0-2 | rows 3-5 | rows 6-8 | row 9
    rank 3's module holds:       DTensor(local (1, 8), shape (10, 8), placements [Shard(0)])

So ``model.weight.shape`` is still ``(10, 8)`` on every rank, the optimizer steps the local
rows in place, and ``model.state_dict()`` is a sharded checkpoint with no communication.
On a 2-D HSDP mesh (R, S) the cut is over the S ranks of the shard dim only, and the DTensor
says so: ``placements (Replicate(), Shard(0))`` (Note [HSDP] in ``hsdp.py``). Below, N is
the number of ranks a parameter is cut over: the mesh's size, or S.

Note [the tensors of one parameter] (torch: [Note: FSDP tensors] in ``_fsdp_param.py``):

    original      the ``nn.Parameter`` the module had; dropped once it is sharded
    padded shard  ``_sharded_data``, 1-D: this rank's rows, zero-padded to chunk 0's size;
                  the all-gather input
    sharded       ``sharded_param``: an ``nn.Parameter`` holding a DTensor whose local tensor
                  is a view of the padded shard's first rows; registered on the module
                  between iterations, seen by the optimizer, holds ``.grad``
    unsharded     ``unsharded_param``: a plain ``nn.Parameter`` of the original shape, a view
                  of ``_unsharded_data`` (N padded shards back to back); registered on the
                  module while it computes; autograd accumulates its ``.grad``. Its dtype is
                  the policy's ``param_dtype`` (Note [mixed precision] in mixed_precision.py),
                  the others' the original dtype

Note [dim-0 chunks]: rank r owns ``torch.chunk(param, N, dim=0)[r]``. ``torch.chunk`` makes
chunks of ``ceil(d0 / N)`` rows, so the *last* chunks are short -- and when ``d0 < N`` there
are fewer than N chunks at all (``torch.chunk`` of 2 rows in 3 gives 2 chunks). FSDP then
gives the remaining ranks an *empty* shard (0 rows; the other dims kept). DTensor's
``Shard(0)`` uses the same rule, so our local tensors are exactly what DTensor expects:

    d0 = 10, N = 4:  3, 3, 3, 1         d0 = 2, N = 3:  1, 1, 0         d0 = 5, N = 4:  2, 2, 1, 0

Note [padding]: a collective moves equal-sized pieces, so every rank pads its shard to chunk
0's size. Only tail ranks are short, so when the N padded shards are laid back to back the
padding is all at the *end*: the unsharded parameter is simply the first ``numel`` elements of
that buffer, a view (``unsharded_param``), and a ``resize_`` of its storage frees or restores
it whole (Note [freeing with resize_] in ``fsdp_param_group.py``). Padding once here, at
init, means no padding work in the training loop.

Note [all-gather extensions] (torch: ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` in
``_fsdp_param.py``): a parameter whose type defines both hooks decides itself what travels in
the all-gather and how the unsharded parameter is rebuilt from it -- FP8 all-gather
(``float8.py``) is the use it was made for::

    fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy)
        -> (tensors to all-gather, each of the padded shard's shape), metadata
    fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None)
        -> (unsharded tensor, tensors to free at reshard); with ``out``: fill it, None

``all_gather_outputs`` are the N gathered pieces of each input, ``(N * padded rows, *rest)``;
the unsharded parameter is the returned tensor's first ``numel`` elements. The first unshard
calls the post-hook without ``out``; later ones, after resharding freed the storage
(Note [freeing with resize_]), give it back and pass ``out=unsharded_param`` so the very
tensors autograd saved are refilled -- under ``_unsafe_preserve_version_counter`` (Note
[version counter]), so a hook needs no care for that. The group moves such a group's
buffer as raw bytes (``extensions.py``). Where ours is simpler than torch: ``self`` is
this rank's *padded* shard (torch passes the unpadded local tensor and demands padded
outputs), viewed as the parameter's type only for the call, so the DTensor, the optimizer
and checkpoints see plain tensors and the type need survive no op (torchao's
``_ops_to_preserve_subclass``); ``mesh`` is the shard group's 1-D mesh; and a group holding
such a parameter cannot ``reshard_after_forward=k`` (torch: ``NotImplementedError`` too).

Note [FSDP2 CPU offload] (torch: ``CPUOffloadPolicy`` in ``_fsdp_api.py``, ``offload_to_cpu`` in
``_fsdp_param.py``): ``fully_shard(m, offload_policy=CPUOffloadPolicy())`` keeps what the
optimizer touches in host memory and only what computes on the mesh's device (``mesh_device``:
``cpu``, or ``cuda:<current device>``)::

    host (CPU)     the padded shards, so the sharded parameters (their DTensors' local tensors),
                   their sharded ``.grad`` and therefore the optimizer's state and its step
    mesh device    each unshard's device copy of the shards (the all-gather input, freed with
                   the group buffer), the unsharded parameters and gradients, the reduce-scatter
                   input and output

Per step, two kinds of copies cross the host link, both in the shards' dtype (``orig_dtype``:
before the copy-in's mixed-precision cast, after the reduced gradient's cast back)::

    H2D  each unshard, every parameter's padded shard (``all_gather_input``, non_blocking):
         U * sum_i padded_shard_numel_i * itemsize per group, U = its unshards per step:
         2 if resharded after forward (forward, backward), 1 if not (the root by default) or
         with reshard_after_forward=k (backward gathers the device piece it kept: no copy)
    D2H  each reducing backward, every reduced parameter's unpadded rows (``grad_to_host``,
         from ``to_sharded_grads``): sum_i sharded_numel_i * itemsize over the parameters with
         a gradient; a backward without sync copies nothing

E.g. P fp32 parameters over N ranks, every group resharded after forward: about 8P/N bytes H2D
and 4P/N bytes D2H per rank and step (plus padding), the price of a device that holds no shards,
no gradients and no optimizer state between steps. ``pin_memory=True`` (the default) puts the
shards in page-locked memory, so copies can run as DMA while the CPU goes on: H2D is always
issued ``non_blocking`` (from pageable memory it simply is not asynchronous), D2H only into
pinned memory and when not adding into an existing ``.grad`` (the add would read it at once);
such a copy records an event that ``FSDPParamGroup.finalize_backward`` waits for before the
optimizer reads the gradient (torch: ``grad_offload_event``). Pinning needs an accelerator:
torch's ``pin_memory()`` fails on a CPU-only machine ("Found no NVIDIA driver"); ours refuses
``CPUOffloadPolicy(pin_memory=True)`` there, naming the fix, before touching the module. On a
CPU mesh the device *is* the CPU and ``.to("cpu")`` returns the tensor itself: the moves copy
nothing, on the same code path (which is how the tests run and count them); on a CUDA mesh the
same lines copy to and from ``cuda``. Measured there (one H200, benchmarks/RESULTS.md,
2026-12-04; ``python -m minifsdp.gpucheck``): bitwise equal to torch's, and a steady step's
copies are these bytes exactly, ours and torch's alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from minifsdp.fsdp2.hsdp import MeshInfo, mesh_info
from minifsdp.fsdp2.mixed_precision import MixedPrecisionPolicy, resolve_dtypes
from minifsdp.fsdp2.shard_placement import chunk_on_dim, unsharded_to_shard_dim
from minifsdp.fsdp2.spmd_mesh import SpmdParamLayout, refuse_dtensor_without_dims
from minifsdp.memory import tag

# (module, attribute name) pairs that hold one parameter: more than one when it is shared,
# e.g. tied embeddings (``head.weight is tok_emb.weight``).
Owners = list[tuple[nn.Module, str]]


@dataclass
class OffloadPolicy:
    """No offloading: ``fully_shard``'s default (torch's class of the same name)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep the sharded parameters, their gradients and the optimizer's state in CPU memory;
    copy the shards to the mesh's device for each all-gather and the reduced gradients back
    (Note [FSDP2 CPU offload]). ``pin_memory``: page-locked host memory, for asynchronous
    copies (needs CUDA; pass ``False`` on a CPU-only machine or when host memory is short)."""

    pin_memory: bool = True


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh computes on: ``cpu``, or e.g. ``cuda:<current device>`` (torch's
    ``_get_device_from_mesh``)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = torch.get_device_module(mesh.device_type)
    return torch.device(mesh.device_type, module.current_device())


def chunk_dim0(tensor: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """``torch.chunk`` on dim 0, with empty chunks appended up to ``world_size`` (Note [dim-0
    chunks]). Chunk r is rank r's rows; the chunks are views of ``tensor``.

    Example:
        >>> [tuple(c.shape) for c in chunk_dim0(torch.zeros(10, 8), 4)]
        [(3, 8), (3, 8), (3, 8), (1, 8)]
        >>> [tuple(c.shape) for c in chunk_dim0(torch.zeros(2, 8), 3)]
        [(1, 8), (1, 8), (0, 8)]
    """
    chunks = list(torch.chunk(tensor, world_size, dim=0))
    return chunks + [tensor.narrow(0, 0, 0)] * (world_size - len(chunks))


def _extension_type(param: torch.Tensor, owners: Owners) -> type | None:
    """The parameter's type if it defines the all-gather hooks (Note [all-gather extensions]),
    else ``None``; a type with only one of them is refused, as torch does."""
    pre, post = (hasattr(param, h) for h in ("fsdp_pre_all_gather", "fsdp_post_all_gather"))
    if pre != post:
        raise ValueError(f"{type(owners[0][0]).__name__}.{owners[0][1]} is a "
                         f"{type(param).__name__}, which defines only "
                         f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}: an "
                         "all-gather extension needs both hooks")
    return type(param) if pre else None


def _alloc_storage(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)


def contiguous_stride(size: torch.Size) -> tuple[int, ...]:
    """Row-major strides of ``size``, e.g. ``(10, 8) -> (8, 1)``."""
    return tuple(math.prod(size[i + 1:]) for i in range(len(size)))


class FSDPParam:
    """One parameter of a ``fully_shard``-ed module, sharded on dim 0 over ``mesh``'s shard
    group (the whole mesh if 1-D, its dim 1 if 2-D: Note [HSDP] in ``hsdp.py``).

    Replaces the parameter on every owning module with ``sharded_param`` (a DTensor, Note
    [the tensors of one parameter]) and keeps the buffers to rebuild the full parameter:
    ``all_gather_input()`` (the padded shard, 1-D, ``padded_shard_numel`` elements) goes in,
    ``alloc_unsharded()`` (1-D, ``N * padded_shard_numel``) is where the gathered rows go out.
    The parameter group (``FSDPParamGroup``) runs the collectives for all its parameters.

    Shapes for ``weight (10, 8)`` at N = 4, rank 3: ``sharded_size (1, 8)``,
    ``padded_sharded_size (3, 8)``, ``padded_shard_numel 24``, unsharded buffer ``(96,)``
    whose first 80 elements are ``unsharded_param (10, 8)``. With ``shard_dim=1`` (torch's
    ``Shard(1)``, from ``fully_shard``'s ``shard_placement_fn``; only even cuts) the shard is
    columns instead, made contiguous: ``(10, 2)``, no padding (Note [Shard(i) layout] in
    ``shard_placement.py``).

    Example (a world of one, so the shard is everything):
        >>> lin = nn.Linear(8, 10)
        >>> p = FSDPParam(lin.weight, [(lin, "weight")], mesh)       # doctest: +SKIP
        >>> lin.weight is p.sharded_param, lin.weight.placements     # doctest: +SKIP
        (True, (Shard(dim=0),))
    """

    def __init__(self, param: nn.Parameter, owners: Owners, mesh: DeviceMesh | MeshInfo,
                 mp_policy: MixedPrecisionPolicy | None = None,
                 offload_policy: OffloadPolicy | None = None, shard_dim: int = 0):
        if param.dim() == 0:
            raise ValueError("fully_shard shards on dim 0: a 0-d parameter has none; make it "
                             "1-d with one element")
        info = mesh if isinstance(mesh, MeshInfo) else mesh_info(mesh)
        # for errors, e.g. "Linear.weight" (taken now: fully_shard renames the class next)
        self.name = f"{type(owners[0][0]).__name__}.{owners[0][1]}"
        # Note [an SPMD mesh] (spmd_mesh.py): a DTensor on the full mesh, its local tensor cut
        self.spmd: SpmdParamLayout | None = None
        orig = param
        if info.spmd is not None:
            self.spmd = SpmdParamLayout(param, info, self.name, shard_dim)
            param = nn.Parameter(param._local_tensor, requires_grad=param.requires_grad)
        else:
            refuse_dtensor_without_dims(self.name, param)
        if not param.is_contiguous():
            raise NotImplementedError("fully_shard needs contiguous parameters")
        self.extension = _extension_type(param, owners)  # Note [all-gather extensions]
        # the dim it is cut on: 0, or i > 0 dividing evenly (resolve_shard_dims has checked)
        self.shard_dim = shard_dim
        self.owners, self.mesh = owners, info.mesh
        self.placements = (*info.placements[:-1], Shard(shard_dim))  # HSDP's Replicate() kept
        self.rank, self.world_size = info.shard_rank, info.shard_size  # the shard group's
        # Note [FSDP2 CPU offload]: the shards on the host, copied to ``device`` to compute
        self.offload_to_cpu = isinstance(offload_policy, CPUOffloadPolicy)
        self.pin_memory = self.offload_to_cpu and offload_policy.pin_memory
        self.device = mesh_device(info.mesh)
        self.grad_offload_event: torch.Event | None = None  # a non_blocking D2H in flight
        self.orig_size = param.shape
        self.orig_stride = contiguous_stride(param.shape)
        with torch.no_grad():
            chunks = (chunk_dim0(param.detach(), self.world_size) if shard_dim == 0 else
                      chunk_on_dim(param.detach(), self.world_size, shard_dim))
            mine = chunks[self.rank]
            self.sharded_size = mine.shape
            self.padded_sharded_size = chunks[0].shape  # chunk 0 is never short
            padded = param.new_zeros(self.padded_sharded_size)  # on "meta" stays on meta
            self._narrow(padded, mine.shape).copy_(mine)  # a copy: dim-i shards contiguous
            if self.offload_to_cpu and not padded.is_meta:
                padded = self._to_host_memory(padded)
        self.padded_shard_numel = padded.numel()
        self._sharded_data = padded.view(-1)
        self._owned_local: torch.Tensor | None = None  # a local tensor known to view it
        local = self._narrow(padded, mine.shape)
        self.sharded_param = nn.Parameter(self.to_sharded_dtensor(local),
                                          requires_grad=param.requires_grad)
        orig._fsdp2_sharded = True  # a parent fully_shard must not shard it again
        self.sharded_param._fsdp2_sharded = True  # nor its sharded DTensor
        self._unsharded_data: torch.Tensor | None = None  # allocated at the first unshard
        self.unsharded_param: nn.Parameter | None = None
        self._unsharded_inner: tuple[torch.Tensor, ...] = ()  # an extension's, freed too
        # without sync, the unsharded gradient summed in reduce_dtype (Note [accumulating in
        # the reduce dtype])
        self.unsharded_accumulated_grad: torch.Tensor | None = None
        self.init_dtype_attrs(mp_policy or MixedPrecisionPolicy())
        self._set_on_owners(self.sharded_param)

    def init_dtype_attrs(self, mp_policy: MixedPrecisionPolicy) -> None:
        """``orig_dtype`` (the shard's), ``param_dtype`` and ``reduce_dtype`` (``None``: no
        cast; ``mixed_precision.resolve_dtypes``). Run again at lazy init, as torch does."""
        self.mp_policy = mp_policy
        self.orig_dtype = self.sharded_param.dtype
        self.param_dtype, self.reduce_dtype = resolve_dtypes(mp_policy, self.orig_dtype)

    @property
    def unsharded_dtype(self) -> torch.dtype:
        """The all-gather's and the unsharded parameter's dtype."""
        return self.param_dtype or self.orig_dtype

    # ---- the sharded side ------------------------------------------------------------------

    def to_sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """Wrap this rank's rows (shape ``sharded_size``) as a DTensor of the full shape.

        ``shape`` and ``stride`` must be given: with uneven chunks DTensor cannot infer the
        global shape from one rank's local tensor. Used for the parameter and its gradient.

        Built from a spec, as torch's ``_from_local_no_grad`` does, not with
        ``DTensor.from_local``: that one moves ``local`` to the mesh's device type, which would
        put a CPU-offloaded shard back on the GPU (Note [FSDP2 CPU offload]; invisible on a
        CPU mesh, seen on an H200, benchmarks/RESULTS.md).
        """
        if self.spmd is not None:  # on the full mesh (Note [an SPMD mesh])
            return self.spmd.sharded_dtensor(local)
        meta = TensorMeta(self.orig_size, self.orig_stride, local.dtype)
        spec = DTensorSpec(self.mesh, tuple(self.placements), tensor_meta=meta)
        return DTensor(local.detach(), spec, requires_grad=False)

    def to_sharded_grad(self, local: torch.Tensor) -> DTensor:
        """This rank's rows of the reduced gradient (shape ``sharded_size``) as the sharded
        parameter's ``.grad``: a DTensor with the parameter's own spec.

        Built with ``DTensor(local, spec)`` rather than ``from_local``, as torch does
        (``_from_local_no_grad``): once per parameter per step, ``from_local``'s argument
        checks and new spec were a tenth of our CPU time on a GPU (benchmarks/RESULTS.md).
        """
        spec = self.sharded_param._spec
        if spec.tensor_meta is None or spec.tensor_meta.dtype != local.dtype:
            return self.to_sharded_dtensor(local)  # a dtype the spec does not describe
        return DTensor(local, spec, requires_grad=False)

    def all_gather_input(self) -> torch.Tensor:
        """The padded shard, 1-D (``padded_shard_numel``), that this rank sends: on the mesh's
        device, so a copy of it under CPU offload (Note [FSDP2 CPU offload])."""
        shard = self.padded_shard()
        if self.offload_to_cpu:
            shard = shard.to(self.device, non_blocking=True)
        return shard

    def padded_shard(self) -> torch.Tensor:
        """The padded shard, 1-D (``padded_shard_numel``), where it lives (the host under CPU
        offload).

        Note [who owns the shard's storage]: the local tensor must stay a view of
        ``_sharded_data``, or the optimizer's in-place updates would never reach the
        all-gather. ``nn.Module.to_empty`` / ``.to(device)`` break that: for a DTensor
        parameter they *swap* a fresh local tensor in (``torch.utils.swap_tensors``, keeping
        the ``Parameter`` object the optimizer holds). So before each all-gather we check,
        and re-pad whatever local tensor the parameter now has (torch: ``reset_sharded_param``).
        The check runs once per local tensor: one found to be ours is remembered, and the
        same object again is ours without looking (a swap brings a new object).
        """
        local = self.sharded_param._local_tensor
        if local is self._owned_local:  # the view we made or checked last time: still ours
            return self._sharded_data
        if local.is_meta or self._owns(local):
            self._owned_local = None if local.is_meta else local
            return self._sharded_data
        with torch.no_grad():
            padded = local.new_zeros(self.padded_sharded_size)
            self._narrow(padded, local.shape).copy_(local)
            if self.pin_memory:  # e.g. after to_empty(device="cpu"): pinned as at init
                padded = self._to_host_memory(padded)
        self._sharded_data = padded.view(-1)
        self.sharded_param._local_tensor = self._owned_local = self._narrow(padded, local.shape)
        return self._sharded_data

    def _narrow(self, padded: torch.Tensor, size: torch.Size) -> torch.Tensor:
        """The first ``size[shard_dim]`` slices of ``padded`` on the shard dim: the unpadded
        shard, a view (contiguous: only dim 0 is ever padded, Note [Shard(i) layout])."""
        return padded.narrow(self.shard_dim, 0, size[self.shard_dim])

    def _to_host_memory(self, padded: torch.Tensor) -> torch.Tensor:
        """The padded shard in CPU memory, page-locked if ``pin_memory``."""
        padded = padded.cpu()
        return padded.pin_memory() if self.pin_memory and not padded.is_pinned() else padded

    def grad_to_host(self, grad: torch.Tensor, accumulate: bool) -> torch.Tensor:
        """This rank's reduced rows ``grad`` (on the mesh's device) as the sharded gradient:
        under CPU offload a copy in CPU memory, else ``grad`` itself (Note [FSDP2 CPU
        offload]). ``accumulate``: it will be added into an existing ``.grad`` right away, so
        the copy must have finished (not ``non_blocking``)."""
        if not self.offload_to_cpu:
            return grad
        non_blocking = self.pin_memory and not accumulate
        grad = grad.to(torch.device("cpu"), non_blocking=non_blocking)
        if non_blocking and self.device.type != "cpu":  # a CPU mesh copied nothing
            # waited for in FSDPParamGroup.finalize_backward, before the optimizer reads it
            self.grad_offload_event = torch.accelerator.current_stream(
                self.device).record_event()
        return grad

    # ---- all-gather extensions (Note [all-gather extensions]) -------------------------------

    def pre_all_gather(self) -> tuple[list[torch.Tensor], Any]:
        """Call the type's ``fsdp_pre_all_gather`` on this rank's padded shard. Returns the
        tensors to all-gather, 1-D each, and the metadata for ``post_all_gather``."""
        shard = self.all_gather_input().view(self.padded_sharded_size).as_subclass(self.extension)
        mesh = self.mesh if self.mesh.ndim == 1 else self.mesh[self.mesh.mesh_dim_names[1]]
        inputs, metadata = shard.fsdp_pre_all_gather(mesh, self.orig_size, self.orig_stride,
                                                     self.owners[0][0], self.mp_policy)
        bad = [tuple(t.shape) for t in inputs if t.shape != self.padded_sharded_size]
        if not inputs or bad:
            raise ValueError(f"{self.extension.__name__}.fsdp_pre_all_gather of {self.name} "
                             f"returned tensors of shapes {bad or 'none'}; each must have the "
                             f"padded shard's shape {tuple(self.padded_sharded_size)}")
        self._ext_input_dtypes = [t.dtype for t in inputs]
        return [t.reshape(-1) for t in inputs], metadata

    def post_all_gather(self, outputs: list[torch.Tensor], metadata: Any) -> None:
        """Rebuild the unsharded parameter from the gathered ``outputs`` (1-D each, ``N *
        padded_shard_numel``) with the type's ``fsdp_post_all_gather``."""
        shard = self._sharded_data.view(self.padded_sharded_size).as_subclass(self.extension)
        outputs = tuple(t.view(-1, *self.padded_sharded_size[1:]) for t in outputs)
        if self.unsharded_param is None:
            unsharded, self._unsharded_inner = shard.fsdp_post_all_gather(
                outputs, metadata, self.unsharded_dtype)
            numel = math.prod(self.orig_size)
            if not unsharded.is_contiguous() or unsharded.numel() < numel:
                raise ValueError(f"{self.extension.__name__}.fsdp_post_all_gather of "
                                 f"{self.name} returned a tensor of shape "
                                 f"{tuple(unsharded.shape)}; it must be contiguous with at "
                                 f"least {numel} elements")
            self._unsharded_data = unsharded.view(-1)
            view = self._unsharded_data[:numel].view(self.orig_size)
            self.unsharded_param = nn.Parameter(view, self.sharded_param.requires_grad)
            return
        self.alloc_unsharded()  # the storage back
        for t in self._unsharded_inner:
            _alloc_storage(t)
        with torch.autograd._unsafe_preserve_version_counter(self.unsharded_param):
            shard.fsdp_post_all_gather(outputs, metadata, self.unsharded_dtype,
                                       out=self.unsharded_param)

    def _owns(self, local: torch.Tensor) -> bool:
        """Is ``local`` a view of our padded shard (same device, same storage)?"""
        mine = self._sharded_data
        return (not mine.is_meta and local.device == mine.device
                and local.untyped_storage().data_ptr() == mine.untyped_storage().data_ptr())

    @property
    def is_meta(self) -> bool:
        return self.sharded_param._local_tensor.is_meta

    # ---- the unsharded side ----------------------------------------------------------------

    def alloc_unsharded(self) -> torch.Tensor:
        """(Re-)allocate the unsharded buffer and return it, 1-D, ``N * padded_shard_numel``.

        The first call creates ``unsharded_param`` (an ``nn.Parameter`` viewing the buffer's
        first ``numel`` elements, Note [padding]), in ``unsharded_dtype``; later calls only
        give the *same* storage its bytes back, so every tensor that autograd saved from it is
        valid again.
        """
        local = self.sharded_param._local_tensor
        if self._unsharded_data is None:  # on the mesh's device, also when the shard is not
            device = self.device if self.offload_to_cpu else local.device
            self._unsharded_data = local.new_empty(self.world_size * self.padded_shard_numel,
                                                   dtype=self.unsharded_dtype, device=device)
            view = self._unsharded_data[: math.prod(self.orig_size)].view(self.orig_size)
            if self.spmd is not None:  # the module computes with DTensors, as before FSDP
                view = self.spmd.unsharded_dtensor(view)
            self.unsharded_param = nn.Parameter(view, self.sharded_param.requires_grad)
        else:
            storage = self._unsharded_data.untyped_storage()
            nbytes = self._unsharded_data.numel() * self._unsharded_data.element_size()
            if storage.size() != nbytes:
                storage.resize_(nbytes)
            if self.unsharded_param.requires_grad != self.sharded_param.requires_grad:
                self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
        return self._unsharded_data

    def unsharded_piece(self, k: int, i: int) -> torch.Tensor:
        """Piece ``i`` of ``k`` of the padded unsharded buffer, 1-D (Note [reshard to k ranks]
        in ``hsdp.py``): rank-major chunks ``i N/k .. (i+1) N/k - 1``, a view."""
        return self._unsharded_data.view(k, -1)[i]

    def free_unsharded(self) -> None:
        """Give the unsharded buffer's bytes back; the tensor objects stay (size-0 storage)."""
        if self._unsharded_data is not None:
            self._unsharded_data.untyped_storage().resize_(0)
        for t in self._unsharded_inner:  # an extension's (Note [all-gather extensions])
            t.untyped_storage().resize_(0)

    def to_unsharded(self) -> None:
        """Register the (already all-gathered) unsharded parameter on its modules."""
        if self.shard_dim:  # the copy-out left the shards stacked on dim 0
            unsharded_to_shard_dim(self)  # Note [Shard(i) layout]
        self._set_on_owners(self.unsharded_param)

    def to_sharded(self) -> None:
        """Register the sharded DTensor parameter again and free the unsharded buffer."""
        self._set_on_owners(self.sharded_param)
        self.free_unsharded()

    # ---- accumulating without sync (Note [accumulating in the reduce dtype]) -----------------

    def to_accumulated_grad_if_needed(self) -> None:
        """After a backward without sync: move a low-precision unsharded gradient into an
        accumulator of ``reduce_dtype``.

        Note [accumulating in the reduce dtype]: with ``set_requires_gradient_sync(False)``
        the unsharded gradients are summed over micro-batches before the one reduce-scatter.
        Summing them in bf16 would round every micro-batch's addition to 8 bits; torch sums
        in ``reduce_dtype`` (fp32) instead: the first bf16 gradient is cast into an fp32
        accumulator, each later one added to it (``accumulate_unsharded_grad_if_needed``),
        and the reduce-scatter takes the accumulator. Without a ``reduce_dtype`` different
        from the gradients', autograd's own accumulation into ``.grad`` is used."""
        grad = None if self.unsharded_param is None else self.unsharded_param.grad
        if self.reduce_dtype is None or grad is None or grad.dtype == self.reduce_dtype:
            return
        self.unsharded_param.grad = None
        self.unsharded_accumulated_grad = self.grad_data(grad).to(self.reduce_dtype)
        tag(self.unsharded_accumulated_grad, "grads")

    def accumulate_unsharded_grad_if_needed(self) -> None:
        """At a post-backward: add this backward's gradient into the accumulator, if any."""
        if self.unsharded_accumulated_grad is not None and self.unsharded_param.grad is not None:
            self.unsharded_accumulated_grad += self.grad_data(self.unsharded_param.grad)
            self.unsharded_param.grad = None

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """The gradient to reduce-scatter -- the accumulator if there is one, else the
        unsharded ``.grad`` -- and forget it here (the caller holds the only reference)."""
        grad, self.unsharded_accumulated_grad = self.unsharded_accumulated_grad, None
        if grad is None and self.unsharded_param is not None:
            grad, self.unsharded_param.grad = self.unsharded_param.grad, None
        return None if grad is None else self.grad_data(grad)

    def grad_data(self, grad: torch.Tensor) -> torch.Tensor:
        """The plain tensor FSDP reduces: ``grad`` itself, or under ``dp_mesh_dims`` the
        DTensor gradient's local tensor (Note [an SPMD mesh])."""
        return grad if self.spmd is None else self.spmd.grad_to_local(grad)

    @property
    def unsharded_local(self) -> torch.Tensor:
        """The unsharded parameter as a plain tensor (the DTensor's local one under
        ``dp_mesh_dims``)."""
        u = self.unsharded_param
        return u._local_tensor if isinstance(u, DTensor) else u

    def _set_on_owners(self, param: nn.Parameter) -> None:
        """Register ``param`` under its name on every module that shares it (tied weights).

        Four times per parameter per step (unshard and reshard, in forward and in backward),
        so the plain case skips ``nn.Module.__setattr__``, whose checks and registration hooks
        cost more than all of FSDP's own Python per parameter: it would only end in the same
        ``module._parameters[name] = param`` (torch: ``unsafe_setattr_param``). A module with
        its own ``__setattr__`` gets it called.
        """
        for module, name in self.owners:
            if type(module).__setattr__ is nn.Module.__setattr__:
                module._parameters[name] = param
            else:
                setattr(module, name, param)

    @property
    def sharded_numel(self) -> int:
        return math.prod(self.sharded_size)

    def __repr__(self) -> str:
        on = f" on dim {self.shard_dim}" if self.shard_dim else ""
        return (f"FSDPParam({tuple(self.orig_size)} -> rank {self.rank}/{self.world_size}{on}: "
                f"{tuple(self.sharded_size)}, padded {tuple(self.padded_sharded_size)})")
