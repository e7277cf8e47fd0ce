"""A run in a sweep is the run alone (Note [a sweep of runs] in minifsdp/sweep.py).

The oracle is the same ``minifsdp.train`` command launched as a torchrun job of its own. At
N = 2 the losses, the full parameters, the comm log (all but its times) and each tracked step's
maximum of parameters, gradients, optimizer state and activations must be equal (gloo's thread
frees its copies at moments that differ between two runs of the same job, so the timelines
themselves are no oracle at N = 2); at world size 1 the whole memory JSON must be.
"""

from __future__ import annotations

import json
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from minifsdp import sweep
from minifsdp.launch import WorkerError, torchrun
from minifsdp.sweep import submit_all, torchrun_sweep

GPT = ("--model", "gpt", "--n-layer", 2, "--d-model", 32, "--n-head", 4, "--seq-len", 32,
       "--optimizer", "adamw", "--steps", 3, "--global-batch", 8, "--save-params",
       "--track-memory", 2)
CNN = ("--model", "cnn", "--steps", 2, "--global-batch", 16, "--track-memory", 2)
OPTIONS = {"chapter": "tests", "env": {"MINIFSDP_BACKEND": "gloo"}, "timeout": 300}


@pytest.fixture(scope="module")
def launched():
    """The four launches, two at a time: each run alone, and a sweep holding it second."""
    with ThreadPoolExecutor(2) as pool:
        jobs = {
            "alone2": pool.submit(torchrun, "minifsdp.train", "--strategy", "fsdp2", *GPT,
                                  nproc=2, name="sweep_alone_fsdp2", **OPTIONS),
            "sweep2": pool.submit(torchrun_sweep, {
                "sweep_zero2_first": ("--strategy", "zero2", *GPT, "--seed", 1),
                "sweep_fsdp2_second": ("--strategy", "fsdp2", *GPT)}, nproc=2, **OPTIONS),
            "alone1": pool.submit(torchrun, "minifsdp.train", "--strategy", "single", *CNN,
                                  nproc=1, name="sweep_alone_single", **OPTIONS),
            "sweep1": pool.submit(torchrun_sweep, {
                "sweep_fsdp2_first": ("--strategy", "fsdp2", *GPT),
                "sweep_single_second": ("--strategy", "single", *CNN)}, nproc=1, **OPTIONS),
        }
        return {k: f.result() for k, f in jobs.items()}


def _untimed(comm: list[dict]) -> list[dict]:
    return [{k: v for k, v in c.items() if not k.startswith("t_")} for c in comm]


def test_a_run_at_n2_is_the_same_in_a_sweep_as_alone(launched):
    alone, inside = launched["alone2"], launched["sweep2"]["sweep_fsdp2_second"]
    assert inside.name == "sweep_fsdp2_second" and inside.out_dir.name == inside.name
    for r in range(2):
        a, b = alone.ranks[r], inside.ranks[r]
        assert a["losses"] == b["losses"], r
        assert _untimed(a["comm"]) == _untimed(b["comm"]), r
        for step, (ma, mb) in enumerate(zip(a["memory"], b["memory"], strict=True)):
            for cat in ("params", "grads", "optimizer", "activations"):
                # each category's own maximum: the main thread's, whenever gloo's thread frees
                # (the breakdown at the total's peak would move with it)
                top = [max(s[cat] for s in m["timeline"]) for m in (ma, mb)]
                assert top[0] == top[1], (r, step, cat, top)
    pa, pb = (torch.load(run.out_dir / "params.pt", weights_only=True) for run in (alone, inside))
    assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
    # the first run is a different one (ZeRO-2, another seed): the sweep really held two runs
    first = launched["sweep2"]["sweep_zero2_first"].ranks[0]
    assert first["strategy"] == "zero2" and first["losses"] != inside.ranks[0]["losses"]


def test_a_run_at_n1_is_the_same_in_a_sweep_as_alone_memory_included(launched):
    a, b = launched["alone1"].ranks[0], launched["sweep1"]["sweep_single_second"].ranks[0]
    assert a["losses"] == b["losses"]
    assert a["memory"] == b["memory"]  # every sample of both tracked steps
    assert _untimed(a["comm"]) == _untimed(b["comm"])


def test_each_run_gets_the_output_it_printed(launched):
    runs = launched["sweep2"]
    for name, run in runs.items():
        steps = [json.loads(line.split(" ", 1)[1])["step"] for line in run.stdout[0].splitlines()
                 if line.startswith("@minifsdp-progress {")]
        assert steps == [1, 2, 3], (name, run.stdout[0])
        assert sweep.RUN_TAG not in run.stdout[0]


def test_a_failing_run_is_run_alone_and_its_own_error_named(tmp_path):
    """The sweep fails at its second run of three. The first had finished: its result
    stands. The second and third run alone: the bad one's own error and the third's result
    come back, each with a warning that says why it ran twice."""
    missing = tmp_path / "no_such_checkpoint"
    one = ("--strategy", "single", "--steps", 1, "--global-batch", 8)
    jobs = {"sweep_before": ("minifsdp.train", 1, one),
            "sweep_bad": ("minifsdp.train", 1, (*one, "--resume", missing)),
            "sweep_after": ("minifsdp.train", 1, (*one, "--seed", 1))}
    with ThreadPoolExecutor(2) as pool, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        futures = submit_all(pool, jobs, **OPTIONS)
        before = futures["sweep_before"].result()
        assert not seen  # from the sweep, no second launch
        after = futures["sweep_after"].result()
        with pytest.raises(WorkerError) as err:
            futures["sweep_bad"].result()
    for run in (before, after):
        assert run.ranks[0]["finished"] and len(run.ranks[0]["losses"]) == 1
    assert before.ranks[0]["losses"] != after.ranks[0]["losses"]  # another seed: its own run
    assert str(err.value).startswith("sweep_bad:"), str(err.value)[:300]
    assert str(missing) in str(err.value)
    warned = sorted(str(w.message).split(":")[0] for w in seen)
    assert warned == ["sweep_after", "sweep_bad"], warned


# ---- without a launch ---------------------------------------------------------------------------

def test_submit_all_groups_train_jobs_by_world_size(monkeypatch):
    calls = []
    monkeypatch.setattr(sweep, "torchrun_sweep",
                        lambda runs, nproc, **o: calls.append(("sweep", nproc, list(runs))) or
                        {k: k for k in runs})
    monkeypatch.setattr(sweep, "torchrun",
                        lambda target, *a, nproc, name, **o: calls.append(("alone", nproc, name))
                        or name)
    jobs = {"a": ("minifsdp.train", 2, ()), "b": ("other.worker", 2, ()),
            "c": ("minifsdp.train", 2, ("--steps", 1)), "d": ("minifsdp.train", 1, ()),
            "e": ("minifsdp.train", 2, ("--kill-at-step", 1))}
    with ThreadPoolExecutor(1) as pool:
        futures = submit_all(pool, jobs)
        assert list(futures) == list(jobs)
        assert {k: f.result() for k, f in futures.items()} == {k: k for k in jobs}
    assert sorted(calls) == [("alone", 1, "d"), ("alone", 2, "b"), ("alone", 2, "e"),
                             ("sweep", 2, ["a", "c"])]


def test_a_plan_that_kills_its_ranks_or_is_malformed_is_refused(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([{"name": "k", "out": "x", "argv": ["--kill-at-step", "2"]}]))
    with pytest.raises(SystemExit, match="run 'k' uses --kill-at-step"):
        sweep.main([str(plan)])
    plan.write_text(json.dumps([{"name": "k", "argv": []}]))
    with pytest.raises(SystemExit, match="entry 0 is not"):
        sweep.main([str(plan)])
    with pytest.raises(SystemExit, match="cannot read the plan"):
        sweep.main([str(tmp_path / "absent.json")])


def test_output_is_cut_at_each_run():
    text = f"{sweep.RUN_TAG}one\nA\nB\n{sweep.RUN_TAG}two\nC\n"
    assert sweep._split_runs(text) == {"one": "A\nB\n", "two": "C\n"}
    assert sweep._split_runs("early\n") == {None: "early\n"}
