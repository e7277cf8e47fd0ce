"""Step time and per-rank peak memory of minifsdp's FSDP1 relative to torch FSDP1, same job.

    python benchmarks/fsdp1.py                     # world sizes 2 and 4, prints a table
    python benchmarks/fsdp1.py --world-sizes 2 --steps 3 --rounds 5

The script launches itself under torchrun (``minifsdp.launch.torchrun``). Each worker builds the
same GPT three times -- wrapped by torch FSDP1 with its defaults (``BACKWARD_PRE`` prefetch),
by torch FSDP1 without prefetching, and by ``minifsdp.fsdp1`` -- all FULL_SHARD, each
transformer block a unit, and times training steps (forward, backward, AdamW step) in
interleaved rounds, so that drift in the machine's speed hits all alike. A step's time is the
slowest rank's, after a barrier; we report the median over all rounds' steps after warm-up and
the range of the per-round ratios, the machine's noise. Memory: one more step of each under
``MemoryTracker``, after warm-up (the optimizer state exists), the largest peak over ranks.
Not part of the test suite.

minifsdp's FSDP1 does not prefetch (chapter 06): it gathers a unit when autograd reaches it,
so its comparison with torch's defaults includes the cost of not overlapping, and the
"no prefetch" column isolates the rest. On a CPU-only machine all ranks share the same cores
and gloo goes through the kernel's loopback, so absolute numbers say little about GPUs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

STRATEGIES = ("torch", "torch_noprefetch", "minifsdp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=4, help="timed steps per strategy per round")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from minifsdp import fsdp1
    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.memory import MemoryTracker
    from minifsdp.models import GPT, Block, GPTConfig, count_params
    from minifsdp.train import loss_fn

    info = dist_setup()
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    torch_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    wrap = {
        "torch": lambda m: TorchFSDP(m, device_id=info.device, use_orig_params=True,
                                     auto_wrap_policy=torch_policy),
        "torch_noprefetch": lambda m: TorchFSDP(m, device_id=info.device, use_orig_params=True,
                                                auto_wrap_policy=torch_policy,
                                                backward_prefetch=None),
        "minifsdp": lambda m: fsdp1.FullyShardedDataParallel(
            m, device_id=info.device,
            auto_wrap_policy=fsdp1.transformer_auto_wrap_policy({Block})),
    }
    models, opts = {}, {}
    for name in STRATEGIES:
        seed_everything(0)
        models[name] = wrap[name](GPT(cfg).to(info.device))
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(info.rank)
    seq = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=g)
    x, y = seq[:, :-1].to(info.device), seq[:, 1:].to(info.device)

    def train_step(name: str) -> None:
        loss_fn(models[name](x), y).backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)

    def step(name: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        train_step(name)
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0], device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        return float(t)

    for name in STRATEGIES:
        for _ in range(args.warmup):
            step(name)
    times: dict[str, list[list[float]]] = {name: [] for name in STRATEGIES}  # [round][step]
    for _ in range(args.rounds):
        for name in STRATEGIES:
            times[name].append([step(name) for _ in range(args.steps)])
    peaks = {}
    for name in STRATEGIES:
        tracker = MemoryTracker(models[name], opts[name], device=info.device)
        with tracker:
            tracker.register((x, y), "activations")
            train_step(name)
        peaks[name] = {"total": tracker.peak, **tracker.peak_by_category}
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, peaks)
    worst = {name: max(p[name]["total"] for p in everyone) for name in STRATEGIES}
    finish({"times": times, "peaks": peaks, "worst_peak": worst, "world_size": info.world_size,
            "num_params": count_params(GPT(cfg)), "device": str(info.device)})


def main(args: argparse.Namespace) -> None:
    from minifsdp.launch import torchrun

    argv = ["--steps", args.steps, "--rounds", args.rounds, "--warmup", args.warmup,
            "--batch", args.batch, "--n-layer", args.n_layer, "--d-model", args.d_model,
            "--seq-len", args.seq_len]
    rows = []
    for n in args.world_sizes:
        run = torchrun(__file__, *argv, nproc=n, chapter="benchmarks", name=f"fsdp1_{n}",
                       timeout=1200)
        r = run.ranks[0]
        med = {k: statistics.median(sum(v, [])) for k, v in r["times"].items()}
        per_round = {k: [statistics.median(a) / statistics.median(t) for a, t in
                         zip(r["times"][k], r["times"]["torch"])] for k in STRATEGIES[1:]}
        rows.append((n, r, med, per_round))
    r = rows[0][1]
    print(f"GPT: {r['num_params'] / 1e6:.2f} M params ({4 * r['num_params'] / 2**20:.1f} MiB "
          f"fp32), {args.n_layer} blocks = units, FULL_SHARD, {args.batch} x {args.seq_len} "
          f"tokens per rank, device {r['device']}")
    print(f"time: median of {args.rounds} x {args.steps} steps per strategy, after "
          f"{args.warmup} warm-up steps; memory: MemoryTracker peak, largest over ranks\n")
    print(f"{'ranks':>5} {'torch':>9} {'torch np':>9} {'minifsdp':>9} {'mini/torch':>11} "
          f"{'(rounds)':>10} {'mini/np':>8} {'peak torch':>11} {'peak np':>9} {'peak mini':>10} "
          f"{'mini/torch':>11}")
    for n, r, med, per_round in rows:
        t, tn, m = med["torch"], med["torch_noprefetch"], med["minifsdp"]
        spread = f"{min(per_round['minifsdp']):.2f}-{max(per_round['minifsdp']):.2f}"
        pk = r["worst_peak"]
        print(f"{n:>5} {1e3 * t:>7.1f}ms {1e3 * tn:>7.1f}ms {1e3 * m:>7.1f}ms {m / t:>10.3f}x "
              f"{spread:>10} {m / tn:>7.3f}x {pk['torch'] / 2**20:>9.2f}Mi "
              f"{pk['torch_noprefetch'] / 2**20:>7.2f}Mi {pk['minifsdp'] / 2**20:>8.2f}Mi "
              f"{pk['minifsdp'] / pk['torch']:>10.3f}x")
    print("\n(rounds): the lowest and highest minifsdp/torch ratio among the rounds' medians; "
          "np: torch FSDP1 without backward prefetch")


if __name__ == "__main__":
    cli = parse_args()
    worker(cli) if "RANK" in os.environ else main(cli)
