"""Chapter 04's worker for FSDP1's knobs: every configuration the section shows, in one job::

    run = torchrun("minifsdp.demos.fsdp1_knobs", nproc=2, chapter="04")
    run.ranks[0]["configs"]["bf16"]["wire"]   # {"all_gather": bytes, "reduce_scatter": bytes}

A 4-block GPT (d_model 128, Psi = 0.86 M), each ``Block`` a unit, FULL_SHARD, AdamW, two
steps on the same batches in every configuration. Each configuration turns one knob of
``minifsdp.fsdp1.FullyShardedDataParallel`` away from the plain setting (``backward_prefetch=
None``, fp32, every parameter trained), runs the same steps under torch's FSDP1 (``device_id`` this
rank's device, ``use_orig_params=True``) and reports per rank, for its second step (AdamW's state
exists by then):

- ``events``: ours and torch's collectives in the order they were issued, with each unit's
  forward start between them (``("AG" | "RS" | "F", unit)``; ours also has its comm-log tag);
- ``wire`` / ``payload`` / ``dtypes``: our comm log's bytes per operation (Note [bytes vs wire
  bytes] in ``minifsdp.comm``) and the dtypes they moved in;
- ``memory``: ``MemoryTracker``'s peak, its categories, the largest ``params`` / ``grads`` /
  ``comm`` bytes over the step and what is left at its end;
- ``bitwise_torch``: the full parameters after both steps equal torch FSDP1's bit for bit, and
  ``vs_torch``: where they first differ (Note [parity] in ``minifsdp/parity.py``), or None;
  ``losses``; for ``clip``, ``norm_bitwise_torch`` and ``norm_vs_torch`` the same of the total
  norm.

Some configurations add their own measurement: ``accumulate`` and ``no_sync`` the bytes of
gradients held after the first of two micro-batches, ``frozen`` whether the frozen parameters
moved, ``clip`` the total norm (ours, torch's, and one process's over the whole batch).
``fsdp2_*``: our ``fully_shard`` on the same model and knob (mixed precision, frozen
parameters), for the bytes beside FSDP1's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import BackwardPrefetch as TorchBP
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from minifsdp import comm, fsdp1, fsdp2, torch_order
from minifsdp.dist import dist_setup, finish
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPT, Block, GPTConfig
from minifsdp.parity import divergence_line
from minifsdp.torch_order import SHORT
from minifsdp.train import loss_fn, use_foreach

CFG = GPTConfig(vocab_size=256, seq_len=32, n_layer=4, n_head=4, d_model=128)
LOCAL, STEPS, MAX_NORM = 4, 2, 0.5  # sequences per rank; clip to a norm the gradients exceed
BF16, FP32 = torch.bfloat16, torch.float32
FROZEN = ("attn.",)  # frozen in every block: the attention's weights (a LoRA-style fine-tune)

# name -> the knobs it sets (everything else plain); "micro": micro-batches per step
CONFIGS: dict[str, dict] = {
    "fp32": {},
    "bf16": {"mp": (BF16, FP32, BF16)},
    "bf16_reduce": {"mp": (BF16, BF16, BF16)},
    "backward_pre": {"prefetch": "BACKWARD_PRE"},
    "backward_post": {"prefetch": "BACKWARD_POST"},
    "forward": {"prefetch": "BACKWARD_PRE", "forward": True},
    "accumulate": {"micro": 2},
    "no_sync": {"micro": 2, "no_sync": True},
    "frozen": {"frozen": True},
    "clip": {"clip": True},
}
LABELS = {  # each configuration as its line in a training script
    "fp32": "(plain: fp32, backward_prefetch=None)",
    "bf16": "mixed_precision=MixedPrecision(bf16, fp32, bf16)",
    "bf16_reduce": "mixed_precision=MixedPrecision(bf16, bf16, bf16)",
    "backward_pre": "backward_prefetch=BACKWARD_PRE",
    "backward_post": "backward_prefetch=BACKWARD_POST",
    "forward": "BACKWARD_PRE, forward_prefetch=True",
    "accumulate": "2 micro-batches per step",
    "no_sync": "2 micro-batches, the first in no_sync()",
    "frozen": "blocks' attention requires_grad=False",
    "clip": "clip_grad_norm_(0.5) before the step",
}
FSDP2_CONFIGS = {"fsdp2_fp32": {}, "fsdp2_bf16": {"mp": (BF16, FP32, None)},
                 "fsdp2_frozen": {"frozen": True}}


def build(knobs: dict) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(CFG)
    if knobs.get("frozen"):
        for name, p in model.named_parameters():
            if name.startswith("blocks.") and any(f in name for f in FROZEN):
                p.requires_grad_(False)
    return model


def wrap(impl: str, model: nn.Module, knobs: dict, device: torch.device) -> nn.Module:
    """The same knobs spelled the same way for ours and torch's FSDP1 (their API is one)."""
    if impl == "fsdp2":
        mp = knobs.get("mp")
        kw = {"mp_policy": fsdp2.MixedPrecisionPolicy(*mp[:2])} if mp else {}
        for block in model.blocks:
            fsdp2.fully_shard(block, **kw)
        return fsdp2.fully_shard(model, **kw)
    ours = impl == "ours"
    mp, bp = knobs.get("mp"), knobs.get("prefetch")
    kw = dict(device_id=device, forward_prefetch=knobs.get("forward", False),
              backward_prefetch=getattr(fsdp1.BackwardPrefetch if ours else TorchBP, bp)
              if bp else None,
              mixed_precision=(fsdp1.MixedPrecision if ours else TorchMP)(*mp) if mp else None)
    if ours:
        return fsdp1.FullyShardedDataParallel(
            model, auto_wrap_policy=fsdp1.transformer_auto_wrap_policy({Block}), **kw)
    return TorchFSDP(model, use_orig_params=True, auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={Block}), **kw)


def batch(step: int, rank: int | None, device: torch.device) -> torch.Tensor:
    """Step ``step``'s tokens: rank ``rank``'s ``LOCAL`` sequences, or all (``None``)."""
    g = torch.Generator().manual_seed(step)
    seq = torch.randint(0, CFG.vocab_size, (LOCAL * dist.get_world_size(), CFG.seq_len),
                        generator=g)
    return (seq if rank is None else seq.chunk(dist.get_world_size())[rank]).to(device)


class Events:
    """Collectives and unit forwards in the order they happen, for ours and torch's FSDP1: our
    comm wrappers are wrapped, torch's recorded by ``minifsdp.torch_order``, and every unit
    gets a forward pre-hook. ``recording()`` yields the list of events (a tuple each)."""

    def __init__(self) -> None:
        self.torch = torch_order.Recorder("fsdp1")
        ag, rs = comm.all_gather_into_tensor, comm.reduce_scatter_tensor
        # FSDP1 passes tag=, FSDP2's group comms label by comm.tagged(...)
        tag_of = lambda kw: kw.get("tag") or comm.current_tag() or ""

        def ours_ag(*a, **kw):
            self.torch.mark("all_gather", tag_of(kw).split()[0], tag_of(kw))
            return ag(*a, **kw)

        def ours_rs(*a, **kw):
            self.torch.mark("reduce_scatter", tag_of(kw).split()[0], tag_of(kw))
            return rs(*a, **kw)

        comm.all_gather_into_tensor, comm.reduce_scatter_tensor = ours_ag, ours_rs

    def watch(self, model: nn.Module) -> None:
        """Name ``model``'s units as ours does (``(root)``, ``blocks.0``) and hook their
        forwards."""
        if isinstance(model, TorchFSDP):
            self.torch.watch(model)
        for name, m in model.named_modules():
            if isinstance(m, (fsdp1.FullyShardedDataParallel, TorchFSDP)):
                unit = torch_order.fsdp1_unit_name(name)
                m.register_forward_pre_hook(lambda *_, u=unit: self.torch.mark("forward", u))

    @contextlib.contextmanager
    def recording(self):
        """``("AG" | "RS" | "F", unit)``, ours with their comm tag as a third element."""
        events: list[tuple] = []
        with self.torch.record() as recorded:
            yield events
        events += [(SHORT[e.op], e.group, e.tag) if e.tag else (SHORT[e.op], e.group)
                   for e in recorded]


def full_params(impl: str, model: nn.Module) -> dict[str, torch.Tensor]:
    if impl == "ours":
        return fsdp1.full_state_dict(model)
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach() for k, v in sd.items()}


def run(impl: str, knobs: dict, info, events: Events) -> dict:
    """Two steps of one configuration; the second under ``MemoryTracker`` and the logs."""
    model = wrap(impl, build(knobs), knobs, info.device)
    events.watch(model)
    params = list(model.parameters())  # foreach by device, not by type: Note [one optimizer path]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, foreach=use_foreach(params))
    out: dict = {"losses": []}
    micro = knobs.get("micro", 1)
    for step in range(STEPS):
        last = step == STEPS - 1
        x = batch(step, info.rank, info.device)
        tracker = MemoryTracker(model, opt, device=info.device) if last and impl != "torch" \
            else None
        with comm.logging_comm() as log, tracker or contextlib.nullcontext(), \
                events.recording() if last else contextlib.nullcontext() as recorded:
            if tracker is not None:
                tracker.register(x, "activations")
            for i, xs in enumerate(x.chunk(micro)):
                sync = not (knobs.get("no_sync") and i < micro - 1)
                with model.no_sync() if not sync else contextlib.nullcontext():
                    loss = loss_fn(model(xs), xs) / micro
                    loss.backward()
                if i == 0 and micro > 1 and tracker is not None:  # Note [FSDP1 no_sync]: its price
                    out["grads_after_first"] = tracker.current()["grads"]
            if knobs.get("clip"):
                out["norm"] = float(model.clip_grad_norm_(MAX_NORM))
            opt.step()
            opt.zero_grad(set_to_none=True)
        out["losses"].append(float(loss) * micro)
        if last:
            out["events"] = recorded
            out["wire"], out["payload"], out["dtypes"] = {}, {}, {}
            for r in log.comms():
                out["wire"][r.op] = out["wire"].get(r.op, 0) + r.wire_bytes
                out["payload"][r.op] = out["payload"].get(r.op, 0) + r.bytes
                out["dtypes"].setdefault(r.op, set()).add(r.dtype)
            out["dtypes"] = {k: sorted(v) for k, v in out["dtypes"].items()}
            out["calls"] = {op: sum(r.op == op for r in log.comms()) for op in out["wire"]}
    if tracker is not None:
        tl = tracker.timeline
        out["memory"] = {"peak": tracker.peak, "peak_by_category": tracker.peak_by_category,
                         **{f"max_{c}": max(s[c] for s in tl) for c in ("params", "grads",
                                                                        "comm")},
                         "end": {c: tl[-1][c] for c in ("params", "grads", "optimizer")},
                         # what no background thread frees: the same bytes in every run
                         "steady_peak": max(s["total"] - s["comm"] - s["other"] for s in tl)}
    if impl != "fsdp2":
        out["params"] = full_params(impl, model)
    if knobs.get("frozen") and impl != "fsdp2":
        base = build(knobs).state_dict()
        out["frozen_unchanged"] = all(torch.equal(out["params"][k], base[k].to(out["params"][k]))
                                      for k, p in build(knobs).named_parameters()
                                      if not p.requires_grad)
    return out


def single_process_norm(info) -> float:
    """The clip configuration's norm in one process: every rank's sequences as one
    micro-batch each (Note [bitwise parity] in minifsdp/train.py), torch's clip."""
    model, n = build({}).to(info.device), dist.get_world_size()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(STEPS):
        for r in range(n):
            x = batch(step, r, info.device)
            (loss_fn(model(x), x) / n).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norm


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", nargs="+", choices=[*CONFIGS, *FSDP2_CONFIGS],
                   default=[*CONFIGS, *FSDP2_CONFIGS], help="a subset to run (default: all)")
    chosen = p.parse_args().configs
    info = dist_setup()
    events = Events()
    configs = {}
    for name, knobs in CONFIGS.items():
        if name not in chosen:
            continue
        ours, theirs = run("ours", knobs, info, events), run("torch", knobs, info, events)
        where = f"rank {info.rank}, {name}"
        line = divergence_line(ours["params"], {k: v.to(ours["params"][k]) for k, v in
                                                theirs["params"].items()}, where=where)
        ours["bitwise_torch"], ours["vs_torch"] = line is None, line
        ours["torch_events"], ours["torch_losses"] = theirs["events"], theirs["losses"]
        if "norm" in ours:
            norm = divergence_line(ours["norm"], theirs["norm"], where=f"{where}, total norm")
            ours["torch_norm"], ours["norm_bitwise_torch"] = theirs["norm"], norm is None
            ours["norm_vs_torch"] = norm
        del ours["params"]
        configs[name] = ours
    for name, knobs in FSDP2_CONFIGS.items():
        if name in chosen:
            configs[name] = run("fsdp2", knobs, info, events)
    if "clip" in configs:
        configs["clip"]["single_norm"] = single_process_norm(info)
    model = build({})
    units = {"(root)": [p for n, p in model.named_parameters() if not n.startswith("blocks.")],
             **{f"blocks.{i}": list(b.parameters()) for i, b in enumerate(model.blocks)}}
    frozen = sum(p.numel() for n, p in build({"frozen": True}).named_parameters()
                 if not p.requires_grad)
    finish({"configs": configs, "world_size": info.world_size,
            "num_params": sum(p.numel() for p in model.parameters()),
            "unit_numel": {u: sum(p.numel() for p in ps) for u, ps in units.items()},
            "frozen_numel": frozen, "max_norm": MAX_NORM})


if __name__ == "__main__":
    main()
