"""Activation checkpointing, as chapter 05 teaches it: what a block saves with and without it
(Note [what a checkpointed block saves] in minifsdp/analytic.py), what the recomputation
costs (Note [early stop] in minifsdp/models.py), and how it composes with FSDP2's
``reshard_after_forward``.

In process: the saved bytes of one Block and of a whole GPT equal ``minifsdp.analytic``'s
prediction exactly; the recomputation adds exactly the qkv and fc matmuls' FLOPs. One torchrun
job at N = 2 (``minifsdp.demos.activation_checkpointing``, the notebook's worker) runs our
``fully_shard`` with checkpointing off/on x ``reshard_after_forward`` True/False, with torch's
``checkpoint_wrapper``, our FSDP1 with the regions inside its units, and torch's ``fully_shard``
as the oracle: every final parameter bit for bit equal, the same collectives as torch, the
tracked activation bytes equal to the prediction.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from jobs import Job, fixture_of
from torch.utils.flop_counter import FlopCounterMode

from minifsdp import analytic
from minifsdp.demos import activation_checkpointing as demo
from minifsdp.demos.activation_checkpointing import saved_for_backward
from minifsdp.models import GPT, GPTConfig, apply_activation_checkpointing

PARALLEL = 1
OURS = [f"ours {ac} {raf}" for ac in ("plain", "ac") for raf in ("raf", "keep")]


# the notebook's worker at N = 2, run in runs/tests/activation_checkpointing_demo
DEMO = Job("demo", "minifsdp.demos.activation_checkpointing", 2)


@fixture_of(DEMO)
def ranks(launched) -> list[dict]:
    return launched[DEMO].result().ranks


@pytest.fixture(scope="module", autouse=True)
def _start_early(launched):
    """Start the job with the module's first test: the in-process tests run meanwhile."""


def gpt(ac: bool, **cfg) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    return apply_activation_checkpointing(model) if ac else model


# ---- in process ----------------------------------------------------------------------------

CFGS = [dict(vocab_size=64, seq_len=16, n_layer=1, n_head=4, d_model=32),
        dict(vocab_size=96, seq_len=24, n_layer=1, n_head=2, d_model=48),
        dict(vocab_size=64, seq_len=16, n_layer=1, n_head=4, d_model=32, dropout=0.1)]


@pytest.mark.parametrize("cfg", CFGS)
@pytest.mark.parametrize("ac", [False, True])
def test_one_block_saves_what_the_formula_says(cfg, ac):
    block, batch = gpt(ac, **cfg).blocks[0], 3
    x = torch.randn(batch, cfg["seq_len"], cfg["d_model"], requires_grad=True)
    rows = saved_for_backward(block, x)
    measured = sum(r["bytes"] for r in rows if r["new"])
    assert measured == analytic.gpt_block_activation_bytes(batch, GPTConfig(**cfg), None, ac)
    if ac:  # outside the regions: ln1 and ln2 (input, mean, rstd), the two regions' inputs
        assert [r["op"] for r in rows] == ["layer_norm"] * 3 + ["checkpoint"] + (
            ["layer_norm"] * 3 + ["checkpoint"])


@pytest.mark.parametrize("cfg", CFGS[:2])
def test_the_recomputation_recreates_what_the_regions_save(cfg):
    """What a region saves when it is not checkpointed, minus its input (which the checkpoint
    kept), is what its recomputation brings back: ``gpt_recompute_bytes``."""
    block, batch = gpt(False, **cfg).blocks[0], 2
    x = torch.randn(batch, cfg["seq_len"], cfg["d_model"], requires_grad=True)
    h = block.ln1(x).detach().requires_grad_()
    measured = {name: sum(r["bytes"] for r in saved_for_backward(region, h)[1:] if r["new"])
                for name, region in (("attn", block.attn), ("mlp", block.mlp))}
    assert measured == analytic.gpt_recompute_bytes(batch, GPTConfig(**cfg))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_whole_gpt_saves_what_the_formula_says(dropout):
    cfg = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32, dropout=dropout)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    for ac in (False, True):
        model = gpt(ac, **cfg)

        def loss(x, y, model=model):
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

        loss.parameters = model.parameters  # saved_for_backward leaves parameters out
        rows = saved_for_backward(loss, x, y)
        expected = analytic.activation_bytes(model, 4, activation_checkpointing=ac)
        assert sum(r["bytes"] for r in rows if r["new"]) == expected, ac
    with pytest.raises(ValueError, match="GPT's blocks only"):
        analytic.activation_bytes("cnn", 4, activation_checkpointing=True)


def test_the_recomputation_skips_each_regions_last_matmul():
    """Note [early stop]: the extra matmul FLOPs are exactly qkv's and fc's, n_layer * 2BT*7C^2;
    with early stop off the whole region runs again (proj's 2BT*5C^2 too)."""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    cfg = dict(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))

    def flops(ac: bool) -> int:
        model = gpt(ac, **cfg)
        with FlopCounterMode(display=False) as fc:
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        return fc.get_total_flops()

    bt, c = 3 * 16, 32
    assert flops(True) - flops(False) == 2 * 2 * bt * 7 * c * c
    with set_checkpoint_early_stop(False):
        assert flops(True) - flops(False) == 2 * 2 * bt * 12 * c * c


def test_saved_for_backward_refuses_a_call_that_saves_nothing():
    with pytest.raises(ValueError, match="nothing was saved"):
        saved_for_backward(torch.nn.Linear(2, 2).requires_grad_(False), torch.ones(1, 2))


# ---- one torchrun job at N = 2 -------------------------------------------------------------

def test_every_configuration_is_bitwise_equal(ranks):
    """Checkpointing, resharding or not, and torch's wrapper change no bit: every final full
    parameter equals ``ours plain raf``'s on both ranks, and so does torch's fully_shard."""
    for r in ranks:
        ref = r["configs"]["ours plain raf"]["losses"]
        for name, c in r["configs"].items():
            assert c["divergence"] is None, c["divergence"]
            assert c["bitwise"] and c["losses"] == ref, (r["rank"], name)
    assert len(ranks[0]["configs"]) == 10


def test_all_gathers_per_step_as_torch(ranks):
    """The recomputation needs the block's parameters, and the pre-backward all-gather (there
    if the block resharded after forward) serves it and the gradients alike: checkpointing
    adds no collective, with our regions or torch's whole-block wrapper, ours as torch's."""
    n_layer, groups = demo.CFG.n_layer, demo.CFG.n_layer + 1
    for r in ranks:
        c = {k: v["counts"] for k, v in r["configs"].items()}
        for name in OURS:
            keep, ac = name.endswith("keep"), " ac" in name
            assert c[name].get("forward all_gather") == groups, name
            assert c[name].get("backward all_gather", 0) == (0 if keep else n_layer), name
            assert c[name].get("backward reduce_scatter") == groups, name
            for op in ("attention", "gelu"):  # one more forward of each region in backward
                assert c[name].get(f"forward {op}") == n_layer, name
                assert c[name].get(f"backward {op}", 0) == (n_layer if ac else 0), name
        assert c["ours ac raf"] == c["torch ac"] == c["ours wrapper raf"] == c["torch wrapper"]
        assert c["ours plain raf"] == c["torch plain"] == c["fsdp1 plain"]
        assert c["fsdp1 ac"] == c["ours ac raf"]  # FSDP1: regions inside its units


def test_tracked_activations_equal_the_prediction(ranks):
    """At the end of forward the tracker's activations are what autograd saved, the batch and
    the 4-byte loss: ``analytic.activation_bytes`` + 4, exactly, in a real FSDP2 run."""
    cfg, batch = GPTConfig(**ranks[0]["cfg"]), ranks[0]["local_batch"]
    for r in ranks:
        for name in OURS:
            predicted = analytic.gpt_activation_bytes(batch, cfg, None, " ac" in name) + 4
            assert r["configs"][name]["end_of_forward"]["activations"] == predicted, name


def test_peaks_of_the_four(ranks):
    """Checkpointing lowers the peak, keeping blocks unsharded raises it; at the end of
    forward the kept blocks' unsharded parameters are there, whole, next to their shards."""
    for r in ranks:
        peak = {k: r["configs"][k]["memory"]["peak"] for k in OURS}
        assert peak["ours ac raf"] < peak["ours plain raf"] < peak["ours plain keep"]
        assert peak["ours ac raf"] < peak["ours ac keep"] < peak["ours plain keep"]
        fwd = {k: r["configs"][k]["end_of_forward"]["params"] for k in OURS}
        block_bytes = 4 * sum(p.numel() for p in GPT(demo.CFG).blocks.parameters())
        assert fwd["ours plain keep"] - fwd["ours plain raf"] == block_bytes
        assert fwd["ours ac keep"] == fwd["ours plain keep"]


def test_flops_of_the_recomputation(ranks):
    """FlopCounterMode in the real run: the checkpointed step costs the qkv and fc matmuls
    of every block once more (attention is not counted: no CPU flop formula in torch 2.14)."""
    cfg, b = demo.CFG, ranks[0]["local_batch"]
    bt, c = b * cfg.seq_len, cfg.d_model
    for r in ranks:
        f = r["flops"]
        assert f["ac step"] - f["plain step"] == cfg.n_layer * 2 * bt * 7 * c * c
        head = 2 * bt * c * cfg.vocab_size
        assert f["forward"] - head == cfg.n_layer * 2 * bt * 12 * c * c  # the blocks' matmuls
        assert len(r["times"]["plain"]) == len(r["times"]["ac"]) == demo.TIMED
