"""ZeRO-1/2 (``minifsdp.zero``) under torchrun: the same training as one process and as torch's
DDP, 1/N of the optimizer state (and, at stage 2, of the gradients) per rank, and the
communication volume of Note [ZeRO-1 traffic].

Launches of ``minifsdp.train`` (gloo, CPU), each ZeRO run next to ``single --data-shards N``
and ``torch_ddp`` at the same N: both stages for the CNN (Adam) and the small GPT (AdamW) at
N = 2; ZeRO-1 on the GPT at N = 3 and ZeRO-2 on the CNN at N = 4, where the parameter counts
leave a remainder (GPT 30,592 = 3k + 1, CNN 1,199,882 = 4k + 2), so the padding is exercised.
One more launch, ``tests/workers/zero_worker.py`` at N = 2, covers other optimizers, many
buckets, gradient accumulation and the memory of a multi-bucket step. Each test declares the
runs it reads (tests/jobs.py) and, as in test_train.py, the module fixture ``launched`` starts
every job the selected tests need, ``PARALLEL`` at a time (15 jobs,
~170 s of CPU: ~105 s on an otherwise idle 2-core machine).
"""

import functools
import math
from pathlib import Path

import pytest
import torch
from jobs import Job, fixture_of

from minifsdp import analytic
from minifsdp.launch import RunResult
from minifsdp.parity import assert_bitwise, assert_close, max_abs_diff
from minifsdp.zero import flatten_into_buckets, setup_zero

PARALLEL = 2
WORKER = str(Path(__file__).parent / "workers" / "zero_worker.py")
MODEL_ARGS = {
    "cnn": ("--model", "cnn", "--optimizer", "adam"),
    "gpt": ("--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4",
            "--seq-len", "32", "--optimizer", "adamw"),
}
# world size -> (models, ZeRO stages, steps, global batch). Beyond N = 2 one model and one
# stage each, with few steps: a launch costs ~3 s of CPU per process on 2 cores.
WORLDS = {2: (["cnn", "gpt"], ["zero1", "zero2"], 4, 32),
          3: (["gpt"], ["zero1"], 3, 24),
          4: (["cnn"], ["zero2"], 2, 32)}
ZERO_CASES = [(n, m, s) for n, (models, stages, _, _) in WORLDS.items()
              for m in models for s in stages]
PADDED = {(3, "gpt"), (4, "cnn")}  # psi % N != 0: the cases with padding
TRACKED = 2  # --track-memory: step 2 has Adam's state from the start (memory[1])


def train_job(n: int, model: str, strategy: str) -> Job:
    """``minifsdp.train`` with ``strategy`` at N = n (``single`` on one process, with n data
    shards), run in runs/tests/zero_<n>_<model>_<strategy>."""
    _, _, steps, batch = WORLDS[n]
    args = ("--strategy", strategy, *MODEL_ARGS[model], "--steps", steps,
            "--global-batch", batch, "--save-params")
    if strategy == "single":
        return Job(f"{n}_{model}_single", "minifsdp.train", 1, (*args, "--data-shards", n))
    if strategy.startswith("zero"):
        args += ("--track-memory", TRACKED)
    return Job(f"{n}_{model}_{strategy}", "minifsdp.train", n, args)


WORKER_JOB = Job("worker", WORKER, 2)
# each case reads its ZeRO run; the parity test also the references at the same N and model
CASES = [pytest.param(*c, marks=pytest.mark.launches(train_job(*c))) for c in ZERO_CASES]
PARITY_CASES = [pytest.param(n, m, s, marks=pytest.mark.launches(
    *(train_job(n, m, ref) for ref in ("single", "torch_ddp", s)))) for n, m, s in ZERO_CASES]


@pytest.fixture(scope="module")
def train_run(launched):
    """``train_run(n, model, strategy)`` -> ``(RunResult, {name: final full parameter})``."""

    @functools.cache
    def get(n: int, model: str, strategy: str) -> tuple[RunResult, dict[str, torch.Tensor]]:
        run = launched[train_job(n, model, strategy)].result()
        return run, torch.load(run.out_dir / "params.pt", weights_only=True)

    return get


@fixture_of(WORKER_JOB)
def worker(launched) -> list[dict]:
    return launched[WORKER_JOB].result().ranks


def shard_numel(psi: int, n: int) -> int:
    """Elements per rank with one bucket (Note [flat partition]): ceil(psi / n)."""
    return -(-psi // n)


# ---- parity ----------------------------------------------------------------------------------

# At N = 3 and 4 the float sums differ: `single` scales each loss by 1/N before backward
# (inexact for N = 3) and accumulates shard after shard; torch DDP divides by N and gloo's
# all-reduce sums in ring order; ZeRO averages with ReduceOp.AVG. Gradients then differ in
# their last bits, and Adam carries that into the weights *unevenly*: its first steps move
# each weight by about lr * g / |g|, so an element whose gradient is near zero (|g| ~ eps) can
# move by anything up to lr = 1e-3 depending on its last bits. There is thus no fixed
# tolerance to derive; instead we measure how far torch's DDP itself is from the one-process
# reference and require ZeRO to be no further from either reference than twice that.
# Measured, parameters (losses): N = 3, GPT, 3 steps: DDP-single 1.8e-5 (1 ulp = 4.8e-7 in
# the last loss), ZeRO-1-single 1.9e-5 (the same ulp), ZeRO-1-DDP 1.7e-6 (losses equal).
# N = 4, CNN, 2 steps: DDP-single 5.9e-7, ZeRO-2-single 5.9e-7, ZeRO-2-DDP 1.0e-8, losses
# all equal. A real bug -- a missing 1/N, a stale or misplaced shard -- is off by ~lr.
RELATIVE_TO_DDP = 2.0


def reference_gap(train_run, n: int, model: str) -> tuple[float, float]:
    """(params, losses): how far torch DDP's result is from the one-process reference."""
    single_run, single = train_run(n, model, "single")
    ddp_run, ddp = train_run(n, model, "torch_ddp")
    return max_abs_diff(single, ddp), max_abs_diff(single_run.ranks[0]["losses"],
                                                    ddp_run.ranks[0]["losses"])


@pytest.mark.parametrize("n,model,strategy", PARITY_CASES)
def test_parity_with_one_process_and_torch_ddp(train_run, n, model, strategy):
    """N = 2: bit for bit (Note [bitwise parity] in minifsdp/train.py: (a + b) / 2 is exact
    in any order, and the optimizer is elementwise). N = 3, 4: as close as DDP (see above)."""
    run, got = train_run(n, model, strategy)
    param_gap, loss_gap = reference_gap(train_run, n, model)
    assert param_gap < 1e-4 and loss_gap < 1e-5  # the references agree to rounding
    for ref_name in ("single", "torch_ddp"):
        ref_run, ref = train_run(n, model, ref_name)
        losses, ref_losses = run.ranks[0]["losses"], ref_run.ranks[0]["losses"]
        assert len(losses) == len(ref_losses) == WORLDS[n][2]
        assert list(got) == list(ref), "saved under the unwrapped names, in the same order"
        for k in ref:
            assert type(got[k]) is torch.Tensor and got[k].shape == ref[k].shape, k
        names = (strategy, ref_name)
        if n == 2:
            assert param_gap == loss_gap == 0.0
            assert_bitwise(losses, ref_losses, names=names, where="losses")
            assert_bitwise(got, ref, names=names)
        else:
            assert_close(losses, ref_losses, atol=RELATIVE_TO_DDP * loss_gap, rtol=0,
                         names=names, where="losses")
            assert_close(got, ref, atol=RELATIVE_TO_DDP * param_gap, rtol=0, names=names)


# ---- memory: what one rank holds, step 2, vs minifsdp.analytic --------------------------------

def peak(rank_json: dict, category: str) -> int:
    return max(s[category] for s in rank_json["memory"][TRACKED - 1]["timeline"])


@pytest.mark.parametrize("n,model,strategy", CASES)
def test_optimizer_state_is_one_nth(train_run, n, model, strategy):
    """Adam's state on each rank: exp_avg and exp_avg_sq of the shard (ceil(psi / N)
    elements, the padding included) and one 0-d fp32 step counter for the one shard tensor:
    8 * ceil(psi / N) + 4 bytes. The paper's 1/N share, 8 psi / N, is smaller by the padding
    (< 8 bytes) and the counter: by 4 (N = 2), 9.3 (N = 3, GPT) and 8 bytes (N = 4, CNN) out
    of 0.08-4.8 MB."""
    run, _ = train_run(n, model, strategy)
    psi = run.ranks[0]["num_params"]
    s = shard_numel(psi, n)
    share = analytic.model_state_bytes(psi, n, strategy, param_bytes=4, grad_bytes=4,
                                       k=analytic.optimizer_bytes_per_param("adam", False))
    for r in run.ranks:
        measured = peak(r, "optimizer")
        assert measured == 8 * s + 4
        assert 0 < measured - share["optimizer"] <= 8 * (n - 1) / n + 4
    assert (n * s > psi) == ((n, model) in PADDED)


@pytest.mark.parametrize("n,model,strategy", CASES)
def test_gradients_full_at_stage_1_and_one_nth_at_stage_2(train_run, n, model, strategy):
    """Stage 1: the flat gradient buffer, N * ceil(psi / N) fp32 (the p.grad are views into
    it). Stage 2: only this rank's shard of it ever exists as a gradient, ceil(psi / N) fp32,
    which is analytic's 4 psi / N plus the padding. The one bucket stage 2 fills in backward is
    counted as ``comm`` (Note [ZeRO memory categories]); the 16 KiB buckets of
    test_many_buckets_bound_the_transient_memory show that it shrinks with the bucket size."""
    run, _ = train_run(n, model, strategy)
    psi = run.ranks[0]["num_params"]
    s = shard_numel(psi, n)
    share = analytic.model_state_bytes(psi, n, strategy, param_bytes=4, grad_bytes=4, k=8)
    for r in run.ranks:
        params, grads = peak(r, "params"), peak(r, "grads")
        assert params == 4 * n * s  # the flat buffer: padding included
        assert grads == (4 * n * s if strategy == "zero1" else 4 * s)
        assert 0 <= grads - share["grads"] < (4 * n if strategy == "zero1" else 4)  # padding
        if strategy == "zero2":
            assert peak(r, "comm") == 4 * n * s  # the single bucket, while backward fills it


@pytest.mark.parametrize("n,model,strategy", CASES)
def test_communication_volume(train_run, n, model, strategy):
    """Per step, S = 4 N ceil(psi / N) bytes: ZeRO-1 all-reduces the gradient (2(N-1)/N S)
    and all-gathers the parameters ((N-1)/N S), 1.5x DDP; ZeRO-2 reduce-scatters instead
    ((N-1)/N S): DDP's 2(N-1)/N S in total (Note [ZeRO-1 traffic])."""
    run, _ = train_run(n, model, strategy)
    steps = WORLDS[n][2]
    S = 4 * n * shard_numel(run.ranks[0]["num_params"], n)
    expected = {"zero1": {"all_reduce": 2, "all_gather": 1},
                "zero2": {"reduce_scatter": 1, "all_gather": 1}}[strategy]
    for r in run.ranks:
        calls = [c for c in r["comm"] if c["kind"] == "comm"]
        assert {c["op"] for c in calls} == set(expected)
        for op, factor in expected.items():
            wire = sum(c["wire_bytes"] for c in calls if c["op"] == op)
            assert math.isclose(wire, steps * factor * (n - 1) / n * S)


# ---- the worker: other optimizers, many buckets, accumulation ---------------------------------

def test_other_optimizers_and_many_buckets_bit_for_bit(worker):
    """SGD (momentum, Nesterov, weight decay), Adam, AdamW, Adadelta; one bucket and two; a
    state_dict round trip; zero_grad(set_to_none=False): all bit for bit at N = 2, on a
    101-parameter MLP (padding in every bucket, parameters at odd offsets)."""
    for r in worker:
        for name, case in r["cases"].items():
            assert case["replicas_differ"] is None, f"{name}: {case['replicas_differ']}"
            assert case["moved"] > 1e-3, name  # parity is vacuous if nothing trained
            if "accumulate" in name:
                continue
            assert case["divergence"] is None, f"{name}: {case['divergence']}"
            assert_bitwise(case["losses"], case["ref_losses"], names=("ZeRO", "one process"),
                           where=f"rank {r['rank']}, {name}, losses")
        assert r["cases"]["sgd_stage2_two_buckets"]["buckets"] == [[31, 32], [70, 70]]


def test_gradient_accumulation_agrees_to_rounding(worker):
    """Two backward passes per step: ZeRO-2 averages each micro-batch's gradient over ranks
    and sums the averages, the reference sums four gradients one after another -- another
    association of the same sum, so equal to rounding (measured 3e-8), not bit for bit."""
    for r in worker:
        for name in ("adam_stage1_accumulate", "adam_stage2_accumulate"):
            case = r["cases"][name]
            assert case["max_abs_diff"] < 1e-6, f"{name}: {case['divergence']}"
            assert_close(case["losses"], case["ref_losses"], atol=1e-6, rtol=0,
                         names=("ZeRO", "one process"), where=f"rank {r['rank']}, {name}, losses")


def test_many_buckets_bound_the_transient_memory(worker):
    """GPT (30,592 parameters), AdamW, step 2, at N = 2, buckets of at most 16 KiB (12 of
    them). One shard per bucket, so the state is 8 bytes per shard element plus one 4-byte
    step counter per bucket. At stage 2 the only gradients are the shards (4 psi / N), and the
    bucket being filled (``comm``) is never more than the largest one, 4096 elements -- not the
    whole model, as with one bucket (test_gradients_full_at_stage_1_and_one_nth_at_stage_2)."""
    for r in worker:
        for name, m in r["memory"].items():
            peaks, shards, buckets = m["peaks"], m["shard_numels"], m["bucket_numels"]
            assert sum(buckets) == 2 * sum(shards) >= m["num_params"]
            assert peaks["params"] == 4 * sum(buckets)
            assert peaks["optimizer"] == 8 * sum(shards) + 4 * len(shards)
            if name.startswith("stage1"):
                assert peaks["grads"] == 4 * sum(buckets) and peaks["comm"] == 0
            else:
                assert peaks["grads"] == 4 * sum(shards)
                assert peaks["comm"] == 4 * max(buckets)
        assert len(r["memory"]["stage2_16KiB"]["bucket_numels"]) > 1
        assert 4 * max(r["memory"]["stage2_16KiB"]["bucket_numels"]) <= 2**14


def test_flatten_into_buckets_makes_parameters_views():
    """In process, no launch: buckets in backward order, padded, parameters aliasing them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.Linear(7, 3))
    before = [p.detach().clone() for p in model.parameters()]
    buckets = flatten_into_buckets(list(model.parameters()), rank=2, world_size=3,
                                   cap_bytes=300)
    assert [[p.shape for p in b.params] for b in buckets] == [
        [(7,), (3, 7), (3,)], [(7, 10)]]  # the last parameters first, in order inside
    assert [(b.numel, b.flat.numel(), b.shard.numel()) for b in buckets] == [
        (31, 33, 11), (70, 72, 24)]
    for p, want in zip(model.parameters(), before):
        assert torch.equal(p, want)  # values kept
    b = buckets[0]
    assert b.params[1].data_ptr() == b.flat.data_ptr() + 4 * b.offsets[1]
    assert b.shard.data_ptr() == b.flat.data_ptr() + 4 * 2 * 11  # rank 2's slice
    assert torch.equal(b.flat[31:], torch.zeros(2))  # the padding
    with torch.no_grad():
        b.shard.fill_(1.0)  # what the optimizer does to the shard, the model sees
    # rank 2 owns bucket 0's elements 22:33: model[1].weight's last 6, its bias, 2 padding
    assert torch.equal(model[1].weight.flatten()[15:], torch.ones(6))
    assert torch.equal(model[1].bias, torch.ones(3)) and model[1].weight[0, 0] != 1.0


def test_stage_3_is_not_here():
    with pytest.raises(ValueError, match="stage 3 is FSDP"):
        setup_zero(torch.nn.Linear(2, 2), torch.optim.Adam, stage=3)
