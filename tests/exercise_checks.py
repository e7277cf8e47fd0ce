"""What the chapters' exercise tests share. ``tests/test_exercises_NN.py`` holds chapter NN's
solutions to its exercises, right and wrong, and gets from ``checker_tests`` the tests that
every checker in ``minifsdp/labs/chNN.py`` must pass: it accepts a correct solution, rejects
plausible wrong ones, and reports a stub that raises ``NotImplementedError`` as not done yet
instead of crashing.

The correct solutions are written from the formulas in the Notes (and, for the Adam state, by
measuring a real optimizer), never by calling the checkers' own references.
"""

from __future__ import annotations

import inspect
import re
import types

import pytest


def checkers(chapter: types.ModuleType) -> list[str]:
    """The names of the checkers that ``chapter`` (a ``minifsdp.labs.chNN``) defines."""
    return sorted(n for n, f in inspect.getmembers(chapter, inspect.isfunction)
                  if n.startswith("check_") and f.__module__ == chapter.__name__)


def one_line(capsys) -> str:
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def checker_tests(chapter: types.ModuleType, SOLUTIONS: dict) -> tuple:
    """The five tests of ``chapter``'s checkers, parametrized over ``SOLUTIONS``: checker name
    -> (the name it prints, a correct solution, wrong solutions). A chapter's test file binds
    them to module-level ``test_*`` names, where pytest collects them."""
    WRONG = [(c, w) for c, (_, _, wrongs) in SOLUTIONS.items() for w in wrongs]
    WRONG_IDS = [w.__name__ for _, w in WRONG]

    def test_every_checker_has_solutions_here():
        assert sorted(SOLUTIONS) == checkers(chapter), \
            "add the new checker's solutions to SOLUTIONS"

    @pytest.mark.parametrize("checker", sorted(SOLUTIONS))
    def test_accepts_a_correct_solution(checker, capsys):
        label, right, _ = SOLUTIONS[checker]
        assert getattr(chapter, checker)(right) is True
        assert re.fullmatch(rf"✓ {re.escape(label)}: all \d+ cases pass", one_line(capsys))

    @pytest.mark.parametrize("checker,wrong", WRONG, ids=WRONG_IDS)
    def test_rejects_a_wrong_solution(checker, wrong, capsys):
        label = SOLUTIONS[checker][0]
        assert getattr(chapter, checker)(wrong) is False
        out = capsys.readouterr().out  # names the failing call, what it returned, what was expected
        assert out.startswith(f"✗ {label}: {wrong.__name__}("), out
        assert re.search(r"\) returned .+, expected .+\n$", out), out
        assert "✓" not in out

    @pytest.mark.parametrize("checker,wrong",
                             [pytest.param(c, w, id=w.__name__) for c, w in WRONG])
    def test_a_wrong_solution_gets_a_one_line_verdict(checker, wrong, capsys):
        getattr(chapter, checker)(wrong)
        assert one_line(capsys).startswith("✗ ")

    @pytest.mark.parametrize("checker", sorted(SOLUTIONS))
    def test_a_stub_is_not_implemented_yet(checker, capsys):
        def stub(*args):
            raise NotImplementedError("your code here")

        label = SOLUTIONS[checker][0]
        assert getattr(chapter, checker)(stub) is False
        assert one_line(capsys) == f"✗ {label}: not implemented yet"

    return (test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
            test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
            test_a_stub_is_not_implemented_yet)
