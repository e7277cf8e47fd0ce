"""Chapter 11's worker: problems FSDP2 users file, each reproduced and then fixed, with our
``fully_shard`` beside torch's. Run under torchrun at N = 2 (section 8: ``--hsdp`` at N = 4)::

    run = torchrun("minifsdp.demos.pitfalls", nproc=2, chapter="11")
    run.ranks[1]["unused"]["sends"]["experts"]   # {"params": ["experts.e.1.weight", ...], ...}
    hsdp = torchrun("minifsdp.demos.pitfalls", "--hsdp", nproc=4, chapter="11", name="hsdp")

Per rank it reports:

- ``unused`` (Note [unused parameters in a group]): a mixture-of-experts route, rank 0's
  tokens to expert 0 and the others' to expert 1. ``sends``: per group, the parameters (and
  elements) this rank's reduce-scatter would carry without ``set_reduce_scatter_unused_params``
  (read off one backward under ``set_requires_gradient_sync(False)``, so nothing is sent); then
  3 SGD steps without and with it, ours against torch's (the first divergence, None when
  bitwise) and against one process that routes every rank's rows (largest difference).
- ``tokens`` (Note [divide factor]): sequences whose numbers of real tokens differ per rank.
  The full parameters after 3 SGD steps under ``mean`` (each rank's mean over its own tokens,
  averaged by FSDP: a mean of means), ``global`` (the token sum over the global token count,
  with ``set_gradient_divide_factor(1.0)``) and ``one`` (one process, the mean over every
  token): the largest differences from ``one``, and ``global``'s ours against torch's.
- ``reset`` (``FSDPModule.reset_iter_state``): step 2's first forward raises inside
  ``narrow``; the retried step's collectives and its peak by category, with and without the
  reset, and for a step that never failed.
- ``forward_method`` (``register_fsdp_forward_method``): a ``generate`` that calls the
  root's layers itself, on ours and torch's, without registering it (the error each raises)
  and with (the tokens, against torch's and against one process's).
- ``tied``: an embedding and a head sharing one weight, the head sharded as a group of its
  own (where ours and torch's refuse it, and with what), then both in one group, the root's
  or their own (the list form ``fully_shard([emb, head])``, ``list_*``): 3 SGD steps against
  torch's and one process's, and whether the tie still holds.
- ``frozen`` (Note [frozen parameters' dtypes] in ``fsdp2/mixed_precision.py``): a pretrained
  embedding frozen at step 0 and trained from step 1, in the root's group with the trainable
  layers, under ``param_dtype=bf16, reduce_dtype=fp32``: per variant ("fp32 base", "bf16
  base", "eval first": the whole model frozen for its first forward), ours and torch's, each
  step's all-gather and reduce-scatter ``(op, dtype, input numel)``, the error a step raises,
  whether the frozen step left the embedding untouched, the parameters' first divergence from
  torch's; ``padded``: each parameter's padded numel.
- ``hsdp`` (``--hsdp``, a 2 x N/2 mesh): ``set_gradient_divide_factor`` with none, the world
  size and the shard size (``hsdp_factor``).
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from minifsdp import comm, fsdp2
from minifsdp.dist import dist_setup, finish, require_torch_api
from minifsdp.memory import MemoryTracker
from minifsdp.parity import divergence_line, max_abs_diff

# torch's methods this demo compares ours with (the notebook checks them before launching)
TORCH_API = ("set_reduce_scatter_unused_params", "set_gradient_divide_factor",
             "set_force_sum_reduction_for_comms", "reset_iter_state")
require_torch_api(TorchFSDPModule, TORCH_API, "minifsdp.demos.pitfalls (chapter 11)")
info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
IMPLS = {"ours": fsdp2.fully_shard, "torch": torch_fully_shard}
STEPS = 3


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.named_parameters()}


def each_fsdp_module(model: nn.Module):
    return [m for m in model.modules() if isinstance(m, (fsdp2.FSDPModule, TorchFSDPModule))]


# ---- 1. a parameter only some ranks use -------------------------------------------------------

class Experts(nn.Module):
    """Two experts of one shape, one group; the router sends every token of rank 0 to expert
    0 and of the other ranks to expert 1 (a stand-in for a learned top-1 route)."""

    def __init__(self):
        super().__init__()
        self.e = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)])

    def forward(self, h, route: int):
        return self.e[0 if route == 0 else 1](h)


class Routed(nn.Module):
    """``(B, 8) -> (B, 4)``: a layer, the experts (their own group), a head; ``route`` is the
    rank whose tokens these are."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.experts = Experts()
        self.head = nn.Linear(32, 4)

    def forward(self, x, route: int = rank):
        h = torch.tanh(self.inp(x))
        return self.head(h + self.experts(h, route))


def routed(fs=None) -> Routed:
    torch.manual_seed(0)
    model = Routed().to(info.device)
    if fs is not None:
        fs(model.experts, mesh=mesh)
        fs(model, mesh=mesh)
    return model


def routed_batch(step: int):
    """The global batch of a step: N x 4 rows, the same on every rank."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(N * 4, 8, generator=g), torch.randint(0, 4, (N * 4,), generator=g)


def train_routed(model, sharded: bool) -> dict[str, torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = routed_batch(step)
        for q in ([rank] if sharded else range(N)):  # one process: every rank's rows, routed
            loss = F.cross_entropy(model(x.chunk(N)[q], q), y.chunk(N)[q])
            (loss if sharded else loss / N).backward()
        opt.step()
        opt.zero_grad()
    return full(model)


def unused() -> dict:
    model = routed(fsdp2.fully_shard)
    model.set_requires_gradient_sync(False)  # gradients stay unsharded: nothing is sent
    x, y = routed_batch(0)
    F.cross_entropy(model(x.chunk(N)[rank]), y.chunk(N)[rank]).backward()
    sends = {}  # what this rank's reduce-scatters would carry: the parameters that got a grad
    names = {id(p): n for n, p in model.named_parameters()}  # the sharded DTensors, resharded
    for m in each_fsdp_module(model):
        group = m.fsdp_state.group
        got = [p for p in group.fsdp_params if p.unsharded_accumulated_grad is not None
               or p.unsharded_param.grad is not None]
        sends[group.name] = {"params": [names[id(p.sharded_param)] for p in got],
                             "numel": N * sum(p.padded_shard_numel for p in got)}
    one = train_routed(routed(), sharded=False)
    params = {}
    for flag in (False, True):
        for name, fs in IMPLS.items():
            model = routed(fs)
            for m in each_fsdp_module(model):
                m.set_reduce_scatter_unused_params(flag)
            params[flag, name] = train_routed(model, sharded=True)
    return {"sends": sends,
            "without_vs_one": max_abs_diff(params[False, "ours"], one),
            "with_vs_one": max_abs_diff(params[True, "ours"], one),
            "without_vs_torch": divergence_line(params[False, "ours"], params[False, "torch"],
                                                names=("fsdp2", "torch"), where=f"rank {rank}"),
            "with_vs_torch": divergence_line(params[True, "ours"], params[True, "torch"],
                                             names=("fsdp2", "torch"), where=f"rank {rank}")}


# ---- 2. a loss normalized per rank ------------------------------------------------------------

VOCAB, T = 32, 8
REAL = [8, 8] + [2, 1] * (N - 1)  # real tokens of each sequence: rank 0's two, then the others'


def tokens_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (2 sequences a rank), targets -100 past each sequence's real tokens."""
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randint(0, VOCAB, (len(REAL), T), generator=g)
    y = torch.randint(0, VOCAB, x.shape, generator=g)
    for i, n in enumerate(REAL):
        y[i, n:] = -100
    return x.to(info.device), y.to(info.device)


def lm(fs=None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, VOCAB))
    model = model.to(info.device)
    if fs is not None:
        fs(model[2], mesh=mesh)
        fs(model, mesh=mesh)
    return model


def ce_sum(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum",
                           ignore_index=-100)


def tokens() -> dict:
    params = {}
    for mode in ("mean", "global"):
        for name, fs in IMPLS.items():
            model = lm(fs)
            if mode == "global":  # the gradient is a sum: divide by nothing (Note [divide factor])
                for m in each_fsdp_module(model):
                    m.set_gradient_divide_factor(1.0)
                    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            for step in range(STEPS):
                x, y = tokens_batch(step)
                mine_x, mine_y = x.chunk(N)[rank], y.chunk(N)[rank]
                if mode == "mean":
                    loss = ce_sum(model, mine_x, mine_y) / (mine_y != -100).sum()
                else:
                    loss = ce_sum(model, mine_x, mine_y) / (y != -100).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
            params[mode, name] = full(model)
    model = lm()  # one process: the mean over every real token of the global batch
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        x, y = tokens_batch(step)
        (ce_sum(model, x, y) / (y != -100).sum()).backward()
        opt.step()
        opt.zero_grad()
    one = full(model)
    return {"real_tokens": [sum(REAL[2 * r: 2 * r + 2]) for r in range(N)],
            "mean_vs_one": max_abs_diff(params["mean", "ours"], one),
            "global_vs_one": max_abs_diff(params["global", "ours"], one),
            "global_vs_torch": divergence_line(params["global", "ours"],
                                               params["global", "torch"],
                                               names=("fsdp2", "torch"), where=f"rank {rank}"),
            "mean_vs_torch": divergence_line(params["mean", "ours"], params["mean", "torch"],
                                             names=("fsdp2", "torch"), where=f"rank {rank}")}


# ---- 3. an exception in the middle of a forward -----------------------------------------------

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 64)
        self.mid = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        self.narrow = nn.Linear(64, 64)
        self.head = nn.Linear(64, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.narrow(self.mid(torch.tanh(self.inp(x))))))


def reset() -> dict:
    out = {}
    for variant in ("clean", "reset", "no reset"):
        torch.manual_seed(0)
        model = Net().to(info.device)
        for unit in (model.mid, model.narrow, model):
            fsdp2.fully_shard(unit, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(300 + step)
            x, y = torch.randn(N * 4, 8, generator=g), torch.randint(0, 3, (N * 4,), generator=g)
            x, y = x.chunk(N)[rank].to(info.device), y.chunk(N)[rank].to(info.device)
            if step == 1 and variant != "clean":

                def boom(*_):
                    raise RuntimeError("a failure inside narrow's forward")

                handle = model.narrow.register_forward_pre_hook(boom)
                try:
                    model(x)
                except RuntimeError:
                    if variant == "reset":
                        model.reset_iter_state()
                handle.remove()
            tracker = MemoryTracker(model=model, optimizer=opt, device=info.device)
            with comm.logging_comm() as log, tracker:
                F.cross_entropy(model(x), y).backward()
            if step == 1:
                out[variant] = {
                    "ops": [f"{r.op} {r.tag.split()[-1]}" for r in log.records
                            if r.kind == "comm"],
                    "peak_but_other": max(s["total"] - s["other"]
                                          for s in tracker.to_dict()["timeline"]),
                    "grads_peak": max(s["grads"] for s in tracker.to_dict()["timeline"])}
            opt.step()
            opt.zero_grad()
    return out


# ---- 4. a method other than forward ------------------------------------------------------------

class Greedy(nn.Module):
    """A tiny language model whose ``generate`` calls its layers itself, not ``forward``."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x):
        return self.head(torch.tanh(self.body(self.emb(x))))

    @torch.no_grad()
    def generate(self, x, steps: int):
        for _ in range(steps):  # greedy: the most likely next token, one at a time
            h = torch.tanh(self.body(self.emb(x[:, -1:])))
            x = torch.cat([x, self.head(h).argmax(-1)], dim=1)
        return x


def greedy(fs=None, register=None) -> nn.Module:
    torch.manual_seed(0)
    model = Greedy().to(info.device)
    if fs is not None:
        fs(model.body, mesh=mesh)  # a nested group: its own __call__ runs its hooks
        fs(model, mesh=mesh)       # the root's group: emb and head
        register(model, "generate")
    return model


def forward_method() -> dict:
    """``generate`` on a sharded root, without and with ``register_fsdp_forward_method``:
    the error each raises, and the tokens against torch's and one process's."""
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    prompt = torch.arange(4 * N).view(2 * N, 2).chunk(N)[rank].to(info.device) % VOCAB
    out = {"errors": {}, "tokens": {}}
    for name, fs, reg in (("ours", fsdp2.fully_shard, fsdp2.register_fsdp_forward_method),
                          ("torch", torch_fully_shard, torch_register)):
        try:
            greedy(fs, lambda *_: None).generate(prompt, 6)
            out["errors"][name] = None
        except Exception as e:  # noqa: BLE001 -- what a user sees is the point
            out["errors"][name] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        out["tokens"][name] = greedy(fs, reg).generate(prompt, 6)
    one = greedy().generate(prompt, 6)
    return {"errors": out["errors"], "tokens": out["tokens"]["ours"].tolist(),
            "vs_torch": divergence_line(out["tokens"]["ours"], out["tokens"]["torch"],
                                        names=("fsdp2", "torch"), where=f"rank {rank}"),
            "vs_one": divergence_line(out["tokens"]["ours"], one,
                                      names=("fsdp2", "one process"), where=f"rank {rank}")}


# ---- 5. a weight tied across two groups -------------------------------------------------------

class Tied(nn.Module):
    """A tiny language model whose head shares the embedding's weight (tied embeddings)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.body = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.body(self.emb(x))))


def tied() -> dict:
    """The head as a group of its own (the tie split over two groups): where ours and torch's
    refuse it, and with what; then the two fixes, the tied modules in one group: the root's, or
    their own by the list form ``fully_shard([emb, head])``; 3 SGD steps each against torch's
    and one process's."""
    out = {"refused": {}}
    x, y = tokens_batch(0)
    x, y = x.chunk(N)[rank], y.chunk(N)[rank].clamp(min=0)
    for name, fs in IMPLS.items():
        torch.manual_seed(0)
        model, where = Tied().to(info.device), "fully_shard(model)"
        try:
            fs(model.head, mesh=mesh)
            fs(model, mesh=mesh)
            where = "the first forward and backward"
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            out["refused"][name] = None
        except ValueError as e:
            out["refused"][name] = {"where": where, "error": str(e).splitlines()[0]}
    params, tie = {}, {}
    runs = [*((f"{k} root", v) for k, v in IMPLS.items()),
            *((f"{k} list", v) for k, v in IMPLS.items()), ("one", None)]
    for name, fs in runs:
        torch.manual_seed(0)
        model = Tied().to(info.device)
        if fs is not None and name.endswith("list"):  # torch's advice: one group, two modules
            fs([model.emb, model.head], mesh=mesh)
            fs(model.body, mesh=mesh)
            fs(model, mesh=mesh)
        elif fs is not None:
            fs(model.body, mesh=mesh)
            fs(model, mesh=mesh)  # emb and head: one group (the root's), one parameter
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(STEPS):
            gx, gy = tokens_batch(step)
            gy = gy.clamp(min=0)  # every token counts here
            xs, ys = (gx, gy) if fs is None else (gx.chunk(N)[rank], gy.chunk(N)[rank])
            F.cross_entropy(model(xs).flatten(0, 1), ys.flatten()).backward()
            opt.step()
            opt.zero_grad()
        params[name] = full(model)
        tie[name] = model.head.weight is model.emb.weight
    return {**out, "tied": {k.removesuffix(" root"): v for k, v in tie.items()
                            if not k.endswith("list")},
            "list_tied": {k.removesuffix(" list"): v for k, v in tie.items() if k.endswith("list")},
            "vs_torch": divergence_line(params["ours root"], params["torch root"],
                                        names=("fsdp2", "torch"), where=f"rank {rank}"),
            "vs_one": max_abs_diff(params["ours root"], params["one"]),
            "list_vs_torch": divergence_line(params["ours list"], params["torch list"],
                                             names=("fsdp2", "torch"), where=f"rank {rank}"),
            "list_vs_one": max_abs_diff(params["ours list"], params["one"])}


# ---- 7. frozen parameters under a mixed-precision policy -----------------------------------

@contextlib.contextmanager
def torch_collectives():
    """``(op, dtype, numel)`` of each all-gather and reduce-scatter *input* that torch's
    ``fully_shard`` issues inside the block (torch 2.14.1 calls ``dist.all_gather_single`` and
    ``dist.reduce_scatter_single`` through the module; ours are logged by ``minifsdp.comm``)."""
    seen, saved = [], {}
    for name, op in (("all_gather_single", "all_gather"),
                     ("reduce_scatter_single", "reduce_scatter")):
        saved[name] = fn = getattr(dist, name)

        def wrapped(*args, _fn=fn, _op=op, **kwargs):
            x = args[1] if len(args) > 1 else kwargs.get("input_tensor", kwargs.get("input"))
            seen.append((_op, str(x.dtype).removeprefix("torch."), x.numel()))
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapped)
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def train_frozen(fs, policy_cls, variant: str) -> dict:
    """A tiny LM whose embedding is pretrained: frozen at step 0, trained from step 1 (a staged
    unfreezing), all of it in the root's group under ``param_dtype=bf16, reduce_dtype=fp32``.
    ``variant``: "fp32 base" (the embedding kept in fp32 like the rest), "bf16 base" (loaded in
    bf16), "eval first" (fp32; the whole model frozen for one forward before training)."""
    torch.manual_seed(0)
    model = Greedy().to(info.device)
    if variant == "bf16 base":
        model.emb.to(torch.bfloat16)
    model.emb.weight.requires_grad_(False)
    frozen_first = [p for p in model.parameters() if p.requires_grad]
    if variant != "eval first":
        frozen_first = []
    for p in frozen_first:
        p.requires_grad_(False)
    fs(model, mesh=mesh, mp_policy=policy_cls(param_dtype=torch.bfloat16,
                                              reduce_dtype=torch.float32))
    if frozen_first:  # the first forward sees no trainable parameter (pytorch#186998)
        model(tokens_batch(9)[0].chunk(N)[rank])
        model.reshard()  # the root keeps its parameters after a forward: back to the shards
        for name, p in model.named_parameters():
            p.requires_grad_(name != "emb.weight")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = {"ops": [], "error": None}
    emb0 = full(model)["emb.weight"]
    for step in range(STEPS):
        if step == 1:
            model.emb.weight.requires_grad_(True)  # the staged unfreezing
            out["emb_kept"] = torch.equal(full(model)["emb.weight"], emb0)  # after step 0
        x, y = tokens_batch(step)
        x, y = x.chunk(N)[rank], y.chunk(N)[rank].clamp(min=0)
        try:
            with comm.logging_comm() as log, torch_collectives() as theirs:
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        except RuntimeError as e:
            out["error"] = {"step": step, "error": str(e).splitlines()[0]}
            break
        out["ops"].append(theirs if fs is torch_fully_shard else [
            (r.op, r.dtype, r.bytes * 8 // torch.finfo(getattr(torch, r.dtype)).bits)
            for r in log.comms()])
        opt.step()
        opt.zero_grad()
    out["params"] = full(model)
    return out


def frozen() -> dict:
    """Section 7: each variant of ``train_frozen``, ours and torch's: the collectives of every
    step, where it fails, and the parameters after 3 steps against torch's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

    impls = {"ours": (fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy),
             "torch": (torch_fully_shard, TorchMixedPrecisionPolicy)}
    # the padded (dim-0 chunks of N) elements of each parameter: a group's collective sizes
    padded = {k: -(-v.shape[0] // N) * N * v[0].numel() for k, v in full(Greedy()).items()}
    out = {"padded": padded}
    for variant in ("fp32 base", "bf16 base", "eval first"):
        runs = {name: train_frozen(fs, mp, variant) for name, (fs, mp) in impls.items()}
        out[variant] = {
            "ops": {k: r["ops"] for k, r in runs.items()},
            "error": {k: r["error"] for k, r in runs.items()},
            "emb_kept": {k: r.get("emb_kept") for k, r in runs.items()},
            "vs_torch": divergence_line(runs["ours"]["params"], runs["torch"]["params"],
                                        names=("fsdp2", "torch"), where=f"rank {rank}")}
    return out


# ---- 8. HSDP's divide factor (run with --hsdp at N = 4) ------------------------------------

def hsdp_factor() -> dict:
    """Section 8, on a 2 x 2 mesh (replicate x shard): ``set_gradient_divide_factor`` with
    none, the world size R S and the shard size S (with ``set_force_sum_reduction_for_comms``:
    gloo has no PREMUL_SUM), ours and torch's; each rank's loss the mean over its own rows.
    Step 0's full gradients (ours): with R S, bitwise those of no factor? with S, bitwise R
    times them? Then 3 SGD steps: ours against torch's, against one process, and against
    our 1-D mesh of R S ranks with the same factor (pytorch#155903: the factor means the
    same on both meshes)."""
    R, S = 2, N // 2
    mesh2 = init_device_mesh(info.device.type, (R, S), mesh_dim_names=("replicate", "shard"))
    factors = {"none": None, "world": float(R * S), "shard": float(S)}

    def mlp(fs=None, on=None, factor=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                              nn.Linear(32, 4)).to(info.device)
        if fs is not None:
            fs(model[2], mesh=on)
            fs(model, mesh=on)
            if factor is not None:
                for m in each_fsdp_module(model):
                    m.set_gradient_divide_factor(factor)
                    m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        return model

    def train(model, sharded=True):
        opt, grads = torch.optim.SGD(model.parameters(), lr=0.1), None
        for step in range(STEPS):
            x, y = routed_batch(step)
            for q in ([rank] if sharded else range(N)):
                loss = F.cross_entropy(model(x.chunk(N)[q]), y.chunk(N)[q])
                (loss if sharded else loss / N).backward()
            if step == 0:
                grads = {k: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                         .clone() for k, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
        return grads, full(model)

    runs = {(f, name): train(mlp(fs, mesh2, factor))
            for f, factor in factors.items() for name, fs in IMPLS.items()}
    one = train(mlp(), sharded=False)[1]
    flat = train(mlp(fsdp2.fully_shard, mesh, factors["world"]))[1]  # 1-D, N ranks
    g = {f: runs[f, "ours"][0] for f in factors}
    return {"R": R, "S": S,
            "world_is_none": all(torch.equal(g["world"][k], g["none"][k]) for k in g["none"]),
            "shard_is_R_world": all(torch.equal(g["shard"][k], R * g["world"][k])
                                    for k in g["world"]),
            "vs_torch": {f: divergence_line(runs[f, "ours"][1], runs[f, "torch"][1],
                                            names=("fsdp2", "torch"), where=f"rank {rank}")
                         for f in factors},
            "vs_one": {f: max_abs_diff(runs[f, "ours"][1], one) for f in factors},
            "flat_vs_hsdp": max_abs_diff(flat, runs["world", "ours"][1])}


def mismatched_reduce_scatter() -> None:
    """``--mismatch``: what Section 1's experts of different sizes would do -- one reduce-scatter
    whose input is 8 elements on rank 0 and 12 on the others. No backend supports it; this job
    is expected to fail (the chapter reads how)."""
    n = 8 if rank == 0 else 12
    comm.reduce_scatter_tensor(torch.empty(n // N), torch.ones(n))


if "--mismatch" in sys.argv:
    mismatched_reduce_scatter()
    finish({"rank": rank, "returned": True})  # reached only if the backend let it through
elif "--hsdp" in sys.argv:
    if N % 2:
        raise SystemExit(f"minifsdp.demos.pitfalls --hsdp: a 2 x (N / 2) mesh needs an even N, "
                         f"got N = {N} (run it at N = 4)")
    finish({"rank": rank, "world_size": N, "hsdp": hsdp_factor()})
else:
    finish({"rank": rank, "world_size": N, "unused": unused(), "tokens": tokens(),
            "reset": reset(), "forward_method": forward_method(), "tied": tied(),
            "frozen": frozen()})
