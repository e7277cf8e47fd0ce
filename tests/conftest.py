"""Shared fixture for the test modules that launch real torchrun jobs.

A launch costs 6-15 s on 2 cores, mostly start-up during which a core idles. A module that
uses ``launched`` declares its jobs, and the fixture starts every job the *selected* tests
need, ``PARALLEL`` at a time, before the first test runs; each test then waits only for the
jobs it reads. The module declares:

    job(key) -> (target, nproc, args)   what to launch for a job key
    jobs_of(item) -> [key, ...]         the job keys a collected test reads
    PARALLEL                            jobs at once
    JOB_PREFIX                          run names: runs/tests/<prefix><key>
    LAUNCH_OPTIONS (optional)           extra keyword arguments for ``torchrun``
"""

import os
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from minifsdp.launch import torchrun

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
def launched(request) -> dict[object, Future]:
    """job key -> Future of its ``RunResult`` (or the ``WorkerError`` it raised)."""
    mod = request.module
    # (nbval's notebook cells, collected in the same session, have no .module)
    keys = [k for item in request.session.items
            if getattr(item, "module", None) is mod for k in mod.jobs_of(item)]
    keys = sorted(set(keys), key=lambda k: -mod.job(k)[1])  # big jobs first: less idle tail
    options = {"timeout": 300, "env": GLOO, **getattr(mod, "LAUNCH_OPTIONS", {})}
    with ThreadPoolExecutor(mod.PARALLEL) as pool:
        futures = {}
        for key in keys:
            target, nproc, args = mod.job(key)
            name = mod.JOB_PREFIX + (key if isinstance(key, str) else "_".join(map(str, key)))
            futures[key] = pool.submit(torchrun, target, *args, nproc=nproc, chapter="tests",
                                       name=name, **options)
        yield futures
        pool.shutdown(cancel_futures=True)  # a run cut short (-x, Ctrl-C) starts no more


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
