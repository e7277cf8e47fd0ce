"""``minifsdp.train`` under torchrun: every data-parallel strategy trains the same model as one
process fed the same global batches (Note [same global batch]), and bad arguments fail with
an error that says what is wrong.

A launch costs 8-15 s on 2 cores, mostly importing torch in torchrun and every rank, while a
core is often idle. Each test declares the jobs it reads (tests/jobs.py), and the fixture
``launched`` (tests/conftest.py) therefore starts every job the selected tests need,
``PARALLEL`` at a time (10 jobs: ~60 s instead of ~120 s), and each test waits for the ones
it reads. All jobs use gloo on the CPU, also on a machine with GPUs.
"""

import functools

import pytest
import torch
from jobs import Job

from minifsdp import parity
from minifsdp.launch import RunResult, WorkerError

PARALLEL = 2  # launches at once (a sweep of train runs is one); 1 runs them one after another
STEPS, GLOBAL_BATCH, WORLD = 4, 32, 2
EVAL_SAMPLES = 1000  # --eval on the first 1,000 test images: ~0.4 s of one core a job
MODEL_ARGS = {
    "cnn": ("--model", "cnn", "--optimizer", "adam"),  # dropout 0 is the default
    "gpt": ("--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4",
            "--seq-len", "32", "--optimizer", "adamw"),
}
DISTRIBUTED = {"cnn": ["torch_ddp", "torch_fsdp1", "torch_fsdp2"],
               "gpt": ["torch_ddp", "torch_fsdp2"]}
CASES = [(m, s) for m, strategies in DISTRIBUTED.items() for s in strategies]

# Bad input: job name -> (nproc, arguments, what the error must say).
BAD = {
    "bad_batch": (4, ("--strategy", "torch_ddp", "--global-batch", 30, "--steps", 1),
                  ["--global-batch 30 is not divisible by 4 ranks"]),
    "bad_single": (2, ("--strategy", "single", "--steps", 1),
                   ["--strategy single runs on one process, got world size 2"]),
    "bad_strategy": (1, ("--strategy", "fsdp9", "--steps", 1),
                     ["unknown --strategy 'fsdp9'; choose from",
                      "'single', 'torch_ddp', 'torch_fsdp1', 'torch_fsdp2'"]),
}


def train_job(model: str, strategy: str) -> Job:
    """``minifsdp.train`` with ``strategy`` on ``model``, run in
    runs/tests/train_<model>_<strategy>."""
    args = ("--strategy", strategy, *MODEL_ARGS[model], "--steps", STEPS,
            "--global-batch", GLOBAL_BATCH, "--save-params")
    if model == "cnn":  # evaluated after training: the saved parameters must not change
        args = (*args, "--eval", "--eval-samples", EVAL_SAMPLES)
    name = f"{model}_{strategy}"
    if strategy == "single":  # one process fed the global batches of WORLD ranks
        return Job(name, "minifsdp.train", 1, (*args, "--data-shards", WORLD))
    if strategy == "single_full":  # the same, with one backward over the whole batch
        return Job(name, "minifsdp.train", 1,
                   (*args[:1], "single", *args[2:], "--data-shards", WORLD, "--full-batch"))
    return Job(name, "minifsdp.train", WORLD, args)


BAD_JOBS = {key: Job(key, "minifsdp.train", nproc, args) for key, (nproc, args, _) in BAD.items()}


def reads(model: str, *strategies: str) -> pytest.MarkDecorator:
    """The mark of a test (or parameter set) that reads ``model``'s runs of ``strategies``."""
    return pytest.mark.launches(*(train_job(model, s) for s in strategies))


# each distributed run next to the one process's run of the same model
VS_SINGLE = [pytest.param(m, s, marks=reads(m, "single", s)) for m, s in CASES]


@pytest.fixture(scope="module")
def train_run(launched):
    """``train_run(model, strategy)`` -> ``(RunResult, {name: final full parameter})``."""

    @functools.cache
    def get(model: str, strategy: str) -> tuple[RunResult, dict[str, torch.Tensor]]:
        run = launched[train_job(model, strategy)].result()
        return run, torch.load(run.out_dir / "params.pt", weights_only=True)

    return get


@pytest.mark.parametrize("model,strategy", [pytest.param(m, s, marks=reads(m, s))
                                            for m, s in CASES])
def test_every_rank_logs_the_global_loss_of_every_step(train_run, model, strategy):
    run, _ = train_run(model, strategy)
    assert [r["rank"] for r in run.ranks] == list(range(WORLD))
    for r in run.ranks:
        assert (r["strategy"], r["model"], r["world_size"]) == (strategy, model, WORLD)
        assert r["backend"] == "gloo" and r["device"] == "cpu"
        assert len(r["losses"]) == len(r["step_times"]) == STEPS
        assert r["losses"] == run.ranks[0]["losses"]  # global_mean: the same on every rank


@pytest.mark.parametrize("model,strategy", VS_SINGLE)
def test_losses_match_one_process_bit_for_bit(train_run, model, strategy):
    """Note [bitwise parity] in minifsdp/train.py: one process accumulating its 2 shards'
    gradients (each loss / 2) does exactly the float operations of 2 ranks."""
    single, _ = train_run(model, "single")
    run, _ = train_run(model, strategy)
    ref, got = single.ranks[0]["losses"], run.ranks[0]["losses"]
    assert len(ref) == len(got) == STEPS
    parity.assert_bitwise(got, ref, names=(strategy, "single"))


@pytest.mark.parametrize("model,strategy", VS_SINGLE)
def test_final_parameters_match_one_process_bit_for_bit(train_run, model, strategy):
    _, ref = train_run(model, "single")
    _, got = train_run(model, strategy)
    assert list(got) == list(ref)
    parity.assert_bitwise(got, ref, names=(strategy, "single"))


@reads("cnn", "single_full", "single")
def test_full_batch_reference_agrees_to_rounding(train_run):
    """The textbook reference -- one backward over the 32-sample mean -- is the same
    mathematics in another summation order: equal to rounding, not bit for bit. Measured
    (CNN, Adam, 4 steps): losses equal, parameters within 2.9e-6 (Adam divides by the
    gradient's own magnitude, so ~5e-9 gradients carry their rounding into the weights).
    Bounds from the error model, not from that measurement: a loss near ln 10 is a sum
    reordered, a few ulps (2.4e-7 each) per step, so 1e-5; a weight moves by at most lr =
    1e-3 a step whatever its gradient's last bits, and the 1e-4 bound (34x the measured) sits
    between rounding and a real bug (~lr)."""
    full, ref_full = train_run("cnn", "single_full")
    single, ref = train_run("cnn", "single")
    assert full.ranks[0]["config"]["full_batch"] and not single.ranks[0]["config"]["full_batch"]
    names = ("single_full", "single")
    parity.assert_close(full.ranks[0]["losses"], single.ranks[0]["losses"], atol=1e-5, rtol=0,
                        names=names, where="losses")
    parity.assert_close(ref_full, ref, atol=1e-4, rtol=0, names=names)


@pytest.mark.parametrize("model,strategy", VS_SINGLE)
def test_saved_parameters_have_the_unwrapped_names(train_run, model, strategy):
    _, ref = train_run(model, "single")
    _, got = train_run(model, strategy)
    # get_model_state_dict strips the wrappers' prefixes (module., _fsdp_wrapped_module.)
    # and returns plain full tensors, not DTensor shards
    assert list(got) == list(ref)
    for k in ref:
        assert type(got[k]) is torch.Tensor, (k, type(got[k]))
        assert (got[k].shape, got[k].dtype) == (ref[k].shape, ref[k].dtype), k


@pytest.mark.parametrize("model", [pytest.param(m, marks=reads(m, *DISTRIBUTED[m]))
                                   for m in sorted(DISTRIBUTED)])
def test_distributed_strategies_agree_bit_for_bit(train_run, model):
    """At 2 ranks every strategy averages the same two local gradients (a sum of two numbers
    does not depend on the order, and halving is exact) and Adam is elementwise, so DDP,
    FSDP1 and FSDP2 must end with *identical* parameters and losses."""
    ref_run, ref = train_run(model, "torch_ddp")
    for strategy in DISTRIBUTED[model][1:]:
        run, got = train_run(model, strategy)
        parity.assert_bitwise(run.ranks[0]["losses"], ref_run.ranks[0]["losses"],
                              names=(strategy, "torch_ddp"))
        assert list(got) == list(ref), strategy
        parity.assert_bitwise(got, ref, names=(strategy, "torch_ddp"))


@pytest.mark.parametrize("model", [pytest.param(m, marks=reads(m, "single"))
                                   for m in sorted(DISTRIBUTED)])
def test_training_moved_every_parameter(train_run, model):
    """Parity is vacuous if nothing trained: every tensor left its initial value."""
    from minifsdp.dist import seed_everything
    from minifsdp.train import make_model, parse_args

    single, final = train_run(model, "single")
    assert single.ranks[0]["config"]["data_shards"] == WORLD
    with torch.random.fork_rng():
        seed_everything(single.ranks[0]["config"]["seed"])  # as main() does before the model
        init = make_model(parse_args(list(MODEL_ARGS[model]))).state_dict()
    assert list(init) == list(final)
    moved = {k: float((final[k] - init[k]).abs().max()) for k in init}
    assert min(moved.values()) > 1e-4, moved  # Adam moves a weight by up to lr = 1e-3 a step


@pytest.mark.parametrize("model", [pytest.param("cnn", marks=reads("cnn", "single",
                                                                  *DISTRIBUTED["cnn"]))])
def test_test_accuracy_is_the_same_count_where_the_parameters_are_bitwise_equal(train_run, model):
    """``--eval`` (Note [test accuracy] in minifsdp/train.py): every rank reports the
    all-reduced sums over exactly EVAL_SAMPLES images, counted once. DDP, FSDP1, FSDP2 and one
    process end with bitwise-equal parameters here and evaluate the same batches in their own
    forward, so they report the same count and the same mean loss, bit for bit. And 4 Adam
    steps learn: far above chance (10%; measured 38.1%)."""
    ref = train_run(model, "single")[0].ranks[0]
    keys = ("test_correct", "test_samples", "test_accuracy", "test_loss")
    for strategy in DISTRIBUTED[model]:
        run, _ = train_run(model, strategy)
        for r in run.ranks:
            assert {k: r[k] for k in keys} == {k: ref[k] for k in keys}, (strategy, r["rank"])
    assert ref["test_samples"] == EVAL_SAMPLES
    assert ref["test_accuracy"] == ref["test_correct"] / EVAL_SAMPLES > 0.2
    assert 0 < ref["test_loss"] < 2.3  # below a uniform guess's log(10) = 2.30


def test_evaluation_counts_every_image_once_on_uneven_shards(monkeypatch):
    """1,000 images on 3 ranks: shards of 334, 334 and 332 (the last one's missing rows masked,
    Note [test accuracy]); without the all-reduce, the ranks' counts add up to the 1-rank
    count. The "model" predicts from 10 raw pixels, no arithmetic, so a prediction cannot
    depend on the batch it is in. In this process, no launch."""
    import torch.distributed as dist

    from minifsdp.dist import DistInfo
    from minifsdp.train import evaluate

    class Pixels(torch.nn.Module):
        def forward(self, x):
            return x[:, 0, 14, 9:19]  # "log-probabilities": ten pixels of the middle row

    def info(rank, world):
        return DistInfo(rank=rank, world_size=world, local_rank=rank,
                        device=torch.device("cpu"), backend="gloo")

    model = Pixels()
    whole = evaluate(model, info(0, 1), samples=1000)
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: None)  # each rank's own sums
    parts = [evaluate(model, info(r, 3), samples=1000, batch=200) for r in range(3)]
    assert whole["test_samples"] == 1000 and 0 < whole["test_correct"] < 1000
    assert [p["test_samples"] for p in parts] == [334, 334, 332]
    assert sum(p["test_correct"] for p in parts) == whole["test_correct"]
    assert model.training  # evaluate() leaves the model in training mode


@pytest.mark.parametrize("bad", [pytest.param(k, marks=pytest.mark.launches(BAD_JOBS[k]))
                                 for k in sorted(BAD)])
def test_bad_input_is_a_clear_error(launched, bad):
    with pytest.raises(WorkerError) as err:
        launched[BAD_JOBS[bad]].result()
    assert err.value.rank is not None  # the launcher found the rank that failed
    for words in BAD[bad][2]:
        assert words in str(err.value)
