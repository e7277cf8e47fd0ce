"""Process-group setup and teardown, seeding, rank-aware printing and per-rank results.

Every worker in the series is launched by ``torchrun`` and follows the same life cycle::

    info = dist_setup()              # reads RANK/WORLD_SIZE/LOCAL_RANK set by torchrun
    seed_everything(0)               # same seed on every rank -> identical model init
    ...train...
    finish({"losses": losses})       # write runs/.../rank{r}.json, barrier, tear down, exit

Note [one code path for CPU and GPU]: one rule, ``choose_backend``, decides per job where
its ranks run: NCCL with ``cuda:LOCAL_RANK`` when CUDA is available and every local rank has a
GPU of its own (local ranks <= visible GPUs), else gloo with CPU tensors -- NCCL cannot put two
ranks on one GPU, so 4 ranks on a 1-GPU machine run on CPU. ``MINIFSDP_BACKEND=gloo|nccl``
overrides it. The launcher applies the rule once and says so in one line (``BackendChoice.line``,
e.g. "4 ranks, 1 GPU: this job runs on CPU with gloo"); ``dist_setup`` applies the same rule to
torchrun's ``LOCAL_WORLD_SIZE``; everything downstream takes ``info.device`` and never asks
again. The same worker therefore runs on a 2-core laptop, a 1-GPU box, an 8-GPU box and a
multi-node cluster (``torchrun --nnodes``): only the launch command changes.

Note [bitwise on CUDA]: on a GPU ``dist_setup`` makes kernels deterministic -- ``torch.
use_deterministic_algorithms`` (warn-only), ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, TF32 off for
matmuls and convolutions, cuDNN's autotuner off -- because every job of the series compares
bits with torch's implementation: two runs of the same operations in the same order then agree
to the last bit, as they do on a CPU. ``MINIFSDP_DETERMINISTIC=0`` turns it off (benchmarks).
A comparison of one process with N processes is *not* bitwise on GPUs even so: a different
batch size gives cuBLAS other kernels and other summation orders.

Note [timeouts]: every process group is created with a timeout (``MINIFSDP_PG_TIMEOUT``
seconds, 120 by default). A rank that dies or hangs makes its peers' collectives raise
instead of waiting forever, so ``minifsdp.launch`` can report the failure.

Note [exit]: workers end with ``barrier -> destroy_process_group -> os._exit(0)``. The
barrier makes sure no rank tears down while a peer still sends; ``os._exit`` skips
interpreter shutdown, where gloo's background threads occasionally abort the process
("terminate called without an active exception", ~5% of runs on this machine).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_PG_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class DistInfo:
    """Who am I in the job. ``device`` is where this rank's tensors live."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class BackendChoice:
    """Where a job of ``local_ranks`` ranks per machine runs, and why (``line``)."""

    backend: str        # "nccl" or "gloo"
    device_type: str    # "cuda" or "cpu"
    local_ranks: int
    gpus: int           # CUDA devices visible here
    forced: bool        # MINIFSDP_BACKEND decided, not the rule

    @property
    def line(self) -> str:
        """One line for the reader, e.g. ``4 ranks, 1 GPU: this job runs on CPU with gloo``."""
        n = f"{self.local_ranks} rank{'s' * (self.local_ranks != 1)}"
        g = "no GPU" if self.gpus == 0 else f"{self.gpus} GPU{'s' * (self.gpus != 1)}"
        if self.backend == "nccl":
            where = ("NCCL, rank r on cuda:r" if self.local_ranks > 1 else "NCCL on cuda:0")
        else:
            where = "CPU with gloo"
        why = ""
        if self.forced:
            why = f" (MINIFSDP_BACKEND={self.backend})"
        elif self.backend == "gloo" and self.gpus:
            why = " (NCCL needs a GPU per rank)"
        return f"{n}, {g}: this job runs on {where}{why}"


def visible_gpus() -> int:
    """CUDA devices this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def choose_backend(local_ranks: int, gpus: int | None = None,
                   override: str | None = None) -> BackendChoice:
    """The one backend rule (Note [one code path for CPU and GPU]).

    Args:
        local_ranks: ranks this job starts on this machine (torchrun's ``--nproc-per-node``).
        gpus: visible CUDA devices (default: ask torch).
        override: ``"gloo"`` or ``"nccl"`` (default: ``$MINIFSDP_BACKEND``, if set).

    Example:
        >>> choose_backend(4, gpus=1, override="").line
        '4 ranks, 1 GPU: this job runs on CPU with gloo (NCCL needs a GPU per rank)'
        >>> choose_backend(4, gpus=4, override="").backend
        'nccl'
    """
    gpus = visible_gpus() if gpus is None else gpus
    if override is None:
        override = os.environ.get("MINIFSDP_BACKEND", "")
    if override and override not in BACKENDS:
        raise ValueError(f"MINIFSDP_BACKEND={override!r}: expected one of {', '.join(BACKENDS)}")
    if override == "nccl" and local_ranks > gpus:
        raise RuntimeError(
            f"MINIFSDP_BACKEND=nccl with {local_ranks} local ranks, but {gpus} GPU(s) are "
            "visible: NCCL needs a GPU per rank. Use fewer ranks, or unset MINIFSDP_BACKEND "
            "(the job then runs on CPU with gloo).")
    if override:
        backend = override
    else:
        backend = "nccl" if 0 < local_ranks <= gpus else "gloo"
    return BackendChoice(backend, "cuda" if backend == "nccl" else "cpu", local_ranks, gpus,
                         bool(override))


def describe_machine() -> str:
    """One line for a notebook's first cell: what this machine's jobs will run on.

    The core count is the one this process may run on: the chapters' timings and gloo's
    behaviour are stated for it ("measured on 2 cores").

    Example (a 2-core laptop):
        >>> describe_machine()                # doctest: +SKIP
        'this machine: torch 2.14.1, 2 CPU cores, no GPU: every job runs on CPU with gloo'
    """
    gpus = visible_gpus()
    forced = os.environ.get("MINIFSDP_BACKEND", "")
    # sched_getaffinity: the cores this process may use (Linux); cpu_count may not know (None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    where = f"{cores} CPU core{'s' * (cores != 1)}" if cores else "CPU cores unknown"
    head = f"this machine: torch {torch.__version__}, {where}, "
    if forced:
        return head + f"MINIFSDP_BACKEND={forced}: every job runs on {forced}"
    if gpus == 0:
        return head + "no GPU: every job runs on CPU with gloo"
    name = torch.cuda.get_device_name(0)
    return head + (f"{gpus} GPU{'s' * (gpus != 1)} ({name}): a job of up to {gpus} "
                   f"rank{'s' * (gpus != 1)} runs on NCCL, one GPU each; a larger job on CPU "
                   "with gloo")


def require_torch_api(owner: type, names: tuple[str, ...], who: str) -> None:
    """Raise a ``RuntimeError`` naming every attribute of ``owner`` in ``names`` that this
    torch lacks, the torch found and the one ``pyproject.toml`` pins; ``who`` says what needs
    them. For code that compares with a torch API newer than some readers' torch.

    Example::

        require_torch_api(torch.distributed.fsdp.FSDPModule, ("reset_iter_state",),
                          "chapter 11")    # torch 2.11: RuntimeError naming reset_iter_state
    """
    missing = [n for n in names if not hasattr(owner, n)]
    if missing:
        raise RuntimeError(
            f"{who} compares with torch's {owner.__name__}.{', .'.join(missing)}, which torch "
            f"{torch.__version__} does not have; install the torch pyproject.toml pins "
            "(torch==2.14.1), where they are")


def dist_setup(backend: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Initialise the default process group from torchrun's environment.

    Outside torchrun (no ``RANK`` in the environment) a one-process group is created, so a
    worker's code can also be stepped through in a notebook or debugger.

    Example (inside a script run by ``torchrun --nproc-per-node 2``)::

        info = dist_setup()
        t = torch.ones(3, device=info.device) * info.rank
        dist.all_reduce(t)            # tensor([1., 1., 1.]) on both ranks
    """
    if dist.is_initialized():
        raise RuntimeError("dist_setup() called twice: the default process group already exists")
    _install_stack_dumps()
    timeout_s = timeout_s or float(os.environ.get("MINIFSDP_PG_TIMEOUT", DEFAULT_PG_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=timeout_s)
    torchrun_job = "RANK" in os.environ
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if torchrun_job else 1
    choice = choose_backend(local_ranks, override=backend)

    if torchrun_job:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        expected = os.environ.get("MINIFSDP_EXPECT_WORLD_SIZE")
        if expected is not None and int(expected) != world:
            raise RuntimeError(
                f"this job expects world size {expected} but torchrun started {world} processes"
            )
    else:  # a single process, e.g. a notebook cell: a world of one
        rank, world, local_rank = 0, 1, 0
    if rank == 0 and torchrun_job and not os.environ.get("MINIFSDP_LAUNCHER"):
        print(choice.line, flush=True)  # run by hand: say where (the launcher said it already)
    if choice.device_type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible. "
                "Use --nproc-per-node <= number of GPUs, or MINIFSDP_BACKEND=gloo for CPU."
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if os.environ.get("MINIFSDP_DETERMINISTIC", "1") != "0":
            make_deterministic()
    else:
        device = torch.device("cpu")
    if torchrun_job:
        dist.init_process_group(choice.backend, timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
    else:
        dist.init_process_group(choice.backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    backend = choice.backend
    return DistInfo(rank, world, local_rank, device, backend)


def _install_stack_dumps() -> None:
    """Make a stuck worker explain itself: on SIGUSR1 (sent by the launcher on timeout) or
    SIGTERM (sent by torchrun when a peer failed) print every thread's Python stack to
    stderr, which the launcher shows. ``chain=True`` keeps SIGTERM's default action. A crash
    in native code (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) prints the Python stack too
    (``faulthandler.enable``): "rank 0 was killed by signal 11" alone names no frame.
    Windows has neither ``faulthandler.register`` nor SIGUSR1: there a hang is still ended by
    the process group's timeout, without the stacks."""
    faulthandler.enable(file=sys.stderr, all_threads=True)
    if not hasattr(faulthandler, "register") or not hasattr(signal, "SIGUSR1"):
        return
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)


def make_deterministic() -> None:
    """CUDA kernels that give the same bits for the same operations (Note [bitwise on CUDA]).

    ``CUBLAS_WORKSPACE_CONFIG`` must be set before cuBLAS starts, i.e. before the first
    matmul: ``dist_setup`` calls this before any model exists."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True


def seed_everything(seed: int) -> None:
    """Seed Python, and torch's CPU and CUDA generators.

    Convention: the *same* seed on every rank for model init (so replicas start identical),
    ``seed + rank`` for anything that must differ per rank (e.g. dropout masks).
    """
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on global rank 0 only (or always, before the process group exists)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


PROGRESS_TAG = "@minifsdp-progress "
RUN_TAG = PROGRESS_TAG + "run "  # a sweep's next run starts: "<tag>NAME" (minifsdp.sweep)


def report_progress(step: int, total: int, **metrics: float) -> None:
    """How far this run is, from rank 0 (other ranks say nothing).

    Under ``minifsdp.launch`` (which sets ``MINIFSDP_LAUNCHER``) it writes one machine-readable line
    that the launcher turns into a progress bar; run by hand (``torchrun ... -m
    minifsdp.train``) it logs a line for a person about every 10% of the run.

    Example: ``report_progress(10, 100, loss=0.31)`` -> ``step 10/100 (10%) loss=0.31``.
    """
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    if os.environ.get("MINIFSDP_LAUNCHER"):
        payload = {"step": step, "total": total, **{k: float(v) for k, v in metrics.items()}}
        print(PROGRESS_TAG + json.dumps(payload), flush=True)
        return
    every = max(1, total // 10)
    if step == total or step == 1 or step % every == 0:
        shown = " ".join(f"{k}={float(v):.4g}" for k, v in metrics.items())
        print(f"step {step}/{total} ({100 * step // max(total, 1)}%) {shown}".rstrip(),
              flush=True)


def results_dir() -> Path:
    """Where this run's per-rank JSON goes: ``$MINIFSDP_OUT`` (set by the launcher) or
    ``runs/adhoc``."""
    return Path(os.environ.get("MINIFSDP_OUT", "runs/adhoc"))


def save_results(results: dict[str, Any]) -> Path:
    """Write this rank's results to ``<results_dir>/rank{r}.json`` atomically."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, default=_jsonable))
    tmp.replace(path)  # a reader never sees half a file
    return path


def _jsonable(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (torch.device, torch.dtype, Path)):
        return str(x)
    raise TypeError(f"cannot serialise {type(x).__name__} to JSON")


def finish(results: dict[str, Any] | None = None) -> None:
    """Save this rank's results (if any) and end the worker cleanly. Never returns.

    See Note [exit] at the top of this module for why it is barrier -> destroy -> os._exit.
    """
    if results is not None:
        save_results(results)
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)


def run_header(args: argparse.Namespace, info: DistInfo) -> dict:
    """The fields every results file starts with, finished or not: which run and which rank."""
    return {"strategy": args.strategy, "model": args.model, "rank": info.rank,
            "world_size": info.world_size, "device": str(info.device),
            "backend": info.backend, "config": vars(args)}
