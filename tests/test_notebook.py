"""minifsdp.notebook: the helpers every notebook uses to print only what holds."""

import doctest
import json
import re
from pathlib import Path

import pytest
import torch

from minifsdp import notebook
from minifsdp.notebook import ClaimError, claim


def test_docstring_examples_run():
    assert doctest.testmod(notebook).failed == 0


def test_a_true_claim_shows_its_value_where_nbval_does_not_compare_it(capsys):
    claim("max |Δparam| < 1e-4", 3.2e-6 < 1e-4, 3.2e-6)
    out = capsys.readouterr().out
    assert out == "✓ max |Δparam| < 1e-4 · measured: 3.2e-06\n"  # the reader sees the number
    assert _sanitize(out) == "✓ max |Δparam| < 1e-4\n"  # nbval compares the statement only
    claim("a fact", True)
    assert capsys.readouterr().out == "✓ a fact\n"


def test_a_false_claim_raises_with_the_measured_value():
    with pytest.raises(ClaimError, match=r"✗ loss ends within 10% of the floor -- measured: 0.25"):
        claim("loss ends within 10% of the floor", 0.25 < 0.1, 0.25)


def test_a_claim_needs_a_comparison_not_a_value():
    with pytest.raises(TypeError, match="needs a bool, got Tensor"):
        claim("grads are finite", torch.tensor([1.0]).isfinite().all())


# ---- every notebook says what this machine runs (Note [one code path for CPU and GPU]) ---------

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_notebooks_first_cell_prints_what_this_machine_runs(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    assert "print(describe_machine())" in "".join(cells[0]["source"]), path.name
    shown = "".join("".join(o.get("text", "")) for o in cells[0].get("outputs", []))  # str or lines
    assert shown.startswith("this machine: "), f"{path.name}: the stored first cell shows {shown!r}"


def _sanitize(text: str) -> str:
    """Apply notebooks/nbval_sanitize.cfg as nbval does (its own parser)."""
    from nbval.plugin import get_sanitize_patterns

    cfg = (NOTEBOOKS[0].parent / "nbval_sanitize.cfg").read_text()
    for regex, replace in get_sanitize_patterns(cfg):
        text = re.sub(regex, replace, text)
    return text


def test_what_differs_between_machines_is_sanitized():
    """The machine line and a job's backend line read differently on a laptop and on a GPU box;
    nbval must compare them as equal (and compare the rest)."""
    laptop = ("this machine: torch 2.14.1+cu130, 2 CPU cores, no GPU: every job runs on CPU with "
              "gloo\n"
              "✓ a claim · measured: 0.0271\n")
    gpu_box = ("this machine: torch 2.11.0+cu130, 16 CPU cores, 1 GPU (NVIDIA H200): a job of up "
               "to 1 rank runs on NCCL, one GPU each; a larger job on CPU with gloo\n"
               "2 ranks, 1 GPU: this job runs on CPU with gloo (NCCL needs a GPU per rank)\n"
               "✓ a claim · measured: (0.0302, {'a': 1})\n")
    assert _sanitize(laptop) == _sanitize(gpu_box) == _sanitize("this machine: x\n✓ a claim\n")
    assert _sanitize(laptop) != _sanitize(laptop.replace("a claim", "another claim"))
