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

import harness

STRATEGIES = ("torch_ddp", "bucketed_ddp", "ddp")


def parse_args(argv=None) -> argparse.Namespace:
    return harness.parse_args(__doc__, lambda p: p.add_argument(
        "--bucket-cap-mb", type=float, default=25.0), argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from minifsdp.ddp import BucketedDDP, NaiveDDP
    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.models import GPT, count_params

    info = dist_setup()
    cfg, x, y = harness.gpt_and_batch(args, info)
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
    times = harness.time_rounds(models, opts, x, y, info, args)
    finish({"times": times, "num_params": count_params(models["ddp"].module),
            "world_size": info.world_size, "buckets": len(models["bucketed_ddp"].buckets),
            "device": str(info.device)})


def driver(args: argparse.Namespace) -> None:
    rows = harness.launch(__file__, args, "ddp", "torch_ddp",
                          ("--bucket-cap-mb", args.bucket_cap_mb), timeout=900)
    r = rows[0].run.ranks[0]
    print(f"GPT: {r['num_params'] / 1e6:.2f} M params ({4 * r['num_params'] / 2**20:.1f} MiB "
          f"of fp32 gradients), bucket cap {args.bucket_cap_mb} MiB -> {r['buckets']} buckets, "
          f"{args.batch} x {args.seq_len} tokens per rank, device {r['device']}")
    print(f"median of {args.jobs} job(s) x {args.rounds} rounds x {args.steps} steps per "
          f"strategy, after {args.warmup} warm-up steps\n")
    print(f"{'ranks':>5} {'torch DDP':>10} {'Bucketed':>10} {'Naive':>10} "
          f"{'Bucketed/torch':>15} {'(rounds)':>13} {'Naive/torch':>12} {'(rounds)':>13}")
    for row in rows:
        med, per_round = row.med, row.per_round
        t, b, v = med["torch_ddp"], med["bucketed_ddp"], med["ddp"]
        print(f"{row.n:>5} {1e3 * t:>8.1f}ms {1e3 * b:>8.1f}ms {1e3 * v:>8.1f}ms "
              f"{b / t:>14.3f}x {harness.spread(per_round['bucketed_ddp']):>13} {v / t:>11.3f}x "
              f"{harness.spread(per_round['ddp']):>13}")
    print("\n(rounds): the lowest and highest ratio among the rounds' medians")
    if args.jobs > 1:
        for row in rows:
            print(f"N = {row.n}: Bucketed/torch job by job: "
                  + " ".join(f"{x:.3f}" for x in row.per_job["bucketed_ddp"]))

if __name__ == "__main__":
    harness.main(worker, driver, parse_args())
