"""FSDP2: ``fully_shard`` -- per-parameter dim-0 sharding on DTensor (chapter 05).

A smaller, readable version of ``torch.distributed.fsdp.fully_shard`` (torch 2.14), with the
same names and the same state machine, one idea per module::

    fully_shard(module)                   api.py: claims the parameters no nested call took,
        |                                 swaps module.__class__ to FSDP<Class>(FSDPModule, ..)
        v
    FSDPModule  --- module._fsdp_state --> FSDPState                        fsdp_state.py
    unshard() / reshard()                  forward pre/post hooks, pre-backward grad hooks,
    set_requires_gradient_sync()           post-backward counting, root lazy init,
    set_modules_to_*_prefetch()            end-of-backward callback
                                                |  which group to all-gather next
                                                |  ----------------------------> prefetch.py
                                                |  .group                      (chapter 06)
                                                v
                                           FSDPParamGroup                   fsdp_param_group.py
                                           SHARDED <-> UNSHARDED; ONE all-gather (copy-in,
                                           collective | wait, copy-out) and ONE reduce-scatter
                                           per group (foreach_reduce: reduce.py); resize_(0)
                                           frees, resize_(n) restores
                                                |  .fsdp_params
                                                v
                                           FSDPParam  (one per parameter)  fsdp_param.py
                                           torch.chunk rows -> padded shard; DTensor(Shard(0))
                                           registered on the module(s); unsharded view

Usage::

    from minifsdp.fsdp2 import fully_shard, full_state_dict
    mesh = init_device_mesh(device.type, (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters())   # DTensor shards
    loss_fn(model(x), y).backward()               # all-gathers, reduce-scatters in hooks
    opt.step()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # works on DTensor grads
    sd = full_state_dict(model)                   # plain full tensors on every rank

Several modules, one group (torch's list form): ``fully_shard([model.tok_emb, model.head],
mesh=mesh)`` before the root's call -- one all-gather before whichever runs first, resharded
after the last, one reduce-scatter (Note [several modules, one group]).

Notes to cite: [the tensors of one parameter], [dim-0 chunks], [padding], [who owns the shard's
storage] (fsdp_param.py); [copy-in and copy-out], [freeing with resize_], [version counter],
[FSDP2 memory categories], [accumulating without communication], [unused parameters in a group],
[no all-gather in backward] (fsdp_param_group.py); [when is a group's backward over?], [not the
last backward], [several modules, one group] (fsdp_state.py); [bottom-up], [the
class swap], [state dicts], [meta-device init] (api.py); [issue and wait], [which group is
next], [same order on every rank], [mistargeted prefetches], [prefetch memory], [prefetch on
GPUs] (prefetch.py); [mixed precision], [gloo dtypes], [divide factor] (mixed_precision.py),
[accumulating in the reduce dtype] (fsdp_param.py); [recomputed in backward] (fsdp_state.py);
[HSDP], [HSDP accumulation], [reshard to k ranks] (hsdp.py); [all-gather extensions]
(fsdp_param.py), [FP8 all-gather], [where ours is simpler than torchao] (float8.py); [Shard(i)
layout] (shard_placement.py: ``fully_shard(..., shard_placement_fn=...)``, a parameter cut on
another dim than 0, as torch's ``Shard(i)``); [custom collectives] (custom_comm.py:
``set_custom_all_gather`` / ``set_custom_reduce_scatter``, torch's ``AllGather`` /
``ReduceScatter`` protocols); [an SPMD mesh] (spmd_mesh.py: ``fully_shard(..., dp_mesh_dims=
DataParallelMeshDims(shard="dp"))``, parameters already DTensors on a tensor-parallel mesh).

CPU offload: ``fully_shard(m, mesh=mesh, offload_policy=CPUOffloadPolicy())`` -- shards,
sharded gradients and the optimizer's state in CPU memory, copied to the device for each
all-gather and back after each reduce-scatter (Note [FSDP2 CPU offload] in ``fsdp_param.py``).

Mixed precision (chapter 07): ``fully_shard(m, mesh=mesh, mp_policy=MixedPrecisionPolicy(
param_dtype=torch.bfloat16, reduce_dtype=torch.float32))`` -- bf16 all-gathers and compute,
fp32 sharded master weights and gradient reduction.

FP8 all-gather (chapter 07): ``enable_float8_all_gather(model)`` before ``fully_shard`` marks the
``nn.Linear`` weights as ``Float8Weight``s: each group's one all-gather then moves them as float8
bytes (a per-tensor scale from an amax all-reduce) beside the other parameters' bf16 / fp32 bytes,
in a ``uint8`` buffer (``extensions.py``, torch's ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` extension point); compute uses the dequantized weights.

HSDP (chapter 09): ``fully_shard(m, mesh=init_device_mesh("cuda", (R, S), mesh_dim_names=(
"replicate", "shard")))`` -- shards over S ranks, replicas over R, gradients reduce-scattered
within a shard group and all-reduced across replicas (``hsdp.py``).

After tensor parallelism: ``fully_shard(m, mesh=world, dp_mesh_dims=DataParallelMeshDims(shard=
"dp"))`` on a ``("dp", "tp")`` mesh whose parameters are DTensors (``Replicate()`` on dp) cuts
each rank's TP piece over dp; the module still computes with DTensors (``spmd_mesh.py``).
"""

from minifsdp.fsdp2.api import (
    FSDPModule,
    full_state_dict,
    fully_shard,
    load_full_state_dict,
)
from minifsdp.fsdp2.custom_comm import AllGather, ReduceScatter
from minifsdp.fsdp2.float8 import Float8Weight, enable_float8_all_gather
from minifsdp.fsdp2.fsdp_param import CPUOffloadPolicy, FSDPParam, OffloadPolicy, chunk_dim0
from minifsdp.fsdp2.fsdp_param_group import FSDPParamGroup, ShardedState, TrainingState
from minifsdp.fsdp2.fsdp_state import FSDPState, register_fsdp_forward_method
from minifsdp.fsdp2.hsdp import MeshInfo, mesh_info
from minifsdp.fsdp2.mixed_precision import MixedPrecisionPolicy
from minifsdp.fsdp2.prefetch import UnshardHandle
from minifsdp.fsdp2.spmd_mesh import DataParallelMeshDims

__all__ = [
    "AllGather", "CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "FSDPParam",
    "FSDPParamGroup", "FSDPState",
    "Float8Weight", "MeshInfo", "MixedPrecisionPolicy", "OffloadPolicy", "ReduceScatter",
    "ShardedState", "TrainingState", "UnshardHandle", "chunk_dim0", "enable_float8_all_gather",
    "full_state_dict", "fully_shard", "load_full_state_dict", "mesh_info",
    "register_fsdp_forward_method",
]
