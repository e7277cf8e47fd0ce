"""Ring all-reduce == dist.all_reduce, measured bytes == theory, and the comm log's records.

One torchrun launch per world size runs every check (tests/workers/comm_worker.py); the
tests below assert on the values each rank reported.
"""

import math
from pathlib import Path

import pytest
import torch

from minifsdp.launch import torchrun
from minifsdp.parity import assert_bitwise, max_abs_diff, worst_divergence

WORKER = str(Path(__file__).parent / "workers" / "comm_worker.py")


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N{n}")
def ranks(request):
    n = request.param
    return torchrun(WORKER, nproc=n, chapter="tests", name=f"comm_{n}", timeout=120).ranks


def test_ring_all_reduce_is_exact_on_integer_values(ranks):
    n = len(ranks)
    for r in ranks:
        assert len(r["exact"]) == 15
        for case, res in r["exact"].items():
            assert res["vs_torch"] is None, res["vs_torch"]
            # rank q holds arange * (q + 1): the sum is arange * N(N+1)/2, whatever the shape
            flat = [v for row in res["ring"] for v in (row if isinstance(row, list) else [row])]
            expected = [i * n * (n + 1) // 2 for i in range(len(flat))]
            if case.startswith("5x3_t"):  # the transposed view reads the (5, 3) data by column
                expected = [i * n * (n + 1) // 2 for i in
                            (c * 3 + rr for rr in range(3) for c in range(5))]
            assert flat == expected, (r["rank"], case)


def ring_and_ref(res: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A case's fp32 values, ours and torch's (JSON holds an fp32 value exactly)."""
    return torch.tensor(res["ring"]), torch.tensor(res["ref"])


def assert_below(res: dict, bound: float, where: str) -> None:
    """max |ring - torch| < bound, else fail with the worst element's line (Note [parity])."""
    ring, ref = ring_and_ref(res)
    kw = dict(names=("ring", "torch"), where=where)
    assert max_abs_diff(ring, ref) < bound, str(
        worst_divergence(ring, ref, atol=bound, **kw) or worst_divergence(ring, ref, **kw))


def test_ring_all_reduce_random_fp32_matches(ranks):
    for r in ranks:
        for numel, res in r["random"].items():
            assert_below(res, 5e-6, f"rank {r['rank']}, numel {numel}")  # a few ulps of ~N
            assert res["ranks_differ"] is None, res["ranks_differ"]


def test_other_ops_and_both_phases(ranks):
    for r in ranks:
        for op in ("MAX", "MIN"):
            assert_bitwise(*ring_and_ref(r["ops"][op]), names=("ring", "torch"),
                           where=f"rank {r['rank']}, {op}")
        assert_below(r["ops"]["AVG"], 1e-6, f"rank {r['rank']}, AVG")
        assert list(r["phases"]) == ["reduce_scatter", "input_untouched", "all_gather"]
        for line in r["phases"].values():
            assert line is None, line


def test_measured_ring_bytes_equal_theory(ranks):
    n = len(ranks)
    for r in ranks:
        w = r["wire"]["12000"]  # N divides 12000: exactly 2(N-1)/N * S
        assert w["sent"] == 2 * (n - 1) / n * 12000 * 4
        assert w["sends"] == 2 * (n - 1)
        assert w["received"] == w["sent"]
        assert w["tags"] == sorted([f"ring reduce-scatter step {k}" for k in range(n - 1)]
                                   + [f"ring all-gather step {k}" for k in range(n - 1)])
        w = r["wire"]["1001"]  # padded to N * ceil(1001 / N) elements
        assert w["sent"] == 2 * (n - 1) * math.ceil(1001 / n) * 4
        assert 0 <= w["sent"] - 2 * (n - 1) / n * 1001 * 4 < 2 * n * 4


def test_ring_on_a_subgroup(ranks):
    n = len(ranks)
    evens = range(0, n, 2)
    for r in ranks:
        if r["rank"] in evens:
            assert r["subgroup"] == [float(sum(evens))] * 5
        else:
            assert "subgroup" not in r


def test_logged_collectives_record_ring_formulas(ranks):
    n = len(ranks)
    s = 4000 * n  # bytes of the full tensor: 1000 * N fp32
    for r in ranks:
        log = r["log"]
        assert [tuple(x) for x in log["ops"][:5]] == [
            ("comm", "all_reduce", s, 2 * (n - 1) / n * s, n, "bucket 0"),
            ("comm", "reduce_scatter", s, (n - 1) / n * s, n, None),
            ("comm", "all_gather", s // n, (n - 1) / n * s, n, None),
            ("comm", "broadcast", s, s, n, None),
            ("comm", "all_to_all", s, (n - 1) / n * s, n, None),
        ]
        assert log["inner_ops"] == ["all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                    "all_to_all"]
        assert [x[:2] for x in log["ops"][5:]] == [["compute", "compute"], ["comm", "all_reduce"]]
        assert log["json_keys"] == sorted(["kind", "op", "bytes", "wire_bytes", "group_size",
                                           "dtype", "shape", "t_start", "t_end", "tag",
                                           "t_done", "t_wait"])
        assert log["span"][1] - log["span"][0] >= 0.05
        assert log["process_log_has_them"]


def test_async_end_time_is_stamped_at_wait(ranks):
    for r in ranks:
        log = r["log"]
        assert log["async_end_before_wait"] is None
        assert log["async_t_end"] >= log["async_t_wait"]  # recorded after wait() returned


def test_async_completion_is_stamped_before_the_wait(ranks):
    # Note [async completion]: a 40-byte all-reduce is done long before the 0.2 s sleep ends
    for r in ranks:
        log = r["log"]
        assert log["async_t_start"] <= log["async_t_done"] < log["async_t_wait"]
        assert log["sync_done_is_end"]


def test_exposed_time_counts_only_the_blocked_part(ranks):
    # Note [exposed communication]: the async all-reduce was done during the 0.2 s sleep, so
    # its wait() blocks for (almost) nothing, while a blocking call is exposed all along.
    for r in ranks:
        log = r["log"]
        assert abs(log["async_rec_t_wait"] - log["async_t_wait"]) < 0.01
        assert 0 <= log["async_exposed"] < 0.05
        assert log["sync_exposed_is_duration"]
        assert log["exposed_total"] == pytest.approx(log["exposed_inner_plus_async"])
