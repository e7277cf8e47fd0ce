"""The simulated link (``minifsdp/simulated_link.py``, Note [simulated link]): bookings in issue
order on one serial link, values exactly those of the real collective, and no ``wait()``
released before its simulated transfer time; the split of a wait into the link's share and the
rest (Note [link's share of the wait]). Only lower bounds on time are asserted: a loaded
machine may make anything later, never earlier.

In-process tests use a world of one (``one_rank`` in conftest.py, whose wire bytes are 0, so
a latency gives the transfer time); one launch of ``python -m minifsdp.simulated_link`` at N = 2
checks chapter 06's job (bits against the unsimulated run, every transfer's lower bound, the
bookings against the comm log, and which blocks compute while an all-gather is in flight).
"""

import time

import pytest
import torch

from minifsdp import comm
from minifsdp.launch import torchrun
from minifsdp.simulated_link import SimulatedLink, simulated_link, split_wait


def test_link_books_transfers_one_after_another():
    link = SimulatedLink(bandwidth=1e6, latency=0.01)  # 1 MB/s: 1000 bytes take 1 ms
    assert link.transfer_time(1000) == pytest.approx(0.011)
    t = time.perf_counter()
    first, second = link.book(1000), link.book(3000)
    assert first.start >= first.issued >= t
    assert first.end == pytest.approx(first.start + 0.011)
    assert second.start == first.end  # queued behind the first, not beside it
    assert second.end == pytest.approx(first.end + 0.013)
    assert link.transfers == [first, second]
    assert (first.wire_bytes, second.wire_bytes) == (1000, 3000)
    assert link.busy == pytest.approx(0.024)
    with pytest.raises(ValueError, match="bandwidth"):
        SimulatedLink(0)


def _rec(op, t_start, t_wait, t_end, wire=100.0):
    return {"kind": "comm", "op": op, "tag": f"fsdp2 {op}", "wire_bytes": wire,
            "t_start": t_start, "t_wait": t_wait, "t_end": t_end}


def test_split_wait_separates_the_links_share_from_the_rest():
    records = [
        {"kind": "compute", "op": "forward", "t_start": 0.0, "t_end": 9.0},  # not a collective
        _rec("all_gather", 0.0, 0.0, 2.5),  # waited from its issue; the link ends at 2: 2 + 0.5
        _rec("all_gather", 2.5, 4.0, 4.0),  # the link ended at 3.5, waited at 4: nothing
        _rec("reduce_scatter", 4.0, 4.0, 5.0),  # blocking, queued to 4.5 on the link: 0.5 + 0.5
        _rec("all_gather", 5.0, 6.0, 7.0),  # waited at 6, while the link carries it to 6.5
    ]
    transfers = [{"end": e, "wire_bytes": 100.0} for e in (2.0, 3.5, 4.5, 6.5)]
    on_link, rest = split_wait(records, transfers)
    assert on_link == pytest.approx(2.0 + 0.5 + 0.5)
    assert rest == pytest.approx(0.5 + 0.5 + 0.5)
    assert on_link + rest == pytest.approx(comm.exposed_seconds(records))
    with pytest.raises(ValueError, match="not the same step"):
        split_wait(records, transfers[:3])
    with pytest.raises(ValueError, match="wire bytes"):
        split_wait(records, [*transfers[:3], {"end": 6.5, "wire_bytes": 7.0}])


def test_values_are_the_real_collective_and_waits_are_held(one_rank):
    x = torch.randn(1000)
    expected = torch.empty(1000)
    comm.all_gather_into_tensor(expected, x)  # the unsimulated call
    latency = 0.05
    real = comm._all_gather_single, comm._reduce_scatter_single
    with simulated_link(bandwidth=1e9, latency=latency) as link, comm.logging_comm() as log:
        outs = [torch.empty(1000) for _ in range(3)]
        t = time.perf_counter()
        works = [comm.all_gather_into_tensor(o, x, async_op=True, tag=f"ag {i}")
                 for i, o in enumerate(outs)]
        works[0].wait()
        assert time.perf_counter() >= t + latency  # never released before its time
        works[2].wait()
        assert time.perf_counter() >= t + 3 * latency  # serial: behind the other two
        assert works[1].is_completed()  # released in issue order
        works[1].wait()
        rs_out = torch.empty(1000)
        t_rs = time.perf_counter()
        comm.reduce_scatter_tensor(rs_out, x)  # blocking: returns once transferred
        assert time.perf_counter() >= t_rs + latency
    assert link.busy == pytest.approx(4 * latency)
    assert len(link.transfers) == 4  # one booking per collective, in issue order
    for booked in link.transfers:  # gloo's own end is stamped; each takes its time on the link
        assert booked.gloo_done is not None and booked.gloo_done >= booked.issued
        assert booked.end == pytest.approx(booked.start + latency)
    for o in outs:
        assert torch.equal(o, expected)
    assert torch.equal(rs_out, x)  # a world of one: the sum of one
    recs = log.comms()
    assert [r.tag for r in recs[:3]] == ["ag 0", "ag 1", "ag 2"]
    for k, r in enumerate(recs[:3]):  # comm's t_done is the simulated end, in order
        assert r.t_done >= r.t_start + latency - 1e-9
        assert r.t_done >= (t - log.t0) + (k + 1) * latency - 1e-9
    assert (comm._all_gather_single, comm._reduce_scatter_single) == real  # restored


@pytest.fixture(scope="module")
def chapter_job():
    return torchrun("minifsdp.simulated_link", "--bandwidth", 2e8, "--rounds", 2, "--batch", 8,
                    nproc=2, chapter="tests", name="simulated_link", timeout=300,
                    env={"MINIFSDP_BACKEND": "gloo"}, progress=False)


def test_chapter_job_keeps_every_bit_and_every_transfer_takes_its_time(chapter_job):
    for r in chapter_job.ranks:
        configs = r["configs"]
        ref = configs["no prefetch, no link"]["losses"]
        for name, c in configs.items():
            assert c["bitwise_vs_no_link"], name
            assert c["losses"] == ref, name
        bw, lat = r["bandwidth"], r["latency"]
        for name, c in configs.items():
            if name.endswith("no link"):
                continue
            comms = [x for x in c["comm"] if x["kind"] == "comm"]
            assert {x["op"] for x in comms} == {"all_gather", "reduce_scatter"}
            for x in comms:  # lower bounds only: a loaded machine can only be later
                assert x["t_done"] - x["t_start"] >= lat + x["wire_bytes"] / bw - 1e-6, (name, x)
            # one serial link: transfer x ends no earlier than any earlier transfer j's issue
            # plus the time of j..x back to back
            for i, x in enumerate(comms):
                for j in range(i + 1):
                    t = sum(lat + c["wire_bytes"] / bw for c in comms[j:i + 1])
                    assert x["t_done"] >= comms[j]["t_start"] + t - 1e-6, (name, i, j)
        none = configs["no prefetch"]
        blocks = {(n, ph) for n, ph, *_ in none["blocks"]}
        assert blocks == {(f"blocks.{i}", ph) for i in range(4) for ph in ("forward", "backward")}


def _link_comms(c):
    return [x for x in c["comm"] if x["kind"] == "comm"]


def test_chapter_job_books_what_the_log_records_and_splits_every_wait(chapter_job):
    """Structure only: the bookings are the log's collectives (same order, same wire bytes),
    every wait is split without loss, and every configuration moves the same bytes."""
    for r in chapter_job.ranks:
        configs = {k: c for k, c in r["configs"].items() if not k.endswith("no link")}
        what = lambda comms: sorted((x["op"], x["tag"], x["wire_bytes"]) for x in comms)
        same = what(_link_comms(configs["no prefetch"]))
        for name, c in configs.items():
            comms, link = _link_comms(c), c["link"]
            assert [x["wire_bytes"] for x in comms] == [x["wire_bytes"] for x in link], name
            assert what(comms) == same, name
            for x, b in zip(comms, link):
                assert b["issued"] <= b["start"] < b["end"], (name, x["tag"])
                assert b["gloo_done"] is not None, (name, x["tag"])
                assert b["gloo_done"] >= b["issued"], (name, x["tag"])
            assert len(c["wait_link_s"]) == len(c["wait_rest_s"]) == r["rounds"]
            for on, rest, exposed in zip(c["wait_link_s"], c["wait_rest_s"], c["exposed_s"]):
                assert on >= 0 and rest >= 0
                assert on + rest == pytest.approx(exposed, abs=1e-9), name


PREFETCHED = {"no prefetch": set(), "implicit backward (default)": {"b3", "b2", "b1"},
              "implicit forward + backward": {"f0", "f1", "f2", "b3", "b2", "b1"},
              "explicit, one ahead": {"f0", "f1", "f2", "b3", "b2", "b1"}}


def test_chapter_job_prefetches_under_exactly_the_blocks_the_schedule_names(chapter_job):
    """Which blocks compute while an all-gather is in flight (issued before the block's compute
    began, waited for after it ended): fixed by the order of the hooks, not by timing. Without
    prefetch no block computes while the link carries anything (each wait returns after its
    transfer's end, and the next block starts after the wait)."""
    for r in chapter_job.ranks:
        for name, expected in PREFETCHED.items():
            c = r["configs"][name]
            ags = [x for x in _link_comms(c) if x["op"] == "all_gather"]
            in_flight = {f"{ph[0]}{n.split('.')[-1]}" for n, ph, a, b in c["blocks"]
                         if any(x["t_start"] < a and x["t_wait"] > b for x in ags)}
            assert in_flight == expected, name
        none = r["configs"]["no prefetch"]
        for n, ph, a, b in none["blocks"]:
            for x in none["link"]:
                assert x["end"] <= a or x["start"] >= b, (n, ph, x)
