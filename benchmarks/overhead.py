"""The GPU bench's CPU side, on a CPU: each strategy's per-step bookkeeping against torch's.

    python benchmarks/overhead.py                    # every pair of gpucheck.BENCH_PAIRS
    python benchmarks/overhead.py --pairs fsdp2 --rounds 10

On a GPU a small model's step is as long as the CPU takes to issue it (benchmarks/RESULTS.md,
"Why bf16 FSDP2 is 2.6-2.8x its compute-only step"), so Python per parameter is what separates
ours from torch's there. This runs the same pairs (``minifsdp.gpucheck.BENCH_PAIRS``, built by
``gpucheck.build``) at world size 1 on one CPU thread, on a GPT so small (12 layers, d_model 32,
8 tokens) that a step is mostly that Python: ours, torch's and the compute-only step, timed in
interleaved rounds, medians in ms. A proxy, not a GPU measurement: it finds where the Python
goes (run it under cProfile), and a GPU session confirms what it changes. Not part of the
test suite.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

GPT = ("--model", "gpt", "--n-layer", 12, "--d-model", 32, "--n-head", 2, "--vocab-size", 64,
       "--seq-len", 8, "--global-batch", 1, "--optimizer", "adamw")


def worker(args: argparse.Namespace) -> None:
    import torch

    from minifsdp.dist import dist_setup
    from minifsdp.gpucheck import BENCH_PAIRS, build, compute_only, time_interleaved

    torch.set_num_threads(1)
    info = dist_setup()
    for pair in BENCH_PAIRS:
        if args.pairs and not any(p in pair.name for p in args.pairs):
            continue
        # --foreach: AdamW's multi-tensor kernels, as on a GPU (a CPU defaults to its loop)
        foreach = True if args.foreach else None
        runs = [build(s, pair.extra, info, GPT, 5, foreach) for s in (pair.ours, pair.torch)]
        runs.append(compute_only(pair, info, GPT, 5, foreach))
        x = torch.randint(runs[0][0].vocab_size, (1, runs[0][0].seq_len))
        y = torch.roll(x, -1, dims=1)
        times = time_interleaved([(m, o) for _, m, o in runs], x, y, args.rounds, args.steps,
                                 args.warmup)
        ours, theirs, alone = (1e3 * statistics.median(t) for t in times)
        print(f"{pair.name:62s} {ours:7.1f} {theirs:7.1f} {alone:8.1f}   {ours / theirs:.2f}x",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", nargs="*", default=[], help="substrings of the pairs' names")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--foreach", action="store_true",
                   help="AdamW with foreach=True for all three runs, the path a GPU takes")
    args = p.parse_args()
    if "RANK" in os.environ:
        return worker(args)
    print(f"{'pair (ms per step, world size 1, one CPU thread)':62s} {'ours':>7} {'torch':>7} "
          f"{'compute':>8}   ours/torch")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MINIFSDP_BACKEND": "gloo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           __file__, *sys.argv[1:]]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    print("".join(line + "\n" for line in out.stdout.splitlines()
                  if "this job runs" not in line), end="")
    if out.returncode:
        sys.exit(f"overhead.py: the worker failed (exit code {out.returncode}):\n{out.stderr}")


if __name__ == "__main__":
    main()
