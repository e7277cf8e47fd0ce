"""``NaiveDDP`` and ``BucketedDDP`` (minifsdp/ddp.py) under real torchrun launches.

``minifsdp.train --strategy ddp | bucketed_ddp`` trains exactly what one process (``--strategy
single --data-shards N``, Note [bitwise parity] in minifsdp/train.py) and torch DDP train, at
world sizes 1 to 4; the comm log shows buckets issued while backward still runs; and
tests/workers/ddp_worker.py checks ``no_sync`` accumulation and unused parameters against torch
DDP in one process group.

Exactness. At N = 1 and N = 2 everything is bit for bit: 1/N is a power of two and a sum of two
numbers does not depend on the order (Note [divide first] in minifsdp/ddp.py). At N = 3 and 4
the sum of N gradients depends on the order of the additions, and gloo's ring adds each element's
N terms in an order that depends on where the element sits in the flattened buffer (measured:
all-reducing a tensor and a slice of it differs in the last bit). Our buckets, torch's (1 MiB
first bucket, rebuilt after step 1 in the order gradients arrived) and the single process's
sequential accumulation all lay gradients out differently, so results agree to rounding only:
losses to ``LOSS_ATOL`` = 1e-5, parameters to ``ATOL`` = 2e-4 (a fifth of one Adam step,
lr 1e-3: a real bug -- a stale bucket, a gradient from the wrong step -- is off by ~lr).
Where the shards' gradients nearly cancel, a last-bit difference in their sum is a large
*relative* difference, and Adam, which divides by the gradient's own magnitude, carries it
into the update. torch DDP differs from the single process by as much (asserted below), so the
tolerance measures the arithmetic, not our code. Measured max parameter differences (3 steps,
vs single / vs torch DDP): CNN N=3 6.1e-6 / 1.2e-7, N=4 5.9e-6 / 7.3e-6; GPT N=3 1.8e-5 /
2.4e-7, N=4 3.0e-7 / 2.9e-7. Losses: at most 4.8e-7 apart. The bounds are 10x and 20x the
largest of these: another CPU's kernels add in other orders (Note [what a notebook prints]).

Cost: 18 launches of 5-10 s, each declared by the tests that read it (tests/jobs.py) and started
``PARALLEL`` at a time by the module fixture ``launched`` (as in tests/test_train.py): ~210
CPU-seconds, ~105 s on an idle 2-core machine.
"""

import functools
import os
from pathlib import Path

import pytest
import torch
from jobs import Job, fixture_of
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

from minifsdp import parity
from minifsdp.ddp import FINAL_SPAN
from minifsdp.launch import RunResult

PARALLEL = 3  # launches at once (a sweep of train runs is one launch)
LAUNCH_OPTIONS = {"pg_timeout": 60}
WORKER = str(Path(__file__).parent / "workers" / "ddp_worker.py")
STEPS, GLOBAL_BATCH, CAP_MB = 3, 24, 0.05  # 24 splits over 1-4 ranks; 0.05 MiB: 3 buckets
MODEL_ARGS = {
    "cnn": ("--model", "cnn", "--optimizer", "adam"),
    "gpt": ("--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4",
            "--seq-len", "32", "--optimizer", "adamw"),
}
EXACT, ATOL, LOSS_ATOL = None, 2e-4, 1e-5
# The default matrix keeps the file near 100 s on 2 cores: both models bit for bit at N = 2, one
# model at each other N, NaiveDDP at N <= 2 (at N >= 3 it differs from BucketedDDP only in how
# gradients are laid out for the all-reduce). MINIFSDP_FULL_DDP_TESTS=1: every model at every N,
# every strategy (~44 launches, ~4 min).
FULL = os.environ.get("MINIFSDP_FULL_DDP_TESTS") == "1"
WORLDS = ([(m, n) for m in MODEL_ARGS for n in (1, 2, 3, 4)] if FULL else
          [("gpt", 1), ("cnn", 2), ("gpt", 2), ("cnn", 3), ("gpt", 4)])  # (model, world size)
CASES = [(m, n, s) for (m, n) in WORLDS for s in ("ddp", "bucketed_ddp")
         if FULL or n <= 2 or s == "bucketed_ddp"]
# at one rank, torch DDP is the identity around the model: compared only in the full matrix
TORCH_CASES = [c for c in CASES if FULL or c[1] > 1]


def tolerance(n: int) -> float | None:
    """Bit for bit (None) at N = 1, 2; ``ATOL`` at N = 3, 4 (see the module docstring)."""
    return EXACT if n <= 2 else ATOL


def train_job(model: str, n: int, strategy: str) -> Job:
    """``minifsdp.train`` with ``strategy`` at N = n (``single`` on one process, with n data
    shards), run in runs/tests/ddp_<model>_<n>_<strategy>."""
    args = ("--strategy", strategy, *MODEL_ARGS[model], "--steps", STEPS,
            "--global-batch", GLOBAL_BATCH, "--save-params")
    name = f"{model}_{n}_{strategy}"
    if strategy == "single":
        return Job(name, "minifsdp.train", 1, (*args, "--data-shards", n))
    if strategy == "bucketed_ddp":
        args += ("--bucket-cap-mb", CAP_MB)
    return Job(name, "minifsdp.train", n, args)


WORKER_JOB = Job("worker", WORKER, 2)
# each case reads its run and the reference's at the same model and N; next to torch DDP at
# N > 2 also the one process's, which bounds how far torch DDP itself is
SINGLE_CASES = [pytest.param(m, n, s, id=f"{m}-N{n}-{s}", marks=pytest.mark.launches(
    train_job(m, n, s), train_job(m, n, "single"))) for m, n, s in CASES]
TORCH_DDP_CASES = [pytest.param(m, n, s, id=f"{m}-N{n}-{s}", marks=pytest.mark.launches(
    train_job(m, n, s), train_job(m, n, "torch_ddp"),
    *([train_job(m, n, "single")] if n > 2 else []))) for m, n, s in TORCH_CASES]
# the comm-log tests read both strategies' GPT runs at N = 2
COMM_LOG_JOBS = (train_job("gpt", 2, "bucketed_ddp"), train_job("gpt", 2, "ddp"))


@pytest.fixture(scope="module")
def train_run(launched):
    """``train_run(model, n, strategy)`` -> ``(RunResult, {name: final full parameter})``."""

    @functools.cache
    def get(model: str, n: int, strategy: str) -> tuple[RunResult, dict[str, torch.Tensor]]:
        run = launched[train_job(model, n, strategy)].result()
        params = torch.load(run.out_dir / "params.pt", weights_only=True)
        # train.py saves our wrappers' state dict with their "module." prefix (torch's
        # get_model_state_dict strips it only for torch's own DDP)
        consume_prefix_in_state_dict_if_present(params, "module.")
        return run, params

    return get


@fixture_of(WORKER_JOB)
def worker(launched) -> list[dict]:
    return launched[WORKER_JOB].result().ranks


def assert_same_training(run, params, ref_run, ref_params, atol, what):
    losses, ref_losses = run.ranks[0]["losses"], ref_run.ranks[0]["losses"]
    assert len(losses) == len(ref_losses) == STEPS
    assert list(params) == list(ref_params), what
    names = tuple(what.split(" vs "))  # "bucketed_ddp vs single"
    if atol is EXACT:
        parity.assert_bitwise(losses, ref_losses, names=names, where="losses")
        parity.assert_bitwise(params, ref_params, names=names)
    else:
        parity.assert_close(losses, ref_losses, atol=LOSS_ATOL, rtol=0, names=names,
                            where="losses")
        parity.assert_close(params, ref_params, atol=atol, rtol=0, names=names)


@pytest.mark.parametrize("model,n,strategy", SINGLE_CASES)
def test_trains_like_one_process(train_run, model, n, strategy):
    run, params = train_run(model, n, strategy)
    assert [r["world_size"] for r in run.ranks] == [n] * n
    assert all(r["losses"] == run.ranks[0]["losses"] for r in run.ranks)
    ref_run, ref = train_run(model, n, "single")
    assert_same_training(run, params, ref_run, ref, tolerance(n), f"{strategy} vs single")


@pytest.mark.parametrize("model,n,strategy", TORCH_DDP_CASES)
def test_trains_like_torch_ddp(train_run, model, n, strategy):
    run, params = train_run(model, n, strategy)
    ref_run, ref = train_run(model, n, "torch_ddp")
    assert_same_training(run, params, ref_run, ref, tolerance(n), f"{strategy} vs torch")
    if tolerance(n) is not EXACT:  # the tolerance is the arithmetic's, not ours
        single_run, single = train_run(model, n, "single")
        assert_same_training(ref_run, ref, single_run, single, ATOL, "torch_ddp vs single")


def steps_of(comm: list[dict]) -> list[tuple[list[dict], dict, dict]]:
    """Split a comm log into steps: (the step's all-reduces, our final-callback span, train.py's
    "backward" span, which ends when ``loss.backward()`` returns)."""
    steps, reduces, final = [], [], None
    for r in comm:
        if r["op"] == "all_reduce":
            reduces.append(r)
        elif r["kind"] == "compute" and r["op"] == FINAL_SPAN:
            final = r
        elif r["kind"] == "compute" and r["op"] == "backward":
            # only the all-reduces issued inside loss.backward() reduce gradients
            inside = [a for a in reduces if r["t_start"] <= a["t_start"] <= r["t_end"]]
            steps.append((inside, final, r))
            reduces, final = [], None
    return steps


@pytest.mark.launches(*COMM_LOG_JOBS)
def test_comm_log_shows_buckets_issued_during_backward(train_run):
    """Overlap: every bucket's all-reduce starts inside backward and before our final callback,
    i.e. while autograd is still computing gradients; the callback only waits for them."""
    run, _ = train_run("gpt", 2, "bucketed_ddp")
    for rank in run.ranks:
        steps = steps_of(rank["comm"])
        assert len(steps) == STEPS
        for reduces, final, backward in steps:
            assert [r["tag"] for r in reduces] == ["bucket 0", "bucket 1", "bucket 2"]
            assert all(r["t_start"] < final["t_start"] for r in reduces), (reduces, final)
            assert all(final["t_start"] <= r["t_end"] <= final["t_end"] for r in reduces)
            assert final["t_end"] <= backward["t_end"]
            # each gradient is reduced exactly once per step
            assert sum(r["bytes"] for r in reduces) == 4 * rank["num_params"]
            # and nobody missed one, so no status is exchanged (Note [unused parameters])
            assert not [r for r in rank["comm"] if r["tag"] == "unused check"]


@pytest.mark.launches(*COMM_LOG_JOBS)
def test_comm_log_naive_ddp_starts_after_backward(train_run):
    """NaiveDDP: one all-reduce per parameter, all issued once autograd is done."""
    from minifsdp.train import make_model, parse_args

    names = [k for k, _ in make_model(parse_args(list(MODEL_ARGS["gpt"]))).named_parameters()]
    run, _ = train_run("gpt", 2, "ddp")
    steps = steps_of(run.ranks[0]["comm"])
    assert len(steps) == STEPS
    for reduces, final, backward in steps:
        assert [r["tag"] for r in reduces] == names
        assert all(r["t_start"] >= final["t_start"] for r in reduces)  # no overlap at all
        assert final["t_end"] <= backward["t_end"]


def test_no_sync_accumulation_matches_torch_ddp(worker):
    """k = 3 micro-batches, the first two under no_sync: bit for bit torch DDP's training,
    and communication only in the synced backward (one all-reduce per bucket per step)."""
    for r in worker:
        acc = r["accumulation"]
        parity.assert_bitwise(acc["losses"], acc["ref_losses"], names=("BucketedDDP", "torch DDP"),
                              where=f"rank {r['rank']}, losses")
        assert acc["names_equal"] and acc["equal"], acc["divergence"]
        assert acc["buckets"] == 3 and acc["bucket_all_reduces"] == 3 * acc["buckets"]


def test_unused_parameter_is_an_error_on_every_rank(worker):
    for r in worker:
        u = r["unused"]
        for case, ranks in (("everywhere", "rank 0, 1"), ("on_rank_1", "rank 1")):
            assert u[case] is not None, case  # raised, on every rank (and nobody hung)
            assert "received no gradient" in u[case]
            assert f"b.weight ({ranks})" in u[case] and f"b.bias ({ranks})" in u[case]
            assert "find_unused_parameters=True" in u[case]
            assert "frozen" not in u[case] and "trunk" not in u[case]
        assert u["recovered_error"] is None and u["recovered_grads_equal"]
        assert not u["frozen_in_buckets"]
        # the status all-gather runs where a slot came back NaN: after a missed gradient, and
        # after a real NaN (which then raises nothing); never in a healthy step
        assert u["nan_error"] is None and u["nan_grad_is_nan"]
        assert u["exchanges"] == [1, 1, 0, 1]


def test_find_unused_parameters_matches_torch_ddp(worker):
    """Missing gradients count as zero; a parameter no rank used keeps .grad = None."""
    for r in worker:
        steps = r["unused"]["find_unused"]
        assert [s["errors"] for s in steps] == [[None, None]] * 3
        assert all(s["grads_equal"] for s in steps)
        assert [s["b_grad_is_none"] for s in steps] == [False, True, False]
        assert [s["ref_b_grad_is_none"] for s in steps] == [False, True, False]
        assert [s["exchanges"] for s in steps] == [1, 1, 1]  # every step, as torch's map
