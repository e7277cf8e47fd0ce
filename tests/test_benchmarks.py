"""The benchmarks' harness (benchmarks/harness.py), without launching anything."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "harness", Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def test_each_round_runs_every_strategy_once_and_the_order_rotates():
    names = ["ours", "torch", "ours_bf16"]
    orders = [harness.rotated(names, r) for r in range(6)]
    assert all(sorted(o) == sorted(names) for o in orders)
    # over len(names) rounds each strategy runs first once; then the cycle repeats
    assert sorted(o[0] for o in orders[:3]) == sorted(names)
    assert orders[3:] == orders[:3]
