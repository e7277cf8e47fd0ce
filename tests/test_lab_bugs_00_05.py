"""The planted bugs of labs 00 to 05 are each rejected where they first show (tests/planted.py
says what is asserted, and why the planted bugs are tested in two files)."""

import planted
import pytest


def test_every_lab_exists_with_planted_bugs():
    planted.every_lab_exists_with_planted_bugs()


@pytest.mark.parametrize("lab,bug,want", planted.planted(planted.HALVES["test_lab_bugs_00_05"]))
def test_planted_bug_is_caught_where_it_shows(lab, bug, want):
    planted.planted_bug_is_caught_where_it_shows(lab, bug, want)
