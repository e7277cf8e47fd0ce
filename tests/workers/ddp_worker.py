"""Worker for tests/test_ddp.py: what ``minifsdp.train`` cannot do -- gradient accumulation with
``no_sync`` and parameters without gradients -- each run side by side with torch DDP doing the
same, in one process group. Reports raw values; the test asserts on them."""

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from minifsdp import comm
from minifsdp.ddp import BucketedDDP
from minifsdp.dist import dist_setup, finish, seed_everything
from minifsdp.parity import divergence_line, max_abs_diff
from minifsdp.train import loss_fn, make_model, parse_args

info = dist_setup()
rank, n = info.rank, info.world_size
out: dict = {"rank": rank, "world_size": n}
GPT_ARGS = ["--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4",
            "--seq-len", "32"]


def tokens(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch: (4, 32) token ids and next-token targets."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    seq = torch.randint(0, 64, (4, 33), generator=g)
    return seq[:, :-1].to(info.device), seq[:, 1:].to(info.device)


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in model.module.named_parameters()}


def compare(ours: dict, ref: dict) -> dict:
    """Bitwise (Note [parity]): ``divergence`` is the first difference's line, or None."""
    line = divergence_line(ours, ref, names=("BucketedDDP", "torch DDP"), where=f"rank {rank}")
    return {"names_equal": list(ours) == list(ref), "equal": line is None, "divergence": line,
            "max_diff": max_abs_diff(ours, ref)}


# ---- 1. gradient accumulation: k-1 backwards under no_sync, then a synced one ------------

def accumulate(model, steps: int = 3, k: int = 3) -> tuple[list[float], dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        for micro in range(k):
            sync = micro == k - 1
            with contextlib.nullcontext() if sync else model.no_sync():
                x, y = tokens(step, micro)
                loss = loss_fn(model(x), y) / k
                loss.backward()
            losses.append(float(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, params_of(model)


seed_everything(0)
ref_losses, ref_params = accumulate(DistributedDataParallel(make_model(parse_args(GPT_ARGS))))
seed_everything(0)
ours = BucketedDDP(make_model(parse_args(GPT_ARGS)), bucket_cap_mb=0.05)
with comm.logging_comm() as log:
    losses, params = accumulate(ours)
out["accumulation"] = {
    "losses": losses, "ref_losses": ref_losses, **compare(params, ref_params),
    "buckets": len(ours.buckets),
    "bucket_all_reduces": len([r for r in log.comms("all_reduce")
                               if (r.tag or "").startswith("bucket")]),
}


# ---- 2. parameters that get no gradient ---------------------------------------------------

class TwoBranch(nn.Module):
    """``a`` always runs; ``b`` only if asked; ``frozen`` never trains (requires_grad=False)."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)
        self.frozen = nn.Linear(8, 8).requires_grad_(False)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = self.frozen(torch.relu(self.trunk(x)))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def two_branch(wrap, **kwargs) -> nn.Module:
    seed_everything(1)
    return wrap(TwoBranch().to(info.device), **kwargs)


def step(model, use_b: bool, i: int = 0) -> str | None:
    """One forward/backward on this rank's batch; the error message if backward raised."""
    g = torch.Generator().manual_seed(100 * i + rank)
    x = torch.randn(4, 8, generator=g).to(info.device)
    try:
        model(x, use_b).square().mean().backward()
    except RuntimeError as e:
        return str(e)
    return None


def grads(model) -> dict[str, list | None]:
    return {k: None if p.grad is None else p.grad.tolist()
            for k, p in model.module.named_parameters()}


def counted_step(model, use_b: bool, i: int = 0) -> tuple[str | None, int]:
    """``step``, and how many status all-gathers it ran (Note [unused parameters])."""
    with comm.logging_comm() as log:
        error = step(model, use_b, i)
    return error, len([r for r in log.comms() if r.tag == "unused check"])


unused: dict = {"exchanges": []}
model = two_branch(BucketedDDP)
nan_model = two_branch(BucketedDDP)
# a gradient that really is NaN looks like a missed one from outside: the status is exchanged,
# says nobody missed anything, and the NaN gradients are handed back as torch's DDP would
nan_model.module.a.bias.data[0] = float("nan")
for case, m, use_b, reset in [("everywhere", model, False, False),  # b unused on every rank
                              ("on_rank_1", model, rank != 1, False),  # on rank 1 only: no hang
                              ("recovered_error", model, True, True),  # the next clean step works
                              ("nan_error", nan_model, True, False)]:
    if reset:
        for p in model.parameters():
            p.grad = None
    unused[case], n = counted_step(m, use_b)
    unused["exchanges"].append(n)
unused["nan_grad_is_nan"] = bool(nan_model.module.a.weight.grad.isnan().any())
ref = two_branch(DistributedDataParallel)
step(ref, use_b=True)
unused["recovered_grads_equal"] = grads(model) == grads(ref)
unused["frozen_in_buckets"] = any(
    p is model.module.frozen.weight for b in model.buckets for p in
    (model._params[i] for i in b.params))

# find_unused_parameters=True: missing gradients count as zero; unused everywhere -> None.
ours, ref = two_branch(BucketedDDP, find_unused_parameters=True), two_branch(
    DistributedDataParallel, find_unused_parameters=True)
unused["find_unused"] = []
for i, use_b in enumerate([rank == 0, False, True]):  # b: used by rank 0, by none, by all
    error, n = counted_step(ours, use_b, i)
    errors = [error, step(ref, use_b, i)]
    g_ours, g_ref = grads(ours), grads(ref)
    unused["find_unused"].append({"errors": errors, "grads_equal": g_ours == g_ref,
                                  "exchanges": n,
                                  "b_grad_is_none": g_ours["b.weight"] is None,
                                  "ref_b_grad_is_none": g_ref["b.weight"] is None})
    for m in (ours, ref):
        m.zero_grad(set_to_none=True)
out["unused"] = unused

dist.barrier()
finish(out)
