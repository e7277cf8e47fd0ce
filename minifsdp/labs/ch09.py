"""Chapter 09 (capstone): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

from minifsdp.notebook import check


def fits(psi: float, n: int, strategy: str, gpu_bytes: float) -> bool:
    """Do mixed-precision Adam's model states (the ZeRO table, 2 + 2 + 12 bytes per parameter)
    fit on each of ``n`` GPUs (``minifsdp.analytic.model_state_bytes``)?"""
    from minifsdp.analytic import model_state_bytes

    return model_state_bytes(psi, n, strategy)["total"] <= gpu_bytes


def check_fits(fn) -> bool:
    """``fn(psi, n, strategy, gpu_bytes)`` -> bool, strategy in ddp / zero1 / zero2 / fsdp."""
    cases = [((psi, n, s, g), fits(psi, n, s, g))
             for psi in (7.5e9, 70e9, 405e9) for n in (1, 8, 64, 1024)
             for s in ("ddp", "zero1", "zero2", "fsdp") for g in (40e9, 80e9)]
    return check("fits", cases, fn)


def hsdp_wire_bytes(psi: float, replicate: int, shard: int) -> tuple[float, float]:
    """``(intra_node, inter_node)`` bytes one rank sends per fp32 step for one unit of
    ``psi`` parameters under HSDP: all-gather (x2) and reduce-scatter among ``shard`` ranks, an
    all-reduce of the 1/shard slice among ``replicate`` ranks."""
    full = 4 * psi
    return (3 * (shard - 1) / shard * full, 2 * (replicate - 1) / replicate * full / shard)


def check_hsdp_wire_bytes(fn) -> bool:
    """``fn(psi, replicate, shard)`` -> ``(intra_node, inter_node)`` wire bytes per step."""
    cases = [((psi, r, s), hsdp_wire_bytes(psi, r, s))
             for psi in (1e6, 3_429_888) for r, s in ((1, 8), (2, 2), (8, 1), (4, 8), (16, 8))]
    close = lambda a, b: all(abs(x - y) <= 1e-9 * max(1.0, y) for x, y in zip(a, b))
    return check("HSDP bytes per step", cases, fn, close=close)


def min_gpus(psi: float, gpu_bytes: float) -> int | None:
    """The smallest power of two N <= 2**20 with FSDP's 16 psi / N <= ``gpu_bytes``."""
    n = 1
    while n <= 2**20:
        if 16 * psi / n <= gpu_bytes:
            return n
        n *= 2
    return None


def check_min_gpus(fn) -> bool:
    """``fn(psi, gpu_bytes)`` -> the fewest GPUs (a power of two) for FSDP's model states."""
    cases = [((psi, g), min_gpus(psi, g)) for psi in (1e6, 5e9, 10e9, 7e9, 70e9, 405e9, 1e15)
             for g in (16e9, 80e9, 192e9)]
    return check("fewest GPUs", cases, fn)
