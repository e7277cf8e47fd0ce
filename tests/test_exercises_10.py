"""Chapter 10 (SimpleFSDP and its graph passes): the exercises' solutions, right and wrong, for the
checkers in minifsdp/labs/ch10.py; the tests that every checker gets are in
tests/exercise_checks.py."""

import math

from exercise_checks import checker_tests

from minifsdp.labs import ch10


def forward_all_gathers(n_blocks, bucketed):
    """Note [one collective per parameter]: a GPT reads 2 + 12 per block + 3 parameters, each
    gathered alone; the bucketing pass makes one all-gather per block, plus the root's two runs."""
    return n_blocks + 2 if bucketed else 5 + 12 * n_blocks


def forward_all_gathers_one_root_run(n_blocks, bucketed):
    return n_blocks + 1 if bucketed else 5 + 12 * n_blocks  # the root's reads are not one run


def forward_all_gathers_blocks_only(n_blocks, bucketed):
    return n_blocks + 2 if bucketed else 12 * n_blocks  # forgets the root's 5 parameters


def bucket_numel(shapes, world_size):
    """Each shard padded to ceil(d0 / N) rows, concatenated, N ranks' buckets gathered."""
    return world_size * sum(math.ceil(s[0] / world_size) * math.prod(s[1:]) for s in shapes)


def bucket_numel_unpadded(shapes, world_size):
    return sum(math.prod(s) for s in shapes)  # the sum of the full sizes: no padding


def bucket_numel_floor(shapes, world_size):
    return world_size * sum(s[0] // world_size * math.prod(s[1:]) for s in shapes)


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_forward_all_gathers": ("forward all-gathers", forward_all_gathers,
                                  [forward_all_gathers_one_root_run,
                                   forward_all_gathers_blocks_only]),
    "check_bucket_numel": ("bucket elements", bucket_numel,
                           [bucket_numel_unpadded, bucket_numel_floor]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch10, SOLUTIONS)
