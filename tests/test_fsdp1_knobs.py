"""FSDP1's knobs (``minifsdp.fsdp1.options``, ``minifsdp.fsdp1.grads``): mixed precision,
backward and forward prefetch, ``no_sync``, ``clip_grad_norm_`` and frozen parameters inside a
unit, each against torch FSDP1 (``use_orig_params=True``, ``device_id`` the CPU) bit for bit.

Launches (each test declares the ones it reads; the module fixture ``launched`` starts them,
``PARALLEL`` at a time):

* ``tests/workers/fsdp1_knobs_worker.py`` at N = 2 and 3 runs 18 configurations of a 4-unit
  MLP whose units all pad differently (33 -> 48 -> 37 -> 24 -> 10, each block with a LayerNorm
  and a float buffer), 3 AdamW steps each, recording per step and rank: losses, each unit's
  local gradient and parameter shard, and the sequence of FSDP collectives with the start of
  each unit's forward computation, ours and torch's; for some, the memory peak of step 2
  (``MemoryTracker``) and our comm log's wire bytes.
* ``minifsdp.train`` at N = 2 with ``--clip-grad-norm`` (fsdp1 and torch_fsdp1 also with bf16
  mixed precision, backward_pre and forward prefetch; fsdp2 next to torch_fsdp2).

Exactness. Everything equals torch bit for bit at both N, mixed precision included: we cast,
gather, divide, reduce and cast back in torch's order (Note [FSDP1 mixed precision]). Compared
are the parameters' elements; torch fills its alignment padding with 42s, ours holds zeros, and
neither is read. Against one process (clipping only), the 2-norm differs by the order of the
sums: each rank adds its shard's squares, then the ranks' sums are added; one process adds per-
parameter norms. Measured: 1 ulp (relative 7e-8); we require 1e-6 relative. The inf-norm is a
max, exact in any order -- of the same gradients. At N = 2 they are the same by construction (a
sum of two shards' gradients is one addition, the same in either order), so the first step's
inf-norm is equal bit for bit. At N = 3 the one process adds its three shards' gradients in
another order than gloo's reduce-scatter, so each element may differ by a few ulps: measured 1
ulp (relative 6.7e-8, an AMD EPYC) where earlier CPUs gave 0; the 1e-6 relative bound (16 ulps)
holds it. """

import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from jobs import Job

from minifsdp import fsdp1

PARALLEL = 2
WORKER = str(Path(__file__).parent / "workers" / "fsdp1_knobs_worker.py")
WORLDS = (2, 3)
UNITS = ["(root)", "blocks.0", "blocks.1", "blocks.2"]


# ``minifsdp.train`` end to end at N = 2 with every FSDP1 knob's flag, next to torch with the
# same flags (and FSDP2 next to torch's fully_shard with --clip-grad-norm)
TRAIN_ARGS = ("--model", "gpt", "--n-layer", "2", "--n-head", "4", "--d-model", "32",
              "--seq-len", "32", "--optimizer", "adamw", "--steps", "3", "--global-batch", "8",
              "--clip-grad-norm", "0.5")
FSDP1_FLAGS = ("--auto-wrap", "transformer", "--param-dtype", "bf16", "--reduce-dtype", "fp32",
               "--backward-prefetch", "backward_pre", "--forward-prefetch", "implicit")
TRAIN = {"fsdp1": FSDP1_FLAGS, "torch_fsdp1": FSDP1_FLAGS, "fsdp2": (), "torch_fsdp2": ()}


# the jobs (tests/jobs.py), run in runs/tests/fsdp1_knobs_worker_2, ..._train_fsdp1, ...
WORKERS = {n: Job(f"worker_{n}", WORKER, n) for n in WORLDS}
TRAIN_JOBS = {s: Job(f"train_{s}", "minifsdp.train", 2, ("--strategy", s, *TRAIN_ARGS, *flags))
              for s, flags in TRAIN.items()}
# the tests parametrized by N read that N's worker
BY_WORLD = [pytest.param(n, marks=pytest.mark.launches(WORKERS[n])) for n in WORLDS]


def cases(launched, n: int, prefix: str) -> list[tuple[str, dict]]:
    """``("<case> (rank r)", results)`` of the cases whose name starts with ``prefix``."""
    ranks = launched[WORKERS[n]].result().ranks
    assert [r["world_size"] for r in ranks] == [n] * n
    out = [(f"{name} (rank {r['rank']})", c) for r in ranks
           for name, c in r["cases"].items() if name.startswith(prefix)]
    assert out, prefix
    return out


def assert_torch_bitwise(name: str, c: dict) -> None:
    assert c["units"] == c["our_units"] == UNITS, name
    assert c["losses"] == c["torch_losses"], name
    for what in ("grads", "params"):  # each a line from minifsdp.parity, or None
        assert c[what]["vs_torch"] is None, f"{name}, {what}: {c[what]['vs_torch']}"
        assert c[what]["padding"] is None, f"{name}, {what}: {c[what]['padding']}"
    assert c["moved"] > 1e-3, f"{name}: some unit did not train"  # lr 1e-2, 3 steps


def ops(events: list, what: str) -> list:
    return [u for op, u in events if op == what]


@pytest.mark.parametrize("n", BY_WORLD)
def test_mixed_precision_bit_for_bit_with_torch_fsdp1(launched, n):
    for name, c in cases(launched, n, "mp_"):
        assert_torch_bitwise(name, c)
        assert c["events"] == c["torch_events"], name
        assert c["state_dict_dtypes"] == ["torch.float32"], name  # fp32 shards, buffers back


@pytest.mark.parametrize("n", BY_WORLD)
def test_mixed_precision_halves_what_it_should(launched, n):
    """bf16 all-gathers (and a bf16 reduce) move half fp32's bytes; an fp32 reduce the same;
    the parameters' peak drops (unsharded parameters in bf16; the shards stay fp32). The whole
    peak need not: with an fp32 reduce a bf16 gradient and its fp32 copy coexist, and gloo's
    copy of the reduce-scatter's input dies when its thread lets go of it."""
    got = {name: c for name, c in cases(launched, n, "")}
    for r in range(n):
        fp32 = got[f"prefetch_none (rank {r})"]  # the same run in fp32 (FULL_SHARD, no prefetch)
        mp, mp16 = got[f"mp_bf16_fp32_reduce (rank {r})"], got[f"mp_bf16 (rank {r})"]
        assert mp["wire_bytes"]["all_gather"] * 2 == fp32["wire_bytes"]["all_gather"]
        assert mp["wire_bytes"]["reduce_scatter"] == fp32["wire_bytes"]["reduce_scatter"]
        assert mp16["wire_bytes"]["reduce_scatter"] * 2 == fp32["wire_bytes"]["reduce_scatter"]
        assert mp["peaks_params"][1] < fp32["peaks_params"][1]


@pytest.mark.parametrize("n", BY_WORLD)
def test_prefetch_issues_torchs_collectives_in_torchs_order(launched, n):
    got = dict(cases(launched, n, "prefetch_"))
    for name, c in got.items():
        assert_torch_bitwise(name, c)
        for step, (ours, theirs) in enumerate(zip(c["events"], c["torch_events"])):
            assert ours == theirs, f"{name}, step {step}:\n ours  {ours}\n torch {theirs}"
    # the settings differ from each other (a prefetch that did nothing would pass the above)
    none, pre, post, fwd = (got[f"prefetch_{k} (rank 0)"]["events"]
                            for k in ("none", "backward_pre", "backward_post", "forward"))
    rs_first = ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    assert [op for op, _ in none[1] if op != "forward"][4:8] == rs_first
    assert pre[1] != none[1] and post[1] != none[1]
    # PRE and POST issue the same sequence here (POST's prefetch of unit k - 1 in unit k's
    # post-backward comes just where PRE's, in unit k's pre-backward, would be followed by
    # nothing else): they differ in *when*, before or after unit k computes, which the memory
    # test below sees
    # forward prefetch starts in the second iteration (the first one records the order)
    assert fwd[0] == none[0] and fwd[1] != none[1]
    assert fwd[1][:3] == [["all_gather", "(root)"], ["all_gather", "blocks.0"],
                          ["forward", "(root)"]]


@pytest.mark.parametrize("n", BY_WORLD)
def test_prefetch_memory(launched, n):
    """A prefetch keeps one more unit unsharded: BACKWARD_PRE during a unit's backward,
    forward_prefetch during its forward. Peaks of every category but "other": gloo's copy of a
    reduce-scatter's input dies when gloo's thread lets go of it, which is not ours to order.
    The bounds allow one unit's unsharded gradient more."""
    got = dict(cases(launched, n, "prefetch_"))
    for r in range(n):
        peak = {k: got[f"prefetch_{k} (rank {r})"]["peaks_but_other"][1]
                for k in ("none", "backward_pre", "backward_post", "forward")}
        unit = max(got[f"prefetch_none (rank {r})"]["padded_bytes"].values())
        assert 0 < peak["backward_pre"] - peak["none"] <= 2 * unit, (peak, unit)
        assert 0 <= peak["backward_post"] - peak["none"] <= unit, (peak, unit)
        assert 0 < peak["forward"] - peak["none"] <= 2 * unit, (peak, unit)


@pytest.mark.parametrize("n", BY_WORLD)
def test_no_sync_accumulates_then_reduces_once(launched, n):
    for name, c in cases(launched, n, "no_sync"):
        assert_torch_bitwise(name, c)
        assert c["events"] == c["torch_events"], name
        for events in c["events"]:  # per step: micro-batch 1 in no_sync, 2 outside
            assert sorted(ops(events, "reduce_scatter")) == UNITS, name
            last_forward = max(i for i, e in enumerate(events) if e[0] == "forward")
            assert ops(events[:last_forward], "reduce_scatter") == [], \
                f"{name}: a reduce-scatter inside no_sync"
    # the memory price: every unit's unsharded gradient lives from micro-batch 1 to 2
    for r in range(n):
        got = dict(cases(launched, n, ""))
        sync, one = got[f"no_sync (rank {r})"], got[f"prefetch_none (rank {r})"]
        assert sync["peaks"][1] > one["peaks"][1]


@pytest.mark.parametrize("n", BY_WORLD)
def test_clip_grad_norm_bit_for_bit_with_torch_and_close_to_one_process(launched, n):
    for name, c in cases(launched, n, "clip_"):
        assert_torch_bitwise(name, c)
        assert c["norms"] == c["torch_norms"], name
        max_norm = 0.01 if "inf" in name else 0.05
        assert all(v > max_norm for v in c["norms"]), f"{name}: clipping never acted"
        if "inf" in name and n == 2:  # a max of the same gradients (see the docstring)
            assert c["norms"][0] == c["ref_norms"][0], name
        for got, ref in zip(c["norms"], c["ref_norms"]):
            assert abs(got - ref) <= 1e-6 * ref, (name, got, ref)
    norms = {r: c["norms"] for r, c in cases(launched, n, "clip_l2")}
    assert len({tuple(v) for v in norms.values()}) == 1  # the same total on every rank


@pytest.mark.parametrize("pair", [
    pytest.param(pair, marks=pytest.mark.launches(*(TRAIN_JOBS[s] for s in pair)))
    for pair in [("fsdp1", "torch_fsdp1"), ("fsdp2", "torch_fsdp2")]])
def test_train_clip_grad_norm_and_knob_flags_equal_torch(launched, pair):
    """train.py --clip-grad-norm (and for FSDP1 mixed precision, backward_pre and forward
    prefetch): losses and the norms before clipping equal torch's with the same flags."""
    ours, theirs = (launched[TRAIN_JOBS[s]].result().ranks for s in pair)
    for a, b in zip(ours, theirs):
        assert len(a["grad_norms"]) == 3 and a["grad_norms"] == b["grad_norms"], pair
        assert all(v > 0.5 for v in a["grad_norms"])  # clipping acted
        assert a["losses"] == b["losses"], pair
    assert ours[0]["grad_norms"] == ours[1]["grad_norms"]  # one total, on every rank


def test_train_flags_refuse_what_does_not_apply(capsys):
    from minifsdp.train import parse_args

    for argv, msg in [
        (["--strategy", "zero2", "--clip-grad-norm", "1"], "--clip-grad-norm applies to"),
        (["--strategy", "fsdp1", "--clip-grad-norm", "0"], "must be > 0"),
        (["--strategy", "fsdp1", "--backward-prefetch", "implicit"], "FSDP1 takes backward_pre"),
        (["--strategy", "fsdp2", "--backward-prefetch", "backward_post"], "fsdp1 and torch_fsdp1"),
        (["--strategy", "fsdp1", "--forward-prefetch", "explicit"], "FSDP1 has no explicit"),
        (["--strategy", "fsdp2", "--buffer-dtype", "bf16"], "--buffer-dtype applies to"),
        (["--strategy", "fsdp1", "--output-dtype", "bf16"], "--output-dtype applies to"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert msg in capsys.readouterr().err, argv
    args = parse_args(["--strategy", "fsdp2"])  # FSDP2's defaults are untouched
    assert (args.forward_prefetch, args.backward_prefetch) == ("none", "implicit")


@pytest.mark.parametrize("n", BY_WORLD)
def test_frozen_parameters_bit_for_bit_with_torch_fsdp1(launched, n):
    """Frozen parameters inside units (and a unit all frozen): trainable ones step as torch's,
    frozen ones never move, their gradient is zero, the clip norm leaves them out."""
    for name, c in cases(launched, n, "frozen"):
        assert_torch_bitwise(name, c)
        assert c["events"] == c["torch_events"], name
        assert c["norms"] == c["torch_norms"], name
        assert c["frozen_unchanged"] and all(c["frozen_unchanged"]), name
        assert c["frozen_grads_zero"], name
    # every rank holds frozen elements, so every rank's optimizer step had some to keep
    assert all(c["frozen_slices"] > 0 for name, c in cases(launched, n, "frozen")
               if name.startswith("frozen (rank"))


# ---- in process, one rank: bad input -----------------------------------------------------------

INNER = fsdp1.transformer_auto_wrap_policy({nn.Sequential})  # the root is never asked


def two_blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))


def test_bad_knobs_are_clear_errors(one_rank):
    with pytest.raises(ValueError, match=r"MixedPrecision.param_dtype must be a floating "
                                         r"torch.dtype or None, got 'bf16'"):
        fsdp1.MixedPrecision(param_dtype="bf16")
    with pytest.raises(ValueError, match="MixedPrecision.reduce_dtype .* got torch.int64"):
        fsdp1.MixedPrecision(reduce_dtype=torch.int64)
    with pytest.raises(ValueError, match="mixed_precision must be a MixedPrecision"):
        fsdp1.FullyShardedDataParallel(two_blocks(), mixed_precision=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown backward_prefetch 'backward'"):
        fsdp1.FullyShardedDataParallel(two_blocks(), backward_prefetch="backward")
    model = fsdp1.FullyShardedDataParallel(two_blocks(), auto_wrap_policy=INNER)
    unit = model.get_submodule("1")
    assert isinstance(unit, fsdp1.FullyShardedDataParallel)
    with pytest.raises(RuntimeError, match="no_sync\\(\\) is called on the root.*unit '1'"):
        with unit.no_sync():
            pass
    with pytest.raises(RuntimeError, match="clip_grad_norm_\\(\\) is called on the root"):
        unit.clip_grad_norm_(1.0)


def test_errors_name_the_full_parameter_path(one_rank):
    """A tied parameter that another unit already flattened, found inside unit "1"."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    m[1][1].weight = m[0].weight
    m[0] = fsdp1.FullyShardedDataParallel(m[0])  # by hand: m[0].weight flattened there
    with pytest.raises(ValueError, match=r"parameter '1\.1\.weight' is tied to a parameter"):
        fsdp1.FullyShardedDataParallel(m, auto_wrap_policy=INNER)


def test_one_rank_mixed_precision_and_clip(one_rank):
    """bf16 compute, fp32 shards and gradients, a clipped gradient, fp32 full parameters."""
    torch.manual_seed(1)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    model = fsdp1.FullyShardedDataParallel(
        two_blocks(), mixed_precision=fsdp1.MixedPrecision(param_dtype=torch.bfloat16))
    out = model(x)
    assert out.dtype == torch.bfloat16
    ((out.float() - y) ** 2).mean().backward()
    [flat] = model.parameters()
    assert flat.dtype == torch.float32 and flat.grad.dtype == torch.float32
    norm = model.clip_grad_norm_(1e-3)
    assert math.isfinite(float(norm)) and float(norm) > 1e-3
    assert float(flat.grad.norm()) <= 1e-3 * (1 + 1e-5)
    with fsdp1.summon_full_params(model):  # fp32, and writes land in the fp32 shard
        weight = dict(model.named_parameters())["1.1.weight"]
        assert weight.dtype == torch.float32
        weight.fill_(0.1 + 2 ** -20)  # not a bf16 number: survives only in fp32
    assert torch.equal(fsdp1.full_state_dict(model)["1.1.weight"],
                       torch.full((4,), 0.1 + 2 ** -20))
    assert model(x).dtype == torch.bfloat16  # and the next forward gathers bf16 again
