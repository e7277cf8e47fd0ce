"""Chapter 11's sixth pitfall: gradient accumulation that communicates on every micro-batch.
Run under torchrun at N = 2::

    run = torchrun("minifsdp.demos.accumulation", nproc=2, chapter="11")
    run.ranks[0]["modes"]["no sync"]["ops"]   # per step: ["AG root", "AG blocks.0", ...]

A loop written for DDP accumulates under ``model.no_sync()``. A ``fully_shard`` model has no
``no_sync``; a trainer whose helper only knows DDP's (NVIDIA/cosmos-framework#161) silently
does nothing, and every micro-batch all-gathers and reduce-scatters as if it were a step. FSDP2
says it per micro-batch instead (torch PR #118298 and #124319):
``set_requires_gradient_sync(is_last)`` skips the reduce-scatter and keeps the unsharded
gradients; ``set_reshard_after_backward(is_last)`` also keeps the parameters unsharded after
backward, so the next micro-batch's forward gathers nothing; with
``reshard_after_forward=False`` as well, parameters are gathered once per step ("ZeRO-1").

Per rank, for each mode (``MODES``) and K = 4 micro-batches, 2 SGD steps, ours and torch's
``fully_shard``: ``ops`` (ours; per step, each all-gather ``AG`` and reduce-scatter ``RS``
with its group, in issue order), ``same_ops`` (torch's recorded order equals ours, step by
step), ``vs_torch`` (the first divergence of the parameters after the last step, None when
bitwise), ``held`` (ours: live bytes by category between micro-batches 0 and 1, after the
first backward of step 1) and ``vs_one`` (largest difference from one process that runs
every rank's micro-batches).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from minifsdp import comm, fsdp2, torch_order
from minifsdp.dist import dist_setup, finish
from minifsdp.memory import MemoryTracker
from minifsdp.parity import divergence_line, max_abs_diff

info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
K, STEPS, ROWS = 4, 2, 3  # micro-batches per step, steps, rows per rank and micro-batch
# mode -> (set_requires_gradient_sync(is_last), set_reshard_after_backward(is_last),
#          reshard_after_forward of the blocks)
MODES = {
    "every micro-batch": (False, False, True),
    "no sync": (True, False, True),
    "no sync, no reshard": (True, True, True),
    "once per step": (True, True, False),
}
TORCH = torch_order.Recorder("fsdp2")


class Stack(nn.Module):
    """``(B, 8) -> (B, 4)``: a layer, two blocks (a group each), a head (the root's group)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.head(h)


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch of the global batch: N x ROWS rows, the same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(N * ROWS, 8, generator=g), torch.randint(0, 4, (N * ROWS,), generator=g)


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.named_parameters()}


def train(impl: str, mode: str) -> dict:
    sync_last, reshard_last, after_forward = MODES[mode]
    fs = fsdp2.fully_shard if impl == "ours" else torch_fully_shard
    torch.manual_seed(0)
    model = Stack().to(info.device)
    for b in model.blocks:
        fs(b, mesh=mesh, reshard_after_forward=after_forward)
    fs(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ops, held = [], None
    for step in range(STEPS):
        with comm.logging_comm() as log, TORCH.record() as events:
            for micro in range(K):
                last = micro == K - 1
                if sync_last:
                    model.set_requires_gradient_sync(last)
                if reshard_last:
                    model.set_reshard_after_backward(last)
                x, y = batch(step, micro)
                x, y = x.chunk(N)[rank].to(info.device), y.chunk(N)[rank].to(info.device)
                tracker = MemoryTracker(model=model, optimizer=opt, device=info.device)
                with tracker:
                    (F.cross_entropy(model(x), y) / K).backward()
                    if impl == "ours" and step == 1 and micro == 0:
                        held = tracker.current()
        opt.step()
        opt.zero_grad()
        if impl == "ours":
            ops.append([f"{'AG' if r.op == 'all_gather' else 'RS'} {r.tag.split()[-1]}"
                        for r in log.comms()])
        else:
            ops.append([e.short for e in events if e.op in ("all_gather", "reduce_scatter")])
    return {"ops": ops, "params": full(model), "held": held}


def one_process() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack().to(info.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        for micro in range(K):
            x, y = batch(step, micro)
            for q in range(N):  # every rank's rows, each averaged as FSDP averages the ranks
                (F.cross_entropy(model(x.chunk(N)[q].to(info.device)),
                                 y.chunk(N)[q].to(info.device)) / (K * N)).backward()
        opt.step()
        opt.zero_grad()
    return full(model)


def main() -> None:
    one = one_process()
    out = {}
    for mode in MODES:
        ours, theirs = train("ours", mode), train("torch", mode)
        out[mode] = {
            "ops": ours["ops"],
            "same_ops": ours["ops"] == theirs["ops"],
            "torch_ops": theirs["ops"],
            "vs_torch": divergence_line(ours["params"], theirs["params"]),
            "vs_one": max_abs_diff(ours["params"], one),
            "held": ours["held"],
        }
    numel = sum(p.numel() for p in Stack().parameters())
    finish({"rank": rank, "modes": out, "K": K, "params": numel})


if __name__ == "__main__":
    main()
