"""Run All twice in one kernel: does every notebook print the same thing the second time?

A reader who re-runs all cells must see the same results (issue 23): no cell may rebind a
variable that an earlier cell's output depends on, fail, or print something else when it runs
again in a kernel that has already run the notebook once. For each notebook this starts ONE
kernel (nbclient, cwd ``notebooks/`` as under nbval), runs every code cell in order, runs every
code cell in order again, and compares each cell's second outputs with its first as nbval
compares a run with the stored notebook: streams coalesced, the keys nbval skips (images,
metadata, execution counts, ...) dropped, every text sanitized with
``notebooks/nbval_sanitize.cfg`` (wall-clock times, progress bars, a claim's ``· measured:``
digits). Reports, per notebook, the code cells, each differing cell with a short diff, the
cells that raised, and the seconds; exits 1 on any difference or error.

A maintainer's tool, not run in CI (each notebook runs twice: minutes to tens of minutes)::

    python benchmarks/run_all_twice.py notebooks/00_*.ipynb notebooks/01_*.ipynb
"""

from __future__ import annotations

import argparse
import copy
import difflib
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbval.plugin import coalesce_streams, get_sanitize_patterns

ROOT = Path(__file__).resolve().parent.parent
SANITIZE_CFG = ROOT / "notebooks" / "nbval_sanitize.cfg"
# nbval's IPyNbFile.skip_compare (without --nbdime): what it never compares
SKIP = {"metadata", "traceback", "prompt_number", "output_type", "name", "execution_count",
        "application/vnd.jupyter.widget-view+json", "image/png", "image/jpeg"}


def load_patterns(path: Path = SANITIZE_CFG) -> list[tuple[str, str]]:
    """The (regex, replacement) pairs of an nbval sanitize file, in order."""
    return get_sanitize_patterns(path.read_text())


def comparable(outputs: list, patterns: list[tuple[str, str]]) -> dict[str, list]:
    """What nbval compares of a cell's outputs: per key (a stream's name, a MIME type, an
    error's ``ename``/``evalue``), the sanitized values in order."""
    out: dict[str, list] = defaultdict(list)
    for o in coalesce_streams([nbformat.from_dict(copy.deepcopy(o)) for o in outputs]):
        items = ({o["name"]: o["text"]} if o["output_type"] == "stream" else
                 {**{k: v for k, v in o.items() if k != "data"}, **o.get("data", {})})
        for key, value in items.items():
            if key not in SKIP:
                out[key].append(_sanitize(value, patterns))
    return dict(out)


def _sanitize(value, patterns):
    if isinstance(value, list):  # a multi-line MIME value stored as a list of lines
        value = "".join(value)
    if isinstance(value, str):
        for regex, replace in patterns:
            value = re.sub(regex, replace, value)
    return value


def diff(first: dict, second: dict, max_lines: int = 12) -> str:
    """A short unified diff of two :func:`comparable` results; ``""`` when they are equal."""
    if first == second:
        return ""

    def text(d):
        return [f"[{k}] {line}" for k in sorted(d) for v in d[k] for line in str(v).splitlines()]

    lines = [line for line in difflib.unified_diff(text(first), text(second), "first run",
                                                    "second run", n=0, lineterm="")
             if not line.startswith("@@")]
    return "\n".join(lines[:max_lines] + ([f"... {len(lines) - max_lines} more lines"]
                                          if len(lines) > max_lines else []))


def errors(outputs: list) -> list[str]:
    """``ename: evalue`` of each error output."""
    return [f"{o['ename']}: {o['evalue']}"[:200] for o in outputs if o["output_type"] == "error"]


def run_twice(path: Path, timeout: float = 1500, patterns=None) -> dict:
    """Run ``path``'s code cells twice in one kernel; compare the runs cell by cell."""
    patterns = load_patterns() if patterns is None else patterns
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, allow_errors=True, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    runs: list[list] = []
    t0 = time.perf_counter()
    with client.setup_kernel():
        for _ in range(2):
            outs = []
            for i, cell in cells:
                client.execute_cell(cell, i)
                outs.append(copy.deepcopy(cell.outputs))
            runs.append(outs)
    res = {"notebook": path.name, "cells": len(cells), "differ": [], "errors": [],
           "seconds": round(time.perf_counter() - t0, 1)}
    for (i, _), first, second in zip(cells, *runs):
        for run, outs in (("first", first), ("second", second)):
            res["errors"] += [f"cell {i} ({run} run): {e}" for e in errors(outs)]
        d = diff(comparable(first, patterns), comparable(second, patterns))
        if d:
            res["differ"].append((i, d))
    return res


def report(res: dict) -> str:
    lines = [f"{res['notebook']}: {res['cells']} code cells, {len(res['differ'])} differ, "
             f"{len(res['errors'])} errors, {res['seconds']:.0f} s"]
    for i, d in res["differ"]:
        lines += [f"  cell {i} differs:", *("    " + line for line in d.splitlines())]
    lines += [f"  error in {e}" for e in res["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="+")
    p.add_argument("--timeout", type=float, default=1500, help="seconds per cell")
    args = p.parse_args(argv)
    bad = 0
    for name in args.notebooks:  # one at a time: the notebooks launch torchrun jobs
        res = run_twice(Path(name), args.timeout)
        print(report(res), flush=True)
        bad += bool(res["differ"] or res["errors"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
