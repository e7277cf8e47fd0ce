"""``fully_shard``: FSDP2's whole user interface, applied in place and bottom-up.

    mesh = init_device_mesh("cpu", (world_size,))     # or "cuda"
    for block in model.blocks:
        fully_shard(block, mesh=mesh)                 # children first ...
    fully_shard(model, mesh=mesh)                     # ... then the root takes the rest
    opt = torch.optim.AdamW(model.parameters())       # the sharded DTensors
    loss_fn(model(x), y).backward(); opt.step()       # hooks all-gather and reduce-scatter

HSDP: the same calls with a 2-D mesh, ``init_device_mesh("cuda", (R, S), mesh_dim_names=(
"replicate", "shard"))``: sharded over S, replicated over R (Note [HSDP] in ``hsdp.py``).

Note [bottom-up]: each call makes one parameter group of the parameters in its subtree that
no earlier call has taken: a child's ``fully_shard`` claims the block's parameters, so the
root's call gets only what is left (embeddings, final norm, head). Calling the root first
would leave nothing for the children. Each group is one all-gather before its module's
forward and one reduce-scatter after its backward, so the units are the granularity of
memory (one block's parameters unsharded at a time) and of communication.

Note [the class swap]: ``fully_shard`` returns the module it was given -- there is no
wrapper, so names, ``state_dict`` keys and attribute access are unchanged (FSDP1's
``_fsdp_wrapped_module.`` prefixes disappear). To give the module FSDP methods anyway
(``unshard``, ``set_requires_gradient_sync``, ...), it swaps ``module.__class__`` for a new
class ``FSDP<Class>(FSDPModule, Class)``, so ``isinstance(m, FSDPModule)`` tells a sharded
module, and ``isinstance(m, Class)`` still holds.

Note [state dicts]: ``model.state_dict()`` returns the registered parameters, which between
steps are the sharded DTensors: a *sharded* state dict, made without communication (each
rank saves its rows; DTensor records how to put them together). ``full_state_dict(model)``
all-gathers each one (``DTensor.full_tensor()``) into plain tensors on every rank.
``load_full_state_dict`` goes back without communication: every rank has the full tensors
and keeps its own rows (``chunk_dim0``; its slices on dim i for a parameter that
``shard_placement_fn`` put on ``Shard(i)``). On an HSDP mesh the DTensors are ``(Replicate(),
Shard(0))``: rows are chosen and gathered over the shard dim only. ``model.load_state_dict``
of a sharded state dict copies DTensor into DTensor, local rows into local rows.
(``assign=True`` would replace our parameter objects, which the optimizer and the group
hold: refused after the load.)

Note [meta-device init]: a model too big for one device can be built on the meta device
(shapes, no memory), sharded, and only then materialized, a shard per rank::

    with torch.device("meta"):
        model = GPT(cfg)
    ... fully_shard bottom-up ...
    model.to_empty(device=device)                     # allocate the local shards, uninitialized
    load_full_state_dict(model, full)                 # a: from a checkpoint / seeded full model
    model.init_weights()  # or m.reset_parameters()   # b: initialize in place, per submodule

(a) reproduces a non-meta run exactly (tests/workers/fsdp2_worker.py trains both and compares
bit for bit). (b) runs the init functions on the DTensors: deterministic values (zeros, ones)
come out exactly, but a random init draws each rank's *local* rows from its own generator, so
the values differ from a one-process init with the same seed (DTensor's offset-based RNG that
would make them agree needs a CUDA-like device).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from minifsdp.fsdp2.comm_buffers import (
    ProcessGroupAllocAllGather,
    ProcessGroupAllocReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
    check_max_input_buffers,
    check_symm_mem,
    refuse_symm_mem_with_buffers,
)
from minifsdp.fsdp2.custom_comm import (
    AllGather,
    DefaultAllGather,
    DefaultReduceScatter,
    ReduceScatter,
    check_comm,
)
from minifsdp.fsdp2.fsdp_param import CPUOffloadPolicy, OffloadPolicy, Owners
from minifsdp.fsdp2.fsdp_param_group import FSDPParamGroup
from minifsdp.fsdp2.fsdp_state import FSDPState, listed_modules
from minifsdp.fsdp2.hsdp import MeshInfo, mesh_info, post_forward_info
from minifsdp.fsdp2.mixed_precision import MixedPrecisionPolicy, register_forward_casts
from minifsdp.fsdp2.prefetch import UnshardHandle
from minifsdp.fsdp2.shard_placement import chunk_on_dim, resolve_shard_dims
from minifsdp.fsdp2.spmd_mesh import (
    DataParallelMeshDims,
    SpmdParamLayout,
    refuse_dtensor_without_dims,
    spmd_mesh_info,
)


class FSDPModule:
    """Mixed into every ``fully_shard``-ed module's class (Note [the class swap]).

    Example:
        >>> isinstance(fully_shard(block, mesh=mesh), FSDPModule)   # doctest: +SKIP
        True
    """

    def __new__(cls, *args, **kwargs):
        # Containers build new instances of their own class (``nn.Sequential[1:]`` calls
        # ``self.__class__(...)``): build the original class, which is not sharded.
        orig_cls = cls.__mro__[2]  # FSDP<Class>, FSDPModule, Class
        self = orig_cls.__new__(orig_cls)
        self.__init__(*args, **kwargs)
        return self

    @property
    def fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's group now (not its children's), as torch's.

        ``async_op=True`` only issues the all-gather and returns an ``UnshardHandle``: its
        ``wait()`` finishes it, and so does the module's next pre-forward. That is how a
        training loop prefetches the first block, which no earlier module does::

            model.blocks[0].unshard(async_op=True)   # overlaps the root's embedding
            loss = loss_fn(model(x), y)
        """
        groups = [self.fsdp_state.group] if self.fsdp_state.group is not None else []
        for group in groups:
            group.unshard(async_op=True)
        handle = UnshardHandle(groups)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this module's unsharded parameters now, registering the shards again."""
        if self.fsdp_state.group is not None:
            self.fsdp_state.group.reshard()

    def reset_iter_state(self) -> None:
        """Recover from an exception that cut a forward or backward short: call it on the
        root, then run the next iteration as usual (torch's). Every group is resharded with
        nothing in flight and the lost iteration's gradients are dropped; under gradient
        accumulation, restart the step's micro-batches. Without it, the next forward starts
        from the cut one's half-finished state::

            try:
                loss = loss_fn(model(x), y)
            except RuntimeError:
                model.reset_iter_state()
                opt.zero_grad()
        """
        self.fsdp_state.reset_iter_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward is not the step's last (torch's, for micro-batches):
        its end keeps the backward-prefetch state, including all-gathers still in flight, for
        the next one (Note [not the last backward] in ``fsdp_state.py``). Set it on the root;
        it holds for every module under it until changed. The step's last backward must run
        with ``True`` (the default). minifsdp refuses a non-bool (torch takes its truth)::

            for m, (x, y) in enumerate(micro_batches):
                model.set_is_last_backward(m == len(micro_batches) - 1)
                (loss_fn(model(x), y) / len(micro_batches)).backward()
            opt.step()
        """
        _check_bool("set_is_last_backward", "is_last_backward", is_last_backward)
        self.fsdp_state.ctx.is_last_backward = is_last_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: this module's group is not all-gathered in backward (nor prefetched
        there), for a module whose backward does not read its parameters, e.g. an embedding
        whose input needs no gradient (Note [no all-gather in backward] in
        ``fsdp_param_group.py``). This module's group only, as torch's. minifsdp refuses a
        non-bool (torch takes its truth)::

            fully_shard(model.tok_emb, mesh=mesh)       # resharded after forward
            model.tok_emb.set_unshard_in_backward(False)
        """
        _check_bool("set_unshard_in_backward", "unshard_in_backward", unshard_in_backward)
        for group in self._groups(recurse=False):
            group.unshard_in_backward = unshard_in_backward

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """``False``: backward keeps full unsharded gradients and skips the reduce-scatter,
        for gradient accumulation without communication (Note [accumulating without
        communication] in ``fsdp_param_group.py``). Set ``True`` before the last backward."""
        for group in self._groups(recurse):
            group.reduce_grads = group.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only (a no-op on a 1-D mesh): ``False`` still reduce-scatters every backward
        within the shard group but skips the all-reduce across replicas, keeping the sum until
        a backward with ``True`` (Note [HSDP accumulation] in ``hsdp.py``).

        Example (two micro-batches, one all-reduce)::

            for m, (x, y) in enumerate(micro_batches):
                model.set_requires_all_reduce(m == len(micro_batches) - 1)
                loss_fn(model(x), y).backward()
            opt.step()
        """
        for group in self._groups(recurse):
            group.all_reduce_grads = requires_all_reduce

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """``False`` keeps the parameters unsharded after backward, so the next micro-batch's
        forward needs no all-gather (at the unsharded parameters' memory). Only between the
        backwards of one step: the optimizer updates the *shards*, so set it back to ``True``
        before the step's last backward."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool,
                                  recurse: bool = True) -> None:
        """Change ``fully_shard``'s ``reshard_after_forward`` at run time (the root's too), e.g.
        ``False`` for evaluation and back to ``True`` for training. A bool only, as torch 2.14's
        ``FSDPModule.set_reshard_after_forward``: the int form k (Note [reshard to k ranks])
        builds process groups, so it is ``fully_shard``'s argument alone."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError("set_reshard_after_forward: reshard_after_forward should be a bool, "
                             f"got {type(reshard_after_forward).__name__} "
                             f"{reshard_after_forward!r}; pass an int k to fully_shard instead")
        for group in self._groups(recurse):
            group.set_reshard_after_forward(reshard_after_forward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by ``factor`` instead of the number of ranks
        (e.g. the global token count when the loss is a sum). This module's group only, as
        torch's. ``factor`` divides the sum over *every* rank: on an HSDP mesh (R, S) the mean
        is ``factor = R * S``, not the shard size S (which gives R times the gradient). On gloo
        a ``factor`` other than the shard size needs ``set_force_sum_reduction_for_comms(True)``
        (Note [divide factor] in ``mixed_precision.py``; chapter 11, section 8)::

            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_gradient_divide_factor(float(tokens_in_global_batch))
        """
        for group in self._groups(recurse=False):
            group.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: ``set_gradient_divide_factor``."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning,
                      stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Call ``hook(out)`` on this group's reduced gradient slot (1-D, in the reduce dtype)
        every reducing backward: after the reduce-scatter, or after HSDP's all-reduce, and
        before the post-division (torch's place for it). E.g. an all-reduce over a data
        parallel dimension FSDP does not know of::

            model.set_all_reduce_hook(lambda g: dist.all_reduce(g, group=dp_group))

        This module's group only. ``stream`` (torch: a CUDA stream to run it on) is refused:
        minifsdp runs everything on the current stream (Note [GPUs] in fsdp_param_group.py).
        """
        if stream is not None:
            raise NotImplementedError("set_all_reduce_hook(stream=...): minifsdp runs the hook "
                                      "on the current stream (Note [GPUs])")
        for group in self._groups(recurse=False):
            group.all_reduce_hook = hook

    def set_post_optim_event(self, event) -> None:
        """Give the root an event recorded after the optimizer step, for this iteration's
        first forward to wait on instead of the current stream (torch's; the root's forward
        waits on it once, then drops it: pass a new event each iteration)::

            optim.step()
            event = torch.cuda.Event(); event.record()   # torch.cpu.Event() on CPU
            model.set_post_optim_event(event)
            loss = model(x).sum()

        Note [post-optimizer event]: torch all-gathers on streams of its own, which at the
        root's pre-forward wait for the current stream -- everything queued so far, the
        optimizer step included -- so no parameter is gathered before the step wrote it. With
        an event, they wait for the step only, not for unrelated work queued after it. Our
        all-gathers run on the current stream (Note [prefetch on GPUs] in ``prefetch.py``),
        ordered after everything queued before them whatever we do: an event cannot remove
        that dependency here. We wait on it anyway (a stream only gains a dependency by it, so
        the values are the same) and drop it, as torch does, so code written for torch runs
        unchanged. Call it on the root, as torch's."""
        if not callable(getattr(event, "record", None)):
            raise TypeError(f"set_post_optim_event: expected an event (torch.Event, "
                            f"torch.cuda.Event, torch.cpu.Event), got {type(event).__name__}")
        self.fsdp_state.ctx.post_optim_event = event  # the root's context, shared at lazy init

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Replace this group's all-gather (torch's): ``comm.allocate(size, *, dtype, device)``
        makes the group buffer and ``comm(output_tensor=, input_tensor=, group=, async_op=)``
        fills it (Note [custom collectives] in ``custom_comm.py``: the protocol, who frees the
        buffer, what ``minifsdp.comm`` logs). This module's group only, as torch's. minifsdp
        refuses, naming this module and the method, an object without ``allocate`` or a
        ``__call__`` taking those keywords (torch checks nothing). E.g. a comm that
        all-gathers into a buffer it keeps::

            class KeptBuffer(AllGather):
                def allocate(self, size, *, dtype, device):
                    self.buf = torch.empty(*size, dtype=dtype, device=device)
                    return self.buf
                def __call__(self, output_tensor, input_tensor, group, async_op=False):
                    return dist.all_gather_into_tensor(output_tensor, input_tensor, group,
                                                       async_op=async_op)

            model.blocks[0].set_custom_all_gather(KeptBuffer())
        """
        check_comm(comm, "set_custom_all_gather", self._label())
        for group in self._groups(recurse=False):
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Replace this group's reduce-scatter (torch's): ``comm.allocate(size, *, dtype,
        device)`` makes its input (the copy-in's target) and then its output (which the
        sharded ``.grad``s view), and ``comm(output_tensor=, input_tensor=, group=, op=)``
        reduces (Note [custom collectives]). HSDP's all-reduce across replicas stays FSDP's.
        This module's group only; refuses a non-comm as ``set_custom_all_gather`` does. E.g.
        a reduce-scatter as an all-reduce of the input, keeping this rank's slot::

            class AllReduceSlice(ReduceScatter):
                def allocate(self, size, *, dtype, device):
                    return torch.empty(*size, dtype=dtype, device=device)
                def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                    dist.all_reduce(input_tensor, op=op, group=group)
                    output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])

            model.set_custom_reduce_scatter(AllReduceSlice())
        """
        check_comm(comm, "set_custom_reduce_scatter", self._label())
        for group in self._groups(recurse=False):
            group.reduce_scatter_comm = comm

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM only, dividing before / after the collective instead of inside it
        (AVG, PREMUL_SUM); this module's group only, as torch's (Note [divide factor])."""
        for group in self._groups(recurse=False):
            group.force_sum_reduction_for_comms = enable

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """``True``: reduce-scatter gradients over a process group of their own, a copy of the
        shard group (the same ranks), made here once per set of ranks and shared by every
        group that shards over them; ``False``: back to the shard group. Collective over each
        shard group's ranks, as torch's: call it on every rank alike. Same values either way
        (Note [a reduce-scatter group of its own] in ``fsdp_param_group.py``: on NCCL it lets
        a reduce-scatter and an all-gather be on the wire together)::

            model.set_separate_reduce_scatter_group()   # every FSDP module below model too
        """
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            if not enable:
                group.separate_reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(group.process_group))
            if ranks not in made:  # an existing copy is reused: calling twice is harmless
                made[ranks] = group.separate_reduce_scatter_group or dist.new_group(
                    list(ranks), use_local_synchronization=True,
                    group_desc="fsdp_reduce_scatter")
            group.separate_reduce_scatter_group = made[ranks]

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """``True``: this group's all-gather buffer and reduce-scatter buffers come from the
        process group's own allocator where its backend has one (NCCL's ``ncclMemAlloc``:
        registered memory, zero-copy collectives); gloo has none, so on CPU the buffers, bytes
        and values are the defaults' (Note [comm buffers from the process group] in
        ``comm_buffers.py``). ``False``: the defaults again. This module's group only, as
        torch's; refused after a custom comm, as torch's, and given a non-bool (torch takes
        its truth)::

            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_allocate_memory_from_process_group_for_comm(True)
        """
        _check_bool("set_allocate_memory_from_process_group_for_comm", "enable", enable)
        for group in self._groups(recurse=False):
            pair = {"all-gather": (group.all_gather_comm, (DefaultAllGather,
                                                           ProcessGroupAllocAllGather)),
                    "reduce-scatter": (group.reduce_scatter_comm, (
                        DefaultReduceScatter, ProcessGroupAllocReduceScatter))}
            _refuse_custom(pair, "set_allocate_memory_from_process_group_for_comm",
                           self._label())
            group.all_gather_comm = (ProcessGroupAllocAllGather(group.process_group) if enable
                                     else DefaultAllGather())
            group.reduce_scatter_comm = (
                ProcessGroupAllocReduceScatter(group.reduce_scatter_group) if enable
                else DefaultReduceScatter())

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """All-gather (and, if this group reduces with SUM only, reduce-scatter) in symmetric
        memory: buffers every rank has mapped, so NCCL copies GPU to GPU directly (its copy
        engines under ``NCCL_CTA_POLICY=2``). CUDA and NCCL only: refused on any other
        device or process group, naming this module (torch 2.14 accepts it there and fails at
        the first forward). Collective over the group (a barrier). This module's group only;
        refused after a custom comm and with ``set_reduce_scatter_max_input_buffers(>1)``, as
        torch's (Note [symmetric memory] in ``comm_buffers.py``)::

            model.set_force_sum_reduction_for_comms(True)   # else the reduce-scatter stays
            model.set_symm_mem_for_comm()
        """
        for group in self._groups(recurse=False):
            check_symm_mem(torch.device(group.mesh.device_type), group.process_group,
                           backend, self._label())
            pair = {"all-gather": (group.all_gather_comm, (DefaultAllGather, SymmMemAllGather)),
                    "reduce-scatter": (group.reduce_scatter_comm, (DefaultReduceScatter,
                                                                   SymmMemReduceScatter))}
            _refuse_custom(pair, "set_symm_mem_for_comm", self._label())
            # NCCL's symmetric reduce-scatter only sums: the other op keeps the default's
            sums = group.force_sum_reduction_for_comms
            refuse_symm_mem_with_buffers(group.name, group.reduce_scatter_max_input_buffers,
                                         symmetric=sums)
            group.all_gather_comm = SymmMemAllGather(group.process_group, backend)
            if sums:
                group.reduce_scatter_comm = SymmMemReduceScatter(group.reduce_scatter_group,
                                                                 backend)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """At most this many gradient reduce-scatter inputs in flight at once (torch's cap
        on the copy-in buffers it keeps alive while its reduce-scatter stream reads them;
        default 1; an int ``>= 1``, torch's errors otherwise). Ours never has one in flight:
        its reduce-scatter is over when the call returns and the input is freed there, so
        every cap holds and no byte changes (Note [reduce-scatter inputs in flight] in
        ``comm_buffers.py``)::

            model.set_reduce_scatter_max_input_buffers(2)   # torch: 2 inputs' memory, no stall
        """
        max_input_buffers = check_max_input_buffers(max_input_buffers)
        for group in self._groups(recurse):
            refuse_symm_mem_with_buffers(group.name, max_input_buffers, symmetric=isinstance(
                group.reduce_scatter_comm, SymmMemReduceScatter))
            group.reduce_scatter_max_input_buffers = max_input_buffers

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """``True``: reduce-scatter a zero gradient for every parameter that requires one and
        got none in this backward, so ranks that took different branches send the same bytes
        (Note [unused parameters in a group] in ``fsdp_param_group.py``)."""
        for group in self._groups(recurse):
            group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """After this module's all-gather in forward, issue those of ``modules``, in order
        (torch's API). Replaces the implicit forward guess for this module; ``[]`` goes back
        to it. One module ahead overlaps the next all-gather with this module's forward; two
        or more go further ahead at one more group's unsharded memory each (Note [prefetch
        memory]). Set the same lists on every rank (Note [same order on every rank])::

            for prev, nxt in zip(model.blocks, model.blocks[1:]):
                prev.set_modules_to_forward_prefetch([nxt])
        """
        self.fsdp_state.forward_prefetch = _states_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """After this module's all-gather in backward, issue those of ``modules`` (torch's
        API); replaces the implicit backward guess (the previous module in post-forward
        order) for this module::

            for prev, nxt in zip(model.blocks, model.blocks[1:]):
                nxt.set_modules_to_backward_prefetch([prev])
            model.set_modules_to_backward_prefetch([model.blocks[-1]])
        """
        self.fsdp_state.backward_prefetch = _states_of(modules,
                                                       "set_modules_to_backward_prefetch")

    def set_implicit_prefetch(self, *, forward: bool | None = None,
                              backward: bool | None = None, recurse: bool = True) -> None:
        """Turn the implicit prefetches on or off (``None``: leave as is). minifsdp only, not a
        torch API: torch always prefetches implicitly in backward and has no forward switch,
        because on GPUs its separate all-gather streams overlap the forward anyway (Notes
        [which group is next], [prefetch on GPUs] in ``minifsdp/fsdp2/prefetch.py``). We
        need the forward switch for overlap on CPU (and on GPUs, where we have no such
        streams), and the backward one to measure what prefetching buys. Defaults:
        ``forward=False, backward=True`` (torch's behaviour)."""
        modules = self.modules() if recurse else [self]
        for state in (m.fsdp_state for m in modules if isinstance(m, FSDPModule)):
            if forward is not None:
                state.implicit_forward_prefetch = forward
            if backward is not None:
                state.implicit_backward_prefetch = backward

    def _label(self) -> str:
        """This module in errors: its group's name (the module's path after lazy init)."""
        group = self.fsdp_state.group
        return group.name if group is not None else type(self).__mro__[2].__name__

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        modules = self.modules() if recurse else [self]
        # dict: a state of several modules once (Note [several modules, one group])
        states = dict.fromkeys(m.fsdp_state for m in modules if isinstance(m, FSDPModule))
        return [s.group for s in states if s.group is not None]


def _refuse_custom(comms: dict, method: str, name: str) -> None:
    """torch's rule: a setter that replaces a group's comms refuses one set by
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (it chose its buffers)."""
    for kind, (comm, replaceable) in comms.items():
        if not isinstance(comm, replaceable):
            raise RuntimeError(f"{name}.{method}: this group's {kind} is a custom comm, "
                               f"{type(comm).__name__}, which allocates its own buffers "
                               "(torch refuses this too)")


def _check_bool(method: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{method}: {name} should be a bool, got {type(value).__name__} "
                        f"{value!r}")


def _states_of(modules: list[FSDPModule], method: str) -> list[FSDPState]:
    """The states of a prefetch list, with clear errors for what cannot be in one."""
    if isinstance(modules, nn.Module) and (isinstance(modules, FSDPModule) or not isinstance(
            modules, (nn.ModuleList, nn.Sequential))):
        raise TypeError(f"{method} takes a list of modules, got one {type(modules).__name__}; "
                        "wrap it in a list: [module]")
    modules = list(modules)
    for i, m in enumerate(modules):
        if not isinstance(m, FSDPModule):
            raise ValueError(f"{method}: modules[{i}] is a {type(m).__name__}, not an FSDPModule; "
                             "only modules that fully_shard was applied to have an all-gather "
                             "to prefetch")
    return [m.fsdp_state for m in modules]


_FSDP_CLASSES: dict[type, type] = {}  # Class -> FSDP<Class>, made once per class
_NO_MIXED_PRECISION = MixedPrecisionPolicy()  # frozen, so one instance can be the default
_NO_OFFLOAD = OffloadPolicy()  # no fields: nothing to mutate (torch's default is one too)


def fully_shard(module: nn.Module | list[nn.Module], *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
                mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
                offload_policy: OffloadPolicy = _NO_OFFLOAD,
                ignored_params: set[nn.Parameter] | None = None,
                dp_mesh_dims: DataParallelMeshDims | None = None,
                ) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters (those no nested ``fully_shard`` took) on dim 0 (or the
    dim ``shard_placement_fn`` picks) over ``mesh`` as one group, install the hooks, and
    return the same module (Note [bottom-up]).

    ``module`` may be a list ``[m1, m2, ...]`` (torch's list form): ONE group of the
    parameters under all of them, all-gathered before the first of them runs forward and
    resharded after the last; one all-gather and one reduce-scatter a step for the lot. Each
    is class-swapped and they share one state; the same list is returned. A listed module
    inside another listed one is covered by it (as torch). Such a group cannot be the root:
    shard their parent too (Note [several modules, one group] in ``fsdp_state.py``).

    Args:
        mesh: a 1-D ``DeviceMesh`` (shard over its ranks), or a 2-D one with
            ``mesh_dim_names=("replicate", "shard")`` (HSDP: shard over dim 1, replicate over
            dim 0; Note [HSDP] in ``hsdp.py``); default: all ranks, 1-D, on the default
            group's device type.
        reshard_after_forward: free the unsharded parameters after forward and all-gather them
            again in backward (memory for communication). ``None`` (torch 2.14's default):
            True, except for the root, whose parameters backward needs first. An int k
            (a divisor of the shard size): keep 1/k of them, all-gathered over k ranks in
            backward (Note [reshard to k ranks] in ``hsdp.py``).
        shard_placement_fn: ``(nn.Parameter) -> Shard | None``, as torch 2.14's (ours calls
            it once per parameter, torch's twice): ``Shard(i)`` cuts it on dim i, not 0 (negative
            i from the end; its DTensor's placement is ``Shard(i)``, HSDP's ``(Replicate(),
            Shard(i))``), ``None`` keeps ``Shard(0)``. E.g. a stacked experts weight ``(E, d,
            h)`` with fewer experts than ranks, cut on ``h`` so every rank holds a slice of
            each expert. As torch: i > 0 only if the shard size divides dim i (no padding); a
            result other than ``Shard``/``None`` and a dim out of range are refused, naming the
            parameter's path. An int ``reshard_after_forward`` k (1 < k < S) with i > 0 is
            refused too (torch accepts it, then fails in backward). Note [Shard(i) layout] in
            ``shard_placement.py``.
        mp_policy: the all-gather / compute, reduce-scatter and output dtypes, and whether to
            cast the forward inputs (Note [mixed precision] in ``mixed_precision.py``).
            Default: no mixed precision. Dtypes the backend cannot communicate (float8 on
            gloo) and parameters of several dtypes in one group are refused here.
        offload_policy: ``OffloadPolicy()`` (default): none. ``CPUOffloadPolicy(pin_memory=
            True)``: the sharded parameters, their gradients and so the optimizer's state and
            step live in CPU memory; every all-gather copies the shards to the mesh's device
            first and every reduce-scatter's result is copied back (Note [FSDP2 CPU offload]
            in ``fsdp_param.py``: the bytes per step). ``pin_memory=True`` needs CUDA (torch's
            fails too): refused on a machine without it; pass ``pin_memory=False``.
        ignored_params: parameters this call leaves alone, as torch's: not sharded, not
            gathered, their gradients not reduced (each rank keeps its own; a parent's call
            takes them unless it is given them too). E.g. a per-rank bias, or parameters
            another parallelism manages.
        dp_mesh_dims: ``DataParallelMeshDims(shard=..., replicate=...)`` (ours or torch's),
            naming the data-parallel dims of ``mesh``, which is then the full mesh the
            parameters already live on as DTensors (tensor parallelism on the other dims):
            each must be ``Replicate()`` on the named dims, and its local tensor is sharded
            over the ``shard`` dims (several: flattened into one group), replicated over the
            ``replicate`` dims (HSDP; without ``shard``, DDP). Note [an SPMD mesh] in
            ``spmd_mesh.py``. Not with an int ``reshard_after_forward`` (torch refuses it
            too), CPU offload or all-gather extensions.

    Parameters must already be on the mesh's device, or on ``meta`` (Note [meta-device
    init]; under CPU offload, materialize them with ``to_empty(device="cpu")``). Frozen
    parameters (``requires_grad=False``) are gathered with the rest but get no gradient and no
    reduce-scatter.

    Example (a world of one)::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> _ = fully_shard(model[0]), fully_shard(model)
        >>> type(model).__name__, type(model[1].weight).__name__, model[1].weight.shape
        ('FSDPSequential', 'DTensor', torch.Size([2, 4]))

    The list form: the (4, 8) weights and (4,) biases of ``emb`` and ``head``, one group of
    72 elements (``mid``, between them in forward, may have its own)::

        >>> net = nn.ModuleDict({"emb": nn.Linear(8, 4), "mid": nn.Linear(4, 8),
        ...                      "head": nn.Linear(8, 4)})
        >>> pair = fully_shard([net["emb"], net["head"]])
        >>> pair[0].fsdp_state is pair[1].fsdp_state, len(pair[0].fsdp_state.group.fsdp_params)
        (True, 4)

    Example (``shard_placement_fn``, inside a torchrun worker, N ranks dividing 64)::

        experts = Experts(n_experts=2, d=32, h=64)        # w_in (2, 32, 64), w_out (2, 64, 32)
        fully_shard(experts, mesh=mesh,
                    shard_placement_fn=lambda p: Shard(2) if p.ndim == 3 else None)
        experts.w_in.placements, experts.w_in.to_local().shape    # (Shard(dim=2),), (2, 32, 64 / N)
    """
    roots = listed_modules(module)  # Note [several modules, one group]
    if mesh is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    # refuses a mesh that is neither FSDP's 1-D nor HSDP's 2-D, or dims it lacks, before changes
    info = mesh_info(mesh) if dp_mesh_dims is None else spmd_mesh_info(mesh, dp_mesh_dims)
    _check_offload_policy(offload_policy)
    params = _managed_params(roots, ignored_params or set())
    for p, owners in params:
        if p.device.type not in (mesh.device_type, "meta"):
            module_, name = owners[0]
            raise ValueError(f"{type(module_).__name__}.{name} is on {p.device}, the mesh on "
                             f"{mesh.device_type}: move the module to the device first")
        if dp_mesh_dims is None:  # before any parameter is replaced
            refuse_dtensor_without_dims(f"{type(owners[0][0]).__name__}.{owners[0][1]}", p)
    shard_dims = _shard_dims(roots, params, shard_placement_fn, info, reshard_after_forward)
    if dp_mesh_dims is not None:
        _check_spmd_params(roots, params, info, shard_dims, reshard_after_forward,
                           offload_policy)
    name = ", ".join(type(m).__name__ for m in roots)  # until lazy init names it
    group = FSDPParamGroup(params, info, reshard_after_forward, name, mp_policy,
                           offload_policy, shard_dims) if params else None
    state = FSDPState(roots, group)
    for m in roots:
        m.__dict__["_fsdp_state"] = state
        register_forward_casts(m, mp_policy)  # after FSDPState's hooks (see its docstring)
        cls = m.__class__
        if cls not in _FSDP_CLASSES:
            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        m.__class__ = _FSDP_CLASSES[cls]
    return module


def _check_offload_policy(policy: object) -> None:
    """Refuse what is not an ``OffloadPolicy`` (torch ignores it silently) and pinned memory
    on a machine without an accelerator (torch fails in ``pin_memory()``: "Found no NVIDIA
    driver"), before ``fully_shard`` changes anything (Note [FSDP2 CPU offload])."""
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy should be an OffloadPolicy (e.g. "
                        f"CPUOffloadPolicy()), got {type(policy).__name__} {policy!r}")
    if (isinstance(policy, CPUOffloadPolicy) and policy.pin_memory
            and not torch.accelerator.is_available()):
        raise RuntimeError("fully_shard: CPUOffloadPolicy(pin_memory=True) pins the shards in "
                           "page-locked memory, which needs CUDA, and this machine has no "
                           "accelerator; pass CPUOffloadPolicy(pin_memory=False)")


def _param_paths(roots: tuple[nn.Module, ...], params: list[tuple[nn.Parameter, Owners]]
                 ) -> list[str]:
    """Each parameter's path under the ``roots`` (e.g. ``blocks.0.attn.qkv.weight``)."""
    paths: dict[nn.Parameter, str] = {}
    for root in roots:
        for name, p in root.named_parameters(remove_duplicate=False):
            paths.setdefault(p, name)
    return [paths.get(p, f"{type(o[0][0]).__name__}.{o[0][1]}") for p, o in params]


def _check_spmd_params(roots, params, info: MeshInfo, shard_dims: list[int],
                       reshard_after_forward, offload_policy) -> None:
    """Under ``dp_mesh_dims``, refuse before any parameter is replaced what torch refuses
    (an int ``reshard_after_forward``; a parameter that is not a DTensor on this mesh,
    ``Replicate()`` on the DP dims) and what ours does not build (offload, extensions)."""
    if not isinstance(reshard_after_forward, bool) and isinstance(reshard_after_forward, int):
        raise NotImplementedError("reshard_after_forward as int is not yet supported with "
                                  "SPMD mesh (dp_mesh_dims)")
    if isinstance(offload_policy, CPUOffloadPolicy):
        raise NotImplementedError("fully_shard: CPUOffloadPolicy with dp_mesh_dims is not "
                                  "built in minifsdp (torch has it)")
    for path, (p, _), d in zip(_param_paths(roots, params), params, shard_dims):
        SpmdParamLayout(p, info, path, d)  # raises, naming the parameter
        if hasattr(p, "fsdp_pre_all_gather"):
            raise NotImplementedError(f"fully_shard: {path} is a {type(p).__name__} (an "
                                      "all-gather extension); with dp_mesh_dims minifsdp "
                                      "shards plain DTensor parameters only")


def _shard_dims(roots: tuple[nn.Module, ...], params: list[tuple[nn.Parameter, Owners]],
                shard_placement_fn, info: MeshInfo, reshard_after_forward) -> list[int]:
    """Each parameter's shard dim (``resolve_shard_dims``), errors naming its path under
    the ``roots``; and torch's one combination that fails later refused now: an int
    ``reshard_after_forward`` k keeps a flat 1/k of each unsharded parameter, which its
    backward all-gather over k ranks cannot lay out on a dim > 0 (torch 2.14: ``IndexError``
    in backward)."""
    named = list(zip(_param_paths(roots, params), (p for p, _ in params)))
    where = ", ".join(type(m).__name__ for m in roots)
    dims = resolve_shard_dims(named, shard_placement_fn, info.shard_size, where)
    if (any(dims) and info.spmd is None
            and post_forward_info(info, reshard_after_forward)[1] is not None):
        on_dim = ", ".join(f"{path} (Shard({d}))" for (path, _), d in zip(named, dims) if d)
        raise NotImplementedError(
            f"fully_shard({where}): reshard_after_forward={reshard_after_forward} with "
            f"parameters sharded on a dim > 0: {on_dim}. Their backward all-gather over "
            f"{reshard_after_forward} ranks is not supported (torch 2.14 fails there with an "
            "IndexError); pass True or False, or shard them in a fully_shard call of their own")
    return dims


def _managed_params(roots: tuple[nn.Module, ...], ignored: set[nn.Parameter]
                    ) -> list[tuple[nn.Parameter, Owners]]:
    """The parameters in the ``roots``' subtrees outside nested ``fully_shard`` modules and
    not in ``ignored``, each with every (module, name) holding it, in torch's order: modules in
    post-order (a module's children before its own parameters, root by root; torch's
    ``_get_managed_modules``), so that the group's flat layout, and with it the order in which
    a backend sums each element, is torch's."""
    found: dict[nn.Parameter, Owners] = {}
    seen: set[nn.Module] = set()

    def visit(module: nn.Module) -> None:
        if module in seen or (module not in roots and isinstance(module, FSDPModule)):
            return  # a module shared twice, or one a nested fully_shard manages
        seen.add(module)
        for child in module.children():
            visit(child)
        for name, p in module._parameters.items():
            if p is None or p in ignored:
                continue
            if getattr(p, "_fsdp2_sharded", False):
                raise ValueError(
                    f"{type(module).__name__}.{name} is shared with a module that an earlier "
                    "fully_shard already sharded; shard the modules that share a parameter in "
                    "one fully_shard call: fully_shard([module_a, module_b]), or on their common "
                    "parent")
            found.setdefault(p, []).append((module, name))

    for root in roots:
        visit(root)
    return list(found.items())


# ---- state dicts (Note [state dicts]) ---------------------------------------------------------

def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every DTensor all-gathered into a plain full tensor, on
    every rank (a collective: call it on all ranks).

    Example::

        sd = full_state_dict(model)      # {"blocks.0.ln1.weight": tensor of shape (C,), ...}

    A DTensor that no dim cuts (``Replicate()`` everywhere: ``dp_mesh_dims`` with
    ``replicate`` only, Note [an SPMD mesh]) is its own full tensor, and ``full_tensor()``
    returns its local tensor itself; such a one is copied, so that the dict is a snapshot of
    the parameters in every case, not a view the next optimizer step changes.
    """
    return {k: _full_copy(v) if isinstance(v, DTensor) else v
            for k, v in model.state_dict().items()}


def _full_copy(v: DTensor) -> torch.Tensor:
    full = v.full_tensor()
    same = full.untyped_storage().data_ptr() == v._local_tensor.untyped_storage().data_ptr()
    return full.clone() if same and full.numel() else full


def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], strict: bool = True):
    """Load full (unsharded) tensors into a sharded model: each rank keeps its own rows of
    each one, so nothing is communicated. Returns ``load_state_dict``'s result.

    Example::

        load_full_state_dict(model, torch.load("full.pt"))   # the same file on every rank
    """
    current = model.state_dict()
    sharded = {}
    for k, v in full.items():
        cur = current.get(k)
        if isinstance(cur, DTensor):
            mesh = cur.device_mesh
            cuts = [i for i, p in enumerate(cur.placements) if not isinstance(p, Replicate)]
            if len(cuts) == 1 and type(cur.placements[cuts[0]]) is Shard:  # FSDP's, HSDP's
                dim = cuts[0]  # the mesh's
                rows = chunk_on_dim(v.to(cur.device, cur.dtype), mesh.size(dim),
                                    cur.placements[dim].dim)[mesh.get_local_rank(dim)]
            else:  # on an SPMD mesh (Note [an SPMD mesh]): DTensor cuts it, locally
                rows = distribute_tensor(v.to(cur.device, cur.dtype), mesh, cur.placements,
                                         src_data_rank=None).to_local()
            # from a spec, not DTensor.from_local, which would move an offloaded shard's
            # rows to the mesh's device (FSDPParam.to_sharded_dtensor says more)
            meta = TensorMeta(cur.shape, cur.stride(), rows.dtype)
            v = DTensor(rows, DTensorSpec(mesh, tuple(cur.placements), tensor_meta=meta),
                        requires_grad=False)
        sharded[k] = v
    return model.load_state_dict(sharded, strict=strict)
