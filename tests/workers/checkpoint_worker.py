"""Worker for tests/test_checkpoint.py: save at N = 4, load at N = 2, save, load at N = 3.

    --phase save4 --dir D   (N = 4) train 2 steps, save D/a; a tiny net with empty shards: D/tiny
    --phase load2 --dir D   (N = 2) load D/a into fsdp2, torch_ddp, bucketed_ddp; train a step;
                            save D/b (fsdp2) and D/ddp (bucketed_ddp); corrupt copies of D/a
    --phase load3 --dir D   (N = 3) load D/b, D/ddp, D/tiny; the sharded model's logits

Each save also writes the full parameters and optimizer state (rank 0, ``ref_<name>.pt``) for
the next phase to compare with, bit for bit, and each phase trains one step past its save
(``next_loss``), which the next phase's first step after loading must reproduce: at any N the
global batch of step s is the same set of samples (Note [same global batch]), so the loss
agrees to float rounding. Reports raw results; the test asserts.
"""

import argparse
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from minifsdp import checkpoint, train
from minifsdp.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from minifsdp.dist import dist_setup, finish, seed_everything

p = argparse.ArgumentParser()
p.add_argument("--phase", choices=["save4", "load2", "load3"], required=True)
p.add_argument("--dir", type=Path, required=True)
cli = p.parse_args()
D = cli.dir
info = dist_setup()
# Uneven dim-0 shards at N = 2, 3, 4: vocab 50, pos_emb 30 rows, d_model 36.
ARGV = ["--strategy", "fsdp2", "--model", "gpt", "--n-layer", "2", "--d-model", "36",
        "--n-head", "4", "--seq-len", "30", "--vocab-size", "50", "--optimizer", "adamw",
        "--global-batch", "24"]
args = train.parse_args(ARGV)
results: dict = {"world_size": info.world_size, "argv": ARGV}


def build(strategy: str, seed: int):
    """A GPT set up by ``strategy``; ``seed`` differs per phase so a load must overwrite."""
    seed_everything(seed)
    model = train.make_model(args).to(info.device)
    model = train.STRATEGIES[strategy](model, info, args)
    return model, train.make_optimizer(model.parameters(), args)


class Tiny(nn.Module):
    """Fewer rows than ranks: ``narrow.weight`` (2, 8) and ``scale`` (1,) get empty shards."""

    def __init__(self):
        super().__init__()
        self.inp, self.narrow = nn.Linear(8, 8), nn.Linear(8, 2)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return self.narrow(torch.tanh(self.inp(x))) * self.scale


def tiny():
    from minifsdp.fsdp2 import fully_shard

    seed_everything(info.world_size)
    model = fully_shard(Tiny().to(info.device))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def full_state(model, opt) -> dict:
    """Full parameters and optimizer state on rank 0 (a collective)."""
    msd, osd = get_state_dict(checkpoint._unwrap(model), opt, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def equal(a, b) -> bool:
    """Nested dicts/lists of tensors and numbers, compared exactly."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def matches(name: str, model, opt) -> bool | None:
    """Do ``model``/``opt`` hold exactly what ``ref_<name>.pt`` recorded? (rank 0; else None)"""
    got = full_state(model, opt)
    if info.rank != 0:
        return None
    return equal(got, torch.load(D / f"ref_{name}.pt", weights_only=False))


def save(name: str, model, opt, step: int) -> None:
    t0 = time.perf_counter()
    path = save_checkpoint(D / name, model, opt, step=step, extra={"global_batch": 24})
    results[f"save_s_{name}"] = time.perf_counter() - t0
    results[f"bytes_{name}"] = checkpoint.rank_bytes(path, info.rank)
    ref = full_state(model, opt)
    if info.rank == 0:
        torch.save(ref, D / f"ref_{name}.pt")


def load(name: str, model, opt) -> dict:
    t0 = time.perf_counter()
    loaded = load_checkpoint(D / name, model, opt)
    results[f"load_s_{name}"] = time.perf_counter() - t0
    return {"step": loaded["step"], "world_size": loaded["world_size"],
            "rng_restored": loaded["rng_restored"]}


def train_steps(model, opt, start: int, n: int) -> list[float]:
    batches = train.make_batches(args, info, start_step=start)
    return [train.global_mean(train.train_step(model, opt, *next(batches)), info)
            for _ in range(n)]


def tiny_step(model, opt) -> None:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4, 8, generator=g).to(info.device)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


if cli.phase == "save4":
    model, opt = build("fsdp2", seed=0)
    results["losses"] = train_steps(model, opt, 0, 2)
    save("a", model, opt, step=2)
    results["next_loss"] = train_steps(model, opt, 2, 1)[0]
    tmodel, topt = tiny()
    tiny_step(tmodel, topt)
    save("tiny", tmodel, topt, step=1)

elif cli.phase == "load2":
    model, opt = build("fsdp2", seed=1)
    results["loaded_a"] = load("a", model, opt)
    results["a_matches"] = matches("a", model, opt)
    for strategy in ["torch_ddp", "bucketed_ddp"]:  # sharded -> replicated
        m, o = build(strategy, seed=1)
        load("a", m, o)
        results[f"a_matches_{strategy}"] = matches("a", m, o)
    save("ddp", m, o, step=2)  # replicated: DCP writes each tensor once
    results["first_loss"] = train_steps(model, opt, 2, 1)[0]
    save("b", model, opt, step=3)
    results["next_loss"] = train_steps(model, opt, 3, 1)[0]
    tmodel, topt = tiny()
    load("tiny", tmodel, topt)
    results["tiny_matches"] = matches("tiny", tmodel, topt)

    # Corrupt copies of D/a: every rank must raise the same CheckpointError (Note [atomic save]).
    bad = D / "corrupt"
    if info.rank == 0:
        shutil.rmtree(bad, ignore_errors=True)
        src = D / "a" / "step_000002"
        for case in ["truncated", "no_manifest", "zeroed", "bad_metadata"]:
            shutil.copytree(src, bad / case)
        shard = bad / "truncated" / "__3_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        (bad / "no_manifest" / "manifest.json").unlink()
        shard = bad / "zeroed" / "__3_0.distcp"  # same size: only DCP's read can tell
        shard.write_bytes(bytes(shard.stat().st_size))
        meta = bad / "bad_metadata" / ".metadata"
        meta.write_bytes(bytes(meta.stat().st_size))
        (bad / "bad_latest").mkdir()
        (bad / "bad_latest" / "latest").write_text("step_000099\n")
    dist.barrier()
    errors = {}
    for case in ["truncated", "no_manifest", "zeroed", "bad_metadata", "bad_latest", "missing"]:
        try:
            load_checkpoint(bad / case, model, opt)
            errors[case] = None
        except CheckpointError as e:
            errors[case] = str(e)
    results["errors"] = errors
    try:  # ZeRO's flat optimizer shards: refused with a pointer to what works
        m, o = train.STRATEGIES["zero1"](train.make_model(args).to(info.device), info, args)
        save_checkpoint(bad / "zero", m, o, step=1)
    except NotImplementedError as e:
        results["zero1_error"] = str(e)

else:  # load3
    model, opt = build("fsdp2", seed=2)
    results["loaded_b"] = load("b", model, opt)
    results["b_matches"] = matches("b", model, opt)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, args.vocab_size, (2, args.seq_len), generator=g)
    with torch.no_grad():
        logits = model(tokens.to(info.device)).cpu()
    if info.rank == 0:
        torch.save({"tokens": tokens, "logits": logits}, D / "logits_b.pt")
    results["first_loss"] = train_steps(model, opt, 3, 1)[0]
    m, o = build("fsdp2", seed=2)
    results["loaded_ddp"] = load("ddp", m, o)  # replicated -> sharded
    results["ddp_matches_a"] = matches("a", m, o)
    tmodel, topt = tiny()
    load("tiny", tmodel, topt)
    results["tiny_matches"] = matches("tiny", tmodel, topt)
    tiny_step(tmodel, topt)  # training goes on from empty shards too

finish(results)
