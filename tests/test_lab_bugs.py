"""Every planted bug in tests/lab_bugs/labNN.py is rejected where it first shows: the status
("diverged", "crash", "hang") and, where the bug module's ``EXPECTED`` says, the case, checked
value, step, phase, rank, hint and file:line (STYLE.md: "Assert where the report points").
Each bug module lists ``EXPECTED[bug] = dict(status, world_sizes, case=..., name=..., hint=...,
where=...)``; the test runs that bug alone in its seam (``path:bug``) at those world sizes.
A file of its own so that pytest-xdist's ``--dist loadfile`` runs it beside tests/test_labs.py.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest

from minifsdp import labs
from minifsdp.labs import seams

BUG_DIR = Path(__file__).parent / "lab_bugs"


def ready_labs() -> list[str]:
    return [i for i in seams.LAB_IDS
            if hasattr(importlib.import_module(f"minifsdp.labs.ch{i}"), "LAB")]


def planted() -> list:
    out = []
    for lab in ready_labs():
        path = BUG_DIR / f"lab{lab}.py"
        if not path.exists():
            continue
        spec = importlib.util.spec_from_file_location(f"lab_bugs_{lab}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for bug, want in mod.EXPECTED.items():
            out.append(pytest.param(lab, bug, want, id=f"lab{lab}-{bug}"))
    return out


def test_every_lab_exists_with_planted_bugs():
    assert ready_labs() == list(seams.LAB_IDS)
    for lab in seams.LAB_IDS:
        path = BUG_DIR / f"lab{lab}.py"
        assert path.exists(), f"no planted bugs for lab {lab}"
        bugs = [p for p in planted() if p.values[0] == lab]
        assert len(bugs) >= 3, f"lab {lab} has {len(bugs)} planted bugs; the bar is 3"


@pytest.mark.parametrize("lab,bug,want", planted())
def test_planted_bug_is_caught_where_it_shows(lab, bug, want):
    path = BUG_DIR / f"lab{lab}.py"
    doc = inspect.getdoc(getattr(_bug_module(path), bug))
    assert doc, f"{bug}: say which learner's mistake it is, and which Note it breaks"
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


def _bug_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"bugs_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
