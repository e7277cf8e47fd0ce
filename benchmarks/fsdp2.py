"""minifsdp's ``fully_shard`` relative to torch's, measured in the same job: step time and
per-rank peak memory.

    python benchmarks/fsdp2.py                     # world sizes 2 and 4, prints a table
    python benchmarks/fsdp2.py --world-sizes 2 --steps 30

The script launches itself under torchrun (``minifsdp.launch.torchrun``). Each worker builds
the same GPT twice -- sharded by ``torch.distributed.fsdp.fully_shard`` and by
``minifsdp.fsdp2.fully_shard``, each block a unit, then the root -- and times training steps
(forward, backward, optimizer step) in interleaved rounds, so that drift in the machine's
speed hits both alike. A step's time is the slowest rank's, after a barrier; we report the
median over all rounds' steps after warm-up, and the range of the per-round ratios as a
measure of the machine's noise. Then one more step of each runs under
``minifsdp.memory.MemoryTracker`` (the same tracker for both) for the per-rank peak. Not part
of the test suite.

Prefetching (chapter 06, ``minifsdp/fsdp2/prefetch.py``) is compared pair by pair, each
ratio against the torch configuration that issues the same all-gathers in the same order:

    default     torch's default (implicit backward prefetch)  vs ours' default (the same)
    explicit    torch with set_modules_to_forward/backward_prefetch one block ahead
                vs ours with the same lists
    implicit    the same torch run vs our implicit forward + backward prefetch (no lists)
    off         torch's default vs ours with prefetching off (what prefetching buys us)
    bf16        both with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on every
                unit and output_dtype=fp32 on the root (chapter 07), default prefetching

On a CPU-only machine all ranks share the same cores and gloo's collectives go through the
kernel's loopback, so absolute numbers say little about GPUs; the ratios compare the two
implementations under the same conditions. On CPU torch's prefetches are *blocking* gloo
all-gathers issued earlier (its overlap comes from CUDA streams), while ours are async gloo
work that runs on gloo's thread during compute -- with two cores shared by all ranks, that
thread competes with compute for a core.
"""

from __future__ import annotations

import argparse

import harness

# name: (implementation, --forward-prefetch, --backward-prefetch, bf16 mixed precision), as
# in minifsdp.train
STRATEGIES = {
    "torch": ("torch", "none", "implicit", False),
    "minifsdp": ("minifsdp", "none", "implicit", False),
    "torch_explicit": ("torch", "explicit", "explicit", False),
    "minifsdp_explicit": ("minifsdp", "explicit", "explicit", False),
    "minifsdp_implicit": ("minifsdp", "implicit", "implicit", False),
    "minifsdp_off": ("minifsdp", "none", "none", False),
    "torch_bf16": ("torch", "none", "implicit", True),
    "minifsdp_bf16": ("minifsdp", "none", "implicit", True),
}
PAIRS = [("default", "torch", "minifsdp"), ("explicit", "torch_explicit", "minifsdp_explicit"),
         ("implicit", "torch_explicit", "minifsdp_implicit"), ("off", "torch", "minifsdp_off"),
         ("bf16", "torch_bf16", "minifsdp_bf16")]


def parse_args(argv=None) -> argparse.Namespace:
    return harness.parse_args(__doc__, argv=argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard
    from minifsdp.models import GPT, count_params
    from minifsdp.train import set_prefetch

    info = dist_setup()
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    cfg, x, y = harness.gpt_and_batch(args, info)
    shard = {"torch": torch_fully_shard, "minifsdp": fully_shard}
    policy = {"torch": TorchPolicy, "minifsdp": MixedPrecisionPolicy}
    models, opts = {}, {}
    for name, (impl, forward, backward, bf16) in STRATEGIES.items():
        seed_everything(0)
        model = GPT(cfg).to(info.device)
        n_params = count_params(model)
        unit_mp, root_mp = {}, {}
        if bf16:
            unit_mp = {"mp_policy": policy[impl](torch.bfloat16, torch.float32)}
            root_mp = {"mp_policy": policy[impl](torch.bfloat16, torch.float32, torch.float32)}
        for block in model.blocks:
            shard[impl](block, mesh=mesh, **unit_mp)
        models[name] = shard[impl](model, mesh=mesh, **root_mp)
        set_prefetch(models[name], argparse.Namespace(forward_prefetch=forward,
                                                      backward_prefetch=backward))
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-4)
    times = harness.time_rounds(models, opts, x, y, info, args)
    peaks = harness.tracked_peaks(models, opts, x, y, info)
    finish({"times": times, "peaks": peaks, "num_params": n_params,
            "world_size": info.world_size, "device": str(info.device)})


def driver(args: argparse.Namespace) -> None:
    rows = harness.launch(__file__, args, "fsdp2", "torch", timeout=900)
    r = rows[0].run.ranks[0]
    print(f"GPT: {r['num_params'] / 1e6:.2f} M params, {args.n_layer} blocks + root as units, "
          f"{args.batch} x {args.seq_len} tokens per rank, AdamW, device {r['device']}")
    print(f"median of {args.jobs} job(s) x {args.rounds} x {args.steps} steps per implementation,"
          f" after {args.warmup} warm-up steps; peak = MemoryTracker, one step\n")
    print(f"{'ranks':>5} {'prefetch':>9} {'torch':>9} {'minifsdp':>9} {'time ratio':>11} "
          f"{'(rounds)':>11} {'torch peak':>11} {'minifsdp peak':>14} {'peak ratio':>11}")
    for row in rows:
        n, run, med = row.n, row.run, row.med
        for label, ref, name in PAIRS:
            t, m = med[ref], med[name]
            per_round = row.ratios(name, ref)
            ours = max(q["peaks"][name]["total"] for q in run.ranks)
            theirs = max(q["peaks"][ref]["total"] for q in run.ranks)
            print(f"{n:>5} {label:>9} {1e3 * t:>7.1f}ms {1e3 * m:>7.1f}ms {m / t:>10.3f}x "
                  f"{harness.spread(per_round):>11} {theirs / 2**20:>9.2f}MiB "
                  f"{ours / 2**20:>12.2f}MiB {ours / theirs:>10.3f}x")
    print("\n(rounds): the lowest and highest ratio among the rounds' medians; peaks: the "
          "largest over ranks. Pairs: see the module docstring.")
    for row in rows:
        n, run = row.n, row.run
        for name in STRATEGIES:
            cats = run.ranks[0]["peaks"][name]
            print(f"rank 0 at N = {n}, {name:>8}'s peak: " + ", ".join(
                f"{k} {v / 2**20:.2f}" for k, v in cats.items() if v and k != "total") + " MiB")


if __name__ == "__main__":
    harness.main(worker, driver, parse_args())
