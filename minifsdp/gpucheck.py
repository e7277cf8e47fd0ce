"""What one GPU can check of the CUDA/NCCL path: ``python -m minifsdp.gpucheck``.

The series runs everywhere on CPU/gloo; readers run it on GPUs. One GPU cannot host two NCCL
ranks, so this check runs a world of one -- ``dist_setup()`` with NCCL and ``cuda:0``, every
collective a real NCCL call over one rank -- and asks of each implementation what a world of
one can answer:

- parity: our ``fully_shard`` (fp32, and bf16 params with fp32 reduction), our FSDP1 and our
  ``BucketedDDP`` against torch's, trained side by side on the same GPT and batches; losses
  and final parameters must be bitwise equal (Note [why a world of one still checks]);
- memory: ``MemoryTracker``'s peak of one step against the CUDA caching allocator's
  (``torch.cuda.max_memory_allocated`` over the same step), the difference printed;
- time: median step time, ours / torch's, after warm-up (on a fast device the Python
  overhead of our hooks shows; there are no timed assertions anywhere).

Without CUDA the same jobs run on CPU/gloo and the CUDA-only parts say they were skipped:
that is how ``tests/test_gpu_ready.py`` keeps this check working on a machine without GPU.

Note [why a world of one still checks]: at N = 1 every all-gather and reduce-scatter copies
one rank's data, so parity here does not test the arithmetic of sharding (the CPU tests do,
at N = 2, 3, 4). It tests what only a GPU exercises: tensors and buffers on ``cuda:LOCAL_RANK``
(not the CPU, not another device), NCCL accepting every call we make (dtypes, in-place
outputs, async work), CUDA kernels giving ours and torch's the same bits for the same
operations, and the caching allocator agreeing with our tracker.

Usage::

    python -m minifsdp.gpucheck                  # prints a report
    python -m minifsdp.gpucheck --out benchmarks/RESULTS.md   # and appends it there
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import sys
import time

import torch

# (name, ours, torch's, extra train.py options): each pair trains the same model on the same
# batches; the parity of a pair is bitwise.
PAIRS = [
    ("fsdp2 fp32", "fsdp2", "torch_fsdp2", ()),
    ("fsdp2 bf16 params, fp32 reduce", "fsdp2", "torch_fsdp2",
     ("--param-dtype", "bf16", "--reduce-dtype", "fp32")),
    ("fsdp1 full shard, a unit per block", "fsdp1", "torch_fsdp1", ("--auto-wrap", "transformer")),
    ("bucketed DDP", "bucketed_ddp", "torch_ddp", ()),
]
GPT = ("--model", "gpt", "--n-layer", 4, "--d-model", 256, "--n-head", 8, "--vocab-size", 512,
       "--seq-len", 64, "--global-batch", 8, "--optimizer", "adamw")
TINY = ("--n-layer", 2, "--d-model", 64, "--n-head", 4, "--vocab-size", 64, "--seq-len", 32)


def run_one(strategy: str, extra: tuple, steps: int, info, tiny: bool = False) -> dict:
    """Train ``steps`` steps in this process; the last one under ``MemoryTracker`` and the
    allocator's peak statistics. Returns losses, full parameters, step times and memory."""
    from minifsdp.dist import seed_everything
    from minifsdp.memory import MemoryTracker
    from minifsdp.train import (
        STRATEGIES,
        full_params,
        make_batches,
        make_model,
        make_optimizer,
        parse_args,
        train_step,
    )

    args = parse_args(["--strategy", strategy, *map(str, GPT + (TINY if tiny else ())),
                       "--steps", str(steps), *map(str, extra)])
    seed_everything(args.seed)
    model = make_model(args).to(info.device)
    setup = STRATEGIES[strategy](model, info, args)
    model, opt = setup if isinstance(setup, tuple) else (setup,
                                                         make_optimizer(setup.parameters(), args))
    batches = make_batches(args, info)
    cuda = info.device.type == "cuda"
    losses, times, memory = [], [], {}
    for step in range(steps):
        x, y = next(batches)
        last = step == steps - 1
        if cuda:
            torch.cuda.synchronize()
            if last:
                torch.cuda.reset_peak_memory_stats(info.device)
                base = torch.cuda.memory_allocated(info.device)
        t0 = time.perf_counter()
        tracker = MemoryTracker(model=model, optimizer=opt, device=info.device) if last else None
        with tracker if tracker else contextlib.nullcontext():
            if tracker:
                tracker.register((x, y), "activations")
            loss = train_step(model, opt, x, y, tracker)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.float().item())
    memory["tracker_peak"] = tracker.peak
    if cuda:  # the allocator counts from 0; our tracker counts every live tensor it knows
        memory["allocator_peak"] = torch.cuda.max_memory_allocated(info.device)
        memory["allocator_at_start"] = base
    return {"losses": losses, "params": full_params(model), "times": times, "memory": memory}


def worker(steps: int, tiny: bool) -> None:
    """One rank (torchrun --nproc-per-node 1): every pair, then the results to rank0.json."""
    from minifsdp.dist import dist_setup, finish

    info = dist_setup()
    out = {"backend": info.backend, "device": str(info.device), "torch": torch.__version__,
           "device_name": torch.cuda.get_device_name(info.device) if info.device.type == "cuda"
           else "cpu", "pairs": []}
    for name, ours, theirs, extra in PAIRS:
        a, b = (run_one(s, extra, steps, info, tiny) for s in (ours, theirs))
        same_params = a["params"].keys() == b["params"].keys() and all(
            torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        out["pairs"].append({
            "name": name, "ours": ours, "torch": theirs, "extra": list(extra),
            "losses_equal": a["losses"] == b["losses"], "params_equal": same_params,
            "max_abs_diff": max(((a["params"][k].float() - b["params"][k].float()).abs().max()
                                 .item() for k in a["params"]), default=0.0),
            # the first step compiles/allocates: the median of the rest
            "step_ms": [1e3 * statistics.median(r["times"][1:]) for r in (a, b)],
            "memory": [a["memory"], b["memory"]],
        })
    finish(out)


def report(res: dict) -> str:
    """The results as a Markdown section (for benchmarks/RESULTS.md)."""
    cuda = res["backend"] == "nccl"
    lines = [f"## GPU check, {datetime.date.today()}: {res['device_name']}, "
             f"{res['backend']}, torch {res['torch']}", ""]
    if not cuda:
        lines += ["No CUDA device: the jobs ran on CPU/gloo; the allocator comparison was "
                  "skipped (it needs CUDA). Run this on a machine with a GPU.", ""]
    lines += ["| pair | losses equal | params equal | max abs diff | step ms ours / torch | "
              "peak: tracker / allocator (ours) |", "|---|---|---|---|---|---|"]
    for p in res["pairs"]:
        mem = p["memory"][0]  # both absolute: every live tensor, parameters included
        alloc = (f"{mem['tracker_peak']:,} / {mem['allocator_peak']:,}"
                 if "allocator_peak" in mem else f"{mem['tracker_peak']:,} / skipped (no CUDA)")
        lines.append(f"| {p['name']} | {p['losses_equal']} | {p['params_equal']} | "
                     f"{p['max_abs_diff']:.1e} | {p['step_ms'][0]:.1f} / {p['step_ms'][1]:.1f} | "
                     f"{alloc} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Check minifsdp on one CUDA device (CPU: a dry run)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", help="append the report (Markdown) to this file")
    p.add_argument("--tiny", action="store_true", help="a 2-layer d_model 64 GPT (a dry run)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.steps, args.tiny)
    from minifsdp.launch import torchrun

    if not torch.cuda.is_available():
        print("no CUDA device: running the same jobs on CPU/gloo; the CUDA-only parts (the "
              "allocator comparison) are skipped", flush=True)
    # a world of one: one GPU cannot host two NCCL ranks (Note [why a world of one ...])
    run = torchrun("minifsdp.gpucheck", "--worker", "--steps", args.steps,
                   *(["--tiny"] if args.tiny else []), nproc=1, chapter="gpucheck",
                   name="gpucheck")
    text = report(run.ranks[0])
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    ok = all(p["losses_equal"] and p["params_equal"] for p in run.ranks[0]["pairs"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
