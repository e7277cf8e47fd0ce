"""Torchrun worker for chapter 07's FP8 all-gather: the same GPT trained four ways, and the
FP8 runs simulated in one process.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m minifsdp.demos.float8

Runs (each from the same seed, on the same Markov-chain token batches, Adam):

    fp32       no mixed precision
    bf16       MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    fp8        every nn.Linear weight a Float8Weight (``enable_float8_all_gather``), fp32 compute
    fp8_bf16   the same, with the bf16 policy: fp8 on the wire, bf16 compute

Per run and rank: the losses, the all-gather and amax all-reduce records of ``minifsdp.comm``
per group, what each group holds (shapes, padded shard sizes, which are float8), the memory
of one step by category (``MemoryTracker``), and the final full parameters' bitwise equality
(Note [parity] in ``minifsdp/parity.py``) with ``simulate``: ONE process that quantizes each
full weight with the scale of its own amax, dequantizes, runs the N ranks' batches one by one
and averages their gradients as the reduce-scatter does (at N = 2 ``(g0 + g1) / 2`` is the
same float sum in any order; Note [bitwise parity] in ``minifsdp/train.py``).
``sim_divergence`` says where the run first differs from the simulation (its losses, then its
parameters), or is None; ``sim_worst`` is the parameters' largest difference, or None.
Results: ``rank{r}.json`` under ``MINIFSDP_OUT``.
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.nn as nn
from torch.func import functional_call

from minifsdp import comm, fsdp2
from minifsdp.data import MarkovTokens
from minifsdp.fsdp2.float8 import enable_float8_all_gather, quantize_dequantize
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPT, GPTConfig
from minifsdp.parity import divergence_line, first_divergence, max_abs_diff, worst_divergence
from minifsdp.train import loss_fn

CFG = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=32)
LOCAL, LR = 8, 3e-3
MODES = {  # name: (float8 weights, param_dtype, reduce_dtype)
    "fp32": (False, None, None),
    "bf16": (False, torch.bfloat16, torch.float32),
    "fp8": (True, None, None),
    "fp8_bf16": (True, torch.bfloat16, torch.float32),
}
DATA = MarkovTokens(vocab_size=CFG.vocab_size, seq_len=CFG.seq_len, num_seqs=4096)


def batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``world * LOCAL`` rows; rank r's are chunk r."""
    seqs = DATA.seqs[step * world * LOCAL: (step + 1) * world * LOCAL]
    return seqs[:, :-1], seqs[:, 1:]


def model(mode: str) -> nn.Module:
    """A fresh GPT, the same on every rank; its Linear weights marked for the fp8 modes."""
    torch.manual_seed(0)
    m = GPT(CFG)
    if MODES[mode][0]:
        enable_float8_all_gather(m)
    return m


def train_fsdp(mode: str, steps: int, mesh, rank: int, track_step: int | None = 1) -> dict:
    """``steps`` Adam steps of ``fully_shard`` (each block, then the root) in ``mode``."""
    world = mesh.size()
    m = model(mode)
    _, param_dtype, reduce_dtype = MODES[mode]
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in m.blocks:
        fsdp2.fully_shard(block, mesh=mesh, mp_policy=policy)
    fsdp2.fully_shard(m, mesh=mesh, mp_policy=policy)
    groups = {name: [{"shape": list(p.orig_size), "padded": p.padded_shard_numel,
                      "float8": p.extension is not None} for p in mod._fsdp_state.group.fsdp_params]
              for name, mod in [("root", m)] + [(f"blocks.{i}", b) for i, b in
                                                enumerate(m.blocks)]}
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    losses, memory = [], None
    with comm.logging_comm() as log:
        for step in range(steps):
            x, y = (t.chunk(world)[rank] for t in batch(step, world))
            tracker = MemoryTracker(m, opt) if step == track_step else None
            with tracker or contextlib.nullcontext():
                loss = loss_fn(m(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
            if step == 0:
                calls = [{k: r.__dict__[k] for k in ("op", "bytes", "wire_bytes", "dtype", "tag")}
                         for r in log.comms()]
            if tracker:
                tl = tracker.timeline
                memory = {c: max(s[c] for s in tl) for c in ("params", "grads", "comm")}
                memory["all-gather buffers"] = max(s.get("labels", {}).get(
                    "all-gather buffers", 0) for s in tl)
                memory["peak"] = tracker.peak
                # every category but "other" (gloo's thread frees its buffers there, a little
                # earlier or later from run to run): the same bytes in every run
                memory["peak but other"] = max(s["total"] - s["other"] for s in tl)
    params = {k: v.full_tensor().detach().clone() for k, v in m.named_parameters()}
    return {"losses": losses, "params": params, "comm": calls, "groups": groups,
            "memory": memory}


def simulate(mode: str, steps: int, world: int) -> dict:
    """One process, no collectives: the same training as ``train_fsdp(mode)`` on ``world``
    ranks. Each step computes with ``quantize_dequantize(w)`` for every float8 weight (cast
    to ``param_dtype``) and the other parameters cast to it, runs rank r's rows as its own
    forward and backward, and averages the ``world`` gradients in the reduce dtype."""
    m = model(mode)
    _, param_dtype, reduce_dtype = MODES[mode]
    float8 = {n for n, p in m.named_parameters() if type(p).__name__ == "Float8Weight"}
    opt = torch.optim.Adam(m.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        compute = {n: (quantize_dequantize(p, param_dtype) if n in float8 else
                       p.detach().to(param_dtype or p.dtype)).requires_grad_()
                   for n, p in m.named_parameters()}
        grads: list[list[torch.Tensor]] = []
        for x, y in zip(*(t.chunk(world) for t in batch(step, world))):
            loss = loss_fn(functional_call(m, compute, (x,)), y)
            grads.append(torch.autograd.grad(loss, list(compute.values())))
            losses.append(loss.item())
        for p, gs in zip(m.parameters(), zip(*grads)):
            total = gs[0].to(reduce_dtype or gs[0].dtype)
            for g in gs[1:]:
                total = total + g.to(total.dtype)
            p.grad = (total / world).to(p.dtype)
        opt.step()
        opt.zero_grad()
    return {"losses": losses[::world], "all_losses": losses,
            "params": {k: v.detach().clone() for k, v in m.named_parameters()}}


def run(steps: int, modes: list[str], mesh, rank: int) -> dict:
    """Every mode with FSDP, every fp8 mode simulated; the per-rank summary to save."""
    world = mesh.size()
    out: dict = {"rank": rank, "world_size": world, "steps": steps, "runs": {}}
    for mode in modes:
        got = train_fsdp(mode, steps, mesh, rank)
        summary = {k: got[k] for k in ("losses", "comm", "groups", "memory")}
        if MODES[mode][0]:
            sim = simulate(mode, steps, world)
            # rank r's loss of each step is the simulation's r-th forward of that step
            sim_losses = sim["all_losses"][rank::world]
            summary["sim_losses_equal"] = [first_divergence(a, b) is None for a, b in zip(
                got["losses"], sim_losses)]  # per step
            summary["sim_params_bitwise"] = {k: first_divergence(v, sim["params"].get(k)) is None
                                             for k, v in got["params"].items()}
            names, where = ("fsdp", "simulation"), f"rank {rank}"
            losses = divergence_line(got["losses"], sim_losses, names=names,
                                     where=f"{where}, losses")
            params = divergence_line(got["params"], sim["params"], names=names, where=where)
            summary["sim_divergence"] = losses or params  # the first difference's line, or None
            summary["sim_max_abs_diff"] = max_abs_diff(got["params"], sim["params"])
            worst = worst_divergence(got["params"], sim["params"], names=names, where=where)
            summary["sim_worst"] = None if worst is None else str(worst)  # the largest one
        out["runs"][mode] = summary
    return out


def main() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp.dist import dist_setup, finish

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    info = dist_setup()
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    finish(run(args.steps, args.modes.split(","), mesh, info.rank))


if __name__ == "__main__":
    main()
