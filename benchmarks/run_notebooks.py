"""Run every notebook's code cells as plain Python, where there is no Jupyter: the GPU check.

The GPU machine's Python has torch but no nbval, jupyter or ipykernel, so the notebooks cannot
run as notebooks there. This runs each notebook's code cells in order in one namespace (one
process per notebook, cwd ``notebooks/`` as under nbval, matplotlib's Agg backend), several
notebooks at a time, under the machine's own backend rule (Note [one code path for CPU and
GPU] in ``minifsdp.dist``), and records per notebook: passed or not, the first failing cell's
index (0-based among *all* cells, as the ``.ipynb`` numbers them) and its error, and the wall
time. A ``ClaimError`` is a failure like any other exception. Outputs are not compared with
the stored ones (what nbval does on CPU): on a GPU they are expected to differ in the last
bits; the claims a notebook makes are what is checked.

IPython-only things: ``display`` is defined (it prints); lines starting with ``%`` or ``!``
(magics, shell) would be skipped with a note -- no notebook uses them today.

Usage::

    python benchmarks/run_notebooks.py                      # all, a table on stdout
    python benchmarks/run_notebooks.py notebooks/00_*.ipynb --jobs 4 --timeout 300 \\
        --json runs/gpu_check/notebooks.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from deadline import kill_tree  # benchmarks/deadline.py

ROOT = Path(__file__).resolve().parent.parent


def code_cells(path: Path) -> list[tuple[int, str]]:
    """``(index among all cells, source)`` of each code cell, IPython-only lines removed."""
    nb = json.loads(path.read_text())
    out = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"])
        lines = [f"pass  # skipped (IPython only): {line.strip()}"
                 if line.lstrip().startswith(("%", "!")) else line for line in src.splitlines()]
        out.append((i, "\n".join(lines)))
    return out


def run_one(path: Path, result_file: Path, max_cells: int | None = None) -> None:
    """In a child process: run ``path``'s code cells (the first ``max_cells`` of them, if
    given); write the result as JSON."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    sys.path.insert(0, str(ROOT))
    os.chdir(path.parent)  # as nbval: a notebook's relative paths start at notebooks/
    result = {"notebook": path.name, "passed": True, "failed_cell": None, "error": None,
              "cells": 0}
    t0 = time.perf_counter()

    def display(*objs, **_):
        for o in objs:
            print(repr(o))

    ns = {"__name__": "__main__", "display": display}
    cells = code_cells(path)
    result["code_cells"] = len(cells)
    cells = cells[:max_cells] if max_cells else cells
    for index, src in cells:
        print(f"----- cell {index} -----", flush=True)
        try:
            exec(compile(src, f"<{path.name} cell {index}>", "exec"), ns)
        except BaseException as e:  # SystemExit, KeyboardInterrupt too: the notebook failed
            traceback.print_exc()
            msg = str(e).strip().splitlines()
            result.update(passed=False, failed_cell=index,
                          error=f"{type(e).__name__}: {msg[0] if msg else ''}"[:300])
            break
        finally:
            try:
                import matplotlib.pyplot as plt

                plt.close("all")  # as a kernel would after showing them: memory stays flat
            except Exception:
                pass
        result["cells"] += 1
    result["wall_s"] = time.perf_counter() - t0
    result_file.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # skip interpreter shutdown (Note [exit] in minifsdp.dist)


def launch(path: Path, timeout: float, log_dir: Path, max_cells: int | None = None) -> dict:
    """Run one notebook in its own process (and process group); kill it at ``timeout``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{path.stem}.log"
    fd, name = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    result_file = Path(name)
    result_file.write_text("")
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, __file__, "--one", str(path.resolve()),
                                 "--result", str(result_file),
                                 *(["--cells", str(max_cells)] if max_cells else [])],
                                stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=_env())
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)  # the notebook and every torchrun job it started
    wall = time.perf_counter() - t0
    text = result_file.read_text()
    result_file.unlink(missing_ok=True)
    if text:
        res = json.loads(text)
    else:
        timed_out = proc.returncode is None or proc.returncode < 0
        res = {"notebook": path.name, "passed": False, "failed_cell": _last_cell(log),
               "error": f"timed out after {timeout:.0f} s" if timed_out
               else f"the process died (exit code {proc.returncode})", "cells": None}
    res.update(wall_s=round(wall, 1), log=str(log))
    return res


def _env() -> dict:
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _last_cell(log: Path) -> int | None:
    """The cell a killed notebook was in: the last ``----- cell i -----`` it printed."""
    cells = [line for line in log.read_text(errors="replace").splitlines()
             if line.startswith("----- cell ")]
    return int(cells[-1].split()[2]) if cells else None


def markdown(results: list[dict]) -> str:
    """A table: notebook, result, first failing cell and its error, wall time."""
    rows = ["| notebook | result | code cells run | first failing cell | error | wall s |",
            "|---|---|---|---|---|---|"]
    for r in results:
        err = (r["error"] or "").replace("|", "\\|").replace("\n", " ")
        cell = "" if r["failed_cell"] is None else str(r["failed_cell"])
        ran = "" if r.get("cells") is None else f"{r['cells']} of {r.get('code_cells', '?')}"
        rows.append(f"| {r['notebook']} | {'pass' if r['passed'] else 'FAIL'} | {ran} | {cell} | "
                    f"{err} | {r['wall_s']:.0f} |")
    passed = sum(r["passed"] for r in results)
    return "\n".join(rows) + f"\n\n{passed} of {len(results)} notebooks passed.\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("notebooks", nargs="*", help="default: notebooks/*.ipynb")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                   help="notebooks at a time")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per notebook")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--logs", default=str(ROOT / "runs" / "notebooks_plain"),
                   help="each notebook's output goes to <logs>/<name>.log")
    p.add_argument("--cells", type=int, help="run only the first N code cells (a dry run)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        run_one(Path(args.one), Path(args.result), args.cells)
    paths = [Path(n) for n in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda q: launch(q, args.timeout, Path(args.logs), args.cells),
                                paths))
    text = markdown(results)
    print(text, flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
