"""FSDP2 (``minifsdp.fsdp2``) under torchrun: the same training as one process and as torch's
``fully_shard``, the communication of one all-gather / reduce-scatter per group, and per-rank
memory under an analytic bound and next to torch's.

Launches of ``minifsdp.train`` (gloo, CPU), each ``--strategy fsdp2`` run next to ``single
--data-shards N`` and ``torch_fsdp2`` at the same N (same units: each block / CNN layer, then
the root): the CNN (Adam) and the tied-embedding GPT (AdamW) at N = 2, the GPT at N = 3 and
the CNN at N = 4, and fsdp2 alone with ``--reshard-after-forward false`` (GPT, N = 2; the
worker compares that option with torch's at N = 2 and 3). At N = 3 and 4 rows divide
unevenly (GPT d_model 32 over 3 ranks, the CNN's fc2 10 rows over 4: 3, 3, 3, 1), so the
padding is exercised. ``tests/workers/fsdp2_worker.py`` at N = 2 and 3 covers what train.py
does not reach (frozen + trainable in one group, empty shards, an unused parameter,
accumulation with and without sync, clipping, meta-device init, state dicts, errors, CPU
offload against torch's ``CPUOffloadPolicy``); the list form ``fully_shard([m1, m2])`` has its
own, ``fsdp2_multi_worker.py`` (N = 2 and 3), and ``shard_placement_fn`` (Shard(i) parameters,
ours against torch's) ``fsdp2_shard_dim_worker.py`` (N = 2, 3 and 4). The in-process tests at
the end use a world of one. 19 launches, each declared by the tests that read it
(tests/jobs.py); the fixture ``launched`` runs ``PARALLEL`` at a time.
"""

import functools
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from jobs import Job, fixture_of
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from minifsdp import analytic, parity
from minifsdp.fsdp2 import FSDPModule, ShardedState, chunk_dim0, fully_shard
from minifsdp.launch import RunResult
from minifsdp.memory import MemoryTracker
from minifsdp.parity import assert_bitwise, assert_close, max_abs_diff
from minifsdp.train import make_model, parse_args, shard_units

PARALLEL = 2
WORKER = str(Path(__file__).parent / "workers" / "fsdp2_worker.py")
MODEL_ARGS = {
    "cnn": ("--model", "cnn", "--optimizer", "adam"),
    "gpt": ("--model", "gpt", "--n-layer", "2", "--d-model", "32", "--n-head", "4",
            "--seq-len", "32", "--optimizer", "adamw", "--tie-embeddings"),
}
# world size -> (models, steps, global batch); few steps beyond N = 2 (a launch costs ~3 s
# of CPU per process on 2 cores)
WORLDS = {2: (["cnn", "gpt"], 4, 32), 3: (["gpt"], 3, 24), 4: (["cnn"], 2, 32)}
VARIANTS = {"": (), "no_reshard": ("--reshard-after-forward", "false")}
CASES = [(n, m, "") for n, (models, _, _) in WORLDS.items() for m in models]
CASES.append((2, "gpt", "no_reshard"))
TRACKED = 2  # --track-memory on the sharded runs at N = 2: step 2 has Adam's state (memory[1])


def train_job(n: int, model: str, variant: str, strategy: str) -> Job:
    """``minifsdp.train`` with ``strategy`` at N = n (``single`` on one process, with n data
    shards), run in runs/tests/fsdp2_<n>_<model>_<variant>_<strategy>."""
    _, steps, batch = WORLDS[n]
    args = ("--strategy", strategy, *MODEL_ARGS[model], "--steps", steps,
            "--global-batch", batch, "--save-params", *VARIANTS[variant])
    name = f"{n}_{model}_{variant}_{strategy}"
    if strategy == "single":
        return Job(name, "minifsdp.train", 1, (*args, "--data-shards", n))
    if n == 2:
        args += ("--track-memory", TRACKED)
        if strategy == "torch_fsdp2":  # FSDPMemTracker watches the last tracked step too
            args += ("--torch-memtracker",)
    return Job(name, "minifsdp.train", n, args)


WORKERS = {n: Job(f"worker_{n}", WORKER, n) for n in (2, 3)}
MULTI_WORKERS = {n: Job(f"multi_{n}", str(Path(WORKER).with_name("fsdp2_multi_worker.py")), n)
                 for n in (2, 3)}


def case_params(cases, *refs: str) -> list:
    """``cases`` as parameter sets, each reading its fsdp2 run and the ``refs`` strategies'
    runs (default variant) at the same N and model."""
    return [pytest.param(n, m, v, marks=pytest.mark.launches(
        train_job(n, m, v, "fsdp2"), *(train_job(n, m, "", s) for s in refs)))
        for n, m, v in cases]


@pytest.fixture(scope="module")
def train_run(launched):
    """``train_run(n, model, variant, strategy)`` -> ``(RunResult, {name: full parameter})``."""

    @functools.cache
    def get(n, model, variant, strategy) -> tuple[RunResult, dict[str, torch.Tensor]]:
        run = launched[train_job(n, model, variant, strategy)].result()
        return run, torch.load(run.out_dir / "params.pt", weights_only=True)

    return get


@fixture_of(*WORKERS.values())
def worker(launched) -> dict[int, list[dict]]:
    return {n: launched[job].result().ranks for n, job in WORKERS.items()}


@fixture_of(*MULTI_WORKERS.values())
def multi(launched) -> dict[int, list[dict]]:
    """tests/workers/fsdp2_multi_worker.py's ranks at N = 2 and 3: ``fully_shard([...])``."""
    return {n: launched[job].result().ranks for n, job in MULTI_WORKERS.items()}


# ---- parity ----------------------------------------------------------------------------------

# fsdp2 lays out its all-gather and reduce-scatter buffers exactly as torch's fully_shard
# (rank-major, each parameter padded to its chunk-0 size, the same parameter order, the same
# AVG reduce-scatter) and runs the same optimizer on the same DTensor shards, so it matches
# torch bit for bit at every N (measured: N = 2, 3, 4). Against one process: bitwise at N = 2
# (Note [bitwise parity] in minifsdp/train.py); at N = 3 and 4 the float sums differ (1/3 is
# inexact, gloo sums in ring order) and Adam carries last-bit differences unevenly into the
# weights -- so, as in test_zero.py, no fixed tolerance: fsdp2 must be no further from the
# one-process run than twice torch's own distance. Measured (parameters; losses were equal):
# N = 3 tied GPT, 3 steps 9.0e-7; N = 4 CNN, 2 steps 5.9e-7 -- for torch and fsdp2 alike.
RELATIVE_TO_TORCH = 2.0


@pytest.mark.parametrize("n,model,variant", case_params(CASES, "torch_fsdp2", "single"))
def test_parity_with_one_process_and_torch_fsdp2(train_run, n, model, variant):
    """(Resharding after forward or not changes memory and communication, never a number:
    the ``no_reshard`` run is compared with the same references.)"""
    run, got = train_run(n, model, variant, "fsdp2")
    torch_run, theirs = train_run(n, model, "", "torch_fsdp2")
    single_run, single = train_run(n, model, "", "single")
    losses, single_losses = run.ranks[0]["losses"], single_run.ranks[0]["losses"]
    assert len(losses) == WORLDS[n][1]
    assert_bitwise(losses, torch_run.ranks[0]["losses"], names=("fsdp2", "torch_fsdp2"),
                   where="losses")
    assert list(got) == list(theirs) == list(single), "the unwrapped names, in the same order"
    for k in single:
        assert type(got[k]) is torch.Tensor and got[k].shape == single[k].shape, k
    assert_bitwise(got, theirs, names=("fsdp2", "torch_fsdp2"))
    gap = max_abs_diff(theirs, single)
    loss_gap = max_abs_diff(torch_run.ranks[0]["losses"], single_losses)
    if n == 2:
        assert gap == loss_gap == 0.0
        assert_bitwise(losses, single_losses, names=("fsdp2", "single"), where="losses")
    else:
        # the references agree to rounding (whether they differ at all is the CPU's business)
        assert gap < 1e-4 and loss_gap < 1e-5
        assert_close(got, single, atol=RELATIVE_TO_TORCH * gap, rtol=0,
                     names=("fsdp2", "single"))
        assert_close(losses, single_losses, atol=RELATIVE_TO_TORCH * loss_gap, rtol=0,
                     names=("fsdp2", "single"), where="losses")


# ---- communication ---------------------------------------------------------------------------

def groups_of(run: RunResult) -> tuple[list[list[nn.Parameter]], bool]:
    """The parameter groups train.py makes (shard_units bottom-up, then the root), rebuilt on
    the meta device from the run's model arguments, and whether the root has one (the CNN's
    root holds no parameter of its own). The root's group is last."""
    with torch.device("meta"):
        model = make_model(parse_args(list(map(str, MODEL_ARGS[run.ranks[0]["model"]]))))
    taken, groups = set(), []
    for unit in [*shard_units(model), model]:
        groups.append([p for p in unit.parameters() if p not in taken])
        taken |= set(groups[-1])
    return [g for g in groups if g], bool(groups[-1])


def padded_numel(p: torch.Tensor, n: int) -> int:
    return chunk_dim0(p, n)[0].numel()  # Note [padding]: every rank's slot is chunk 0's size


@pytest.mark.parametrize("n,model,variant", case_params(CASES))
def test_one_all_gather_and_one_reduce_scatter_per_group(train_run, n, model, variant):
    """Per step and group: an all-gather before forward, another before backward unless the
    group keeps its parameters (the root, or --reshard-after-forward false), one
    reduce-scatter after backward. A group's slot is its padded shards; the all-gather sends
    (N-1) slots per rank, the reduce-scatter (N-1)/N of its N-slot input."""
    run, _ = train_run(n, model, variant, "fsdp2")
    groups, has_root = groups_of(run)
    steps = WORLDS[n][1]
    slots = {4 * sum(padded_numel(p, n) for p in g) for g in groups}
    gathers_per_step = len(groups) + (0 if variant else len(groups) - has_root)
    for r in run.ranks:
        calls = [c for c in r["comm"] if c["kind"] == "comm"]
        ag = [c for c in calls if c["op"] == "all_gather"]
        rs = [c for c in calls if c["op"] == "reduce_scatter"]
        assert len(ag) == steps * gathers_per_step and len(rs) == steps * len(groups)
        assert len(calls) == len(ag) + len(rs)
        assert {c["bytes"] for c in ag} == slots and {c["bytes"] for c in rs} == {
            n * s for s in slots}
        assert {c["tag"].split()[1] for c in ag} == {"params"}
        assert {c["tag"].split()[1] for c in rs} == {"grads"}
        for c in ag:
            assert c["group_size"] == n and math.isclose(c["wire_bytes"], (n - 1) * c["bytes"])
        for c in rs:
            assert math.isclose(c["wire_bytes"], (n - 1) / n * c["bytes"])


# ---- memory ----------------------------------------------------------------------------------

def step_memory(run: RunResult, rank: int) -> dict:
    return run.ranks[rank]["memory"][TRACKED - 1]


def memory_bound(run: RunResult) -> dict[str, int]:
    """An upper bound on one rank's live bytes at any moment of a step (fp32, Adam/AdamW):

        bound = Ps + Gs + OSs + max(Ts + Bopt,  2 Uroot + 2 Umax + W)

    * Ps, Gs, OSs: the sharded model state, from the shard sizes (rank 0's are the largest):
      padded shards; the reduce-scatter outputs the sharded grads view (same size); Adam's two
      states of the local rows plus a 4-byte step per tensor.
    * Ts + Bopt: inside ``optimizer.step()`` (activations are gone): Adam's temporaries over
      the local shards (``analytic.adam_temporaries``) and the batch still held.
    * 2 Uroot: the root group (U = N padded slots of a group, 4 bytes each) stays unsharded
      from its forward to its post-backward, with its unsharded gradients.
    * 2 Umax: one other group at a time -- its unsharded parameters and gradients, or the
      parameters and its all-gather buffer (copy-out), or the gradients and the reduce-scatter
      input (copy-in), or that input and gloo's own copy of it during the collective
      (measured: gloo's reduce-scatter allocates an input-sized temporary). The post-backward
      barrier reshards block i before block i-1 unshards (Note [when is a group's backward
      over?]), so two such groups never overlap.
    * W: activations and backward working memory of ONE process at the local batch: the
      analytic single-process peak (``analytic.step_peak_moments``) minus its P + OS, over the
      forward/backward moments -- it still includes that process's full gradients, so it
      over-counts there.
    """
    cfg = run.ranks[0]["config"]
    n = run.ranks[0]["world_size"]
    groups, has_root = groups_of(run)
    with torch.device("meta"):
        model = make_model(parse_args(list(map(str, MODEL_ARGS[cfg["model"]]))))
    shards = [chunk_dim0(p, n)[0].numel() for g in groups for p in g]
    Ps = Gs = 4 * sum(shards)  # padded shard = rank 0's shard
    OSs = 8 * sum(shards) + 4 * len(shards)
    U = [4 * n * sum(padded_numel(p, n) for p in g) for g in groups]
    u_root, u_max = (U[-1], max(U[:-1])) if has_root else (0, max(U))
    optimizer = cfg["optimizer"]
    moments = analytic.step_peak_moments(model, cfg["global_batch"] // n, optimizer)
    numels = [p.numel() for p in model.parameters()]
    P, OS = 4 * sum(numels), analytic.optimizer_state_bytes(model.parameters(), optimizer)
    b_opt = moments["optimizer step"] - 2 * P - OS - analytic.adam_temporaries(numels)
    W = max(m - P - OS for k, m in moments.items() if k != "optimizer step")
    opt_moment = analytic.adam_temporaries(shards) + b_opt
    bound = Ps + Gs + OSs + max(opt_moment, 2 * u_root + 2 * u_max + W)
    return {"bound": bound, "Ps": Ps, "OSs": OSs, "Uroot": u_root, "Umax": u_max, "W": W}


# Measured (N = 2, local batch 16, step 2, every rank): CNN fsdp2 24,563,192 B = 0.76 of the
# bound, torch_fsdp2 24,637,688 (fsdp2/torch 0.997: torch keeps a forward all-gather buffer
# until the next group's copy-out, for overlap; we free it at once); GPT both 2,850,680 B =
# 0.94 of the bound (ratio 1.000). Both peaks are early in backward, held by activations.
@pytest.mark.parametrize("n,model,variant", case_params(
    [c for c in CASES if c[0] == 2 and not c[2]], "torch_fsdp2"))
def test_peak_memory_under_the_bound_and_next_to_torch(train_run, n, model, variant):
    run, _ = train_run(n, model, variant, "fsdp2")
    torch_run, _ = train_run(n, model, "", "torch_fsdp2")
    b = memory_bound(run)
    # torch's peak on a rank is not reproducible: measured on the CNN at N = 2, rank 1 peaked at
    # 24,637,688 B in one run and 27,586,296 B (+2.9 MB) in two others, while ours was
    # 24,563,192 B every time. The extra is a buffer that torch lets die on gloo's thread, racing
    # the main thread's allocations. So: never above torch on any rank, and not suspiciously far
    # below torch's smallest rank peak (a tracker that missed a gradient would be ~0.8).
    torch_low = min(step_memory(torch_run, r)["peak"] for r in range(n))
    for r in range(n):
        ours, theirs = step_memory(run, r), step_memory(torch_run, r)
        ratio = ours["peak"] / torch_low
        msg = (f"rank {r}: fsdp2 {ours['peak']:,} B = {ours['peak'] / b['bound']:.2f} of the "
               f"bound {b['bound']:,}; torch_fsdp2 {theirs['peak']:,} (lowest rank "
               f"{torch_low:,}); ratio to the lowest {ratio:.3f}")
        assert ours["peak"] <= b["bound"], msg
        assert theirs["peak"] <= b["bound"], msg
        assert ours["peak"] <= theirs["peak"], msg
        assert 0.85 < ratio <= 1.0, msg
        # at rest (end of the step): exactly the sharded parameters and Adam's sharded state
        end = ours["timeline"][-1]
        assert end["params"] == b["Ps"] and end["grads"] == 0 and end["comm"] == 0, msg
        assert end["optimizer"] <= b["OSs"]


# Both trackers watch the same step (probes.py's Note [two trackers, one step]): they agree byte
# for byte (measured so on every rank, CNN and tied GPT here and the chapter-05 GPT at N = 2 and
# 4, in almost every run) or by construction differ by at most one reduce-scatter input that died
# on gloo's thread between their two bookkeepings. (With torch's tracker on the step after ours,
# CI once saw 24,637,688 B vs 27,586,296 B on both ranks: a different step.)
@pytest.mark.parametrize("model", [
    pytest.param(m, marks=pytest.mark.launches(train_job(2, m, "", "torch_fsdp2")))
    for m in ("cnn", "gpt")])
def test_our_tracker_agrees_with_torch_fsdp_memtracker(train_run, model):
    run, _ = train_run(2, model, "", "torch_fsdp2")
    for r in run.ranks:
        ours = r["memory"][TRACKED - 1]
        theirs = r["torch_memtracker"]
        gloo_copy = r["largest_reduce_scatter_input"]
        assert 0 < gloo_copy < ours["peak"] // 2
        assert abs(ours["peak"] - theirs["Total"]) <= gloo_copy, (r["rank"], ours["peak"], theirs)
        end = ours["timeline"][-1]  # the end of the step: at rest
        assert theirs["OptState"] == end["optimizer"]
        assert theirs["Sharded Param"] == end["params"]


@pytest.mark.launches(train_job(3, "gpt", "", "fsdp2"))
def test_param_layout_shows_logical_and_physical_shapes(train_run):
    """``param_layout`` (train.py): every parameter is a DTensor of its full shape whose local
    rows are ``chunk_dim0``'s, on every rank."""
    run, full = train_run(3, "gpt", "", "fsdp2")
    for r in range(3):
        layout = {p["name"]: p for p in run.ranks[r]["param_layout"]}
        assert set(layout) <= set(full)  # the tied head.weight is one parameter
        for name, p in layout.items():
            assert p["type"] == "DTensor" and p["placements"] == "(Shard(dim=0),)"
            assert p["shape"] == list(full[name].shape)
            assert p["local_shape"] == list(chunk_dim0(full[name], 3)[r].shape)


@pytest.mark.launches(*(train_job(2, "gpt", v, "fsdp2") for v in VARIANTS))
def test_reshard_after_forward_false_keeps_the_blocks_unsharded(train_run):
    """The trade: without resharding after forward the backward all-gathers disappear (the
    communication test) and, at the end of forward, every group is unsharded at once."""
    run, _ = train_run(2, "gpt", "no_reshard", "fsdp2")
    default, _ = train_run(2, "gpt", "", "fsdp2")
    b = memory_bound(run)
    groups, _ = groups_of(run)
    all_unsharded = b["Ps"] + sum(4 * 2 * sum(padded_numel(p, 2) for p in g) for g in groups)
    for r in range(2):
        params_peak = max(s["params"] for s in step_memory(run, r)["timeline"])
        default_peak = max(s["params"] for s in step_memory(default, r)["timeline"])
        assert params_peak >= all_unsharded > default_peak


# ---- the worker: frozen, empty, unused, accumulation, clipping, meta, state dicts ------------

def test_worker_trains_like_torch_and_one_process(worker):
    """ours == torch bit for bit in every case at N = 2 and 3; == one process bit for bit at
    N = 2 without accumulation or clipping; otherwise within twice torch's own distance
    (measured 3e-8 .. 1.3e-7: accumulation sums micro-batch averages in another order, and
    clipping sums the ranks' squared shard norms where one process takes one norm of the
    whole gradient -- whether those agree to the last bit depends on the CPU's reduction
    kernels: bitwise on earlier CI machines, 3e-8 apart on an AVX-512/AMX Xeon, for torch's
    ``fully_shard`` exactly as for ours)."""
    for n, ranks in worker.items():
        for r in ranks:
            for name, case in r["cases"].items():
                assert case["vs_torch"] is None, f"{name}: {case['vs_torch']}"
                assert_bitwise(case["losses"]["ours"], case["losses"]["torch"],
                               names=("fsdp2", "torch"), where=f"N = {n}, {name}, losses")
                exact = n == 2 and "accumulate" not in name and name != "clip"
                if exact:
                    assert case["vs_single"] is None, f"{name}: {case['vs_single']}"
                assert case["ours_vs_single"] <= RELATIVE_TO_TORCH * case["torch_vs_single"]
                assert case["ours_vs_single"] < 1e-5, (n, name)  # 77x the 1.3e-7 measured


def test_worker_whole_unit_checkpointing_runs_like_no_checkpointing(worker):
    """``checkpoint(block, x)`` re-runs the block's FSDP hooks inside backward. They must only
    make sure the parameters are there: the same numbers as without checkpointing and as
    torch's, and the same collectives in the same order -- each block's reduce-scatter right
    after its backward. (Before Note [recomputed in backward], the numbers matched but every
    reduce-scatter waited for the end of backward, holding all blocks' unsharded parameters.)"""
    for ranks in worker.values():
        for r in ranks:
            case = r["whole_unit_checkpointing"]
            for name in ("ours_ac", "ours_ac_no_early_stop", "torch_ac"):
                assert case[name]["losses"] == case["ours"]["losses"], name
                assert case[name]["vs_ours"] is None, case[name]["vs_ours"]
            for name in ("ours_ac", "ours_ac_no_early_stop"):
                assert case[name]["ops"] == case["ours"]["ops"], (name, case[name]["ops"])
            scatters = [op for op in case["ours"]["ops"] if op.startswith("reduce_scatter")]
            assert scatters[:3] == [f"reduce_scatter {g}" for g in ("blocks.1", "blocks.0", "root")]


def test_worker_frozen_and_unused_parameters_get_no_gradient(worker):
    """``mid.0`` is frozen inside a trainable group, ``unused`` never runs: neither has a
    gradient nor moves; everything else does."""
    for ranks in worker.values():
        for r in ranks:
            for name, case in r["cases"].items():
                for k, moved in case["moved"].items():
                    idle = k.startswith(("mid.0.", "unused."))
                    for impl in ("ours", "torch", "single"):
                        assert case["has_grad"][impl][k] is not idle, (name, impl, k)
                    assert (moved == 0.0) if idle else (moved > 1e-3), (name, k, moved)


def test_worker_communication_counts(worker):
    """3 steps x (3 groups forward + 2 non-root groups backward) all-gathers, 3 x 3
    reduce-scatters; twice for 2 micro-batches; without sync only the last micro-batch
    reduce-scatters; without resharding after forward no backward all-gather; without
    resharding after the first micro-batch's backward no all-gather before the second's
    forward (its non-root groups still reshard after forward: 3 + 2 + 0 + 2 per step)."""
    expected = {"basic": (15, 9), "no_reshard_after_forward": (9, 9), "accumulate": (30, 18),
                "accumulate_no_sync": (30, 9), "accumulate_no_sync_no_reshard": (21, 9),
                "clip": (15, 9)}
    for ranks in worker.values():
        for r in ranks:
            for name, (ag, rs) in expected.items():
                assert r["cases"][name]["comm"] == {"all_gather": ag, "reduce_scatter": rs}


def test_worker_clip_grad_norm_on_dtensor_grads(worker):
    """torch.nn.utils.clip_grad_norm_ on the sharded DTensor grads: each rank's norm of its
    rows, combined over ranks by DTensor -- the global norm, as one process computes it."""
    for ranks in worker.values():
        for r in ranks:
            norms = r["cases"]["clip"]["norms"]
            where = f"rank {r['rank']}, clipped norms"
            assert len(norms["ours"]) == 3
            assert_bitwise(norms["ours"], norms["torch"], where=where)
            assert_close(norms["ours"], norms["single"], rtol=1e-6, atol=0,
                         names=("ours", "single"), where=where)
            assert min(norms["ours"]) > 0.05  # the clip (max_norm 0.05) did act


def test_worker_shards_follow_torch_chunk_with_empty_shards(worker):
    """Local shapes are torch.chunk's rows, empty where dim 0 < N: ``scale`` (1 element) is
    empty on ranks >= 1, ``narrow`` (2 rows) on rank 2 of 3; global shapes and placements
    are the original's, Shard(0)."""
    for n, ranks in worker.items():
        total = {}
        for r in ranks:
            for k, (local, shape, placements) in r["local_shapes"].items():
                want = chunk_dim0(torch.empty(shape, device="meta"), n)[r["rank"]]
                assert local == list(want.shape), (n, r["rank"], k)
                assert placements == "(Shard(dim=0),)"
                total[k] = total.get(k, 0) + math.prod(local)
            assert r["local_shapes"]["scale"][0] == ([1] if r["rank"] == 0 else [0])
        if n == 3:
            assert ranks[2]["local_shapes"]["narrow.weight"][0] == [0, 16]
        for k, (_, shape, _) in ranks[0]["local_shapes"].items():
            assert total[k] == math.prod(shape), k  # the shards partition the parameter


def test_worker_meta_device_init(worker):
    """Note [meta-device init] in minifsdp/fsdp2/api.py: meta -> fully_shard -> to_empty ->
    load_full_state_dict trains bit for bit like sharding the model directly (tied embeddings
    included); init_weights() on the shards gives exact ones and zeros and GPT-2's std."""
    for ranks in worker.values():
        for r in ranks:
            m = r["meta"]
            assert m["on_meta"] and m["tied"]
            assert m["vs_direct"] is None, m["vs_direct"]
            assert m["losses"]["meta"] == m["losses"]["direct"]
            assert m["ln_ones"] and m["bias_zeros"] and m["finite_after_training"]
            assert 0.015 < m["emb_std"] < 0.025


def test_worker_state_dicts(worker):
    """``state_dict()`` is sharded and communicates nothing (neither our logged collectives
    nor any that torch's CommDebugMode sees), even right after a forward that left the root
    unsharded; ``full_state_dict`` does communicate (so the check can fail); full and sharded
    state dicts load back exactly, and the loaded values are what the next all-gather sends."""
    for ranks in worker.values():
        for r in ranks:
            s = r["state_dict"]
            assert s["comm_during_state_dict"] == [0, 0] and s["comm_during_full"] > 0
            assert s["all_dtensor"] and s["full_plain"]
            for key in ("full_round_trip", "sharded_round_trip", "trained_unlike"):
                assert s[key] is None, f"{key}: {s[key]}"
        assert sum(r["state_dict"]["local_numel"] for r in ranks) == ranks[0]["state_dict"][
            "full_numel"]


def test_worker_errors(worker):
    for ranks in worker.values():
        for r in ranks:
            assert "already applied" in r["errors"]["twice"]
            assert "shared with a module that an earlier fully_shard" in r["errors"]["shared"]


# ---- in process: a world of one -----------------------------------------------------------------

def test_chunk_dim0_is_torch_chunk_plus_empty_shards():
    shapes = lambda d0, n: [c.shape[0] for c in chunk_dim0(torch.zeros(d0, 3), n)]
    assert shapes(10, 4) == [3, 3, 3, 1]
    assert shapes(5, 4) == [2, 2, 1, 0]  # torch.chunk gives only 3 chunks here
    assert shapes(2, 3) == [1, 1, 0]
    assert shapes(1, 2) == [1, 0]
    assert shapes(8, 4) == [2, 2, 2, 2]
    assert all(c.shape[1:] == (3,) for c in chunk_dim0(torch.zeros(2, 3), 4))  # dims kept


@pytest.fixture(scope="module")
def mesh(cpu_mesh):
    return cpu_mesh  # conftest.py: a world of one, in this process


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def test_sharded_param_is_a_dtensor_view_of_the_padded_shard(mesh):
    model = small_model()
    w = model[0].weight.detach().clone()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    p = model[0].fsdp_state.group.fsdp_params[0]
    assert model[0].weight is p.sharded_param and isinstance(p.sharded_param, DTensor)
    assert p.sharded_param.placements == (Shard(0),) and p.sharded_param.shape == (6, 4)
    assert p.sharded_param.to_local().data_ptr() == p.all_gather_input().data_ptr()
    assert torch.equal(p.sharded_param.full_tensor(), w)
    # children's parameters are not in the parent's group (Note [bottom-up])
    root_params = [q.sharded_param for q in model.fsdp_state.group.fsdp_params]
    assert len(root_params) == 2 and all(q is not p.sharded_param for q in root_params)


def test_unshard_reshard_keep_the_same_tensor_and_free_its_storage(mesh):
    """Note [freeing with resize_]: the unsharded parameter is one object for life; resharding
    leaves it with a 0-byte storage, unsharding restores bytes and values."""
    model = small_model()
    w = model[0].weight.detach().clone()
    fully_shard(model, mesh=mesh)
    group = model.fsdp_state.group
    model.unshard()
    u = model[0].weight
    assert group.sharded_state is ShardedState.UNSHARDED and type(u) is nn.Parameter
    assert torch.equal(u, w) and u.untyped_storage().size() == 4 * 24
    model.reshard()
    assert isinstance(model[0].weight, DTensor) and u.untyped_storage().size() == 0
    model.unshard()
    assert model[0].weight is u and torch.equal(u, w)
    model.reshard()


def test_backward_after_reshard_and_unshard_passes_the_version_check(mesh):
    """Autograd saved the unsharded weight in forward; the root reshards after forward here
    and the pre-backward hook all-gathers into the same tensor: the copy-out must not bump its
    version counter (Note [version counter]), and the gradients must equal plain autograd's."""
    model, ref = small_model(), small_model()
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    x = torch.randn(5, 4)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert model.fsdp_state.group.sharded_state is ShardedState.SHARDED
    parity.assert_bitwise({k: p.grad.full_tensor() for k, p in model.named_parameters()},
                          {k: q.grad for k, q in ref.named_parameters()},
                          names=("fully_shard", "autograd"))


def test_frozen_first_layer_needs_the_input_barrier(mesh, monkeypatch):
    """Note [when is a group's backward over?]: counting only the trainable parameters'
    gradients would reshard ``mid`` while its frozen first layer still needs its weight for
    the input's gradient. With the barrier, backward works; without it, it reads freed
    storage."""
    from minifsdp.fsdp2 import fsdp_state

    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.Tanh(),
                                                          nn.Linear(16, 16)), nn.Linear(16, 3))
        m[1][0].requires_grad_(False)
        fully_shard(m[1], mesh=mesh)
        return fully_shard(m, mesh=mesh)

    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    F.cross_entropy(model()(x), y).backward()  # fine
    counting = fsdp_state.FSDPState._register_post_backward

    def params_only(self, args, kwargs):  # the barrier's event not counted
        args, kwargs = counting(self, args, kwargs)
        self._pending -= any(isinstance(t, torch.Tensor) and t.requires_grad for t in args)
        return args, kwargs

    monkeypatch.setattr(fsdp_state.FSDPState, "_register_post_backward", params_only)
    with pytest.raises(RuntimeError, match="storage of size 0"):
        F.cross_entropy(model()(x), y).backward()


def test_fsdp_module_methods_have_torchs_signatures():
    """Every public FSDPModule method of torch's exists in ours with the same parameters: names,
    order, kinds (positional or keyword-only) and defaults; a call written for torch's binds
    to ours. (Annotations are not compared: ours name fewer torch types.)"""
    import inspect

    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    def params(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    names = [n for n in dir(TorchFSDPModule) if not n.startswith("_")
             and callable(getattr(TorchFSDPModule, n))]
    assert len(names) >= 23
    for n in names:
        assert hasattr(FSDPModule, n), n
        assert params(getattr(FSDPModule, n)) == params(getattr(TorchFSDPModule, n)), n


def test_fully_shard_has_torchs_signature():
    """All 8 of torch's ``fully_shard`` parameters, dp_mesh_dims last: names, order, kinds
    and defaults (the policies' by their fields, since the classes are ours)."""
    import inspect

    def params(f):
        return [(p.name, p.kind, repr(p.default)) for p in inspect.signature(f).parameters.values()]

    assert params(fully_shard) == params(torch_fully_shard)
    assert len(params(fully_shard)) == 8


def test_class_swap_and_errors(mesh):
    model = small_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert type(model).__name__ == "FSDPSequential" and isinstance(model, nn.Sequential)
    assert isinstance(model, FSDPModule) and isinstance(model[0], FSDPModule)
    assert type(model[1:]) is nn.Sequential  # containers build the original class
    with pytest.raises(ValueError, match="already applied"):
        fully_shard(model, mesh=mesh)
    ref = small_model()
    torch_fully_shard(ref[0], mesh=mesh)
    torch_fully_shard(ref, mesh=mesh)
    for not_a_bool in (2, 1, None):  # an int k is fully_shard's argument only, in both
        with pytest.raises(ValueError, match="should be a bool"):
            model.set_reshard_after_forward(not_a_bool)
        with pytest.raises(ValueError, match="should be a bool"):
            ref.set_reshard_after_forward(not_a_bool)
    model.set_reshard_after_forward(False, False)  # recurse is positional, as in torch
    assert not model._groups(False)[0].reshard_after_forward
    assert model[0]._groups(False)[0].reshard_after_forward is not False  # not recursed into
    model.set_reshard_after_forward(False)
    assert not model[0]._groups(True)[0].reshard_after_forward
    with pytest.raises(ValueError, match="0-d parameter"):
        scalar = nn.Module()
        scalar.p = nn.Parameter(torch.tensor(1.0))
        fully_shard(scalar, mesh=mesh)
    with torch.device("meta"):
        meta = small_model()
    fully_shard(meta, mesh=mesh)
    with pytest.raises(RuntimeError, match="to_empty"):
        meta(torch.randn(2, 4))


def test_memory_categories_of_a_step(mesh):
    """Note [FSDP2 memory categories]: at rest only the padded shards (params) and Adam's
    state; during the step the group buffers are ``comm`` and the sharded grads ``grads``."""
    model = small_model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(5, 4)
    for _ in range(2):
        with MemoryTracker(model, opt) as mt:
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    numel = sum(p.numel() for p in small_model().parameters())  # 51, no padding at N = 1
    peaks = {c: max(s[c] for s in mt.timeline) for c in ("params", "grads", "comm")}
    assert mt.timeline[-1]["params"] == 4 * numel
    assert peaks["grads"] == 4 * numel and peaks["comm"] >= 4 * 30  # model[0]: 30 elements
    assert peaks["params"] <= 4 * numel + 4 * numel  # shards + at most everything unsharded


def test_worker_reduction_options_are_torchs(worker):
    """Note [divide factor], Note [unused parameters in a group]: with each option ours and torch's
    ``fully_shard`` train to the same bits (N = 2, 3); a factor other than N without
    force-sum needs NCCL's PREMUL_SUM, which both refuse on gloo; a factor of N changes
    nothing, force-sum (a post-division instead of AVG) and 2.5 do; an all-reduce hook runs
    where torch's does (an add before the post-division tells); with
    ``set_reduce_scatter_unused_params`` an expert that only rank 0 runs trains as torch's;
    ZeRO++'s qgZ (``QuantizedReduceScatter``, int4 and int8, Note [qgZ]) as a custom
    reduce-scatter trains as torch's with it, and int4 drifts further from fp32 than int8."""
    for ranks in worker.values():
        for r in ranks:
            cases = r["reduction_options"]
            for name in ("default", "factor_n", "force_sum", "factor_2.5_force_sum",
                         "unused_reduced", "all_reduce_hook", "hook_force_sum", "qgz_int4",
                         "qgz_int8"):
                case = cases[name]
                assert case["errors"] == {"ours": None, "torch": None}, (name, case["errors"])
                assert case["vs_torch"] is None and case["losses_equal"], (name, case["vs_torch"])
            premul = cases["factor_2.5_premul"]["errors"]
            assert all("PREMUL_SUM" in (premul[k] or "") for k in ("ours", "torch")), premul
            assert cases["factor_n"]["off_default"] == 0.0
            assert cases["factor_2.5_force_sum"]["off_default"] > 1e-3
            assert cases["all_reduce_hook"]["off_default"] > 1e-3
            assert cases["hook_force_sum"]["off_default"] > 1e-3
            assert cases["qgz_int4"]["off_default"] > cases["qgz_int8"]["off_default"] > 0


def test_worker_ignored_params_are_torchs(worker):
    """``ignored_params``: the ignored ``scale`` stays a plain ``Parameter`` under both, ours
    trains bit for bit as torch's on every rank, and ``scale``'s value differs across ranks
    (each rank stepped on its own gradient: nothing reduced it)."""
    for ranks in worker.values():
        for r in ranks:
            case = r["ignored_params"]
            assert case["vs_torch"] is None and case["losses_equal"], case["vs_torch"]
            assert case["scale_type"] == ["Parameter", "Parameter"]
        assert len({r["ignored_params"]["scale"] for r in ranks}) == len(ranks)


def test_worker_reset_iter_state_after_an_exception_is_torchs(worker):
    """``reset_iter_state`` after a forward cut short inside a group (every rank): the next
    iteration trains as torch's does after its reset, bit for bit, and as a run that never
    failed, with the same collectives in the same order (without the reset, the cut forward's
    stale backward counts hold ``narrow``'s reduce-scatter until the end of backward); on a
    non-root module both refuse it (naming the root)."""
    for ranks in worker.values():
        for r in ranks:
            case = r["reset_after_exception"]
            assert case["failed"] == [True, True]
            assert case["vs_torch"] is None and case["vs_clean"] is None, case
            assert case["losses_equal"]
            assert case["ops"]["ours"] == case["ops"]["clean"] != [], case["ops"]
            assert all(m and "root" in m for m in case["non_root"]), case["non_root"]


def test_worker_backward_options_are_torchs(worker):
    """``set_is_last_backward(m == last)`` over 3 micro-batches a step (Note [not the last
    backward]) and ``set_unshard_in_backward(False)`` on an embedding whose input needs no
    gradient (Note [no all-gather in backward]): ours trains as torch's bit for bit, and as
    without the option (neither changes a number), at N = 2 and 3. The collectives show the
    option acting as torch's: with ``is_last_backward`` the same sequence as torch's (the
    first group's backward prefetches the previous forward's last group, whose next forward
    uses it), not the default's; with ``unshard_in_backward`` the same all-gathers as
    torch's, in order, one fewer a step than the default (the embedding's), and the same
    reduce-scatters (ours reduce-scatters the root's group when its last gradient is in,
    torch's at the end of backward: Note [when is a group's backward over?]). A non-bool is
    refused, naming the argument."""
    for ranks in worker.values():
        for r in ranks:
            cases = r["backward_options"]
            for name in ("is_last_backward", "unshard_in_backward"):
                case = cases[name]
                assert case["vs_torch"] is None and case["vs_default"] is None, (name, case)
                assert case["losses_equal"], name
            ops = cases["is_last_backward"]["ops"]
            assert ops["ours"] == ops["torch"] != ops["ours_default"], ops
            ops = cases["unshard_in_backward"]["ops"]
            gathers = {k: [o for o in v if o.startswith("all_gather")] for k, v in ops.items()}
            scatters = {k: sorted(o for o in v if o.startswith("reduce_scatter"))
                        for k, v in ops.items()}
            assert gathers["ours"] == gathers["torch"], gathers
            assert len(gathers["ours"]) == len(gathers["ours_default"]) - 3, gathers  # 3 steps
            assert scatters["ours"] == scatters["torch"] == scatters["ours_default"], scatters
            for method, arg in (("set_is_last_backward", "is_last_backward"),
                                ("set_unshard_in_backward", "unshard_in_backward")):
                assert f"{arg} should be a bool" in cases["errors"][method], cases["errors"]


def test_worker_forward_method_is_torchs(worker):
    """``register_fsdp_forward_method(root, "score")`` at N = 2 and 3 (``mid`` has 2 rows: an
    empty shard at 3), with a ``forward`` that raises: training through the method is torch's
    bit for bit (losses, parameters) and so is its ``no_grad`` output; and it is a forward, the
    same bits and the same collectives as the same model trained through ``forward``."""
    for ranks in worker.values():
        for r in ranks:
            case = r["forward_method"]
            for other in ("torch", "ours_forward"):
                c = case[other]
                assert c["params"] is None and c["eval"] is None, (other, c)
                assert c["losses_equal"], other
            assert case["ours_forward"]["ops_equal"]


def test_worker_zeropp_qwz_is_torchs(worker):
    """ZeRO++'s qwZ (Note [qwZ]) at N = 2 and 3: ours and torch's ``fully_shard`` driving the
    same int8 all-gather hooks train to the same bits in bf16 compute, and the quantization
    acts (ours without it differs). qgZ on uneven and empty shards is in the reduction-options
    test; hpZ needs N >= 4 (a proper divisor), chapter 12's launch."""
    for ranks in worker.values():
        for r in ranks:
            case = r["qwz"]
            assert case["vs_torch"] is None and case["losses_equal"], case
            assert case["off_bf16"] > 0, case


def test_worker_cpu_offload_is_torchs(worker):
    """``offload_policy=CPUOffloadPolicy(pin_memory=False)`` (Note [FSDP2 CPU offload]) at N =
    2 and 3, on a net with uneven and empty shards, a frozen layer and an unused parameter:
    ours trains as torch's bit for bit (losses, each rank's sharded gradients, parameters over
    3 Adam steps) and as ours without offload, with the same collectives in the same order as
    both; the shards, their gradients and Adam's state are on the CPU; and each step makes the
    moves the Note predicts, the same as torch's: every parameter's padded shard once per
    unshard -- 19 a step: the root's 7 parameters once (kept unsharded after forward), mid's 4
    and narrow's 2 twice (forward, backward) -- and every reduced parameter's rows back once:
    9, all 13 but mid[0]'s 2 (frozen) and unused's 2 (no gradient). On this CPU mesh a move is
    a ``.to("cpu")`` that copies nothing; what is checked is that it is made, where torch makes
    it; without offload there is none."""
    for n, ranks in worker.items():
        for r in ranks:
            case = r["offload"]
            assert case["vs_torch"] == {"losses": None, "grads": None, "params": None}, case
            assert case["vs_default"] is None, case["vs_default"]
            ops = case["ops"]
            assert ops["ours"] == ops["torch"] == ops["ours_default"] != [], ops
            assert case["devices"]["ours"] == ["adam cpu", "grad cpu", "padded shard cpu",
                                               "param cpu"], case["devices"]
            assert case["devices"]["torch"] == ["adam cpu", "grad cpu", "param cpu"]
            moves = case["moves"]
            assert moves["ours"] == moves["torch"] == case["predicted"], moves
            assert moves["ours_default"] == [[]] * 3
            for step in moves["ours"]:
                kinds = [k for k, _, _ in step]
                assert (kinds.count("h2d"), kinds.count("d2h")) == (19, 9), (n, step)
                assert all(size == 4 for _, _, size in step)  # fp32: the shards' dtype


def test_cpu_offload_pin_memory_needs_cuda_as_in_torch(mesh):
    """Note [FSDP2 CPU offload]: ``CPUOffloadPolicy()`` pins the shards (``pin_memory=True``,
    the default). Without an accelerator torch's ``fully_shard`` fails inside ``pin_memory()``
    and ours refuses up front, naming the fix; both leave the module unsharded. With one, both
    pin. Something that is not an ``OffloadPolicy`` is refused (torch ignores it)."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy

    from minifsdp.fsdp2 import CPUOffloadPolicy, OffloadPolicy

    assert CPUOffloadPolicy() == CPUOffloadPolicy(pin_memory=True)
    assert isinstance(CPUOffloadPolicy(), OffloadPolicy)
    for fs, policy in ((fully_shard, CPUOffloadPolicy()),
                       (torch_fully_shard, TorchCPUOffloadPolicy())):
        model = small_model()
        if torch.accelerator.is_available():
            fs(model, mesh=mesh, offload_policy=policy)
            assert model[0].weight.to_local().is_pinned()
            continue
        with pytest.raises(RuntimeError) as err:
            fs(model, mesh=mesh, offload_policy=policy)
        assert not isinstance(model[0].weight, DTensor) and type(model) is nn.Sequential
        if fs is fully_shard:
            assert "CPUOffloadPolicy(pin_memory=False)" in str(err.value)
            assert "needs CUDA" in str(err.value)
    with pytest.raises(TypeError, match="offload_policy should be an OffloadPolicy"):
        fully_shard(small_model(), mesh=mesh, offload_policy="cpu")


def test_cpu_offload_meta_init_trains_as_without(mesh):
    """Note [FSDP2 CPU offload] with Note [meta-device init]: shards sharded on ``meta``,
    materialized with ``to_empty(device="cpu")`` and loaded (Note [who owns the shard's
    storage]: re-padded before the first all-gather) train 3 Adam steps to the same bits as
    the same model without offload, and the shards stay in CPU memory."""
    from minifsdp.fsdp2 import CPUOffloadPolicy, load_full_state_dict

    full = small_model().state_dict()
    trained = []
    for policy in (CPUOffloadPolicy(pin_memory=False), None):
        with torch.device("meta"):
            model = small_model()
        kw = {"offload_policy": policy} if policy is not None else {}
        fully_shard(model[0], mesh=mesh, **kw)
        fully_shard(model, mesh=mesh, **kw)
        model.to_empty(device="cpu")
        load_full_state_dict(model, full)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            model(torch.randn(5, 4, generator=g)).square().sum().backward()
            opt.step()
            opt.zero_grad()
        p = model[0].fsdp_state.group.fsdp_params[0]
        assert p.offload_to_cpu is (policy is not None) and p.padded_shard().device.type == "cpu"
        trained.append({k: v.full_tensor() for k, v in model.state_dict().items()})
    assert_bitwise(trained[0], trained[1], names=("offload", "no offload"))
    assert max_abs_diff(trained[0], full) > 1e-3  # it trained


# ---- the list form: fully_shard([m1, m2]) (Note [several modules, one group]) --------------

def test_list_form_unshards_before_the_first_and_reshards_after_the_last(mesh):
    """One group over ``head`` and ``emb`` (listed in the reverse of their run order): it is
    unsharded from the pre-forward of ``emb`` (which runs first) through the blocks in
    between to the post-forward of ``head``; the two modules share one state, both are
    class-swapped, the same list comes back, and its gradients equal plain autograd's."""
    torch.manual_seed(0)
    ref = nn.ModuleDict({"emb": nn.Linear(4, 6), "mid": nn.Linear(6, 6), "head": nn.Linear(6, 3)})
    model = nn.ModuleDict({k: nn.Linear(m.in_features, m.out_features) for k, m in ref.items()})
    model.load_state_dict(ref.state_dict())
    seen = []

    def run(m, x):
        return m["head"](torch.tanh(m["mid"](torch.tanh(m["emb"](x)))))

    listed = [model["head"], model["emb"]]
    assert fully_shard(listed, mesh=mesh) is listed
    fully_shard(model["mid"], mesh=mesh)
    state = model["emb"].fsdp_state
    assert model["head"].fsdp_state is state and state.group.name == "Linear, Linear"
    assert all(isinstance(m, FSDPModule) for m in listed) and len(state.group.fsdp_params) == 4
    for name in ("emb", "mid", "head"):  # the group's sharded state as each module starts
        model[name].register_forward_pre_hook(
            lambda m, a, name=name: seen.append((name, state.group.sharded_state.name)))
    model["head"].register_forward_hook(
        lambda *_: seen.append(("after head", state.group.sharded_state.name)))
    x = torch.randn(5, 4)
    fully_shard(model, mesh=mesh)  # a root over them (the list's state cannot be one)
    model.forward = lambda x: run(model, x)
    model(x).square().sum().backward()
    run(ref, x).square().sum().backward()
    assert seen == [("emb", "UNSHARDED"), ("mid", "UNSHARDED"), ("head", "UNSHARDED"),
                    ("after head", "SHARDED")], seen
    assert state.group.name == "emb, head"  # named at lazy init, as torch's _module_fqn
    parity.assert_bitwise({k: p.grad.full_tensor() for k, p in model.named_parameters()},
                          {k: q.grad for k, q in ref.named_parameters()},
                          names=("fully_shard([head, emb])", "autograd"))


def test_worker_list_form_trains_like_torch(multi):
    """``Pair`` (``fully_shard([head, emb])`` around two blocks, a group each, and the root's
    norm), ``Experts`` (two sibling experts on one input as one group) and ``Chunked`` (Pair
    whose loss calls ``head`` on two halves after the model's forward): losses, gradients and
    parameters equal torch's bit for bit at every one of 3 steps, every rank, N = 2 and 3; the
    group's shards are uneven and, at N = 3, empty (``head``'s 4 rows: 2, 2, 0)."""
    for n, ranks in multi.items():
        for r in ranks:
            for name in ("pair", "experts", "chunked"):
                assert r[name]["first_divergence"] is None, r[name]["first_divergence"]
            group = r["pair"]["groups"]["emb, head"]
            assert group["modules"] == ["emb", "head"]
            rows = [len(c) for c in torch.arange(10).chunk(n)] + [0] * n  # emb.weight's
            head_rows = ([len(c) for c in torch.arange(4).chunk(n)] + [0] * n)[r["rank"]]
            assert group["rows"] == {"emb.weight": rows[r["rank"]], "emb.bias": rows[r["rank"]],
                                     "head.weight": head_rows, "head.bias": head_rows}, group
        if n == 3:
            assert ranks[2]["pair"]["groups"]["emb, head"]["rows"]["head.weight"] == 0


def order_line(where: str, ours: list[str], theirs: list[str]) -> str:
    """The first place two collective sequences differ, in one line."""
    i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours),
                                                                              len(theirs)))
    at = lambda ops: repr(ops[i]) if i < len(ops) else "nothing"  # noqa: E731
    return (f"{where}: collective {i} differs: fsdp2 {at(ours)}, torch {at(theirs)} "
            f"(the {i} before agree; fsdp2 {len(ours)}, torch {len(theirs)} in all)")


def test_worker_list_form_collectives_are_torchs(multi):
    """The list form's group issues one all-gather in forward (before ``emb``, the first of
    its modules to run; none before ``head``), one in backward (it was resharded after
    ``head``) and ONE reduce-scatter a step, as torch's: the all-gathers equal torch's in
    order, and so do the reduce-scatters, but for the root's, which ours issues when its last
    gradient is in and torch's at the end of backward (Note [when is a group's backward
    over?]); ``Experts``' collectives equal torch's one for one. ``Chunked`` pins where we
    stop following torch: there torch's group reduce-scatters when the first chunk's
    backward is done, gathers again for the pre-backward and reduce-scatters again at the
    end (3 all-gathers, 2 reduce-scatters a step); ours waits for all its gradients (2, 1),
    with the same numbers (test above)."""
    def count(ops, op, group):
        return sum(o == f"{op} {group}" for o in ops)

    for ranks in multi.values():
        for r in ranks:
            ops = r["pair"]["ops"]
            for step, (ours, theirs) in enumerate(zip(ops["ours"], ops["torch"])):
                where = f"N = {r['world_size']}, rank {r['rank']}, step {step}"
                ag = {k: [o for o in v if o.startswith("AG")] for k, v in
                      (("ours", ours), ("torch", theirs))}
                assert ag["ours"] == ag["torch"], order_line(where, ag["ours"], ag["torch"])
                rs = {k: [o for o in v if o.startswith("RS") and o != "RS root"] for k, v in
                      (("ours", ours), ("torch", theirs))}
                assert rs["ours"] == rs["torch"], order_line(where, rs["ours"], rs["torch"])
                assert sorted(ours) == sorted(theirs), (where, ours, theirs)
                for side in (ours, theirs):
                    assert count(side, "AG", "emb, head") == 2, (where, side)
                    assert count(side, "RS", "emb, head") == 1, (where, side)
            ops = r["experts"]["ops"]
            for step, (ours, theirs) in enumerate(zip(ops["ours"], ops["torch"])):
                assert ours == theirs, order_line(
                    f"Experts, N = {r['world_size']}, rank {r['rank']}, step {step}", ours, theirs)
            assert all(count(s, "RS", "experts.0, experts.1") == 1 for s in ops["ours"]), ops
            ops = r["chunked"]["ops"]
            for ours, theirs in zip(ops["ours"], ops["torch"]):
                assert (count(ours, "AG", "emb, head"), count(ours, "RS", "emb, head")) == (2, 1)
                assert (count(theirs, "AG", "emb, head"),
                        count(theirs, "RS", "emb, head")) == (3, 2)
                assert [o for o in ours if "emb, head" not in o and o != "RS root"] == [
                    o for o in theirs if "emb, head" not in o and o != "RS root"]


def test_worker_list_form_returns_and_errors(multi):
    """Ours returns what torch's does (the same list; each module class-swapped; a listed
    module inside another listed one covered by it, not swapped). Misuse: torch's raises too
    (an IndexError, AssertionErrors, a ValueError at the first forward), ours a ValueError or
    TypeError naming the module or parameter at ``fully_shard``, and both refuse a list's
    group as the root."""
    for ranks in multi.values():
        for r in ranks:
            assert r["returns"]["ours"] == r["returns"]["torch"], r["returns"]
            assert r["returns"]["ours"]["nested_swapped"] == [True, False]
            e = r["errors"]
            assert all(e[f"torch_{k}"] for k in ("empty", "already", "twice", "shared", "root"))
            assert "list of modules is empty" in e["ours_empty"]
            assert "already applied to this module[1], FSDPLinear" in e["ours_already"]
            assert "module[1] (Linear) is listed twice" in e["ours_twice"]
            assert e["ours_shared"].startswith("ValueError: Linear.weight is shared")
            assert "in one fully_shard call" in e["ours_shared"]
            assert e["ours_root"].startswith("RuntimeError") and "root" in e["ours_root"]
            assert "the group of FSDPLinear, FSDPLinear" in e["ours_root"]
            assert "module[1] is a int, not an nn.Module" in e["ours_not_a_module"]


# ---- shard_placement_fn: Shard(i) parameters (Note [Shard(i) layout]) --------------------------

SHARD_DIM_WORKER = str(Path(__file__).parent / "workers" / "fsdp2_shard_dim_worker.py")
SHARD_DIM = {n: Job(f"shard_dim_{n}", SHARD_DIM_WORKER, n) for n in (2, 3, 4)}
SHARD_DIMS = {"experts.w_in": 2, "experts.w_out": 1, "out.weight": 1}  # the rest: dim 0


def shard_dim_ranks(launched, n: int) -> list[dict]:
    return launched[SHARD_DIM[n]].result().ranks


def shard_dim_param(n: int):
    return pytest.param(n, marks=pytest.mark.launches(SHARD_DIM[n]))


@pytest.mark.parametrize("n", [shard_dim_param(2), shard_dim_param(3)])
def test_worker_shard_placement_fn_is_torchs(launched, n):
    """``shard_placement_fn`` putting stacked experts on Shard(-1) and Shard(1) and a Linear's
    weight on Shard(1), beside dim-0 parameters with uneven and empty shards in the same two
    groups: at init the local tensors (``torch.chunk`` on each one's dim) and placements are
    torch's and ``full_tensor()`` is the unsharded parameter; then over 3 Adam steps the
    losses, the sharded gradients (local tensors, placements) and the parameters equal
    torch's bit for bit, on every rank -- fp32, without resharding after forward, and with
    bf16 parameters reduced in fp32 (torch supports it). Against one process: bitwise at
    N = 2; at N = 3 no further than torch (RELATIVE_TO_TORCH)."""
    from minifsdp.fsdp2.shard_placement import chunk_on_dim

    for r in shard_dim_ranks(launched, n):
        for name in ("fp32", "no_reshard_after_forward", "bf16"):
            case = r[name]
            assert case["placements_equal"] and case["shapes_equal"], name
            assert case["grad_placements_equal"], name
            for key in ("local_vs_torch", "full_vs_unsharded", "losses_vs_torch",
                        "grads_vs_torch", "params_vs_torch", "full_vs_torch"):
                assert case[key] is None, (name, key, case[key])
            for k, shape in case["shapes"].items():
                dim = SHARD_DIMS.get(k, 0)
                assert case["placements"][k] == case["grad_placements"][k] == f"(Shard(dim={dim}),)"
                want = chunk_on_dim(torch.empty(shape, device="meta"), n, dim)[r["rank"]]
                assert case["local_shapes"][k] == list(want.shape), (name, k)
            assert case["dtypes"] == ["torch.float32"]  # the sharded grads: fp32 under bf16 too
        if n == 3 and r["rank"] == 2:  # empty dim-0 shards next to Shard(i) in both groups
            assert r["fp32"]["local_shapes"]["experts.e_bias"] == [0, 1, 12]
            assert r["fp32"]["local_shapes"]["gate.weight"] == [0, 8]
        fp32 = r["fp32"]
        assert fp32["losses_vs_single"] is None, fp32["losses_vs_single"]
        if n == 2:
            assert fp32["vs_single"] is None, fp32["vs_single"]
        else:
            assert fp32["torch_vs_single"] < 1e-4
            assert fp32["ours_vs_single"] <= RELATIVE_TO_TORCH * fp32["torch_vs_single"]


@pytest.mark.parametrize("n", [shard_dim_param(2), shard_dim_param(3)])
def test_worker_shard_placement_fn_state_dicts_and_refusals(launched, n):
    """The sharded state dict holds torch's placements; ``full_state_dict`` ->
    ``load_full_state_dict`` (each rank keeps its slice on the parameter's dim) and a sharded
    ``load_state_dict`` give the same bits back. Ours refuses exactly what torch refuses, with
    the same exception type where torch's is a ``ValueError`` or ``NotImplementedError`` (a
    dim > 0 that N does not divide: 5 columns at N = 2 and 3, 4 at N = 3 with its empty
    shard; not Shard) and a ``ValueError`` where torch asserts (a dim out of range), each
    message naming the parameter's path."""
    for r in shard_dim_ranks(launched, n):
        sd = r["state_dict"]
        assert sd["placements_equal"] and sd["placements"]["out.weight"] == "(Shard(dim=1),)"
        assert sd["full_round_trip"] is None and sd["sharded_round_trip"] is None, sd
        errors = r["errors"]
        assert (errors["columns_4"]["ours"] is None) == (errors["columns_4"]["torch"] is None) \
            == (n == 2), errors["columns_4"]
        for name, e in errors.items():
            if e["torch"] is None:
                continue
            assert e["ours"] is not None and "layer.w" in e["ours"][1], (name, e)
            want = "ValueError" if e["torch"][0] == "AssertionError" else e["torch"][0]
            assert e["ours"][0] == want, (name, e)
        assert errors["columns_5"]["ours"][0] == "NotImplementedError"
        assert "does not divide evenly" in errors["columns_5"]["ours"][1]


@pytest.mark.parametrize("n", [shard_dim_param(4)])
def test_worker_shard_placement_fn_hsdp_and_reshard_to_k(launched, n):
    """On a 2 x 2 HSDP mesh ours trains as torch's bit for bit with ``(Replicate(),
    Shard(i))`` placements. ``reshard_after_forward=2`` on a 1-D mesh of 4: torch's accepts it
    and fails in backward (an ``IndexError``: its copy-out reads the kept flat piece as a
    padded shard with a dim i); ours refuses it in ``fully_shard``, naming both parameters."""
    for r in shard_dim_ranks(launched, n):
        case = r["hsdp"]
        for key in ("local_vs_torch", "full_vs_unsharded", "losses_vs_torch", "grads_vs_torch",
                    "params_vs_torch", "full_vs_torch"):
            assert case[key] is None, (key, case[key])
        assert case["placements_equal"] and case["grad_placements_equal"]
        assert case["placements"]["experts.w_in"] == "(Replicate(), Shard(dim=2))"
        assert case["placements"]["gate.weight"] == "(Replicate(), Shard(dim=0))"
        k = r["reshard_to_k"]
        assert k["torch"][:2] == ["training", "IndexError"], k
        assert k["ours"][:2] == ["fully_shard", "NotImplementedError"], k
        assert "w_in (Shard(2)), w_out (Shard(1))" in k["ours"][2], k


@pytest.mark.parametrize("n", [shard_dim_param(4)])
def test_worker_hpz_on_uneven_and_empty_shards_is_torchs(launched, n):
    """ZeRO++'s hpZ (``reshard_after_forward=2``, Note [reshard to k ranks] in ``hsdp.py``)
    at N = 4 on Net with every parameter on dim 0, so its rows cut unevenly and leave empty
    shards (rank 3 holds no row of any parameter). In fp32 and in bf16: layouts, losses,
    gradients and parameters equal torch's bit for bit on every rank, and ours' full
    parameters equal ZeRO-3's (True). The proof that hpZ acted is in ours' collectives: each
    step's two backward all-gathers run over 2 ranks instead of 4."""
    for r in shard_dim_ranks(launched, n):
        for name in ("hpz", "hpz_bf16"):
            case = r[name]
            assert case["placements_equal"] and case["shapes_equal"], name
            assert case["grad_placements_equal"], name
            for key in ("local_vs_torch", "full_vs_unsharded", "losses_vs_torch",
                        "grads_vs_torch", "params_vs_torch", "full_vs_torch", "vs_zero3"):
                assert case[key] is None, (name, key, case[key])
            steps, groups = 3, 2
            assert case["collectives"] == {"all_gather over 4": steps * groups,
                                           "all_gather over 2": steps * groups,
                                           "reduce_scatter over 4": steps * groups}, name
            assert case["zero3_collectives"] == {"all_gather over 4": 2 * steps * groups,
                                                 "reduce_scatter over 4": steps * groups}
            rows = {k: s[0] for k, s in case["local_shapes"].items()}
            if r["rank"] == 3:
                assert set(rows.values()) == {0}, rows
            if r["rank"] == 2:
                assert rows["out.weight"] == 1 and rows["gate.weight"] == 0, rows
        fp32 = r["hpz"]
        assert fp32["losses_vs_single"] is None, fp32["losses_vs_single"]
        assert fp32["ours_vs_single"] <= RELATIVE_TO_TORCH * fp32["torch_vs_single"]


def test_shard_placement_fn_in_a_world_of_one(mesh):
    """At N = 1 a Shard(1) parameter is its whole self (placement ``Shard(1)``) and trains
    as the plain model does; refused before any parameter is replaced: torch's per-parameter
    mesh (``ShardPlacementResult``), a placement fn that is not callable, and an all-gather
    extension on a dim > 0."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult

    from minifsdp.fsdp2.shard_placement import chunk_on_dim

    assert [tuple(c.shape) for c in chunk_on_dim(torch.zeros(2, 4), 3, 1)] == [(2, 2), (2, 2),
                                                                                (2, 0)]
    model, ref = small_model(), small_model()
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(-1) if p.ndim == 2 else None)
    assert model[0].weight.placements == (Shard(1),) and model[0].bias.placements == (Shard(0),)
    for m in (model, ref):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for step in range(2):
            torch.manual_seed(step)
            m(torch.randn(5, 4)).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert_bitwise({k: v.full_tensor() for k, v in model.named_parameters()},
                   dict(ref.named_parameters()), names=("fsdp2 Shard(1)", "plain"))
    m = small_model()
    before = dict(m.named_parameters())
    with pytest.raises(NotImplementedError, match="ShardPlacementResult for 0.weight"):
        fully_shard(m, mesh=mesh,
                    shard_placement_fn=lambda p: ShardPlacementResult(Shard(1), None))
    with pytest.raises(TypeError, match="must be a callable"):
        fully_shard(m, mesh=mesh, shard_placement_fn=Shard(1))
    m[0].weight.fsdp_pre_all_gather = m[0].weight.fsdp_post_all_gather = print  # as Float8Weight
    with pytest.raises(NotImplementedError, match="0.weight is a Parameter, an all-gather ext"):
        fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    assert dict(m.named_parameters()) == before and not isinstance(m, FSDPModule)


# ---- dp_mesh_dims: parameters already DTensors on a larger mesh (Note [an SPMD mesh]) ---------

SPMD_WORKER = str(Path(__file__).parent / "workers" / "fsdp2_spmd_worker.py")
SPMD = {n: Job(f"spmd_{n}", SPMD_WORKER, n) for n in (2, 3, 4)}
SPMD_CASES = {2: ("dp_tp", "ddp"), 3: ("dp_tp",),
              4: ("dp_tp", "dp_tp_bf16", "hsdp", "flattened", "ddp")}


def spmd_param(n: int):
    return pytest.param(n, marks=pytest.mark.launches(SPMD[n]))


@pytest.mark.parametrize("n", [spmd_param(2), spmd_param(3), spmd_param(4)])
def test_worker_dp_mesh_dims_is_torchs(launched, n):
    """``fully_shard(..., mesh=world, dp_mesh_dims=...)`` on a tensor-parallel Net whose
    parameters are DTensors on the full mesh: (dp, tp) at N = 2, 3 (tp = 1) and (2, 2) at
    N = 4 (real TP: column- and row-parallel layers, so gradients that are ``Partial()`` on
    tp; also with bf16 parameters reduced in fp32), HSDP through ``replicate="rep"`` and two
    shard dims flattened, each at N = 4; and ``replicate="dp"`` alone (torch's DDP mode; ours:
    HSDP with one-rank shard groups) at N = 2 and 4. On every
    rank: the sharded placements (``_StridedShard`` where tp cut the same dim first) and local
    tensors at init, then over 3 Adam steps the losses, gradients (local tensors and
    placements) and parameters equal torch's bit for bit; ``full_state_dict`` equals torch's
    full parameters and loads back to the same bits; against one process (the plain model on
    every DP rank's rows) no further than torch, bitwise at N = 2 (fp32). Net's rows leave
    empty shards (``gate.weight``'s one row)."""
    for r in launched[SPMD[n]].result().ranks:
        for name in SPMD_CASES[n]:
            case = r[name]
            assert case["placements_equal"] and case["grad_placements_equal"], name
            for key in ("local_vs_torch", "full_vs_unsharded", "losses_vs_torch",
                        "grads_vs_torch", "params_vs_torch", "full_vs_torch", "round_trip"):
                assert case[key] is None, (name, key, case[key])
            assert case["ours_vs_single"] == case["torch_vs_single"], name
            if not name.endswith("bf16"):
                assert case["ours_vs_single"] < 1e-4, name
            if n == 2:
                assert case["ours_vs_single"] == 0.0
            if r["rank"] == n - 1 and name != "ddp":  # gate.weight's one row went to rank 0
                assert case["local_shapes"]["gate.weight"] == [0, 8], name
        ddp = r["ddp"] if "ddp" in SPMD_CASES[n] else None
        if ddp:  # nothing cut over dp: each rank keeps its whole TP piece
            assert ddp["local_shapes"]["gate.weight"] == [1, 8]
            assert ddp["placements"]["gate.weight"] == "(Replicate(), Replicate())"
        tp4 = r.get("dp_tp") if n == 4 else None
        if tp4:  # fc1 is cut by tp first, then by dp inside tp's piece
            assert tp4["placements"]["fc1.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
            assert tp4["placements"]["fc2.weight"] == "(Shard(dim=0), Shard(dim=1))"
            assert tp4["grad_placements"]["fc1.weight"] == tp4["placements"]["fc1.weight"]
        if n == 4:  # bf16 acted: its rounding moves the parameters far more than fp32's
            assert r["dp_tp_bf16"]["ours_vs_single"] > 100 * r["dp_tp"]["ours_vs_single"]
            hsdp_head = r["hsdp"]["placements"]["head.weight"]
            assert hsdp_head == "(Replicate(), Shard(dim=0), Replicate())"
            assert r["flattened"]["placements"]["head.weight"] == "(Shard(dim=0), Replicate())"
            assert r["flattened"]["dp_size"] == r["hsdp"]["dp_size"] == 4


@pytest.mark.parametrize("n", [spmd_param(2)])
def test_worker_dp_mesh_dims_refuses_what_torch_refuses(launched, n):
    """Each refusal with torch's exception type and message (ours names the parameter's path
    too): no dims, a plain parameter, one not ``Replicate()`` on a DP dim, one on another
    mesh object, an unknown dim name, an int ``reshard_after_forward``. A DTensor parameter
    without ``dp_mesh_dims``: ours points to it (torch takes it as tensor parallelism on a
    mesh of its own, which ours does not build)."""
    for r in launched[SPMD[n]].result().ranks:
        errors = r["errors"]
        for name in ("no_dims", "plain_param", "sharded_on_dp", "other_mesh", "unknown_name",
                     "int_reshard"):
            ours, theirs = errors[name]["ours"], errors[name]["torch"]
            assert ours and theirs and ours[0] == theirs[0], (name, ours, theirs)
            assert theirs[1] in ours[1], (name, ours, theirs)
        assert errors["sharded_on_dp"]["ours"][1].startswith("weight: ")
        ours = errors["dtensor_without_dims"]["ours"]
        assert ours[0] == "ValueError" and "dp_mesh_dims=DataParallelMeshDims" in ours[1]


def test_dp_mesh_dims_in_a_world_of_one(mesh):
    """The doctests, and at N = 1 on a named (dp, tp) mesh of (1, 1): the sharded parameter
    is the whole local tensor on the full mesh, ``Shard(0)`` on dp, and trains as the plain
    model does, bit for bit; ours' ``DataParallelMeshDims`` refuses no dims as torch's does."""
    import doctest

    from torch.distributed.tensor import distribute_tensor

    from minifsdp.fsdp2 import DataParallelMeshDims, spmd_mesh

    assert doctest.testmod(spmd_mesh).failed == 0
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()
    world = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model, ref = small_model(), small_model()
    for m in model:
        for name, p in list(m.named_parameters()):
            setattr(m, name, nn.Parameter(distribute_tensor(p.detach(), world,
                                                            [Replicate(), Replicate()])))
    fully_shard(model, mesh=world, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    assert model[0].weight.placements == (Shard(0), Replicate())
    assert model[0].weight.device_mesh is world
    for m in (model, ref):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        for step in range(2):
            torch.manual_seed(step)
            x = torch.randn(5, 4)
            if m is model:
                x = DTensor.from_local(x, world, [Shard(0), Replicate()])
            out = m(x)
            (out.to_local() if isinstance(out, DTensor) else out).square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert_bitwise({k: v.full_tensor() for k, v in model.named_parameters()},
                   dict(ref.named_parameters()), names=("fsdp2 dp_mesh_dims", "plain"))
