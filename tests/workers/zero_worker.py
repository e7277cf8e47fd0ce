"""Worker for tests/test_zero.py: ZeRO-1/2 against a plain torch optimizer on the same data, for
what ``minifsdp.train`` does not reach (more optimizers, many buckets with padding each,
gradient accumulation, ``zero_grad(set_to_none=False)``, a state_dict round trip), and the
memory of a multi-bucket ZeRO-2 step. Reports raw numbers; the test asserts on them.

The reference is one process on every rank: the N ranks' local batches run as micro-batches,
each loss / N, gradients accumulated (Note [bitwise parity] in minifsdp/train.py).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minifsdp.dist import dist_setup, finish
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPT, GPTConfig
from minifsdp.parity import divergence_line, max_abs_diff
from minifsdp.zero import setup_zero

info = dist_setup()
rank, N = info.rank, info.world_size
STEPS, LOCAL = 3, 4
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True,
                                      weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
}
# name -> (stage, optimizer, bucket cap in bytes, micro-batches per step, options)
SMALL = 300  # bytes: the MLP's buckets are [fc1.weight] and [fc1.bias, fc2.weight, fc2.bias]
CASES = {
    "sgd_stage1_one_bucket": (1, "sgd", 2**20, 1, {}),
    "sgd_stage2_two_buckets": (2, "sgd", SMALL, 1, {}),
    "adam_stage1_two_buckets": (1, "adam", SMALL, 1, {}),
    "adam_stage2_two_buckets": (2, "adam", SMALL, 1, {}),
    "adamw_stage2_state_dict": (2, "adamw", SMALL, 1, {"reload_state": True}),
    "adadelta_stage2_one_bucket": (2, "adadelta", 2**20, 1, {}),
    "adam_stage1_zero_not_none": (1, "adam", SMALL, 1, {"set_to_none": False}),
    "adam_stage2_zero_not_none": (2, "adam", SMALL, 1, {"set_to_none": False}),
    "adam_stage1_accumulate": (1, "adam", SMALL, 2, {}),
    "adam_stage2_accumulate": (2, "adam", SMALL, 2, {}),
}


def mlp() -> nn.Module:
    """101 parameters (odd, prime to 2, 3, 4) at offsets 0, 70, 77, 98: padding everywhere."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-step: the same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(N * LOCAL, 10, generator=g), torch.randint(0, 3, (N * LOCAL,), generator=g)


def replicas_differ(model: nn.Module) -> str | None:
    """Where some rank's parameters first differ from rank 0's (ZeRO's all-gather must leave
    every replica alike, bit for bit), or None."""
    per_rank: list[dict] = [{} for _ in range(N)]
    for k, p in model.named_parameters():
        everyone = [torch.empty_like(p.detach()) for _ in range(N)]
        dist.all_gather(everyone, p.detach().contiguous())
        for q in range(N):
            per_rank[q][k] = everyone[q]
    lines = (divergence_line(per_rank[q], per_rank[0], names=(f"rank {q}", "rank 0"))
             for q in range(1, N))
    return next((line for line in lines if line), None)


def run_case(stage, opt_name, cap, micro, options) -> dict:
    model = mlp()
    ref = copy.deepcopy(model)
    make = OPTIMIZERS[opt_name]
    model, opt = setup_zero(model, make, stage=stage, bucket_cap_mb=cap / 2**20)
    ref_opt = make(ref.parameters())
    set_to_none = options.get("set_to_none", True)
    losses, ref_losses = [], []
    for step in range(STEPS):
        for m in range(micro):
            x, y = batch(step, m)
            xs, ys = x.chunk(N), y.chunk(N)
            loss = F.cross_entropy(model(xs[rank]), ys[rank])
            (loss / micro).backward()
            losses.append(loss.item())
            for q in range(N):  # the reference: every rank's micro-batch, in rank order
                ref_loss = F.cross_entropy(ref(xs[q]), ys[q])
                (ref_loss / (N * micro)).backward()
                ref_losses.append(ref_loss.item())
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        if options.get("reload_state") and step == 0:
            opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    return {
        "buckets": [[b.numel, b.flat.numel()] for b in opt.buckets],
        "max_abs_diff": max_abs_diff(got, want),
        "divergence": divergence_line(got, want, names=("ZeRO", "one process"),
                                      where=f"rank {rank}"),  # None: bit for bit
        "replicas_differ": replicas_differ(model),
        "moved": min(float((p - q).abs().max()) for p, q in zip(model.parameters(),
                                                                 mlp().parameters())),
        "losses": losses, "ref_losses": ref_losses[rank::N],
    }


def gpt_memory(stage: int, cap_bytes: float) -> dict:
    """Per-category peaks of step 2 of a GPT (d_model 32, 2 layers, AdamW) under ZeRO."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=32))
    model, opt = setup_zero(model, OPTIMIZERS["adamw"], stage=stage,
                            bucket_cap_mb=cap_bytes / 2**20)
    g = torch.Generator().manual_seed(rank)
    x, y = (torch.randint(0, 64, (LOCAL, 32), generator=g) for _ in range(2))
    for _ in range(2):  # step 2: AdamW's state exists from the start
        tracker = MemoryTracker(model, opt)
        with tracker:
            tracker.register((x, y), "activations")
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
    peaks = {c: max(s[c] for s in tracker.timeline) for c in ("params", "grads", "optimizer",
                                                              "comm")}
    return {"peaks": peaks, "shard_numels": [b.shard.numel() for b in opt.buckets],
            "bucket_numels": [b.flat.numel() for b in opt.buckets],
            "num_params": sum(p.numel() for p in model.parameters())}


out = {"rank": rank, "world_size": N,
       "cases": {name: run_case(*case) for name, case in CASES.items()},
       "memory": {f"stage{s}_16KiB": gpt_memory(s, 2**14) for s in (1, 2)}}
finish(out)
