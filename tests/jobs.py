"""Torchrun jobs declared beside the tests that read them; the ``launched`` fixture in
conftest.py starts every job that the selected tests of a module need, before its first test.

A job is what it launches, with a name for its run directory (``runs/tests/<prefix><name>``,
the prefix being the module's ``JOB_PREFIX`` or its name without ``test_``)::

    N2 = Job("n2", WORKER, 2)
    TRAIN = Job("train_fsdp1", "minifsdp.train", 2, ("--strategy", "fsdp1"))

A test declares the jobs it reads with a mark, on itself or on one parameter set::

    @pytest.mark.launches(TRAIN)
    def test_trains(launched):
        launched[TRAIN].result().ranks

    @pytest.mark.parametrize("n", [pytest.param(n, marks=pytest.mark.launches(W[n]))
                                   for n in (2, 3)])

and a module fixture declares them for every test that requests it (directly or through
another fixture)::

    @fixture_of(N2, N3)
    def runs(launched):
        return {2: launched[N2].result().ranks, 3: launched[N3].result().ranks}

``PARALLEL`` (launches at once, default 2) and ``LAUNCH_OPTIONS`` (more ``torchrun`` keyword
arguments) stay module attributes: they are the module's, not a test's.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class Job:
    """``torchrun(target, *args, nproc=nproc)``, its run named ``name``."""

    name: str
    target: str
    nproc: int
    args: tuple = ()


def fixture_of(*jobs: Job, scope: str = "module"):
    """Decorator: a ``scope`` fixture whose every requester needs ``jobs`` launched."""
    for job in jobs:
        if not isinstance(job, Job):
            raise TypeError(f"fixture_of takes Job objects, got {job!r}")

    def make(fn):
        fixture = pytest.fixture(scope=scope)(fn)
        fixture.jobs = jobs
        return fixture

    return make


def declared(item: pytest.Item) -> list[Job]:
    """The jobs ``item`` reads: its ``launches`` marks' (its own, its parameter set's, its
    class's or module's) and those of the module fixtures it requests."""
    out = [job for mark in item.iter_markers("launches") for job in mark.args]
    for name in getattr(item, "fixturenames", ()):
        out += getattr(getattr(item.module, name, None), "jobs", ())
    bad = [job for job in out if not isinstance(job, Job)]
    if bad:
        raise TypeError(f"{item.nodeid}: launches takes Job objects, got {bad[0]!r}")
    return out
