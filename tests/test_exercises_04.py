"""Chapter 04 (FSDP1's FlatParameter): the exercises' solutions, right and wrong, for the checkers
in minifsdp/labs/ch04.py; the tests that every checker gets are in tests/exercise_checks.py."""

import math

import torch.nn as nn
from exercise_checks import checker_tests

from minifsdp.labs import ch04


def flat_layout(numels, world_size, align):
    offsets, total = [], 0
    for n in numels:
        total = math.ceil(total / align) * align
        offsets.append(total)
        total += n
    return offsets, math.ceil(total / world_size) * world_size


def flat_layout_unaligned(numels, world_size, align):
    """Packs parameters tightly: ZeRO's layout, not FSDP1's."""
    return flat_layout(numels, world_size, 1)


def flat_layout_pads_each(numels, world_size, align):
    """Pads every parameter to a multiple of world_size instead of the total."""
    offsets, total = [], 0
    for n in numels:
        total = math.ceil(total / align) * align
        offsets.append(total)
        total += math.ceil(n / world_size) * world_size
    return offsets, math.ceil(total / world_size) * world_size


def size_wrap(model, min_num_params):
    units = []

    def visit(name, m):  # returns the elements of m that a unit took
        taken = sum(visit(f"{name}.{c}" if name else c, child)
                    for c, child in m.named_children())
        left = sum(p.numel() for p in m.parameters()) - taken
        if name and left >= min_num_params and not isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            units.append(name)
            return taken + left
        return taken

    visit("", model)
    return units


def size_wrap_counts_all(model, min_num_params):
    """Compares the module's *total* size, ignoring what its children's units took."""
    return [name for name, m in model.named_modules()
            if name and sum(p.numel() for p in m.parameters()) >= min_num_params
            and not isinstance(m, (nn.ModuleList, nn.ModuleDict))][::-1]


def size_wrap_leaves_only(model, min_num_params):
    """Only modules without children can be units."""
    return [name for name, m in model.named_modules()
            if name and not list(m.children())
            and sum(p.numel() for p in m.parameters()) >= min_num_params]


def fsdp1_step_wire_bytes(padded_numels, n, strategy):
    share = (n - 1) / n * 4
    if strategy == "no_shard":
        return 2 * share * sum(padded_numels)
    gathers = 2 * sum(padded_numels) - padded_numels[-1] if strategy == "full_shard" else \
        sum(padded_numels)
    return share * (gathers + sum(padded_numels))


def fsdp1_step_wire_bytes_root_regathered(padded_numels, n, strategy):
    """Forgets that the root keeps its parameters between forward and backward."""
    share = (n - 1) / n * 4
    if strategy == "no_shard":
        return 2 * share * sum(padded_numels)
    k = 3 if strategy == "full_shard" else 2
    return k * share * sum(padded_numels)


def fsdp1_step_wire_bytes_regathers_for_backward(padded_numels, n, strategy):
    """Thinks SHARD_GRAD_OP also gathers again before backward. (Treating NO_SHARD as
    SHARD_GRAD_OP would be right: an all-reduce is a reduce-scatter plus an all-gather.)"""
    return fsdp1_step_wire_bytes(padded_numels, n,
                                 "full_shard" if strategy == "shard_grad_op" else strategy)


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_flat_layout": ("flat layout", flat_layout,
                          [flat_layout_unaligned, flat_layout_pads_each]),
    "check_size_wrap": ("size-based wrap", size_wrap,
                        [size_wrap_counts_all, size_wrap_leaves_only]),
    "check_fsdp1_step_wire_bytes": ("FSDP1 bytes per step", fsdp1_step_wire_bytes,
                                    [fsdp1_step_wire_bytes_root_regathered,
                                     fsdp1_step_wire_bytes_regathers_for_backward]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch04, SOLUTIONS)
