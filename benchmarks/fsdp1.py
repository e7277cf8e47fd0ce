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

import harness

STRATEGIES = ("torch", "torch_noprefetch", "minifsdp")


def parse_args(argv=None) -> argparse.Namespace:
    return harness.parse_args(__doc__, argv=argv)


def worker(args: argparse.Namespace) -> None:
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from minifsdp import fsdp1
    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.models import GPT, Block, count_params

    info = dist_setup()
    cfg, x, y = harness.gpt_and_batch(args, info)
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
    times = harness.time_rounds(models, opts, x, y, info, args)
    peaks = harness.tracked_peaks(models, opts, x, y, info)
    everyone = [None] * info.world_size
    dist.all_gather_object(everyone, peaks)
    worst = {name: max(p[name]["total"] for p in everyone) for name in STRATEGIES}
    finish({"times": times, "peaks": peaks, "worst_peak": worst, "world_size": info.world_size,
            "num_params": count_params(GPT(cfg)), "device": str(info.device)})


def driver(args: argparse.Namespace) -> None:
    rows = harness.launch(__file__, args, "fsdp1", "torch")
    r = rows[0][1].ranks[0]
    print(f"GPT: {r['num_params'] / 1e6:.2f} M params ({4 * r['num_params'] / 2**20:.1f} MiB "
          f"fp32), {args.n_layer} blocks = units, FULL_SHARD, {args.batch} x {args.seq_len} "
          f"tokens per rank, device {r['device']}")
    print(f"time: median of {args.rounds} x {args.steps} steps per strategy, after "
          f"{args.warmup} warm-up steps; memory: MemoryTracker peak, largest over ranks\n")
    print(f"{'ranks':>5} {'torch':>9} {'torch np':>9} {'minifsdp':>9} {'mini/torch':>11} "
          f"{'(rounds)':>10} {'mini/np':>8} {'peak torch':>11} {'peak np':>9} {'peak mini':>10} "
          f"{'mini/torch':>11}")
    for n, run, med, per_round in rows:
        t, tn, m = med["torch"], med["torch_noprefetch"], med["minifsdp"]
        pk = run.ranks[0]["worst_peak"]
        print(f"{n:>5} {1e3 * t:>7.1f}ms {1e3 * tn:>7.1f}ms {1e3 * m:>7.1f}ms {m / t:>10.3f}x "
              f"{harness.spread(per_round['minifsdp']):>10} {m / tn:>7.3f}x "
              f"{pk['torch'] / 2**20:>9.2f}Mi {pk['torch_noprefetch'] / 2**20:>7.2f}Mi "
              f"{pk['minifsdp'] / 2**20:>8.2f}Mi {pk['minifsdp'] / pk['torch']:>10.3f}x")
    print("\n(rounds): the lowest and highest minifsdp/torch ratio among the rounds' medians; "
          "np: torch FSDP1 without backward prefetch")


if __name__ == "__main__":
    harness.main(worker, driver, parse_args())
