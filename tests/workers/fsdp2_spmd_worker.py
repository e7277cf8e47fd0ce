"""Worker for tests/test_fsdp2.py: ``fully_shard(..., dp_mesh_dims=...)`` (Note [an SPMD mesh]
in minifsdp/fsdp2/spmd_mesh.py), ours against torch's, on a model whose parameters are already
DTensors on the full mesh.

``Net`` (``(B, 8) -> (B, 3)``) is tensor-parallel on the mesh's ``tp`` dim: ``fc1`` column-
parallel (weight and bias ``Shard(0)``), ``fc2`` row-parallel (weight ``Shard(1)``, bias
``Replicate()``), ``gate`` and ``head`` replicated; on every data-parallel dim ``Replicate()``.
Its rows cut unevenly over the DP ranks and leave empty shards: ``gate.weight`` (1, 8) is one
row (1, 0 at DP = 2; 1, 0, 0 at 3), ``head`` 3 rows, ``fc2`` 5, ``fc1`` 6 (3 per tp rank at
tp = 2). Units: ``fc1``, then the root.

Meshes (``CASES``): N = 2 and 3, ``(dp, tp)`` with tp = 1 (the layout code runs, no TP
traffic); N = 4: ``(dp, tp) = (2, 2)`` (real tensor parallelism: ``fc1``'s sharded placement
is ``_StridedShard`` on dp), ``(rep, dp, tp) = (2, 2, 1)`` with ``replicate="rep"`` (HSDP),
and ``(dp, cp, tp) = (2, 2, 1)`` with ``shard=("dp", "cp")`` (two dims flattened into one
group of 4), and (dp, tp) = (2, 2) again with bf16 parameters reduced in fp32. ``ddp``
(N = 2 and 4): ``replicate="dp"`` alone, torch's DDP mode. The batch is
split over all DP ranks (a DTensor ``Shard(0)`` on each DP dim); each rank's loss is its own
rows' cross-entropy, as in data parallelism.

Per case: the sharded placements and local shapes at init; over 3 Adam steps the losses, the
sharded gradients' local tensors and the parameters' local tensors after each step, ours
against torch's; the full parameters after training against torch's and against one process
(the plain model on every DP rank's rows, each loss / D; fp32 cases); ``full_state_dict`` ->
``load_full_state_dict`` round trip; and what each refuses. Each comparison is the first
divergence's line (None: bit for bit).
"""


import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from minifsdp import fsdp2
from minifsdp.dist import dist_setup, finish
from minifsdp.parity import divergence_line, max_abs_diff

info = dist_setup()
rank, N = info.rank, info.world_size
STEPS, LOCAL, LR = 3, 2, 1e-2
AT = f"N = {N}, rank {rank}"
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
# name: (mesh shape, mesh dim names, dp_mesh_dims fields, MixedPrecisionPolicy fields)
CASES = {
    2: {"dp_tp": ((2, 1), ("dp", "tp"), {"shard": "dp"}, None),
        "ddp": ((2, 1), ("dp", "tp"), {"replicate": "dp"}, None)},
    3: {"dp_tp": ((3, 1), ("dp", "tp"), {"shard": "dp"}, None)},
    4: {"dp_tp": ((2, 2), ("dp", "tp"), {"shard": "dp"}, None),
        "dp_tp_bf16": ((2, 2), ("dp", "tp"), {"shard": "dp"}, BF16),
        "ddp": ((2, 2), ("dp", "tp"), {"replicate": "dp"}, None),
        "hsdp": ((2, 2, 1), ("rep", "dp", "tp"), {"shard": "dp", "replicate": "rep"}, None),
        "flattened": ((2, 2, 1), ("dp", "cp", "tp"), {"shard": ("dp", "cp")}, None)},
}[N]
TP_PLACEMENT = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1)}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.gate = nn.Linear(8, 6), nn.Linear(8, 1)
        self.fc2, self.head = nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.fc1(x)) * torch.sigmoid(self.gate(x))
        return self.head(torch.tanh(self.fc2(h)))


def dp_names(names: tuple[str, ...]) -> list[str]:
    return [n for n in names if n != "tp"]


def plain_net() -> Net:
    torch.manual_seed(0)
    return Net().to(info.device)


def distributed_net(mesh) -> Net:
    """``Net`` with every parameter a DTensor on ``mesh``: its TP placement on ``tp``,
    ``Replicate()`` on the DP dims (each rank cuts its own piece: no communication)."""
    model = plain_net()
    for path, p in list(model.named_parameters()):
        module, name = model.get_submodule(path.rsplit(".", 1)[0]), path.rsplit(".", 1)[1]
        places = [TP_PLACEMENT.get(path, Replicate()) if n == "tp" else Replicate()
                  for n in mesh.mesh_dim_names]
        setattr(module, name, nn.Parameter(distribute_tensor(p.detach(), mesh, places,
                                                             src_data_rank=None)))
    return model


def shard(model: Net, fully_shard, mesh, dims, mp: dict | None = None) -> Net:
    kw = {}
    if mp:
        cls = fsdp2.MixedPrecisionPolicy if fully_shard is fsdp2.fully_shard else TorchPolicy
        kw["mp_policy"] = cls(**mp)
    fully_shard(model.fc1, mesh=mesh, dp_mesh_dims=dims, **kw)
    return fully_shard(model, mesh=mesh, dp_mesh_dims=dims, **kw)


def dp_index(mesh) -> tuple[int, int]:
    """This rank's index among the DP ranks (row-major over the DP dims) and their count."""
    idx, size = 0, 1
    for n in dp_names(mesh.mesh_dim_names):
        idx, size = idx * mesh.size(mesh.mesh_dim_names.index(n)) + mesh.get_local_rank(n), \
            size * mesh.size(mesh.mesh_dim_names.index(n))
    return idx, size


def batch(step: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(d * LOCAL, 8, generator=g), torch.randint(0, 3, (d * LOCAL,), generator=g)
    return x.to(info.device), y.to(info.device)


def local(model, grads: bool = False) -> dict[str, torch.Tensor]:
    return {k: (p.grad if grads else p).to_local().detach().clone()
            for k, p in model.named_parameters()}


def full(model) -> dict[str, torch.Tensor]:
    return {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for k, p in model.named_parameters()}


def train(model, mesh=None, d: int = 1) -> dict:
    """STEPS Adam steps; with ``mesh``: this DP rank's rows as a DTensor, else (one process)
    every one of the ``d`` DP ranks' rows as a micro-batch, each loss / d."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = {"losses": [], "grads": [], "params": []}
    d_idx, d = dp_index(mesh) if mesh is not None else (0, d)
    for step in range(STEPS):
        x, y = batch(step, d)
        if mesh is not None:
            places = [Replicate() if n == "tp" else Shard(0) for n in mesh.mesh_dim_names]
            xd = DTensor.from_local(x.chunk(d)[d_idx], mesh, places)
            out_places = [Replicate() if n == "tp" else Shard(0) for n in mesh.mesh_dim_names]
            logits = model(xd).redistribute(placements=out_places).to_local()
            loss = F.cross_entropy(logits, y.chunk(d)[d_idx])
            loss.backward()
            out["losses"].append(loss.item())
            out["grads"].append(local(model, grads=True))
            out["params"].append(local(model))
            out["grad_placements"] = {n: str(p.grad.placements)
                                      for n, p in model.named_parameters()}
        else:
            for q in range(d):
                (F.cross_entropy(model(x.chunk(d)[q]), y.chunk(d)[q]) / d).backward()
        opt.step()
        opt.zero_grad()
    return out


MESHES: dict[tuple, object] = {}


def named_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """One mesh object per layout. dp_mesh_dims checks that a parameter's mesh *is* the one
    passed (torch's check, by identity), and a second mesh equal to the first is not safe: a
    DTensor made on it may come back on the first (DTensor caches its sharding decisions by
    equal meshes), as this worker saw for ``distribute_tensor`` with ``Shard`` placements."""
    if (shape, names) not in MESHES:
        MESHES[shape, names] = init_device_mesh(info.device.type, shape, mesh_dim_names=names)
    return MESHES[shape, names]


def parity(shape, names, dims_kw, mp) -> dict:
    mesh = named_mesh(shape, names)
    ours = shard(distributed_net(mesh), fsdp2.fully_shard, mesh,
                 fsdp2.DataParallelMeshDims(**dims_kw), mp)
    theirs = shard(distributed_net(mesh), torch_fully_shard, mesh, TorchDims(**dims_kw), mp)
    layout = {k: {"placements": {n: str(p.placements) for n, p in m.named_parameters()},
                  "local_shapes": {n: list(p.to_local().shape) for n, p in m.named_parameters()},
                  "local": local(m)}
              for k, m in (("ours", ours), ("torch", theirs))}
    full_init = full(ours)
    o, t = train(ours, mesh), train(theirs, mesh)
    single = plain_net()
    init = full(single)
    train(single, d=dp_index(mesh)[1])

    def line(a, b, names=("fsdp2", "torch")):
        return divergence_line(a, b, names=names, where=AT)

    saved = fsdp2.full_state_dict(ours)
    with torch.no_grad():
        for p in ours.parameters():
            p.to_local().zero_()
    fsdp2.load_full_state_dict(ours, saved)
    return {
        "dp_size": dp_index(mesh)[1],
        "placements": layout["ours"]["placements"],
        "placements_equal": layout["ours"]["placements"] == layout["torch"]["placements"],
        "local_shapes": layout["ours"]["local_shapes"],
        "local_vs_torch": line(layout["ours"]["local"], layout["torch"]["local"]),
        "full_vs_unsharded": line(full_init, init, names=("full_tensor()", "unsharded")),
        "losses_vs_torch": line(o["losses"], t["losses"]),
        "grads_vs_torch": line(o["grads"], t["grads"]),
        "grad_placements_equal": o["grad_placements"] == t["grad_placements"],
        "grad_placements": o["grad_placements"],
        "params_vs_torch": line(o["params"], t["params"]),
        "full_vs_torch": line(saved, full(theirs)),
        "ours_vs_single": max_abs_diff(saved, full(single)),
        "torch_vs_single": max_abs_diff(full(theirs), full(single)),
        "round_trip": line(fsdp2.full_state_dict(ours), saved, names=("loaded", "saved")),
    }


def errors() -> dict:
    """What ours and torch's refuse, each ``[type, first line]`` (None: accepted)."""
    mesh = named_mesh((N, 1), ("dp", "tp"))

    def attempt(fully_shard, dims_cls, make, **kw):
        try:
            fully_shard(make(), mesh=kw.pop("mesh", mesh), **kw)
            return None
        except Exception as e:
            return [type(e).__name__, str(e).splitlines()[0]]

    def sharded_on_dp():
        m = nn.Linear(4, N)
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0),
                                                                            Replicate()]))
        return m

    def on_other_mesh():
        other = named_mesh((1, N), ("dp", "tp"))  # not equal to mesh: its own object
        m = nn.Linear(4, 2)
        m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), other,
                                                  [Replicate(), Replicate()]))
        return m

    replicated = lambda: distributed_net(mesh).fc2  # noqa: E731
    cases = {
        "plain_param": (lambda: nn.Linear(4, 2), {"shard": "dp"}, {}),
        "sharded_on_dp": (sharded_on_dp, {"shard": "dp"}, {}),
        "other_mesh": (on_other_mesh, {"shard": "dp"}, {}),
        "unknown_name": (replicated, {"shard": "data"}, {}),
        "int_reshard": (replicated, {"shard": "dp"}, {"reshard_after_forward": 1}),
    }
    out = {"no_dims": {}}
    for impl, cls in (("ours", fsdp2.DataParallelMeshDims), ("torch", TorchDims)):
        try:
            cls()
            out["no_dims"][impl] = None
        except Exception as e:
            out["no_dims"][impl] = [type(e).__name__, str(e).splitlines()[0]]
    for name, (make, dims_kw, kw) in cases.items():
        out[name] = {
            impl: attempt(fs, cls, make, dp_mesh_dims=cls(**dims_kw), **dict(kw))
            for impl, fs, cls in (("ours", fsdp2.fully_shard, fsdp2.DataParallelMeshDims),
                                  ("torch", torch_fully_shard, TorchDims))}
    # a DTensor parameter without dp_mesh_dims: torch takes it as TP on another mesh; ours
    # refuses, naming the way in
    out["dtensor_without_dims"] = {"ours": attempt(fsdp2.fully_shard, None, replicated,
                                                   mesh=mesh["dp"])}
    return out


results = {"rank": rank, "world_size": N}
for case, (shape, names, dims_kw, mp) in CASES.items():
    results[case] = parity(shape, names, dims_kw, mp)
results["errors"] = errors()
finish(results)
