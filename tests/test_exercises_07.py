"""Chapter 07 (mixed precision): the exercises' solutions, right and wrong, for the checkers in
minifsdp/labs/ch07.py; the tests that every checker gets are in tests/exercise_checks.py."""

import math

from exercise_checks import checker_tests

from minifsdp.labs import ch07


def bf16_round(x):
    import struct

    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000   # round to nearest, ties to even
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bf16_truncate(x):
    """Drops the low 16 bits: rounds toward zero."""
    import struct

    bits = struct.unpack("<I", struct.pack("<f", x))[0] & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def bf16_round_half_up(x):
    """Rounds ties away from zero instead of to even."""
    import struct

    bits = (struct.unpack("<I", struct.pack("<f", x))[0] + 0x8000) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def unsharded_group_bytes(shapes, world_size, element_size):
    n = world_size
    return element_size * n * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)


def unsharded_group_bytes_unpadded(shapes, world_size, element_size):
    """The parameters' own elements: forgets the padding of short shards."""
    return element_size * sum(math.prod(s) for s in shapes)


def unsharded_group_bytes_fp32(shapes, world_size, element_size):
    """Ignores the gather dtype: unsharded parameters are param_dtype under mixed precision."""
    return unsharded_group_bytes(shapes, world_size, 4)


def mp_group_wire_bytes(shapes, world_size, param_bytes, reduce_bytes, reshard_after_forward):
    n = world_size
    elems = n * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)
    return (n - 1) / n * elems * ((2 if reshard_after_forward else 1) * param_bytes
                                  + reduce_bytes)


def mp_group_wire_bytes_all_param(shapes, world_size, param_bytes, reduce_bytes,
                                  reshard_after_forward):
    """Reduce-scatters in the param dtype too, whatever reduce_dtype says."""
    return mp_group_wire_bytes(shapes, world_size, param_bytes, param_bytes,
                               reshard_after_forward)


def mp_group_wire_bytes_fp32_gather(shapes, world_size, param_bytes, reduce_bytes,
                                    reshard_after_forward):
    """Gathers the fp32 shards and casts after: the cast belongs in the copy-in."""
    return mp_group_wire_bytes(shapes, world_size, 4, reduce_bytes, reshard_after_forward)


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_bf16_round": ("bf16 rounding", bf16_round, [bf16_truncate, bf16_round_half_up]),
    "check_unsharded_group_bytes": ("unsharded group bytes", unsharded_group_bytes,
                                    [unsharded_group_bytes_unpadded, unsharded_group_bytes_fp32]),
    "check_mp_group_wire_bytes": ("mixed-precision group bytes", mp_group_wire_bytes,
                                  [mp_group_wire_bytes_all_param,
                                   mp_group_wire_bytes_fp32_gather]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch07, SOLUTIONS)
