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

On a CPU-only machine all ranks share the same cores and gloo's collectives go through the
kernel's loopback, so absolute numbers say little about GPUs; the ratios compare the two
implementations under the same conditions. Neither side overlaps communication here (torch's
separate all-gather/reduce-scatter streams exist only on GPUs), so this is the un-prefetched
baseline of chapter 06.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

STRATEGIES = ("torch", "minifsdp")


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
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.fsdp2 import fully_shard
    from minifsdp.memory import MemoryTracker
    from minifsdp.models import GPT, GPTConfig, count_params
    from minifsdp.train import loss_fn

    info = dist_setup()
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    shard = {"torch": torch_fully_shard, "minifsdp": fully_shard}
    models, opts = {}, {}
    for name in STRATEGIES:
        seed_everything(0)
        model = GPT(cfg).to(info.device)
        n_params = count_params(model)
        for block in model.blocks:
            shard[name](block, mesh=mesh)
        models[name] = shard[name](model, mesh=mesh)
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
    peaks, by_category = {}, {}
    for name in STRATEGIES:
        tracker = MemoryTracker(models[name], opts[name], device=info.device)
        with tracker:
            tracker.register((x, y), "activations")
            train_step(name)
        peaks[name], by_category[name] = tracker.peak, tracker.peak_by_category
    finish({"times": times, "peaks": peaks, "peak_by_category": by_category,
            "num_params": n_params,
            "world_size": info.world_size, "device": str(info.device)})


def main(args: argparse.Namespace) -> None:
    from minifsdp.launch import torchrun

    argv = ["--steps", args.steps, "--rounds", args.rounds, "--warmup", args.warmup,
            "--batch", args.batch, "--n-layer", args.n_layer, "--d-model", args.d_model,
            "--seq-len", args.seq_len]
    rows = []
    for n in args.world_sizes:
        run = torchrun(__file__, *argv, nproc=n, chapter="benchmarks", name=f"fsdp2_{n}",
                       timeout=900)
        r = run.ranks[0]
        med = {k: statistics.median(sum(v, [])) for k, v in r["times"].items()}
        per_round = [statistics.median(a) / statistics.median(t)
                     for a, t in zip(r["times"]["minifsdp"], r["times"]["torch"])]
        peaks = [(q["peaks"]["minifsdp"], q["peaks"]["torch"]) for q in run.ranks]
        rows.append((n, r, med, per_round, peaks))
    r = rows[0][1]
    print(f"GPT: {r['num_params'] / 1e6:.2f} M params, {args.n_layer} blocks + root as units, "
          f"{args.batch} x {args.seq_len} tokens per rank, AdamW, device {r['device']}")
    print(f"median of {args.rounds} x {args.steps} steps per implementation, after "
          f"{args.warmup} warm-up steps; peak = MemoryTracker, one step\n")
    print(f"{'ranks':>5} {'torch':>9} {'minifsdp':>9} {'time ratio':>11} {'(rounds)':>11} "
          f"{'torch peak':>11} {'minifsdp peak':>14} {'peak ratio':>11}")
    for n, _, med, per_round, peaks in rows:
        t, m = med["torch"], med["minifsdp"]
        ours, theirs = max(p[0] for p in peaks), max(p[1] for p in peaks)
        print(f"{n:>5} {1e3 * t:>7.1f}ms {1e3 * m:>7.1f}ms {m / t:>10.3f}x "
              f"{min(per_round):.2f}-{max(per_round):.2f} {theirs / 2**20:>9.2f}MiB "
              f"{ours / 2**20:>12.2f}MiB {ours / theirs:>10.3f}x")
    print("\n(rounds): the lowest and highest ratio among the rounds' medians; peaks: the "
          "largest over ranks")
    for n, r, *_ in rows:
        for name in STRATEGIES:
            cats = r["peak_by_category"][name]
            print(f"rank 0 at N = {n}, {name:>8}'s peak: " + ", ".join(
                f"{k} {v / 2**20:.2f}" for k, v in cats.items() if v) + " MiB")


if __name__ == "__main__":
    cli = parse_args()
    worker(cli) if "RANK" in os.environ else main(cli)
