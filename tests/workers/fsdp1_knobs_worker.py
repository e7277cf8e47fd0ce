"""Worker for tests/test_fsdp1_knobs.py: FSDP1's knobs (mixed precision, backward and forward
prefetch, no_sync, clip_grad_norm_), each configuration next to torch FSDP1
(``use_orig_params=True``, ``device_id`` the CPU) on the same data, all in one launch.

Per configuration and step it records, on this rank: the loss (global mean), where the units'
local gradient shards and parameter shards first differ from torch's (``minifsdp.parity``'s
line, or None: ``vs_torch``), and the sequence of FSDP collectives with the start of each
unit's forward computation, ours and torch's. Reports raw facts; the test asserts on them.

    python -m torch.distributed.run --standalone --nproc-per-node 3 \
        tests/workers/fsdp1_knobs_worker.py
"""

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy, wrap

from minifsdp import comm, fsdp1, torch_order
from minifsdp.dist import dist_setup, finish
from minifsdp.memory import MemoryTracker
from minifsdp.parity import divergence_line

info = dist_setup()
rank, N = info.rank, info.world_size
STEPS, LOCAL, D_IN, CLASSES = 3, 4, 33, 10
BF16, FP32 = torch.bfloat16, torch.float32


class Block(nn.Module):
    """A unit of its own size (so the flat parameters pad differently), with a float buffer
    (for ``buffer_dtype``) and a LayerNorm."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc, self.norm = nn.Linear(d_in, d_out), nn.LayerNorm(d_out)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.fc(x))) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(Block(D_IN, 48), Block(48, 37), Block(37, 24))
        self.head = nn.Linear(24, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


FROZEN = ["blocks.0.fc.bias", "blocks.1.fc.weight", "blocks.1.norm.weight", "head.bias"]
# name -> options; every configuration runs FULL_SHARD unless it says otherwise
CASES = {
    "mp_bf16_fp32_reduce": dict(mp=(BF16, FP32, BF16)),
    "mp_bf16": dict(mp=(BF16, None, BF16), strategy="shard_grad_op"),
    "mp_reduce_bf16_only": dict(mp=(None, BF16, None)),
    "mp_no_shard": dict(mp=(BF16, FP32, BF16), strategy="no_shard"),
    "prefetch_none": dict(bp=None),
    "prefetch_backward_pre": dict(bp="backward_pre"),
    "prefetch_backward_post": dict(bp="backward_post"),
    "prefetch_forward": dict(bp=None, fp=True),
    "prefetch_pre_forward_shard_grad_op": dict(bp="backward_pre", fp=True,
                                               strategy="shard_grad_op"),
    "no_sync": dict(no_sync=True),
    "no_sync_shard_grad_op": dict(no_sync=True, strategy="shard_grad_op"),
    "no_sync_mp": dict(no_sync=True, mp=(BF16, FP32, BF16)),
    "clip_l2": dict(clip=(0.05, 2.0)),
    "clip_inf": dict(clip=(0.01, float("inf"))),
    "clip_no_shard": dict(clip=(0.05, 2.0), strategy="no_shard"),
    # frozen parameters inside units (and one in the root), clipped: the norm leaves them out
    "frozen": dict(frozen=FROZEN, clip=(0.05, 2.0)),
    "frozen_no_sync_shard_grad_op": dict(frozen=FROZEN, no_sync=True, strategy="shard_grad_op"),
    "frozen_whole_unit": dict(frozen=["blocks.2.fc.weight", "blocks.2.fc.bias",
                                      "blocks.2.norm.weight", "blocks.2.norm.bias"]),
}
TRACKED = ("prefetch_none", "prefetch_backward_pre", "prefetch_backward_post",
           "prefetch_forward", "no_sync", "mp_bf16_fp32_reduce", "mp_bf16")

# torch's collectives (minifsdp.torch_order) and, on the same timeline, ours and every unit's
# forward start: (what, unit) with what "all_gather", "reduce_scatter", "all_reduce", "forward"
TORCH = torch_order.Recorder("fsdp1")


def _record_ours() -> None:
    """Wrap minifsdp.comm's collectives: the unit is the first word of the tag."""
    for op, name in (("all_gather_into_tensor", "all_gather"),
                     ("reduce_scatter_tensor", "reduce_scatter"), ("all_reduce", "all_reduce")):
        fn = getattr(comm, op)

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            if kwargs.get("tag"):
                TORCH.mark(_name, kwargs["tag"].split(" ")[0])
            return _fn(*args, **kwargs)

        setattr(comm, op, wrapped)


_record_ours()


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's local batch of a step's micro-batch (the global batch is the same on every
    rank, cut in N)."""
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(N * LOCAL, D_IN, generator=g)
    y = torch.randint(0, CLASSES, (N * LOCAL,), generator=g)
    return x.chunk(N)[rank].to(info.device), y.chunk(N)[rank].to(info.device)


def global_mean(loss: torch.Tensor) -> float:
    t = loss.detach().float().clone()
    dist.all_reduce(t)
    return float(t / N)


def units_of(model: nn.Module, ours: bool) -> dict[str, torch.Tensor]:
    """unit name -> its FlatParameter (this rank's shard)."""
    if ours:
        return {u._name: u.flat_param for u in model._units if u._handle is not None}
    return {torch_order.fsdp1_unit_name(n): m._handle.flat_param for n, m in model.named_modules()
            if isinstance(m, TorchFSDP) and m._handle is not None}


def real(h) -> torch.Tensor:
    """Which elements of this rank's shard of handle ``h`` belong to a parameter: torch fills
    its alignment padding with 42s, ours holds zeros; neither is ever read."""
    start = h.rank * h.shard_numel if h.sharded else 0
    mask = torch.zeros(h.shard_numel, dtype=torch.bool)
    for i in h.infos:
        lo, hi = max(i.offset, start), min(i.offset + i.numel, start + h.shard_numel)
        if hi > lo:
            mask[lo - start:hi - start] = True
    return mask


def trainable(h) -> torch.Tensor:
    """``real(h)`` less the frozen parameters' elements (torch's flat gradient holds their
    reduced gradient, hidden from the optimizer; ours zeros: Note [frozen parameters])."""
    mask = real(h)
    for a, b in h.flat_param.frozen_slices:
        mask[a:b] = False
    return mask


def vs_torch(got: list[dict], want: list[dict], masks: dict[str, torch.Tensor],
             what: str) -> dict[str, str | None]:
    """Our per-step ``{unit: flat tensor}`` (``what``: "gradient" or "parameter") against
    torch's: ``"vs_torch"``, the first divergence on the elements ``masks`` keeps (Note [parity]
    in minifsdp/parity.py), and ``"padding"``, the first step and unit where our flat tensor
    holds a nonzero element beyond torch's numel, each a line or None. Our NO_SHARD flat tensor
    is padded to a multiple of N; torch 2.14's is too (the lengths agree here). Should torch's
    be shorter, ours is compared up to its length and the rest must be zeros."""
    trimmed, padding = [], None
    for step, ours in enumerate(got):
        theirs = want[step] if step < len(want) else {}
        cut = {}
        for unit, a in ours.items():
            b = theirs.get(unit)
            if a is not None and b is not None and a.numel() > b.numel():
                tail = a[b.numel():]
                if padding is None and tail.any():
                    i = b.numel() + int(tail.nonzero()[0, 0])
                    padding = (f"step {step}, rank {rank}, {unit}: our {what}'s padding beyond "
                               f"torch's {b.numel()} elements is not zero: [{i}] = "
                               f"{float(a[i])!r} ({int((tail != 0).sum())} nonzero)")
                a = a[:b.numel()]
            cut[unit] = a
        trimmed.append(cut)
    # the trimmed length is the same at every step: torch's flat tensor's
    cuts = {u: t.numel() for step in trimmed for u, t in step.items() if t is not None}
    kept = {u: m[:cuts.get(u, m.numel())] for u, m in masks.items()}
    return {"vs_torch": divergence_line(trimmed, want, where=f"rank {rank}", masks=kept),
            "padding": padding}


def wrap_pair(case: dict) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(0)
    base = Net()
    for name in case.get("frozen", ()):
        base.get_parameter(name).requires_grad_(False)
    strategy = case.get("strategy", "full_shard")
    mp = case.get("mp")
    bp = case.get("bp", "backward_pre")
    ours = fsdp1.FullyShardedDataParallel(
        copy.deepcopy(base), sharding_strategy=strategy, device_id=info.device,
        auto_wrap_policy=fsdp1.transformer_auto_wrap_policy({Block}),
        mixed_precision=fsdp1.MixedPrecision(*mp) if mp else None,
        backward_prefetch=fsdp1.BackwardPrefetch.parse(bp),
        forward_prefetch=case.get("fp", False))
    theirs = TorchFSDP(
        copy.deepcopy(base), device_id=info.device, use_orig_params=True,
        sharding_strategy=ShardingStrategy[strategy.upper()],
        auto_wrap_policy=functools.partial(wrap.transformer_auto_wrap_policy,
                                           transformer_layer_cls={Block}),
        mixed_precision=TorchMixedPrecision(*mp) if mp else None,
        backward_prefetch=TorchBackwardPrefetch[bp.upper()] if bp else None,
        forward_prefetch=case.get("fp", False))
    TORCH.watch(theirs)
    return base, ours, theirs


def mark_forwards(model: nn.Module, ours: bool) -> None:
    """Record the start of each unit's own computation (after its pre-forward logic)."""
    for n, m in model.named_modules():
        if isinstance(m, (fsdp1.FullyShardedDataParallel, TorchFSDP)):
            name = m._name if ours else torch_order.fsdp1_unit_name(n)
            inner = getattr(m, fsdp1.WRAPPED)
            inner.register_forward_pre_hook(
                lambda *_, _n=name: TORCH.mark("forward", _n))


def train(model: nn.Module, opt, case: dict, ours: bool, tracker_steps: bool = False) -> dict:
    losses, grads, params, norms, events = [], [], [], [], []
    peaks, peaks_but_other, peaks_params = [], [], []
    clip = case.get("clip")
    for step in range(STEPS):
        with TORCH.record() as recorded:
            tracker = MemoryTracker(model, opt) if tracker_steps else None
            if tracker is not None:
                tracker.__enter__()
            micro = 2 if case.get("no_sync") else 1
            parts = []
            for k in range(micro):
                x, y = batch(step, k)
                ctx = model.no_sync() if k < micro - 1 else _nothing()
                with ctx:
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                parts.append(global_mean(loss))
            losses.append(parts)
            if clip is not None:
                norms.append(float(model.clip_grad_norm_(*clip)))
            grads.append({n: p.grad.detach().clone() if p.grad is not None else None
                          for n, p in units_of(model, ours).items()})
            opt.step()
            opt.zero_grad(set_to_none=True)
            if tracker is not None:
                tracker.__exit__(None, None, None)
                # and without "other": gloo's reduce-scatter copy dies on its thread
                peaks.append(tracker.peak)
                peaks_but_other.append(max(s["total"] - s["other"] for s in tracker.timeline))
                peaks_params.append(max(s["params"] for s in tracker.timeline))
            params.append({n: p.detach().clone() for n, p in units_of(model, ours).items()})
        events.append([(e.op, e.group) for e in recorded])
    return dict(losses=losses, grads=grads, params=params, norms=norms, events=events,
                peaks=peaks, peaks_but_other=peaks_but_other, peaks_params=peaks_params)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def reference_norms(base: nn.Module, case: dict) -> list[float]:
    """One process: every rank's micro-batch, each loss / N, then torch.nn.utils'
    clip_grad_norm_ (Note [bitwise parity] in minifsdp/train.py)."""
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step)
        x = torch.randn(N * LOCAL, D_IN, generator=g)
        y = torch.randint(0, CLASSES, (N * LOCAL,), generator=g)
        for q in range(N):
            loss = F.cross_entropy(ref(x.chunk(N)[q]), y.chunk(N)[q])
            (loss / N).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), *case["clip"])))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def run_case(name: str, case: dict) -> dict:
    base, ours, theirs = wrap_pair(case)
    init = {n: p.detach().clone() for n, p in units_of(ours, True).items()}
    masks = {u._name: real(u._handle) for u in ours._units if u._handle is not None}
    grad_masks = {u._name: trainable(u._handle) for u in ours._units if u._handle is not None}
    frozen0 = {k: v.clone() for k, v in base.state_dict().items() if k in case.get("frozen", ())}
    mark_forwards(ours, True)
    mark_forwards(theirs, False)
    with comm.logging_comm() as log:
        got = train(ours, torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.1),
                    case, ours=True)
    want = train(theirs, torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1),
                 case, ours=False)
    out = {
        "losses": got["losses"], "torch_losses": want["losses"],
        # the first divergence from torch's on the parameters' (trainable) elements, or None
        "grads": vs_torch(got["grads"], want["grads"], grad_masks, "gradient"),
        "params": vs_torch(got["params"], want["params"], masks, "parameter"),
        "units": sorted(want["params"][0]), "our_units": sorted(got["params"][0]),
        "events": got["events"], "torch_events": want["events"],
        "norms": got["norms"], "torch_norms": want["norms"],
        "wire_bytes": {op: log.total_bytes(op, wire=True) for op in ("all_gather",
                                                                      "reduce_scatter")},
        # every unit's trainable elements on this rank (if it has any) moved
        "moved": min(float((got["params"][-1][n] - p)[grad_masks[n]].abs().max())
                     for n, p in init.items() if grad_masks[n].any()),
    }
    sd = fsdp1.full_state_dict(ours)
    out["state_dict_dtypes"] = sorted({str(v.dtype) for v in sd.values()})
    out["frozen_unchanged"] = [torch.equal(sd[k], v) for k, v in frozen0.items()]
    flats = units_of(ours, True)
    out["frozen_slices"] = sum(len(p.frozen_slices) for p in flats.values())
    out["frozen_grads_zero"] = all(not g[n][a:b].any() for g in got["grads"] for n in g
                                   if g[n] is not None for a, b in flats[n].frozen_slices)
    if "clip" in case:
        out["ref_norms"] = reference_norms(base, case)
    if name in TRACKED:  # memory of the second step (the optimizer state exists from step 1)
        _, ours2, _ = wrap_pair(case)
        tracked = train(ours2, torch.optim.AdamW(ours2.parameters(), lr=1e-2,
                                                      weight_decay=0.1), case, ours=True,
                             tracker_steps=True)
        for k in ("peaks", "peaks_but_other", "peaks_params"):
            out[k] = tracked[k]
        out["padded_bytes"] = {u._name: u._handle.padded_numel * 4 for u in ours2._units
                               if u._handle is not None}
    return out


finish({"rank": rank, "world_size": N,
        "cases": {name: run_case(name, case) for name, case in CASES.items()}})
