"""Worker for tests/test_fsdp1.py: many FSDP1 configurations in one launch, each against torch
FSDP1 and against one process, on the same data. A launch costs seconds of start-up per rank;
a configuration here costs a fraction of a second, so the sharding strategy x auto-wrap x model
matrix runs inside one job per world size. Reports raw numbers; the test asserts on them.

The one-process reference runs on every rank: the N ranks' local batches as micro-batches,
each loss / N, gradients accumulated (Note [bitwise parity] in minifsdp/train.py).

    python -m torch.distributed.run --standalone --nproc-per-node 3 tests/workers/fsdp1_worker.py
"""

import copy
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy, wrap

from minifsdp import comm, fsdp1
from minifsdp.dist import dist_setup, finish
from minifsdp.models import GPT, GPTConfig, MnistCNN
from minifsdp.parity import divergence_line, max_abs_diff
from minifsdp.train import loss_fn, unit_classes

info = dist_setup()
rank, N = info.rank, info.world_size
STEPS, LOCAL = 3, 4
# name -> (model, sharding strategy, auto-wrap, min_num_params, cpu offload); the same at
# every world size. The size policy at 3000 cuts the d_model-32 GPT into 7 units.
CASES = {
    **{f"gpt_{s}_{w}": ("gpt", s, w, 3000, False) for s in ("full_shard", "shard_grad_op",
                                                             "no_shard")
       for w in ("none", "size", "transformer")},
    "gpt_tied_full_shard_transformer": ("gpt_tied", "full_shard", "transformer", 3000, False),
    "gpt_tied_no_shard_size": ("gpt_tied", "no_shard", "size", 3000, False),
    "gpt_shard_grad_op_transformer_offload": ("gpt", "shard_grad_op", "transformer", 3000, True),
    "gpt_no_shard_none_offload": ("gpt", "no_shard", "none", 3000, True),
    "cnn_full_shard_size_offload": ("cnn", "full_shard", "size", 10_000, True),
    "mlp_full_shard_none": ("mlp", "full_shard", "none", 3000, False),
    "mlp_no_shard_transformer": ("mlp", "no_shard", "transformer", 3000, False),
}


def build(model: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if model == "cnn":
        return MnistCNN(dropout=0.0)
    if model == "mlp":  # odd sizes: 16-byte alignment pads between parameters (Note [alignment])
        return nn.Sequential(nn.Linear(33, 65), nn.Tanh(), nn.Linear(65, 10), nn.LogSoftmax(1))
    return GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=32,
                         tie_embeddings=model == "gpt_tied"))


def optimizer(model: str, params) -> torch.optim.Optimizer:
    if model in ("cnn", "mlp"):
        return torch.optim.Adam(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)  # as minifsdp.train


def batch(model: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: the same on every rank."""
    g = torch.Generator().manual_seed(step)
    if model in ("cnn", "mlp"):
        shape = (1, 28, 28) if model == "cnn" else (33,)
        x = torch.randn(N * LOCAL, *shape, generator=g)
        y = torch.randint(0, 10, (N * LOCAL,), generator=g)
    else:
        x, y = (torch.randint(0, 64, (N * LOCAL, 32), generator=g) for _ in range(2))
    return x.to(info.device), y.to(info.device)


def global_mean(loss: torch.Tensor) -> float:
    t = loss.detach().clone()
    dist.all_reduce(t)  # not logged: the comm log holds FSDP's collectives only
    return float(t / N)


def train(model_name: str, model, opt, reference: bool = False) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = batch(model_name, step)
        xs, ys = x.chunk(N), y.chunk(N)
        if reference:  # every rank's micro-batch, in rank order
            parts = []
            for q in range(N):
                loss = loss_fn(model(xs[q]), ys[q])
                (loss / N if N > 1 else loss).backward()
                parts.append(loss.detach())
            losses.append(float(torch.stack(parts).sum() / N) if N > 1 else float(parts[0]))
        else:
            loss = loss_fn(model(xs[rank]), ys[rank])
            loss.backward()
            losses.append(global_mean(loss))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def run_case(model_name: str, strategy: str, wrap_name: str, min_params: int,
             offload: bool) -> dict:
    base = build(model_name)
    ours_m, theirs_m, ref = (copy.deepcopy(base) for _ in range(3))
    classes = unit_classes(base)
    ours_policy = {"none": None, "size": fsdp1.size_based_auto_wrap_policy(min_params),
                   "transformer": fsdp1.transformer_auto_wrap_policy(classes)}[wrap_name]
    torch_policy = {"none": None,
                    "size": functools.partial(wrap.size_based_auto_wrap_policy,
                                              min_num_params=min_params),
                    "transformer": functools.partial(wrap.transformer_auto_wrap_policy,
                                                     transformer_layer_cls=classes)}[wrap_name]
    ours = fsdp1.FullyShardedDataParallel(ours_m, sharding_strategy=strategy,
                                          auto_wrap_policy=ours_policy, device_id=info.device,
                                          cpu_offload=fsdp1.CPUOffload(offload))
    theirs = TorchFSDP(theirs_m, device_id=info.device, use_orig_params=True,
                       sharding_strategy=ShardingStrategy[strategy.upper()],
                       auto_wrap_policy=torch_policy)
    with comm.logging_comm() as log:
        losses = train(model_name, ours, optimizer(model_name, ours.parameters()))
    torch_losses = train(model_name, theirs, optimizer(model_name, theirs.parameters()))
    ref_losses = train(model_name, ref, optimizer(model_name, ref.parameters()), reference=True)
    got = fsdp1.full_state_dict(ours)
    theirs_sd = get_model_state_dict(theirs, options=StateDictOptions(full_state_dict=True))
    theirs_sd = {k: v.detach().cpu() for k, v in theirs_sd.items()}  # on every rank
    want = {k: v.detach().cpu() for k, v in ref.state_dict().items()}
    calls: dict[str, int] = {}
    for r in log.comms():
        calls[f"{r.op} {r.tag}"] = calls.get(f"{r.op} {r.tag}", 0) + 1
    return {
        "config": {"model": model_name, "sharding": strategy, "wrap": wrap_name,
                   "offload": offload},
        "units": sorted(u._name for u in ours._units if u._handle is not None),
        "names": list(got) == list(theirs_sd) == list(want),
        "offloaded": all(p.device.type == "cpu" for p in ours.parameters()) if offload else None,
        "losses": losses, "torch_losses": torch_losses, "ref_losses": ref_losses,
        "vs_torch": divergence_line(got, theirs_sd, names=("fsdp1", "torch FSDP1"),
                                    where=f"rank {rank}"),
        "diff_torch": max_abs_diff(got, theirs_sd),
        "vs_ref": divergence_line(got, want, names=("fsdp1", "one process"),
                                  where=f"rank {rank}"),
        "diff_ref": max_abs_diff(got, want), "torch_diff_ref": max_abs_diff(theirs_sd, want),
        "moved": min(float((got[k] - v).abs().max()) for k, v in base.state_dict().items()),
        "calls": calls,
    }


finish({"rank": rank, "world_size": N,
        "cases": {name: run_case(*case) for name, case in CASES.items()}})
