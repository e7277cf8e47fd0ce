"""FSDP1's FlatParameter: one unit's parameters as one flat, padded 1-D tensor, sharded N ways.

``minifsdp.fsdp1`` shards a model *unit* by unit. This module is the data layout of one unit:
its parameters are copied, back to back, into one 1-D tensor, padded to a multiple of N and cut
into N equal shards; rank r keeps shard r as a ``FlatParameter`` (an ``nn.Parameter``), the one
tensor of the unit that the optimizer steps. To compute, the unit all-gathers the N shards into
the unsharded flat tensor, and every original parameter becomes a *view* into it::

    handle = FlatParamHandle(named_params, rank=r, world_size=N)  # the modules now hold views
    handle.flat_param             # (padded_numel / N,): this rank's shard, what the optimizer sees
    handle.unshard()              # all-gather the N shards into handle.unsharded (padded_numel,)
    handle.use_unsharded_views()  # module.weight = handle.unsharded[o:o + n].view(shape)
    ...forward, backward...
    handle.reshard()              # free the unsharded storage; only the shard remains

*When* to unshard and reshard, and what to do with gradients, is ``fully_sharded.py``'s business.
torch's ``FlatParamHandle`` (torch/distributed/fsdp/_flat_param.py) is the model.

Note [flat layout]: parameters go in ``named_modules()`` order, each module's in registration
order, a tied parameter once (Note [tied parameters]). Parameter i occupies
``unsharded[offsets[i]:offsets[i] + numel_i]``; each offset is rounded up to a 16-byte boundary
(Note [alignment]) and the total is padded with zeros to a multiple of N, so the N shards are
equal and a reduce-scatter of the flat gradient needs no copy. Padding is never seen by the
model; its gradient is zero, so the optimizer keeps it at zero. ``ParamInfo`` records each
parameter's fqn, shape, numel and offset, which is all one needs to find it again.

Note [alignment]: torch FSDP1 with ``use_orig_params=True`` starts every parameter at a 16-byte
boundary (kernels compiled by Inductor assume aligned pointers). We do the same, and it buys
more than speed: gloo's (and NCCL's) reduce-scatter adds an element's N contributions in an
order that depends on the element's *position* in the buffer (measured: shifting a buffer by
one element changes last bits at N = 3 and 4). With the same layout as torch, our gradients are
bitwise torch's at every N, not only at N = 2; packed tightly, an MLP of odd sizes trained at
N = 3 ends 9e-10 away from torch (tests/workers/fsdp1_worker.py).

Note [views, not copies]: during compute ``module.weight`` is ``unsharded[o:o+n].view(shape)``,
made with autograd from the leaf ``unsharded`` (requires_grad). Backward therefore delivers
every view's gradient into one flat ``unsharded.grad`` of shape ``(padded_numel,)`` (split's
backward concatenates, zeros in the padding): exactly the reduce-scatter's input. A copy would
double the memory and need a copy back; a view costs nothing. Views are made fresh at each
forward (cheap) and stored in the module's ``__dict__``; the registered entry in
``module._parameters`` is left as ``None``, which keeps its position (so state-dict order
survives) but hides it from ``parameters()``: the optimizer sees only the FlatParameter.
Between iterations the attributes still hold the last views, whose storage has been freed:
read parameters through ``fsdp1.summon_full_params`` or ``fsdp1.full_state_dict``.

Note [freeing storage]: after the forward, autograd still holds the views it saved for backward
(a Linear saves its weight to compute the input's gradient), so dropping our reference to the
unsharded tensor would free nothing. FSDP instead frees the *storage*:
``unsharded.untyped_storage().resize_(0)``: every view keeps its shape but owns zero bytes.
Before the unit's backward the same storage is resized and all-gathered into again, and the
saved views see the data once more. (``MemoryTracker`` patches ``resize_`` to see this.)

Note [two tensors, one storage]: the all-gather writes into ``_buffer``, and the views are
made from ``unsharded``: two tensor objects over the same storage (``unsharded.data =
_buffer``). Why two? Autograd checks that a saved tensor was not modified in place, by a
version counter shared by a tensor and its views. Writing the backward all-gather into
``unsharded`` itself would bump that counter and backward would refuse the saved views;
``_buffer`` has its own counter. (torch FSDP1 plays the same trick with ``flat_param.data``.)

Note [tied parameters]: a parameter reachable under two names (GPT's ``tok_emb.weight`` and
``head.weight`` with ``tie_embeddings``) is flattened once, under its first name; the second
name is a ``SharedParamInfo`` pointing at the first, and gets the *same* view, so autograd sums
both uses' gradients into one place, as for the unwrapped model. Both names must be in the
same unit (Note [tied parameters across units] in ``wrap.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from minifsdp import comm
from minifsdp.memory import tag

ALIGN_BYTES = 16  # Note [alignment]


@dataclass(frozen=True, eq=False)
class ParamInfo:
    """Where one original parameter lives: ``module.<name>`` (``fqn``, relative to the unit's
    module) is ``unsharded[offset:offset + numel].view(shape)``."""

    fqn: str
    module: nn.Module
    name: str
    shape: torch.Size
    numel: int
    offset: int


@dataclass(frozen=True, eq=False)
class SharedParamInfo:
    """A second name of a tied parameter: ``module.<name>`` is the view of ``infos[primary]``."""

    fqn: str
    module: nn.Module
    name: str
    primary: int


class FlatParameter(nn.Parameter):
    """This rank's shard of one unit's flattened parameters: what the optimizer steps.

    Shape ``(padded_numel // world_size,)``, or ``(padded_numel,)`` when not sharded (NO_SHARD).
    Its metadata (set by ``FlatParamHandle``) says what it holds: ``infos`` (one ``ParamInfo``
    per distinct original parameter), ``shared`` (``SharedParamInfo``, tied names),
    ``padded_numel``, ``rank``, ``world_size`` and ``sharded``.

    Example (rank 1 of 3; see ``FlatParamHandle``)::

        [flat] = model.parameters()        # one FlatParameter per unit
        flat.shape, flat.padded_numel      # (torch.Size([36]), 108)
        [(i.fqn, i.offset) for i in flat.infos]   # [('0.weight', 0), ('0.bias', 72), ...]
    """

    infos: list[ParamInfo]
    shared: list[SharedParamInfo]
    padded_numel: int
    rank: int
    world_size: int
    sharded: bool
    frozen_slices: list[tuple[int, int]]  # Note [frozen parameters] in options.py


def flat_layout(numels: list[int], world_size: int, align: int = 1) -> tuple[list[int], int]:
    """Offsets of parameters of ``numels`` elements laid out back to back, each start rounded up
    to a multiple of ``align`` elements, and the total padded to a multiple of ``world_size``
    (Note [flat layout]). Returns ``(offsets, padded_numel)``.

    Example:
        >>> flat_layout([70, 7, 21, 3], world_size=3, align=4)  # Linear(10, 7), Linear(7, 3)
        ([0, 72, 80, 104], 108)
    """
    offsets, total = [], 0
    for n in numels:
        total = -(-total // align) * align
        offsets.append(total)
        total += n
    return offsets, -(-total // world_size) * world_size


def rank_shard(full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the padded flat tensor ``full`` (``(padded_numel,)``, a multiple
    of ``world_size``): the view ``full[rank * s:(rank + 1) * s]``, ``s = padded_numel / N``;
    the padding, at the end of ``full``, falls in the last rank's shard (Note [flat layout]).

    Example:
        >>> rank_shard(torch.arange(6.0), rank=1, world_size=3).tolist()
        [2.0, 3.0]
    """
    s = full.numel() // world_size
    return full[rank * s:(rank + 1) * s]


Named = tuple[str, nn.Module, str, nn.Parameter]  # (fqn, module, attribute name, parameter)


def registered_params(module: nn.Module) -> list[Named]:
    """``(fqn, module, name, parameter)`` for every name under which a parameter is registered
    below ``module``, in ``named_modules()`` order: a tied parameter appears once per name.

    Example:
        >>> [(fqn, name) for fqn, _, name, _ in registered_params(nn.Linear(2, 2))]
        [('weight', 'weight'), ('bias', 'bias')]
    """
    return [(f"{mname}.{pname}" if mname else pname, m, pname, p)
            for mname, m in module.named_modules() for pname, p in m._parameters.items()
            if p is not None]


class FlatParamHandle:
    """Flatten ``params`` into one ``FlatParameter`` shard and manage its unsharded copy.

    Args:
        params: ``(fqn, module, name, parameter)`` for every name under which a parameter of the
            unit is registered, in the order of Note [flat layout]; a parameter listed twice is
            tied. They must share dtype and device and not be on ``meta``; some may be frozen
            (``requires_grad=False``: Note [frozen parameters] in
            ``options.py``).
        rank, world_size: this rank's place in ``process_group``.
        sharded: False for NO_SHARD: the "shard" is the whole padded flat tensor.
        device: the compute device (default: the parameters'); ``unsharded`` lives there.
        offload: keep ``flat_param`` in CPU memory (Note [CPU offload] in ``fully_sharded.py``).
        process_group: the group of the all-gather.

    Afterwards the modules have ``_parameters[name] = None`` and hold views (Note [views, not
    copies]). Attributes: ``flat_param`` (``(padded_numel / N,)``), ``unsharded`` (the compute
    leaf, ``(padded_numel,)``, storage freed while ``not is_unsharded``), ``infos``, ``shared``.

    Example:
        >>> seq = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 3))
        >>> h = FlatParamHandle(registered_params(seq), rank=1, world_size=3)
        >>> h.flat_param.shape, h.padded_numel, [i.offset for i in h.infos]
        (torch.Size([36]), 108, [0, 72, 80, 104])
        >>> list(seq.parameters())     # the modules hold views now, no parameters
        []
    """

    def __init__(self, params: list[Named], rank: int, world_size: int, *, sharded: bool = True,
                 device: torch.device | None = None, offload: bool = False,
                 process_group=None, label: str = "", param_dtype: torch.dtype | None = None):
        if not params:
            raise ValueError("FlatParamHandle needs at least one parameter")
        primary: dict[int, int] = {}  # id(parameter) -> index in self.infos
        unique: list[nn.Parameter] = []
        for fqn, _, _, p in params:
            if p.device.type == "meta":
                raise ValueError(f"parameter {fqn!r} is on the meta device: materialize the module "
                                 "first (module.to_empty(device=...), then initialize it)")
            if id(p) not in primary:
                primary[id(p)] = len(unique)
                unique.append(p)
        if len({(p.dtype, p.device) for p in unique}) > 1:
            kinds = sorted({(str(p.dtype), str(p.device)) for p in unique})
            raise ValueError(f"unit {label or '(root)'}: parameters of one unit must share dtype "
                             f"and device, got {kinds}")
        dtype = unique[0].dtype
        self.device = torch.device(device) if device is not None else unique[0].device
        self.rank, self.world_size, self.sharded = rank, world_size, sharded
        self.offload, self.process_group, self.label = offload, process_group, label
        # Note [FSDP1 mixed precision] in options.py: the shard keeps ``dtype``; the
        # unsharded flat tensor (what forward and backward use) is in ``compute_dtype``
        self.compute_dtype = param_dtype if param_dtype is not None else dtype
        self.mixed = self.compute_dtype != dtype
        offsets, self.padded_numel = flat_layout([p.numel() for p in unique], world_size,
                                                 max(1, ALIGN_BYTES // dtype.itemsize))
        self.infos: list[ParamInfo] = []
        self.shared: list[SharedParamInfo] = []
        seen: set[int] = set()
        for fqn, module, name, p in params:
            if id(p) in seen:
                self.shared.append(SharedParamInfo(fqn, module, name, primary[id(p)]))
            else:
                seen.add(id(p))
                self.infos.append(ParamInfo(fqn, module, name, p.shape, p.numel(),
                                            offsets[primary[id(p)]]))

        full = torch.zeros(self.padded_numel, dtype=dtype, device=self.device)
        with torch.no_grad():
            for info, p in zip(self.infos, unique):
                full[info.offset:info.offset + info.numel].copy_(p.reshape(-1))
                p._minifsdp_flattened = label or "?"  # Note [tied parameters across units]
        # seam "flat_param.shard" (lab 04), like "flat_param.layout" (flat_layout above)
        shard = rank_shard(full, rank, world_size) if sharded else full
        shard = shard.to("cpu", copy=True) if offload else shard.clone() if sharded else shard
        frozen = [not p.requires_grad for p in unique]
        self.flat_param = FlatParameter(shard, requires_grad=not all(frozen))
        fp = self.flat_param
        fp.infos, fp.shared, fp.padded_numel = self.infos, self.shared, self.padded_numel
        fp.rank, fp.world_size, fp.sharded = rank, world_size, sharded
        # this rank's (start, end) in flat_param of each frozen parameter's elements
        fp.frozen_slices = [sl for info, f in zip(self.infos, frozen) if f
                            for sl in [self.local_slice(info)] if sl is not None]

        # Note [two tensors, one storage]. NO_SHARD without offload or mixed precision computes
        # on the flat parameter's own storage: nothing to gather, nothing to free.
        self._owns_buffer = sharded or offload or self.mixed
        self._buffer = fp.data if not self._owns_buffer else (
            full.to(self.compute_dtype) if self.mixed else full)
        self._full_precision = False  # unsharded in the shard's dtype (summon_full_params)
        self.unsharded = torch.empty(0, dtype=self.compute_dtype, device=self.device
                                     ).requires_grad_(fp.requires_grad)
        self.unsharded.data = self._buffer
        self.is_unsharded = True
        self._split_sizes, self._chunk_of = [], []  # split of unsharded: gaps, params, tail
        end = 0
        for info in self.infos:
            if info.offset > end:
                self._split_sizes.append(info.offset - end)
            self._chunk_of.append(len(self._split_sizes))
            self._split_sizes.append(info.numel)
            end = info.offset + info.numel
        if self.padded_numel > end:
            self._split_sizes.append(self.padded_numel - end)
        with torch.no_grad():
            self.use_unsharded_views()  # the modules' names now point into the flat tensor
        self.reshard()

    @property
    def shard_numel(self) -> int:
        """Elements per rank, padding included: ``padded_numel / world_size`` (all when not
        sharded)."""
        return self.padded_numel // self.world_size if self.sharded else self.padded_numel

    def local_slice(self, info: ParamInfo) -> tuple[int, int] | None:
        """``(start, end)`` of ``info``'s elements within this rank's ``flat_param`` (None if
        it has none here): the part of the parameter this rank owns and steps."""
        base = self.rank * self.shard_numel if self.sharded else 0
        lo = max(info.offset, base)
        hi = min(info.offset + info.numel, base + self.shard_numel)
        return (lo - base, hi - base) if hi > lo else None

    # ---- unshard / reshard ------------------------------------------------------------------

    def unshard(self, tag_: str | None = None) -> None:  # seam "flat_param.unshard" (lab 04)
        """Give the unsharded storage its bytes back and all-gather the N shards into it (a copy
        to the compute device when not sharded but offloaded): the views autograd saved see the
        parameters again (Note [freeing storage]). A no-op if already unsharded. ``tag_``
        labels the collective in the comm log."""
        if self.is_unsharded:
            return
        self._buffer.untyped_storage().resize_(self._buffer.numel() * self._buffer.element_size())
        tag(self._buffer, "params")  # Note [memory categories] in fully_sharded.py
        with torch.no_grad():
            if self.sharded:
                comm.all_gather_into_tensor(self._buffer, self.gather_input(),
                                            self.process_group, tag=tag_)
            else:  # NO_SHARD + offload / mixed precision: a copy (and cast)
                self._buffer.copy_(self.flat_param)
        self.is_unsharded = True

    def gather_input(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """What this rank sends to the all-gather: its shard, detached, on the compute device (a
        copy under CPU offload: Note [CPU offload] in ``fully_sharded.py``) and in ``dtype``
        (default: the compute dtype; a cast under mixed precision, so the all-gather moves half
        the bytes: Note [FSDP1 mixed precision] in ``options.py``). Without either knob, the
        shard itself."""
        shard = self.flat_param.detach()
        if self.offload:
            shard = shard.to(self.device, copy=True)
            tag(shard, "comm")
        dtype = dtype if dtype is not None else self.compute_dtype
        if shard.dtype != dtype:
            shard = shard.to(dtype)
            tag(shard, "comm")
        return shard

    @torch.no_grad()
    def unshard_full_precision(self, tag_: str | None = None) -> None:
        """Unshard in the shard's own dtype (fp32 under mixed precision), as torch FSDP1's
        ``summon_full_params`` does: its writes can go back to the shard without rounding.
        Undo with ``end_full_precision()``. Without mixed precision: ``unshard()``."""
        if not self.mixed:
            return self.unshard(tag_)
        self.reshard()  # a low-precision copy would be stale after writes to the fp32 one
        if self.sharded or self.offload:
            full = torch.empty(self.padded_numel, dtype=self.flat_param.dtype, device=self.device)
            tag(full, "params")
            if self.sharded:
                comm.all_gather_into_tensor(full, self.gather_input(full.dtype),
                                            self.process_group, tag=tag_)
            else:  # NO_SHARD + offload: a copy
                full.copy_(self.flat_param)
        else:  # NO_SHARD: the flat parameter is the full one
            full = self.flat_param.detach()
        self.unsharded.data = full
        self._full_precision = self.is_unsharded = True

    def end_full_precision(self) -> None:
        """Back from ``unshard_full_precision()`` under mixed precision: drop the
        full-precision copy; the low-precision one is gathered again when next needed."""
        if self._full_precision:
            self.unsharded.data = self._buffer  # its storage is free (reshard above)
            self._full_precision = self.is_unsharded = False

    def reshard(self) -> None:  # seam "flat_param.reshard" (lab 04)
        """Free the unsharded storage (Note [freeing storage]); views keep their shapes. A no-op
        when there is nothing to free (NO_SHARD without offload) or it is already free."""
        if self._owns_buffer and self.is_unsharded:
            self._buffer.untyped_storage().resize_(0)
            self.is_unsharded = False

    def reduce_grad(self, grad: torch.Tensor, divide: tuple[float, float],
                    tag_: str | None = None) -> Callable[[], torch.Tensor]:
        # seam "flat_param.reduce_scatter" (lab 04)
        """Start averaging the flat gradient ``grad`` (``(padded_numel,)``, this rank's, in the
        reduce dtype) over the process group; return ``finish``, which waits for the collective
        and returns this rank's part of the average: ``(shard_numel,)``, elements
        ``[rank * s, (rank + 1) * s)`` of the padded flat tensor (all of it for NO_SHARD).

        As torch FSDP1: ``grad`` divided by ``divide[0]``, a SUM reduce-scatter (an all-reduce
        when not sharded), the result divided by ``divide[1]`` (Note [divide before and after]
        in ``fully_sharded.py``). ``grad`` is consumed: divided in place, and on the CPU its
        storage is freed as soon as the collective is done (Note [final callback]).

        Example (2 ranks, every rank's ``grad`` full of 4.0)::

            finish = handle.reduce_grad(grad, (2.0, 1.0), "unit grad")   # issued, not waited
            finish()                 # (padded_numel / 2,) of 4.0; grad's storage: 0 bytes
        """
        before, after = divide
        if before > 1:
            grad.div_(before)
        if self.sharded:
            out = grad.new_empty(self.shard_numel)
            tag(out, "grads")  # Note [memory categories] in fully_sharded.py
            work = comm.reduce_scatter_tensor(out, grad, group=self.process_group,
                                              async_op=True, tag=tag_)
        else:
            out = grad
            work = comm.all_reduce(grad, group=self.process_group, async_op=True, tag=tag_)

        def finish() -> torch.Tensor:
            work.wait()
            if grad is not out and grad.device.type == "cpu":
                # freed now, not when gloo's thread lets go of its work (Note [final callback])
                grad.untyped_storage().resize_(0)
            if after > 1:
                out.div_(after)
            return out
        return finish

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy this rank's slice of the unsharded tensor into the shard (after writing to the
        unsharded parameters, e.g. in ``summon_full_params``)."""
        src = self.unsharded.detach()
        if self._owns_buffer and src.data_ptr() != self.flat_param.data_ptr():
            r, s = self.rank if self.sharded else 0, self.shard_numel
            self.flat_param.copy_(src[r * s:(r + 1) * s])

    # ---- views ------------------------------------------------------------------------------

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:  # seam "flat_param.views"
        """Views of ``flat`` (shape ``(padded_numel,)``) with the original shapes, one per
        ``infos`` entry: for an unsharded tensor, the parameters; for its gradient, theirs.

        Example:
            >>> lin = nn.Linear(3, 2)
            >>> h = FlatParamHandle([("weight", lin, "weight", lin.weight),
            ...                      ("bias", lin, "bias", lin.bias)], rank=0, world_size=1)
            >>> h.padded_numel, [i.offset for i in h.infos]   # the bias starts 16-byte aligned
            (10, [0, 8])
            >>> [t.tolist() for t in h.unflatten(torch.arange(10.0))]
            [[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], [8.0, 9.0]]
        """
        chunks = torch.split(flat, self._split_sizes)
        return [chunks[c].view(info.shape) for c, info in zip(self._chunk_of, self.infos)]

    def use_unsharded_views(self, as_params: bool = False) -> None:
        """Point every original name (tied ones too) at its view of ``unsharded``. Made with
        autograd when grad is enabled (Note [views, not copies]). With ``as_params`` the views are
        registered as ``nn.Parameter`` (sharing the storage) so that ``named_parameters()`` and
        ``state_dict()`` see the original names; otherwise they are plain attributes."""
        views = self.unflatten(self.unsharded)
        for info, view in zip(self.infos, views):
            _set_param(info.module, info.name, view, as_params)
        for s in self.shared:
            _set_param(s.module, s.name, getattr(self.infos[s.primary].module,
                                                 self.infos[s.primary].name), as_params)


def _set_param(module: nn.Module, name: str, tensor: torch.Tensor, as_param: bool) -> None:
    if as_param:
        if not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=False)
        module.__dict__.pop(name, None)
        module._parameters[name] = tensor
    else:  # keep the slot (state_dict order), hidden from parameters(); the view wins lookup
        module._parameters[name] = None
        module.__dict__[name] = tensor
