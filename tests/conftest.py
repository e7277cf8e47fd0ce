"""Shared fixture for the test modules that launch real torchrun jobs.

A launch costs 6-15 s on 2 cores, mostly start-up during which a core idles. The tests of a
module that uses ``launched`` declare the jobs they read beside themselves (``tests/jobs.py``:
a ``launches`` mark on a test, ``fixture_of`` on a fixture), and the fixture starts every job
the *selected* tests need, ``PARALLEL`` at a time, before the first test runs; each test then
waits only for the jobs it reads. Its ``minifsdp.train`` jobs of one world size run one after
another in one launch (``minifsdp.sweep``, Note [a sweep of runs]), which pays torch's start-up
once; a job that fails there is run again alone. The module may set:

    PARALLEL (default 2)                launches at once
    JOB_PREFIX (default: its name without test_, then _)   run names: runs/tests/<prefix><name>
    LAUNCH_OPTIONS                      extra keyword arguments for ``torchrun``
"""

import os
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from jobs import Job, declared

from minifsdp.sweep import submit_all

GLOO = {"MINIFSDP_BACKEND": "gloo"}  # CPU collectives, also on a machine with GPUs


@pytest.fixture(scope="module", autouse=True)
def cpu_facts():
    """Pin gloo and CPU tensors for every test module here, on every machine.

    The tests' oracles are CPU facts: exact byte counts of CPU tensors, gloo's collectives,
    bitwise equalities measured on this CPU. On a machine with GPUs the backend rule (Note [one
    code path for CPU and GPU]) would put 1-rank jobs, and this process's own world of one, on
    NCCL and CUDA. ``MINIFSDP_BACKEND=gloo`` in this process's environment reaches every
    ``dist_setup`` run here, every launch (the launcher hands its environment to the workers)
    and every subprocess. Module scope, so it is in place before a module's ``launched`` jobs
    start; modules marked ``gpu`` (tests/test_gpu.py) are the exception, and notebooks, which
    run under the machine's own rule, never see it."""
    saved = os.environ.get("MINIFSDP_BACKEND")
    os.environ["MINIFSDP_BACKEND"] = "gloo"
    yield
    if saved is None:
        os.environ.pop("MINIFSDP_BACKEND", None)
    else:
        os.environ["MINIFSDP_BACKEND"] = saved


@pytest.fixture(scope="module", autouse=True)
def _gpu_modules_use_the_rule(request, cpu_facts):
    """A module marked ``gpu`` tests the machine's own rule: lift the pin for it."""
    if next(request.node.iter_markers("gpu"), None) is None:
        yield
        return
    pinned = os.environ.pop("MINIFSDP_BACKEND", None)
    yield
    if pinned is not None:
        os.environ["MINIFSDP_BACKEND"] = pinned


@pytest.fixture(scope="module")
def launched(request) -> dict[Job, Future]:
    """Job -> Future of its ``RunResult`` (or the ``WorkerError`` it raised): every job that
    the module's selected tests declare (``tests/jobs.py``)."""
    mod = request.module
    # (nbval's notebook cells, collected in the same session, have no .module)
    items = [item for item in request.session.items if getattr(item, "module", None) is mod]
    wanted = dict.fromkeys(job for item in items for job in declared(item))  # in test order
    names = [job.name for job in wanted]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"{mod.__name__}: two different jobs named {twice}: a run's "
                         "directory is its name")
    prefix = getattr(mod, "JOB_PREFIX", mod.__name__.removeprefix("test_") + "_")
    options = {"timeout": 300, "env": GLOO, **getattr(mod, "LAUNCH_OPTIONS", {})}
    with ThreadPoolExecutor(getattr(mod, "PARALLEL", 2)) as pool:
        # the minifsdp.train jobs of one world size share a launch (Note [a sweep of runs])
        by_name = submit_all(pool, {prefix + job.name: (job.target, job.nproc, job.args)
                                    for job in wanted}, chapter="tests", **options)
        futures = Launched(mod.__name__)
        futures.update({job: by_name[prefix + job.name] for job in wanted})
        yield futures
        pool.shutdown(cancel_futures=True)  # a run cut short (-x, Ctrl-C) starts no more


class Launched(dict):
    """The ``launched`` futures; a job no selected test declared is a clear error."""

    def __init__(self, module: str):
        super().__init__()
        self.module = module

    def __missing__(self, key):
        raise KeyError(f"{self.module}: job {key!r} was not launched: no selected test declares "
                       "it (a launches mark on the test, or fixture_of on a fixture it requests)")


@pytest.fixture(scope="module")
def one_rank():
    """A gloo process group of one, in this process (for in-process tests of code that asks
    for its rank and world size); created and destroyed here unless one exists already."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    if created:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def cpu_mesh(one_rank):
    """A 1-D CPU ``DeviceMesh`` over a world of one, in this process (for DTensor unit tests)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))
