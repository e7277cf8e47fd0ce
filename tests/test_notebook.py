"""minifsdp.notebook: the helpers every notebook uses to print only what holds."""

import doctest

import pytest
import torch

from minifsdp import notebook
from minifsdp.notebook import ClaimError, claim


def test_docstring_examples_run():
    assert doctest.testmod(notebook).failed == 0


def test_a_true_claim_prints_only_the_statement(capsys):
    claim("max |Δparam| < 1e-4", 3.2e-6 < 1e-4, 3.2e-6)
    assert capsys.readouterr().out == "✓ max |Δparam| < 1e-4\n"  # the value stays out


def test_a_false_claim_raises_with_the_measured_value():
    with pytest.raises(ClaimError, match=r"✗ loss ends within 10% of the floor -- measured: 0.25"):
        claim("loss ends within 10% of the floor", 0.25 < 0.1, 0.25)


def test_a_claim_needs_a_comparison_not_a_value():
    with pytest.raises(TypeError, match="needs a bool, got Tensor"):
        claim("grads are finite", torch.tensor([1.0]).isfinite().all())
