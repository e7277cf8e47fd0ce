"""minifsdp: Fully Sharded Data Parallel, rebuilt step by step.

The pieces a reader reaches for most often are re-exported here; each lives in a module of
its own (see README.md for the map)::

    from minifsdp import torchrun, MemoryTracker, MnistCNN
"""

from minifsdp.dist import DistInfo, dist_setup, finish, print0, report_progress, seed_everything
from minifsdp.launch import RunResult, WorkerError, WorkerTimeout, torchrun
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPT, GPTConfig, MnistCNN, build_model, count_params

__version__ = "0.1.0"

__all__ = [
    "GPT", "DistInfo", "GPTConfig", "MemoryTracker", "MnistCNN", "RunResult", "WorkerError",
    "WorkerTimeout", "build_model", "count_params", "dist_setup", "finish", "print0",
    "report_progress", "seed_everything", "torchrun",
]
