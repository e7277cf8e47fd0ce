"""The lab checkers judge correctly: a pass needs every seam called (the package's own code
passes every lab in its notebook's Lab cell, under nbval), each untouched skeleton reports
"not started" at its TODO, ids agree everywhere, and the harness names a bad file before
launching anything (STYLE.md: "A checker is trusted only when tests show it"). The planted
bugs are tested in tests/test_lab_bugs_00_05.py and tests/test_lab_bugs_06_11.py
(tests/planted.py).
"""

from __future__ import annotations

import ast
import inspect
import json
from pathlib import Path

import pytest

from minifsdp import labs
from minifsdp.labs import seams
from minifsdp.launch import RunResult, repo_root

ROOT = repo_root()


@pytest.mark.parametrize("lab", seams.LAB_IDS)
def test_ids_agree_everywhere(lab):
    """One id per lab, derived or checked, never typed twice differently (STYLE.md)."""
    spec = seams.get_lab(lab)
    assert spec.id == lab
    skeleton = ROOT / spec.skeleton
    assert skeleton.name.startswith(f"lab{lab}_"), skeleton
    text = skeleton.read_text()
    assert text.startswith(f'"""Lab {lab}: '), "the first line names the lab"
    assert f"TODO(lab {lab})" in text
    assert f'NotImplementedError("lab {lab}: ' in text
    assert f"python -m minifsdp.labs {lab}" in "\n".join(text.splitlines()[:10]), \
        "the skeleton's first ten lines say how to check it"
    for note in spec.notes:
        found = any(f"Note [{note}]" in p.read_text() for p in (ROOT / "minifsdp").rglob("*.py")
                    if "labs" not in p.parts)
        assert found, f"lab {lab} cites Note [{note}], which the package does not define"
    nb = next((ROOT / "notebooks").glob(f"{lab}_*.ipynb"))
    cells = ["".join(c["source"]) for c in json.loads(nb.read_text())["cells"]]
    assert any(f'labs.check("{lab}", "reference")' in c for c in cells), \
        f"{nb.name} has no Lab section running labs.check({lab!r}, 'reference')"
    assert any(spec.skeleton in c for c in cells), f"{nb.name} does not name {spec.skeleton}"


@pytest.mark.parametrize("lab", seams.LAB_IDS)
def test_skeleton_takes_what_the_reference_takes(lab):
    """The seam's reference and the skeleton have the same parameters (for a method, the
    reference's ``self`` is the skeleton's first parameter, whatever its name)."""
    spec = seams.get_lab(lab)
    skeleton = seams._skeleton_module(spec)
    for s in spec.seams:
        ref = list(inspect.signature(getattr(*s.target())).parameters)
        mine = list(inspect.signature(getattr(skeleton, s.fn_name)).parameters)
        if "." in s.attr:  # a method
            ref, mine = ref[1:], mine[1:]
        assert mine == ref, f"{s.name}: skeleton {mine} vs reference {ref}"


def test_a_pass_needs_every_seam_called(tmp_path, monkeypatch):
    """Every check matched, but no case called one seam: the checker judged nothing there, so
    the verdict is a harness error, not a pass. (The reference's own pass, every seam called,
    is each notebook's Lab cell under nbval: test_ids_agree_everywhere makes sure it is there.)"""
    def fake_torchrun(*args, nproc, env, **kwargs):
        n = len(env["MINIFSDP_LAB_FILE"].split("\n"))
        calls = {"ring.reduce_scatter": 2, "ring.all_gather": int(nproc == 3)}
        rank = {"files": [{"first": None, "checks": 5, "calls": calls}] * n}
        return RunResult("fake", tmp_path / "fake", [rank] * nproc, {}, 0.0)

    monkeypatch.setattr(labs, "torchrun", fake_torchrun)
    half = labs.check("00", "reference", world_sizes=(2,), quiet=True)
    assert half.status == "harness error" and "ring.all_gather" in str(half), str(half)
    assert "ring.reduce_scatter" not in str(half)
    both = labs.check("00", "reference", world_sizes=(2, 3), quiet=True)
    assert both.ok and str(both).startswith("✓ lab 00 · ") and "all 10 checks" in str(both)


def test_check_many_reports_what_check_reports(tmp_path):
    """labs.check_many (Note [a batch of lab files]) gives each file the report labs.check
    gives it alone: a pass, a divergence, a bad file, and, when one file crashes the batch's
    job, the crash and its neighbour's divergence from their own jobs."""
    bugs = ROOT / "tests/lab_bugs/lab00.py"
    bad = tmp_path / "lab00_ring.py"
    bad.write_text("def ring_reduce_scatter(output, input, op=None, group=None):\n    pass\n")
    files = ["reference", f"{bugs}:avg_never_divided", bad, f"{bugs}:sums_into_the_input"]
    many = labs.check_many("00", files, world_sizes=(2,))
    alone = [labs.check("00", f, world_sizes=(2,), quiet=True) for f in files]
    assert [r.status for r in many] == ["pass", "diverged", "bad file", "diverged"]
    for m, a in zip(many, alone, strict=True):
        assert (str(m), m.calls) == (str(a), a.calls)
    crash = f"{bugs}:copies_the_input_unflattened"
    many = labs.check_many("00", [f"{bugs}:avg_never_divided", crash], world_sizes=(2,))
    assert [r.status for r in many] == ["diverged", "crash"], "\n".join(map(str, many))
    assert many[1].where.endswith("lab00.py:124") and str(many[0]) == str(alone[1])


@pytest.mark.parametrize("lab", seams.LAB_IDS)
def test_untouched_skeleton_is_not_started(lab):
    spec = seams.get_lab(lab)
    report = labs.check(lab, ROOT / spec.skeleton, world_sizes=(2,), quiet=True)
    assert report.status == "not started", str(report)
    assert report.where.startswith(spec.skeleton + ":"), report.where
    assert f"python -m minifsdp.labs {lab} --start" in str(report)


# ---- the harness itself, without launching jobs -------------------------------------------------


def test_a_missing_function_or_a_syntax_error_is_named_before_any_launch(tmp_path):
    bad = tmp_path / "lab00_ring.py"
    bad.write_text("def ring_reduce_scatter(output, input, op=None, group=None):\n    pass\n")
    report = labs.check("00", bad, quiet=True)
    assert report.status == "bad file"
    assert "defines no function ring_all_gather() (seam 'ring.all_gather')" in str(report)
    bad.write_text("def ring_reduce_scatter(output, input op):\n")
    report = labs.check("00", bad, quiet=True)
    assert report.status == "bad file" and "lab00_ring.py:1: SyntaxError" in str(report)
    bad.write_text("import torch\n\n\ndef ring_reduce_scatter(output: Group, input):\n    pass\n")
    report = labs.check("00", bad, quiet=True)  # any error while importing: its line, no traceback
    assert report.status == "bad file", str(report)
    assert "lab00_ring.py:4: importing it raised NameError: name 'Group'" in str(report)


def test_a_changed_signature_is_named(tmp_path):
    src = (ROOT / "labs/lab00_ring.py").read_text().replace(
        "def ring_all_gather(output, input, group=None)", "def ring_all_gather(out, inp)")
    (tmp_path / "mine.py").write_text(src)
    report = labs.check("00", tmp_path / "mine.py", quiet=True)
    assert report.status == "bad file"
    assert "ring_all_gather(out, inp) must take (output, input, group)" in str(report)


def test_start_copies_the_skeleton_and_never_overwrites(tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine" / "lab00_ring.py"
    monkeypatch.setattr(labs, "your_file", lambda lab_id: mine)
    assert labs.start("00") == mine
    assert mine.read_text() == (ROOT / "labs/lab00_ring.py").read_text()
    mine.write_text("# my work")
    labs.start("00")
    assert mine.read_text() == "# my work"
    assert "already exists" in capsys.readouterr().out


def test_your_copies_are_ignored_by_git():
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "labs/mine/" in ignored


def test_skeletons_hold_no_solution():
    """A skeleton's seam functions end in the NotImplementedError: no loop is written for the
    reader (a given line may stay; the lesson may not)."""
    for lab in seams.LAB_IDS:
        spec = seams.get_lab(lab)
        tree = ast.parse((ROOT / spec.skeleton).read_text())
        fns = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        for s in spec.seams:
            last = fns[s.fn_name].body[-1]
            assert isinstance(last, ast.Raise), f"lab {lab}: {s.fn_name} must end in the raise"


def test_labs_readme_lists_every_lab_file_seam_and_command():
    text = (ROOT / "labs" / "README.md").read_text()
    for lab in seams.LAB_IDS:
        spec = seams.get_lab(lab)
        row = next((ln for ln in text.splitlines() if ln.startswith(f"| {lab} ")), None)
        assert row, f"labs/README.md has no row for lab {lab}"
        assert Path(spec.skeleton).name in row, row
        for s in spec.seams:
            assert f"`{s.name}`" in row, f"lab {lab}: seam {s.name} missing from {row}"


def test_hints_are_graded_and_asked_for_one_at_a_time(tmp_path, monkeypatch):
    """Every lab has three hints (idea and Notes; data structures and invariants; pseudo-code),
    given one per request and remembered beside the reader's copy; none is the package's code
    (no line of the seam's reference source appears in a hint)."""
    monkeypatch.setattr(labs, "repo_root", lambda: tmp_path)
    for lab_id in seams.LAB_IDS:
        lab = seams.get_lab(lab_id)
        assert len(lab.hints) == 3 and all(len(h) > 80 for h in lab.hints), lab_id
        assert "Note [" in lab.hints[0], f"lab {lab_id}: the first hint names the Notes to read"
        shown = [labs.hint(lab_id) for _ in range(4)]
        for k in range(3):
            assert shown[k].startswith(f"lab {lab_id}, hint {k + 1} of 3: "), shown[k]
        assert shown[3] == shown[2]  # the last hint stays the last
        assert labs.hint(lab_id, 1) == shown[0].split("\n")[0] + "\n(ask again for hint 2)"
        code = {ln.strip() for s in lab.seams
                for ln in inspect.getsource(getattr(*s.target())).splitlines()
                if len(ln.strip()) > 30 and not ln.strip().startswith(("#", '"""', "``"))}
        for h in lab.hints:
            assert not any(ln in h for ln in code), f"lab {lab_id}: a hint quotes the package"
    with pytest.raises(ValueError, match="lab 00 has hints 1 to 3, not 4"):
        labs.hint("00", 4)


def test_nan_for_empty_fills_only_what_nobody_wrote():
    """Lab 05's and 07's copy-ins run under ``NaNForEmpty``: an uninitialized allocation
    (empty, new_empty, empty_like) starts as NaN (ints: their largest value), so padding left
    unwritten differs on every run; zeros and a zero-padding ``_chunk_cat`` stay zero."""
    import torch

    from minifsdp.labs.uninitialized import NaNForEmpty

    with NaNForEmpty():
        made = [torch.empty(3), torch.ones(2).new_empty(4), torch.empty_like(torch.ones(2))]
        ints = torch.empty(2, dtype=torch.int32)
        zeros = torch.zeros(3)
        padded = torch._chunk_cat([torch.ones(3), torch.ones(1)], dim=0, num_chunks=2)
    assert all(t.isnan().all() for t in made)
    assert ints.tolist() == [torch.iinfo(torch.int32).max] * 2
    assert zeros.tolist() == [0.0] * 3 and padded.tolist() == [[1, 1, 1], [1, 0, 0]]
