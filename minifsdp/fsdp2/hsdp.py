"""How ``fully_shard`` reads its mesh: FSDP on a 1-D mesh, HSDP (hybrid sharding) on a 2-D one.

    mesh = init_device_mesh("cpu", (N,))                                  # FSDP: shard over N
    mesh = init_device_mesh("cuda", (R, S), mesh_dim_names=("replicate", "shard"))   # HSDP

``MeshInfo`` names the two process groups a parameter group talks to (torch:
``FSDPMeshInfo`` / ``HSDPMeshInfo`` in ``_fsdp_common.py``): the *shard* group, over which
parameters are cut into dim-0 chunks, all-gathered and reduce-scattered, and -- for HSDP only
-- the *replicate* group, over which the gradient shards are all-reduced. Everything else in
``minifsdp.fsdp2`` only sees "the shard group of S ranks", which on a 1-D mesh is the whole
mesh (S = N).

Note [HSDP]: on a 2-D mesh (R, S) -- think R nodes of S GPUs -- dim 1 shards and dim 0
replicates. Rank ``r`` sits at ``(r // S, r % S)``; at R = S = 2 the shard groups are {0, 1}
and {2, 3} (one per node), the replicate groups {0, 2} and {1, 3} (one per shard index)::

                 shard dim (S ranks, fast links: NVLink within a node)
                 ------------------->
    replicate  | rank 0  rank 1        node 0: every parameter cut in S pieces, one each
    dim (R)    | rank 2  rank 3        node 1: the same S pieces again (a replica)
               v

A parameter is the DTensor ``(Replicate(), Shard(0))``: the rows of ``torch.chunk(p, S)`` at the
rank's shard index, the same rows on every node. Per group and step:

    all-gather      within the shard group, S padded shards     (forward; again in backward)
    reduce-scatter  within the shard group: AVG over S          (each rank: its 1/S rows)
    all-reduce      across the replicate group: AVG over R      (only those 1/S rows)

AVG then AVG is the average over all N = R S ranks, as torch computes it (``foreach_reduce``:
``_get_gradient_divide_factors`` sizes the division by R S; fp32 / bf16 reduce dtypes use the
backend's AVG in both collectives, other dtypes divide by ~sqrt(R S) before the
reduce-scatter and by the rest after the all-reduce, with SUM in both -- ``mixed_precision.
gradient_divide_factors``). The sum is associated differently from 1-D FSDP's (two rings),
so HSDP is bitwise equal to torch's HSDP, not to 1-D FSDP or one process (rounding apart).

The trade, per rank, for a group of Psi parameters in fp32 (4 Psi bytes), wire bytes as in
the Note [bytes vs wire bytes] of ``minifsdp/comm.py``::

                         FSDP over N                       HSDP (R x S)
    model state          16 Psi / N (params, grads, Adam)  16 Psi / S       -- R times more
    all-gather (x2)      (N-1)/N 4 Psi, across nodes       (S-1)/S 4 Psi, within the node
    reduce-scatter       (N-1)/N 4 Psi, across nodes       (S-1)/S 4 Psi, within the node
    all-reduce           --                                2 (R-1)/R 4 Psi / S, across nodes

So HSDP pays R times FSDP's model-state memory, and in exchange every collective over the
full parameter size stays inside the node; only a 1/S-sized shard of the gradients crosses
nodes, once per step. FSDP's three collectives are rings over all N ranks that cross nodes.
E.g. R = 16 nodes of S = 8 GPUs, Psi = 7e9: per rank and step, 2 (15/16) 28 GB / 8 = 6.6 GB
go through an all-reduce across nodes instead of about 3 x 28 GB = 84 GB through node-
spanning rings, and each GPU holds 16 Psi / 8 = 14 GB of model state instead of
16 Psi / 128 = 0.9 GB. What those bytes cost depends on the network. On a DGX H100 cluster
(a 400 Gb/s NIC per GPU) NCCL spreads FSDP's node-spanning ring over all 8 NICs of a node, so
its bus bandwidth is close to NVLink's for large messages, while HSDP's all-reduce, one rank
per node, shares the node's 8 NICs with the node's 7 other replicate groups: one NIC each,
8x less bandwidth for its 13x fewer bytes. What grows with N is every ring's latency,
linear in N (Notes [hardware defaults], [a group's share of the NICs] and [collective time]
in ``minifsdp/scale_time.py``, which chapter 09 uses to price both). With fewer NICs per
node, or TCP, the bytes dominate and HSDP's 13x fewer of them decide. Measured at
R = S = 2 on the test GPT: tests/test_fsdp2_hsdp.py.

Note [HSDP accumulation]: with several micro-batches per step, each backward but the step's
last may reduce as usual (the default) or skip part of it:
  * ``set_requires_gradient_sync(False)`` skips both collectives and keeps the full unsharded
    gradients until the last backward (S times a gradient shard's memory, no traffic);
  * ``set_requires_all_reduce(False)`` -- torch's, for HSDP -- reduce-scatters within the node
    as usual but keeps the output (averaged over S, not yet post-divided) in the group's
    ``partial_reduce_output``, writes no ``.grad`` and skips the inter-node all-reduce; the
    next backward that all-reduces adds it in first. The slow links carry one all-reduce per
    step instead of one per micro-batch, for one gradient shard of memory.
Both add the same numbers in the same order as torch (``foreach_reduce``: ``partial += out``,
later ``out += partial``), so they are bitwise equal to torch's (tests/test_fsdp2_hsdp.py). As
in torch, ``zero_grad`` does not clear a kept sum: end every step's accumulation with a
backward under ``set_requires_all_reduce(True)``.

Note [reshard to k ranks]: ``reshard_after_forward=k`` (torch's int form; k divides the shard
size S) is the middle ground between True (backward all-gathers over all S ranks again) and
False (keep the unsharded parameters from forward to backward). After forward each rank keeps
the 1/k of every unsharded parameter that its position in a group of k contiguous ranks
selects -- a copy, so the unsharded buffer is freed -- and backward all-gathers those pieces
within the k ranks: with k = GPUs per node, fast links only, for P/k bytes held per group
instead of P/S. torch builds the groups as ``DeviceMesh(mesh.mesh.view(-1, k))`` (on a 2-D
HSDP mesh, groups of k inside a shard group, as S is a multiple of k) and so do we, once per
(mesh, k). Like torch, k = 1 means False and k = S means True. Between forward and backward
the modules hold the sharded DTensors (torch registers the k-way piece as a DTensor on the
k-rank mesh; nothing reads it there, so we keep one kind of sharded parameter); a forward that
finds a group still holding its piece (no backward came) drops it and all-gathers the shards
afresh, as the optimizer may have changed them. The numbers are unchanged: an all-gather only
copies (tests/test_fsdp2_hsdp.py's worker: bitwise equal to torch's with k = 2 at N = 4).

A mesh with other dims (tensor parallelism) goes through ``dp_mesh_dims``, which names the
data-parallel dims of it (Note [an SPMD mesh] in ``spmd_mesh.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

HSDP_DIM_NAMES = ("replicate", "shard")  # the convention: dim 0 replicates, dim 1 shards


@dataclass(frozen=True)
class MeshInfo:
    """The groups of one ``fully_shard`` mesh (Note [HSDP]).

    Attributes:
        mesh: the mesh the DTensors live on (1-D or 2-D).
        shard_group, shard_rank, shard_size: all-gather and reduce-scatter; rank r holds
            dim-0 chunk ``shard_rank`` of ``shard_size`` (Note [dim-0 chunks]).
        replicate_group, replicate_size: the gradient all-reduce; ``None`` and 1 on a 1-D mesh.
        placements: ``(Shard(0),)`` or ``(Replicate(), Shard(0))``.
        spmd: with ``dp_mesh_dims``, the full mesh the parameters live on and the names of
            its data-parallel dims (``mesh`` is then the data-parallel part of it; Note [an
            SPMD mesh] in ``spmd_mesh.py``); else ``None``.

    Example (4 ranks, mesh (2, 2), rank 3)::

        >>> info = mesh_info(init_device_mesh("cpu", (2, 2), mesh_dim_names=HSDP_DIM_NAMES))
        >>> info.shard_rank, info.shard_size, info.replicate_size, info.placements  # doctest: +SKIP
        (1, 2, 2, (Replicate(), Shard(dim=0)))     # rank 3 = row 1, column 1: chunk 1 of 2
    """

    mesh: DeviceMesh
    shard_group: dist.ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    placements: tuple[Placement, ...]
    spmd: Any = None  # spmd_mesh.SpmdMesh (that module builds on this one)

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_group is not None


@dataclass(frozen=True)
class PostForwardInfo:
    """The k ranks a group reshards to after forward (Note [reshard to k ranks]): their
    process group, this rank's position in it, and k."""

    group: dist.ProcessGroup
    rank: int
    size: int


_POST_FORWARD_GROUPS: dict[tuple, PostForwardInfo] = {}


def post_forward_info(info: MeshInfo, reshard_after_forward: bool | int | None,
                      ) -> tuple[bool | None, PostForwardInfo | None]:
    """Read ``fully_shard``'s ``reshard_after_forward``: ``None`` / ``True`` / ``False`` as they
    are; an int k dividing the shard size S reshards to k ranks (k = 1 is False, k = S True).

    Example (4 ranks, a 1-D mesh, rank 3)::

        >>> post_forward_info(mesh_info(mesh), 2)                 # doctest: +SKIP
        (True, PostForwardInfo(group=<ranks 2, 3>, rank=1, size=2))
    """
    k = reshard_after_forward
    if k is None or isinstance(k, bool):
        return k, None
    if not isinstance(k, int) or not 1 <= k <= info.shard_size or info.shard_size % k:
        raise ValueError(f"reshard_after_forward={k!r}: pass a bool, or an int that divides the "
                         f"shard group's size {info.shard_size} (the ranks to reshard to)")
    if k in (1, info.shard_size):
        return k == info.shard_size, None
    ranks = info.mesh.mesh
    key = (info.mesh.device_type, tuple(ranks.flatten().tolist()), k)
    if key not in _POST_FORWARD_GROUPS:  # new groups: every rank gets here in the same order
        sub = DeviceMesh(info.mesh.device_type, ranks.view(-1, k))
        _POST_FORWARD_GROUPS[key] = PostForwardInfo(sub.get_group(1), sub.get_local_rank(1), k)
    return True, _POST_FORWARD_GROUPS[key]


def mesh_info(mesh: DeviceMesh) -> MeshInfo:
    """Check ``mesh`` and name its groups: a 1-D mesh shards over all its ranks; a 2-D mesh
    replicates over dim 0 and shards over dim 1 (torch's rule). Anything else is refused.

    Example (a world of one)::

        >>> mesh_info(init_device_mesh("cpu", (1,))).placements     # doctest: +SKIP
        (Shard(dim=0),)
    """
    if mesh.ndim == 1:
        return MeshInfo(mesh, mesh.get_group(), mesh.get_local_rank(), mesh.size(), None, 1,
                        (Shard(0),))
    if mesh.ndim != 2:
        raise ValueError(
            f"fully_shard takes a 1-D DeviceMesh (FSDP) or a 2-D one (HSDP: "
            f"mesh_dim_names={HSDP_DIM_NAMES}), got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)}; minifsdp composes with no other parallelism (tensor, "
            "pipeline), so pass only the data-parallel dims")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"fully_shard on a 2-D mesh {tuple(mesh.shape)} is HSDP: dim 0 replicates and dim 1 "
            "shards. Name the dims to say so (torch requires names too): init_device_mesh("
            f"..., ({mesh.shape[0]}, {mesh.shape[1]}), mesh_dim_names={HSDP_DIM_NAMES})")
    if set(names) == set(HSDP_DIM_NAMES) and tuple(names) != HSDP_DIM_NAMES:
        raise ValueError(
            f"fully_shard: mesh_dim_names={tuple(names)}, but HSDP shards over dim 1 and "
            f"replicates over dim 0 (torch's rule); build the mesh as (R, S) with "
            f"mesh_dim_names={HSDP_DIM_NAMES}")
    return MeshInfo(mesh, mesh.get_group(1), mesh.get_local_rank(1), mesh.size(1),
                    mesh.get_group(0), mesh.size(0), (Replicate(), Shard(0)))
