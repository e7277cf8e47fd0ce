"""What every benchmark here shares: the command line, the GPT and its batch, interleaved timed
rounds, a tracked step for the peak, and the launch + medians on the driver's side.

A benchmark script defines ``worker(args)`` (build its wrapped models, then call
``time_rounds`` and maybe ``tracked_peaks``) and calls ``run(__file__, worker, ...)``; it runs
once as the driver, which launches itself under torchrun per world size. Not part of the tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# (flag, type, default, help): forwarded unchanged from the driver to its workers
COMMON = [("--steps", int, 4, "timed steps per strategy per round"),
          ("--rounds", int, 10, None), ("--warmup", int, 3, None),
          ("--batch", int, 2, "sequences per rank"), ("--n-layer", int, 4, None),
          ("--d-model", int, 256, None), ("--seq-len", int, 64, None)]


def parse_args(doc: str, extra: Callable[[argparse.ArgumentParser], None] | None = None,
               argv=None) -> argparse.Namespace:
    """``--world-sizes`` and ``COMMON``, plus what ``extra(parser)`` adds (forwarded too)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    for flag, kind, default, help_ in COMMON:
        p.add_argument(flag, type=kind, default=default, help=help_)
    p.add_argument("--jobs", type=int, default=1,
                   help="separate torchrun jobs per world size, pooled (see launch)")
    if extra:
        extra(p)
    return p.parse_args(argv)


def gpt_and_batch(args: argparse.Namespace, info):
    """``(cfg, x, y)``: the benchmark GPT's config and this rank's batch ``(batch, seq_len)``."""
    import torch

    from minifsdp.models import GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer,
                    n_head=max(1, args.d_model // 64), d_model=args.d_model)
    g = torch.Generator().manual_seed(info.rank)
    seq = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=g)
    return cfg, seq[:, :-1].to(info.device), seq[:, 1:].to(info.device)


def train_step(model, opt, x, y) -> None:
    from minifsdp.train import loss_fn

    loss_fn(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def time_rounds(models: dict, opts: dict, x, y, info, args) -> dict[str, list[list[float]]]:
    """Warm up, then ``rounds`` x (every strategy ``steps`` times), interleaved so that drift
    in the machine's speed hits all alike, and the order rotated by one each round so that
    each strategy runs first (right after the warm-up or the previous round) equally often
    over ``len(models)`` rounds, not always the same one. A step lasts as long as its slowest
    rank's, after a barrier. Returns ``times[name][round][step]`` in seconds."""
    import torch
    import torch.distributed as dist

    def step(name: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        train_step(models[name], opts[name], x, y)
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        t = torch.tensor([time.perf_counter() - t0], device=info.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    for name in models:
        for _ in range(args.warmup):
            step(name)
    times: dict[str, list[list[float]]] = {name: [] for name in models}
    names = list(models)
    for r in range(args.rounds):
        for name in rotated(names, r):
            times[name].append([step(name) for _ in range(args.steps)])
    return times


def rotated(names: list[str], r: int) -> list[str]:
    """Round ``r``'s order: ``names`` rotated left by ``r`` (every rank computes the same)."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def tracked_peaks(models: dict, opts: dict, x, y, info) -> dict[str, dict[str, int]]:
    """One more step of each under ``MemoryTracker``: ``{name: {"total", <category>...}}``."""
    from minifsdp.memory import MemoryTracker

    peaks = {}
    for name in models:
        tracker = MemoryTracker(models[name], opts[name], device=info.device)
        with tracker:
            tracker.register((x, y), "activations")
            train_step(models[name], opts[name], x, y)
        peaks[name] = {"total": tracker.peak, **tracker.peak_by_category}
    return peaks


@dataclass
class Row:
    """One world size's results, pooled over ``--jobs`` separate torchrun jobs."""

    n: int
    run: Any                    # the last job's run (for what every job reports alike)
    reference: str              # the strategy the ratios divide by
    times: dict                 # times[name][round][step], every job's rounds one after another
    per_job: dict               # name -> its ratio to the reference, job by job

    @property
    def med(self) -> dict:
        """name -> median step time over every step of every job."""
        return {k: statistics.median(sum(v, [])) for k, v in self.times.items()}

    @property
    def per_round(self) -> dict:
        """name -> its ratio to the reference, round by round."""
        return {k: self.ratios(k, self.reference) for k in self.times}

    def ratios(self, name: str, ref: str) -> list[float]:
        """``name``'s ratio to ``ref`` round by round (each round's medians)."""
        return [statistics.median(a) / statistics.median(b)
                for a, b in zip(self.times[name], self.times[ref])]


def launch(script: str, args: argparse.Namespace, name: str, reference: str,
           extra_argv: tuple = (), timeout: float = 1200) -> list[Row]:
    """Run ``script``'s workers at each world size, ``args.jobs`` times. One ``Row`` per world
    size: the median step time per strategy over all steps, and each strategy's ratio to
    ``reference`` round by round and job by job (their spreads are the machine's noise).

    Why several jobs: one job's ratio moves by more than the gaps these benchmarks look for
    (BucketedDDP / torch DDP: 0.95-1.03 over six jobs of 40 steps each on a 2-core VM,
    2026-12-06), from the rounds' noise and from what a job fixes once at its start (where its
    buffers land, which cores its threads get); pooled jobs average both."""
    from minifsdp.launch import torchrun

    argv = [v for flag, *_ in COMMON for v in (flag, getattr(args, flag[2:].replace("-", "_")))]
    rows = []
    for n in args.world_sizes:
        times: dict[str, list] = {}
        per_job: dict[str, list[float]] = {}
        for j in range(args.jobs):
            run = torchrun(script, *argv, *extra_argv, nproc=n, chapter="benchmarks",
                           name=f"{name}_{n}" + (f"_job{j}" if args.jobs > 1 else ""),
                           timeout=timeout)
            job = run.ranks[0]["times"]
            ref = statistics.median(sum(job[reference], []))
            for k, v in job.items():
                times.setdefault(k, []).extend(v)
                per_job.setdefault(k, []).append(statistics.median(sum(v, [])) / ref)
        rows.append(Row(n, run, reference, times, per_job))
    return rows


def spread(ratios: list[float]) -> str:
    return f"{min(ratios):.2f}-{max(ratios):.2f}"


def main(worker: Callable, driver: Callable, args: argparse.Namespace) -> None:
    """A worker under torchrun (``RANK`` is set), the driver otherwise."""
    worker(args) if "RANK" in os.environ else driver(args)
