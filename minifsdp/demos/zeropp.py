"""Torchrun worker for chapter 12 (ZeRO++): one job, every variant, at N = 4 with "nodes" of
K = 2 ranks ({0, 1} and {2, 3}).

    python -m torch.distributed.run --standalone --nproc-per-node 4 -m minifsdp.demos.zeropp

The tiny GPT (each block a unit, then the root) trains ``--steps`` Adam steps from the same
seed on the same Markov-chain batches, bf16 params and bf16 reduce (the paper's fp16 M) except
the fp32 reference, in these runs (``RUNS``; "ours" = ``minifsdp.fsdp2``, "torch" = torch's
``fully_shard``):

    fp32        ours, no mixed precision: what the drift is measured against
    base        ours and torch: reshard_after_forward True (ZeRO-3), the root's too
    hpz         ours and torch: reshard_after_forward=K (Note [hpZ is reshard to k])
    keep        ours: reshard_after_forward False (the memory of no backward all-gather)
    qwz         ours and torch: every parameter a QuantizedWeight (Note [qwZ])
    qgz         torch (and ours once it has set_custom_reduce_scatter): QuantizedReduceScatter(4)
    qwz+qgz, hpz+qgz   the same, combined (qwz with hpz is refused by both: Note [qwZ])

Per run and rank: losses, step 0's collectives from ``minifsdp.comm``'s log (torch's own
all-gathers and reduce-scatters bypass it; our qgZ's all-to-alls do not), the memory between
step 1's forward and backward, and the drift from fp32 after each step. Before training,
standalone checks of qgZ against ``reduce_scatter_tensor`` and of qwZ's gathered weights
against an independent float64 quantization. Results: ``rank{r}.json`` under MINIFSDP_OUT.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from minifsdp import comm, fsdp2
from minifsdp.data import MarkovTokens
from minifsdp.fsdp2.extensions import OnTorch
from minifsdp.fsdp2.hsdp import _POST_FORWARD_GROUPS
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPT, GPTConfig
from minifsdp.parity import divergence_line
from minifsdp.train import loss_fn
from minifsdp.zeropp import (
    QWZ_BLOCK,
    QuantizedReduceScatter,
    QuantizedWeight,
    enable_qwz,
    error_bound,
    quantize_blocks,
)

CFG = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=32)
LOCAL, LR, K = 4, 3e-3, 2
DATA = MarkovTokens(vocab_size=CFG.vocab_size, seq_len=CFG.seq_len, num_seqs=1024)
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}
# name: (impl, qwz, blocks' reshard_after_forward, qgz bits or None, bf16)
RUNS = {
    "ours fp32": ("ours", False, True, None, False),
    "ours base": ("ours", False, True, None, True),
    "torch base": ("torch", False, True, None, True),
    "ours hpz": ("ours", False, K, None, True),
    "torch hpz": ("torch", False, K, None, True),
    "ours keep": ("ours", False, False, None, True),
    "ours qwz": ("ours", True, True, None, True),
    "torch qwz": ("torch", True, True, None, True),
    "torch qgz": ("torch", False, True, 4, True),
    "torch qwz+qgz": ("torch", True, True, 4, True),
    "torch hpz+qgz": ("torch", False, K, 4, True),
}
# ours with qgZ, where minifsdp.fsdp2 has set_custom_reduce_scatter (torch's comm protocol)
OURS_QGZ = {"ours qgz": ("ours", False, True, 4, True),
            "ours qwz+qgz": ("ours", True, True, 4, True)}
if hasattr(fsdp2.FSDPModule, "set_custom_reduce_scatter"):
    RUNS.update(OURS_QGZ)


def batch(step: int, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    seqs = DATA.seqs[step * world * LOCAL: (step + 1) * world * LOCAL].chunk(world)[rank]
    return seqs[:, :-1], seqs[:, 1:]


def build(name: str, mesh) -> GPT:
    impl, qwz, raf, qgz, bf16 = RUNS[name]
    torch.manual_seed(0)
    model = GPT(CFG)
    if qwz:
        enable_qwz(model) if impl == "ours" else torch_qwz(model)
    shard, policy = ((fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy) if impl == "ours"
                     else (torch_fully_shard, TorchPolicy))
    kw = {"mp_policy": policy(**BF16)} if bf16 else {}
    units = [shard(b, mesh=mesh, reshard_after_forward=raf, **kw) for b in model.blocks]
    units.append(shard(model, mesh=mesh, reshard_after_forward=raf, **kw))  # the root too
    if qgz:
        for u in units:
            u.set_custom_reduce_scatter(QuantizedReduceScatter(bits=qgz))
    return model


class TorchQuantizedWeight(OnTorch):
    """``QuantizedWeight``'s hooks on torch's ``fully_shard`` (as chapter 07's test worker
    runs ``Float8Weight``'s)."""

    ours = QuantizedWeight


def torch_qwz(model: nn.Module) -> None:
    """``enable_qwz`` for torch's ``fully_shard``: every parameter a ``TorchQuantizedWeight``."""
    for m in model.modules():
        for attr, p in list(m.named_parameters(recurse=False)):
            setattr(m, attr, nn.Parameter(TorchQuantizedWeight(p.detach()), p.requires_grad))


def local_params(model) -> dict[str, torch.Tensor]:
    """This rank's shards (every parameter shards evenly here), fp32 copies."""
    return {k: v.to_local().detach().float().clone() for k, v in model.named_parameters()}


def all_ranks(value: float, op=dist.ReduceOp.MAX) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op)
    return t.item()


def train(name: str, mesh, steps: int, rank: int) -> dict:
    world = mesh.size()
    model = build(name, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, history, memory, calls = [], [], None, []
    for step in range(steps):
        x, y = batch(step, world, rank)
        tracker = MemoryTracker(model, opt) if step == 1 and name.startswith("ours") else None
        with comm.logging_comm() as log:
            if tracker:
                with tracker:
                    with tracker.phase("forward"):
                        loss = loss_fn(model(x), y)
                    after_forward = dict(tracker.current())
                    forward_calls = len(log.comms())
                    loss.backward()
                memory = {"after_forward": after_forward, "peak": tracker.peak,
                          "kept": max(sum(v for k, v in s.get("labels", {}).items()
                                          if "kept" in k) for s in tracker.timeline)}
            else:
                loss = loss_fn(model(x), y)
                forward_calls = len(log.comms())
                loss.backward()
        if step == 0:
            calls = [{k: r.__dict__[k] for k in ("op", "bytes", "wire_bytes", "group_size",
                                                  "dtype", "tag")} for r in log.comms()]
            for i, c in enumerate(calls):
                c["phase"] = "forward" if i < forward_calls else "backward"
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        history.append(local_params(model))
    return {"losses": losses, "comm": calls, "memory": memory, "history": history}


def check_qgz(world: int, rank: int) -> dict:
    """Our qgZ against the exact fp32 reduce-scatter (AVG) on random gradients; the bound of
    Note [qgZ] from the scales every rank used (all-gathered here only to compute it)."""
    out = {}
    for bits in (8, 4):
        g = torch.Generator().manual_seed(1000 + rank)
        grads = torch.randn(world * 1000, generator=g) * torch.logspace(-3, 0, world * 1000)
        exact = torch.empty(1000)
        comm.reduce_scatter_tensor(exact, grads.clone(), op=dist.ReduceOp.AVG)
        got = torch.empty(1000)
        QuantizedReduceScatter(bits=bits, block=64)(got, grads, dist.group.WORLD,
                                                     dist.ReduceOp.AVG)
        mine = torch.stack([error_bound(quantize_blocks(c, 64, bits)[1], 64, 1000)
                            for c in grads.view(world, 1000)])  # row j: my bound for rank j
        every = torch.empty(world * world, 1000)
        comm.all_gather_into_tensor(every, mine)
        # every rank's bound for my chunk, averaged
        bound = every.view(world, world, 1000)[:, rank].sum(0) / world
        bound = bound + 2 * world * 2.0 ** -24 * grads.abs().max()  # fp32 sums (loose)
        out[bits] = {"max_err": (got - exact).abs().max().item(),
                     "worst_ratio": ((got - exact).abs() / bound).max().item()}
    return out


def check_qwz(mesh, rank: int) -> dict:
    """Forward's unsharded weights of a qwZ model (ours, bf16) against an independent float64
    quantization of the fp32 master: |w_fwd - w| <= scale (1/2 + 2^-16) + bf16's half ulp."""
    model = build("ours qwz", mesh)
    master = {k: v.full_tensor().detach().float() for k, v in model.named_parameters()}
    seen = {}
    lin = model.blocks[0].attn.qkv

    def grab(module, args) -> None:  # the unsharded weight that forward computes with
        seen.setdefault("w", module.weight.detach().clone())

    lin.register_forward_pre_hook(grab)
    x, _ = batch(0, mesh.size(), rank)
    model(x)
    w, ref = seen["w"].double(), master["blocks.0.attn.qkv.weight"].double()
    n = mesh.size()
    worst = 0.0
    for piece, got in zip(ref.chunk(n), w.chunk(n)):
        flat, fgot = piece.reshape(-1), got.reshape(-1)
        for b in range(0, flat.numel(), QWZ_BLOCK):
            blk, gb = flat[b: b + QWZ_BLOCK], fgot[b: b + QWZ_BLOCK]
            scale = blk.abs().max().item() / 127
            bound = scale * (0.5 + 2 ** -16) + gb.abs() * 2.0 ** -8  # bf16: u = 2^-8
            worst = max(worst, ((gb - blk).abs() / bound).max().item())
    return {"worst_ratio": worst, "dtype": str(seen["w"].dtype)}


def main() -> None:
    from minifsdp.dist import dist_setup, finish

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    info = dist_setup()
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    out: dict = {"rank": info.rank, "world_size": info.world_size, "K": K,
                 "block": QWZ_BLOCK, "steps": args.steps, "runs": {},
                 "qgz_check": check_qgz(info.world_size, info.rank),
                 "qwz_check": check_qwz(mesh, info.rank)}
    results = {name: train(name, mesh, args.steps, info.rank) for name in RUNS}
    out["hpz_groups"] = sorted(dist.get_process_group_ranks(g.group)
                               for g in _POST_FORWARD_GROUPS.values())
    ref = results["ours fp32"]["history"]
    final = {name: r["history"][-1] for name, r in results.items()}
    for name, r in results.items():
        drift = [all_ranks(max((h[k] - f[k]).abs().max().item() for k in f))
                 for h, f in zip(r["history"], ref)]
        out["runs"][name] = {"losses": r["losses"], "comm": r["comm"], "memory": r["memory"],
                             "drift": drift}
    pairs = [(f"ours {v}", f"torch {v}") for v in ("base", "hpz", "qwz", "qgz", "qwz+qgz")]
    # the first difference's line (step, rank, parameter, index), None if bitwise (Note [parity]
    # in minifsdp/parity.py); "bitwise": on every rank
    out["divergence"] = {f"{a} == {b}": divergence_line(final[a], final[b], names=(a, b),
                                                         where=f"rank {info.rank}")
                         for a, b in pairs + [("ours hpz", "ours base"),
                                              ("torch hpz", "torch base"),
                                              ("torch hpz+qgz", "torch qgz")]
                         if a in final and b in final}
    out["bitwise"] = {pair: all_ranks(float(line is None), dist.ReduceOp.MIN) == 1.0
                      for pair, line in out["divergence"].items()}
    out["bitwise_losses"] = {f"{a} == {b}": results[a]["losses"] == results[b]["losses"]
                             for a, b in pairs if a in results and b in results}
    out["numels"] = {k: v.numel() * info.world_size for k, v in final["ours base"].items()}
    finish(out)


if __name__ == "__main__":
    main()
