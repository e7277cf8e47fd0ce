"""Worker for tests/test_fsdp2.py: ``fully_shard(..., shard_placement_fn=...)`` (Note [Shard(i)
layout] in minifsdp/fsdp2/shard_placement.py), ours against torch's, at N = 2 and 3; at N = 4
only what needs 4 ranks: a 2 x 2 HSDP mesh, and ``reshard_after_forward=2`` (refused with
Shard(i); ZeRO++'s hpZ on dim 0, against torch and against ZeRO-3).

``Net`` mixes, in each of its two groups, parameters cut on dim 0 with ones cut on dim 1 and
on the last dim: stacked experts ``w_in (2, 8, 12)`` on Shard(-1) and ``w_out (2, 12, 8)`` on
Shard(1), ``out.weight (5, 6)`` on Shard(1) (12 and 6 divide evenly at N = 2 and 3, as torch
requires off dim 0), next to dim-0 parameters whose rows divide unevenly and leave empty
shards at N = 3 (``e_bias`` 2 rows: 1, 1, 0; ``gate`` 2: 1, 1, 0; ``out.bias`` 5: 2, 2, 1).
Reports raw results; the test asserts on them. Each comparison is the first divergence's line
(None: bit for bit).
"""

from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from minifsdp import comm, fsdp2
from minifsdp.dist import dist_setup, finish
from minifsdp.parity import divergence_line, max_abs_diff

info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
STEPS, LOCAL = 3, 4
AT = f"N = {N}, rank {rank}"


class Experts(nn.Module):
    """Two stacked experts: ``(B, 8) -> (B, 2, 8)``, one output per expert.

    (Parameters of its own and no submodule: torch's ``fully_shard`` puts a module's own
    parameters *after* its submodules' in the group, ours before -- a difference in the
    buffer's order, so in gloo's summation order at N = 3, that is not this worker's subject.)
    """

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(2, 8, 12) / 8 ** 0.5)
        self.e_bias = nn.Parameter(torch.randn(2, 1, 12) / 10)
        self.w_out = nn.Parameter(torch.randn(2, 12, 8) / 12 ** 0.5)

    def forward(self, x):
        h = torch.tanh(torch.einsum("bd,edh->beh", x, self.w_in) + self.e_bias.squeeze(1))
        return torch.einsum("beh,ehd->bed", h, self.w_out)


class Net(nn.Module):
    """``(B, 8) -> (B, 3)``. Units: ``experts``; the root keeps ``gate`` (mixing the experts
    by a softmax), ``mix``, ``out``, ``head``."""

    def __init__(self):
        super().__init__()
        self.experts, self.gate = Experts(), nn.Linear(8, 2)
        self.mix, self.out, self.head = nn.Linear(8, 6), nn.Linear(6, 5), nn.Linear(5, 3)

    def forward(self, x):
        mixed = (F.softmax(self.gate(x), dim=-1).unsqueeze(-1) * self.experts(x)).sum(1)
        h = torch.tanh(self.mix(x + mixed))
        return self.head(torch.tanh(self.out(h)))


def net() -> Net:
    torch.manual_seed(0)
    return Net().to(info.device)


def placement_fn(model: nn.Module):
    """Shard(-1) for ``w_in``, Shard(1) for ``w_out`` and ``out.weight``, None (Shard(0)) else."""
    chosen = {p: Shard(-1) if k.endswith("w_in") else Shard(1) for k, p in model.named_parameters()
              if k.endswith(("w_in", "w_out", "out.weight"))}
    return lambda p: chosen.get(p)


def shard(model: Net, fully_shard, mp: dict | None = None, on=None, dim0: bool = False,
          **kw) -> Net:
    """``experts``, then the root, each with ``placement_fn`` (``dim0``: without, so every
    parameter on dim 0), on ``on`` (default: the 1-D mesh); ``mp``: the fields of a
    ``MixedPrecisionPolicy``, in ours or torch's class."""
    fn = None if dim0 else placement_fn(model)
    if mp:
        cls = fsdp2.MixedPrecisionPolicy if fully_shard is fsdp2.fully_shard else TorchPolicy
        kw["mp_policy"] = cls(**mp)
    fully_shard(model.experts, mesh=on or mesh, shard_placement_fn=fn, **kw)
    return fully_shard(model, mesh=on or mesh, shard_placement_fn=fn, **kw)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one step, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(N * LOCAL, 8, generator=g), torch.randint(0, 3, (N * LOCAL,), generator=g)
    return x.to(info.device), y.to(info.device)


def local(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Each parameter's (or its gradient's) local tensor, as a copy."""
    return {k: (p.grad if grads else p).to_local().detach().clone()
            for k, p in model.named_parameters()}


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for k, p in model.named_parameters()}


def placements(model: nn.Module, grads: bool = False) -> dict[str, str]:
    return {k: str((p.grad if grads else p).placements) for k, p in model.named_parameters()}


def train(model: nn.Module, sharded: bool) -> dict:
    """STEPS Adam steps; sharded: this rank's rows, else every rank's batch as N micro-batches
    (each loss / N). Returns per step the losses, the gradients (sharded: local tensors) and
    the parameters after the step (sharded: local tensors), and the last gradients'
    placements."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = {"losses": [], "grads": [], "params": []}
    for step in range(STEPS):
        x, y = batch(step)
        if sharded:
            loss = F.cross_entropy(model(x.chunk(N)[rank]), y.chunk(N)[rank])
            loss.backward()
            out["losses"].append(loss.item())
            out["grads"].append(local(model, grads=True))
            out["grad_placements"] = placements(model, grads=True)
        else:
            for q in range(N):
                loss = F.cross_entropy(model(x.chunk(N)[q]), y.chunk(N)[q])
                (loss / N).backward()
                if q == rank:
                    out["losses"].append(loss.item())
        opt.step()
        opt.zero_grad()
        out["params"].append(local(model) if sharded else {})
    return out


def parity(**kw) -> dict:
    """Ours and torch's ``fully_shard`` with ``shard_placement_fn`` (and ``kw``), trained
    alike: the layouts at init, then losses, gradients and parameters step by step; and the
    full parameters, at init against the unsharded model and after training against a
    one-process run (fp32 only). Also ours' collectives over the 3 steps, counted by (op,
    group size), and (key ``_full``, not for JSON) ours' full parameters after training."""
    unsharded = net()
    init = {k: p.detach().clone() for k, p in unsharded.named_parameters()}
    ours, theirs = shard(net(), fsdp2.fully_shard, **kw), shard(net(), torch_fully_shard, **kw)
    layout = {name: {"local": local(m), "placements": placements(m),
                     "shapes": {k: list(p.shape) for k, p in m.named_parameters()}}
              for name, m in (("ours", ours), ("torch", theirs))}
    full_init = full(ours)
    with comm.logging_comm() as log:
        run = {"ours": train(ours, True)}
    run["torch"] = train(theirs, True)
    single = None if kw.get("mp") else train(unsharded, False)
    o, t = run["ours"], run["torch"]

    def line(a, b, names=("fsdp2", "torch")):
        return divergence_line(a, b, names=names, where=AT)

    out = {
        "placements": layout["ours"]["placements"],
        "placements_equal": layout["ours"]["placements"] == layout["torch"]["placements"],
        "shapes_equal": layout["ours"]["shapes"] == layout["torch"]["shapes"],
        "local_shapes": {k: list(v.shape) for k, v in layout["ours"]["local"].items()},
        "shapes": layout["ours"]["shapes"],
        "local_vs_torch": line(layout["ours"]["local"], layout["torch"]["local"]),
        "full_vs_unsharded": line(full_init, init, names=("full_tensor()", "unsharded")),
        "losses_vs_torch": line(o["losses"], t["losses"]),
        "grads_vs_torch": line(o["grads"], t["grads"]),
        "grad_placements_equal": o["grad_placements"] == t["grad_placements"],
        "grad_placements": o["grad_placements"],
        "params_vs_torch": line(o["params"], t["params"]),
        "full_vs_torch": line(full(ours), full(theirs)),
        "dtypes": sorted({str(v.dtype) for v in o["grads"][-1].values()}),
        "collectives": dict(Counter(f"{c.op} over {c.group_size}" for c in log.comms())),
        "_full": full(ours),
    }
    if single is not None:
        mine, torchs, ref = full(ours), full(theirs), full(unsharded)
        out.update({"vs_single": line(mine, ref, names=("fsdp2", "one process")),
                    "ours_vs_single": max_abs_diff(mine, ref),
                    "torch_vs_single": max_abs_diff(torchs, ref),
                    "losses_vs_single": line(o["losses"], single["losses"],
                                             names=("fsdp2", "one process"))})
    return out


def state_dicts() -> dict:
    """The sharded state dict's placements (ours == torch's); ``full_state_dict`` then
    ``load_full_state_dict`` into zeroed parameters gives the same bits back, and the
    sharded ``load_state_dict`` too."""
    ours, theirs = shard(net(), fsdp2.fully_shard), shard(net(), torch_fully_shard)
    sd = {k: str(v.placements) for k, v in ours.state_dict().items()}
    sd_torch = {k: str(v.placements) for k, v in theirs.state_dict().items()}
    saved = fsdp2.full_state_dict(ours)
    sharded = {k: v.detach().clone() for k, v in ours.state_dict().items()}
    with torch.no_grad():
        for p in ours.parameters():
            p.zero_()
    fsdp2.load_full_state_dict(ours, saved)
    after_full = fsdp2.full_state_dict(ours)
    with torch.no_grad():
        for p in ours.parameters():
            p.zero_()
    ours.load_state_dict(sharded)
    after_sharded = fsdp2.full_state_dict(ours)
    return {"placements_equal": sd == sd_torch, "placements": sd,
            "full_round_trip": divergence_line(after_full, saved, names=("loaded", "saved"),
                                               where=AT),
            "sharded_round_trip": divergence_line(after_sharded, saved,
                                                  names=("loaded", "saved"), where=AT)}


def errors() -> dict:
    """What ours and torch's refuse, each ``[type, first line]`` (None: accepted): dims > 0
    of 5 and 4 columns (uneven at N = 3, and with an empty shard; 4 is even at N = 2), a
    placement that is not Shard, a dim out of range, a dim > 0 of a 1-D parameter."""

    def attempt(fully_shard, fn, shape):
        torch.manual_seed(0)
        m = nn.Module()
        m.layer = nn.Module()
        m.layer.w = nn.Parameter(torch.randn(*shape))
        try:
            fully_shard(m, mesh=mesh, shard_placement_fn=fn)
            return None
        except Exception as e:
            return [type(e).__name__, str(e).splitlines()[0]]

    cases = {"columns_5": (lambda p: Shard(1), (6, 5)),  # 3, 2 at N = 2; 2, 2, 1 at N = 3
             "columns_4": (lambda p: Shard(-1), (6, 4)),  # 2, 2 at N = 2; 2, 2, 0 at N = 3
             "not_shard": (lambda p: Replicate(), (6, 6)),
             "dim_out_of_range": (lambda p: Shard(2), (6, 6)),
             "dim_too_negative": (lambda p: Shard(-3), (6, 6)),
             "dim_of_1d": (lambda p: Shard(1), (6,))}
    return {name: {"ours": attempt(fsdp2.fully_shard, fn, shape),
                   "torch": attempt(torch_fully_shard, fn, shape)}
            for name, (fn, shape) in cases.items()}


def reshard_to_k(k: int) -> dict:
    """``reshard_after_forward=k`` (1 < k < N) on ``Experts`` (Shard(-1), Shard(1)): ours
    refuses it in ``fully_shard``, naming the parameters; torch's accepts it and fails in
    backward. Each ``[where, type, first line]``, None if both steps ran."""
    out = {}
    for name, fs in (("ours", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        where = "fully_shard"
        try:
            torch.manual_seed(0)
            model = nn.Sequential(Experts()).to(info.device)
            fn = placement_fn(model)
            fs(model[0], mesh=mesh, shard_placement_fn=fn, reshard_after_forward=k)
            fs(model, mesh=mesh)
            where = "training"
            for step in range(2):
                model(batch(step)[0].chunk(N)[rank]).square().sum().backward()
            out[name] = None
        except Exception as e:
            out[name] = [where, type(e).__name__, str(e).splitlines()[0]]
    return out


def hpz(mp: dict | None = None) -> dict:
    """ZeRO++'s hpZ, ``reshard_after_forward=2`` at N = 4 on both groups, every parameter on
    dim 0, so Net's rows cut unevenly and leave empty shards (at N = 4: ``w_in``, ``e_bias``,
    ``w_out``, ``gate`` 2 rows -> 1, 1, 0, 0; ``mix`` 6 -> 2, 2, 2, 0; ``out`` 5 -> 2, 2, 1,
    0; ``head`` 3 -> 1, 1, 1, 0). ``parity`` with k = 2 and with ZeRO-3 (True), and the first
    divergence of the two's full parameters after training: an all-gather only copies, so
    hpZ == ZeRO-3."""
    k, zero3 = (parity(reshard_after_forward=r, dim0=True, mp=mp) for r in (2, True))
    k["vs_zero3"] = divergence_line(k.pop("_full"), zero3.pop("_full"),
                                    names=("hpZ", "ZeRO-3"), where=AT)
    k["zero3_collectives"] = zero3["collectives"]
    return k


def cases(**named: dict) -> dict:
    """Each case's result without its ``_full`` parameters (not JSON)."""
    return {name: {k: v for k, v in case.items() if k != "_full"} for name, case in named.items()}


if N == 4:  # HSDP (2 x 2) and reshard_after_forward=2: what needs 4 ranks
    hsdp = init_device_mesh(info.device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
    finish({"rank": rank, "world_size": N, "reshard_to_k": reshard_to_k(2),
            **cases(hsdp=parity(on=hsdp), hpz=hpz(),
                    hpz_bf16=hpz({"param_dtype": torch.bfloat16,
                                  "reduce_dtype": torch.bfloat16}))})
out = {
    "rank": rank, "world_size": N,
    **cases(fp32=parity(), no_reshard_after_forward=parity(reshard_after_forward=False),
            bf16=parity(mp={"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32})),
    "state_dict": state_dicts(),
    "errors": errors(),
}
finish(out)
