"""Worker for tests/test_fsdp2.py: ``fully_shard([m1, m2])``, one group over several modules
(Note [several modules, one group] in minifsdp/fsdp2/fsdp_state.py), ours against torch's.
Run at N = 2 and N = 3; reports raw results, the test asserts on them.

Two nets, each sharded the same way by ours and torch's ``fully_shard`` and trained 3 steps
on the same batches (Adam): ``Pair``, whose first and last layers (``emb``, ``head``) form one
group by the list form, the blocks between them a group each and the root the rest (``norm``);
and ``Experts``, two sibling experts run on the same input (which needs a gradient, so the
first expert's input goes through the post-backward barrier) as one group. Uneven and empty
shards: ``emb`` has 10 rows (4, 4, 2 at N = 3), ``head`` 4 (2, 2, 0 at N = 3), each expert 7
(3, 3, 1). Each case reports the first divergence of losses, gradients and parameters at
every step (None: bit for bit) and every all-gather and reduce-scatter, ours (``comm``'s log)
and torch's (``torch_order.Recorder``), in issue order, named by group: ``"AG emb, head"``.
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from pair_model import Pair
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from minifsdp import comm, fsdp2, torch_order
from minifsdp.dist import dist_setup, finish
from minifsdp.parity import divergence_line

info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
STEPS, LOCAL = 3, 4
AT = f"N = {N}, rank {rank}"


def shard_pair(model: Pair, fs) -> nn.Module:
    for block in model.blocks:
        fs(block, mesh=mesh)
    fs([model.head, model.emb], mesh=mesh)  # listed in reverse: emb, run first, unshards
    return fs(model, mesh=mesh)


class Chunked(Pair):
    """``Pair`` whose forward stops before ``head``: the loss calls ``head`` itself on two
    halves of the batch (a chunked loss, torch's motivating case for the list form)."""

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.norm(h)


class Experts(nn.Module):
    """``(B, 8) -> (B, 4)``: ``inp`` (root), two experts on its output (one group), ``out``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.experts = nn.ModuleList([nn.Linear(16, 7), nn.Linear(16, 7)])
        self.out = nn.Linear(7, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(torch.tanh(self.experts[0](h)) * torch.sigmoid(self.experts[1](h)))


def shard_experts(model: Experts, fs) -> nn.Module:
    fs(list(model.experts), mesh=mesh)
    fs(model.out, mesh=mesh)
    return fs(model, mesh=mesh)


def make(cls):
    torch.manual_seed(0)
    return cls().to(info.device)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(N * LOCAL, 8, generator=g), torch.randint(0, 4, (N * LOCAL,), generator=g)
    return x.chunk(N)[rank].to(info.device), y.chunk(N)[rank].to(info.device)


def full(tensors: dict) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in tensors.items()}


SHORT = {"all_gather": "AG", "reduce_scatter": "RS"}


@contextlib.contextmanager
def collectives(theirs: bool):
    """The step's all-gathers and reduce-scatters in issue order, ``"AG <group>"``."""
    ops: list[str] = []
    if theirs:
        with torch_order.Recorder("fsdp2").record() as events:
            yield ops
        ops += [e.short for e in events if e.op in SHORT]
    else:
        with comm.logging_comm() as log:
            yield ops
        ops += [f"{SHORT[r.op]} {r.tag.split(' ', 2)[2]}" for r in log.comms()
                if r.op in SHORT]


def train(model: nn.Module, theirs: bool) -> dict:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses, grads, params, ops = [], [], [], []
    for step in range(STEPS):
        x, y = batch(step)
        with collectives(theirs) as step_ops:
            if isinstance(model, Chunked):
                h = model(x)
                loss = sum(F.cross_entropy(model.head(hc), yc, reduction="sum")
                           for hc, yc in zip(h.chunk(2), y.chunk(2))) / len(y)
            else:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
        ops.append(step_ops)
        losses.append(loss.detach().clone())
        grads.append(full({k: p.grad for k, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
        params.append(full(dict(model.named_parameters())))
    return {"losses": losses, "grads": grads, "params": params, "ops": ops}


def case(cls, shard_fn) -> dict:
    """Ours and torch's: the first divergence (losses, then gradients, then parameters, step
    by step; None if bit for bit), each one's collectives per step, and ours' sharing."""
    ours = shard_fn(make(cls), fsdp2.fully_shard)
    theirs = shard_fn(make(cls), torch_fully_shard)
    out = {"ours": train(ours, False), "torch": train(theirs, True)}
    first = None
    for step in range(STEPS):
        for what in ("losses", "grads", "params"):
            a, b = out["ours"][what][step], out["torch"][what][step]
            line = divergence_line({"loss": a} if what == "losses" else a,
                                   {"loss": b} if what == "losses" else b,
                                   names=("fsdp2", "torch"), where=f"{AT}, step {step} {what}")
            if line is not None and first is None:
                first = line
    groups = {}  # our groups: which modules share each, and this rank's rows of each parameter
    names = {p: k for k, p in ours.named_parameters()}
    for name, m in ours.named_modules():
        if isinstance(m, fsdp2.FSDPModule) and m.fsdp_state.group is not None:
            g = m.fsdp_state.group
            groups.setdefault(g.name, {"rows": {names[p.sharded_param]: p.sharded_param.to_local(
                ).shape[0] for p in g.fsdp_params}, "modules": []})["modules"].append(name)
    return {"first_divergence": first, "ops": {k: out[k]["ops"] for k in out},
            "groups": groups}


def errors() -> dict:
    """What ours raises, and what torch's raises, for misuse of the list form."""
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # the type and first line, both sides
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    for side, fs in (("ours", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        attempt(f"{side}_empty", lambda fs=fs: fs([], mesh=mesh))
        model = make(Pair)
        fs(model.blocks[0], mesh=mesh)
        attempt(f"{side}_already", lambda fs=fs, m=model: fs([m.emb, m.blocks[0]], mesh=mesh))
        attempt(f"{side}_twice", lambda fs=fs, m=model: fs([m.emb, m.emb], mesh=mesh))
        torch.manual_seed(0)  # a weight shared by a (own group) and b (in a list's group)
        tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)).to(info.device)
        tied[1].weight = tied[0].weight
        fs(tied[0], mesh=mesh)
        attempt(f"{side}_shared", lambda fs=fs, m=tied: (
            fs([m[1], m[2]], mesh=mesh), fs(m, mesh=mesh),
            m(torch.zeros(2, 4, device=info.device))))
        root = make(Pair)
        fs([root.emb, root.head], mesh=mesh)
        attempt(f"{side}_root", lambda root=root: root.head(torch.zeros(2, 10)))
    attempt("ours_not_a_module", lambda: fsdp2.fully_shard([make(Pair).emb, 3], mesh=mesh))
    return out


def returns() -> dict:
    """What the list form returns and does to the modules, ours and torch's."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    out = {}
    for side, fs, cls in (("ours", fsdp2.fully_shard, fsdp2.FSDPModule),
                          ("torch", torch_fully_shard, TorchFSDPModule)):
        model = make(Pair)
        listed = [model.emb, model.head]
        got = fs(listed, mesh=mesh)
        nested = make(Pair)
        nested_list = [nested, nested.emb]  # emb inside the other: covered by it
        fs(nested_list, mesh=mesh)
        out[side] = {"same_list": got is listed,
                     "swapped": [type(m).__name__ for m in listed],
                     "fsdp_modules": [isinstance(m, cls) for m in listed],
                     "nested_swapped": [isinstance(m, cls) for m in nested_list]}
    return out


out = {"rank": rank, "world_size": N,
       "pair": case(Pair, shard_pair), "experts": case(Experts, shard_experts),
       "chunked": case(Chunked, shard_pair),
       "errors": errors(), "returns": returns()}
finish(out)
