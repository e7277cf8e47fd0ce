"""FSDP1's sharded gradients between backward and the optimizer step: ``clip_grad_norm_``
(``FullyShardedDataParallel.clip_grad_norm_`` calls ``clip_grad_norm`` here) and keeping frozen
parameters still (Note [frozen parameters] in ``options.py``).

Note [clipping sharded gradients]: the norm of the whole model's gradient, when each rank holds
1/N of it: every rank computes its shard's ``sum |g|^p`` (as the p-th power of a norm), one
all-reduce adds them (``max`` for p = inf), and the p-th root is the total, the same on every
rank; each rank then scales its own shard by ``min(1, max_norm / (total + 1e-6))``. One scalar
on the wire, not the gradient. To be torch FSDP1's bits, the local norm is computed as torch's
``_get_grad_norm`` does with ``use_orig_params=True``: a norm per original parameter's part of
the shard (in flat order), then the norm of those norms; NO_SHARD units (whole on every rank)
are added after the all-reduce, and a model whose units are all NO_SHARD is clipped by
``torch.nn.utils`` over the model's parameters, as torch does. Frozen parameters have no
gradient in torch's eyes: they are left out. Against one process the sums are grouped
differently (shard by shard, then across ranks): the same norm within fp32 rounding (1 ulp
measured, tests/test_fsdp1_knobs.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from minifsdp.fsdp1.flat_param import FlatParameter, FlatParamHandle


@torch.no_grad()
def clip_grad_norm(root: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Note [clipping sharded gradients] for the root ``FullyShardedDataParallel`` ``root``:
    scales every unit's ``flat_param.grad`` in place and returns the total norm before clipping
    (a 0-dim fp32 tensor, the same on every rank). A collective: call it on every rank.

    Example::

        norm = clip_grad_norm(model, 1.0)   # what model.clip_grad_norm_(1.0) does
    """
    p = float(norm_type)
    units = [u for u in root._units if u._handle is not None]
    if units and not any(u._handle.sharded for u in units):  # all NO_SHARD: as torch,
        views = _model_order_grads(root)  # nn.utils' clip over the model's parameters
        total = torch.nn.utils.get_total_norm(views, p)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for u in units:
            if u._handle.flat_param.grad is not None:
                u._handle.flat_param.grad.mul_(coef)
        return total
    sharded, whole, grads = [], [], []
    for unit in root._units:
        h = unit._handle
        if h is None or h.flat_param.grad is None:
            continue
        grads.append(h.flat_param.grad)
        (sharded if h.sharded else whole).extend(_local_param_grads(h))
    device = root._handle.device if root._handle is not None else None
    local = _norm_of(sharded, p, device)
    rest = _norm_of(whole, p, device) if whole else None
    if math.isinf(p):
        total = torch.maximum(local, rest) if rest is not None else local
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=root._group)
    else:
        total = local ** p
        dist.all_reduce(total, group=root._group)
        if rest is not None:
            total += rest ** p
        total = total ** (1.0 / p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def _local_param_grads(h: FlatParamHandle) -> list[torch.Tensor]:
    """The parts of ``h.flat_param.grad`` that belong to each original parameter on this rank,
    in flat order, skipping those with no element here (torch's sharded ``param.grad``)."""
    grad, frozen = h.flat_param.grad, set(h.flat_param.frozen_slices)
    slices = [h.local_slice(info) for info in h.infos]
    return [grad[sl[0]:sl[1]] for sl in slices if sl is not None and sl not in frozen]


def install_frozen_hooks() -> None:
    """Once per process: around every optimizer step, keep the frozen elements of each
    FlatParameter it steps as they were (Note [frozen parameters])."""
    global _FROZEN_HOOKS
    if _FROZEN_HOOKS:
        return
    _FROZEN_HOOKS = True

    def frozen_of(opt: torch.optim.Optimizer) -> list:
        return [(p, a, b) for g in opt.param_groups for p in g["params"]
                if isinstance(p, FlatParameter) for a, b in p.frozen_slices]

    def save(opt: torch.optim.Optimizer, *_: Any) -> None:
        opt.__dict__["_minifsdp_frozen"] = [(p, a, b, p.detach()[a:b].clone())
                                            for p, a, b in frozen_of(opt)]

    @torch.no_grad()
    def restore(opt: torch.optim.Optimizer, *_: Any) -> None:
        for p, a, b, value in opt.__dict__.pop("_minifsdp_frozen", []):
            p.detach()[a:b] = value

    register_optimizer_step_pre_hook(save)
    register_optimizer_step_post_hook(restore)


_FROZEN_HOOKS = False


def _model_order_grads(root: nn.Module) -> list[torch.Tensor]:
    """Each original parameter's gradient (a view of its unit's unsharded flat gradient, NO_SHARD
    only) in the order of the unwrapped model's ``parameters()``."""
    where = {}
    for u in root._units:
        h = u._handle
        if h is not None and h.flat_param.grad is not None:
            views = h.unflatten(h.flat_param.grad)
            frozen = set(h.flat_param.frozen_slices)
            where.update({(id(i.module), i.name): v for i, v in zip(h.infos, views)
                          if h.local_slice(i) not in frozen})
    return [where[id(m), name] for _, m in root.named_modules() for name in m._parameters
            if (id(m), name) in where]


def _norm_of(grads: list[torch.Tensor], p: float, device) -> torch.Tensor:
    """torch FSDP1's ``_get_grad_norm``: the norm of the per-parameter norms, in fp32."""
    if not grads:
        return torch.zeros((), device=device)
    norms = [torch.linalg.vector_norm(g, p, dtype=torch.float32) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), p, dtype=torch.float32)
