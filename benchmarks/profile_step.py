"""Where one training step's time goes, for one strategy in one process (world size 1).

    python benchmarks/profile_step.py --strategy fsdp2                  # the --bench GPT
    python benchmarks/profile_step.py --strategy torch_fsdp2 --bf16
    python benchmarks/profile_step.py --strategy single --bf16     # the compute-only step
    python benchmarks/profile_step.py --strategy bucketed_ddp --tiny --rows 15   # on a CPU

Builds the model as ``python -m minifsdp.gpucheck --bench`` does (``gpucheck.build``), runs
warm-up steps, then profiles ``--steps`` steps with ``torch.profiler`` and prints the ops
sorted by their own CPU time, and the step's wall time against the time the GPU was busy.
At world size 1 communication is a copy, so what the table shows beyond the model's own ops is
the strategy's bookkeeping: hooks, copies, allocations (issue 26's question: is our step
slower than torch's because of Python?). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="fsdp2")
    p.add_argument("--bf16", action="store_true", help="bf16 params, fp32 reduce")
    p.add_argument("--tiny", action="store_true", help="a tiny GPT (a dry run on a CPU)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from minifsdp.dist import dist_setup
    from minifsdp.gpucheck import BENCH_GPT, BENCH_PAIRS, BENCH_TINY, BF16, Autocast, build
    from minifsdp.train import train_step

    info = dist_setup()
    gpt = BENCH_GPT + (BENCH_TINY if args.tiny else ())
    if args.strategy == "single":  # the compute-only step of gpucheck --bench
        targs, model, opt = build("single", (), info, gpt, args.steps)
        model = Autocast(model) if args.bf16 else model
    else:
        # the bench pair's options (FSDP1's wrapping and prefetch), else just the dtypes
        extra = next((p.extra for p in BENCH_PAIRS if args.strategy in (p.ours, p.torch)
                      and ("--param-dtype" in p.extra) == args.bf16), BF16 if args.bf16 else ())
        targs, model, opt = build(args.strategy, extra, info, gpt, args.steps)
    x = torch.randint(targs.vocab_size, (targs.global_batch, targs.seq_len), device=info.device)
    y = torch.roll(x, -1, dims=1)
    cuda = info.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(args.warmup):
        train_step(model, opt, x, y)
    sync()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        train_step(model, opt, x, y)
    sync()
    wall = (time.perf_counter() - t0) / args.steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            train_step(model, opt, x, y)
        sync()
    ev = prof.key_averages()
    print(f"## {args.strategy}{' bf16' if args.bf16 else ''}: {info.device}, torch "
          f"{torch.__version__}; step {1e3 * wall:.1f} ms unprofiled (mean of {args.steps})")
    if cuda:
        from torch.autograd import DeviceType

        # kernels only, as the table's "Self CUDA time total": the ranges that user
        # annotations (Optimizer.step, FSDP::...) record on the device would count twice
        busy = sum(e.self_device_time_total for e in ev if e.device_type == DeviceType.CUDA
                   and not e.is_user_annotation) / args.steps / 1e3
        print(f"GPU busy {busy:.1f} ms a step (sum of kernels' own time): the rest of the step "
              "is the GPU waiting for the CPU")
    print(ev.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
