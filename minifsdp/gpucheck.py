"""What one GPU can check of the CUDA/NCCL path: ``python -m minifsdp.gpucheck``.

The series runs everywhere on CPU/gloo; readers run it on GPUs. One GPU cannot host two NCCL
ranks, so this check runs a world of one -- ``dist_setup()`` with NCCL and ``cuda:0``, every
collective a real NCCL call over one rank -- and asks of each implementation what a world of
one can answer:

- parity: our ``fully_shard`` (fp32, and bf16 params with fp32 reduction), our FSDP1 and our
  ``BucketedDDP`` against torch's, trained side by side on the same GPT and batches; losses
  and final parameters bitwise equal where ``Pair.bitwise`` says so (Note [why a world of one
  still checks], Note [FSDP1 on CUDA]); where parameters differ, the report names the
  parameter with the largest difference, how many elements differ, and the first element
  that differs with both values' bits (``minifsdp.parity``);
- determinism: FSDP1, ours and torch's, each run twice: is each bitwise equal to itself?
  (Note [FSDP1 on CUDA]: a difference between ours and torch's means little if torch's
  differs from itself);
- memory: over the last step, ``MemoryTracker``'s rise (step peak - its total at the step's
  start) against the CUDA caching allocator's (``max_memory_allocated`` - ``memory_allocated``
  at the step's start, peak statistics reset there). Deltas, not absolute peaks: the
  allocator also counts what the tracker does not know (cuBLAS workspaces, what an earlier
  pair left in the process), and its absolute peak grew pair to pair (154 -> 219 -> 320 ->
  412 MB on an H200). Every run starts after the previous one's objects are collected and the
  cache emptied, so each pair starts from the same floor;
- the host link: with CPU offload (``--cpu-offload``, Note [FSDP2 CPU offload]), the bytes
  one step copies between host and device (``HostDeviceCopies``), ours and torch's, against
  the Note's prediction (``offload_moves``): equal on CUDA, or the check fails;
- time: median step time, ours / torch's. On this small GPT the GPU waits for Python; the
  ``--bench`` mode times a GPT of 135M parameters in bf16, where the GPU is busy.

Without CUDA the same jobs run on CPU/gloo and the CUDA-only parts say they were skipped:
that is how ``tests/test_gpu_ready.py`` keeps this check working on a machine without GPU.

Note [why a world of one still checks]: at N = 1 every all-gather and reduce-scatter copies
one rank's data, so parity here does not test the arithmetic of sharding (the CPU tests do,
at N = 2, 3, 4). It tests what only a GPU exercises: tensors and buffers on ``cuda:LOCAL_RANK``
(not the CPU, not another device), NCCL accepting every call we make (dtypes, in-place
outputs, async work), CUDA kernels giving ours and torch's the same bits for the same
operations, and the caching allocator agreeing with our tracker.

Note [FSDP1 on CUDA]: measured 2026-11-26 on an H200 (torch 2.11, world size 1, 6 steps of
AdamW): our FSDP1's parameters were not bitwise equal to torch's (max |diff| 4.8e-5) although
every loss was, while FSDP2 and DDP were bitwise. Reading both implementations for what
differs on CUDA at N = 1:

1. torch FSDP1 switches to ``NO_SHARD`` at world size 1 (``_init_core_state``: "FSDP is
   switching to use NO_SHARD ... since the world size is 1"): it all-reduces the flat
   gradient in place where we reduce-scatter into a new tensor. At N = 1 both are copies;
   its pre/post-divide factors are 1 and ``_div_if_needed`` skips them; ours are 1 too
   (``gradient_divide_factors(1) == (1.0, 1.0)``). No arithmetic differs: not the cause.
2. Streams (torch reduces on a side stream, unshards on another), ``_use_unsharded_views``
   (split + view of one flat tensor, as ours), the 16-byte alignment of every view (ours
   aligns alike, Note [alignment] in ``minifsdp.fsdp1.flat_param``; every numel of this GPT is a
   multiple of 4 anyway), the fp32 cast of the gradient (a no-op in fp32), TF32 (off:
   ``make_deterministic``): none changes a bit of the forward, and the losses agree.
3. **The optimizer** (a hypothesis when written, confirmed since, below): ``torch.optim``
   runs its ``foreach`` kernels by default only when every parameter is on CUDA *and* of type
   exactly ``torch.Tensor`` or ``nn.Parameter`` (``_default_to_fused_or_foreach``,
   ``_foreach_supported_types``). Torch's FSDP1 with ``use_orig_params=True`` hands the
   optimizer the original ``nn.Parameter`` s: foreach. Ours hands it ``FlatParameter`` s, a
   subclass: the per-tensor loop. The two are the same formula but not the same kernels: the
   per-tensor AdamW computes ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` with a Python
   float, which CUDA's ``div_true_kernel_cuda`` turns into a multiplication by the reciprocal
   ("may lose one bit of precision"), while ``_foreach_div_`` divides. One bit in the
   denominator of some elements, amplified by Adam where ``v`` is small. On the CPU neither
   side uses foreach (foreach is CUDA's default only), which is why every CPU test is bitwise.
   It also explains why FSDP2 and DDP agree: both sides foreach (``torch.distributed.tensor``
   appends ``DTensor`` to ``_foreach_supported_types``; DDP's parameters are plain). Open:
   every loss agreed, through step 6. Either the differences stayed too small to move a mean
   loss's last bit for five steps, or they arose in the last step only (the one run under
   ``MemoryTracker``, a ``TorchDispatchMode``); the report's "first loss difference at step"
   (and a run with more ``--steps``) tells which.
   Since then ``make_optimizer`` chooses ``foreach`` by device only, for every strategy
   (Note [one optimizer path] in ``minifsdp.strategies``). The pairs check the hypothesis three
   ways: "fsdp1 ..." (foreach by device: the same kernels on both sides) and "fsdp1 ...,
   foreach=False" (the per-tensor loop on both) must be bitwise; "fsdp1 ..., torch's foreach
   default" (the old situation: per-tensor ours, foreach torch's) is expected to differ as
   measured. The report's "foreach" column shows what each optimizer ran with on CUDA
   (``_would_use_foreach``; torch's rule is shown by type, also on the CPU). If the first two
   are bitwise and the third is not, the hypothesis holds and the difference was the
   optimizer's, not FSDP's; if not, look at the determinism lines (torch against itself).
   **Confirmed** 2026-11-26 on an H100 (torch 2.11, benchmarks/RESULTS.md): the first two
   bitwise, the third 3.3e-05 apart in 1,952,918 of 3,438,080 elements with every loss equal,
   and each FSDP1 bitwise equal to itself run twice.

Usage::

    python -m minifsdp.gpucheck                  # prints a report
    python -m minifsdp.gpucheck --out benchmarks/RESULTS.md   # and appends it there
    python -m minifsdp.gpucheck --bench          # step time, ours / torch's, a 135M GPT in bf16
    python -m minifsdp.gpucheck --bench --tiny   # the same on a tiny GPT (a dry run on CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp import parity


@dataclass(frozen=True)
class Pair:
    """Ours and torch's strategy, trained on the same model and batches (``extra``: more
    ``minifsdp.train`` options; ``foreach``: the optimizer's -- None: ``make_optimizer``'s
    choice, by device (Note [one optimizer path] in ``minifsdp.strategies``); ``"torch"``: torch's
    own default, by device *and type*; True/False: that)."""

    name: str
    ours: str
    torch: str
    extra: tuple = ()
    foreach: bool | str | None = None  # None: make_optimizer's; "torch": torch's default rule
    bitwise: bool = True   # expected bitwise equal on CUDA too (on CPU every pair is)
    repeat: bool = False   # run each side twice: is it deterministic with itself?
    cuda_only: bool = False  # skipped off CUDA; an exception is reported, not raised


FSDP1 = ("--auto-wrap", "transformer")
PAIRS = [
    Pair("fsdp2 fp32", "fsdp2", "torch_fsdp2"),
    Pair("fsdp2 bf16 params, fp32 reduce", "fsdp2", "torch_fsdp2",
         ("--param-dtype", "bf16", "--reduce-dtype", "fp32")),
    # Note [FSDP1 on CUDA]: the optimizer's kernels chosen by device (make_optimizer) ...
    Pair("fsdp1 full shard, a unit per block", "fsdp1", "torch_fsdp1", FSDP1, repeat=True),
    # ... by torch's default rule, as measured (4.8e-5): expected to differ on CUDA
    Pair("fsdp1 full shard, a unit per block, torch's foreach default", "fsdp1", "torch_fsdp1",
         FSDP1, foreach="torch", bitwise=False),
    # ... the per-tensor loop on both sides
    Pair("fsdp1 full shard, a unit per block, foreach=False", "fsdp1", "torch_fsdp1", FSDP1,
         foreach=False),
    Pair("bucketed DDP", "bucketed_ddp", "torch_ddp"),
    # Note [FSDP2 CPU offload]: shards, gradients and Adam on the host; each step's copies
    # across the host link counted (HostDeviceCopies) against the Note's bytes
    Pair("fsdp2 fp32, CPU offload", "fsdp2", "torch_fsdp2", ("--cpu-offload",)),
    # Note [comm buffers from the process group], Note [symmetric memory] (comm_buffers.py):
    # torch runs no collective in a world of one, so only ours allocates and rendezvouses here
    Pair("fsdp2 fp32, buffers from NCCL's allocator", "fsdp2", "torch_fsdp2",
         ("--comm-buffers", "process-group")),
    Pair("fsdp2 fp32, symmetric memory", "fsdp2", "torch_fsdp2", ("--comm-buffers", "symm-mem"),
         cuda_only=True),
]
GPT = ("--model", "gpt", "--n-layer", 4, "--d-model", 256, "--n-head", 8, "--vocab-size", 512,
       "--seq-len", 64, "--global-batch", 8, "--optimizer", "adamw")
TINY = ("--n-layer", 2, "--d-model", 64, "--n-head", 4, "--vocab-size", 64, "--seq-len", 32)

# --bench: GPT-2 small's blocks (12 layers, d_model 768, 85M parameters) with a 32,768-token
# vocabulary, untied: 135M parameters; bf16 compute, 8 x 1024 tokens a step (~6.6 TFLOP), enough
# that the GPU, not Python, sets the time. Two models live at once: ~2 x 2.2 GB of fp32 model
# state and AdamW moments, plus one step's activations (a few GB).
BENCH_GPT = ("--model", "gpt", "--n-layer", 12, "--d-model", 768, "--n-head", 12,
             "--vocab-size", 32768, "--seq-len", 1024, "--global-batch", 8,
             "--optimizer", "adamw")
BENCH_TINY = ("--n-layer", 2, "--d-model", 64, "--n-head", 4, "--vocab-size", 64,
              "--seq-len", 32, "--global-batch", 4)
BF16 = ("--param-dtype", "bf16", "--reduce-dtype", "fp32")
BENCH_PAIRS = [
    Pair("fsdp2 fp32", "fsdp2", "torch_fsdp2"),
    Pair("fsdp2 bf16 params, fp32 reduce", "fsdp2", "torch_fsdp2", BF16),
    Pair("fsdp1 bf16 params, fp32 reduce, a unit per block, backward_pre", "fsdp1",
         "torch_fsdp1", (*FSDP1, *BF16, "--backward-prefetch", "backward_pre")),
    Pair("bucketed DDP (fp32)", "bucketed_ddp", "torch_ddp"),
]


class HostDeviceCopies(TorchDispatchMode):
    """Count the bytes every op moves between host memory and a device, by direction.

    A copy is an op whose input and output live on different devices: ``aten._to_copy``
    (``t.to(device)``) and ``aten.copy_`` (``dst.copy_(src)``), seen at the dispatcher, so
    ours and torch's are counted alike whichever Python calls made them. ``h2d``: from the
    CPU to another device; ``d2h``: back. On a CPU-only run nothing crosses: both stay 0.

    Example:
        >>> with HostDeviceCopies() as c:
        ...     _ = torch.ones(4).to("meta")          # 16 bytes host -> device
        >>> c.h2d, c.d2h
        (16, 0)
    """

    def __init__(self):
        super().__init__()
        self.h2d = self.d2h = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[0] if func is torch.ops.aten._to_copy.default else args[1]
            dst = out
            if isinstance(src, torch.Tensor) and src.device != dst.device:
                nbytes = src.numel() * src.element_size()
                if src.device.type == "cpu":
                    self.h2d += nbytes
                elif dst.device.type == "cpu":
                    self.d2h += nbytes
        return out


def offload_moves(model: torch.nn.Module, after_backward: bool = True,
                  ) -> list[tuple[str, int, int]]:
    """Every copy across the host link in one step of our ``fully_shard`` with CPU offload, as
    Note [FSDP2 CPU offload] predicts them, sorted: ``("h2d", numel, itemsize)`` per padded
    shard and unshard (twice for a group resharded after forward), ``("d2h", numel,
    itemsize)`` per parameter's rows with a gradient -- those that have a ``.grad`` now
    (``after_backward``), or, after ``zero_grad``, every trainable one."""
    from minifsdp import fsdp2

    groups = [m.fsdp_state.group for m in model.modules()
              if isinstance(m, fsdp2.FSDPModule) and m.fsdp_state.group is not None]
    got_grad = (lambda p: p.grad is not None) if after_backward else (lambda p: p.requires_grad)
    return sorted(
        [("h2d", p.padded_shard_numel, p.sharded_param.element_size())
         for g in groups for p in g.fsdp_params
         for _ in range(2 if g.reshard_after_forward else 1)]
        + [("d2h", p.sharded_numel, p.sharded_param.element_size())
           for g in groups for p in g.fsdp_params if got_grad(p.sharded_param)])


def _would_use_foreach(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` runs (on CUDA: would run) its foreach kernels: its own ``foreach``
    setting, else torch's default rule without the device condition (Note [FSDP1 on CUDA])."""
    from torch.optim.optimizer import _foreach_supported_types

    asked = opt.defaults.get("foreach")
    if asked is not None:
        return bool(asked)
    return all(type(p) in _foreach_supported_types
               for g in opt.param_groups for p in g["params"])


def build(strategy: str, extra: tuple, info, gpt: tuple, steps: int,
          foreach: bool | str | None = None):
    """``(args, model, optimizer)`` for ``strategy`` as ``minifsdp.train`` builds them."""
    from minifsdp.dist import seed_everything
    from minifsdp.train import STRATEGIES, make_model, make_optimizer, parse_args

    args = parse_args(["--strategy", strategy, *map(str, gpt), "--steps", str(steps),
                       *map(str, extra)])
    seed_everything(args.seed)
    model = make_model(args).to(info.device)
    setup = STRATEGIES[strategy](model, info, args)
    if isinstance(setup, tuple):
        return (args, *setup)
    params = setup.parameters()
    if foreach is None:
        return args, setup, make_optimizer(params, args)
    if args.optimizer != "adamw":
        raise ValueError("foreach is set for adamw only")
    kw = {} if foreach == "torch" else {"foreach": foreach}
    return args, setup, torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, **kw)


class Autocast(torch.nn.Module):
    """``module`` with its forward under ``torch.autocast`` to bf16: the compute-only step of a
    bf16-params pair (bf16 matmuls, fp32 master weights, no FSDP) in ``--bench``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args):
        device = next(self.module.parameters()).device
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return self.module(*args)


def compute_only(pair: Pair, info, gpt: tuple, steps: int, foreach: bool | None = None):
    """The pair's model trained by one process with no wrapper at all (``single``), under
    autocast where the pair computes in bf16: the step FSDP's bookkeeping is measured against
    when communication is free (world size 1). ``foreach`` as in ``build``."""
    args, model, opt = build("single", (), info, gpt, steps, foreach)
    if "--param-dtype" in pair.extra:
        model = Autocast(model)
    return args, model, opt


def _fresh(device: torch.device) -> None:
    """Start a run from the same floor: what the last run left is collected and, on CUDA,
    handed back to the driver (so one pair's cache does not hide the next pair's growth)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_one(strategy: str, extra: tuple, steps: int, info, tiny: bool = False,
            foreach: bool | str | None = None) -> dict:
    """Train ``steps`` steps in this process; the last one under ``MemoryTracker`` and the
    allocator's peak statistics. Returns losses, full parameters, step times and memory."""
    from minifsdp.memory import MemoryTracker
    from minifsdp.train import full_params, make_batches, train_step

    _fresh(info.device)
    args, model, opt = build(strategy, extra, info, GPT + (TINY if tiny else ()), steps,
                             foreach)
    batches = make_batches(args, info)
    cuda = info.device.type == "cuda"
    losses, times, memory, copied = [], [], {}, None
    for step in range(steps):
        x, y = next(batches)
        last = step == steps - 1
        if cuda:
            torch.cuda.synchronize()
            if last:
                torch.cuda.reset_peak_memory_stats(info.device)
                memory["allocator_at_start"] = torch.cuda.memory_allocated(info.device)
        t0 = time.perf_counter()
        tracker = MemoryTracker(model=model, optimizer=opt, device=info.device) if last else None
        copies = HostDeviceCopies() if step == 1 else None  # a steady step, without the tracker
        with tracker if tracker else contextlib.nullcontext(), \
                copies if copies else contextlib.nullcontext():
            if tracker:
                tracker.register((x, y), "activations")
                memory["tracker_at_start"] = tracker.current()["total"]
            loss = train_step(model, opt, x, y, tracker)
        if copies:
            copied = {"h2d": copies.h2d, "d2h": copies.d2h}
            if strategy == "fsdp2" and "--cpu-offload" in extra:  # after zero_grad
                moves = offload_moves(model, after_backward=False)
                copied["note"] = [sum(n * size for kind, n, size in moves if kind == k)
                                  for k in ("h2d", "d2h")]
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.float().item())
    memory["tracker_peak"] = tracker.peak
    memory["tracker_delta"] = tracker.peak - memory["tracker_at_start"]
    if cuda:  # the allocator counts every block it handed out; our tracker, what it knows
        memory["allocator_peak"] = torch.cuda.max_memory_allocated(info.device)
        memory["allocator_delta"] = memory["allocator_peak"] - memory["allocator_at_start"]
    out = {"losses": losses, "params": full_params(model), "times": times, "memory": memory,
           "foreach": _would_use_foreach(opt), "copies": copied}
    del model, opt, batches
    _fresh(info.device)
    return out


def compare(a: dict, b: dict, names: tuple[str, str] = ("ours", "torch")) -> dict:
    """Two runs bit for bit (Note [parity] in minifsdp/parity.py): losses, parameters, the
    first parameter element that differs, and the largest difference (its parameter, and how
    many elements differ at all)."""
    pa, pb = a["params"], b["params"]
    loss = parity.first_divergence(a["losses"], b["losses"])
    first = parity.first_divergence(pa, pb, names=names)
    alike = first is None or first.kind == "value"  # the same names, shapes and dtypes
    worst = parity.worst_divergence(pa, pb) if alike else None  # atol = rtol = 0
    return {
        "losses_equal": loss is None,
        "first_loss_diff_step": None if loss is None else loss.step + 1,
        "params_equal": first is None,
        "first_divergence": None if first is None else str(first),
        "max_abs_diff": parity.max_abs_diff(pa, pb) if alike else float("nan"),
        "worst_param": worst.name if worst else None,
        "elements_differing": worst.count if worst else 0,
        "elements": sum(v.numel() for v in pa.values()),
    }


def worker(steps: int, tiny: bool) -> None:
    """One rank (torchrun --nproc-per-node 1): every pair, then the results to rank0.json."""
    from minifsdp.dist import dist_setup, finish

    info = dist_setup()
    out = _header(info)
    out["pairs"], out["repeats"] = [], []
    t0 = time.perf_counter()
    for pair in PAIRS:
        if pair.cuda_only and info.device.type != "cuda":
            continue
        try:
            a, b = (run_one(s, pair.extra, steps, info, tiny, pair.foreach)
                    for s in (pair.ours, pair.torch))
        except Exception as e:  # noqa: BLE001 -- a cuda_only feature may be missing here
            if not pair.cuda_only:
                raise
            # this torch lacks the setter (set_symm_mem_for_comm): nothing to compare with
            kind = "skipped" if "has no FSDPModule." in str(e) else "error"
            out["pairs"].append({"name": pair.name, kind: f"{type(e).__name__}: {e}"})
            _fresh(info.device)
            continue
        # where a slow or stuck check was: the worker's stderr log under runs/gpucheck/
        print(f"[gpucheck {time.perf_counter() - t0:.1f}s] {pair.name}: done", file=sys.stderr,
              flush=True)
        out["pairs"].append({
            "name": pair.name, "ours": pair.ours, "torch": pair.torch, "extra": list(pair.extra),
            "bitwise_expected": pair.bitwise or info.device.type != "cuda",
            **compare(a, b),
            # the first step compiles/allocates: the median of the rest
            "step_ms": [1e3 * statistics.median(r["times"][1:] or r["times"]) for r in (a, b)],
            "memory": [a["memory"], b["memory"]],
            "foreach": [a["foreach"], b["foreach"]],
            "copies": [a["copies"], b["copies"]],
        })
        if pair.repeat:  # Note [FSDP1 on CUDA]: is each deterministic with itself?
            for first, strategy in ((a, pair.ours), (b, pair.torch)):
                again = run_one(strategy, pair.extra, steps, info, tiny, pair.foreach)
                out["repeats"].append({"name": f"{strategy} ({pair.name}) twice",
                                       **compare(first, again, ("first run", "second run"))})
        del a, b
    finish(out)


def _header(info) -> dict:
    return {"backend": info.backend, "device": str(info.device), "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name(info.device)
            if info.device.type == "cuda" else "cpu"}


def time_interleaved(runs: list, x: torch.Tensor, y: torch.Tensor, rounds: int, steps: int,
                     warmup: int, sync=lambda: None) -> list[list[float]]:
    """Seconds per training step of each ``(model, opt)`` in ``runs``, one entry per round:
    ``warmup`` steps each, then ``rounds`` rounds of ``steps`` steps each, taking turns, the
    order rotated by one each round so that drift in the machine's speed hits all alike.
    ``sync`` (``torch.cuda.synchronize`` on a GPU) brackets each round's timing.

    Example:
        >>> m = torch.nn.Linear(4, 4)
        >>> times = time_interleaved([(m, torch.optim.SGD(m.parameters()))],
        ...                          torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 3, 2, 1)
        >>> len(times), len(times[0])
        (1, 3)
    """
    from minifsdp.train import train_step

    for model, opt in runs:
        for _ in range(warmup):
            train_step(model, opt, x, y)
    times: list[list[float]] = [[] for _ in runs]
    for r in range(rounds):
        for i in [(r + k) % len(runs) for k in range(len(runs))]:
            model, opt = runs[i]
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                train_step(model, opt, x, y)
            sync()
            times[i].append((time.perf_counter() - t0) / steps)
    return times


def bench_worker(tiny: bool, rounds: int, steps: int, warmup: int) -> None:
    """Step time of ours, torch's and the compute-only step (``compute_only``), the three
    models alive side by side and timed in interleaved rounds (the order rotates each round),
    ``steps`` steps a round; the medians."""
    from minifsdp.dist import dist_setup, finish
    from minifsdp.models import count_params

    info = dist_setup()
    out = {**_header(info), "bench": [], "rounds": rounds, "steps": steps, "warmup": warmup}
    gpt = BENCH_GPT + (BENCH_TINY if tiny else ())
    cuda = info.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for pair in BENCH_PAIRS:
        _fresh(info.device)
        runs = [build(s, pair.extra, info, gpt, steps) for s in (pair.ours, pair.torch)]
        runs.append(compute_only(pair, info, gpt, steps))
        args = runs[0][0]
        n_params = count_params(runs[1][1])  # torch's: the original parameters, unpadded
        # random tokens on the device: the data loader is not what is timed
        g = torch.Generator(device=info.device).manual_seed(0)
        x = torch.randint(args.vocab_size, (args.global_batch, args.seq_len), device=info.device,
                          generator=g)
        y = torch.roll(x, -1, dims=1)
        times = time_interleaved([(m, o) for _, m, o in runs], x, y, rounds, steps, warmup, sync)
        ours, theirs, alone = (statistics.median(t) for t in times)
        tokens = args.global_batch * args.seq_len
        out["bench"].append({
            "name": pair.name, "ours": pair.ours, "torch": pair.torch, "params": n_params,
            "tokens": tokens, "step_ms": [1e3 * ours, 1e3 * theirs],
            "compute_only_ms": 1e3 * alone,
            "rounds_ms": [[1e3 * t for t in ts] for ts in times],
            "ratio": ours / theirs, "ratio_compute_only": ours / alone,
            # 6 N tokens: forward and backward matmuls, attention's own flops left out
            "tflops": [6 * n_params * tokens / t / 1e12 for t in (ours, theirs)],
            "peak_gb": torch.cuda.max_memory_allocated(info.device) / 2**30 if cuda else None,
        })
        del runs, x, y  # before the next pair builds its models
    finish(out)


def report(res: dict) -> str:
    """The parity results as a Markdown section (for benchmarks/RESULTS.md)."""
    cuda = res["backend"] == "nccl"
    lines = [f"## GPU check, {datetime.date.today()}: {res['device_name']}, "
             f"{res['backend']}, torch {res['torch']}", ""]
    if not cuda:
        lines += ["No CUDA device: the jobs ran on CPU/gloo; the allocator comparison was "
                  "skipped (it needs CUDA). Run this on a machine with a GPU.", ""]
    mb = lambda n: f"{n / 2**20:.2f}"
    lines += ["| pair | losses equal | params equal | expected | max abs diff | step ms ours / "
              "torch | foreach (CUDA) ours / torch | step rise MB ours: tracker / allocator; "
              "torch's |",
              "|---|---|---|---|---|---|---|---|"]
    failed = [p for p in res["pairs"] if "error" in p or "skipped" in p]
    res = {**res, "pairs": [p for p in res["pairs"] if p not in failed]}
    for p in res["pairs"]:
        rise = []
        for mem in p["memory"]:
            alloc = mb(mem["allocator_delta"]) if "allocator_delta" in mem else \
                "skipped (no CUDA)"
            rise.append(f"{mb(mem['tracker_delta'])} / {alloc}")
        expected = "bitwise" if p["bitwise_expected"] else "not bitwise (Note [FSDP1 on CUDA])"
        lines.append(f"| {p['name']} | {p['losses_equal']} | {p['params_equal']} | {expected} | "
                     f"{p['max_abs_diff']:.1e} | {p['step_ms'][0]:.1f} / {p['step_ms'][1]:.1f} "
                     f"| {p['foreach'][0]} / {p['foreach'][1]} | {rise[0]}; {rise[1]} |")
    lines.append("")
    for p in failed:
        lines.append(f"- {p['name']}: FAILED, {p['error'][:300]}" if "error" in p else
                     f"- {p['name']}: skipped, {p['skipped'][:300]}")
    for p in res["pairs"]:
        if not p["params_equal"]:
            lines.append(f"- {p['name']}: {p['elements_differing']:,} of {p['elements']:,} "
                         f"elements differ, the most in `{p['worst_param']}`; first loss "
                         f"difference at step {p['first_loss_diff_step']}; first element: "
                         f"{p['first_divergence']}")
    for p in res["pairs"]:
        ours, theirs = p.get("copies") or (None, None)
        if ours and "note" in ours:  # Note [FSDP2 CPU offload]: the host link, one step
            lines.append(
                f"- {p['name']}, host link in step 2: H2D ours / torch / the Note's "
                f"{mb(ours['h2d'])} / {mb(theirs['h2d'])} / {mb(ours['note'][0])} MB, D2H "
                f"{mb(ours['d2h'])} / {mb(theirs['d2h'])} / {mb(ours['note'][1])} MB"
                + ("" if cuda else " (a CPU mesh copies nothing: the Note's bytes need CUDA)"))
    for r in res.get("repeats", []):
        verdict = "bitwise equal to itself" if r["params_equal"] and r["losses_equal"] else (
            f"NOT deterministic: max abs diff {r['max_abs_diff']:.1e}, "
            f"{r['elements_differing']:,} elements differ")
        lines.append(f"- determinism, {r['name']}: {verdict}")
    return "\n".join(lines) + "\n"


def report_bench(res: dict) -> str:
    """The bench results as a Markdown section."""
    lines = [f"## GPU bench, {datetime.date.today()}: {res['device_name']}, {res['backend']}, "
             f"torch {res['torch']}", "",
             f"{res['rounds']} interleaved rounds of {res['steps']} steps after {res['warmup']} "
             "warm-up steps each; medians of the per-step time; MINIFSDP_DETERMINISTIC=0.", "",
             "Compute only: the same model and batch trained by one process with no wrapper "
             "(under bf16 autocast where the pair computes in bf16); ours / compute only is "
             "the cost of the bookkeeping when communication is free.", "",
             "| pair | params | tokens/step | step ms ours / torch / compute only | "
             "ours / torch | ours / compute only | TFLOP/s (6N) ours / torch | peak GB |",
             "|---|---|---|---|---|---|---|---|"]
    for b in res["bench"]:
        peak = f"{b['peak_gb']:.1f}" if b["peak_gb"] is not None else "n/a (CPU)"
        lines.append(f"| {b['name']} | {b['params'] / 1e6:.1f}M | {b['tokens']:,} | "
                     f"{b['step_ms'][0]:.1f} / {b['step_ms'][1]:.1f} / "
                     f"{b['compute_only_ms']:.1f} | {b['ratio']:.3f} | "
                     f"{b['ratio_compute_only']:.3f} | "
                     f"{b['tflops'][0]:.1f} / {b['tflops'][1]:.1f} | {peak} |")
    return "\n".join(lines) + "\n"


def run_check(steps: int = 6, tiny: bool = False, timeout: float = 600.0):
    """The parity check as a torchrun job of one rank; returns its ``RunResult``."""
    from minifsdp.launch import torchrun

    # a world of one: one GPU cannot host two NCCL ranks (Note [why a world of one ...])
    return torchrun("minifsdp.gpucheck", "--worker", "--steps", steps,
                    *(["--tiny"] if tiny else []), nproc=1, chapter="gpucheck",
                    name="gpucheck", timeout=timeout)


def run_bench(tiny: bool = False, rounds: int = 5, steps: int = 5, warmup: int = 3,
              timeout: float = 600.0):
    """The bench as a torchrun job of one rank (deterministic kernels off); its ``RunResult``."""
    from minifsdp.launch import torchrun

    return torchrun("minifsdp.gpucheck", "--bench-worker", "--rounds", rounds, "--bench-steps",
                    steps, "--warmup", warmup, *(["--tiny"] if tiny else []), nproc=1,
                    chapter="gpucheck", name="bench", timeout=timeout,
                    env={"MINIFSDP_DETERMINISTIC": "0"})


def passed(res: dict) -> bool:
    """Every pair bitwise equal where it is expected to be, none failed to run (a pair this
    torch cannot run is skipped, not failed); on CUDA, our offload's copies across the host
    link exactly Note [FSDP2 CPU offload]'s bytes."""
    if any("error" in p for p in res["pairs"]):
        return False
    bitwise = all(p["losses_equal"] and p["params_equal"]
                  for p in res["pairs"] if "skipped" not in p and p["bitwise_expected"])
    offload = [c[0] for c in (p.get("copies") for p in res["pairs"]) if c and c[0]
               and "note" in c[0]]
    return bitwise and (res["backend"] != "nccl"
                        or all([c["h2d"], c["d2h"]] == c["note"] for c in offload))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Check minifsdp on one CUDA device (CPU: a dry run)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", help="append the report (Markdown) to this file")
    p.add_argument("--tiny", action="store_true", help="a 2-layer d_model 64 GPT (a dry run)")
    p.add_argument("--bench", action="store_true",
                   help="time ours against torch's on a 135M GPT in bf16 instead")
    p.add_argument("--rounds", type=int, default=5, help="--bench: interleaved rounds")
    p.add_argument("--bench-steps", type=int, default=5, help="--bench: steps a round")
    p.add_argument("--warmup", type=int, default=3, help="--bench: warm-up steps")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the job")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bench-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.steps, args.tiny)
    if args.bench_worker:
        bench_worker(args.tiny, args.rounds, args.bench_steps, args.warmup)

    if not torch.cuda.is_available():
        print("no CUDA device: running the same jobs on CPU/gloo; the CUDA-only parts (the "
              "allocator comparison) are skipped", flush=True)
    if args.bench:
        run = run_bench(args.tiny, args.rounds, args.bench_steps, args.warmup, args.timeout)
        text, ok = report_bench(run.ranks[0]), True
    else:
        run = run_check(args.steps, args.tiny, args.timeout)
        text, ok = report(run.ranks[0]), passed(run.ranks[0])
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
