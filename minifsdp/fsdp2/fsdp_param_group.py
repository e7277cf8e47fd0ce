"""``FSDPParamGroup``: the parameters of one ``fully_shard`` call, communicated together.

Each parameter is sharded on its own (``FSDPParam``), but one collective per parameter would
pay the per-call latency hundreds of times per step. So the parameters of one
``fully_shard(module)`` form a group with ONE all-gather before the module computes and ONE
reduce-scatter after its backward::

    unshard:   padded shards --copy-in--> [rank 0 | rank 1 | ... ] --all-gather--> same buffer,
               every slot filled --copy-out--> each parameter's unsharded buffer
    backward:  unsharded grads --copy-in--> [rank 0 | rank 1 | ... ] --reduce-scatter (avg)-->
               my slot --views--> each sharded parameter's .grad (a DTensor)

"Ranks" are the mesh's *shard group*: all of a 1-D mesh, dim 1 of a 2-D HSDP mesh, where a
third collective follows the reduce-scatter -- an all-reduce (avg) of my slot across the
replicate group (Note [HSDP] in ``hsdp.py``). ``self.rank`` / ``self.world_size`` /
``self.process_group`` are the shard group's.

A group is ``SHARDED`` or ``UNSHARDED`` (``ShardedState``; with ``reshard_after_forward=k``
also ``SHARDED_POST_FORWARD`` between forward and backward), and moves through
``TrainingState`` IDLE -> FORWARD -> (IDLE) -> PRE_BACKWARD -> POST_BACKWARD -> IDLE in every
step. ``FSDPState`` (``fsdp_state.py``) decides *when*; this module does the work.

Note [copy-in and copy-out]: ``all_gather_into_tensor`` concatenates the ranks' inputs, so
the gathered buffer is *rank-major*: rank 0's padded shards of every parameter, then rank
1's, ... A parameter's rows are therefore spread over N places, and it cannot be a view of
the group's buffer: ``_all_gather_copy_out`` copies each parameter's N pieces into its own
buffer (one ``split_with_sizes_copy``), and the group buffer is freed at once. Gradients go
the same way backwards: ``reduce_scatter_copy_in`` (``reduce.py``) lays each gradient's chunk
r into slot r (``torch._chunk_cat``, which zero-pads short chunks exactly as Note [padding]
in ``fsdp_param.py``). These two copy-ins are single methods on purpose: mixed precision
(chapter 07) casts right there -- the all-gather input to bf16, the gradients to the reduce
dtype -- and prefetching (chapter 06) splits ``unshard`` into "issue the all-gather" and
"wait, then copy out" (``unshard(async_op=True)`` / ``wait_for_unshard``).

Note [freeing with resize_]: in forward, autograd *saves* tensors it needs for backward --
for ``F.linear(x, w)`` the weight ``w`` itself, i.e. our unsharded parameter (or a view of
it). To reshard after forward we must free that memory, yet backward will use the very
tensor objects autograd saved. If we dropped them, the saved ones would keep the memory alive
(nothing freed); if we made new ones at the next all-gather, autograd would still hold the
old. The way out: keep the tensor objects forever and free only their *storage*:
``untyped_storage().resize_(0)`` leaves every tensor and view in place with zero bytes
behind them; ``resize_(nbytes)`` before the next all-gather gives the same storage bytes
again, which the copy-out fills, and every saved view is valid once more. (Reading a saved
tensor while its storage is empty would fail, which is why the pre-backward hook must
unshard before the module's backward runs.)

Note [version counter]: autograd also checks that a saved tensor was not modified in place
since forward (its version counter). The copy-out *is* an in-place write into saved tensors
-- deliberately, it restores the very values they had -- so it runs under
``torch.autograd._unsafe_preserve_version_counter``, as torch's FSDP does.

Note [FSDP2 memory categories]: what ``minifsdp.memory.MemoryTracker`` counts where.
``params``: the padded shards (the DTensors' local tensors are views of them, padding
included) and, while a group is unsharded, the unsharded buffers (tagged on re-allocation:
they are parameters registered on the module). ``grads``: the reduce-scatter output -- the
sharded ``.grad`` DTensors are views of it -- and the unsharded gradients that autograd
accumulates before the reduce-scatter (tagged in the post-accumulate-grad hook,
``fsdp_state.py``). ``comm``: the group's all-gather buffer and reduce-scatter input, which
exist only around their collective (and an all-gather extension's gathered outputs, one
parameter's at a time: ``extensions.py``). With mixed precision (``mixed_precision.py``) the same
categories hold at other sizes: unsharded buffers, unsharded gradients and the all-gather
buffer in ``param_dtype``, the reduce-scatter input in the reduce dtype; when that differs
from the shards' dtype, the reduce-scatter output is ``comm`` too (it dies at once) and its
cast-up copy is ``grads``; an accumulator of the reduce dtype (no sync) is ``grads``.

Note [GPUs]: nothing here is device-specific -- buffers are made on the parameters' device
(``new_empty``, or a comm's ``allocate``: Note [custom collectives] in ``custom_comm.py``),
the collectives take the mesh's process group (NCCL on GPUs) -- but this has only been run on
CPU/gloo. On GPUs a blocking NCCL call only makes the current stream wait
for the collective, so copy-out, freeing and the next kernels are ordered on that stream, and
c10d keeps a collective's tensors from being reused by the caching allocator before NCCL is
done with them.
Everything runs on the current stream; overlapping communication with compute is chapter 06's
prefetching (Note [prefetch on GPUs] in ``prefetch.py``: what torch does with its separate
all-gather streams and events, and what we do instead).

Note [a shard group of one rank]: with one rank to shard over (one GPU; an HSDP mesh (R, 1))
the copy-in already wrote the whole gathered buffer -- slot 0 *is* my slot -- and my slot of
the reduce-scatter is the whole input. So a group of one issues no collective at all:
``unshard`` goes straight on to the copy-out, ``reduce_grads`` (``reduce.py``) copies the
input into its output (the average over one rank is itself; HSDP's all-reduce across
replicas still runs). Not a shortcut of ours: torch 2.14's ``FSDPParamGroup.unshard`` and
``wait_for_unshard`` (``world_size == 1``) and ``foreach_reduce`` (``if world_size > 1``) in
``torch/distributed/fsdp/_fully_shard`` do the same, and so call no custom comm (Note
[custom collectives]) either. The same holds for the all-gather over k = 1 ranks after
``reshard_after_forward=1`` (which torch turns into ``False`` with a warning). What it saves
is Python, not bytes: a collective over one rank moves nothing, but each call costs a c10d
dispatch and a work handle, two or three per group per step (the all-gathers of forward and,
resharded, backward; the reduce-scatter) -- on one GPU, the step's overhead.

Note [accumulating without communication]: ``set_requires_gradient_sync(False)`` (FSDP's
``no_sync``) skips the reduce-scatter: each parameter keeps its *unsharded* gradient, and the
next backward's autograd adds into it. The unsharded parameter is still freed after backward,
but the gradients are full-size: accumulating this way costs DDP's gradient memory. The
first backward with sync on reduce-scatters the sum.

Note [unused parameters in a group]: a group reduce-scatters the gradients its parameters *got*. If
ranks take different branches (mixture of experts, a multimodal model whose batch lacks one
modality on some ranks), they reduce-scatter different sets of parameters: inputs of
different sizes in one collective, which NCCL can hang on and gloo refuses. As torch's
``set_reduce_scatter_unused_params(True)`` (DDP's ``find_unused_parameters``), every
parameter that requires a gradient then goes in, a zero gradient where it got none, so each
rank sends the same bytes (and the unused ones' gradients become the others' average).

Note [no all-gather in backward]: some modules' backward never reads their parameters: an
embedding's weight gradient scatters the output gradient into the rows of the looked-up
indices, and if the input needs no gradient (token ids never do) nothing else is computed.
``set_unshard_in_backward(False)`` (torch's) skips the group's backward all-gather, and any
backward prefetch of it: the module keeps its shards registered through its backward, and
autograd accumulates the gradient into the unsharded parameter it saved in forward -- whose
storage is freed, which is fine only because nothing reads it (the user's promise, as in
torch: FSDP cannot check it). The reduce-scatter is as usual. One all-gather less per step
for a group resharded after forward; a group kept unsharded (the root by default) has none
to skip.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from minifsdp import comm
from minifsdp.fsdp2.custom_comm import DefaultAllGather, DefaultReduceScatter, allocate, release
from minifsdp.fsdp2.extensions import all_gather_copy_in_bytes, all_gather_copy_out_bytes
from minifsdp.fsdp2.fsdp_param import FSDPParam, OffloadPolicy, Owners
from minifsdp.fsdp2.hsdp import MeshInfo, mesh_info, post_forward_info
from minifsdp.fsdp2.mixed_precision import MixedPrecisionPolicy, check_backend, group_dtypes
from minifsdp.fsdp2.reduce import foreach_reduce
from minifsdp.memory import tag


class ShardedState(Enum):
    """Which parameters the modules hold, and what the group keeps for its next all-gather."""

    SHARDED = auto()  # the sharded DTensors; unsharded storage freed
    UNSHARDED = auto()  # the all-gathered plain tensors, ready to compute
    # the sharded DTensors, plus a 1/k piece of the unsharded parameters for backward's
    # all-gather over k ranks (reshard_after_forward=k: Note [reshard to k ranks] in hsdp.py)
    SHARDED_POST_FORWARD = auto()


class TrainingState(Enum):
    """Where in the step a group (or an ``FSDPState``) is."""

    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()  # unsharded for backward, grads not yet reduced
    POST_BACKWARD = auto()  # grads reduce-scattered (or kept, without sync)


class FSDPParamGroup:
    """All parameters of one ``fully_shard`` call: one all-gather, one reduce-scatter.

    Args:
        params: ``[(parameter, owners), ...]`` in the order of their buffer slots.
        mesh: the data-parallel ``DeviceMesh``: 1-D, or 2-D (replicate, shard) for HSDP.
        reshard_after_forward: free the unsharded parameters after forward (and all-gather
            again in backward); ``None``: decided at lazy init, True except for the root; an
            int k: keep 1/k of them, all-gathered over k ranks (Note [reshard to k ranks]).
        name: for communication tags, e.g. ``"blocks.0"`` (set at lazy init).
        mp_policy: the dtypes (Note [mixed precision] in ``mixed_precision.py``); ``None``:
            none, as ``MixedPrecisionPolicy()``.
        offload_policy: ``CPUOffloadPolicy()`` keeps the shards and their gradients in CPU
            memory (Note [FSDP2 CPU offload] in ``fsdp_param.py``); ``None``: no offload.
        shard_dims: the dim each parameter is cut on (``fully_shard``'s ``shard_placement_fn``,
            checked by ``resolve_shard_dims``: Note [Shard(i) layout] in
            ``shard_placement.py``); ``None``: dim 0 for all.

    Example (inside a torchrun worker, N ranks)::

        group = FSDPParamGroup([(lin.weight, [(lin, "weight")])], mesh, True, "lin")
        group.unshard()     # lin.weight is now the full (out, in) tensor
        group.reshard()     # lin.weight is the DTensor shard again
    """

    def __init__(self, params: list[tuple[nn.Parameter, Owners]], mesh: DeviceMesh | MeshInfo,
                 reshard_after_forward: bool | int | None, name: str,
                 mp_policy: MixedPrecisionPolicy | None = None,
                 offload_policy: OffloadPolicy | None = None,
                 shard_dims: list[int] | None = None):
        self.mp_policy = mp_policy or MixedPrecisionPolicy()
        # check the dtypes before FSDPParam replaces any parameter: an error leaves the
        # module as it was
        named = [(f"{type(owners[0][0]).__name__}.{owners[0][1]}", p.dtype, p.requires_grad)
                 for p, owners in params]
        self.dtypes = group_dtypes(named, self.mp_policy, name)
        # refuses other meshes (Note [HSDP]); a MeshInfo: dp_mesh_dims' (Note [an SPMD mesh])
        self.mesh_info = info = mesh if isinstance(mesh, MeshInfo) else mesh_info(mesh)
        mesh = info.mesh
        self.name = name
        # Note [all-gather extensions] (fsdp_param.py): such a group all-gathers bytes
        self.extension_params = [f"{type(o[0][0]).__name__}.{o[0][1]} ({type(p).__name__})"
                                 for p, o in params if hasattr(p, "fsdp_pre_all_gather")]
        self.has_extensions = bool(self.extension_params)
        self.set_reshard_after_forward(reshard_after_forward)  # refuses a bad k
        check_backend(self.dtypes, info.shard_group, mesh.device_type, name)
        self.fsdp_params = [FSDPParam(p, owners, info, self.mp_policy, offload_policy, d)
                            for (p, owners), d in zip(params, shard_dims or [0] * len(params))]
        self.mesh, self.process_group = mesh, info.shard_group
        self.rank, self.world_size = info.shard_rank, info.shard_size
        self.replicate_group = info.replicate_group  # HSDP's all-reduce; None on a 1-D mesh
        self._post_forward_data: torch.Tensor | None = None  # SHARDED_POST_FORWARD's piece
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        self.reduce_grads = True  # set_requires_gradient_sync
        self.all_reduce_grads = True  # set_requires_all_reduce (HSDP)
        self.partial_reduce_output: torch.Tensor | None = None  # Note [HSDP accumulation]
        self.reshard_after_backward = True
        # torch's FSDPModule setters of the same names (Note [divide factor] in
        # mixed_precision.py; Note [unused parameters in a group] below)
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction_for_comms = False
        self.reduce_scatter_unused_params = False
        self.all_reduce_hook = None  # set_all_reduce_hook: called on the reduced slot
        self.unshard_in_backward = True  # Note [no all-gather in backward]
        # set_custom_all_gather / set_custom_reduce_scatter (Note [custom collectives])
        self.all_gather_comm, self.reduce_scatter_comm = DefaultAllGather(), DefaultReduceScatter()
        # set_separate_reduce_scatter_group (Note [a reduce-scatter group of its own])
        self.separate_reduce_scatter_group: dist.ProcessGroup | None = None
        # set_reduce_scatter_max_input_buffers: kept, always met (Note [reduce-scatter
        # inputs in flight] in comm_buffers.py)
        self.reduce_scatter_max_input_buffers = 1

    @property
    def reduce_scatter_group(self) -> dist.ProcessGroup:
        """The group the gradients are reduce-scattered over: the shard group, or the copy of
        it that ``set_separate_reduce_scatter_group`` made (the same ranks, in the same order).

        Note [a reduce-scatter group of its own]: NCCL runs one collective at a time per
        communicator, so an all-gather and a reduce-scatter issued on two CUDA streams through
        one process group still take turns on the wire. torch's
        ``set_separate_reduce_scatter_group`` gives the reduce-scatter a second group over the
        same ranks (``dist.new_group(ranks, use_local_synchronization=True)``, one per set of
        ranks, shared by every group sharding over them), so backward's prefetched
        all-gather and the previous group's reduce-scatter can be on the wire together. The
        values are the same: the same ranks sum in the same order. Ours issues the
        reduce-scatter blocking on the current stream (Note [GPUs]), so here it changes which
        gloo context carries the bytes, not what overlaps."""
        return self.separate_reduce_scatter_group or self.process_group

    def set_reshard_after_forward(self, reshard_after_forward: bool | int | None) -> None:
        """A bool, ``None`` (decided at lazy init) or an int k (Note [reshard to k ranks])."""
        if getattr(self, "sharded_state", None) is ShardedState.SHARDED_POST_FORWARD:
            self.reshard()  # its piece was cut for the old k
        self.reshard_after_forward, self.post_forward_ranks = post_forward_info(
            self.mesh_info, reshard_after_forward)
        if self.has_extensions and self.post_forward_ranks is not None:
            raise NotImplementedError(
                f"fully_shard({self.name}): reshard_after_forward={reshard_after_forward} "
                "keeps a piece of the unsharded parameters, but "
                f"{', '.join(self.extension_params)} rebuild theirs from their own all-gather "
                "outputs (Note [all-gather extensions]; torch refuses this too): pass True or "
                "False, or shard those parameters in a fully_shard call of their own")

    def lazy_init(self, is_root: bool) -> None:
        """At the root's first forward: the root keeps its parameters after forward (backward
        needs them first thing); refuse parameters still on the meta device."""
        if self.reshard_after_forward is None:
            self.reshard_after_forward = not is_root
        # the shards' dtype may have changed since fully_shard (torch re-resolves here too)
        for p in self.fsdp_params:
            p.init_dtype_attrs(self.mp_policy)
        named = [(repr(p), p.orig_dtype, p.sharded_param.requires_grad)
                 for p in self.fsdp_params]
        self.dtypes = group_dtypes(named, self.mp_policy, self.name)
        check_backend(self.dtypes, self.process_group, self.mesh.device_type, self.name)
        meta = [p for p in self.fsdp_params if p.is_meta]
        if meta:
            raise RuntimeError(
                f"fully_shard: {len(meta)} parameter(s) of {self.name!r} are still on the meta "
                "device. Materialize them first: model.to_empty(device=...), then initialize "
                "(load_full_state_dict, or reset_parameters() on each submodule).")
        off_cpu = [f"{p.name} on {p.sharded_param.device}" for p in self.fsdp_params
                   if p.offload_to_cpu and p.sharded_param.device.type != "cpu"]
        if off_cpu:  # Note [FSDP2 CPU offload]; torch's _validate_cpu_offload_params
            raise RuntimeError(
                f"fully_shard({self.name!r}, offload_policy=CPUOffloadPolicy()): the shards "
                f"must be in CPU memory, but {', '.join(off_cpu)}; materialize them on the CPU "
                '(module.to_empty(device="cpu"), or load a CPU state dict)')

    # ---- unshard: all-gather -----------------------------------------------------------------

    # The all-gather between ``unshard`` and ``wait_for_unshard``: ``(work handle, group
    # buffer)``, the handle ``None`` for a blocking call. A class-level default, so instances
    # get it without a line in ``__init__``.
    _in_flight: tuple[object, torch.Tensor, int] | None = None  # ..., ranks gathered over

    def unshard(self, async_op: bool = False) -> None:
        """All-gather the group: afterwards the modules hold the full, plain parameters. With
        ``async_op=True`` only *issue* it (copy-in, async collective); ``wait_for_unshard()``
        finishes it (torch's group-level ``unshard`` always leaves that to it). A no-op while
        unsharded or in flight, so a prefetch and the group's own hook can both call it (Note
        [issue and wait] in ``prefetch.py``)."""
        if self.sharded_state is ShardedState.UNSHARDED or self._in_flight is not None:
            return
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:  # over k ranks
            my_slot, gathered = self._post_forward_copy_in()
            group, world = self.post_forward_ranks.group, self.post_forward_ranks.size
        elif self.has_extensions:  # a byte buffer (extensions.py)
            my_slot, gathered, self._ext_layout = all_gather_copy_in_bytes(
                self.fsdp_params, self.dtypes.gather, self.rank, self.world_size, self.name,
                self.all_gather_comm)
            group, world = self.process_group, self.world_size
        else:
            # seam "fsdp2.all_gather_copy_in" (lab 07): the mixed-precision cast
            my_slot, gathered = self._all_gather_copy_in()
            group, world = self.process_group, self.world_size
        work = None  # Note [a shard group of one rank]: my slot already is all of gathered
        if world > 1:
            with comm.tagged(f"fsdp2 params {self.name}"):  # Note [custom collectives]
                work = self.all_gather_comm(output_tensor=gathered, input_tensor=my_slot,
                                            group=group, async_op=async_op)
        self._in_flight = (work, gathered, world)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Finish the all-gather that ``unshard`` issued: wait for it, copy out, register the
        unsharded parameters. A no-op when none is in flight. The group buffer is held until
        its copy-out is issued, then freed (Note [prefetch on GPUs] in ``prefetch.py``)."""
        if self._in_flight is None:
            return
        work, gathered, world = self._in_flight
        if work is not None:
            work.wait()  # gloo: blocks until done; NCCL: makes the current stream wait
        if self.has_extensions:  # never resharded to k ranks (set_reshard_after_forward)
            all_gather_copy_out_bytes(self.fsdp_params, gathered, world, self._ext_layout,
                                      self.name)
        else:
            self._all_gather_copy_out(gathered, world)  # seam "fsdp2.all_gather_copy_out" (lab 05)
        _free(gathered, self.all_gather_comm)
        self._post_forward_data = None
        for p in self.fsdp_params:
            p.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED
        self._in_flight = None

    def discard_unshard(self) -> None:
        """Wait for an all-gather in flight and throw its result away; the group stays as it
        is. Every rank issued the collective, so it must complete (Note [mistargeted
        prefetches] in ``prefetch.py``)."""
        if self._in_flight is not None:
            work, gathered, _ = self._in_flight
            if work is not None:
                work.wait()
            _free(gathered, self.all_gather_comm)
            self._in_flight = None

    @torch.no_grad()
    def _all_gather_copy_in(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate the group buffer ``(N * S,)``, S = the padded shards' total numel, and copy
        this rank's padded shards into its slot r. Returns ``(slot r, buffer)``: the slot is a
        view of the buffer, so the all-gather needs no separate input. The buffer has the
        policy's ``param_dtype``, so the ``copy_`` into the slot is the mixed-precision cast
        (Note [mixed precision]: fp32 shards in, half the bytes on the wire for bf16)."""
        inputs = [p.all_gather_input() for p in self.fsdp_params]
        slot_numel = sum(t.numel() for t in inputs)
        gathered = allocate(self.all_gather_comm, self.world_size * slot_numel,
                            self.dtypes.gather, inputs[0].device, f"{self.name}'s all-gather")
        tag(gathered, "comm", label="all-gather buffers")
        my_slot = gathered.narrow(0, self.rank * slot_numel, slot_numel)
        # one call for all the copies (and casts), as torch's all_gather_copy_in
        torch._foreach_copy_(my_slot.split([t.numel() for t in inputs]), inputs)
        return my_slot, gathered

    @torch.no_grad()
    def _all_gather_copy_out(self, gathered: torch.Tensor, world: int) -> None:
        """Copy each parameter's ``world`` padded pieces from the rank-major buffer into its
        own unsharded buffer (Notes [copy-in and copy-out], [freeing with resize_], [version
        counter]). ``gathered.view(world, S)`` row r is rank r's slot; column block i is
        parameter i. ``world`` is N, or k after ``reshard_after_forward=k``."""
        outs = []
        for p in self.fsdp_params:
            buf = p.alloc_unsharded()
            tag(buf, "params", label=self.name)  # Note [labels] in minifsdp/memory.py
            outs.append(buf.view(world, -1))
        sizes = [p.padded_shard_numel * self.world_size // world for p in self.fsdp_params]
        with torch.autograd._unsafe_preserve_version_counter(tuple(outs)):
            torch.split_with_sizes_copy(gathered.view(world, -1), sizes, dim=1, out=outs)

    @torch.no_grad()
    def _post_forward_copy_in(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``_all_gather_copy_in`` for the k-rank all-gather: this rank's kept piece is its
        slot (Note [reshard to k ranks] in ``hsdp.py``)."""
        slot = self._post_forward_data.numel()
        gathered = allocate(self.all_gather_comm, self.post_forward_ranks.size * slot,
                            self._post_forward_data.dtype, self._post_forward_data.device,
                            f"{self.name}'s all-gather")
        tag(gathered, "comm", label="all-gather buffers")
        my_slot = gathered.narrow(0, self.post_forward_ranks.rank * slot, slot)
        my_slot.copy_(self._post_forward_data)
        return my_slot, gathered

    @torch.no_grad()
    def _reshard_post_forward(self) -> None:
        """Keep this rank's 1/k of the unsharded parameters, then reshard."""
        k, i = self.post_forward_ranks.size, self.post_forward_ranks.rank
        self._post_forward_data = torch.cat([p.unsharded_piece(k, i) for p in self.fsdp_params])
        tag(self._post_forward_data, "params", label=f"{self.name} (1/{k} kept)")
        for p in self.fsdp_params:
            p.to_sharded()
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def reshard(self) -> None:
        """Register the sharded DTensors again and free the unsharded storage (an all-gather
        still in flight is waited for and dropped)."""
        self.discard_unshard()
        self._post_forward_data = None  # SHARDED_POST_FORWARD: the piece goes too
        if self.sharded_state is ShardedState.UNSHARDED:
            for p in self.fsdp_params:
                p.to_sharded()
        self.sharded_state = ShardedState.SHARDED

    # ---- the step's transitions (called by FSDPState's hooks) -------------------------------

    def pre_forward(self) -> None:
        self.training_state = TrainingState.FORWARD
        if self.sharded_state is ShardedState.SHARDED_POST_FORWARD:
            self.reshard()  # no backward came since: gather the (maybe updated) shards
        self.unshard()  # a no-op if a prefetch issued it already ...
        self.wait_for_unshard()  # ... which is then finished here

    def post_forward(self) -> None:
        if self.reshard_after_forward and self.post_forward_ranks is not None and \
                torch.is_grad_enabled():  # no backward, no piece to keep
            self._reshard_post_forward()
        elif self.reshard_after_forward:
            self.reshard()
        self.training_state = TrainingState.IDLE

    def pre_backward(self) -> None:
        if self.training_state is not TrainingState.PRE_BACKWARD:
            self.training_state = TrainingState.PRE_BACKWARD
            if self.unshard_in_backward:  # Note [no all-gather in backward]
                self.unshard()  # a no-op unless resharded after forward (or prefetched)
            self.wait_for_unshard()

    @torch.no_grad()
    def post_backward(self) -> None:
        """The group's backward is over: reshard, reduce-scatter the unsharded gradients into
        the sharded ``.grad`` (or keep them, Note [accumulating without communication])."""
        self.training_state = TrainingState.POST_BACKWARD
        for p in self.fsdp_params:  # Note [accumulating in the reduce dtype] (fsdp_param.py)
            p.accumulate_unsharded_grad_if_needed()
        with_grad = [p for p in self.fsdp_params if p.unsharded_accumulated_grad is not None or (
                     p.unsharded_param is not None and p.unsharded_param.grad is not None)]
        if not self.reduce_grads:
            if self.reshard_after_backward:
                self.reshard()
            for p in with_grad:
                p.to_accumulated_grad_if_needed()
            return
        grads = [p.take_unsharded_grad() for p in with_grad]  # now the only references
        if self.reduce_scatter_unused_params:  # Note [unused parameters in a group]
            had = dict(zip(with_grad, grads))
            with_grad = [p for p in self.fsdp_params if p in had or (
                p.unsharded_param is not None and p.unsharded_param.requires_grad)]
            grads = [had[p] if p in had else torch.zeros_like(p.unsharded_local)
                     for p in with_grad]
            had.clear()
        if self.reshard_after_backward:
            self.reshard()  # before the copy-in: params and the buffer need not coexist
        if with_grad:
            foreach_reduce(self, with_grad, grads)

    def finalize_backward(self) -> None:
        """End of backward (the root's callback): run ``post_backward`` if it did not run, and
        wait for the gradients' asynchronous copies to the host, which the optimizer reads
        next (Note [FSDP2 CPU offload] in ``fsdp_param.py``)."""
        if self.training_state is not TrainingState.POST_BACKWARD:
            self.post_backward()
        for p in self.fsdp_params:
            if p.grad_offload_event is not None:
                p.grad_offload_event.synchronize()
                p.grad_offload_event = None
        self.training_state = TrainingState.IDLE

    def reset_iter_state(self) -> None:
        """After an exception cut a forward or backward short: drop any all-gather in flight,
        HSDP's partial sum and the unsharded gradients, and reshard (torch's
        ``FSDPParamGroup._reset_iter_state``; ``FSDPModule.reset_iter_state`` calls it)."""
        self.discard_unshard()
        self.partial_reduce_output = None
        for p in self.fsdp_params:
            p.unsharded_accumulated_grad = None
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None
        self.reshard()
        self.training_state = TrainingState.IDLE

    def __repr__(self) -> str:
        return (f"FSDPParamGroup({self.name!r}, {len(self.fsdp_params)} params, "
                f"{self.sharded_state.name}, {self.training_state.name})")


def _free(gathered: torch.Tensor, all_gather_comm) -> None:
    """Free an all-gather buffer after its copy-out, here and now (``resize_(0)``, not by
    dropping our reference: gloo's worker thread still holds the tensor for a moment after
    ``wait()``, which would make the free, and every measured peak, depend on thread timing).
    Nothing views the buffer (Note [copy-in and copy-out]); on CUDA the allocator still orders
    its reuse after the copy-out (Note [prefetch on GPUs] in ``prefetch.py``). A custom comm's
    buffer is left to it (Note [custom collectives])."""
    release(gathered, all_gather_comm)
