"""Step time of NaiveDDP and BucketedDDP relative to torch DDP, measured in the same job.

    python benchmarks/ddp.py                     # world sizes 2 and 4, prints a table
    python benchmarks/ddp.py --world-sizes 2 --steps 30

The script launches itself under torchrun (``minifsdp.launch.torchrun``). Each worker builds
the same GPT three times -- wrapped by torch DDP, ``BucketedDDP`` and ``NaiveDDP`` -- and times
training steps (forward, backward, optimizer step) in interleaved rounds, so that drift in the
machine's speed hits all three alike. A step's time is the slowest rank's, after a barrier; we
report the median over all rounds' steps after warm-up, and the range of the per-round ratios
as a measure of the machine's noise. Not part of the test suite.

The GPT is sized so that communication matters: a few MB of fp32 gradients against a small
batch. On a CPU-only machine all ranks share the same cores and gloo's all-reduce goes through
the kernel's loopback, so absolute numbers say little about GPUs; the ratios compare the
implementations under the same conditions.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

STRATEGIES = ("torch_ddp", "bucketed_ddp", "ddp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=4, help="timed steps per strategy per round")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from minifsdp.ddp import BucketedDDP, NaiveDDP
    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.models import GPT, GPTConfig, count_params
    from minifsdp.train import loss_fn

    info = dist_setup()
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    ids = [info.device.index] if info.device.type == "cuda" else None
    wrap = {"torch_ddp": lambda m: DistributedDataParallel(m, device_ids=ids,
                                                          bucket_cap_mb=args.bucket_cap_mb),
            "bucketed_ddp": lambda m: BucketedDDP(m, bucket_cap_mb=args.bucket_cap_mb),
            "ddp": NaiveDDP}
    models, opts = {}, {}
    for name in STRATEGIES:
        seed_everything(0)
        models[name] = wrap[name](GPT(cfg).to(info.device))
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(info.rank)
    seq = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=g)
    x, y = seq[:, :-1].to(info.device), seq[:, 1:].to(info.device)

    def step(name: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        loss_fn(models[name](x), y).backward()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
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
    n_params = count_params(models["ddp"].module)
    finish({"times": times, "num_params": n_params, "world_size": info.world_size,
            "buckets": len(models["bucketed_ddp"].buckets), "device": str(info.device)})


def main(args: argparse.Namespace) -> None:
    from minifsdp.launch import torchrun

    argv = ["--steps", args.steps, "--rounds", args.rounds, "--warmup", args.warmup,
            "--batch", args.batch, "--n-layer", args.n_layer, "--d-model", args.d_model,
            "--seq-len", args.seq_len, "--bucket-cap-mb", args.bucket_cap_mb]
    rows = []
    for n in args.world_sizes:
        run = torchrun(__file__, *argv, nproc=n, chapter="benchmarks", name=f"ddp_{n}",
                       timeout=900)
        r = run.ranks[0]
        med = {k: statistics.median(sum(v, [])) for k, v in r["times"].items()}
        # the ratio within each round, to show how much the machine's noise moves it
        per_round = {k: [statistics.median(a) / statistics.median(t) for a, t in
                         zip(r["times"][k], r["times"]["torch_ddp"])] for k in STRATEGIES[1:]}
        rows.append((n, r, med, per_round))
    r = rows[0][1]
    print(f"GPT: {r['num_params'] / 1e6:.2f} M params ({4 * r['num_params'] / 2**20:.1f} MiB "
          f"of fp32 gradients), bucket cap {args.bucket_cap_mb} MiB -> {r['buckets']} buckets, "
          f"{args.batch} x {args.seq_len} tokens per rank, device {r['device']}")
    print(f"median of {args.rounds} x {args.steps} steps per strategy, after {args.warmup} "
          "warm-up steps\n")
    print(f"{'ranks':>5} {'torch DDP':>10} {'Bucketed':>10} {'Naive':>10} "
          f"{'Bucketed/torch':>15} {'(rounds)':>13} {'Naive/torch':>12} {'(rounds)':>13}")
    for n, _, med, per_round in rows:
        t, b, v = med["torch_ddp"], med["bucketed_ddp"], med["ddp"]
        spread = {k: f"{min(x):.2f}-{max(x):.2f}" for k, x in per_round.items()}
        print(f"{n:>5} {1e3 * t:>8.1f}ms {1e3 * b:>8.1f}ms {1e3 * v:>8.1f}ms "
              f"{b / t:>14.3f}x {spread['bucketed_ddp']:>13} {v / t:>11.3f}x "
              f"{spread['ddp']:>13}")
    print("\n(rounds): the lowest and highest ratio among the rounds' medians")


if __name__ == "__main__":
    cli = parse_args()
    worker(cli) if "RANK" in os.environ else main(cli)
