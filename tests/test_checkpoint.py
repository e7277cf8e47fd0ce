"""``minifsdp.checkpoint``: a killed run resumes bit for bit, checkpoints reshard 4 -> 2 -> 3
exactly, a crash during a save keeps the last good one, a corrupt one fails the same way on
every rank, and an export loads into a plain one-process model.

Jobs depend on each other (a resume needs the killed run's checkpoint), so instead of
conftest's ``launched`` the fixture ``jobs`` runs ``CHAINS``, each in order, ``PARALLEL`` chains
at a time, only the jobs the selected tests need. The in-process tests come first and run
while the first jobs start.
"""

import json
import re
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from minifsdp import parity, train
from minifsdp.checkpoint import (
    CheckpointError,
    export_full_state_dict,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
    validate,
)
from minifsdp.fsdp2 import chunk_dim0
from minifsdp.launch import RunResult, WorkerError, repo_root, torchrun
from minifsdp.models import build_model

PARALLEL = 2
# In-process saves and loads without a process group: DCP says so, rightly.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
OUT = repo_root() / "runs" / "tests"
WORKER = str(Path(__file__).parent / "workers" / "checkpoint_worker.py")
GPT = ("--strategy", "fsdp2", "--model", "gpt", "--n-layer", "2", "--d-model", "32",
       "--n-head", "4", "--seq-len", "32", "--optimizer", "adamw", "--global-batch", "16",
       "--dropout", "0.1", "--steps", "8")  # dropout: the resumed run needs the RNG states


def ck(key: str) -> Path:
    """Where job ``key`` keeps checkpoints: inside its run folder, which its launch empties."""
    return OUT / f"ckpt_{key}" / "ck"


JOBS = {  # key -> (target, nproc, arguments)
    "full": ("minifsdp.train", 2, (*GPT, "--save-params")),
    "killed": ("minifsdp.train", 2, (*GPT, "--checkpoint-dir", ck("killed"), "--save-every", 3,
                                     "--kill-at-step", 5, "--kill-rank", 1)),
    "resumed": ("minifsdp.train", 2, (*GPT, "--resume", ck("killed"), "--checkpoint-dir",
                                      ck("resumed"), "--save-every", 3, "--save-params")),
    "save_crash": ("minifsdp.train", 2, ("--strategy", "torch_fsdp2", "--model", "cnn",
                                         "--steps", 4, "--global-batch", 32, "--checkpoint-dir",
                                         ck("save_crash"), "--save-every", 2,
                                         "--kill-during-save", 4, "--kill-rank", 1)),
    "reshard4": (WORKER, 4, ("--phase", "save4", "--dir", ck("reshard4"))),
    "reshard2": (WORKER, 2, ("--phase", "load2", "--dir", ck("reshard4"))),
    "reshard3": (WORKER, 3, ("--phase", "load3", "--dir", ck("reshard4"))),
}
CHAINS = [["reshard4", "reshard2", "reshard3"], ["killed", "resumed", "full", "save_crash"]]
NEEDS = {  # test -> jobs it reads (with what they depend on)
    "test_kill_and_resume_is_bitwise": ["full", "killed", "resumed"],
    "test_export_of_the_resumed_run_is_the_uninterrupted_runs_parameters": [
        "full", "killed", "resumed"],
    "test_kill_during_save_keeps_the_last_good_checkpoint": ["save_crash"],
    "test_reshard_4_to_2_to_3_is_exact": ["reshard4", "reshard2", "reshard3"],
    "test_dcp_chunks_are_our_dim0_chunks": ["reshard4", "reshard2"],
    "test_corrupt_checkpoint_fails_alike_on_every_rank": ["reshard4", "reshard2"],
    "test_export_loads_into_a_plain_gpt": ["reshard4", "reshard2", "reshard3"],
}


@pytest.fixture(scope="module", autouse=True)
def jobs(request):
    """job key -> Future of its ``RunResult``, or of the ``WorkerError`` it raised. Autouse:
    the launches start with the module's first test and run behind the in-process ones."""
    mod = sys.modules[__name__]
    wanted = {k for item in request.session.items if getattr(item, "module", None) is mod
              for k in NEEDS.get(item.originalname, [])}
    futures = {k: Future() for k in wanted}
    stop = threading.Event()  # the module is over (e.g. -x): start nothing more

    def run_chain(chain: list[str]) -> None:
        for key in (k for k in chain if k in wanted):
            if stop.is_set():
                futures[key].cancel()
                continue
            target, nproc, args = JOBS[key]
            try:
                futures[key].set_result(torchrun(target, *args, nproc=nproc, chapter="tests",
                                                 name=f"ckpt_{key}", timeout=300,
                                                 env={"MINIFSDP_BACKEND": "gloo"}))
            except WorkerError as e:
                futures[key].set_result(e)
            except BaseException as e:
                futures[key].set_exception(e)

    with ThreadPoolExecutor(PARALLEL) as pool:
        for chain in CHAINS:
            pool.submit(run_chain, chain)
        yield futures
        stop.set()


def ok(jobs, key: str) -> RunResult:
    """A job that must have finished cleanly."""
    run = jobs[key].result()
    if isinstance(run, Exception):
        raise run
    return run


def progress_losses(key: str) -> list[float]:
    """The losses rank 0 printed (``report_progress``) -- all a killed run leaves behind."""
    (log,) = (OUT / f"ckpt_{key}" / "logs").glob("*/attempt_0/0/stdout.log")
    return [json.loads(line.split(" ", 1)[1])["loss"] for line in log.read_text().splitlines()
            if line.startswith("@minifsdp-progress ")]


# ---- in this process ------------------------------------------------------------------------

def tiny_run(root: Path, steps: list[int], keep: int | None = 2):
    """A Linear trained one Adam step per save, saved after each of ``steps``."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in steps:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        save_checkpoint(root, model, opt, step=step, keep=keep, extra={"note": "tiny"})
    return model, opt


def test_save_commits_keeps_k_and_resumes_the_generators(tmp_path):
    root = tmp_path / "ck"
    (root / "step_000009.tmp").mkdir(parents=True)  # a crashed save, any step
    model, _ = tiny_run(root, [1, 2, 3])
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert (root / "latest").read_text() == "step_000003\n"
    files = set(validate(root / "step_000003")["files"])
    assert files == {".metadata", "__0_0.distcp", "rank0_rng.pt"}
    expected_draw = torch.rand(3)  # the generator as saved, one draw on

    fresh = nn.Linear(4, 3)
    opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
    loaded = load_checkpoint(root, fresh, opt)
    assert loaded["step"] == 3 and loaded["extra"] == {"note": "tiny"} and loaded["rng_restored"]
    assert torch.equal(torch.rand(3), expected_draw)
    parity.assert_bitwise(dict(fresh.named_parameters()), dict(model.named_parameters()),
                          names=("loaded", "saved"))
    assert all(int(s["step"]) == 3 for s in opt.state.values())
    save_checkpoint(root, fresh, opt, step=3)  # the same step again: replaced
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]


@pytest.mark.parametrize("strategy,rank", [("single", 0), ("fsdp2", 1)])
def test_make_batches_starts_at_any_step(strategy, rank):
    """``make_batches(start_step=s)`` yields what the uninterrupted iterator yields from step
    s on, across epoch ends (2 batches an epoch here), without loading the batches before s
    -- and starting mid-epoch draws nothing from the global generator (Note [bitwise
    resume]), while a new epoch's loader draws its base seed as the uninterrupted one does."""
    from itertools import islice

    from minifsdp.dist import DistInfo

    args = train.parse_args(["--strategy", strategy, "--model", "gpt", "--seq-len", "8",
                             "--global-batch", "2048", "--data-shards", "2"])
    info = DistInfo(rank, 1 if strategy == "single" else 2, rank, torch.device("cpu"), "gloo")
    ref = list(islice(train.make_batches(args, info), 6))
    for start in [1, 2, 3]:
        torch.manual_seed(0)
        got = list(islice(train.make_batches(args, info, start_step=start), 6 - start))
        draws_left = torch.rand(1)
        torch.manual_seed(0)
        draws = sum(1 for epoch_start in (2, 4) if epoch_start >= start)  # fresh loaders
        draws *= 2 if strategy == "single" else 1  # global_batch_loader: one loader per shard
        for _ in range(draws):
            torch.empty((), dtype=torch.int64).random_()
        assert torch.equal(torch.rand(1), draws_left), start
        assert len(got) == len(ref[start:])
        for (x, y), (rx, ry) in zip(got, ref[start:]):
            assert torch.equal(x, rx) and torch.equal(y, ry)


CORRUPTIONS = {  # what to break -> what the error must say (after the checkpoint's path)
    "truncate": (lambda d: (d / "__0_0.distcp").write_bytes(b"x"),
                 r": __0_0\.distcp has 1 bytes, the manifest says \d+"),
    "delete_shard": (lambda d: (d / "__0_0.distcp").unlink(),
                     r": __0_0\.distcp is missing \(the manifest lists it; step 1, saved by 1"),
    "delete_manifest": (lambda d: (d / "manifest.json").unlink(), r": no manifest\.json"),
    "garbage_manifest": (lambda d: (d / "manifest.json").write_text("{not json"),
                         r"/manifest\.json: unreadable manifest \(JSONDecodeError"),
    "old_format": (lambda d: (d / "manifest.json").write_text(json.dumps(
        {"format": "v0", "files": {}, "step": 1, "world_size": 1})),
        r"/manifest\.json: format 'v0', expected 'minifsdp-checkpoint/1'"),
}


@pytest.mark.parametrize("case", CORRUPTIONS)
def test_validate_says_what_is_wrong(tmp_path, case):
    root = tmp_path / "ck"
    tiny_run(root, [1])
    break_it, message = CORRUPTIONS[case]
    step = root / "step_000001"
    break_it(step)
    with pytest.raises(CheckpointError, match=re.escape(str(step)) + message):
        load_checkpoint(root, nn.Linear(4, 3))


def test_find_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        find_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="neither a checkpoint .* nor a checkpoint dir"):
        find_checkpoint(tmp_path)
    (tmp_path / "latest").write_text("step_000005\n")
    with pytest.raises(CheckpointError, match="names 'step_000005', which does not exist"):
        find_checkpoint(tmp_path)
    (tmp_path / "step_000005.old").mkdir()  # a re-save of step 5 crashed between its renames
    assert find_checkpoint(tmp_path) == tmp_path / "step_000005.old"
    (tmp_path / "step_000005").mkdir()  # the normal case wins
    assert find_checkpoint(tmp_path) == tmp_path / "step_000005"


def test_unsupported_strategies_say_what_to_use(tmp_path, cpu_mesh):
    from minifsdp.dist import DistInfo

    args = train.parse_args(["--strategy", "zero1", "--model", "gpt", "--n-layer", "1",
                             "--d-model", "16", "--seq-len", "8"])
    info = DistInfo(0, 1, 0, torch.device("cpu"), "gloo")
    for strategy in ["zero1", "zero2", "fsdp1"]:
        setup = train.STRATEGIES[strategy](train.make_model(args), info, args)
        model, opt = setup if isinstance(setup, tuple) else (setup, None)
        with pytest.raises(NotImplementedError, match="--strategy fsdp2 or torch_fsdp2"):
            save_checkpoint(tmp_path, model, opt, step=1)


# ---- launched ----------------------------------------------------------------------------

def test_kill_and_resume_is_bitwise(jobs):
    """Run B saves after steps 3 (and would after 6), rank 1 SIGKILLs itself after step 5; C
    resumes from B's latest (step 3) and trains steps 4-8: B's steps 1-3 + C's = the
    uninterrupted run's losses and final parameters, bit for bit (Note [bitwise resume])."""
    full, resumed = ok(jobs, "full"), ok(jobs, "resumed")
    killed = jobs["killed"].result()
    assert isinstance(killed, WorkerError)  # (which rank torchrun blames first is a race)
    assert (ck("killed") / "latest").read_text().strip() == "step_000003"
    assert sorted(p.name for p in ck("killed").iterdir()) == ["latest", "step_000003"]
    ref = full.ranks[0]["losses"]
    assert len(ref) == 8 and full.ranks[0]["steps"] == list(range(1, 9))
    assert progress_losses("killed") == ref[:5]  # it trained 5 steps, then died
    partial = json.loads((OUT / "ckpt_killed" / "rank0.json").read_text())  # from its save
    assert partial["steps"] == [1, 2, 3] and not partial["finished"]
    for r in resumed.ranks:
        assert r["start_step"] == 3 and r["rng_restored"] and r["steps"] == [4, 5, 6, 7, 8]
        assert r["resumed_from"] == str(ck("killed") / "step_000003")
    assert partial["losses"] + resumed.ranks[0]["losses"] == ref
    a = torch.load(full.out_dir / "params.pt", weights_only=True)
    c = torch.load(resumed.out_dir / "params.pt", weights_only=True)
    assert list(a) == list(c)
    parity.assert_bitwise(c, a, names=("resumed", "uninterrupted"))
    # The resumed run saves on: after steps 6 and 8 (its last), keep = 2.
    assert [s["step"] for s in resumed.ranks[0]["checkpoints"]] == [6, 8]
    assert sorted(p.name for p in ck("resumed").iterdir()) == [
        "latest", "step_000006", "step_000008"]


def test_export_of_the_resumed_run_is_the_uninterrupted_runs_parameters(jobs, tmp_path):
    full, _ = ok(jobs, "full"), ok(jobs, "resumed")
    out = tmp_path / "gpt.pt"
    export_full_state_dict(ck("resumed"), out)  # latest: step 8
    a = torch.load(full.out_dir / "params.pt", weights_only=True)
    got = torch.load(out, weights_only=True)
    assert list(got) == list(a)
    parity.assert_bitwise(got, a, names=("exported", "uninterrupted"))


def test_kill_during_save_keeps_the_last_good_checkpoint(jobs, tmp_path):
    """torch_fsdp2 (CNN): rank 1 dies in the save after step 4, its files written, nothing
    committed: ``latest`` still names step 2, which loads (into a plain one-process CNN:
    2 ranks' DTensors -> plain tensors) and exports; the ``.tmp`` is no checkpoint."""
    crashed = jobs["save_crash"].result()
    assert isinstance(crashed, WorkerError)
    root = ck("save_crash")
    assert (root / "latest").read_text().strip() == "step_000002"
    assert not (root / "step_000004").exists()
    tmp = root / "step_000004.tmp"
    assert (tmp / "__0_0.distcp").exists() and not (tmp / "manifest.json").exists()
    with pytest.raises(CheckpointError, match=r"step_000004\.tmp: no manifest\.json: the save "
                       "did not finish"):
        validate(find_checkpoint(tmp))
    manifest = validate(root / "step_000002")
    assert (manifest["step"], manifest["world_size"]) == (2, 2)
    assert manifest["extra"]["strategy"] == "torch_fsdp2"

    model = build_model("cnn", dropout=0.0)
    opt = torch.optim.Adam(model.parameters())
    loaded = load_checkpoint(root, model, opt)
    assert (loaded["step"], loaded["world_size"], loaded["rng_restored"]) == (2, 2, False)
    assert all(int(s["step"]) == 2 for s in opt.state.values())
    full = export_full_state_dict(root, tmp_path / "cnn.pt")
    plain = build_model("cnn", dropout=0.0)
    plain.load_state_dict(torch.load(tmp_path / "cnn.pt", weights_only=True))  # strict
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())
    x = torch.randn(4, 1, 28, 28)
    assert torch.equal(plain(x), model(x))


def test_reshard_4_to_2_to_3_is_exact(jobs):
    """Full parameters and optimizer state after each load equal the saved ones exactly, at
    N = 4 -> 2 -> 3, for fsdp2 -> fsdp2 / torch_ddp / bucketed_ddp, bucketed_ddp -> fsdp2,
    and a net with empty shards; training continues: the first loss after a load is the loss
    the saving run computed next (to rounding: another N sums in another order)."""
    r4, r2, r3 = (ok(jobs, k).ranks for k in ("reshard4", "reshard2", "reshard3"))
    assert r2[0]["loaded_a"] == {"step": 2, "world_size": 4, "rng_restored": False}
    assert r3[0]["loaded_b"] == {"step": 3, "world_size": 2, "rng_restored": False}
    for flag in ["a_matches", "a_matches_torch_ddp", "a_matches_bucketed_ddp", "tiny_matches"]:
        assert r2[0][flag] is True, flag
    for flag in ["b_matches", "ddp_matches_a", "tiny_matches"]:
        assert r3[0][flag] is True, flag
    assert r2[0]["first_loss"] == pytest.approx(r4[0]["next_loss"], rel=1e-6)
    assert r3[0]["first_loss"] == pytest.approx(r2[0]["next_loss"], rel=1e-6)


def test_dcp_chunks_are_our_dim0_chunks(jobs):
    """Note [resharding]: what DCP recorded for each fsdp2 parameter at N = 4 is exactly
    ``chunk_dim0``'s rows (the empty shards of ``Tiny``: one 0-row chunk at offset d0, the
    ranks' identical entries deduplicated); a replicated (bucketed_ddp) checkpoint holds
    each tensor once, whole."""
    import torch.distributed.checkpoint as dcp

    ok(jobs, "reshard2")
    for name in ["a", "tiny"]:
        (path,) = (ck("reshard4") / name).glob("step_*")
        meta = dcp.FileSystemReader(path).read_metadata()
        keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
        assert keys
        for key in keys:
            md = meta.state_dict_metadata[key]
            rows = [c.shape[0] for c in chunk_dim0(torch.empty(md.size), 4)]
            expect = sorted({(sum(rows[:r]), n) for r, n in enumerate(rows)})
            got = sorted((c.offsets[0], c.sizes[0]) for c in md.chunks)
            assert got == expect, key
    (path,) = (ck("reshard4") / "ddp").glob("step_*")
    meta = dcp.FileSystemReader(path).read_metadata()
    for key, md in meta.state_dict_metadata.items():
        if key.startswith("model."):
            assert [tuple(c.sizes) for c in md.chunks] == [tuple(md.size)], key
    files = {info.relative_path for info in meta.storage_data.values()}
    assert files == {"__0_0.distcp", "__1_0.distcp"}  # DCP spread the copies over both ranks


def test_corrupt_checkpoint_fails_alike_on_every_rank(jobs):
    r2 = ok(jobs, "reshard2").ranks
    errors = r2[0]["errors"]
    assert r2[1]["errors"] == errors  # every rank raised, with the same message
    bad = str(ck("reshard4") / "corrupt")
    expect = {
        "truncated": r"/truncated: __3_0\.distcp has \d+ bytes, the manifest says \d+ "
                     r"\(truncated or overwritten\)",
        "no_manifest": r"/no_manifest: no manifest\.json: the save did not finish",
        "zeroed": r"/zeroed: DCP could not load it into this FSDPGPT: rank \d: Unpickling",
        "bad_metadata": r"/bad_metadata/\.metadata is unreadable",
        "bad_latest": r"/bad_latest/latest names 'step_000099', which does not exist",
        "missing": r"/missing: no such checkpoint",
    }
    assert errors.keys() == expect.keys()
    for case, pattern in expect.items():
        assert errors[case] is not None and re.match(re.escape(bad) + pattern, errors[case]), (
            case, errors[case])
    assert "checkpoint with --strategy fsdp2 or torch_fsdp2" in r2[0]["zero1_error"]


def test_export_loads_into_a_plain_gpt(jobs, tmp_path):
    """Saved at N = 2, exported offline, loaded into a one-process GPT: its logits equal the
    N = 3 sharded model's (which loaded the same checkpoint), bit for bit at the workers' one
    thread (two threads split a matmul's sums differently: ~1e-7)."""
    r3 = ok(jobs, "reshard3").ranks
    root = ck("reshard4")
    export_full_state_dict(root / "b", tmp_path / "gpt.pt")
    model = train.make_model(train.parse_args(r3[0]["argv"]))
    model.load_state_dict(torch.load(tmp_path / "gpt.pt", weights_only=True))  # strict
    ref = torch.load(root / "logits_b.pt", weights_only=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            assert torch.equal(model(ref["tokens"]), ref["logits"])
    finally:
        torch.set_num_threads(threads)
