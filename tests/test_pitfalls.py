"""Chapter 11's demo (``minifsdp.demos.pitfalls``) at N = 3: every pitfall's fix, ours against
torch's ``fully_shard`` bit for bit, and each pitfall's failure as the chapter says. The
notebook runs it at N = 2 (nbval); this runs the world size it does not, with uneven rows."""

from __future__ import annotations

import pytest
from jobs import Job, fixture_of

N3 = Job("n3", "minifsdp.demos.pitfalls", 3)


@fixture_of(N3)
def ranks(launched):
    return launched[N3].result().ranks


@pytest.mark.parametrize("section, key", [
    ("unused", "without_vs_torch"), ("unused", "with_vs_torch"),
    ("tokens", "mean_vs_torch"), ("tokens", "global_vs_torch"),
    ("forward_method", "vs_torch"), ("forward_method", "vs_one"), ("tied", "vs_torch")])
def test_ours_equals_torch_bit_for_bit(ranks, section, key):
    for r in ranks:
        assert r[section][key] is None, r[section][key]


def test_unused_params_fix_matches_one_process(ranks):
    u = ranks[0]["unused"]
    assert u["without_vs_one"] > 1e-3, u  # wrong without the fix ...
    assert u["with_vs_one"] < 1e-5, u     # ... right with it (fp32 sums in another order)


def test_global_token_count_matches_one_process(ranks):
    t = ranks[0]["tokens"]
    assert t["mean_vs_one"] > 1e-3 and t["global_vs_one"] < 1e-5, t


def test_generate_unregistered_fails_alike_and_registered_works(ranks):
    for r in ranks:
        errors = r["forward_method"]["errors"]
        assert errors["ours"] is not None and errors["ours"] == errors["torch"], errors
        assert "mixed torch.Tensor and DTensor" in errors["ours"], errors
        assert len(r["forward_method"]["tokens"][0]) == 2 + 6  # the prompt and 6 new tokens


def test_reset_iter_state_restores_the_clean_step(ranks):
    for r in ranks:
        reset, clean, stale = (r["reset"][k] for k in ("reset", "clean", "no reset"))
        assert reset["ops"] == clean["ops"], (reset["ops"], clean["ops"])
        assert stale["ops"] != clean["ops"], stale["ops"]  # the reduce-scatters move later


def test_tied_weight_split_over_groups_is_refused_and_one_group_trains_like_torch(ranks):
    for r in ranks:
        t = r["tied"]
        assert t["refused"]["ours"]["where"] == "fully_shard(model)", t["refused"]
        assert t["refused"]["torch"] is not None, t["refused"]  # torch refuses it lazily
        assert "shared" in t["refused"]["ours"]["error"], t["refused"]
        assert t["tied"] == {"ours": True, "torch": True, "one": True}, t["tied"]
        assert t["vs_torch"] is None, t["vs_torch"]
        assert t["list_tied"] == {"ours": True, "torch": True}, t["list_tied"]
        assert t["list_vs_torch"] is None, t["list_vs_torch"]
        assert t["vs_one"] < 1e-5 and t["list_vs_one"] < 1e-5, t
        assert t["vs_one"] < 1e-5, t["vs_one"]


def test_frozen_parameters_are_gathered_in_bf16_and_left_out_of_the_fp32_reduce_scatter(ranks):
    """Section 7: the frozen embedding is all-gathered (bf16) with the group but reduce-scattered
    only once unfrozen (fp32); ours issues torch's collectives and trains torch's bits, also after
    a first forward that saw the whole model frozen (pytorch#186998: ours reduced in bf16)."""
    for r in ranks:
        f, padded = r["frozen"], r["frozen"]["padded"]
        total, emb = sum(padded.values()), padded["emb.weight"]
        shard = total // len(ranks)  # each rank's all-gather input: its padded shards
        want = [[["all_gather", "bfloat16", shard], ["reduce_scatter", "float32", total - emb]]]
        want += 2 * [[["all_gather", "bfloat16", shard], ["reduce_scatter", "float32", total]]]
        for variant in ("fp32 base", "eval first"):
            v = f[variant]
            assert v["ops"]["ours"] == v["ops"]["torch"] == want, (variant, v["ops"])
            assert v["error"] == {"ours": None, "torch": None}, (variant, v["error"])
            assert v["vs_torch"] is None, (variant, v["vs_torch"])
            assert v["emb_kept"] == {"ours": True, "torch": True}, (variant, v["emb_kept"])


def test_a_bf16_frozen_base_unfrozen_later_fails_alike(ranks):
    for r in ranks:
        v = r["frozen"]["bf16 base"]
        assert v["error"]["ours"] is not None and v["error"]["ours"] == v["error"]["torch"], v
        assert v["error"]["ours"]["step"] == 1, v["error"]  # the first step after unfreezing
        assert "grad_dtype 'BFloat16'" in v["error"]["ours"]["error"], v["error"]
        assert v["ops"]["ours"] == v["ops"]["torch"], v["ops"]


HSDP4 = Job("hsdp_n4", "minifsdp.demos.pitfalls", 4, ("--hsdp",))


@fixture_of(HSDP4)
def hsdp(launched):
    return [r["hsdp"] for r in launched[HSDP4].result().ranks]


def test_hsdp_divide_factor_is_the_world_size(hsdp):
    """Section 8, a 2 x 2 mesh: the factor R S gives bitwise the gradients of no factor, the
    shard size S bitwise R times them; ours equals torch's bit for bit with each factor."""
    for h in hsdp:
        assert (h["R"], h["S"]) == (2, 2), h
        assert h["world_is_none"] and h["shard_is_R_world"], h
        assert h["vs_torch"] == {"none": None, "world": None, "shard": None}, h["vs_torch"]
        assert h["vs_one"]["world"] < 1e-5 and h["vs_one"]["none"] < 1e-5, h["vs_one"]
        assert h["vs_one"]["shard"] > 1e-3, h["vs_one"]
        assert h["flat_vs_hsdp"] < 1e-5, h["flat_vs_hsdp"]


ACC3 = Job("accumulation_n3", "minifsdp.demos.accumulation", 3)


@fixture_of(ACC3)
def acc(launched):
    return launched[ACC3].result().ranks


def test_accumulation_modes_equal_torch_in_collectives_and_bits(acc):
    for r in acc:
        for mode, d in r["modes"].items():
            assert d["same_ops"], (mode, d["ops"][1], d["torch_ops"][1])
            assert d["vs_torch"] is None, (mode, d["vs_torch"])
            assert d["vs_one"] < 1e-5, (mode, d["vs_one"])


def test_accumulation_collective_counts_and_held_memory(acc):
    K, psi, G = acc[0]["K"], acc[0]["params"], 3  # the root and two blocks
    want = {"every micro-batch": (K * (2 * G - 1), K * G), "no sync": (K * (2 * G - 1), G),
            "no sync, no reshard": (G + K * (G - 1), G), "once per step": (G, G)}
    for r in acc:
        for mode, d in r["modes"].items():
            for ops in d["ops"]:  # every step alike
                got = (sum(o.startswith("AG") for o in ops), sum(o.startswith("RS") for o in ops))
                assert got == want[mode], (mode, ops)
        held = {m: d["held"] for m, d in r["modes"].items()}
        assert held["every micro-batch"]["grads"] < 4 * psi, held  # a shard (padded at N = 3)
        assert held["no sync"]["grads"] == 4 * psi, held
        # the all-gather's output stays: N padded shards (4 psi plus the padding at N = 3)
        shards = held["every micro-batch"]["params"]
        assert held["no sync, no reshard"]["params"] == held["no sync"]["params"] + 3 * shards
        assert 3 * shards > 4 * psi, held
