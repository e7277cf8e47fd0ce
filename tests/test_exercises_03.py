"""Chapter 03 (ZeRO): the exercises' solutions, right and wrong, for the checkers in
minifsdp/labs/ch03.py; the tests that every checker gets are in tests/exercise_checks.py."""

import math

from exercise_checks import checker_tests

from minifsdp.labs import ch03


def flat_partition(numels, rank, world_size):
    shard = -(-sum(numels) // world_size)
    lo, hi = rank * shard, (rank + 1) * shard
    out, offset = [], 0
    for i, n in enumerate(numels):
        start, stop = max(lo, offset), min(hi, offset + n)
        if start < stop:
            out.append((i, start - offset, stop - offset))
        offset += n
    return out


def flat_partition_floor(numels, rank, world_size):
    """Rounds the shard size down: the last elements belong to nobody."""
    shard = sum(numels) // world_size
    out, offset = [], 0
    for i, n in enumerate(numels):
        start, stop = max(rank * shard, offset), min((rank + 1) * shard, offset + n)
        if start < stop:
            out.append((i, start - offset, stop - offset))
        offset += n
    return out


def flat_partition_per_tensor(numels, rank, world_size):
    """Splits every parameter N ways instead of the flat buffer."""
    out = []
    for i, n in enumerate(numels):
        k = -(-n // world_size)
        start, stop = min(rank * k, n), min((rank + 1) * k, n)
        if start < stop:
            out.append((i, start, stop))
    return out


def zero_model_state_bytes(psi, n, stage):
    shard = math.ceil(psi / n)
    return {"params": 4 * n * shard, "grads": 4 * (n * shard if stage == "zero1" else shard),
            "optimizer": 8 * shard + 4}


def zero_model_state_bytes_unpadded(psi, n, stage):
    """The paper's formulas: right only when N divides psi."""
    return {"params": 4 * psi, "grads": 4 * psi if stage == "zero1" else 4 * psi // n,
            "optimizer": 8 * psi // n + 4}


def zero_model_state_bytes_no_step(psi, n, stage):
    """Forgets Adam's 4-byte step counter."""
    out = zero_model_state_bytes(psi, n, stage)
    return {**out, "optimizer": out["optimizer"] - 4}


def zero_step_wire_bytes(psi, n, stage):
    if stage == "ddp":
        return 2 * (n - 1) / n * 4 * psi
    flat = 4 * n * math.ceil(psi / n)
    reduce = 2 * (n - 1) / n * flat if stage == "zero1" else (n - 1) / n * flat
    return reduce + (n - 1) / n * flat


def zero_step_wire_bytes_no_gather(psi, n, stage):
    """Forgets the all-gather of the updated parameters."""
    flat = 4 * n * math.ceil(psi / n) if stage != "ddp" else 4 * psi
    return (1 if stage == "zero2" else 2) * (n - 1) / n * flat


def zero_step_wire_bytes_unpadded(psi, n, stage):
    """Ignores the padding of the flat buffer."""
    return {"ddp": 2, "zero1": 3, "zero2": 2}[stage] * (n - 1) / n * 4 * psi


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_flat_partition": ("flat partition", flat_partition,
                             [flat_partition_floor, flat_partition_per_tensor]),
    "check_zero_model_state_bytes": ("ZeRO model-state bytes", zero_model_state_bytes,
                                     [zero_model_state_bytes_unpadded,
                                      zero_model_state_bytes_no_step]),
    "check_zero_step_wire_bytes": ("ZeRO bytes per step", zero_step_wire_bytes,
                                   [zero_step_wire_bytes_no_gather,
                                    zero_step_wire_bytes_unpadded]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch03, SOLUTIONS)
