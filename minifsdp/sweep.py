"""Several ``minifsdp.train`` runs in one torchrun job, one after another.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m minifsdp.sweep plan.json

where ``plan.json`` lists the runs: ``[{"name": "ddp", "out": "runs/09/ddp", "argv":
["--strategy", "ddp", ...]}, ...]``. From Python, ``torchrun_sweep`` writes the plan, launches
it and returns one ``RunResult`` per run; ``torchrun_all`` (``minifsdp.launch``) sends its
``minifsdp.train`` jobs here on its own (``submit_all``).

Note [a sweep of runs]: a 2-rank job on 2 CPU cores spends about 7 s of CPU on things that are
not training: torchrun imports torch and opens its rendezvous (~2.5 s), every rank imports torch,
the ``torch._dynamo`` that ``torch.optim.Optimizer`` pulls in and FSDP2's DTensor (~5 s of the
two ranks' CPU), and torchrun waits ~0.8 s after the ranks exit. A chapter comparing seven
strategies for 16 steps pays that seven times for a few seconds of training each. A sweep pays
it once: the ranks set up the process group once and call ``minifsdp.train.run`` for each run
of the plan, in order, each writing its own ``rank{r}.json`` (and ``params.pt``) into its own
directory, exactly where a job of its own would have written them.

A run is the same alone or in a sweep, bit for bit: ``run`` seeds every generator from its own
``--seed``, builds its own model, optimizer and data, and clears the comm log first; nothing a
run keeps refers to an earlier run's tensors. tests/test_sweep.py compares a run alone and in a
sweep behind another: losses, parameters, comm log and (at world size 1, where the tracker's
timeline is reproducible) the whole memory JSON. What a sweep cannot hold: a run that kills its
own ranks (``--kill-at-step``, ``--kill-during-save``), which ``submit_all`` launches alone; and
a failure ends the job. The runs that had finished on every rank stand (``SweepFailed.finished``);
``submit_all`` runs each of the others alone, so the error a reader sees is the failing job's
own, as if there had been no sweep.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import shutil
import sys
import warnings
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

from minifsdp.dist import RUN_TAG, dist_setup, finish, save_results
from minifsdp.launch import RunResult, WorkerError, _read_logs, repo_root, torchrun

TARGET = "minifsdp.train"  # the one worker whose runs a sweep holds
ALONE_FLAGS = ("--kill-at-step", "--kill-during-save")  # runs that end their own ranks


def main(argv: list[str] | None = None) -> None:
    """The worker: run every run of the plan, in order, in one process group."""
    p = argparse.ArgumentParser(prog="minifsdp.sweep", description=__doc__.split("\n")[0])
    p.add_argument("plan", type=Path, help="JSON list of {name, out, argv}")
    plan = _read_plan(p.parse_args(argv).plan)

    from minifsdp import train  # the worker's import: the launcher side needs none of it

    info = dist_setup()
    for run in plan:
        os.environ["MINIFSDP_OUT"] = run["out"]  # results_dir(): this run's own directory
        print(RUN_TAG + run["name"], flush=True)  # every rank: its output is cut here
        try:
            results = train.run(_parse(train, run), info)
        except Exception as e:
            e.add_note(f"minifsdp.sweep: in run {run['name']!r}, minifsdp.train "
                       + " ".join(run["argv"]))
            raise
        save_results(results)
        del results
        # the run's model, optimizer and buffers go now, cycles included: on CUDA each memory
        # sample records torch.cuda.memory_allocated() (Note [CUDA] in minifsdp/memory.py)
        gc.collect()
    finish()


def _parse(train, run: dict) -> argparse.Namespace:
    try:
        return train.parse_args(run["argv"])
    except SystemExit:  # argparse printed what is wrong; say which run it was
        print(f"minifsdp.sweep: run {run['name']!r}: bad arguments to minifsdp.train (above)",
              file=sys.stderr, flush=True)
        raise


def _read_plan(path: Path) -> list[dict]:
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"minifsdp.sweep: cannot read the plan {path}: {e}") from None
    for i, r in enumerate(plan if isinstance(plan, list) else [None]):
        if not (isinstance(r, dict) and {"name", "out", "argv"} <= r.keys()):
            raise SystemExit(f"minifsdp.sweep: {path}: entry {i} is not "
                             "{name, out, argv}: " + repr(r)[:200])
        bad = [f for f in ALONE_FLAGS if f in r["argv"]]
        if bad:
            raise SystemExit(f"minifsdp.sweep: {path}: run {r['name']!r} uses {bad[0]}, which "
                             "ends its ranks: launch it alone (Note [a sweep of runs])")
    return plan


def torchrun_sweep(runs: dict[str, tuple], *, nproc: int = 2, chapter: str = "adhoc",
                   timeout: float = 300.0, **options: Any) -> dict[str, RunResult]:
    """Run every ``minifsdp.train`` run of ``runs`` (``name -> args``) in one torchrun job of
    ``nproc`` ranks, one after another (Note [a sweep of runs]); return ``name -> RunResult``.

    Each run's results go to ``runs/<chapter>/<name>/`` as from ``torchrun(name=name)``; its
    ``stdout`` is what the ranks printed during that run; ``wall_s`` is the whole sweep's.
    ``timeout`` is per run (the job gets ``len(runs)`` times it); ``options`` as ``torchrun``'s.

    Example:
        >>> res = torchrun_sweep({"ddp": ("--strategy", "ddp", "--steps", 2),
        ...                       "fsdp2": ("--strategy", "fsdp2", "--steps", 2)}, nproc=2)
        ... # doctest: +SKIP
        >>> res["ddp"].ranks[0]["losses"] == res["fsdp2"].ranks[0]["losses"]  # doctest: +SKIP
        True
    """
    base = repo_root() / "runs" / chapter
    outs = {k: base / k for k in runs}
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)  # stale rank files must never be read back
    name = "sweep_" + hashlib.sha1("\0".join(runs).encode()).hexdigest()[:10]
    plan = base / f"{name}.plan.json"
    plan.parent.mkdir(parents=True, exist_ok=True)
    plan.write_text(json.dumps([{"name": k, "out": str(outs[k]), "argv": [str(a) for a in v]}
                                for k, v in runs.items()], indent=1))
    try:
        job = torchrun("minifsdp.sweep", plan, nproc=nproc, name=name, chapter=chapter,
                       timeout=timeout * len(runs), **options)
    except WorkerError as e:  # the runs that had finished on every rank stand
        stdout = _by_run(_read_logs(base / name / "logs", "stdout"))
        found = {k: _result(k, outs[k], nproc, stdout) for k in runs}
        done = {k: r for k, r in found.items() if all(x and x.get("finished") for x in r.ranks)}
        raise SweepFailed(str(e), e.rank, e.logs, done) from e
    stdout = _by_run(job.stdout)
    return {k: _result(k, outs[k], nproc, stdout, job.wall_s, job.backend) for k in runs}


class SweepFailed(WorkerError):
    """A run of a sweep failed; ``finished`` holds the ``RunResult`` of every run that had
    finished on every rank before it."""

    def __init__(self, message: str, rank, logs: dict[int, str], finished: dict):
        super().__init__(message, rank, logs)
        self.finished = finished


def _result(name: str, out: Path, nproc: int, stdout: dict[int, dict], wall_s: float = math.nan,
            backend=None) -> RunResult:
    """Run ``name``'s ``RunResult``: its rank files, and its part of each rank's output
    (``stdout``: rank -> ``_split_runs`` of what it printed)."""
    ranks = [json.loads(p.read_text()) if (p := out / f"rank{r}.json").exists() else None
             for r in range(nproc)]
    return RunResult(name, out, ranks, {r: runs.get(name, "") for r, runs in stdout.items()},
                     wall_s, backend)


def _by_run(stdout: dict[int, str]) -> dict[int, dict]:
    return {r: _split_runs(text) for r, text in stdout.items()}  # once per rank, not per run


def _split_runs(text: str) -> dict[str | None, str]:
    """A rank's stdout cut at its ``RUN_TAG`` lines: ``run name -> what it printed``
    (``None``: what it printed before the first run)."""
    out: dict[str | None, list[str]] = {}
    current = None
    for line in text.splitlines(keepends=True):
        if line.startswith(RUN_TAG):
            current = line[len(RUN_TAG):].strip()
            continue
        out.setdefault(current, []).append(line)
    return {k: "".join(v) for k, v in out.items()}


def submit_all(pool: Executor, jobs: dict[str, tuple[str, int, tuple]], **options: Any
               ) -> dict[str, Future]:
    """Submit ``jobs`` (``name -> (target, nproc, args)``) to ``pool``; return ``name ->
    Future`` of its ``RunResult`` (or the ``WorkerError`` it raised).

    The ``minifsdp.train`` jobs of one ``nproc`` run as one sweep (Note [a sweep of runs]);
    if it fails, the runs it finished stand and each other job runs alone, to its own result
    or error. Every other job is a ``torchrun`` of its own. Big launches are submitted first
    (less idle tail)."""
    groups: dict[int, list[str]] = {}
    singles = []
    for k, (target, nproc, args) in jobs.items():
        sweepable = target == TARGET and not any(str(a) in ALONE_FLAGS for a in args)
        (groups.setdefault(nproc, []) if sweepable else singles).append(k)
    for nproc, names in list(groups.items()):
        if len(names) == 1:
            singles += groups.pop(nproc)

    def alone(k: str):
        target, nproc, args = jobs[k]
        return torchrun(target, *args, nproc=nproc, name=k, **options)

    futures: dict[str, Future] = {}
    work = [(jobs[k][1], [k]) for k in singles] + [(n, names) for n, names in groups.items()]
    for nproc, names in sorted(work, key=lambda w: -w[0] * len(w[1])):
        if len(names) == 1:
            futures[names[0]] = pool.submit(alone, names[0])
            continue
        sweep: Future = pool.submit(torchrun_sweep, {k: jobs[k][2] for k in names},
                                    nproc=nproc, **options)
        for k in names:
            futures[k] = _SweepMember(sweep, k, alone)
    return {k: futures[k] for k in jobs}


class _SweepMember(Future):
    """Run ``name``'s Future: its ``RunResult`` from the sweep, also when a later run of the
    sweep failed; otherwise the result or error of ``name`` run alone (computed once, when
    first asked for)."""

    def __init__(self, sweep: Future, name: str, alone):
        super().__init__()
        self._sweep, self._name, self._alone = sweep, name, alone

    def result(self, timeout=None):
        if not self.done():  # first asked: settle it
            try:
                self.set_result(self._sweep.result()[self._name])
            except Exception as failed:
                finished = getattr(failed, "finished", {})  # SweepFailed's
                if self._name in finished:
                    self.set_result(finished[self._name])
                else:
                    warnings.warn(f"{self._name}: the sweep it ran in failed, so it runs alone "
                                  f"(Note [a sweep of runs]): {str(failed).splitlines()[0]}",
                                  stacklevel=2)
                    try:
                        self.set_result(self._alone(self._name))
                    except BaseException as e:
                        self.set_exception(e)
        return super().result(timeout)


if __name__ == "__main__":
    main()
