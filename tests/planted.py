"""Every planted bug in tests/lab_bugs/labNN.py is rejected where it first shows: the status
("diverged", "crash", "hang") and, where the bug module's ``EXPECTED`` says, the case, checked
value, step, phase, rank, hint and file:line (STYLE.md: "Assert where the report points").
Each bug module lists ``EXPECTED[bug] = dict(status, world_sizes, case=..., name=..., hint=...,
where=...)``; the test runs that bug in its seam (``path:bug``) at those world sizes. The bugs
expected to diverge run as one batch per lab and world sizes (``labs.check_many``, Note [a batch
of lab files]): each report is the one ``labs.check`` gives for the bug alone
(tests/test_labs.py checks that), in 19 launches instead of 106. Crashes and hangs run alone.

The tests live in two files, tests/test_lab_bugs_00_05.py and tests/test_lab_bugs_06_11.py
(``HALVES``), because pytest-xdist's ``--dist loadfile`` runs a file on one worker. Alone on 2
cores the two files took 17 min with one job per bug and 6.6 min with the batches.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest

from minifsdp import labs
from minifsdp.labs import seams

BUG_DIR = Path(__file__).parent / "lab_bugs"
# which test file runs which labs' planted bugs
HALVES = {"test_lab_bugs_00_05": ("00", "02", "03", "04", "05"),
          "test_lab_bugs_06_11": ("06", "07", "08", "09", "10", "11")}


def ready_labs() -> list[str]:
    return [i for i in seams.LAB_IDS
            if hasattr(importlib.import_module(f"minifsdp.labs.ch{i}"), "LAB")]


def planted(labs: tuple[str, ...] | None = None) -> list:
    """``pytest.param(lab, bug, EXPECTED[bug])`` for every planted bug of ``labs`` (all)."""
    out = []
    for lab in ready_labs():
        if labs is not None and lab not in labs:
            continue
        path = BUG_DIR / f"lab{lab}.py"
        if not path.exists():
            continue
        for bug, want in _bug_module(path).EXPECTED.items():
            out.append(pytest.param(lab, bug, want, id=f"lab{lab}-{bug}"))
    return out


def every_lab_exists_with_planted_bugs():
    assert ready_labs() == list(seams.LAB_IDS)
    assert sorted(sum(HALVES.values(), ())) == list(seams.LAB_IDS), "HALVES: each lab once"
    for name in HALVES:
        assert (Path(__file__).parent / f"{name}.py").exists(), name
    every = planted()
    for lab in seams.LAB_IDS:
        path = BUG_DIR / f"lab{lab}.py"
        assert path.exists(), f"no planted bugs for lab {lab}"
        bugs = [p for p in every if p.values[0] == lab]
        assert len(bugs) >= 3, f"lab {lab} has {len(bugs)} planted bugs; the bar is 3"


def planted_bug_is_caught_where_it_shows(lab, bug, want):
    path = BUG_DIR / f"lab{lab}.py"
    doc = inspect.getdoc(getattr(_bug_module(path), bug))
    assert doc, f"{bug}: say which learner's mistake it is, and which Note it breaks"
    if want["status"] == "diverged":  # one job for the lab's diverging bugs (_batch)
        report = _batch(lab, tuple(want["world_sizes"]))[bug]
    else:
        report = labs.check(lab, f"{path}:{bug}", world_sizes=want["world_sizes"], quiet=True)
    text = str(report)
    assert report.status == want["status"], text
    assert text.startswith(f"✗ lab {lab} · "), text
    d = report.divergence
    for key in ("case", "name", "step", "phase", "rank"):
        if key in want:
            assert getattr(d, key) == want[key], f"{key}: {getattr(d, key)!r}\n{text}"
    if "hint" in want:
        assert want["hint"] in text, text
    if "where" in want:
        assert report.where and report.where.endswith(want["where"]), text


_BATCHES: dict[tuple[str, tuple[int, ...]], dict[str, labs.Report]] = {}


def _batch(lab: str, world_sizes: tuple[int, ...]) -> dict[str, labs.Report]:
    """The reports of every planted bug of ``lab`` expected to diverge at ``world_sizes``,
    from ``labs.check_many`` (one job, not one per bug), computed once per test process."""
    key = (lab, world_sizes)
    if key not in _BATCHES:
        path = BUG_DIR / f"lab{lab}.py"
        bugs = [bug for bug, want in _bug_module(path).EXPECTED.items()
                if want["status"] == "diverged" and tuple(want["world_sizes"]) == world_sizes]
        reports = labs.check_many(lab, [f"{path}:{bug}" for bug in bugs],
                                  world_sizes=world_sizes)
        _BATCHES[key] = dict(zip(bugs, reports, strict=True))
    return _BATCHES[key]


def _bug_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"bugs_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
