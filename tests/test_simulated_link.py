"""The simulated link (``minifsdp/simulated_link.py``, Note [simulated link]): bookings in issue
order on one serial link, values exactly those of the real collective, and no ``wait()``
released before its simulated transfer time. Only lower bounds on time are asserted: a
loaded machine may make anything later, never earlier.

In-process tests use a world of one (``one_rank`` in conftest.py, whose wire bytes are 0, so
a latency gives the transfer time); one launch of ``python -m minifsdp.simulated_link`` at N = 2
checks chapter 06's job (bits against the unsimulated run, every transfer's lower bound).
"""

import time

import pytest
import torch

from minifsdp import comm
from minifsdp.launch import torchrun
from minifsdp.simulated_link import SimulatedLink, simulated_link


def test_link_books_transfers_one_after_another():
    link = SimulatedLink(bandwidth=1e6, latency=0.01)  # 1 MB/s: 1000 bytes take 1 ms
    assert link.transfer_time(1000) == pytest.approx(0.011)
    t = time.perf_counter()
    first, second = link.book(1000), link.book(3000)
    assert first >= t + 0.011
    assert second == pytest.approx(first + 0.013)  # queued behind the first, not beside it
    assert link.busy == pytest.approx(0.024)
    with pytest.raises(ValueError, match="bandwidth"):
        SimulatedLink(0)


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
    return torchrun("minifsdp.simulated_link", "--bandwidth", 2e8, "--rounds", 2, nproc=2,
                    chapter="tests", name="simulated_link", timeout=300,
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
