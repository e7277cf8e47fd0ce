"""The planted bugs of labs 06 to 11 are each rejected where they first show (tests/planted.py
says what is asserted, and why the planted bugs are tested in two files)."""

import planted
import pytest


@pytest.mark.parametrize("lab,bug,want", planted.planted(planted.HALVES["test_lab_bugs_06_11"]))
def test_planted_bug_is_caught_where_it_shows(lab, bug, want):
    planted.planted_bug_is_caught_where_it_shows(lab, bug, want)
