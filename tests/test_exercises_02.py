"""Chapter 02 (DDP): the exercises' solutions, right and wrong, for the checkers in
minifsdp/labs/ch02.py; the tests that every checker gets are in tests/exercise_checks.py."""


import torch
from exercise_checks import checker_tests

from minifsdp.labs import ch02


def assign_buckets(params, cap_bytes):
    buckets, current, size, key = [], [], 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        if current and (p.dtype, p.device) != key:
            buckets.append(current)
            current, size = [], 0
        key = (p.dtype, p.device)
        current.append(i)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def assign_buckets_forward_order(params, cap_bytes):
    """Fills buckets from the first parameter: the last layers' gradients would wait."""
    return [list(reversed(b)) for b in reversed(assign_buckets(params[::-1], cap_bytes))]


def assign_buckets_cap_exclusive(params, cap_bytes):
    """Never lets a bucket reach the cap: closes it before the parameter that would."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if current and size + nbytes >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + ([current] if current else [])


def ddp_step_comm(numels, world_size, cap_bytes):
    buckets = assign_buckets([torch.empty(n) for n in numels], cap_bytes)
    return len(buckets), 2 * (world_size - 1) / world_size * 4 * sum(numels)


def ddp_step_comm_per_tensor(numels, world_size, cap_bytes):
    """Counts one all-reduce per parameter, as NaiveDDP does."""
    return len(numels), 2 * (world_size - 1) / world_size * 4 * sum(numels)


def ddp_step_comm_gather_bytes(numels, world_size, cap_bytes):
    """Counts only the reduce-scatter half of the ring."""
    n, _ = ddp_step_comm(numels, world_size, cap_bytes)
    return n, (world_size - 1) / world_size * 4 * sum(numels)


def stalled_buckets(buckets, used):
    stalled = False
    out = []
    for k, b in enumerate(buckets):
        stalled = stalled or not set(b) <= used
        if stalled:
            out.append(k)
    return out


def stalled_buckets_only_incomplete(buckets, used):
    """Forgets that buckets launch in order."""
    return [k for k, b in enumerate(buckets) if not set(b) <= used]


def stalled_buckets_from_the_end(buckets, used):
    """Thinks the last incomplete bucket blocks the ones before it."""
    bad = [k for k, b in enumerate(buckets) if not set(b) <= used]
    return list(range(0, bad[-1] + 1)) if bad else []


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_assign_buckets": ("bucket assignment", assign_buckets,
                             [assign_buckets_forward_order, assign_buckets_cap_exclusive]),
    "check_ddp_step_comm": ("DDP bytes per step", ddp_step_comm,
                            [ddp_step_comm_per_tensor, ddp_step_comm_gather_bytes]),
    "check_stalled_buckets": ("stalled buckets", stalled_buckets,
                              [stalled_buckets_only_incomplete, stalled_buckets_from_the_end]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch02, SOLUTIONS)
