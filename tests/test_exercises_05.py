"""Chapter 05 (FSDP2's per-parameter sharding): the exercises' solutions, right and wrong, for the
checkers in minifsdp/labs/ch05.py; the tests that every checker gets are in
tests/exercise_checks.py."""

import math

from exercise_checks import checker_tests

from minifsdp.labs import ch05


def dim0_rows(d0, world_size):
    per = -(-d0 // world_size)
    return [max(0, min(per, d0 - r * per)) for r in range(world_size)]


def dim0_rows_floor(d0, world_size):
    """Splits as evenly as possible (np.array_split), which is not torch.chunk's rule."""
    return [d0 // world_size + (r < d0 % world_size) for r in range(world_size)]


def dim0_rows_no_empty(d0, world_size):
    """Returns only torch.chunk's chunks, forgetting the empty shards."""
    per = -(-d0 // world_size)
    return [min(per, d0 - r * per) for r in range(world_size) if d0 - r * per > 0]


def fsdp2_rest_bytes(shapes, world_size, rank):
    total = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        rows = dim0_rows(shape[0], world_size)
        total += 4 * rows[0] * rest + 8 * rows[rank] * rest + 4
    return total


def fsdp2_rest_bytes_unpadded(shapes, world_size, rank):
    """Counts the parameter's own rows, not the padded shard behind them."""
    return sum(12 * dim0_rows(s[0], world_size)[rank] * math.prod(s[1:]) + 4 for s in shapes)


def fsdp2_rest_bytes_with_grads(shapes, world_size, rank):
    """Keeps sharded gradients between steps (zero_grad sets them to None)."""
    return fsdp2_rest_bytes(shapes, world_size, rank) + sum(
        4 * dim0_rows(s[0], world_size)[rank] * math.prod(s[1:]) for s in shapes)


def fsdp2_group_wire_bytes(shapes, world_size, reshard_after_forward):
    n = world_size
    buffer = 4 * n * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)
    return (3 if reshard_after_forward else 2) * (n - 1) / n * buffer


def fsdp2_group_wire_bytes_unpadded(shapes, world_size, reshard_after_forward):
    """Sends the parameters' own elements, without the padding of short shards."""
    n = world_size
    buffer = 4 * sum(math.prod(s) for s in shapes)
    return (3 if reshard_after_forward else 2) * (n - 1) / n * buffer


def fsdp2_group_wire_bytes_always_regather(shapes, world_size, reshard_after_forward):
    """Forgets that a group kept after forward needs no second all-gather."""
    return fsdp2_group_wire_bytes(shapes, world_size, True)


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_dim0_rows": ("dim-0 rows", dim0_rows, [dim0_rows_floor, dim0_rows_no_empty]),
    "check_fsdp2_rest_bytes": ("FSDP2 bytes at rest", fsdp2_rest_bytes,
                               [fsdp2_rest_bytes_unpadded, fsdp2_rest_bytes_with_grads]),
    "check_fsdp2_group_wire_bytes": ("FSDP2 group bytes per step", fsdp2_group_wire_bytes,
                                     [fsdp2_group_wire_bytes_unpadded,
                                      fsdp2_group_wire_bytes_always_regather]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch05, SOLUTIONS)
