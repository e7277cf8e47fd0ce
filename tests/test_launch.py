"""The launcher turns every failure into a prompt Python error naming the rank."""

import time
from pathlib import Path

import pytest

from minifsdp.labs.report import last_exception
from minifsdp.launch import WorkerError, WorkerTimeout, split_stack_dump, torchrun

WORKER = str(Path(__file__).parent / "workers" / "faulty.py")


def test_results_come_back_per_rank():
    run = torchrun(WORKER, "--mode", "ok", nproc=3, chapter="tests", name="launch_ok")
    assert [r["rank"] for r in run.ranks] == [0, 1, 2]
    assert all(r["sum"] == [6.0, 6.0] for r in run.ranks)  # 1 + 2 + 3
    assert all(r["world_size"] == 3 for r in run.ranks)


def test_crashing_rank_raises_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        torchrun(WORKER, "--mode", "crash", nproc=2, chapter="tests", name="launch_crash",
                 timeout=120)
    assert time.monotonic() - t0 < 60, "a crash must not wait for the timeout"
    assert err.value.rank == 1
    assert "deliberate failure on rank 1" in str(err.value)
    assert "rank 1 failed" in str(err.value)


def test_rank_exiting_without_traceback_is_named():
    with pytest.raises(WorkerError) as err:
        torchrun(WORKER, "--mode", "exit", nproc=2, chapter="tests", name="launch_exit")
    assert err.value.rank == 1
    assert "exit" in str(err.value).lower()


def test_rank_killed_by_a_signal_names_it_and_shows_the_survivors_error():
    with pytest.raises(WorkerError) as err:
        torchrun(WORKER, "--mode", "kill", nproc=2, chapter="tests", name="launch_kill",
                 timeout=120)
    msg = str(err.value)
    assert err.value.rank == 1
    assert "rank 1 was killed by signal 9 (SIGKILL) and printed nothing" in msg
    assert "out-of-memory killer" in msg
    # What rank 0 shows is a race between gloo noticing the closed socket and torchrun's SIGTERM
    # (a loaded machine can deliver the SIGTERM first, e.g. while the excepthook prints): either
    # rank 0's own error or where it was stopped, never nothing and never a frameless dump.
    if "rank 0 then failed with" in msg:
        assert "Connection closed by peer" in msg.split("rank 0 then failed with")[1]
    else:
        assert "rank 0 was stopped here" in msg
        assert "File " in msg.split("rank 0 was stopped here")[1]
    assert "Garbage-collecting" not in msg


def test_faulthandlers_dump_is_split_from_what_the_rank_printed():
    own = ("[rank1]: terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
           "[rank1]:   what():  Received data size doesn't match expected size\n")
    fatal = ("[rank1]: Fatal Python error: Aborted\n[rank1]: \n"
             "[rank1]: Current thread 0x00007f3a (most recent call first):\n"
             '[rank1]:   File "lab02.py", line 7 in on_grad_ready\n')
    stopped = 'Thread 0x00007f3b (most recent call first):\n  File "x.py", line 3 in wait\n'
    assert split_stack_dump(own + fatal) == (own, fatal)
    assert split_stack_dump("waiting\n" + stopped) == ("waiting\n", stopped)
    assert split_stack_dump(own) == (own, "")
    # the lab report (prefixes stripped): the abort's message, not faulthandler's last frame
    text = (own + fatal).replace("[rank1]: ", "")
    assert last_exception(text).strip() == "what():  Received data size doesn't match expected size"


def test_rank_crashing_in_native_code_names_the_signal_and_the_python_frame():
    with pytest.raises(WorkerError) as err:
        torchrun(WORKER, "--mode", "segv", nproc=2, chapter="tests", name="launch_segv",
                 timeout=120)
    msg = str(err.value)
    assert err.value.rank == 1
    assert "rank 1 was killed by signal 11 (SIGSEGV)" in msg
    assert "Fatal Python error: Segmentation fault" in msg and "faulty.py" in msg  # the frame


def test_hung_rank_fails_within_the_collective_timeout():
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        torchrun(WORKER, "--mode", "hang", nproc=2, chapter="tests", name="launch_hang",
                 pg_timeout=3, timeout=120)
    assert time.monotonic() - t0 < 60
    msg = str(err.value)
    assert err.value.rank == 0 and "Timed out" in msg
    assert "rank 1 was stopped here" in msg and "faulty.py" in msg  # where the hung rank was


def test_job_timeout_kills_everything_and_shows_stacks():
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout) as err:
        # The collective timeout (120 s) is longer than the job's: the launcher must act. The
        # job gets 45 s because a rank killed before it installed its stack dumper has nothing
        # to show, and importing torch alone took >12 s on a loaded 2-core CI machine and 25 s
        # with four other test runs beside it.
        torchrun(WORKER, "--mode", "hang", nproc=2, chapter="tests", name="launch_timeout",
                 pg_timeout=120, timeout=45)
    assert time.monotonic() - t0 < 100
    assert "did not finish within 45 s" in str(err.value)
    assert "faulty.py" in str(err.value)  # the stacks dumped on SIGUSR1


def test_wrong_world_size_is_a_clear_error():
    with pytest.raises(WorkerError) as err:
        torchrun(WORKER, "--mode", "ok", nproc=2, chapter="tests", name="launch_ws",
                 env={"MINIFSDP_EXPECT_WORLD_SIZE": "4"})
    assert "expects world size 4 but torchrun started 2" in str(err.value)
