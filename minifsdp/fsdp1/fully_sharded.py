"""FSDP1: ``FullyShardedDataParallel``, a wrapper that keeps each *unit* of a model sharded as
one ``FlatParameter`` (``flat_param.py``) and gathers it only while the unit computes::

    policy = transformer_auto_wrap_policy({Block})        # each Block a unit, the root the rest
    model = FullyShardedDataParallel(GPT(cfg), auto_wrap_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # one flat shard per unit: 1/N of Psi
    loss_fn(model(x), y).backward()   # per unit: all-gather, compute, reduce-scatter, free
    opt.step(); opt.zero_grad()       # each rank steps its shards: no all-gather after the step

ZeRO-3 (Rajbhandari et al. 2020) as PyTorch built it (Zhao et al. 2023). Per rank, fp32 Adam:
params 4 Psi / N plus the units being computed, grads 4 Psi / N plus up to two units', optimizer
state 8 Psi / N; per step all-gather twice and reduce-scatter once, 3(N-1)/N S (S = 4 Psi).

The knobs of torch FSDP1's config files, under its names: ``mixed_precision=MixedPrecision(...)``,
``backward_prefetch=BackwardPrefetch.BACKWARD_PRE``, ``forward_prefetch=True``, ``model.no_sync()``,
``model.clip_grad_norm_(1.0)`` and frozen parameters inside a unit; their Notes are in
``options.py`` and ``grads.py``.

Note [units]: a unit is a module whose parameters (those not in a unit below it) form one
FlatParameter. ``auto_wrap_policy`` picks units bottom-up, as torch's ``_recursive_wrap``; each
becomes a nested ``FullyShardedDataParallel`` in its parent's place, and the instance the user
creates, the *root*, takes the leftovers. A unit is the granularity of memory (its whole flat
parameter is gathered at once) and of communication (one collective per unit, so few large
messages instead of many small ones).

Note [sharding strategies]: what a unit keeps between its forward and its backward::

                 after forward     before backward   after backward   gradients
  FULL_SHARD     free (not root)   all-gather again  free             reduce-scatter (ZeRO-3)
  SHARD_GRAD_OP  keep              -                 free             reduce-scatter (ZeRO-2)
  NO_SHARD       never sharded: the flat parameter is whole on every rank   all-reduce (DDP)

The root keeps its parameters after forward even under FULL_SHARD (as torch does): backward
starts with it. A forward without grad (evaluation) frees every unit at once.

Note [pre-backward hook]: a module has no "my backward starts now" hook, but its outputs do:
``register_multi_grad_hook(outputs, fn, mode="any")`` runs ``fn`` when the first gradient
w.r.t. any output is computed, i.e. just before autograd runs the unit's backward. There we
all-gather again what the forward freed (into the same storage the saved views use, Note
[freeing storage] in ``flat_param.py``). The first such hook of a backward also queues
the final callback.

Note [post-backward hook]: the views come from one leaf, ``unsharded``; autograd accumulates
their gradients into ``unsharded.grad`` (padded, flat) once *all* uses of the unit's parameters
have been differentiated, and then runs its ``register_post_accumulate_grad_hook``. There we
free the unsharded parameters and reduce-scatter the gradient into this rank's
``flat_param.grad``; the unsharded gradient dies with the collective.

Note [divide before and after]: torch FSDP1 does not use ReduceOp.AVG: it divides the local
gradient by a power of two f ~ sqrt(N) before a SUM reduce-scatter and the sum by N / f after
(``_get_gradient_predivide_factor``: f = 2 for N = 2, 3, 4), so that a low-precision sum
neither overflows (all terms full size) nor loses small terms (all divided by N). We do the
same float operations. In fp32 a division by a power of two is exact, so the result is the
sum divided by N, rounded once: what gloo's AVG computes too (measured: the same bits at N = 3
and 4). NCCL's AVG instead multiplies every term by 1/N before summing, a rounding per term;
copying torch's operations keeps our gradients torch's on every backend.

Note [final callback]: the root queues ``_finalize_backward`` with
``Variable._execution_engine.queue_callback``; autograd runs it when the whole backward is done
(Note [when backward ends] in ``minifsdp.ddp``). It waits for the last reduce-scatter, frees
units whose post-backward hook never ran (no gradient reached them), and resets the
per-backward flags. Where a device has streams, each reduce-scatter runs asynchronously,
overlapping the next unit's backward, and is waited for when the next one starts: at most one
in flight, so at most two unsharded gradients alive -- as torch, which reduce-scatters on a
side stream and cannot reuse the gradient's memory before that stream is done with it. On
the CPU there is no stream to overlap on, and torch's reduce-scatter call blocks there (it
is issued with ``async_op=False``, ``_reduce_grad`` in ``torch/distributed/fsdp/
_runtime_utils.py``). So does ours: it is waited for at once, the unsharded gradient is freed
before the next unit's backward (its storage is freed at once: gloo's thread may hold the work,
and with it the input, a moment longer), and the peak is torch FSDP1's. Waiting later would cost a
second unsharded gradient (on benchmarks/fsdp1.py's GPT at N = 2: 37.4 MiB instead of 34.9)
for an overlap that 2 CPU cores cannot give.

Note [CPU offload]: with ``CPUOffload(offload_params=True)`` the shard (and its gradient, which
the optimizer needs beside it) lives in host memory: each all-gather starts by copying the
shard to the compute device, and each reduced gradient is copied back. On a CPU-only machine
the "device" is the CPU: the copies go from CPU to CPU and the code path is the same, which is
how the tests run it. (torch FSDP1's CPUOffload refuses to run without an accelerator.)

Note [memory categories]: for ``MemoryTracker``: the shards are ``params`` (found as the model's
parameters), and so are the unsharded flat parameters (tagged: during compute they *are* the
model's parameters; the tracker would otherwise call an all-gather output ``comm``). Gradients,
unsharded and sharded, are ``grads``. The shard's device copy under CPU offload is ``comm``.

Note [names]: ``parameters()`` yields the FlatParameters (what the optimizer needs), named like
torch's with ``use_orig_params=False`` but without the wrapper's prefix: ``flat_param``,
``blocks.0.flat_param``. The original names and shapes appear inside ``summon_full_params``,
in ``full_state_dict`` and in the root's ``state_dict()`` (a collective: every rank calls it),
which is torch FSDP1's default full state dict.

Tied parameters (Note [tied parameters across units] in ``wrap.py``): with
``auto_wrap_policy``, a tied parameter goes to the deepest unit enclosing all its users.
Wrapping units by hand, a parameter already flattened by another unit is an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from minifsdp import comm
from minifsdp.fsdp1.flat_param import FlatParameter, FlatParamHandle, registered_params
from minifsdp.fsdp1.grads import clip_grad_norm, install_frozen_hooks
from minifsdp.fsdp1.options import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
)
from minifsdp.fsdp1.wrap import Policy, assign_owners, plan_units
from minifsdp.memory import tag

WRAPPED = "_fsdp_wrapped_module"  # the wrapped module's attribute, as in torch
FINAL_SPAN = "fsdp1 final callback"  # the comm log's compute span of the final callback


def gradient_divide_factors(world_size: int) -> tuple[float, float]:
    """``(before, after)``: Note [divide before and after]. Their product is ``world_size``.

    Example:
        >>> [gradient_divide_factors(n) for n in (1, 2, 3, 4, 8)]
        [(1.0, 1.0), (2.0, 1.0), (2.0, 1.5), (2.0, 2.0), (4.0, 2.0)]
    """
    f = 1
    while world_size % f == 0 and world_size / f > f:
        f *= 2
    return float(f), world_size / f


class FullyShardedDataParallel(nn.Module):
    """Shard ``module`` unit by unit over the ranks of ``process_group`` (module docstring).

    Args:
        module: built identically on every rank (same seed; or ``sync_module_states=True``).
        process_group: the ranks to shard over (default: all).
        sharding_strategy: a ``ShardingStrategy`` or its name (Note [sharding strategies]).
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps shards in host memory.
        auto_wrap_policy: picks the units inside ``module`` (Note [units]); None: one unit.
        device_id: the compute device (default: the parameters'); the module is moved there.
        sync_module_states: broadcast rank 0's parameters and buffers first.
        backward_prefetch: None (default), ``BackwardPrefetch.BACKWARD_PRE`` (torch's
            default) or ``BACKWARD_POST`` (Note [backward prefetch] in ``options.py``).
        mixed_precision: ``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype)`` (Note
            [mixed precision]); None: compute and reduce in the parameters' dtype.
        forward_prefetch: gather the next unit during this one's forward (Note [forward
            prefetch]).

    Shapes: whatever ``module`` takes and returns. ``parameters()``: one ``FlatParameter`` of
    shape ``(padded_numel / N,)`` per unit; after ``loss.backward()`` its ``.grad`` holds this
    rank's slice of the gradient averaged over ranks. Build the optimizer after wrapping.

    Example (under ``torchrun --nproc-per-node 2``)::

        model = FullyShardedDataParallel(MnistCNN(), auto_wrap_policy=size_based_auto_wrap_policy(
            10_000))                                      # units: conv2, fc1, the root
        [p.shape for p in model.parameters()]             # [(805,), (9248,), (589888,)]
        F.nll_loss(model(x), y).backward()                # x: this rank's (B/2, 1, 28, 28)
        full_state_dict(model)["fc1.weight"].shape        # (128, 9216), on every rank
    """

    def __init__(self, module: nn.Module, process_group: Any = None,
                 sharding_strategy: ShardingStrategy | str = ShardingStrategy.FULL_SHARD,
                 cpu_offload: CPUOffload | None = None, auto_wrap_policy: Policy | None = None,
                 device_id: torch.device | str | None = None, sync_module_states: bool = False,
                 backward_prefetch: BackwardPrefetch | str | None = None,
                 mixed_precision: MixedPrecision | None = None, forward_prefetch: bool = False,
                 *, _nested: bool = False, _params: set[int] | None = None, _name: str = ""):
        super().__init__()
        if isinstance(module, FullyShardedDataParallel) or _is_unit(module):
            name = module.__dict__.get("_minifsdp_unit") or type(module).__name__
            raise ValueError(f"{type(module).__name__} ({name}) is already wrapped by "
                             "FullyShardedDataParallel: a module can be one unit only")
        for parent_name, parent in module.named_modules():  # another FSDP's unit, unwrapped
            for name, m in parent.named_children():
                if _is_unit(m) and not isinstance(parent, FullyShardedDataParallel):
                    raise ValueError(
                        f"{type(m).__name__} ({_clean(f'{parent_name}.{name}'.lstrip('.'))}) is "
                        "already wrapped by another FullyShardedDataParallel: use that wrapper "
                        "in its place")
        self._strategy = ShardingStrategy.parse(sharding_strategy)
        offload = cpu_offload if cpu_offload is not None else CPUOffload()
        if not isinstance(offload, CPUOffload):
            raise ValueError(f"cpu_offload must be a CPUOffload, got {cpu_offload!r}")
        mp = mixed_precision if mixed_precision is not None else MixedPrecision()
        if not isinstance(mp, MixedPrecision):
            raise ValueError("mixed_precision must be a MixedPrecision (minifsdp.fsdp1), got "
                             f"{mixed_precision!r}")
        prefetch = BackwardPrefetch.parse(backward_prefetch)
        if auto_wrap_policy is not None and not callable(auto_wrap_policy):
            raise ValueError(f"auto_wrap_policy must be callable, got {auto_wrap_policy!r}")
        for fqn, p in module.named_parameters():
            if p.device.type == "meta":
                raise ValueError(f"parameter {fqn!r} is on the meta device: materialize the module "
                                 "first (module.to_empty(device=...), then initialize it)")
        if device_id is not None:
            module.to(device_id)
        self._offload, self._group = offload.offload_params, process_group
        rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
        self._divide = gradient_divide_factors(world)
        if sync_module_states and not _nested:
            from minifsdp.ddp import broadcast_module_state
            broadcast_module_state(module, process_group)
        if auto_wrap_policy is not None:
            _params = _auto_wrap(module, auto_wrap_policy, dict(
                process_group=process_group, sharding_strategy=self._strategy,
                cpu_offload=offload, device_id=device_id, mixed_precision=mp))
        setattr(self, WRAPPED, module)
        module._minifsdp_unit = _name or "(root)"
        named = _unit_params(module, _params, _name)
        device = torch.device(device_id) if device_id is not None else (
            named[0][3].device if named else None)
        self._mp = mp
        param_dtype, self._reduce_dtype = mp.dtypes_for(named[0][3].dtype) if named else (
            None, None)
        self._handle = FlatParamHandle(
            named, rank, world, sharded=self._strategy is not ShardingStrategy.NO_SHARD,
            device=device, offload=self._offload, process_group=process_group,
            label=_name or type(module).__name__, param_dtype=param_dtype) if named else None
        if self._handle is not None:
            self.flat_param = self._handle.flat_param
            if self.flat_param.requires_grad:  # else every parameter of the unit is frozen
                self._handle.unsharded.register_post_accumulate_grad_hook(self._post_backward)
            if self.flat_param.frozen_slices:
                install_frozen_hooks()
        self._is_root, self._name = not _nested, _name or "(root)"
        self.__dict__["_root"] = self  # not a submodule: nn.Module would register it as one
        self._ran_pre_backward = False
        # Note [backward prefetch], Note [forward prefetch]: this iteration's post-forward
        # index, the first iteration's pre-forward index, and what is still to be gathered
        self._post_fwd_index: int | None = None
        self._pre_fwd_index: int | None = None
        self._needs_bwd_unshard = self._needs_fwd_unshard = self._prefetched = False
        if not _nested:  # this instance is the root: every unit below reports to it
            self._backward_prefetch, self._forward_prefetch = prefetch, bool(forward_prefetch)
            self._pre_fwd_order: list[FullyShardedDataParallel] = []
            self._post_fwd_order: list[FullyShardedDataParallel] = []
            self._iteration = 0  # backwards finished: forward prefetch starts at 1
            self._sync_gradients = True  # Note [FSDP1 no_sync]
            self._buffer_dtypes: dict[str, torch.dtype] | None = None  # cast at first forward
            self._units = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
            for name, unit in self.named_modules():
                if isinstance(unit, FullyShardedDataParallel):
                    unit._is_root, unit.__dict__["_root"] = unit is self, self
                    unit._name = _clean(name) or "(root)"
            self._pending: tuple | None = None  # the reduce-scatter in flight
            self._callback_queued = False

    # ---- forward ----------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch._C._current_graph_task_id() != -1:  # autograd is running a backward
            raise RuntimeError(
                f"FSDP unit {self._name!r} ran forward inside backward: activation "
                "checkpointing of a whole unit is not supported by minifsdp's FSDP1. Checkpoint "
                "regions inside the unit (minifsdp.models.apply_activation_checkpointing), or "
                "use minifsdp.fsdp2 (Note [recomputed in backward] in fsdp2/fsdp_state.py)")
        root, h = self._root, self._handle
        if self._is_root:
            args, kwargs = self._root_pre_forward(args, kwargs)
        if h is not None:
            if root._iteration == 0 and self._pre_fwd_index is None:  # Note [forward prefetch]
                self._pre_fwd_index = len(root._pre_fwd_order)
                root._pre_fwd_order.append(self)
            if not (self._prefetched and h.is_unsharded):  # Note [forward prefetch]
                h.unshard(f"{self._name} forward")
                h.use_unsharded_views()
            self._needs_fwd_unshard = self._prefetched = False
            if root._forward_prefetch and self._pre_fwd_index is not None:
                nxt = self._pre_fwd_index + 1
                if nxt < len(root._pre_fwd_order) and root._pre_fwd_order[nxt]._needs_fwd_unshard:
                    unit = root._pre_fwd_order[nxt]
                    unit._handle.unshard(f"{unit._name} forward prefetch")
                    unit._handle.use_unsharded_views()
                    unit._prefetched = True
        out = getattr(self, WRAPPED)(*args, **kwargs)
        if h is not None:
            if self._post_fwd_index is None:  # Note [backward prefetch]
                self._post_fwd_index = len(root._post_fwd_order)
                root._post_fwd_order.append(self)
            if not torch.is_grad_enabled():
                h.reshard()  # no backward will come
            else:
                grads = [t for t in tree_flatten(out)[0]
                         if isinstance(t, torch.Tensor) and t.requires_grad]
                self._ran_pre_backward, self._needs_bwd_unshard = False, bool(grads)
                if grads:  # Note [pre-backward hook]
                    torch.autograd.graph.register_multi_grad_hook(grads, self._pre_backward,
                                                                  mode="any")
                if self._strategy is ShardingStrategy.FULL_SHARD and not self._is_root:
                    h.reshard()
        return out

    def _root_pre_forward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(root) Note [FSDP1 mixed precision]: cast the buffers once and the floating inputs to
        ``param_dtype``; Note [forward prefetch]: every unit is yet to be gathered."""
        mp = self._mp
        if self._buffer_dtypes is None:
            self._buffer_dtypes = {}
            for name, b in getattr(self, WRAPPED).named_buffers():
                self._buffer_dtypes[_clean(name)] = b.dtype
                if mp.buffer_dtype is not None and b.is_floating_point():
                    b.data = b.to(mp.buffer_dtype)
        for unit in self._units:
            unit._needs_fwd_unshard = self._forward_prefetch
        if mp.param_dtype is None:
            return args, kwargs
        cast = lambda t: (t.to(mp.param_dtype) if isinstance(t, torch.Tensor)
                          and t.is_floating_point() else t)
        return (tuple(tree_map(cast, list(args))),
                tree_map(cast, kwargs))

    # ---- backward ---------------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        root = self._root
        if not root._callback_queued:  # Note [final callback]
            root._callback_queued = True
            Variable._execution_engine.queue_callback(root._finalize_backward)
        if not self._ran_pre_backward:
            self._ran_pre_backward = True
            if self._needs_bwd_unshard:
                self._handle.unshard(f"{self._name} backward")
            self._needs_bwd_unshard = False
            if root._backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
                self._prefetch_backward()

    def _prefetch_backward(self) -> None:
        """Note [backward prefetch]: gather the unit that finished its forward just before this
        one, if its backward is still to come."""
        order, i = self._root._post_fwd_order, self._post_fwd_index
        if i is not None and i > 0 and order[i - 1]._needs_bwd_unshard:
            unit = order[i - 1]
            unit._handle.unshard(f"{unit._name} backward prefetch")

    @torch.no_grad()
    def _post_backward(self, unsharded: torch.Tensor) -> None:
        """Note [post-backward hook]: ``unsharded.grad`` (padded_numel,) is final."""
        root = self._root
        if root._sync_gradients or self._strategy is ShardingStrategy.FULL_SHARD:
            self._handle.reshard()  # nothing needs the parameters any more (Note [FSDP1 no_sync])
        if root._backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            self._prefetch_backward()
        if not root._sync_gradients:  # Note [FSDP1 no_sync]: autograd adds the next one into it
            tag(unsharded.grad, "grads")
            return
        grad, unsharded.grad = unsharded.grad, None
        tag(grad, "grads")
        if grad.dtype != self._reduce_dtype:  # Note [FSDP1 mixed precision]
            grad = grad.to(self._reduce_dtype)
            tag(grad, "grads")
        root._reduce(self, grad)

    def _reduce(self, unit: FullyShardedDataParallel, grad: torch.Tensor) -> None:
        """(root) Average ``grad`` over ranks into ``unit``'s shard gradient (asynchronously where
        the device has streams)."""
        self._finish_pending()
        finish = unit._handle.reduce_grad(grad, unit._divide, f"{unit._name} grad")
        self._pending = (unit, finish)  # holds the input until the collective is done
        if grad.device.type == "cpu":  # no stream to overlap on (Note [final callback])
            self._finish_pending()

    @torch.no_grad()
    def _finish_pending(self) -> None:
        """(root) Wait for the collective in flight; its result joins the shard's ``.grad``."""
        if self._pending is None:
            return
        unit, finish = self._pending
        self._pending = None
        out = finish()
        flat = unit._handle.flat_param
        if out.dtype != flat.dtype:  # Note [FSDP1 mixed precision]: reduced, then full precision
            out = out.to(flat.dtype)
            tag(out, "grads")
        if unit._offload:  # Note [CPU offload]
            out = out.to(flat.device, copy=True)
            tag(out, "grads")
        for a, b in flat.frozen_slices:  # Note [frozen parameters]
            out[a:b] = 0
        if flat.grad is None:
            flat.grad = out
        else:  # gradient accumulation over several backwards
            flat.grad += out

    def _finalize_backward(self) -> None:
        """(root) Note [final callback]."""
        try:
            with comm.span(FINAL_SPAN):
                self._finish_pending()
                keep = not self._sync_gradients  # Note [FSDP1 no_sync]: SHARD_GRAD_OP keeps them
                for unit in self._units:
                    if unit._handle is not None and not (
                            keep and unit._strategy is ShardingStrategy.SHARD_GRAD_OP):
                        unit._handle.reshard()
                    unit._ran_pre_backward = unit._needs_bwd_unshard = False
                    unit._post_fwd_index = None
                self._post_fwd_order.clear()
                self._iteration += 1
        finally:
            self._callback_queued = False

    # ---- knobs used in the training loop --------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate unsharded gradients and communicate nothing; the first
        backward after the block reduce-scatters the sum (Note [FSDP1 no_sync]). On the root.

        Example::

            with model.no_sync():
                for x, y in micro_batches[:-1]:
                    loss_fn(model(x), y).backward()      # no collective
            loss_fn(model(*micro_batches[-1]), ...).backward()   # one reduce-scatter per unit
        """
        if not self._is_root:
            raise RuntimeError(f"no_sync() is called on the root FullyShardedDataParallel, not "
                               f"on unit {self._name!r}")
        old, self._sync_gradients = self._sync_gradients, False
        try:
            yield
        finally:
            self._sync_gradients = old

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every unit's gradient so that the norm of the whole model's gradient is at
        most ``max_norm``; return that norm (before clipping), the same on every rank. A
        collective, on the root (Note [clipping sharded gradients] in ``grads.py``).

        Example::

            loss.backward()
            norm = model.clip_grad_norm_(1.0)    # a 0-dim fp32 tensor, e.g. tensor(3.7)
            opt.step()
        """
        if not self._is_root:
            raise RuntimeError("clip_grad_norm_() is called on the root FullyShardedDataParallel, "
                               f"not on unit {self._name!r}")
        return clip_grad_norm(self, max_norm, norm_type)

    # ---- names (Note [names]) ---------------------------------------------------------------

    def named_modules(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Module]]:
        """The model's own names: the wrapper's hop ``_fsdp_wrapped_module.`` is left out, so
        ``named_parameters()``, ``named_buffers()`` and memory phases read ``blocks.0...``."""
        for name, m in super().named_modules(*args, **kwargs):
            yield _clean(name), m

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """The root: ``full_state_dict(self)`` (a collective). A nested unit: as nn.Module."""
        if not self._is_root:
            return super().state_dict(*args, destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        out = destination if destination is not None else {}
        out.update({prefix + k: v for k, v in full_state_dict(self).items()})
        return out

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(getattr(self, WRAPPED), name)  # model.blocks, model.cfg, ...


FSDP = FullyShardedDataParallel


def _is_unit(m: nn.Module) -> bool:  # __dict__: FSDP.__getattr__ forwards to the wrapped module
    return "_minifsdp_unit" in m.__dict__


def _clean(name: str) -> str:
    return name.replace(WRAPPED + ".", "").replace(WRAPPED, "").rstrip(".")


def _unit_params(module: nn.Module, keep: set[int] | None, unit: str = "") -> list:
    """The ``(fqn, module, name, parameter)`` a unit flattens: the parameters still registered
    below ``module`` (FlatParameters of units below excepted), or those in ``keep``. Errors name
    the full path: ``unit`` (the unit's name in the model) + the fqn."""
    out = []
    for fqn, m, name, p in registered_params(module):
        if isinstance(p, FlatParameter) or (keep is not None and id(p) not in keep):
            continue
        if getattr(p, "_minifsdp_flattened", None) is not None:
            full = f"{unit}.{_clean(fqn)}" if unit else _clean(fqn)
            raise ValueError(f"parameter {full!r} is tied to a parameter that unit "
                             f"{p._minifsdp_flattened!r} already flattened: wrap the modules that "
                             "share it in one unit (Note [tied parameters across units])")
        out.append((_clean(fqn), m, name, p))
    return out


def _auto_wrap(root: nn.Module, policy: Policy, kwargs: dict) -> set[int]:
    """Wrap the units ``policy`` picks below ``root`` as nested FSDP, children first
    (``wrap.py``), and return the ids of the parameters left to the root."""
    skip = lambda m: isinstance(m, FullyShardedDataParallel)  # wrapped by hand before
    plan = plan_units(root, policy, skip)
    owner = assign_owners(root, [m for _, m in plan], skip)
    for name, m in plan:
        if _is_unit(m):
            raise ValueError(f"{type(m).__name__} ({name}) is already wrapped by "
                             "FullyShardedDataParallel: a module can be one unit only")
        parent, _, attr = name.rpartition(".")
        unit = FullyShardedDataParallel(m, **kwargs, _nested=True, _name=name,
                                        _params={i for i, u in owner.items() if u is m})
        setattr(root.get_submodule(parent), attr, unit)
    return {i for i, u in owner.items() if u is root}


# ---- the full parameters -----------------------------------------------------------------------

@contextlib.contextmanager
def summon_full_params(model: nn.Module, writeback: bool = True) -> Iterator[nn.Module]:
    """Inside the block every unit is unsharded and its original parameters are registered
    under their names and shapes (``model.named_parameters()`` shows them). With
    ``writeback``, changes to them are kept. A collective: call it on every rank.

    Example::

        with summon_full_params(model):
            dict(model.named_parameters())["fc1.weight"].shape   # (128, 9216)
    """
    units = [u for u in model.modules()
             if isinstance(u, FullyShardedDataParallel) and u._handle is not None]
    was_unsharded = [u._handle.is_unsharded for u in units]
    with torch.no_grad():
        for u in units:
            u._handle.unshard_full_precision(f"{u._name} summon")  # Note [FSDP1 mixed precision]
            u._handle.use_unsharded_views(as_params=True)
            del u._parameters["flat_param"]
    try:
        yield model
    finally:
        with torch.no_grad():
            for u, was in zip(units, was_unsharded):
                if writeback:
                    u._handle.write_back()
                u._handle.use_unsharded_views(as_params=False)
                u._parameters["flat_param"] = u._handle.flat_param
                if u._handle._full_precision:
                    u._handle.end_full_precision()
                elif not was:
                    u._handle.reshard()


def full_state_dict(model: FullyShardedDataParallel) -> dict[str, torch.Tensor]:
    """The unwrapped model's ``state_dict()``: original names (tied ones too), order and
    shapes, full tensors copied to CPU on every rank. A collective: call it on every rank.

    Example::

        sd = full_state_dict(model)        # {"tok_emb.weight": (64, 32) tensor, ...}
        GPT(cfg).load_state_dict(sd)       # a plain, unsharded copy of the model
    """
    # buffers in their own dtype, as before MixedPrecision.buffer_dtype cast them (as torch)
    dtypes = getattr(model, "_buffer_dtypes", None) or {}
    with summon_full_params(model, writeback=False):
        sd = getattr(model, WRAPPED).state_dict()
        sd = {k: v.to(dtypes.get(_clean(k), v.dtype)) for k, v in sd.items()}
        return {_clean(k): v.detach().to("cpu", copy=True) for k, v in sd.items()}
