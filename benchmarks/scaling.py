"""Strong scaling of every training strategy: step time and per-rank peak memory at N = 1, 2, 4,
as ratios to N = 1, in one run.

    python benchmarks/scaling.py                         # N = 1, 2, 4; table, JSON and PNG
    python benchmarks/scaling.py --world-sizes 1 2 --rounds 3 --steps 1
    python benchmarks/scaling.py --n-layer 4 --d-model 256 --global-batch 16 --rounds 18

**Strong scaling**: the global batch (``--global-batch`` sequences) is fixed and split over the
N ranks, ``global / N`` each, so ideal scaling is a step time of 1/N of one process's; the
model, the optimizer (AdamW) and the data are the same at every N. For each N the script
launches itself under torchrun (``minifsdp.launch.torchrun``); each worker builds the small
GPT once per strategy through ``minifsdp.train``'s own registry (``minifsdp.strategies``: the
same builders, flags and optimizer as ``python -m minifsdp.train --strategy S``) and times
training steps (forward, backward, optimizer step) in interleaved rounds with the order
rotated each round (``harness.time_rounds``): a step lasts as long as its slowest rank's,
after a barrier, and the step time is the median over all rounds' steps after warm-up. Then
one more step of each runs under ``minifsdp.memory.MemoryTracker``: the peak is that of every
category but ``other`` (tensor bytes; ``other`` holds backward's temporaries and gloo's buffers,
freed by gloo's thread a little earlier or later from run to run), the largest over ranks. Ours
are the same in every run; torch ``fully_shard``'s was not at N = 4 (two executions of chapter 09
differed by 0.66 MB), so only bounds with margin are safe to assert on torch's.
Both FSDP1s wrap each block as a unit with torch's default
``backward_prefetch=BACKWARD_PRE``; both FSDP2s shard each block and then the root.

Every N runs on gloo with CPU tensors (``MINIFSDP_BACKEND=gloo``; ``--backend auto`` applies the
backend rule instead, under which a 1-GPU machine would run N = 1 on the GPU and N = 2, 4 on
the CPU: not a scaling curve). Each rank runs one thread (``OMP_NUM_THREADS=1``, as every
torchrun job here), so on a machine with C cores the ranks share them: beyond N = C, adding
ranks adds no compute, only communication. These times are measured behaviour of gloo on
this machine's CPU cores, not of NCCL on GPUs (where each rank has a device of its own and
the collectives run on separate streams). A strategy that fails at some N is reported as
such (its error in the JSON and the table), not a crash.

Writes ``--out`` (JSON: the configuration, every strategy's median time, per-round medians,
peaks per rank and by category at each N, and the ratios to N = 1) and the same name with
``.png`` (two panels, time and peak ratio to N = 1, one line per strategy). Not part of the
test suite's timings: tests/test_benchmarks.py runs it tiny and checks only exact things.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

# minifsdp.train's strategies, ours beside torch's, and the flags each gets here
STRATEGIES = {
    "ddp": (), "bucketed_ddp": (), "torch_ddp": (), "zero1": (), "zero2": (),
    "fsdp1": ("--auto-wrap", "transformer", "--backward-prefetch", "backward_pre"),
    "torch_fsdp1": ("--auto-wrap", "transformer", "--backward-prefetch", "backward_pre"),
    "fsdp2": (), "torch_fsdp2": (),
}
# forwarded unchanged from the driver to the workers: (flag, type, default, help)
FORWARDED = [("--steps", int, 4, "timed steps per strategy per round"),
             ("--rounds", int, 9, "rounds (9: each of the 9 strategies runs first once)"),
             ("--warmup", int, 2, "untimed steps per strategy first"),
             ("--global-batch", int, 8, "sequences per step over all ranks (strong scaling)"),
             ("--n-layer", int, 2, None), ("--d-model", int, 128, None),
             ("--n-head", int, 4, None), ("--seq-len", int, 64, None),
             ("--vocab-size", int, 64, None)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES),
                   help=f"any of {', '.join(STRATEGIES)}")
    for flag, kind, default, help_ in FORWARDED:
        p.add_argument(flag, type=kind, default=default, help=help_)
    p.add_argument("--backend", choices=["gloo", "auto"], default="gloo",
                   help="gloo: every N on CPU (default); auto: the backend rule")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON path (default runs/benchmarks/scaling/scaling.json); the plot "
                   "goes beside it as .png")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--chapter", default="benchmarks",
                   help="the jobs' results go to runs/<chapter>/scaling_<N>/")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per torchrun job")
    args = p.parse_args(argv)
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown:
        p.error(f"--strategies: unknown {unknown}; choose from {list(STRATEGIES)}")
    if 1 not in args.world_sizes:
        p.error("--world-sizes must include 1: every ratio is to N = 1")
    if any(n < 1 for n in args.world_sizes):
        p.error(f"--world-sizes {args.world_sizes}: each must be >= 1")
    bad = [n for n in args.world_sizes if args.global_batch % n]
    if bad:
        p.error(f"--global-batch {args.global_batch} is not divisible by world sizes {bad}: "
                "strong scaling splits one global batch equally over the ranks")
    for flag in ("steps", "rounds", "global_batch"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    return args


def train_args(name: str, args: argparse.Namespace) -> argparse.Namespace:
    """``minifsdp.train``'s parsed arguments for strategy ``name`` on this GPT."""
    from minifsdp.train import parse_args as train_parse

    return train_parse(["--strategy", name, "--model", "gpt", "--optimizer", "adamw",
                        "--lr", "1e-4", "--global-batch", str(args.global_batch),
                        "--n-layer", str(args.n_layer), "--d-model", str(args.d_model),
                        "--n-head", str(args.n_head), "--seq-len", str(args.seq_len),
                        "--vocab-size", str(args.vocab_size), *STRATEGIES[name]])


def attributed_peak(timeline: list[dict]) -> int:
    """The peak of every category but ``other``: exact bytes, the same in every run."""
    return max(s["total"] - s.get("other", 0) for s in timeline)


def worker(args: argparse.Namespace) -> None:
    import torch

    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.memory import MemoryTracker
    from minifsdp.models import count_params
    from minifsdp.strategies import STRATEGIES as REGISTRY
    from minifsdp.train import make_model, make_optimizer, train_step

    info = dist_setup()
    local = args.global_batch // info.world_size
    g = torch.Generator().manual_seed(1000 + info.rank)  # this rank's share of the batch
    seq = torch.randint(0, args.vocab_size, (local, args.seq_len + 1), generator=g)
    x, y = seq[:, :-1].to(info.device), seq[:, 1:].to(info.device)
    models, opts, errors, n_params = {}, {}, {}, None
    for name in args.strategies:
        targs = train_args(name, args)
        seed_everything(targs.seed)
        model = make_model(targs).to(info.device)
        n_params = count_params(model)
        try:
            setup = REGISTRY[name](model, info, targs)
            model, opt = setup if isinstance(setup, tuple) else (
                setup, make_optimizer(setup.parameters(), targs))
            train_step(model, opt, x, y)  # one step proves it runs here
        except Exception as e:  # noqa: BLE001 -- reported per strategy, not a crash
            errors[name] = f"{type(e).__name__}: {e}"
            continue
        models[name], opts[name] = model, opt
    times = harness.time_rounds(models, opts, x, y, info, args) if models else {}
    peaks = {}
    for name in models:
        tracker = MemoryTracker(model=models[name], optimizer=opts[name], device=info.device)
        with tracker:
            tracker.register((x, y), "activations")
            train_step(models[name], opts[name], x, y, tracker)
        d = tracker.to_dict()
        peaks[name] = {"attributed": attributed_peak(d["timeline"]), "total": d["peak"],
                       "by_category": d["peak_by_category"]}
    finish({"times": times, "peaks": peaks, "errors": errors, "num_params": n_params,
            "world_size": info.world_size, "local_batch": local, "device": str(info.device),
            "backend": info.backend})


def launch(args: argparse.Namespace) -> dict:
    """Run every world size; return the JSON-ready results (see the module docstring)."""
    from minifsdp.launch import torchrun

    argv = [v for flag, *_ in FORWARDED for v in (flag, getattr(args, flag[2:].replace("-", "_")))]
    argv += ["--strategies", *args.strategies, "--world-sizes", *args.world_sizes]
    env = {"MINIFSDP_BACKEND": "gloo"} if args.backend == "gloo" else None
    by_n = {}
    for n in args.world_sizes:
        run = torchrun(__file__, *argv, nproc=n, chapter=args.chapter, name=f"scaling_{n}",
                       timeout=args.timeout, env=env)
        by_n[n] = run
    return summarize(args, {n: run.ranks for n, run in by_n.items()},
                     {n: run.backend.line if run.backend else "" for n, run in by_n.items()})


def summarize(args: argparse.Namespace, ranks_by_n: dict[int, list[dict]],
              backend_lines: dict[int, str]) -> dict:
    """The JSON from every world size's rank results: medians, peaks (largest over ranks) and
    the ratios to N = 1 where both ends ran."""
    r0 = ranks_by_n[1][0]
    results: dict[str, dict[str, dict]] = {s: {} for s in args.strategies}
    for n, ranks in ranks_by_n.items():
        first = ranks[0]
        for s in args.strategies:
            if s in first["errors"]:
                results[s][str(n)] = {"error": first["errors"][s]}
                continue
            rounds = first["times"][s]
            peak_by_rank = [r["peaks"][s]["attributed"] for r in ranks]
            results[s][str(n)] = {
                "time_s": statistics.median(sum(rounds, [])),
                "round_medians_s": [statistics.median(r) for r in rounds],
                "peak_bytes": max(peak_by_rank), "peak_by_rank": peak_by_rank,
                "peak_by_category_rank0": first["peaks"][s]["by_category"],
                "error": None}
    ratios = {s: {} for s in args.strategies}
    for s in args.strategies:
        one = results[s]["1"]
        for n in args.world_sizes:
            cell = results[s][str(n)]
            if one["error"] or cell["error"]:
                ratios[s][str(n)] = None
                continue
            ratios[s][str(n)] = {"time": cell["time_s"] / one["time_s"],
                                 "peak": cell["peak_bytes"] / one["peak_bytes"]}
    return {
        "scaling": "strong: the global batch is fixed and split over the N ranks",
        "config": {k: getattr(args, k.replace("-", "_")) for k in
                   ["world_sizes", "strategies", *(f[2:] for f, *_ in FORWARDED), "backend"]},
        "num_params": r0["num_params"], "cpu_count": os.cpu_count(),
        "device": {str(n): rs[0]["device"] for n, rs in ranks_by_n.items()},
        "backend": {str(n): line for n, line in backend_lines.items()},
        "local_batch": {str(n): rs[0]["local_batch"] for n, rs in ranks_by_n.items()},
        "results": results, "ratios": ratios,
        "unavailable": {s: {n: c["error"] for n, c in results[s].items() if c["error"]}
                        for s in args.strategies if any(c["error"] for c in results[s].values())},
    }


def table(res: dict) -> str:
    """The ratios to N = 1 as text, one row per strategy."""
    ns = res["config"]["world_sizes"]
    head = f"{'strategy':13s} {'N=1 time':>9s} {'N=1 peak':>10s} " + " ".join(
        f"{'time N=' + str(n):>10s} {'peak N=' + str(n):>10s}" for n in ns if n != 1)
    lines = [head]
    for s, by_n in res["results"].items():
        one = by_n["1"]
        if one["error"]:
            lines.append(f"{s:13s} cannot run at N = 1: {one['error']}")
            continue
        cells = []
        for n in ns:
            if n == 1:
                continue
            r = res["ratios"][s][str(n)]
            cells.append(f"{r['time']:>9.2f}x {r['peak']:>9.3f}x" if r else
                         f"{'failed':>10s} {'':>10s}")
        lines.append(f"{s:13s} {1e3 * one['time_s']:>7.1f}ms {one['peak_bytes'] / 2**20:>7.2f}MiB "
                     + " ".join(cells))
    for s, errs in res["unavailable"].items():
        for n, e in errs.items():
            lines.append(f"{s} at N = {n}: {e}")
    return "\n".join(lines)


def plot(res: dict, path: Path | None = None, axes=None):
    """Two panels, step time and peak as ratios to N = 1 against N, one line per strategy,
    beside the ideal 1/N. Saves to ``path`` if given; returns the figure."""
    import matplotlib
    if path is not None and axes is None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    ns = res["config"]["world_sizes"]
    fig = None
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    markers = ["o", "s", "^", "D", "v", "P", "X", "*", "h"]
    for (s, by_n), marker in zip(res["ratios"].items(), markers):
        pts = [(n, by_n[str(n)]) for n in ns if by_n[str(n)]]
        if not pts:
            continue
        for ax, key in zip(axes, ("time", "peak")):
            ax.plot([n for n, _ in pts], [r[key] for _, r in pts], marker=marker, label=s,
                    ls="--" if s.startswith("torch") else "-", alpha=0.85)
    cores = res["cpu_count"]
    for ax, what in zip(axes, ("step time", "peak memory per rank (all but other)")):
        ax.plot(ns, [1 / n for n in ns], "k:", lw=1.5, label="ideal 1/N")
        ax.set(xscale="log", yscale="log", xlabel="N (ranks)", ylabel=f"{what} / N = 1's",
               title=f"{what}, ratio to N = 1")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
        ax.grid(alpha=0.3, which="both")
    axes[0].set_title(f"step time, ratio to N = 1 (gloo, {cores} CPU cores shared by the ranks)",
                      fontsize=10)
    axes[1].legend(fontsize=7, ncol=2)
    if fig is not None:
        fig.suptitle(f"Strong scaling, global batch {res['config']['global-batch']} x "
                     f"{res['config']['seq-len']} tokens, GPT of {res['num_params']:,} parameters")
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
    return fig


def driver(args: argparse.Namespace) -> dict:
    from minifsdp.launch import repo_root

    res = launch(args)
    out = args.out or repo_root() / "runs" / "benchmarks" / "scaling" / "scaling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"GPT: {res['num_params']:,} parameters; strong scaling: global batch "
          f"{args.global_batch} x {args.seq_len} tokens split over N ranks; AdamW")
    for n, line in res["backend"].items():
        print(f"N = {n}: {line}")
    print(f"time: median of {args.rounds} x {args.steps} steps per strategy after {args.warmup} "
          "warm-up steps, strategies interleaved and rotated; peak: MemoryTracker, every "
          "category but other, the largest over ranks\n")
    print(table(res))
    print(f"\n{os.cpu_count()} CPU cores; each rank one thread: times are gloo on this CPU")
    if not args.no_plot:
        plot(res, out.with_suffix(".png"))
        print(f"wrote {out} and {out.with_suffix('.png')}")
    else:
        print(f"wrote {out}")
    return res


if __name__ == "__main__":
    harness.main(worker, driver, parse_args())
