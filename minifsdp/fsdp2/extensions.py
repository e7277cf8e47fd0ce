"""The all-gather of a group with extension parameters: one buffer of raw bytes (chapter 07).

``FSDPParamGroup`` gathers a plain group through one buffer of one dtype (Note [copy-in and
copy-out]). Once a parameter's type chooses its own all-gather inputs (Note [all-gather
extensions] in ``fsdp_param.py``, e.g. float8 bytes from ``float8.py``), the inputs of one
group have several dtypes, yet they must still travel in ONE collective -- the point of FSDP2's
"FP8 all-gather mixed with other parameters". So the buffer becomes ``uint8`` and every input
is copied in, and every output copied out, through a ``uint8`` view of it (torch does the
same: ``_get_all_gather_input_metadatas`` switches the buffer to uint8 as soon as two dtypes
mix, and ``foreach_all_gather_copy_out`` views the outputs as uint8). Views of the *inputs
and outputs*, never of the buffer as another dtype: a bf16 piece at an odd byte offset would
be misaligned. Byte layout, for a group of a Float8Weight W (padded shard w elements) and a
bias b (padded shard c elements), param_dtype bf16::

    rank r's slot:   [ W: w bytes (fp8) | b: 2c bytes (bf16) ]      S = w + 2c bytes
    buffer:          [ slot 0 | slot 1 | ... | slot N-1 ]           N S bytes, rank-major

so the wire carries W at 1 byte an element, a quarter of fp32 and half of bf16. gloo cannot
move float8 at all (Note [gloo dtypes]); uint8 it can. Always bytes, even when every input
of the group has one dtype (torch then gathers in that dtype, which fails on gloo for an
all-float8 group): the same path in every case.

Also here, the parameter types themselves: ``ExtensionWeight``, the base of ours (chapter 07's
``Float8Weight``, chapter 12's ``QuantizedWeight``), and ``OnTorch``, which runs the same hooks
under torch's ``fully_shard`` so that torch can be the bitwise oracle for them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.utils._pytree as pytree

from minifsdp import comm
from minifsdp.fsdp2.custom_comm import AllGather, allocate
from minifsdp.fsdp2.fsdp_param import FSDPParam
from minifsdp.memory import tag


class ExtensionWeight(torch.Tensor):
    """Base of a parameter type that chooses its own all-gather (Note [all-gather extensions]
    in ``fsdp_param.py``): ``Float8Weight`` (chapter 07) and ``QuantizedWeight`` (chapter 12).

    It only *marks* the parameter: it holds the master data itself, and every op on it returns
    a plain ``torch.Tensor`` (``detach`` keeps the type, so ``nn.Parameter`` accepts it). A
    subclass defines torch's two hooks, ``fsdp_pre_all_gather`` and ``fsdp_post_all_gather``
    (whose later calls end in ``write_unsharded``). The hooks must not rely on ``self``'s type:
    ``OnTorch`` calls them with its own.

    Example:
        >>> class Marked(ExtensionWeight): pass
        >>> w = torch.nn.Parameter(Marked(torch.ones(2)))
        >>> type(w).__name__, type(w * 2).__name__
        ('Marked', 'Tensor')
    """

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> ExtensionWeight:
        return data.as_subclass(cls)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out.as_subclass(cls) if func is torch.Tensor.detach else out


def write_unsharded(out: torch.Tensor, full: torch.Tensor) -> None:
    """A post-all-gather hook's later calls: write ``full`` into ``out``, the unsharded
    parameter whose storage FSDP restored -- an in-place write into a tensor autograd saved,
    so its version is kept (Note [version counter]); torch's FSDP2 does not do it for a hook,
    so the hook must."""
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
        out.copy_(full)


class OnTorch(torch.Tensor):
    """An ``ExtensionWeight``'s hooks on torch's own ``fully_shard``, for the bitwise oracle.

    torch shards a parameter with ordinary ops (``empty_like``, ``slice``, ``copy_``, ...)
    and calls the hooks on the *unpadded* local shard, so a type that only marks the
    parameter, as ``ExtensionWeight`` does, is lost on the way. This is a wrapper subclass in
    torchao's style that keeps its type through exactly those ops (torchao's
    ``_ops_to_preserve_subclass``, plus ``detach`` for ``nn.Parameter``); its pre-hook pads the
    local shard with zeros to the padded shard's rows, as minifsdp hands it, and runs
    ``ours``'s hooks. A subclass names ``ours``.

    Example:
        >>> from minifsdp.fsdp2.float8 import Float8Weight
        >>> class TorchFloat8Weight(OnTorch): ours = Float8Weight
        >>> w = torch.nn.Parameter(TorchFloat8Weight(torch.ones(2, 3)))
        >>> type(w.detach()).__name__, type(w * 2).__name__
        ('TorchFloat8Weight', 'Tensor')
    """

    ours: type[ExtensionWeight]
    _preserve = {torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default,
                 torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default,
                 torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
                 torch.ops.aten._to_copy.default, torch.ops.aten.split.Tensor,
                 torch.ops.aten.clone.default, torch.ops.aten.detach.default}

    @staticmethod
    def __new__(cls, t: torch.Tensor) -> OnTorch:
        return torch.Tensor._make_wrapper_subclass(
            cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(),
            dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)

    def __init__(self, t: torch.Tensor):
        self._t = t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, lambda x: x._t, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, cls, out) if func in cls._preserve else out

    def __tensor_flatten__(self):
        return ["_t"], None

    @classmethod
    def __tensor_unflatten__(cls, inner, spec, size, stride):
        return cls(inner["_t"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        padded = self._t.new_zeros((math.ceil(outer_size[0] / mesh.size()), *outer_size[1:]))
        padded[: self.shape[0]].copy_(self._t)
        return self.ours.fsdp_pre_all_gather(padded.as_subclass(self.ours), mesh, outer_size,
                                             outer_stride, module, mp_policy)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        return self.ours.fsdp_post_all_gather(self, outputs, metadata, param_dtype, out=out)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A ``uint8`` view of a contiguous tensor: ``element_size()`` bytes per element."""
    return t.reshape(-1).view(torch.uint8)


@torch.no_grad()
def all_gather_copy_in_bytes(params: list[FSDPParam], gather_dtype: torch.dtype, rank: int,
                             world_size: int, label: str, all_gather_comm: AllGather,
                             ) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Run each extension's pre-hook, cast the other parameters' padded shards to
    ``gather_dtype``, and lay all their bytes into slot ``rank`` of a ``uint8`` buffer of
    ``world_size`` slots, from ``all_gather_comm.allocate`` (Note [custom collectives]).
    ``label``: the group's name, for tags. Returns ``(slot, buffer,
    layout)``: ``layout[i] = (dtypes, byte sizes, metadata)`` of parameter i's inputs, for
    the copy-out."""
    inputs: list[torch.Tensor] = []
    layout: list[tuple[list[torch.dtype], list[int], Any]] = []
    for p in params:
        if p.extension is not None:  # its collectives (Float8Weight's amax) tagged, e.g.
            with comm.tagged(f"fsdp2 {p.extension.__name__} {label}"):  # "... blocks.0"
                ts, metadata = p.pre_all_gather()
        else:  # the mixed-precision cast (Note [mixed precision]), a slot-sized temporary
            ts, metadata = [p.all_gather_input().to(gather_dtype)], None
        inputs += ts
        layout.append(([t.dtype for t in ts], [t.numel() * t.element_size() for t in ts],
                       metadata))
    sizes = [t.numel() * t.element_size() for t in inputs]
    gathered = allocate(all_gather_comm, world_size * sum(sizes), torch.uint8, inputs[0].device,
                        f"{label}'s all-gather")
    tag(gathered, "comm", label="all-gather buffers")
    my_slot = gathered.narrow(0, rank * sum(sizes), sum(sizes))
    for dst, src in zip(my_slot.split(sizes), inputs):
        dst.copy_(_bytes(src))
    return my_slot, gathered, layout


@torch.no_grad()
def all_gather_copy_out_bytes(params: list[FSDPParam], gathered: torch.Tensor,
                              world_size: int, layout: list, label: str) -> None:
    """Copy each parameter's ``world_size`` pieces out of the rank-major byte buffer: a plain
    parameter's straight into its unsharded buffer (under the version-counter guard, Note
    [version counter]); an extension's into fresh outputs that its post-hook turns into the
    unsharded parameter and that are freed right after -- one parameter's at a time."""
    rows = gathered.view(world_size, -1)  # row r: rank r's slot
    offset = 0
    for p, (dtypes, nbytes, metadata) in zip(params, layout):
        if p.extension is None:
            buf = p.alloc_unsharded()
            tag(buf, "params", label=label)
            with torch.autograd._unsafe_preserve_version_counter(buf):
                _bytes(buf).view(world_size, -1).copy_(rows[:, offset: offset + nbytes[0]])
            offset += nbytes[0]
            continue
        outputs = []
        for dtype, n in zip(dtypes, nbytes):
            out = torch.empty(world_size * n, dtype=torch.uint8, device=gathered.device)
            tag(out, "comm", label="all-gather buffers")
            out.view(world_size, -1).copy_(rows[:, offset: offset + n])
            outputs.append(out.view(dtype))
            offset += n
        p.post_all_gather(outputs, metadata)
        tag(p._unsharded_data, "params", label=label)
        for out in outputs:
            out.untyped_storage().resize_(0)  # as the group buffer (``_free``)
