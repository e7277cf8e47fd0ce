"""FSDP1: ``FullyShardedDataParallel`` -- one flat, sharded parameter per unit (chapter 04).

A smaller, readable version of torch FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``,
torch 2.14, with ``use_orig_params=True``'s layout), under torch's names, one idea per module::

    FullyShardedDataParallel(model, auto_wrap_policy=policy)         fully_sharded.py
        |  which modules become units, and which     ---------------> wrap.py
        |  unit owns a (tied) parameter               plan_units, assign_owners; the size and
        |                                             transformer policies (torch's contract)
        v
    the root, and a nested FullyShardedDataParallel in each unit's place: forward unshards
    and (FULL_SHARD, not the root) reshards, the pre-backward hook unshards again, the
    post-backward hook reshards and reduce-scatters, the root's final callback ends the
    backward; no_sync, clip_grad_norm_, summon_full_params, state dicts
        |  ._handle
        v
    FlatParamHandle                                                   flat_param.py
    the unit's parameters flattened, aligned, padded to a multiple of N and cut into N
    shards: this rank's FlatParameter is what the optimizer steps; unshard = ONE all-gather
    into a flat tensor whose views the modules compute with; reshard = resize_(0)

    options.py   ShardingStrategy, BackwardPrefetch, CPUOffload, MixedPrecision: the knobs
    grads.py     clip_grad_norm_ over the shards; frozen parameters kept still by the step

Usage::

    from minifsdp import fsdp1
    policy = fsdp1.transformer_auto_wrap_policy({Block})   # each Block a unit, the root the rest
    model = fsdp1.FullyShardedDataParallel(GPT(cfg), auto_wrap_policy=policy)
    opt = torch.optim.AdamW(model.parameters())           # one FlatParameter shard per unit
    loss_fn(model(x), y).backward()                       # all-gathers, reduce-scatters in hooks
    model.clip_grad_norm_(1.0)                            # one all-reduce of a scalar
    opt.step()
    sd = fsdp1.full_state_dict(model)                     # original names, full tensors

Notes to cite: [units], [sharding strategies], [pre-backward hook], [post-backward hook],
[divide before and after], [final callback], [CPU offload], [memory categories], [names]
(fully_sharded.py); [flat layout], [alignment], [views, not copies], [freeing storage], [two
tensors, one storage], [tied parameters] (flat_param.py); [policy contract], [tied parameters
across units] (wrap.py); [FSDP1 mixed precision], [backward prefetch], [forward prefetch],
[FSDP1 no_sync], [frozen parameters] (options.py); [clipping sharded gradients] (grads.py).
"""

from minifsdp.fsdp1.flat_param import FlatParameter, FlatParamHandle
from minifsdp.fsdp1.fully_sharded import (
    FINAL_SPAN,
    FSDP,
    WRAPPED,
    FullyShardedDataParallel,
    full_state_dict,
    summon_full_params,
)
from minifsdp.fsdp1.options import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from minifsdp.fsdp1.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

__all__ = [
    "FINAL_SPAN", "FSDP", "WRAPPED", "BackwardPrefetch", "CPUOffload", "FlatParamHandle",
    "FlatParameter", "FullyShardedDataParallel", "MixedPrecision", "ShardingStrategy",
    "full_state_dict", "size_based_auto_wrap_policy", "summon_full_params",
    "transformer_auto_wrap_policy",
]
