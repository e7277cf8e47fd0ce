"""Chapter 00 (collectives and torchrun): the exercises' solutions, right and wrong, for the
checkers in minifsdp/labs/ch00.py; the tests that every checker gets are in
tests/exercise_checks.py."""

import math
import re

from exercise_checks import checker_tests, one_line

from minifsdp.labs import ch00, ch01


def ring_bytes(numel, element_size, world_size):
    """Note [ring bytes]: 2(N-1) steps, each sending one chunk of ceil(numel/N) elements."""
    return 2 * (world_size - 1) * math.ceil(numel / world_size) * element_size


def ring_bytes_unpadded(numel, element_size, world_size):
    return 2 * (world_size - 1) / world_size * numel * element_size  # 2(N-1)/N * S, no padding


def ring_bytes_2n_steps(numel, element_size, world_size):
    return 2 * world_size * math.ceil(numel / world_size) * element_size  # N steps per phase


def ring_bytes_padding_times_n(numel, element_size, world_size):
    """The formula Note [ring bytes] once printed: padding p counted 2(N-1) times, not 2(N-1)/N."""
    n = world_size
    p = n * math.ceil(numel / n) - numel
    return (2 * (n - 1) / n * numel + 2 * (n - 1) * p) * element_size


def reduce_scatter(inputs):
    """Rank r gets chunk r of the elementwise sum of every rank's list."""
    n = len(inputs)
    k = len(inputs[0]) // n
    total = [sum(column) for column in zip(*inputs)]
    return [total[r * k:(r + 1) * k] for r in range(n)]


def reduce_scatter_full_sum(inputs):
    total = [sum(column) for column in zip(*inputs)]
    return [total for _ in inputs]  # an all_reduce: nothing is scattered


def reduce_scatter_own_chunk(inputs):
    n = len(inputs)
    k = len(inputs[0]) // n
    return [x[r * k:(r + 1) * k] for r, x in enumerate(inputs)]  # scattered, never reduced


# The right answer is the package's ring itself: ch00 reads the schedule off
# minifsdp.ring (one copy of the answer key); the test below ties it to the Note's table.
chunk_sent = ch00.ring_schedule


def chunk_sent_off_by_one(rank, step, world_size, phase):
    return (rank - step) % world_size  # the all-gather schedule in both phases


def chunk_sent_leftwards(rank, step, world_size, phase):
    first = 1 if phase == "reduce_scatter" else 0
    return (rank + first + step) % world_size  # the ring run the wrong way round


def test_chunk_sent_reproduces_the_table_in_the_ring_note():
    # minifsdp/ring.py, Note [ring all-reduce], N = 3: row = step, column = rank
    table = {"reduce_scatter": [[2, 0, 1], [1, 2, 0]], "all_gather": [[0, 1, 2], [2, 0, 1]]}
    for phase, rows in table.items():
        assert [[chunk_sent(r, s, 3, phase) for r in range(3)] for s in range(2)] == rows


def collectives_run(n, corrupt=False):
    """A ``--demo collectives`` run's ``ranks`` (only what the checker reads): rank r holds
    [10r, 10r + 1, ..., 10r + 2N - 1]; reduce_scatter gives rank r elements 2r and 2r + 1 of
    the sum, sum_r (j + 10r) = N j + 5 N (N - 1)."""
    ranks = []
    for r in range(n):
        out = [n * j + 5 * n * (n - 1) for j in (2 * r, 2 * r + 1)]
        if corrupt and r == 1:
            out = out[::-1]
        ranks.append({"collectives": {"reduce_scatter": {
            "input": [10 * r + j for j in range(2 * n)], "output": out}}})
    return ranks


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_ring_bytes": ("ring bytes", ring_bytes, [ring_bytes_unpadded, ring_bytes_2n_steps,
                                                    ring_bytes_padding_times_n]),
    "check_reduce_scatter": ("reduce_scatter", reduce_scatter,
                             [reduce_scatter_full_sum, reduce_scatter_own_chunk]),
    "check_ring_schedule": ("ring schedule", chunk_sent,
                            [chunk_sent_off_by_one, chunk_sent_leftwards]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch00, SOLUTIONS)


def test_first_failing_case_is_the_one_shown(capsys):
    # 1000 elements split evenly over 4 and 2 ranks, so the unpadded count is right until
    # 10,001 elements over 4 ranks: 2*3*2501*4 = 60024 bytes sent, not 60006
    assert ch00.check_ring_bytes(ring_bytes_unpadded) is False
    assert one_line(capsys) == ("✗ ring bytes: ring_bytes_unpadded(10001, 4, 4) returned "
                                "60006.0, expected 60024")


def test_ring_bytes_answers_are_counted_and_match_the_note():
    """The checker's answers are bytes counted from the package's ring; they equal Note [ring
    bytes]'s 2(N-1) chunks of ceil(numel/N) elements, and not the old formula's count."""
    for numel, e, n in [(10_001, 4, 4), (7, 2, 3), (1003, 8, 5), (1, 4, 8), (1000, 4, 1)]:
        assert ch00.counted_ring_bytes(numel, e, n) == ring_bytes(numel, e, n)
    old = ring_bytes_padding_times_n(10_001, 4, 4)
    assert ch00.counted_ring_bytes(10_001, 4, 4) == 60024 != old


def test_reduce_scatter_is_also_checked_against_a_measured_run(capsys):
    assert ch00.check_reduce_scatter(reduce_scatter, measured=collectives_run(4)) is True
    assert re.fullmatch(r"✓ reduce_scatter: all \d+ cases pass", one_line(capsys))
    # a run whose outputs disagree with the sum (rank 1's two elements swapped) is flagged
    assert ch00.check_reduce_scatter(reduce_scatter,
                                     measured=collectives_run(4, corrupt=True)) is False
    assert one_line(capsys).startswith("✗ reduce_scatter: reduce_scatter([[0, 1, 2")


def test_checker_survives_odd_answers(capsys):
    """A partial, a None and a tensor answer get a verdict, never a crash."""
    import functools

    import torch

    from minifsdp.ring import ring_wire_bytes

    assert ch00.check_ring_bytes(functools.partial(ring_wire_bytes))
    assert not ch01.check_model_states(lambda psi, n, stage: None)
    assert ch00.check_reduce_scatter(
        lambda ins: list(torch.tensor(ins).sum(0).chunk(len(ins))))
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("✓") and out[1].startswith("✗ model states: <lambda>(")
    assert out[2].startswith("✓")
