"""SimpleFSDP (chapter 10): FSDP as a parametrization that ``torch.compile`` can see whole.

Chapter 05's ``FSDPParamGroup`` runs FSDP from hooks around each module. Here a parameter is
*stored* sharded and every *read* of it is an all-gather, written as DTensor code; autograd
derives the reduce-scatter, and a selective-checkpoint policy derives the reshard::

    stored   nn.Parameter(DTensor, Shard(0))   sharded shard, what the optimizer steps
    read     .redistribute([Replicate()])      all-gather                       = unshard()
    compute  .to_local(grad_placements=[Partial("avg")])  plain tensor for the module's ops
    backward Partial -> Shard(0)               reduce-scatter (avg)             = post_backward()

Note [reshard is recompute]: ``reshard()`` frees the unsharded parameter after forward. Here
nothing frees it: each block runs under selective activation checkpointing whose policy says
"recompute" for the gather chain (all-gather, its autograd wrapper, wait, cast, pad, cat, views)
and "save" for all else, so autograd keeps no unsharded parameter, and backward all-gathers
again (``reshard_after_forward=False`` drops the checkpoint: they stay alive until backward).
It pays most under compile. The partitioner sees the backward graph and saves, of the "save"
ops, those backward reads; eager checkpointing cannot know what its recompute will ask for
and caches the output of *every* "save" op. Measured (chapter 10, N = 2): compiled, resharding
has the lowest peak of the compiled variants; eager, it peaks below keeping too (it peaked
above while the wrapper was a "save" op: see GATHER_OPS).

Note [one collective per parameter]: eager SimpleFSDP gathers and reduces each parameter
alone (FSDPParamGroup does one flat collective per group); grouping them into buckets and
issuing them early is the graph passes' job (``minifsdp.graph_passes``).

Note [what compile sees]: no hooks, no state machine -- only ops. ``torch.compile`` traces the
collectives into the forward and backward FX graphs (``_c10d_functional`` all_gather /
reduce_scatter + wait_tensor per parameter), where passes can move and merge them.

Parity: losses and parameters equal torch's and our ``fully_shard`` bit for bit at N = 2 (fp32,
bf16/fp32) and N = 3 (bf16/fp32); fp32 at N = 3 differs in the last bits, as gloo sums each
per-parameter buffer in another order (tests/test_simple_fsdp.py). ``"replicate"`` equals torch
DDP bit for bit at N = 2; ``"hybrid_shard"`` on a 2 x 2 mesh equals ``fully_shard``'s HSDP
but for a tied parameter, last bits (tests/test_fsdp2_hsdp.py). No TP.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.utils.parametrize as parametrize
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from minifsdp.fsdp2.mixed_precision import MixedPrecisionPolicy

# mode -> (stored, computed, gradient placements), one entry per mesh dimension. The backward of
# Partial -> stored is the gradient collective: DDP all-reduce, FSDP reduce-scatter, HSDP a
# reduce-scatter within a shard group, then an all-reduce across the replicas.
PLACEMENTS = {
    "replicate": ((Replicate(),), (Replicate(),), (Partial("avg"),)),
    "fully_shard": ((Shard(0),), (Replicate(),), (Partial("avg"),)),
    "hybrid_shard": ((Replicate(), Shard(0)), (Replicate(), Replicate()),
                     (Partial("avg"), Partial("avg"))),
}

_ACTIVE = [True]  # False inside disable_parametrization()


@contextmanager
def disable_parametrization():
    """Reading ``module.weight`` returns the stored DTensor, without any collective: for
    initialization (``init_weights`` on the shards), export or inspection."""
    _ACTIVE.append(False)
    try:
        yield
    finally:
        _ACTIVE.pop()


class ReplicateCompute(nn.Module):
    """The parametrization: stored DTensor -> the full plain tensor that the module computes
    with. Mixed precision is the redistribute's own dtypes: ``forward_dtype`` casts the
    shard before the all-gather (bf16 on the wire, as fully_shard's copy-in), and
    ``backward_dtype`` casts the gradient before the reduce-scatter (``reduce_dtype``); the
    sharded gradient returns in the parameter's dtype."""

    def __init__(self, compute, grads, param_dtype=None, reduce_dtype=None):
        super().__init__()
        self.compute, self.grads = compute, grads
        self.param_dtype = param_dtype
        # fully_shard reduces in param_dtype when reduce_dtype is None; redistribute would
        # reduce in the stored dtype, so say param_dtype explicitly.
        self.reduce_dtype = reduce_dtype or param_dtype

    def forward(self, x: DTensor):
        if not _ACTIVE[-1]:
            return x
        full = x.redistribute(placements=self.compute, forward_dtype=self.param_dtype,
                              backward_dtype=self.reduce_dtype)
        return full.to_local(grad_placements=self.grads)


# ---- reshard after forward: Note [reshard is recompute] ---------------------------------------

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
# _wrap_tensor_autograd (eager only: it wraps the all-gather's output in the
# AsyncCollectiveTensor that waits for it) belongs to the chain. Saved, as it was until
# 2026-11-26, the recompute got the *forward's* gathered tensor back from the cache and waited on
# that, while the all-gather it had just issued again was never waited for: a collective left
# in flight per re-gathered parameter (Note [one collective in flight on gloo] in
# graph_passes.py) and the unsharded parameter kept alive from forward to backward.
GATHER_OPS = {_c10d.all_gather_into_tensor.default, _c10d.wait_tensor.default,
              _c10d._wrap_tensor_autograd.default,
              _aten._to_copy.default, _aten.constant_pad_nd.default, _aten.cat.default}


def reshard_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Recompute the gather chain (and every view: a saved view keeps its base alive), save
    the rest. Op-based, so it holds when compile traces the policy, not only in eager."""
    if func in GATHER_OPS or func.is_view:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE


def _resharded_forward(forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False,
                          context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                       reshard_policy), **kwargs)
    return run


# ---- the public function ----------------------------------------------------------------------

def data_parallel(model: nn.Module, mesh: DeviceMesh, mode: str = "fully_shard", *,
                  mp_policy: MixedPrecisionPolicy | None = None,
                  reshard_after_forward: bool = True,
                  blocks: list[nn.Module] | None = None) -> nn.Module:
    """Shard (or replicate) every parameter of ``model`` over ``mesh``, in place; returns it.

    Args:
        mode: ``"fully_shard"`` (FSDP), ``"replicate"`` (DDP) or ``"hybrid_shard"`` (HSDP,
            a 2-D mesh: (replicate, shard)).
        mp_policy: ``param_dtype`` and ``reduce_dtype`` as in ``fully_shard``; floating
            inputs of ``model`` are cast to ``param_dtype`` if ``cast_forward_inputs``.
        reshard_after_forward: run each of ``blocks`` under the reshard policy (Note
            [reshard is recompute]). Default blocks: the members of the model's ModuleLists.

    Example (inside a torchrun worker)::

        mesh = init_device_mesh("cpu", (world_size,))
        model = data_parallel(GPT(cfg), mesh)          # parameters: DTensor shards
        opt = torch.optim.AdamW(model.parameters())
        loss_fn(model(x), y).backward()                # gathers and reduce-scatters inside
        opt.step()
        model = torch.compile(model, backend=graph_passes.backend())   # optional
    """
    stored, compute, grads = PLACEMENTS[mode]
    if mesh.ndim != len(stored):
        raise ValueError(f"mode {mode!r} needs a {len(stored)}-D mesh, got {mesh.ndim}-D")
    mp = mp_policy or MixedPrecisionPolicy()
    param_dtype = reduce_dtype = None
    if mp.param_dtype is not None:
        param_dtype = mp.param_dtype
        reduce_dtype = mp.reduce_dtype
    # A tied parameter becomes one DTensor, gathered once per module; its two reduce-scattered
    # gradients are then added: not bitwise to fully_shard, which reduce-scatters their sum.
    sharded: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in sharded:
                sharded[id(p)] = nn.Parameter(distribute_tensor(p.data, mesh, stored),
                                              requires_grad=p.requires_grad)
            module.register_parameter(name, sharded[id(p)])
            # unsafe: the parametrization changes the type (DTensor -> Tensor) and shape.
            parametrize.register_parametrization(
                module, name, ReplicateCompute(compute, grads, param_dtype, reduce_dtype),
                unsafe=True)
    if reshard_after_forward and mode != "replicate":
        if blocks is None:
            blocks = [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]
        for block in blocks:
            block.forward = _resharded_forward(block.forward)
    if param_dtype is not None and mp.cast_forward_inputs:
        def cast_inputs(module, args, kwargs):
            cast = lambda t: t.to(param_dtype) if torch.is_floating_point(t) else t  # noqa: E731
            return torch.utils._pytree.tree_map_only(torch.Tensor, cast, (args, kwargs))
        model.register_forward_pre_hook(cast_inputs, with_kwargs=True)
    return model


def param_name(name: str) -> str:
    """``blocks.0.fc.parametrizations.weight.original`` -> ``blocks.0.fc.weight``."""
    return name.replace(".parametrizations.", ".").removesuffix(".original")
