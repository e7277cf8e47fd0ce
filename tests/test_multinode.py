"""``torchrun_multinode``: two torchrun launchers on this machine, as two nodes would run them.

Two launchers x 1 process train FSDP2 exactly as one ``--standalone`` launcher x 2 processes
(the workers cannot tell the difference: same RANK, WORLD_SIZE, same collectives); a crashing
worker on one node and two nodes that never meet at the rendezvous each fail with a clear
error in bounded time. Four jobs, two at a time (~40 s on an idle 2-core machine).
"""

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from minifsdp import parity
from minifsdp.launch import WorkerError, torchrun, torchrun_multinode

GLOO = {"MINIFSDP_BACKEND": "gloo"}
FAULTY = str(Path(__file__).parent / "workers" / "faulty.py")
TRAIN = ("--strategy", "fsdp2", "--model", "gpt", "--n-layer", 2, "--d-model", 32,
         "--n-head", 4, "--seq-len", 16, "--vocab-size", 64, "--steps", 3,
         "--global-batch", 8, "--save-params")
JOIN_TIMEOUT, GRACE = 10, 10


def _timed(fn, *args, **kwargs):
    """``(result or the WorkerError raised, seconds)``."""
    t0 = time.monotonic()
    try:
        out = fn(*args, **kwargs)
    except WorkerError as e:
        out = e
    return out, time.monotonic() - t0


JOBS = {
    "two_nodes": lambda: _timed(torchrun_multinode, "minifsdp.train", *TRAIN, nnodes=2,
                                nproc_per_node=1, chapter="tests", name="multinode_fsdp2",
                                env=GLOO, timeout=180),
    "standalone": lambda: _timed(torchrun, "minifsdp.train", *TRAIN, nproc=2,
                                 chapter="tests", name="multinode_standalone", env=GLOO,
                                 timeout=180),
    "crash": lambda: _timed(torchrun_multinode, FAULTY, "--mode", "crash", chapter="tests",
                            name="multinode_crash", env=GLOO, timeout=180, grace=GRACE),
    # Node 1 is told another rendezvous endpoint: on this host it serves its own store
    # there, so each launcher waits for a partner that never comes.
    "apart": lambda: _timed(torchrun_multinode, FAULTY, "--mode", "ok", chapter="tests",
                            name="multinode_apart", env=GLOO, timeout=180, grace=GRACE,
                            join_timeout=JOIN_TIMEOUT,
                            node_options=[(), ("--rdzv-endpoint", "localhost:9")]),
}


@pytest.fixture(scope="module")
def jobs() -> dict[str, Future]:
    with ThreadPoolExecutor(2) as pool:
        futures = {k: pool.submit(fn) for k, fn in JOBS.items()}
        yield futures
        pool.shutdown(cancel_futures=True)


def test_two_nodes_train_as_one_standalone_job(jobs):
    (multi, _), (single, _) = jobs["two_nodes"].result(), jobs["standalone"].result()
    assert not isinstance(multi, Exception), multi
    assert [r["rank"] for r in multi.ranks] == [0, 1]
    assert all(r["world_size"] == 2 for r in multi.ranks)
    for r in range(2):
        parity.assert_bitwise(multi.ranks[r]["losses"], single.ranks[r]["losses"],
                              names=("two nodes", "standalone"), where=f"rank {r}")
        assert [c["wire_bytes"] for c in multi.ranks[r]["comm"]] == \
            [c["wire_bytes"] for c in single.ranks[r]["comm"]]
    a, b = (torch.load(x.out_dir / "params.pt") for x in (multi, single))
    parity.assert_bitwise(a, b, names=("two nodes", "standalone"))  # names, then bits
    # Every rank's log found under its *global* rank (c10d numbered the nodes): only rank 0
    # reports progress.
    assert sorted(multi.stdout) == [0, 1]
    assert "progress" in multi.stdout[0] and "progress" not in multi.stdout[1]


def test_crashing_worker_on_one_node_is_reported(jobs):
    err, seconds = jobs["crash"].result()
    assert isinstance(err, WorkerError) and err.rank == 1
    assert "deliberate failure on rank 1" in str(err) and "rank 1 failed" in str(err)
    assert seconds < 90, "a crash must not wait for the job's timeout"


def test_nodes_that_never_meet_fail_within_the_join_timeout(jobs):
    err, seconds = jobs["apart"].result()
    assert isinstance(err, WorkerError) and err.rank is None
    assert "RendezvousTimeoutError" in str(err) and "--rdzv-endpoint" in str(err)
    assert seconds < JOIN_TIMEOUT + GRACE + 60  # start-up on a loaded machine, then the wait
