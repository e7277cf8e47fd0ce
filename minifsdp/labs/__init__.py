"""Labs: you write one chapter's mechanism; real torchrun jobs check it against PyTorch.

    python -m minifsdp.labs 02 --start     # copy the skeleton to labs/mine/lab02_ddp.py
    # ... edit labs/mine/lab02_ddp.py ...
    python -m minifsdp.labs 02             # check it: N = 2 and 3, bit for bit against torch

or, in a notebook, ``labs.start("02")`` and ``labs.check("02")``. Each chapter's pieces sit
together: the skeleton ``labs/labNN_*.py`` (the only file you edit, as a copy in ``labs/mine/``,
which git ignores, so neither ``git pull`` nor the tests ever touch your work), and
``minifsdp/labs/chNN.py`` with the lab's seams and cases and the chapter's exercise checkers.
The solution is the package's own code behind each seam (``labs/README.md`` lists them).
Labs always run on gloo with CPU tensors, also on a GPU machine: the oracles are bitwise on CPU
kernels, and a check reads the same on a laptop and on an 8-GPU box.

Modules: ``seams`` (where your code plugs in), ``report`` (the first divergence, in words),
``worker`` (the torchrun entry point), ``chNN`` (one chapter each).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from minifsdp.labs import seams
from minifsdp.labs.report import Report, diverged, frames_in, last_exception
from minifsdp.labs.seams import LAB_IDS, REFERENCE, LabFileError, get_lab
from minifsdp.launch import WorkerError, WorkerTimeout, repo_root, torchrun

__all__ = ["LAB_IDS", "Report", "check", "check_many", "get_lab", "hint", "start", "your_file"]


def your_file(lab_id: str) -> Path:
    """Where your copy of the lab's skeleton lives: ``labs/mine/labNN_*.py``."""
    lab = get_lab(lab_id)
    return repo_root() / "labs" / "mine" / Path(lab.skeleton).name


def start(lab_id: str) -> Path:
    """Copy lab ``lab_id``'s skeleton to ``labs/mine/`` (never over an existing copy) and
    return the copy's path. To start over, delete the copy first."""
    lab, mine = get_lab(lab_id), your_file(lab_id)
    if mine.exists():
        print(f"{_rel(mine)} already exists: edit it, or delete it to start over")
        return mine
    mine.parent.mkdir(parents=True, exist_ok=True)
    tmp = mine.with_suffix(".tmp")
    shutil.copyfile(repo_root() / lab.skeleton, tmp)
    tmp.replace(mine)
    print(f"wrote {_rel(mine)}: fill in the TODO(lab {lab.id}), then labs.check({lab.id!r})")
    return mine


def hint(lab_id: str, level: int | None = None) -> str:
    """Print and return lab ``lab_id``'s next graded hint (or hint ``level``, 1-based).

    Hints are asked for, one at a time: the first points at the idea and the Notes, the last
    describes the solution's shape. Which one you have seen is kept beside your copy
    (``labs/mine/.hints.json``), so asking again moves on.

    Example:
        >>> hint("00")     # doctest: +SKIP
        lab 00, hint 1 of 3: ...
    """
    lab = get_lab(lab_id)
    if not lab.hints:
        raise ValueError(f"lab {lab.id} has no hints")
    state_file = repo_root() / "labs" / "mine" / ".hints.json"
    seen = json.loads(state_file.read_text()) if state_file.exists() else {}
    if level is None:
        level = min(seen.get(lab.id, 0) + 1, len(lab.hints))
    if not 1 <= level <= len(lab.hints):
        raise ValueError(f"lab {lab.id} has hints 1 to {len(lab.hints)}, not {level}")
    seen[lab.id] = max(seen.get(lab.id, 0), level)
    state_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(seen))
    tmp.replace(state_file)
    last = level == len(lab.hints)
    text = (f"lab {lab.id}, hint {level} of {len(lab.hints)}: {lab.hints[level - 1]}"
            + ("" if last else f"\n(ask again for hint {level + 1})"))
    print(text)
    return text


def check(lab_id: str, path: str | os.PathLike | None = None, *,
          world_sizes: tuple[int, ...] | None = None, timeout: float = 120.0,
          quiet: bool = False) -> Report:
    """Run lab ``lab_id``'s cases in real torchrun jobs with your code in its seams; print
    and return the ``Report``.

    Args:
        path: your file (default: ``labs/mine/labNN_*.py`` if you started, else the skeleton);
            ``"reference"`` checks the package's own code (what the notebooks store).
        world_sizes: the jobs to run (default: the lab's, usually N = 2 then 3); the first
            failing job ends the check.
        timeout: seconds per job before it counts as hung.

    Example:
        >>> report = check("00", "reference")   # doctest: +SKIP
        ✓ lab 00 · ring all-reduce from send/recv: all 36 checks equal torch.distributed's ...
        >>> report.ok                            # doctest: +SKIP
        True
    """
    lab = get_lab(lab_id)
    spec = _resolve(lab, path)
    report = _check(lab, spec, world_sizes or lab.world_sizes, timeout)
    if not quiet:
        print(report)
    return report


def _resolve(lab: seams.Lab, path: str | os.PathLike | None) -> str:
    if path == REFERENCE:
        return REFERENCE
    if path is None:
        mine = your_file(lab.id)
        return str(mine if mine.exists() else repo_root() / lab.skeleton)
    text = str(path)
    file, sep, name = text.rpartition(":") if not Path(text).exists() else (text, "", "")
    file = file if sep else text
    full = Path(file) if Path(file).is_absolute() else (Path.cwd() / file)
    if not full.exists() and (repo_root() / file).exists():
        full = repo_root() / file
    return str(full) + (f":{name}" if sep else "")


def check_many(lab_id: str, paths: list[str], *, world_sizes: tuple[int, ...] | None = None,
               timeout: float = 120.0) -> list[Report]:
    """``check(lab_id, p, world_sizes=world_sizes, quiet=True)`` for each of ``paths``, in one
    torchrun job per world size for all of them (Note [a batch of lab files] in
    ``minifsdp/labs/worker.py``). A job that crashes or hangs cannot say which file did it:
    the files it held are then checked one at a time, so every report is the one ``check``
    gives.

    Example:
        >>> [r.status for r in check_many("00", ["reference", "reference"])]  # doctest: +SKIP
        ['pass', 'pass']
    """
    lab = get_lab(lab_id)
    specs = [_resolve(lab, p) for p in paths]
    return _check_all(lab, specs, world_sizes or lab.world_sizes, timeout)


def _check(lab: seams.Lab, spec: str, world_sizes: tuple[int, ...], timeout: float) -> Report:
    return _check_all(lab, [spec], world_sizes, timeout)[0]


def _check_all(lab: seams.Lab, specs: list[str], world_sizes: tuple[int, ...],
               timeout: float) -> list[Report]:
    head = f"lab {lab.id} · {lab.title}"
    reports: dict[int, Report] = {}
    for i, spec in enumerate(specs):
        try:
            seams.load(lab, spec)  # a missing function or a syntax error: say so before launching
        except LabFileError as e:
            reports[i] = Report(lab.id, lab.title, "bad file",
                                [f"✗ {head}: {_strip_root(str(e))}"])
    pending = [i for i in range(len(specs)) if i not in reports]
    done: dict[int, list[str]] = {i: [] for i in pending}
    total = dict.fromkeys(pending, 0)
    calls: dict[int, dict[str, int]] = {i: {} for i in pending}
    for n in world_sizes:
        if not pending:
            break
        name = f"lab{lab.id}_n{n}_{os.getpid()}"
        try:
            run = torchrun("minifsdp.labs.worker", lab.id, nproc=n, name=name, chapter="labs",
                           timeout=timeout * len(pending), progress=False,
                           env={"MINIFSDP_LAB_FILE": "\n".join(specs[i] for i in pending),
                                "MINIFSDP_BACKEND": "gloo"})
        except (WorkerTimeout, WorkerError) as e:
            if len(pending) > 1:  # which file did it? Check each alone
                for i in pending:
                    reports[i] = _check(lab, specs[i], world_sizes, timeout)
            else:
                i = pending[0]
                file_name = Path(specs[i].split(":")[0]).name if specs[i] != REFERENCE else None
                reports[i] = (_hang(lab, head, n, e.logs, file_name, timeout)
                              if isinstance(e, WorkerTimeout)
                              else _failed(lab, head, n, e, file_name))
            return [reports[i] for i in range(len(specs))]
        shutil.rmtree(run.out_dir, ignore_errors=True)
        still = []
        for k, i in enumerate(pending):
            ranks = [r["files"][k] for r in run.ranks if r]
            firsts = [r["first"] for r in ranks if r["first"]]
            if firsts:
                first = min(firsts, key=lambda f: (f["seq"], f["rank"]))
                before = "; ".join(done[i] + [f"N = {n}: {first['matched']} checks"])
                reports[i] = diverged(lab, n, first, before)
                continue
            for seam, count in ranks[0]["calls"].items():
                calls[i][seam] = calls[i].get(seam, 0) + count
            total[i] += ranks[0]["checks"]
            done[i].append(f"N = {n} ({ranks[0]['checks']} checks)")
            still.append(i)
        pending = still
    sizes = " and ".join(str(n) for n in world_sizes)
    for i in pending:
        never = [s.name for s in lab.seams if not calls[i].get(s.name)]
        if never:  # nothing judged that code: not a pass
            reports[i] = Report(lab.id, lab.title, "harness error", [
                f"✗ {head}: every check matched, but no case called the seam(s) "
                f"{', '.join(never)}, so nothing judged that code. Does your code call it "
                "where the package's does? If so, this is a bug in the lab's harness"],
                calls=calls[i])
            continue
        reports[i] = Report(lab.id, lab.title, "pass", [
            f"✓ {head}: all {total[i]} checks equal {lab.oracle} bit for bit at N = {sizes}"],
            calls=calls[i])
    return [reports[i] for i in range(len(specs))]


def _failed(lab: seams.Lab, head: str, n: int, e: WorkerError, file_name: str | None) -> Report:
    rank = e.rank
    text = e.logs.get(rank, "") if rank is not None else ""
    text = re.sub(r"(?m)^\[rank\d+\]:\s?", "", text or str(e))
    if _is_timeout(text):  # a peer that raised reads here as a closed connection: report it
        for r, log in sorted(e.logs.items()):
            log = re.sub(r"(?m)^\[rank\d+\]:\s?", "", log or "")
            if "Traceback (most recent call last)" in log and not _is_timeout(log):
                rank, text = r, log
                break
    exc = last_exception(text)
    frames = frames_in(text, file_name) if file_name else []
    where = f"{_strip_root(frames[-1][0])}:{frames[-1][1]}" if frames else None
    if exc.startswith("NotImplementedError"):
        lines = [f"✗ {head}: not started: {where or 'the skeleton'} raises {exc}",
                 f"  start from a fresh copy: python -m minifsdp.labs {lab.id} --start "
                 f"(writes {_rel(your_file(lab.id))}), fill in the TODO(lab {lab.id}), check again"]
        return Report(lab.id, lab.title, "not started", lines, where=where)
    if _is_timeout(text):
        return _hang(lab, head, n, e.logs, file_name, None)
    lines = [f"✗ {head}: crash at N = {n} on rank {rank}"
             + (f" at {where}" if where else "") + f": {exc}"]
    lines += [f"    {_strip_root(f)}:{ln}: {code}" for f, ln, code in frames]
    if not frames:
        lines.append("  " + _strip_root(_tail_lines(text, 12)).replace("\n", "\n  "))
    return Report(lab.id, lab.title, "crash", lines, where=where, traceback=text)


def _hang(lab: seams.Lab, head: str, n: int, logs: dict[int, str], file_name: str | None,
          timeout: float | None) -> Report:
    waited = "its timeout" if timeout else "a few seconds"
    lines = [f"✗ {head}: hang at N = {n}: a collective waited {waited} for a peer that never "
             "joined it. A collective issued on some ranks only, or in another order on each?"]
    where = None
    for r, text in sorted(logs.items()):
        text = re.sub(r"(?m)^\[rank\d+\]:\s?", "", text)
        frames = frames_in(text, file_name) if file_name else []
        if frames:
            f, ln, code = frames[-1]
            where = where or f"{_strip_root(f)}:{ln}"
            lines.append(f"  rank {r} was at {_strip_root(f)}:{ln}: {code}")
    lines.append("  read: Note [a lab never hangs] in minifsdp/labs/worker.py")
    return Report(lab.id, lab.title, "hang", lines, where=where)


def _is_timeout(text: str) -> bool:
    return bool(re.search(r"[Tt]imed out|Timeout \(|Application timeout|Connection closed by peer"
                          r"|Connection reset",
                          text))


def _tail_lines(text: str, n: int) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(repo_root()))
    except ValueError:
        return str(path)


def _strip_root(text: str) -> str:
    """Paths relative to the checkout, so a report reads the same on every machine."""
    return text.replace(str(repo_root()) + os.sep, "")
