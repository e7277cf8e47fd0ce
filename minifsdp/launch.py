"""Launch a multi-process job with torchrun from Python, and get its results back.

Notebooks and tests call::

    run = torchrun("minifsdp.train", "--strategy", "torch_ddp", nproc=2, name="ddp")
    run.ranks[0]["losses"]          # rank 0's JSON, as plain Python objects

which runs ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m minifsdp.train
...`` in a subprocess -- the very command a reader would type in a terminal.

Note [failures surface, never hang]: torchrun writes each rank's stdout/stderr to its own
file (``--redirects 3 --log-dir``). If a rank raises, torchrun stops the others and exits
non-zero; we read its summary to find the first failing rank and raise ``WorkerError`` with
*that rank's* traceback. If the job outlives ``timeout``, we send SIGUSR1 to every worker
(``minifsdp.dist`` registered ``faulthandler`` for it, so each prints its Python stack), kill
the process group, and raise ``WorkerTimeout`` showing where every rank was stuck.

Note [standalone]: ``--standalone`` starts a private rendezvous on a free port, so two
notebooks (or two pytest workers) can launch jobs at the same time. Multi-node jobs are
launched by hand with ``--nnodes``/``--rdzv-endpoint`` (see README); the workers are the same.
``torchrun_multinode`` simulates them on this machine (Note [multi-node]).

Note [multi-node]: a multi-node job is one torchrun launcher per node, all started with the
same ``--nnodes``, ``--rdzv-backend c10d``, ``--rdzv-endpoint HOST:PORT`` and ``--rdzv-id``.
The launcher on HOST serves a TCPStore at PORT; every launcher joins the rendezvous there,
which numbers the nodes (group ranks) in sorted (host, launcher pid) order -- with c10d,
``--node-rank`` is ignored (torch warns) -- and gives each worker ``RANK = group_rank *
nproc_per_node + LOCAL_RANK`` and the ``MASTER_ADDR``/``MASTER_PORT`` of the process group's
store. ``--nnodes`` is an elastic range (``MIN:MAX``), so a mismatch is not an error:
measured, one of two launchers given ``--nnodes 3`` joins a world of 2 once the other closes
the rendezvous at its count; launchers at *different* endpoints each wait ``join_timeout`` and
fail with ``RendezvousTimeoutError``. ``torchrun_multinode`` starts the launchers on
localhost; on a cluster (e.g. 2 nodes x 8 GPUs) one runs on each node::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id $JOB_ID -m minifsdp.train ...

(under Slurm: ``srun --nodes 2 --ntasks-per-node 1 torchrun ...`` with MASTER_ADDR the first
host of ``scontrol show hostnames $SLURM_JOB_NODELIST`` and ``--rdzv-id $SLURM_JOB_ID``). What
the simulation does not show: (1) NCCL, not gloo over loopback -- NVLink inside a node,
InfiniBand/RoCE or TCP between nodes, so inter-node bandwidth (tens of GB/s per GPU against
hundreds inside a node) sets the step time (``minifsdp.scale``); (2) network setup -- the
rendezvous HOST:PORT must be reachable from every node (firewalls), ``NCCL_SOCKET_IFNAME`` /
``GLOO_SOCKET_IFNAME`` pick the interface (e.g. ``eth0``, not ``lo`` or ``docker0``),
``NCCL_IB_HCA`` the InfiniBand adapters, ``NCCL_DEBUG=INFO`` prints what NCCL chose; (3) the
same code, environment and data on every node, and a shared file system for
``MINIFSDP_OUT`` (else each node keeps its own ranks' JSON); (4) ``perf_counter`` times in
the comm logs of different machines are not on one clock; (5) a dead node: gloo's peers fail
at once on the broken connection, NCCL's wait for the collective timeout (``pg_timeout``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minifsdp.dist import PROGRESS_TAG, RUN_TAG, BackendChoice, choose_backend


class WorkerError(RuntimeError):
    """A rank of a torchrun job failed. ``rank`` is the first rank that failed."""

    def __init__(self, message: str, rank: int | None, logs: dict[int, str]):
        super().__init__(message)
        self.rank = rank
        self.logs = logs


class WorkerTimeout(WorkerError):
    """A torchrun job did not finish within its timeout (a hang, or too little time)."""


@dataclass
class RunResult:
    """What a finished job left behind.

    ``ranks[r]`` is rank r's JSON (``None`` if it wrote none), ``stdout[r]`` its printed
    output, ``wall_s`` the job's wall time including process start-up, ``backend`` where it
    ran (``backend.line`` says it in words, Note [one code path for CPU and GPU]).
    """

    name: str
    out_dir: Path
    ranks: list[Any]
    stdout: dict[int, str] = field(repr=False)
    wall_s: float
    backend: BackendChoice | None = None

    def print_logs(self, ranks: list[int] | None = None) -> None:
        """Print what each rank printed (progress lines omitted), prefixed by its rank."""
        for r in ranks if ranks is not None else sorted(self.stdout):
            for line in self.stdout[r].splitlines():
                if not line.startswith(PROGRESS_TAG):
                    print(f"[rank{r}] {line}")


def repo_root() -> Path:
    """The checkout containing this package (``runs/`` lives there), else the cwd."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "pyproject.toml").exists() else Path.cwd()


def torchrun(
    target: str,
    *args: Any,
    nproc: int = 2,
    name: str | None = None,
    chapter: str = "adhoc",
    timeout: float = 300.0,
    pg_timeout: float | None = None,
    progress: bool | None = None,
    env: dict[str, str] | None = None,
) -> RunResult:
    """Run ``target`` (a module name like ``"minifsdp.train"`` or a ``.py`` path) on ``nproc``
    local processes under torchrun and return every rank's JSON results.

    Args:
        target: module (run with ``-m``) or script path.
        *args: command-line arguments for the worker (converted with ``str``).
        nproc: processes on this machine (= world size here).
        name / chapter: results go to ``runs/<chapter>/<name>/rank{r}.json``.
        timeout: seconds before the job is considered hung (``WorkerTimeout``).
        pg_timeout: seconds a collective may wait for a peer (``MINIFSDP_PG_TIMEOUT``).
        progress: show a progress bar from the worker's ``report_progress`` calls
            (default: in a terminal or a notebook).
        env: extra environment variables for the workers (``MINIFSDP_BACKEND`` among them
            overrides the backend rule).

    Where the job runs is decided here, once, by ``minifsdp.dist.choose_backend(nproc)``
    and handed to every worker as ``MINIFSDP_BACKEND``; ``run.backend.line`` says it.

    Example:
        >>> run = torchrun("minifsdp.demos.collectives", "--demo", "collectives", nproc=2)
        >>> sorted(run.ranks[0])   # doctest: +SKIP
        ["all_gather_into_tensor", "all_reduce", ...]
    """
    if progress is None:  # a terminal or a notebook: someone is watching
        progress = _watched()
    options = ("--standalone", "--nproc-per-node", nproc)
    return _run(target, args, name=name, chapter=chapter, nnodes=1, nproc_per_node=nproc,
                timeout=timeout, pg_timeout=pg_timeout, env=env, watched=progress, bar=progress,
                node=lambda i, node_env: (options, node_env))


def torchrun_all(jobs: dict[str, tuple[str, int, tuple]], *, parallel: int = 2,
                 **options: Any) -> dict[str, RunResult]:
    """Run several torchrun jobs, ``parallel`` at a time; return their results by name.

    Args:
        jobs: ``name -> (target, nproc, args)``; each is ``torchrun(target, *args,
            nproc=nproc, name=name, **options)``, except that the ``minifsdp.train`` jobs of
            one ``nproc`` run one after another in a single torchrun job, which pays torch's
            start-up once (``minifsdp.sweep``, Note [a sweep of runs]). Each still gets its
            own ``RunResult`` and directory, the same bit for bit; if the sweep fails, the runs
            it finished stand and each other job runs alone, so an error is its own.
        parallel: launches at once. A launch spends much of its wall time starting processes
            (every rank imports torch) while cores wait on the rendezvous, so two launches at
            once finish sooner than one after the other on 2 cores.

    Memory measured by ``MemoryTracker`` counts tensors and does not depend on what else runs;
    *times* do: time things in a job of their own. The first failing job's ``WorkerError``
    is raised once every started job has ended; jobs not yet started are not run.

    Example:
        >>> runs = torchrun_all({"ddp": ("minifsdp.train", 2, ("--strategy", "ddp")),
        ...                      "one": ("minifsdp.train", 1, ())}, chapter="05")  # doctest: +SKIP
        >>> runs["ddp"].ranks[0]["losses"]  # doctest: +SKIP
    """
    from concurrent.futures import ThreadPoolExecutor

    from minifsdp.sweep import submit_all

    with ThreadPoolExecutor(parallel) as pool:
        futures = submit_all(pool, jobs, **options)
        try:
            return {k: futures[k].result() for k in jobs}
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def torchrun_multinode(
    target: str,
    *args: Any,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    name: str | None = None,
    chapter: str = "adhoc",
    timeout: float = 300.0,
    join_timeout: float = 60.0,
    grace: float = 20.0,
    pg_timeout: float | None = None,
    env: dict[str, str] | None = None,
    node_options: list[tuple] | None = None,
) -> RunResult:
    """Run ``target`` as ``nnodes`` separate torchrun launchers on this machine -- the way
    ``nnodes`` machines would -- meeting at one c10d rendezvous; return every rank's JSON.

    Each "node" is a ``python -m torch.distributed.run --nnodes N --nproc-per-node K
    --rdzv-backend c10d --rdzv-endpoint localhost:PORT --rdzv-id ID`` of its own (a free
    port, a fresh id); its workers get global ``RANK`` = group rank * K + ``LOCAL_RANK``. Results
    go to ``runs/<chapter>/<name>/rank{r}.json`` (a directory every node can write: a shared
    file system, here trivially), logs to ``.../logs/node{i}/``. As with ``torchrun``: the first
    failing rank's traceback is raised as ``WorkerError``, and nothing outlives ``timeout``.

    On a real cluster, the same command on each node (Note [multi-node]), e.g. 2 nodes x 8 GPUs::

        # on both nodes; MASTER_ADDR = node 0's address, reachable from node 1
        torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
            --rdzv-endpoint $MASTER_ADDR:29500 --rdzv-id $JOB_ID \\
            -m minifsdp.train --strategy fsdp2 --model gpt --steps 100

    Args:
        nnodes, nproc_per_node: launchers, and workers per launcher (world = their product).
        timeout: seconds for the whole job (``WorkerTimeout``, every rank's stack shown).
        join_timeout: seconds a launcher waits at the rendezvous for the others (a node
            that never comes raises then, in the launchers that did).
        grace: once a launcher has failed, seconds the others get to fail on their own
            (a peer's gloo connection breaks at once; NCCL waits for ``pg_timeout``) before
            they are killed.
        node_options: extra torchrun options per node, after ours (argparse keeps the last
            occurrence), e.g. ``[(), ("--nnodes", 3)]`` to misconfigure node 1.
        name, chapter, pg_timeout, env: as for ``torchrun``.

    Example:
        >>> run = torchrun_multinode("minifsdp.train", "--strategy", "fsdp2", "--model", "gpt",
        ...                          nnodes=2, nproc_per_node=1)    # doctest: +SKIP
        >>> run.ranks[1]["losses"]                                  # doctest: +SKIP
    """
    name = name or _default_name(target)
    with socket.socket() as s:  # a free port for the rendezvous store (node 0's, in real life)
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    run_id = f"{name}-{os.getpid()}-{time.time_ns()}"

    def node(i: int, node_env: dict[str, str]) -> tuple[tuple, dict[str, str]]:
        options = ("--nnodes", nnodes, "--nproc-per-node", nproc_per_node,
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}",
                   "--rdzv-id", run_id, "--rdzv-conf", f"join_timeout={int(join_timeout)}",
                   "--max-restarts", "0", *(node_options[i] if node_options else ()))
        # every simulated node is on this machine: the rule counted all their ranks, and on
        # NCCL each node sees only its own GPUs (as a real node would), so no two ranks share
        # cuda:0
        if node_env["MINIFSDP_BACKEND"] == "nccl":
            node_env = {**node_env, "CUDA_VISIBLE_DEVICES": _gpu_slice(i, nproc_per_node)}
        return options, node_env

    def failed(err: WorkerError, bad: list[int], outs: dict[int, str]) -> WorkerError:
        if err.rank is not None:
            return WorkerError(f"node {bad[0]} of {nnodes}: {err}", err.rank, err.logs)
        # no worker failed: the launchers themselves did, e.g. at the rendezvous
        last = {i: (outs[i].strip().splitlines() or ["(no output)"])[-1] for i in bad}
        return WorkerError(
            f"{name}: node(s) {bad} failed before any worker did -- "
            + "; ".join(f"node {i}: {line}" for i, line in last.items())
            + f". A RendezvousTimeoutError means the {nnodes} launchers did not all meet "
            f"within join_timeout={join_timeout:.0f} s: check that every node has the same "
            "--rdzv-endpoint (reachable from all) and --rdzv-id, and that all were started."
            f"\nNode {bad[0]}'s launcher:\n{_tail(outs[bad[0]], 30)}", None, err.logs)

    return _run(target, args, name=name, chapter=chapter, nnodes=nnodes,
                nproc_per_node=nproc_per_node, timeout=timeout, pg_timeout=pg_timeout, env=env,
                watched=_watched(), bar=False, node=node, grace=grace, failed=failed,
                what=f"{nnodes}-node job")


def _run(target: str, args: tuple, *, name: str | None, chapter: str, nnodes: int,
         nproc_per_node: int, timeout: float, pg_timeout: float | None,
         env: dict[str, str] | None, watched: bool, bar: bool,
         node: Callable[[int, dict[str, str]], tuple[tuple, dict[str, str]]],
         grace: float = 0.0,
         failed: Callable[[WorkerError, list[int], dict[int, str]], WorkerError] | None = None,
         what: str = "torchrun job") -> RunResult:
    """What ``torchrun`` and ``torchrun_multinode`` share: a fresh ``runs/<chapter>/<name>``,
    ``nnodes`` torchrun launchers of ``nproc_per_node`` workers each (``node(i, env)`` gives
    launcher i's own options and environment), waited for (Note [failures surface, never
    hang]), and every rank's JSON read back.

    A launcher's output goes to ``logs/launcher{i}.txt``, its workers' to ``logs/`` (one node)
    or ``logs/node{i}/``. Once a launcher has failed, the others get ``grace`` seconds to end
    on their own; past ``timeout`` every rank's stack is dumped and the job killed
    (``WorkerTimeout``, ``what`` naming the job). A failure raises the first failing rank's
    ``WorkerError``, or what ``failed(error, failed launchers, their outputs)`` makes of it.
    """
    name = name or _default_name(target)
    out_dir = repo_root() / "runs" / chapter / name
    shutil.rmtree(out_dir, ignore_errors=True)  # stale rank files must never be read back
    log_dirs = [out_dir / "logs" / (f"node{i}" if nnodes > 1 else "") for i in range(nnodes)]
    for d in log_dirs:
        d.mkdir(parents=True)
    choice = _choice(nnodes * nproc_per_node, env)
    child_env = _worker_env(out_dir, env, pg_timeout, choice)
    worker = [target] if target.endswith(".py") else ["-m", target]
    if watched:
        _say_where(choice)
    progress = _ProgressBar(name, log_dirs[0]) if bar else None
    procs = []
    t0 = time.perf_counter()
    for i, log_dir in enumerate(log_dirs):
        options, node_env = node(i, child_env)
        # node options last: argparse keeps an option's last occurrence (torchrun_multinode's
        # node_options may override its own)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--redirects", "3",
               "--log-dir", str(log_dir), "--monitor-interval", "0.1", *map(str, options),
               *worker, *map(str, args)]
        # a file, never a pipe that fills and blocks; start_new_session: the launcher gets its
        # own process group, so a kill reaches every worker
        with open(out_dir / "logs" / f"launcher{i}.txt", "w") as f:
            procs.append(subprocess.Popen(cmd, env=node_env, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))

    def logs(stream: str) -> dict[int, str]:
        # Note [multi-node]: c10d numbers the nodes by (host, launcher pid), not --node-rank.
        order = sorted(range(nnodes), key=lambda i: procs[i].pid)
        return {order.index(i) * nproc_per_node + local: text for i in range(nnodes)
                for local, text in _read_logs(log_dirs[i], stream).items()}

    def launcher_out(i: int) -> str:
        return (out_dir / "logs" / f"launcher{i}.txt").read_text(errors="replace")

    outs: dict[int, str] = {}  # launcher -> its output, in the order they ended
    deadline, failed_at = time.monotonic() + timeout, None
    try:
        while True:
            for i, p in enumerate(procs):
                if i not in outs and p.poll() is not None:
                    outs[i] = launcher_out(i)
                    if p.returncode and failed_at is None:
                        failed_at = time.monotonic()
            if progress:
                progress.update()
            now = time.monotonic()
            if len(outs) == nnodes or now > deadline or (
                    failed_at is not None and now > failed_at + grace):
                break
            time.sleep(0.1)
    finally:  # a hang, a failure's survivors, or Ctrl-C: leave no launcher or worker behind
        for i, p in enumerate(procs):
            if p.poll() is None:
                _dump_stacks_and_kill(p, log_dirs[i])
                outs.setdefault(i, launcher_out(i))
        if progress:
            progress.close()
    wall = time.perf_counter() - t0

    bad = [i for i in outs if procs[i].returncode]  # in the order they ended
    if failed_at is None and bad:  # timed out, nobody had failed before: killed by us
        errs = logs("stderr")
        stacks = "\n".join(f"----- rank {r} -----\n{_tail(t, 40) or _SILENT}"
                           for r, t in sorted(errs.items()))
        raise WorkerTimeout(f"{name}: {what} did not finish within {timeout:.0f} s; every rank "
                            f"was stopped. Where each rank was:\n{stacks}", None, errs)
    if bad:
        err = _worker_error(name, outs[bad[0]], logs("stderr"), procs[bad[0]].returncode)
        raise failed(err, bad, outs) if failed else err
    ranks = []
    for r in range(nnodes * nproc_per_node):
        path = out_dir / f"rank{r}.json"
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    return RunResult(name, out_dir, ranks, logs("stdout"), wall, choice)


def _default_name(target: str) -> str:
    """A run's name from its target: ``minifsdp.train`` -> ``minifsdp_train``, a script's stem."""
    return re.sub(r"\W+", "_", Path(target).stem if target.endswith(".py") else target)


def _watched() -> bool:
    """A terminal or a notebook: someone is watching (the job says where it runs)."""
    return sys.stderr.isatty() or "ipykernel" in sys.modules


def _choice(local_ranks: int, env: dict[str, str] | None) -> BackendChoice:
    """The backend rule for a job of ``local_ranks`` ranks on this machine; a
    ``MINIFSDP_BACKEND`` in the job's own ``env`` wins over the launcher's environment."""
    override = (env or {}).get("MINIFSDP_BACKEND")
    return choose_backend(local_ranks, override=override)


def _say_where(choice: BackendChoice) -> None:
    """Print the job's one line about where it runs. A notebook on a machine without GPUs
    stays quiet: its first cell said it once for every job (``dist.describe_machine``)."""
    if "ipykernel" not in sys.modules or choice.gpus:
        print(choice.line, flush=True)


def _gpu_slice(node: int, per_node: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` for simulated node ``node``: its own ``per_node`` GPUs, as
    numbered in this process's ``CUDA_VISIBLE_DEVICES`` (or all devices)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(1 << 10)]
    return ",".join(ids[node * per_node:(node + 1) * per_node])


def _worker_env(out_dir: Path, env: dict[str, str] | None, pg_timeout: float | None,
                choice: BackendChoice) -> dict[str, str]:
    """The workers' environment: one thread each (ranks share the cores), results into
    ``out_dir``, the backend the rule chose, progress as protocol lines for ``_ProgressBar``,
    and *this* checkout's minifsdp first on the path (a notebook's cwd is notebooks/)."""
    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                 "MINIFSDP_OUT": str(out_dir), "MINIFSDP_LAUNCHER": "1", **(env or {}),
                 "MINIFSDP_BACKEND": choice.backend}
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(Path(__file__).resolve().parent.parent), child_env.get("PYTHONPATH")) if p
    )
    if choice.device_type == "cpu":
        # a CPU job sees no GPU, as in CI: no rank opens a CUDA context on a GPU the job does
        # not use (N ranks, N contexts on one card), and torch's defaults cannot pick one
        # (torch FSDP1 without device_id takes "the current accelerator").
        child_env["CUDA_VISIBLE_DEVICES"] = ""
    if pg_timeout is not None:
        child_env["MINIFSDP_PG_TIMEOUT"] = str(pg_timeout)
    return child_env


_SILENT = ("(this rank printed nothing: it had not reached minifsdp.dist.dist_setup, "
           "e.g. it was still importing torch)")


def _dump_stacks_and_kill(proc: subprocess.Popen, log_dir: Path, grace: float = 5.0) -> None:
    """SIGUSR1 makes each worker print its stack (see dist._install_stack_dumps); then kill.

    torchrun starts every worker in a session of its own, so killing torchrun's process group
    would orphan them: walk the process tree instead. The dumps are written asynchronously, and
    on a loaded machine a fixed short sleep lost them, so we wait (up to ``grace`` seconds) until
    every worker's stderr has grown by a stack trace.
    """
    workers = _descendants(proc.pid)
    before = _read_logs(log_dir, "stderr")
    for pid in workers:
        _signal(pid, signal.SIGUSR1)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        time.sleep(0.2)
        after = _read_logs(log_dir, "stderr")
        dumped = [r for r, t in after.items() if len(t) > len(before.get(r, "")) and "File " in t]
        if len(dumped) >= len(after) or len(dumped) >= len(workers):
            time.sleep(0.2)  # let the last frames land
            break
    for pid in [proc.pid, *workers]:
        _signal(pid, signal.SIGKILL)
    proc.communicate()


def _descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (``pgrep -P``, available on Linux and macOS)."""
    found, todo = [], [pid]
    while todo:
        out = subprocess.run(["pgrep", "-P", str(todo.pop())], capture_output=True, text=True)
        children = [int(c) for c in out.stdout.split()]
        found += children
        todo += children
    return found


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _read_logs(log_dir: Path, stream: str) -> dict[int, str]:
    """torchrun writes ``<log_dir>/<run_id>/attempt_0/<local_rank>/{stdout,stderr}.log``."""
    logs = {}
    for f in log_dir.glob(f"*/attempt_*/*/{stream}.log"):
        logs[int(f.parent.name)] = f.read_text(errors="replace")
    return logs


def _worker_error(name: str, launcher_out: str, errs: dict[int, str], code: int) -> WorkerError:
    # torchrun's summary names the first failure and how it ended:
    #   Root Cause ... rank : 1 (local_rank: 1)  exitcode : -9 (pid: 13212)  (SIGKILL)
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", launcher_out, re.S)
    failed = [r for r, t in sorted(errs.items()) if "Traceback (most recent call last)" in t]
    rank = int(m.group(1)) if m else (failed[0] if failed else None)
    if rank is None or rank not in errs:  # failed before any worker started (bad arguments,
        return WorkerError(f"{name}: torchrun exited with code {code}:\n"  # an import error
                           f"{_tail(launcher_out, 60)}", rank, errs)      # in torchrun, ...)
    rank_code = int(m.group(2)) if m else code
    own, dump = split_stack_dump(errs[rank])
    if rank_code < 0 and FATAL in dump:  # a native crash: where it was
        own += dump  # (faulthandler, enabled by dist._install_stack_dumps)
    if rank_code < 0:  # killed by a signal: it could print nothing of its own
        sig = signal.Signals(-rank_code).name if -rank_code in signal.valid_signals() else "?"
        msg = f"{name}: rank {rank} was killed by signal {-rank_code} ({sig})"
    else:
        msg = f"{name}: rank {rank} failed (exit code {rank_code})"
    msg += f". Its stderr:\n{_tail(own, 60)}" if own.strip() else " and printed nothing to stderr."
    if rank_code == -signal.SIGKILL:
        msg += ("\nSIGKILL comes from outside the program: the kernel's out-of-memory killer "
                "sends it (see `dmesg`), as does `kill -9`.")
    for r, text in sorted(errs.items()):
        if r == rank:
            continue
        error, stack = split_stack_dump(text)
        if "Traceback (most recent call last)" in error:  # what the failure did to the others
            msg += f"\n----- rank {r} then failed with -----\n{_tail(error, 12)}"
        elif "File " in stack:
            # Peers stopped by torchrun's SIGTERM printed their stacks (dist._install_stack_dumps):
            # for a collective timeout, this shows where the rank that never arrived was.
            msg += f"\n----- rank {r} was stopped here -----\n{_tail(stack, 20)}"
    return WorkerError(msg, rank, errs)


FATAL = "Fatal Python error: "  # faulthandler's first line on a fatal signal


def split_stack_dump(text: str) -> tuple[str, str]:
    """A rank's stderr -> (what it printed itself, what faulthandler appended after it). On a
    fatal signal, a native crash, the dump starts at ``FATAL`` ("Fatal Python error:
    Segmentation fault"; "...: Aborted" after gloo's abort message, which stays the rank's own)
    and holds every thread's stack; a rank stopped by
    SIGUSR1 or SIGTERM dumps the stacks alone, from "Current thread 0x... (most recent call
    first)" (dist._install_stack_dumps enables both). A dump of a rank stopped while
    garbage-collecting names no Python frame; it is returned all the same. Lines may carry
    torchrun's "[rankN]: " prefix."""
    at = re.search(rf"^(\[rank\d+\]: )?({FATAL}|(Current thread|Thread) 0x[0-9a-f]+ "
                   r"\(most recent call first\))", text, re.M)
    return (text, "") if at is None else (text[:at.start()], text[at.start():])


def _tail(text: str, n: int) -> str:
    lines = [ln for ln in text.rstrip().splitlines() if not ln.startswith(PROGRESS_TAG)]
    return "\n".join((["..."] if len(lines) > n else []) + lines[-n:])


class _ProgressBar:
    """A tqdm bar fed by the ``report_progress`` lines rank 0 writes to its stdout log.

    Created at the first progress line (jobs that report none show nothing). In a notebook
    it is one output updated in place (see ``_NotebookLine``), so the saved notebook holds its
    last state, e.g. ``torch_ddp: 100%|████| 50/50, loss=0.3145``, which nbval compares.
    """

    def __init__(self, name: str, log_dir: Path):
        self.name, self.log_dir, self.pos, self.file, self.bar = name, log_dir, 0, None, None

    def update(self) -> None:
        if self.file is None:
            found = list(self.log_dir.glob("*/attempt_*/0/stdout.log"))
            if not found:
                return
            self.file = found[0]
        with open(self.file, "rb") as f:
            f.seek(self.pos)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # only whole lines
        self.pos += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            if line.startswith(RUN_TAG):  # a sweep's next run: a bar of its own
                self.close_bar()
                self.name = line[len(RUN_TAG):].strip()
            elif line.startswith(PROGRESS_TAG):
                info = json.loads(line[len(PROGRESS_TAG):])
                if self.bar is None:
                    from tqdm import tqdm

                    out = _NotebookLine() if "ipykernel" in sys.modules else sys.stderr
                    self.bar = tqdm(desc=self.name, total=info["total"], file=out,
                                    bar_format="{desc}: {percentage:3.0f}%|{bar:20}| "
                                    "{n}/{total}{postfix}")
                self.bar.total = info.pop("total")
                self.bar.n = info.pop("step")
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in info.items()}, refresh=False)
                self.bar.refresh()

    def close(self) -> None:
        self.update()
        self.close_bar()

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class _NotebookLine:
    """A file for tqdm that shows each refresh as the *same* notebook output (a display with
    an id, updated in place) instead of appending ``\r``-separated stream messages, which
    notebook files store one by one and GitHub renders as hundreds of lines."""

    encoding = "utf-8"

    def __init__(self):
        self._handle = None

    def write(self, text: str) -> None:
        from IPython.display import Pretty, display

        text = text.strip("\r\n")
        if not text:
            return
        if self._handle is None:  # the first state is a real bar line (nbval sees only it)
            self._handle = display(Pretty(text), display_id=True)
        else:
            self._handle.update(Pretty(text))

    def flush(self) -> None:
        pass
