"""Chapter 09 (capstone): the exercises' solutions, right and wrong, for the checkers in
minifsdp/labs/ch09.py; the tests that every checker gets are in tests/exercise_checks.py."""



from exercise_checks import checker_tests

from minifsdp.labs import ch09


def fits(psi, n, strategy, gpu_bytes):
    per_gpu = {"ddp": 16 * psi, "zero1": 4 * psi + 12 * psi / n,
               "zero2": 2 * psi + 14 * psi / n, "fsdp": 16 * psi / n}[strategy]
    return per_gpu <= gpu_bytes


def fits_zero2_shards_params(psi, n, strategy, gpu_bytes):
    """Treats ZeRO-2 as if it sharded the parameters too."""
    return fits(psi, n, "fsdp" if strategy == "zero2" else strategy, gpu_bytes)


def fits_fp32(psi, n, strategy, gpu_bytes):
    """Counts 4-byte parameters and gradients on top of the 12 bytes of optimizer state."""
    per_gpu = {"ddp": 20 * psi, "zero1": 8 * psi + 12 * psi / n,
               "zero2": 4 * psi + 16 * psi / n, "fsdp": 20 * psi / n}[strategy]
    return per_gpu <= gpu_bytes


def hsdp_wire_bytes(psi, replicate, shard):
    full = 4 * psi
    return 3 * (shard - 1) / shard * full, 2 * (replicate - 1) / replicate * full / shard


def hsdp_wire_bytes_full_allreduce(psi, replicate, shard):
    """All-reduces the whole gradient across nodes, not the node's 1/shard slice."""
    intra, _ = hsdp_wire_bytes(psi, replicate, shard)
    return intra, 2 * (replicate - 1) / replicate * 4 * psi


def hsdp_wire_bytes_no_regather(psi, replicate, shard):
    """Forgets the second all-gather, before backward."""
    _, inter = hsdp_wire_bytes(psi, replicate, shard)
    return 2 * (shard - 1) / shard * 4 * psi, inter


def min_gpus(psi, gpu_bytes):
    n = 1
    while n <= 2**20:
        if 16 * psi / n <= gpu_bytes:
            return n
        n *= 2
    return None


def min_gpus_strict(psi, gpu_bytes):
    """Demands strictly less than the budget."""
    n = 1
    while n <= 2**20:
        if 16 * psi / n < gpu_bytes:
            return n
        n *= 2
    return None


def min_gpus_exact_division(psi, gpu_bytes):
    """Returns ceil(16 psi / budget) instead of a power of two."""
    return max(1, -(-int(16 * psi) // int(gpu_bytes)))


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_fits": ("fits", fits, [fits_zero2_shards_params, fits_fp32]),
    "check_hsdp_wire_bytes": ("HSDP bytes per step", hsdp_wire_bytes,
                              [hsdp_wire_bytes_full_allreduce, hsdp_wire_bytes_no_regather]),
    "check_min_gpus": ("fewest GPUs", min_gpus, [min_gpus_strict, min_gpus_exact_division]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch09, SOLUTIONS)
