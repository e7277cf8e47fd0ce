"""The chapter index (minifsdp/chapters.py) is the repository's map: hold the files to it."""

import json
import re
from pathlib import Path

from minifsdp.chapters import CHAPTERS, INFRASTRUCTURE
from minifsdp.labs.seams import LAB_IDS, get_lab

ROOT = Path(__file__).resolve().parents[1]
NO_EXERCISES = {"12"}  # chapters without minifsdp/labs/chNN.py checkers


def _indexed() -> list[str]:
    out = list(INFRASTRUCTURE)
    for c in CHAPTERS.values():
        out += [c.notebook, *c.modules, *c.tests, *c.workers, *c.demos]
    return out


def test_every_file_named_exists_and_is_named_once():
    named = _indexed()
    assert [p for p in named if not (ROOT / p).is_file()] == []
    assert sorted({p for p in named if named.count(p) > 1}) == []


def test_every_module_test_worker_and_notebook_belongs_somewhere():
    files = [p.relative_to(ROOT).as_posix() for pattern in (
        "minifsdp/*.py", "minifsdp/fsdp1/*.py", "minifsdp/fsdp2/*.py", "minifsdp/demos/*.py",
        "tests/test_*.py", "tests/workers/*.py", "notebooks/*.ipynb") for p in ROOT.glob(pattern)]
    assert sorted(set(files) - set(_indexed())) == [], "add them to minifsdp/chapters.py"


def test_the_labs_are_the_chapters_labs_and_each_has_its_files_and_readme_row():
    assert sorted(c.lab for c in CHAPTERS.values() if c.lab) == sorted(LAB_IDS)
    readme = (ROOT / "labs" / "README.md").read_text()
    for lab_id in LAB_IDS:
        assert (ROOT / get_lab(lab_id).skeleton).is_file()
        assert (ROOT / "minifsdp" / "labs" / f"ch{lab_id}.py").is_file()
        assert re.search(rf"^\| {lab_id} \|", readme, re.M), f"labs/README.md: no row for {lab_id}"


def test_every_chapter_with_exercise_checkers_has_its_exercise_tests():
    """minifsdp/labs/chNN.py's checkers are tested in tests/test_exercises_NN.py, which holds a
    solution for each of them (its test_every_checker_has_solutions_here)."""
    with_checkers = [p.stem[2:] for p in sorted((ROOT / "minifsdp" / "labs").glob("ch*.py"))
                     if re.search(r"^def check_", p.read_text(), re.M)]
    # every chapter has exercises today, but chapter 12 (ZeRO++, no lab and no exercises yet)
    assert with_checkers == sorted(c for c in CHAPTERS if c not in NO_EXERCISES)
    assert [c for c in with_checkers
            if f"tests/test_exercises_{c}.py" not in CHAPTERS[c].tests] == []


def test_every_notebook_cell_has_a_unique_id():
    """nbformat 4.5 requires cell ids (nbclient warns today and will refuse later)."""
    for c in CHAPTERS.values():
        cells = json.loads((ROOT / c.notebook).read_text())["cells"]
        ids = [cell.get("id") for cell in cells]
        assert None not in ids and len(set(ids)) == len(ids), c.notebook


def test_the_readme_names_every_chapter_notebook():
    readme = (ROOT / "README.md").read_text()
    assert [c.notebook for c in CHAPTERS.values() if Path(c.notebook).name not in readme] == []


def _py_files():
    for folder in ("minifsdp", "tests", "benchmarks", "labs"):
        yield from (ROOT / folder).rglob("*.py")


def test_every_cited_note_is_defined_exactly_once():
    """A Note is defined where a docstring line starts with ``Note [name]:`` (or ``Note [name]
    (its torch counterpart):``); notebooks and code cite it as ``Note [name]``, which must then
    lead to one place. Abbreviated (``...``) and formatted (``{note}``) citations are skipped."""
    defined: dict[str, list[str]] = {}
    for p in _py_files():
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if m := re.match(r"^\s*Note \[([^\]]+)\](:| \()", line):
                defined.setdefault(m.group(1), []).append(f"{p.relative_to(ROOT)}:{i}")
    assert {k: v for k, v in defined.items() if len(v) > 1} == {}
    texts = [p.read_text() for p in _py_files()]
    texts += [p.read_text() for p in (ROOT / "notebooks").glob("*.ipynb")]
    texts += [p.read_text() for p in ROOT.glob("*.md")] + [(ROOT / "labs/README.md").read_text()]
    cited = {m for t in texts for m in re.findall(r"Note \[([^\]\n]+)\]", t)
             if not any(c in m for c in ('{', '"', "...")) and m != "name"}
    assert sorted(cited - defined.keys()) == []
