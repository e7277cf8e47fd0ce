"""``fully_shard(..., mesh=world_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))``:
parameters that are already DTensors on a larger mesh, sharded over the dims that name data
parallelism (torch 2.14's ``dp_mesh_dims``; ``_get_mesh_info_from_named_dims`` in
``_fsdp_init.py``, ``_init_sharding_spec_spmd`` in ``_fsdp_param.py``).

Note [an SPMD mesh]: with tensor parallelism (TP), a model's parameters are DTensors on a mesh
that has more dims than FSDP's, e.g. ``("dp", "tp")``: ``Shard(0)`` on ``tp`` for a column-
parallel weight, ``Replicate()`` there for a LayerNorm's. ``dp_mesh_dims`` tells FSDP which of
the mesh's dims are its own; the parameter must be ``Replicate()`` on each of them, and FSDP
treats its *local* tensor (this rank's TP piece) as "the parameter"::

    mesh (dp=2, tp=2), W (8, 4) as (Replicate(), Shard(0)):   tp rank t holds rows 4t..4t+3
    FSDP cuts that local (4, 4) on dim 0 over dp:              dp rank d holds rows 2d..2d+1 of it
    sharded   DTensor (8, 4) on the same mesh, (Shard(0), Shard(0)) -- or _StridedShard(0,
              split_factor=2) on dp, as torch writes it, since tp's cut comes first (below)
    unsharded the all-gathered local (4, 4), as a DTensor with W's own spec: the module
              computes with DTensors, exactly as it did before FSDP

Everything else is FSDP over the shard dim's group, unchanged: the all-gather, the reduce-
scatter (an average over the DP ranks), HSDP's all-reduce over the replicate dims. Several
shard dims (``shard=("dp", "cp")``) are flattened into one group; with ``replicate`` too it is
HSDP on (replicate, shard). ``replicate`` alone is DDP, and ours builds it as HSDP whose shard
groups hold one rank each: the "shard" is the whole local tensor, the all-gather and the
reduce-scatter over one rank are copies, and the all-reduce over the replicas averages the
gradients -- the arithmetic of torch's DDP mode of ``fully_shard`` (``DDPMeshInfo``: a copy
for the reduce-scatter, then the all-reduce), so the same bits.

The gradient arrives as a DTensor; on the non-DP dims it is first brought to the
parameter's placements (a ``Partial()`` on ``tp`` becomes an all-reduce there), on the DP dims
it is left as it is, since the reduce-scatter is that reduction (torch's
``_get_grad_inner_tensor``), and its local tensor is what FSDP reduces.

Why ``_StridedShard``: the DTensor's placements are read left to right, dp before tp, but the
rows were cut by tp first, then by dp within tp's piece. With both on dim 0, ``Shard(0),
Shard(0)`` would mean the other order; ``_StridedShard(0, split_factor=tp)`` on dp says "cut
each of tp's pieces", so ``full_tensor()`` puts every row back where it was. torch computes the
same placements (``split_factor``: the sizes of the later dims that shard the same dim).

As torch: at least one of ``shard`` / ``replicate`` must be given, the named dims must exist,
and every managed parameter must be a DTensor on *this* mesh object, ``Replicate()`` on the DP
dims; ``reshard_after_forward`` as an int is refused (``NotImplementedError``). Not in ours:
spmd_types annotations, and all-gather extensions or CPU offload together with
``dp_mesh_dims``, each refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from minifsdp.fsdp2.hsdp import MeshInfo, mesh_info


@dataclass(frozen=True)
class DataParallelMeshDims:
    """The mesh dims FSDP owns, by name (torch 2.14's class of the same name): ``shard`` cuts
    the parameters (several names: one flattened group), ``replicate`` holds HSDP's replicas.

    Example:
        >>> DataParallelMeshDims(shard=("dp", "cp")).shard_names
        ('dp', 'cp')
        >>> DataParallelMeshDims(shard="dp", replicate="rep").replicate_names
        ('rep',)
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in "
                             "DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(field: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if field is None else (field,) if isinstance(field, str) else tuple(field)


@dataclass(frozen=True)
class SpmdMesh:
    """The full mesh the parameters live on and the dims of it that FSDP owns."""

    mesh: DeviceMesh
    dims: DataParallelMeshDims

    def dp_indices(self) -> tuple[list[int], list[int]]:
        """The mesh-dim indices of the shard names and of the replicate names."""
        names = self.mesh.mesh_dim_names
        return ([names.index(n) for n in self.dims.shard_names],
                [names.index(n) for n in self.dims.replicate_names])


def refuse_dtensor_without_dims(name: str, param: torch.Tensor) -> None:
    """A DTensor parameter reaching ``fully_shard`` without ``dp_mesh_dims``: say how to pass
    it (torch would take it as tensor parallelism on a mesh of its own, which ours does not
    build)."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        raise ValueError(f"{name} is already a DTensor (on mesh "
                         f"{mesh.mesh_dim_names or tuple(mesh.shape)}, {param.placements}): "
                         "pass its full mesh as mesh= with dp_mesh_dims=DataParallelMeshDims("
                         "shard=...) naming the data-parallel dims (Note [an SPMD mesh] in "
                         "spmd_mesh.py)")


def spmd_mesh_info(mesh: DeviceMesh, dims) -> MeshInfo:
    """Check ``dims`` against ``mesh`` (torch's ``_validate_mesh``) and build the data-
    parallel mesh FSDP communicates over: the shard dims' submesh (flattened if several), with
    the replicate dims' in front for HSDP; with replicate dims only, those as (R, 1), HSDP with
    one-rank shard groups (DDP). ``dims``: ours or torch's ``DataParallelMeshDims``.

    Example (inside a 4-rank torchrun worker)::

        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        info = spmd_mesh_info(world, DataParallelMeshDims(shard="dp"))
        info.shard_size, info.spmd.mesh is world          # 2, True
    """
    dims = DataParallelMeshDims(dims.shard, dims.replicate)  # torch's class works as well
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in dims.shard_names + dims.replicate_names:
        if name not in names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {names}")

    def submesh(group: tuple[str, ...]) -> DeviceMesh:
        return mesh[group[0]] if len(group) == 1 else mesh[group]._flatten("_".join(group))

    if not dims.shard_names:  # DDP: HSDP whose shard groups are one rank each (Note above)
        replicas = submesh(dims.replicate_names)
        name = "_".join(dims.replicate_names)
        dp_mesh = replicas._unflatten(0, (replicas.size(), 1), (name, f"{name}_one_rank"))
    else:
        dp_mesh = submesh(dims.shard_names)
        if dims.replicate_names:
            dp_mesh = DeviceMesh._concatenate([submesh(dims.replicate_names), dp_mesh])
    info = mesh_info(dp_mesh)
    return MeshInfo(info.mesh, info.shard_group, info.shard_rank, info.shard_size,
                    info.replicate_group, info.replicate_size, info.placements,
                    spmd=SpmdMesh(mesh, dims))


class SpmdParamLayout:
    """One parameter's two specs under ``dp_mesh_dims`` (Note [an SPMD mesh]): the unsharded
    one (the parameter's own, its TP placements) and the sharded one (a DP dim cut)."""

    def __init__(self, param: torch.Tensor, info: MeshInfo, path: str, shard_dim: int):
        spmd = info.spmd
        if not isinstance(param, DTensor):
            raise ValueError("When dp_mesh_dims is provided, all parameters must be DTensors on "
                             "the full SPMD mesh (e.g. via distribute_module). Got plain tensor "
                             f"for parameter '{path}'.")
        if param.device_mesh is not spmd.mesh:
            raise ValueError(f"{path}: Expected param's DTensor mesh to be the same mesh passed "
                             "to fully_shard, but got different mesh objects")
        self.unsharded_spec: DTensorSpec = param._spec
        shard_idx, replicate_idx = spmd.dp_indices()
        placements = list(param.placements)
        for kind, indices in (("shard", shard_idx), ("replicate", replicate_idx)):
            for i in indices:
                if not isinstance(placements[i], Replicate):
                    raise ValueError(f"{path}: Expected Replicate() on DP {kind} dim "
                                     f"'{spmd.mesh.mesh_dim_names[i]}' (index {i}) but got "
                                     f"{placements[i]}")
        self.dp_indices = frozenset(shard_idx + replicate_idx)
        for i in shard_idx:  # later dims cutting the same dim cut first: _StridedShard
            split = 1
            for j in range(i + 1, spmd.mesh.ndim):
                q = param.placements[j]
                if isinstance(q, (Shard, _StridedShard)) and q.dim == shard_dim:
                    split *= spmd.mesh.size(j)
            placements[i] = (_StridedShard(shard_dim, split_factor=split) if split > 1
                             else Shard(shard_dim))
        if len(shard_idx) <= 1:
            self.sharded_mesh, self.sharded_placements = spmd.mesh, tuple(placements)
        else:  # the shard dims flattened into one (torch's _build_spmd_sharding_spec)
            meshes, kept, skip = [], [], False
            for i, name in enumerate(spmd.mesh.mesh_dim_names):
                if name in spmd.dims.shard_names:
                    if not skip:
                        meshes.append(info.mesh)
                        kept += ([Replicate()] if info.is_hsdp else []) + [placements[i]]
                    skip = True
                elif name not in spmd.dims.replicate_names or not info.is_hsdp:
                    meshes.append(spmd.mesh[name])
                    kept.append(placements[i])
            self.sharded_mesh = DeviceMesh._concatenate(meshes)
            self.sharded_placements = tuple(kept)

    def sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """This rank's DP cut of its local tensor, as the sharded DTensor."""
        meta = self.unsharded_spec.tensor_meta
        meta = TensorMeta(meta.shape, meta.stride, local.dtype)
        spec = DTensorSpec(self.sharded_mesh, self.sharded_placements, tensor_meta=meta)
        return DTensor(local.detach(), spec, requires_grad=False)

    def unsharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """The all-gathered local tensor as a DTensor with the parameter's own spec (in the
        all-gather's dtype: mixed precision's ``param_dtype``)."""
        meta = self.unsharded_spec.tensor_meta
        spec = DTensorSpec(self.unsharded_spec.mesh, self.unsharded_spec.placements,
                           tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))
        return DTensor(local, spec, requires_grad=False)

    def grad_to_local(self, grad: torch.Tensor) -> torch.Tensor:
        """The unsharded DTensor gradient as the local tensor FSDP reduces: non-DP dims
        redistributed to the parameter's placements, DP dims left for the reduce-scatter."""
        if not isinstance(grad, DTensor):
            return grad
        want = tuple(grad.placements[i] if i in self.dp_indices else p
                     for i, p in enumerate(self.unsharded_spec.placements))
        if want != tuple(grad.placements):
            grad = grad.redistribute(placements=want)
        return grad._local_tensor
