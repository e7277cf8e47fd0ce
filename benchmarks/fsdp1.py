"""Step time and per-rank peak memory of minifsdp's FSDP1 relative to torch FSDP1, same job.

    python benchmarks/fsdp1.py                     # world sizes 2 and 4, prints a table
    python benchmarks/fsdp1.py --world-sizes 2 --steps 3 --rounds 5

The script launches itself under torchrun (``minifsdp.launch.torchrun``). Each worker builds the
same GPT four times -- wrapped by torch FSDP1 and by ``minifsdp.fsdp1``, each with torch's
default ``backward_prefetch=BackwardPrefetch.BACKWARD_PRE`` and with prefetching off
(``backward_prefetch=None``) -- all FULL_SHARD, each transformer block a unit, and times
training steps (forward, backward, AdamW step) in interleaved rounds, so that drift in the
machine's speed hits all alike. Each row compares like with like: ours against torch with the
same prefetch setting (Note [backward prefetch] in ``minifsdp/fsdp1/options.py``). A step's time
is the slowest rank's, after a barrier; we report the median over all rounds' steps after
warm-up and the range of the per-round ratios, the machine's noise. Memory: one more step of
each under ``MemoryTracker``, after warm-up (the optimizer state exists), the largest peak over
ranks. Not part of the test suite.

On a CPU-only machine all ranks share the same cores, gloo goes through the kernel's loopback
and there are no streams to overlap on, so a prefetch can only move the wait, and absolute
numbers say little about GPUs; the peaks are exact tensor bytes. Ours equal torch's with either
setting: on the CPU both block in each reduce-scatter (Note [final callback] in
``minifsdp/fsdp1/fully_sharded.py``), and BACKWARD_PRE adds exactly one unsharded block to both
peaks.
"""

from __future__ import annotations

import argparse

import harness

# name: (implementation, backward_prefetch); both implementations spell the knob alike
STRATEGIES = {"torch": ("torch", "BACKWARD_PRE"), "minifsdp": ("minifsdp", "BACKWARD_PRE"),
              "torch_off": ("torch", None), "minifsdp_off": ("minifsdp", None)}
PAIRS = [("pre", "torch", "minifsdp"), ("none", "torch_off", "minifsdp_off")]


def parse_args(argv=None) -> argparse.Namespace:
    return harness.parse_args(__doc__, argv=argv)


def worker(args: argparse.Namespace) -> None:
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import BackwardPrefetch as TorchPrefetch
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from minifsdp import fsdp1
    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.models import GPT, Block, count_params

    info = dist_setup()
    cfg, x, y = harness.gpt_and_batch(args, info)
    torch_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})

    def wrap(impl: str, prefetch: str | None, model: torch.nn.Module) -> torch.nn.Module:
        if impl == "torch":
            return TorchFSDP(model, device_id=info.device, use_orig_params=True,
                             auto_wrap_policy=torch_policy,
                             backward_prefetch=prefetch and TorchPrefetch[prefetch])
        return fsdp1.FullyShardedDataParallel(
            model, device_id=info.device, auto_wrap_policy=fsdp1.transformer_auto_wrap_policy(
                {Block}), backward_prefetch=prefetch and fsdp1.BackwardPrefetch[prefetch])

    models, opts = {}, {}
    for name, (impl, prefetch) in STRATEGIES.items():
        seed_everything(0)
        models[name] = wrap(impl, prefetch, GPT(cfg).to(info.device))
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
    r = rows[0].run.ranks[0]
    print(f"GPT: {r['num_params'] / 1e6:.2f} M params ({4 * r['num_params'] / 2**20:.1f} MiB "
          f"fp32), {args.n_layer} blocks = units, FULL_SHARD, {args.batch} x {args.seq_len} "
          f"tokens per rank, device {r['device']}")
    print(f"time: median of {args.jobs} job(s) x {args.rounds} x {args.steps} steps per strategy,"
          f" after {args.warmup} warm-up steps; memory: MemoryTracker peak, largest over ranks\n")
    print(f"{'ranks':>5} {'prefetch':>9} {'torch':>9} {'minifsdp':>9} {'mini/torch':>11} "
          f"{'(rounds)':>10} {'peak torch':>11} {'peak mini':>10} {'mini/torch':>11}")
    for row in rows:
        n, run, med = row.n, row.run, row.med
        worst = run.ranks[0]["worst_peak"]
        for label, ref, name in PAIRS:
            t, m = med[ref], med[name]
            per_round = row.ratios(name, ref)
            print(f"{n:>5} {label:>9} {1e3 * t:>7.1f}ms {1e3 * m:>7.1f}ms {m / t:>10.3f}x "
                  f"{harness.spread(per_round):>10} {worst[ref] / 2**20:>9.2f}Mi "
                  f"{worst[name] / 2**20:>8.2f}Mi {worst[name] / worst[ref]:>10.3f}x")
    print("\n(rounds): the lowest and highest minifsdp/torch ratio among the rounds' medians, "
          "both with the same backward_prefetch (pre: BACKWARD_PRE, torch's default; none: off)")
    for row in rows:
        n, med = row.n, row.med
        ours, theirs = med["minifsdp"] / med["minifsdp_off"], med["torch"] / med["torch_off"]
        print(f"N = {n}: step time with BACKWARD_PRE / without: minifsdp {ours:.3f}x, "
              f"torch {theirs:.3f}x")


if __name__ == "__main__":
    harness.main(worker, driver, parse_args())
