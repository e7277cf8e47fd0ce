"""Worker for tests/test_fsdp2.py: ``minifsdp.fsdp2`` on what ``minifsdp.train`` does not reach.
Run at N = 2 and N = 3; reports raw numbers, the test asserts on them.

Each training case trains the same small net three ways on the same batches: with our
``fully_shard``, with torch's ``fully_shard`` (same units, same options) and as one plain
process that runs the N ranks' local batches as micro-batches (each loss / N, gradients
accumulated: Note [bitwise parity] in minifsdp/train.py). The net mixes what FSDP2 must
handle: a unit whose *first* layer is frozen (its weight is still needed for the input's
gradient after every trainable parameter of the unit is done), parameters with fewer rows
than ranks (empty shards: ``narrow`` has 2 rows, ``scale`` 1 element), uneven rows, and a
parameter that is never used (its group's post-backward runs in the end-of-backward
callback). Further cases: meta-device init of the tied-embedding GPT, state dicts, errors.
"""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from minifsdp import comm, fsdp2, zeropp
from minifsdp.dist import dist_setup, finish
from minifsdp.gpucheck import offload_moves
from minifsdp.models import GPT, GPTConfig
from minifsdp.parity import divergence_line, max_abs_diff

info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
STEPS, LOCAL = 3, 4
AT = f"N = {N}, rank {rank}"  # where a divergence is (Note [parity] in minifsdp/parity.py)


class Net(nn.Module):
    """``(B, 8) -> (B, 3)``. Units: ``mid`` (frozen Linear, then a trainable one) and
    ``narrow`` (2 rows); the root keeps ``inp``, ``head``, ``scale`` and ``unused``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.narrow = nn.Linear(16, 2)
        self.head = nn.Linear(2, 3)
        self.scale = nn.Parameter(torch.ones(1))
        self.unused = nn.Linear(3, 3)
        self.mid[0].requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.narrow(self.mid(torch.tanh(self.inp(x)))))) * self.scale


def net() -> Net:
    torch.manual_seed(0)
    return Net().to(info.device)


def shard(model: nn.Module, fully_shard, **kw) -> nn.Module:
    fully_shard(model.mid, mesh=mesh, **kw)
    fully_shard(model.narrow, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-step, the same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x, y = torch.randn(N * LOCAL, 8, generator=g), torch.randint(0, 3, (N * LOCAL,), generator=g)
    return x.to(info.device), y.to(info.device)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.named_parameters()}


def train(model, opt, sharded: bool, micro: int = 1, no_sync: bool = False,
          clip: float | None = None, keep_unsharded: bool = False,
          ) -> tuple[list[float], list[float], dict[str, bool]]:
    """STEPS steps; sharded: this rank's rows, else every rank's as micro-batches. Returns
    the losses, the clipped norms and which parameters had a gradient at the last step."""
    losses, norms = [], []
    for step in range(STEPS):
        for m in range(micro):
            x, y = batch(step, m)
            if sharded:
                last = m == micro - 1
                if no_sync:  # sync only on the step's last micro-batch
                    model.set_requires_gradient_sync(last)
                if keep_unsharded:  # no all-gather before the next micro-batch's forward
                    model.set_reshard_after_backward(last)
                loss = F.cross_entropy(model(x.chunk(N)[rank]), y.chunk(N)[rank])
                (loss / micro).backward()
                losses.append(loss.item())
            else:
                for q in range(N):
                    loss = F.cross_entropy(model(x.chunk(N)[q]), y.chunk(N)[q])
                    (loss / (N * micro)).backward()
                    if q == rank:
                        losses.append(loss.item())
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
        has_grad = {k: p.grad is not None for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    return losses, norms, has_grad


def run_case(kw: dict, micro: int = 1, no_sync: bool = False, clip: float | None = None,
             keep_unsharded: bool = False):
    out = {}
    models = {"ours": shard(net(), fsdp2.fully_shard, **kw),
              "torch": shard(net(), torch_fully_shard, **kw), "single": net()}
    init = full_params(models["single"])
    for name, model in models.items():
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        with comm.logging_comm() as log:
            losses, norms, has_grad = train(model, opt, name != "single", micro, no_sync, clip,
                                            keep_unsharded)
        out[name] = {"losses": losses, "norms": norms, "params": full_params(model),
                     "has_grad": has_grad}
        if name == "ours":
            out["comm"] = {op: s["calls"] for op, s in log.summary().items()}
    ours, theirs, single = (out[k]["params"] for k in ("ours", "torch", "single"))
    moved = {k: float((single[k] - init[k]).abs().max()) for k in init}
    return {  # a divergence: the first difference's line, None if bit for bit
        "vs_torch": divergence_line(ours, theirs, names=("fsdp2", "torch"), where=AT),
        "vs_single": divergence_line(ours, single, names=("fsdp2", "one process"), where=AT),
        "ours_vs_single": max_abs_diff(ours, single),
        "torch_vs_single": max_abs_diff(theirs, single),
        "losses": {k: out[k]["losses"] for k in models},
        "norms": {k: out[k]["norms"] for k in models},
        "has_grad": {k: out[k]["has_grad"] for k in models}, "moved": moved,
        "comm": out["comm"],
    }


def local_shapes() -> dict:
    model = shard(net(), fsdp2.fully_shard)
    return {k: [list(p.to_local().shape), list(p.shape), str(p.placements)]
            for k, p in model.named_parameters()}


def gpt(device=None) -> GPT:
    torch.manual_seed(0)
    with torch.device(device or info.device):
        return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32,
                             tie_embeddings=True))


def shard_gpt(model: GPT) -> GPT:
    for block in model.blocks:
        fsdp2.fully_shard(block, mesh=mesh)
    return fsdp2.fully_shard(model, mesh=mesh)


def train_gpt(model: GPT) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randint(0, 64, (N * LOCAL, 16), generator=g).chunk(N)[rank]
                for _ in range(2))
        loss = F.cross_entropy(model(x.to(info.device)).flatten(0, 1), y.to(info.device).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def whole_unit_checkpointing() -> dict:
    """``checkpoint(block, x)`` around each ``fully_shard``-ed block: the recomputation calls
    ``Block.__call__`` inside backward, so the group's forward hooks run there (Note
    [recomputed in backward] in minifsdp/fsdp2/fsdp_state.py). Ours without checkpointing,
    with it, with it and early stopping off (the recomputation then reaches the post-forward
    hook), and torch's with it; each with its collectives' order (ours only)."""
    import types

    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    def forward(self, idx):  # GPT.forward, each block under checkpoint
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln_f(x))

    out = {}
    for name, fully_shard, ac, early_stop in (("ours", fsdp2.fully_shard, False, True),
                                              ("ours_ac", fsdp2.fully_shard, True, True),
                                              ("ours_ac_no_early_stop", fsdp2.fully_shard, True,
                                               False),
                                              ("torch_ac", torch_fully_shard, True, True)):
        model = gpt()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if ac:
            model.forward = types.MethodType(forward, model)
        with comm.logging_comm() as log, set_checkpoint_early_stop(early_stop):
            losses = train_gpt(model)
        ops = [f"{r.op} {r.tag.split()[-1]}" for r in log.records if r.kind == "comm"]
        out[name] = {"losses": losses, "params": full_params(model), "ops": ops}
    ref = out["ours"]["params"]
    return {name: {"losses": o["losses"], "ops": o["ops"],
                   "vs_ours": divergence_line(o["params"], ref, names=(name, "ours"), where=AT)}
            for name, o in out.items()}


def meta_init() -> dict:
    """(a) meta -> shard -> to_empty -> load a seeded full model's weights: must train exactly
    like the same model sharded straight away. (b) ... -> init_weights(): deterministic
    values exact, random ones with GPT-2's std."""
    full = gpt().state_dict()
    direct = shard_gpt(gpt())
    with torch.device("meta"):
        meta = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32,
                             tie_embeddings=True))
    shard_gpt(meta)
    on_meta = all(p.is_meta for p in meta.parameters())
    meta.to_empty(device=info.device)
    fsdp2.load_full_state_dict(meta, full)
    tied = meta.head.weight is meta.tok_emb.weight
    losses = {"direct": train_gpt(direct), "meta": train_gpt(meta)}
    a, b = fsdp2.full_state_dict(direct), fsdp2.full_state_dict(meta)
    with torch.device("meta"):
        fresh = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32))
    shard_gpt(fresh)
    fresh.to_empty(device=info.device)
    fresh.init_weights()  # on the DTensor shards
    sd = fsdp2.full_state_dict(fresh)
    train_gpt(fresh)  # trains (its local tensors were re-padded before the first all-gather)
    return {
        "on_meta": on_meta, "tied": tied, "losses": losses,
        "vs_direct": divergence_line(b, a, names=("meta init", "direct"), where=AT),
        "ln_ones": all(bool((v == 1).all()) for k, v in sd.items() if ".ln" in k and "weight" in k),
        "bias_zeros": all(bool((v == 0).all()) for k, v in sd.items() if k.endswith("bias")),
        "emb_std": float(sd["tok_emb.weight"].std()),
        "finite_after_training": all(bool(p.full_tensor().isfinite().all())
                                     for p in fresh.parameters()),
    }


def state_dicts() -> dict:
    model = shard(net(), fsdp2.fully_shard)
    train(model, torch.optim.Adam(model.parameters(), lr=1e-2), sharded=True)
    model(batch(0, 0)[0].chunk(N)[rank])  # an extra forward: the root stays unsharded
    with comm.logging_comm() as log, CommDebugMode() as debug:
        sd = model.state_dict()
    counts = (len(log.comms()), debug.get_total_counts())
    with CommDebugMode() as debug:
        full = fsdp2.full_state_dict(model)
    full_counts = debug.get_total_counts()
    saved = {k: v.detach().clone() for k, v in full.items()}
    sharded = {k: v.detach().clone() for k, v in sd.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    fsdp2.load_full_state_dict(model, saved)
    after_full = fsdp2.full_state_dict(model)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(sharded)
    after_sharded = fsdp2.full_state_dict(model)
    # the loaded values must reach the all-gather: one more step, compared with a copy
    model2 = shard(net(), fsdp2.fully_shard)
    fsdp2.load_full_state_dict(model2, saved)
    for m in (model, model2):
        train(m, torch.optim.SGD(m.parameters(), lr=0.1), sharded=True)
    return {
        "comm_during_state_dict": counts, "comm_during_full": full_counts,
        "all_dtensor": all(isinstance(v, DTensor) for v in sd.values()),
        "local_numel": sum(v.to_local().numel() for v in sd.values()),
        "full_numel": sum(v.numel() for v in full.values()),
        "full_plain": all(type(v) is torch.Tensor for v in full.values()),
        # each the first difference's line, None if bit for bit
        "full_round_trip": divergence_line(after_full, saved, names=("loaded", "saved"),
                                           where=AT),
        "sharded_round_trip": divergence_line(after_sharded, saved, names=("loaded", "saved"),
                                              where=AT),
        "trained_unlike": divergence_line(full_params(model), full_params(model2),
                                          names=("reloaded", "fresh model"), where=AT),
    }


class Branchy(nn.Module):
    """``(B, 8) -> (B, 3)`` whose ``expert`` only rank 0 runs (a mixture-of-experts route):
    Note [unused parameters in a group]. The expert's bottleneck has 2 rows, so at N = 3 its
    first layer's shards are 1, 1 and 0 rows: the unused parameter has an empty shard."""

    def __init__(self):
        super().__init__()
        self.inp, self.head = nn.Linear(8, 16), nn.Linear(16, 3)
        self.expert = nn.Sequential(nn.Linear(16, 2), nn.Tanh(), nn.Linear(2, 16))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.head(h + self.expert(h) if rank == 0 else h)


def branchy() -> Branchy:
    torch.manual_seed(0)
    return Branchy().to(info.device)


def reduction_case(configure, make=net, shard_fn=shard) -> dict:
    """Ours and torch's ``fully_shard`` with ``configure(m)`` called on every FSDPModule:
    the first divergence (None: bitwise) and each one's error, if one raised."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    out = {}
    for name, fs in (("ours", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = shard_fn(make(), fs)
        for m in model.modules():
            if isinstance(m, (fsdp2.FSDPModule, TorchFSDPModule)):
                configure(m)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # Adam would hide a gradient's scale
        try:
            losses = train(model, opt, True)[0]
            out[name] = {"losses": losses, "params": full_params(model)}
        except RuntimeError as e:
            out[name] = {"error": str(e).splitlines()[0][:200]}
    both = all("params" in out[k] for k in ("ours", "torch"))
    return {"errors": {k: out[k].get("error") for k in out},
            "vs_torch": divergence_line(out["ours"]["params"], out["torch"]["params"],
                                        names=("fsdp2", "torch"), where=AT) if both else "n/a",
            "losses_equal": both and out["ours"]["losses"] == out["torch"]["losses"],
            "params": out["ours"].get("params")}


def reduction_options() -> dict:
    """``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms`` (Note [divide
    factor]) and ``set_reduce_scatter_unused_params`` (Note [unused parameters in a group]), ours
    against torch's."""
    cases = {
        "default": reduction_case(lambda m: None),
        "factor_n": reduction_case(lambda m: m.set_gradient_divide_factor(float(N))),
        "force_sum": reduction_case(lambda m: m.set_force_sum_reduction_for_comms(True)),
        "hook_force_sum": reduction_case(lambda m: (  # an add: before the post-division?
            m.set_force_sum_reduction_for_comms(True),
            m.set_all_reduce_hook(lambda g: g.add_(0.1)))),
        "factor_2.5_force_sum": reduction_case(lambda m: (
            m.set_gradient_divide_factor(2.5), m.set_force_sum_reduction_for_comms(True))),
        "factor_2.5_premul": reduction_case(lambda m: m.set_gradient_divide_factor(2.5)),
        "all_reduce_hook": reduction_case(lambda m: m.set_all_reduce_hook(lambda g: g.mul_(0.75))),
        "unused_reduced": reduction_case(lambda m: m.set_reduce_scatter_unused_params(True),
                                         make=branchy, shard_fn=lambda m, fs: fs(m, mesh=mesh)),
        # ZeRO++'s qgZ (Note [qgZ]) as a custom reduce-scatter on Net's uneven and empty shards
        "qgz_int4": reduction_case(lambda m: m.set_custom_reduce_scatter(
            zeropp.QuantizedReduceScatter(bits=4))),
        "qgz_int8": reduction_case(lambda m: m.set_custom_reduce_scatter(
            zeropp.QuantizedReduceScatter(bits=8))),
    }
    default = cases["default"]["params"]
    for name, case in cases.items():  # did the option change anything? (max |ours - default|)
        p = case.pop("params")
        case["off_default"] = max_abs_diff(p, default) if p and name != "unused_reduced" else None
    return cases


def qwz() -> dict:
    """ZeRO++'s qwZ (Note [qwZ]: int8 codes and fp32 block scales in the all-gather), ours and
    torch's ``fully_shard`` driving the same hooks, 3 Adam steps in bf16 compute. qwZ needs dim
    0 divisible by N, so the model is one whose rows (12, 6) divide over 2 and 3 ranks."""
    from minifsdp.demos.zeropp import torch_qwz  # QuantizedWeight's hooks on torch's

    out = {}
    for name, fs, policy, quantize in (
            ("ours", fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy, zeropp.enable_qwz),
            ("torch", torch_fully_shard, TorchMixedPrecisionPolicy, torch_qwz),
            ("ours_bf16", fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy, lambda m: None)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 6)).to(info.device)
        quantize(model)
        kw = {"mesh": mesh, "mp_policy": policy(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32)}
        fs(model[0], **kw)
        fs(model, **kw)
        losses = train(model, torch.optim.Adam(model.parameters(), lr=1e-2), True)[0]
        # this rank's shards as plain fp32 tensors (full_tensor would gather the subclass)
        out[name] = {"losses": losses, "params": {
            k: torch.Tensor(v.to_local().detach()).float().clone()
            for k, v in model.named_parameters()}}
    return {"vs_torch": divergence_line(out["ours"]["params"], out["torch"]["params"],
                                        names=("fsdp2", "torch"), where=AT),
            "losses_equal": out["ours"]["losses"] == out["torch"]["losses"],
            "off_bf16": max_abs_diff(out["ours"]["params"], out["ours_bf16"]["params"])}


def ignored_params() -> dict:
    """``fully_shard(..., ignored_params={scale})`` on the root, ours and torch's: ``scale``
    stays a plain parameter whose gradient each rank keeps (so it differs across ranks), the
    rest trains as without it; ours == torch's bit for bit on every rank."""
    out = {}
    for name, fs in (("ours", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = net()
        fs(model.mid, mesh=mesh)
        fs(model.narrow, mesh=mesh)
        fs(model, mesh=mesh, ignored_params={model.scale})
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = train(model, opt, True)[0]
        out[name] = {"losses": losses, "params": full_params(model),
                     "scale_type": type(model.scale).__name__}
    ours, theirs = out["ours"], out["torch"]
    return {"vs_torch": divergence_line(ours["params"], theirs["params"], names=("fsdp2", "torch"),
                                        where=AT),
            "losses_equal": ours["losses"] == theirs["losses"],
            "scale_type": [ours["scale_type"], theirs["scale_type"]],
            "scale": float(ours["params"]["scale"])}


def reset_after_exception() -> dict:
    """Step 2's first forward raises inside ``narrow`` (after ``mid`` is gathered) on every
    rank; ``reset_iter_state()`` on the root, ``zero_grad``, and step 2 runs again. Ours and
    torch's train to the same bits, and ours as an uninterrupted run. Also: calling it on a
    non-root module is refused by both."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    out = {}
    for name, fs, interrupt in (("ours", fsdp2.fully_shard, True),
                                ("torch", torch_fully_shard, True),
                                ("clean", fsdp2.fully_shard, False)):
        model = shard(net(), fs)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        fail = {"left": 1 if interrupt else 0}

        def boom(*_, fail=fail):
            if fail["left"]:
                fail["left"] -= 1
                raise RuntimeError("injected failure in narrow's forward")

        losses, ops = [], []
        for step in range(STEPS):
            x, y = batch(step, 0)
            x, y = x.chunk(N)[rank], y.chunk(N)[rank]
            if step == 1 and interrupt:  # the cut forward, then the recovery
                handle = model.narrow.register_forward_pre_hook(boom)
                try:
                    model(x)
                except RuntimeError:
                    model.reset_iter_state()
                    opt.zero_grad()
                handle.remove()
            with comm.logging_comm() as log:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            if step == 1:  # the retried (or uninterrupted) step's collectives, in order
                ops = [f"{r.op} {r.tag.split()[-1]}" for r in log.records if r.kind == "comm"]
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        try:
            model.mid.reset_iter_state()
            non_root = None
        except RuntimeError as e:
            non_root = str(e)
        assert isinstance(model, (fsdp2.FSDPModule, TorchFSDPModule))
        out[name] = {"losses": losses, "params": full_params(model), "non_root": non_root,
                     "failed": fail["left"] == 0 and interrupt, "ops": ops}
    return {"vs_torch": divergence_line(out["ours"]["params"], out["torch"]["params"],
                                        names=("fsdp2", "torch"), where=AT),
            "vs_clean": divergence_line(out["ours"]["params"], out["clean"]["params"],
                                        names=("fsdp2 reset", "fsdp2 uninterrupted"), where=AT),
            "losses_equal": out["ours"]["losses"] == out["torch"]["losses"]
            == out["clean"]["losses"],
            "failed": [out[k]["failed"] for k in ("ours", "torch")],
            "ops": {k: out[k]["ops"] for k in ("ours", "clean")},
            "non_root": [out[k]["non_root"] for k in ("ours", "torch")]}


@contextlib.contextmanager
def recording_collectives():
    """Record ``(op, input numel)`` of every all-gather and reduce-scatter, ours (through
    ``minifsdp.comm``) and torch's ``fully_shard`` (``dist.*_single``) alike, in call order:
    the numel tells the groups apart."""
    names = {"all_gather_single": "all_gather", "reduce_scatter_single": "reduce_scatter",
             "_all_gather_single": "all_gather", "_reduce_scatter_single": "reduce_scatter"}
    ops, saved = [], []
    for module in (dist, comm):
        for attr, op in names.items():
            if hasattr(module, attr):
                orig = getattr(module, attr)

                def record(*a, _orig=orig, _op=op, **k):  # torch passes keywords
                    inp = a[1] if len(a) > 1 else k.get("input", k.get("input_tensor"))
                    ops.append(f"{_op} {inp.numel()}")
                    return _orig(*a, **k)

                saved.append((module, attr, orig))
                setattr(module, attr, record)
    try:
        yield ops
    finally:
        for module, attr, orig in saved:
            setattr(module, attr, orig)


def option_case(make, shard_fn, configure, micro: int = 1) -> dict:
    """Ours and torch's ``fully_shard`` with ``configure(model, micro_index, micro)`` before
    each micro-batch's forward, and ours without it (``configure=None``): the divergence
    from torch (None: bitwise), whether the losses are equal, and each one's collectives
    (``recording_collectives``) over the whole training."""
    out = {}
    for name, fs, conf in (("ours", fsdp2.fully_shard, configure),
                           ("torch", torch_fully_shard, configure),
                           ("ours_default", fsdp2.fully_shard, None)):
        model = shard_fn(make(), fs)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        with recording_collectives() as ops:
            for step in range(STEPS):
                for m in range(micro):
                    x, y = batch(step, m)
                    if conf is not None:
                        conf(model, m, micro)
                    loss = F.cross_entropy(model(x.chunk(N)[rank]), y.chunk(N)[rank])
                    (loss / micro).backward()
                    losses.append(loss.item())
                opt.step()
                opt.zero_grad()
        out[name] = {"losses": losses, "params": full_params(model), "ops": list(ops)}
    ours, theirs = out["ours"], out["torch"]
    return {"vs_torch": divergence_line(ours["params"], theirs["params"],
                                        names=("fsdp2", "torch"), where=AT),
            "vs_default": divergence_line(ours["params"], out["ours_default"]["params"],
                                          names=("fsdp2", "fsdp2 default"), where=AT),
            "losses_equal": ours["losses"] == theirs["losses"],
            "ops": {k: out[k]["ops"] for k in out}}


class Chain(nn.Module):
    """``(B, 8) -> (B, 3)``: three ``Linear`` units under a root with no parameters of its own,
    so the last group of a forward is a block that its backward reshards. The middle one has 2
    rows: an empty shard at N = 3."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2), nn.Tanh(),
                                    nn.Linear(2, 3))

    def forward(self, x):
        return self.layers(x)


class Embedder(nn.Module):
    """``(B, 8) -> (B, 3)`` through an embedding of the first feature's bucket: the input (token
    ids) needs no gradient, so the embedding's backward does not read its weight. ``mid`` has 2
    rows: an empty shard at N = 3."""

    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(10, 16), nn.Linear(16, 2), nn.Linear(2, 3)

    def forward(self, x):
        ids = (x[:, 0] * 3).floor().clamp(-5, 4).long() + 5
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def seeded(cls):
    def make():
        torch.manual_seed(0)
        return cls().to(info.device)
    return make


def shard_chain(model, fs):
    for i in (0, 2, 4):
        fs(model.layers[i], mesh=mesh)
    return fs(model, mesh=mesh)


def shard_embedder(model, fs):
    fs(model.emb, mesh=mesh)
    fs(model.mid, mesh=mesh)
    return fs(model, mesh=mesh)


def backward_options() -> dict:
    """``set_is_last_backward`` (Note [not the last backward]) over 3 micro-batches a step
    and ``set_unshard_in_backward(False)`` on the embedding (Note [no all-gather in
    backward]), ours against torch's; and a non-bool refused by ours."""
    errors = {}
    model = shard_embedder(seeded(Embedder)(), fsdp2.fully_shard)
    for method in ("set_is_last_backward", "set_unshard_in_backward"):
        try:
            getattr(model, method)(1)
        except TypeError as e:
            errors[method] = str(e)
    return {
        "is_last_backward": option_case(
            seeded(Chain), shard_chain,
            lambda m, i, micro: m.set_is_last_backward(i == micro - 1), micro=3),
        "unshard_in_backward": option_case(
            seeded(Embedder), shard_embedder,
            lambda m, i, micro: m.emb.set_unshard_in_backward(False)),
        "errors": errors,
    }


class Scorer(Embedder):
    """``Embedder`` whose entry point is ``score``, not ``forward`` (a ``generate``-like method
    that calls the layers itself). ``forward`` raises, so nothing can reach it by accident."""

    def forward(self, x):
        raise RuntimeError("Scorer: call score(), not forward()")

    def score(self, x):
        return Embedder.forward(self, x)


def forward_method() -> dict:
    """``register_fsdp_forward_method(root, "score")`` (Note [forward methods]), ours and
    torch's, against ours trained through ``forward`` (``Embedder``): 3 Adam steps through the
    method, then its output under ``no_grad``. Registered, a method is a forward: the same bits
    as torch's and as ``forward``'s, and the same collectives as ``forward``'s."""
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    out = {}
    for name, fs, reg, cls in (("ours", fsdp2.fully_shard, fsdp2.register_fsdp_forward_method,
                                Scorer),
                               ("torch", torch_fully_shard, torch_register, Scorer),
                               ("ours_forward", fsdp2.fully_shard, None, Embedder)):
        model = shard_embedder(seeded(cls)(), fs)
        if reg is not None:
            reg(model, "score")  # replaces the bound method: look it up after this
        call = model.__call__ if reg is None else model.score
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        with recording_collectives() as ops:
            for step in range(STEPS):
                x, y = batch(step, 0)
                loss = F.cross_entropy(call(x.chunk(N)[rank]), y.chunk(N)[rank])
                loss.backward()
                losses.append(loss.item())
                opt.step()
                opt.zero_grad()
            with torch.no_grad():
                evaluated = call(batch(STEPS, 0)[0].chunk(N)[rank])
        out[name] = {"losses": losses, "params": full_params(model), "ops": list(ops),
                     "eval": evaluated}
    ours = out["ours"]
    return {k: {"params": divergence_line(ours["params"], out[k]["params"],
                                          names=("fsdp2", k), where=AT),
                "eval": divergence_line(ours["eval"], out[k]["eval"], names=("fsdp2", k),
                                        where=f"{AT}, no_grad output"),
                "losses_equal": ours["losses"] == out[k]["losses"],
                "ops_equal": ours["ops"] == out[k]["ops"]}
            for k in ("torch", "ours_forward")}


@contextlib.contextmanager
def recording_moves():
    """Record every ``Tensor.to(..., non_blocking=...)`` as ``(kind, numel, itemsize)``: the
    CPU offload's moves, ours (``FSDPParam.all_gather_input`` / ``grad_to_host``) and torch's
    (``FSDPParam.all_gather_inputs`` / ``foreach_reduce``) alike -- both pass ``non_blocking``
    by keyword, which nothing else in a step does (the run without offload records none).
    ``non_blocking=True``: the shard to the device ("h2d"); ``False``: an unpinned gradient to
    the host ("d2h"). On a CPU mesh ``.to("cpu")`` copies nothing, but the call is made."""
    moves, orig = [], torch.Tensor.to

    def to(self, *a, **k):
        if "non_blocking" in k:
            moves.append(("h2d" if k["non_blocking"] else "d2h", self.numel(),
                          self.element_size()))
        return orig(self, *a, **k)

    torch.Tensor.to = to
    try:
        yield moves
    finally:
        torch.Tensor.to = orig


def offload() -> dict:
    """``offload_policy=CPUOffloadPolicy(pin_memory=False)`` (Note [FSDP2 CPU offload]) on
    ``Net`` (uneven and empty shards, a frozen layer, an unused parameter), ours and torch's,
    and ours without offload, 3 Adam steps: losses, sharded gradients (each rank's rows) and
    parameters; the collectives; where the shards, gradients and Adam's state live; each
    step's moves (``recording_moves``, sorted: ours reduce-scatters the root's group earlier,
    Note [when is a group's backward over?]) and what Note [FSDP2 CPU offload] predicts."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy

    out = {}
    for name, fs, policy in (
            ("ours", fsdp2.fully_shard, fsdp2.CPUOffloadPolicy(pin_memory=False)),
            ("torch", torch_fully_shard, TorchCPUOffloadPolicy(pin_memory=False)),
            ("ours_default", fsdp2.fully_shard, fsdp2.OffloadPolicy())):
        model = shard(net(), fs, offload_policy=policy)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, grads, moves, predicted, devices = [], [], [], [], set()
        with recording_collectives() as ops:
            for step in range(STEPS):
                x, y = batch(step, 0)
                with recording_moves() as m:
                    loss = F.cross_entropy(model(x.chunk(N)[rank]), y.chunk(N)[rank])
                    loss.backward()
                moves.append(sorted(m))
                losses.append(loss.item())
                named = dict(model.named_parameters())
                grads.append({k: p.grad.to_local().clone() for k, p in named.items()
                              if p.grad is not None})
                devices |= {f"grad {p.grad.to_local().device.type}" for p in named.values()
                            if p.grad is not None}
                if name == "ours":  # the Note's prediction from our groups
                    predicted.append(offload_moves(model))
                opt.step()
                opt.zero_grad()
        devices |= {f"param {p.to_local().device.type}" for p in model.parameters()}
        devices |= {f"adam {t.device.type}" for st in opt.state.values() for t in st.values()}
        if name == "ours":  # the padded shards themselves, not only the DTensors' views
            devices |= {f"padded shard {p.padded_shard().device.type}"
                        for mod in model.modules() if isinstance(mod, fsdp2.FSDPModule)
                        for p in mod.fsdp_state.group.fsdp_params}
        out[name] = {"losses": losses, "grads": grads, "params": full_params(model),
                     "ops": list(ops), "moves": moves, "devices": sorted(devices),
                     "predicted": predicted}
    ours, theirs = out["ours"], out["torch"]
    return {"vs_torch": {k: divergence_line(ours[k], theirs[k], names=("fsdp2", "torch"),
                                            where=f"{AT}, {k}")
                         for k in ("losses", "grads", "params")},
            "vs_default": divergence_line(ours["params"], out["ours_default"]["params"],
                                          names=("fsdp2 offload", "fsdp2"), where=AT),
            "ops": {k: out[k]["ops"] for k in out},
            "moves": {k: out[k]["moves"] for k in out},
            "predicted": ours["predicted"],
            "devices": {k: out[k]["devices"] for k in out}}


def errors() -> dict:
    out = {}
    model = shard(net(), fsdp2.fully_shard)
    try:
        fsdp2.fully_shard(model.mid, mesh=mesh)
    except ValueError as e:
        out["twice"] = str(e)
    tied = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)}).to(info.device)
    tied["b"].weight = tied["a"].weight
    fsdp2.fully_shard(tied["b"], mesh=mesh)  # shards the weight in b; a still holds it
    try:
        fsdp2.fully_shard(tied, mesh=mesh)
    except ValueError as e:
        out["shared"] = str(e)
    return out


out = {
    "rank": rank, "world_size": N,
    "cases": {
        "basic": run_case({}),
        "no_reshard_after_forward": run_case({"reshard_after_forward": False}),
        "accumulate": run_case({}, micro=2),
        "accumulate_no_sync": run_case({}, micro=2, no_sync=True),
        "accumulate_no_sync_no_reshard": run_case({}, micro=2, no_sync=True,
                                                  keep_unsharded=True),
        "clip": run_case({}, clip=0.05),
    },
    "local_shapes": local_shapes(),
    "meta": meta_init(),
    "whole_unit_checkpointing": whole_unit_checkpointing(),
    "state_dict": state_dicts(),
    "errors": errors(),
    "reduction_options": reduction_options(),
    "ignored_params": ignored_params(),
    "reset_after_exception": reset_after_exception(),
    "backward_options": backward_options(),
    "forward_method": forward_method(),
    "qwz": qwz(),
    "offload": offload(),
}
finish(out)
