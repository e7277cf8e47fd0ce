"""Process-group setup and teardown, seeding, rank-aware printing and per-rank results.

Every worker in the series is launched by ``torchrun`` and follows the same life cycle::

    info = dist_setup()              # reads RANK/WORLD_SIZE/LOCAL_RANK set by torchrun
    seed_everything(0)               # same seed on every rank -> identical model init
    ...train...
    finish({"losses": losses})       # write runs/.../rank{r}.json, barrier, tear down, exit

Note [one code path for CPU and GPU]: ``dist_setup`` picks ``nccl`` + ``cuda:LOCAL_RANK``
when CUDA is available and ``gloo`` + ``cpu`` otherwise; everything downstream takes
``info.device`` and never asks again. The same worker therefore runs on a 2-core laptop, an
8-GPU box and a multi-node cluster (``torchrun --nnodes``): only the launch command changes.

Note [timeouts]: every process group is created with a timeout (``MINIFSDP_PG_TIMEOUT``
seconds, 120 by default). A rank that dies or hangs makes its peers' collectives raise
instead of waiting forever, so ``minifsdp.launch`` can report the failure.

Note [exit]: workers end with ``barrier -> destroy_process_group -> os._exit(0)``. The
barrier makes sure no rank tears down while a peer still sends; ``os._exit`` skips
interpreter shutdown, where gloo's background threads occasionally abort the process
("terminate called without an active exception", ~5% of runs on this machine).
"""

from __future__ import annotations

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


def pick_backend() -> tuple[str, str]:
    """``("nccl", "cuda")`` when GPUs are visible, else ``("gloo", "cpu")``."""
    if torch.cuda.is_available():
        return "nccl", "cuda"
    return "gloo", "cpu"


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
    default_backend, device_type = pick_backend()
    backend = backend or os.environ.get("MINIFSDP_BACKEND") or default_backend
    if backend == "gloo":
        device_type = "cpu"
    timeout_s = timeout_s or float(os.environ.get("MINIFSDP_PG_TIMEOUT", DEFAULT_PG_TIMEOUT_S))
    timeout = datetime.timedelta(seconds=timeout_s)

    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        expected = os.environ.get("MINIFSDP_EXPECT_WORLD_SIZE")
        if expected is not None and int(expected) != world:
            raise RuntimeError(
                f"this job expects world size {expected} but torchrun started {world} processes"
            )
        device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
        if device.type == "cuda":
            if local_rank >= torch.cuda.device_count():
                raise RuntimeError(
                    f"local rank {local_rank} has no GPU: {torch.cuda.device_count()} visible. "
                    "Use --nproc-per-node <= number of GPUs, or MINIFSDP_BACKEND=gloo for CPU."
                )
            torch.cuda.set_device(device)
            dist.init_process_group(backend, timeout=timeout, device_id=device)
        else:
            dist.init_process_group(backend, timeout=timeout)
    else:  # a single process, e.g. a notebook cell: a world of one
        rank, world, local_rank = 0, 1, 0
        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return DistInfo(rank, world, local_rank, device, backend)


def _install_stack_dumps() -> None:
    """Make a stuck worker explain itself: on SIGUSR1 (sent by the launcher on timeout) or
    SIGTERM (sent by torchrun when a peer failed) print every thread's Python stack to
    stderr, which the launcher shows. ``chain=True`` keeps SIGTERM's default action."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)


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


def report_progress(step: int, total: int, **metrics: float) -> None:
    """Tell the launcher how far this run is (rank 0 only). Shown as a progress bar.

    Example: ``report_progress(10, 100, loss=0.31)`` -> bar at 10/100 with ``loss=0.31``.
    """
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    payload = {"step": step, "total": total, **{k: float(v) for k, v in metrics.items()}}
    print(PROGRESS_TAG + json.dumps(payload), flush=True)


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
