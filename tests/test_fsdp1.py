"""FSDP1 (``minifsdp.fsdp1``: fully_sharded.py, flat_param.py, wrap.py): the same training as
one process and as torch's FSDP1, the collectives of each sharding strategy, and the memory of
FULL_SHARD.

Two kinds of launch (each test declares the ones it reads; the module fixture ``launched``
starts them, ``PARALLEL`` at a time):

* ``tests/workers/fsdp1_worker.py`` at N = 2, 3, 4 runs 16 configurations in one job each:
  every sharding strategy x every auto-wrap (none, size, transformer) on the GPT, tied
  embeddings, CPU offload, the CNN, and an MLP of odd sizes whose parameters the 16-byte
  alignment separates (without it, N = 3 differs from torch by 9e-10: Note [alignment]); each
  next to torch FSDP1 and to one process on the same data. Start-up (seconds per rank)
  dominates a launch; a configuration costs ~0.3 s.
* ``minifsdp.train`` end to end at N = 2: ``--strategy fsdp1`` (tied GPT, a unit per block,
  ``--cpu-offload``) next to ``torch_fsdp1`` with the same options (no offload: torch's needs
  an accelerator), ``single --data-shards 2`` and ``torch_ddp``, saved with ``--save-params``;
  fsdp1 and torch DDP are tracked (``--track-memory``) for the memory test.

7 launches, 16 processes (~100 s of CPU). The rest runs in process, at world size 1. Parameter
counts that N does not divide: the GPT's 30,592 (28,544 tied) at N = 3 and the CNN's 1,199,882
at N = 4 (worker); torch's 16-byte alignment pads units too (the worker's MLP).

Exactness. Against torch FSDP1: bit for bit at every N, losses and parameters. We lay out the
flat parameters as torch does (Note [alignment] in minifsdp/fsdp1/flat_param.py) and divide
gradients as it does (Note [divide before and after] in minifsdp/fsdp1/fully_sharded.py), so the
same reduce-scatters add the same numbers in the same order. Against one process: bit for bit
at N = 2 (Note [bitwise parity] in minifsdp/train.py); at N = 3, 4 the single process sums its
N shard gradients in another order, so, as in test_zero.py, we require no more distance from it than
twice torch FSDP1's own (which is then the same distance, since we equal torch). Measured
(parameters after 3 steps, lr 1e-3): N = 3 GPT 8.5e-7 to 1.0e-6, tied GPT 4.0e-6, CNN 7.0e-6;
N = 4 GPT 1.8e-7 to 4.2e-7, CNN 8.1e-6; losses equal or 1 ulp (4.8e-7) apart. A real bug (a
missing division, a stale shard, a unit gathered from the wrong rank) is off by ~lr.
"""

import copy
import functools
import math
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from jobs import Job

from minifsdp import fsdp1, parity
from minifsdp.fsdp1.flat_param import FlatParamHandle, flat_layout, registered_params
from minifsdp.fsdp1.fully_sharded import _clean
from minifsdp.fsdp1.wrap import (
    assign_owners,
    plan_units,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from minifsdp.launch import RunResult
from minifsdp.models import GPT, Block, GPTConfig, MnistCNN, build_model
from minifsdp.parity import assert_bitwise, max_abs_diff

PARALLEL = 2
WORKER = str(Path(__file__).parent / "workers" / "fsdp1_worker.py")
WORKER_WORLDS = (2, 3, 4)
GPT_ARGS = ("--model", "gpt", "--n-head", "4", "--d-model", "32", "--seq-len", "32",
            "--optimizer", "adamw")
MODEL_ARGS = {
    "gpt_tied": (*GPT_ARGS, "--n-layer", "2", "--tie-embeddings"),
    # 4 blocks: big enough that FULL_SHARD holds fewer parameters than DDP
    "gpt4_tied": (*GPT_ARGS, "--n-layer", "4", "--tie-embeddings"),
}
TRACKED = 2  # --track-memory: step 2 has the optimizer state from the start (memory[1])


class Case(NamedTuple):
    n: int
    model: str
    sharding: str
    wrap: str
    min_params: int = 10_000
    offload: bool = False  # fsdp1 only: torch's CPUOffload needs an accelerator
    steps: int = 3
    batch: int = 24


TRAIN_CASES = {
    "n2_gpt4_tied_full_shard_transformer_offload": Case(2, "gpt4_tied", "full_shard",
                                                        "transformer", offload=True, batch=32),
    "n3_gpt_tied_full_shard_size_offload": Case(3, "gpt_tied", "full_shard", "size",
                                                min_params=3000, offload=True),
}
MEMORY_CASE = "n2_gpt4_tied_full_shard_transformer_offload"  # tracked, next to torch DDP
GPT_SIZE_3000 = ["(root)"] + [f"blocks.{i}.{m}" for i in range(2)
                              for m in ("attn.qkv", "mlp.fc", "mlp.proj")]


def units_of(model: str, wrap: str) -> list[str]:
    """The units, as named in the comm log's tags (the GPT's size policy at 3000 elements)."""
    if wrap == "none":
        return ["(root)"]
    if model == "mlp":  # the worker's Linear-Tanh-Linear; its root keeps no parameter
        return ["0", "2"]
    if model == "cnn":
        return ["(root)", "conv2", "fc1"]
    if wrap == "transformer":
        return ["(root)"] + [f"blocks.{i}" for i in range(4 if "gpt4" in model else 2)]
    return GPT_SIZE_3000


def train_job(strategy: str, name: str) -> Job:
    """``minifsdp.train`` with ``strategy`` on train case ``name`` (``single`` on one process,
    with N data shards), run in runs/tests/fsdp1_<strategy>_<name>."""
    c = TRAIN_CASES[name]
    args = ("--strategy", strategy, *MODEL_ARGS[c.model], "--steps", c.steps, "--global-batch",
            c.batch, "--save-params", "--sharding-strategy", c.sharding, "--auto-wrap", c.wrap,
            "--min-num-params", c.min_params)
    if strategy == "single":
        return Job(f"single_{name}", "minifsdp.train", 1, (*args, "--data-shards", c.n))
    if strategy == "fsdp1" and c.offload:
        args += ("--cpu-offload",)
    if name == MEMORY_CASE and strategy in ("fsdp1", "torch_ddp"):
        args += ("--track-memory", TRACKED)
    return Job(f"{strategy}_{name}", "minifsdp.train", c.n, args)


# the worker at each N (runs/tests/fsdp1_worker_2, ...); the tests parametrized by N read it
WORKERS = {n: Job(f"worker_{n}", WORKER, n) for n in WORKER_WORLDS}
BY_WORLD = [pytest.param(n, marks=pytest.mark.launches(WORKERS[n])) for n in WORKER_WORLDS]
# each train case reads its fsdp1 run; the parity test also torch's and the one process's
TRAIN_NAMES = [pytest.param(name, marks=pytest.mark.launches(train_job("fsdp1", name)))
               for name in TRAIN_CASES]
PARITY_NAMES = [pytest.param(name, marks=pytest.mark.launches(
    *(train_job(s, name) for s in ("fsdp1", "torch_fsdp1", "single")))) for name in TRAIN_CASES]


@pytest.fixture(scope="module")
def train_run(launched):
    """``train_run(strategy, case)`` -> ``(RunResult, {name: final full parameter})``."""

    @functools.cache
    def get(strategy: str, name: str) -> tuple[RunResult, dict[str, torch.Tensor]]:
        run = launched[train_job(strategy, name)].result()
        return run, torch.load(run.out_dir / "params.pt", weights_only=True)

    return get


def worker_cases(launched, n: int) -> list[tuple[str, dict]]:
    """``("<case> (rank r)", results)`` of every case and rank of the worker at world size n."""
    ranks = launched[WORKERS[n]].result().ranks
    assert [r["world_size"] for r in ranks] == [n] * n
    assert all(len(r["cases"]) == 16 for r in ranks)
    return [(f"{name} (rank {r['rank']})", case) for r in ranks
            for name, case in r["cases"].items()]


RELATIVE_TO_TORCH = 2.0  # see the module docstring


# ---- parity: the worker's configurations ------------------------------------------------------

@pytest.mark.parametrize("worker_n", BY_WORLD)
def test_worker_parity_bit_for_bit_with_torch_fsdp1(launched, worker_n):
    for name, c in worker_cases(launched, worker_n):
        assert c["names"], f"{name}: state dict names or order differ"
        assert c["losses"] == c["torch_losses"], name
        assert c["vs_torch"] is None, f"{name}: {c['vs_torch']}"
        assert c["moved"] > 1e-3, name  # parity is vacuous if nothing trained
        if c["offloaded"] is not None:
            assert c["offloaded"], f"{name}: a shard is not in host memory"


@pytest.mark.parametrize("worker_n", BY_WORLD)
def test_worker_parity_with_one_process(launched, worker_n):
    for name, c in worker_cases(launched, worker_n):
        if worker_n == 2:
            assert c["losses"] == c["ref_losses"], name
            assert c["vs_ref"] is None, f"{name}: {c['vs_ref']}"
            continue
        torch_gap = max(abs(a - b) for a, b in zip(c["torch_losses"], c["ref_losses"]))
        gap = max(abs(a - b) for a, b in zip(c["losses"], c["ref_losses"]))
        assert c["torch_diff_ref"] < 1e-4 and torch_gap < 1e-5  # references agree to rounding
        assert c["diff_ref"] <= RELATIVE_TO_TORCH * c["torch_diff_ref"], name
        assert gap <= RELATIVE_TO_TORCH * torch_gap, name


@pytest.mark.parametrize("worker_n", BY_WORLD)
def test_worker_collectives_per_step(launched, worker_n):
    """Per step and unit (Note [sharding strategies]): FULL_SHARD all-gathers in forward and
    again in backward (not the root, which keeps its parameters), SHARD_GRAD_OP in forward
    only, NO_SHARD never; one reduce-scatter (NO_SHARD: all-reduce) of the gradient."""
    steps = 3  # the worker's STEPS
    for name, c in worker_cases(launched, worker_n):
        model, sharding, wrap = (c["config"][k] for k in ("model", "sharding", "wrap"))
        units = units_of(model, wrap)
        assert c["units"] == sorted(units), name
        assert c["calls"] == expected_calls(units, sharding, steps), name


def expected_calls(units: list[str], sharding: str, steps: int) -> dict[str, int]:
    out = {}
    for u in units:
        if sharding == "no_shard":
            out[f"all_reduce {u} grad"] = steps
            continue
        out[f"all_gather {u} forward"] = out[f"reduce_scatter {u} grad"] = steps
        if sharding == "full_shard" and u != "(root)":
            out[f"all_gather {u} backward"] = steps
    return out


# ---- parity and collectives: minifsdp.train end to end ---------------------------------------

@pytest.mark.parametrize("name", PARITY_NAMES)
def test_train_parity_with_torch_fsdp1_and_one_process(train_run, name):
    c = TRAIN_CASES[name]
    run, got = train_run("fsdp1", name)
    torch_run, theirs = train_run("torch_fsdp1", name)
    single_run, ref = train_run("single", name)
    assert [r["rank"] for r in run.ranks] == list(range(c.n))
    losses = run.ranks[0]["losses"]
    assert len(losses) == c.steps and losses == torch_run.ranks[0]["losses"]
    assert list(got) == list(theirs) == list(ref), "the unwrapped names, in the same order"
    for k in ref:
        assert type(got[k]) is torch.Tensor and got[k].shape == ref[k].shape, k
    assert_bitwise(got, theirs, where=name)
    ref_losses = single_run.ranks[0]["losses"]
    if c.n == 2:
        assert losses == ref_losses
        assert_bitwise(got, ref, names=("ours", "one process"), where=name)
    else:
        gap = max(abs(a - b) for a, b in zip(torch_run.ranks[0]["losses"], ref_losses))
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= RELATIVE_TO_TORCH * gap
        assert max_abs_diff(got, ref) <= RELATIVE_TO_TORCH * max_abs_diff(theirs, ref) < 1e-4


@pytest.mark.parametrize("name", TRAIN_NAMES)
def test_train_moved_every_parameter(train_run, name):
    """Parity is vacuous if nothing trained: every saved tensor left its initial value."""
    from minifsdp.dist import seed_everything
    from minifsdp.train import make_model, parse_args

    _, final = train_run("fsdp1", name)
    with torch.random.fork_rng():
        seed_everything(0)
        init = make_model(parse_args(list(MODEL_ARGS[TRAIN_CASES[name].model]))).state_dict()
    assert list(init) == list(final)
    assert min(float((final[k] - init[k]).abs().max()) for k in init) > 1e-4


@pytest.mark.parametrize("name", TRAIN_NAMES)
def test_train_collectives(train_run, name):
    """The collectives of Note [sharding strategies], each all-gather moving (N-1)/N of its
    unit's padded flat parameter; the units hold the model with less than 4 elements of
    alignment padding per parameter plus N per unit (the padding to a multiple of N); and
    backward's collectives are issued while backward runs, the final callback once per step."""
    c = TRAIN_CASES[name]
    run, _ = train_run("fsdp1", name)
    units = units_of(c.model, c.wrap)
    for r in run.ranks:
        calls = [x for x in r["comm"] if x["kind"] == "comm"]
        got: dict[str, int] = {}
        for x in calls:
            got[f"{x['op']} {x['tag']}"] = got.get(f"{x['op']} {x['tag']}", 0) + 1
        assert got == expected_calls(units, c.sharding, c.steps)
        unit = lambda x: x["tag"].rsplit(" ", 1)[0]
        padded = {unit(x): c.n * x["shape"][0] for x in calls if x["op"] == "all_gather"}
        for x in calls:
            if x["op"] == "all_gather":
                assert math.isclose(x["wire_bytes"], (c.n - 1) / c.n * 4 * padded[unit(x)])
            elif x["op"] == "reduce_scatter":
                assert x["shape"] == [padded[unit(x)]]
        psi, tensors = r["num_params"], 52  # the tied 4-block GPT's parameter tensors
        assert psi <= sum(padded.values()) < psi + 3 * tensors + c.n * len(units)
        spans = [x for x in r["comm"] if x["kind"] == "compute"]
        assert sum(x["op"] == fsdp1.FINAL_SPAN for x in spans) == c.steps
        backward = [(x["t_start"], x["t_end"]) for x in spans if x["op"] == "backward"]
        for x in calls:
            if x["tag"].endswith(("backward", "grad")):
                assert any(a <= x["t_start"] <= b for a, b in backward), x


# ---- memory: FULL_SHARD at N = 2, step 2, vs torch DDP ----------------------------------------

def peaks(rank_json: dict) -> dict:
    tl = rank_json["memory"][TRACKED - 1]["timeline"]
    return {c: max(s[c] for s in tl) for c in ("params", "grads", "optimizer", "total")}


@pytest.mark.launches(train_job("fsdp1", MEMORY_CASE), train_job("torch_ddp", MEMORY_CASE))
def test_memory_of_full_shard(train_run):
    """The tied GPT (4 blocks, 53,952 parameters) with each block a unit, at N = 2, CPU
    offload (on the CPU: the same memory, plus a transient copy of a shard counted as comm).
    Parameters at their peak: every unit's shard, plus the root's unsharded flat parameter
    (kept from forward to backward) and one block's (the one being computed): 171,264 bytes
    where DDP holds 4 Psi = 215,808. When the optimizer steps only the sharded gradients exist
    (the unsharded ones were freed after their reduce-scatter), and AdamW's state is 1/N of
    DDP's plus one step counter per unit. (torch FSDP1 peaks a block higher: it prefetches the
    next block in backward, chapter 06's subject.)"""
    run, _ = train_run("fsdp1", MEMORY_CASE)
    ddp, _ = train_run("torch_ddp", MEMORY_CASE)
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, seq_len=32, n_layer=4, n_head=4, d_model=32,
                        tie_embeddings=True))
    psi = sum(p.numel() for p in gpt.parameters())
    blocks = [[p.numel() for p in b.parameters()] for b in gpt.blocks]
    block_ids = {id(p) for b in gpt.blocks for p in b.parameters()}
    root = [p.numel() for p in gpt.parameters() if id(p) not in block_ids]
    padded = [flat_layout(u, 2, align=4)[1] for u in [root, *blocks]]
    shards = sum(padded) // 2
    for r, d in zip(run.ranks, ddp.ranks):
        ours, theirs = peaks(r), peaks(d)
        assert ours["params"] == 4 * (shards + padded[0] + max(padded[1:])) == 171_264
        assert theirs["params"] == 4 * psi and ours["params"] < theirs["params"]
        assert ours["total"] < theirs["total"]
        assert ours["optimizer"] == 8 * shards + 4 * len(padded)
        step = [s for s in r["memory"][TRACKED - 1]["timeline"] if s["phase"] == "optimizer step"]
        assert step and all(s["grads"] == 4 * shards for s in step)
        # at most two units' unsharded gradients at once (Note [final callback])
        assert ours["grads"] <= 4 * (shards + 2 * max(padded))


# ---- in process, one rank ---------------------------------------------------------------------

def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 7), nn.Tanh(), nn.Linear(7, 3))  # 70 + 7 + 21 + 3


def test_flat_layout_aligns_and_pads():
    assert flat_layout([70, 7, 21, 3], world_size=3, align=4) == ([0, 72, 80, 104], 108)
    assert flat_layout([70, 7, 21, 3], world_size=3) == ([0, 70, 77, 98], 102)
    assert flat_layout([8, 4], world_size=4, align=4) == ([0, 8], 12)  # nothing to pad
    assert flat_layout([30_592], world_size=3, align=4)[1] == 30_594


def test_shards_of_all_ranks_make_the_flat_parameter():
    """Three handles built as ranks 0, 1, 2 would: each holds 36 of the 108 elements; together,
    in rank order, they are the four parameters at their offsets with zeros in the gaps."""
    ref = mlp()
    params = [p.detach().flatten() for p in ref.parameters()]
    shards = []
    for rank in range(3):
        model = copy.deepcopy(ref)
        h = FlatParamHandle(registered_params(model), rank=rank, world_size=3)
        assert [(i.fqn, tuple(i.shape), i.numel, i.offset) for i in h.infos] == [
            ("0.weight", (7, 10), 70, 0), ("0.bias", (7,), 7, 72), ("2.weight", (3, 7), 21, 80),
            ("2.bias", (3,), 3, 104)]
        assert h.flat_param.shape == (36,) and h.flat_param.infos is h.infos
        assert list(model.parameters()) == []  # only views are left in the modules
        shards.append(h.flat_param.detach())
    flat = torch.cat(shards)
    want = torch.zeros(108)
    for p, o in zip(params, [0, 72, 80, 104]):
        want[o:o + p.numel()] = p
    assert torch.equal(flat, want)
    assert torch.equal(flat[70:72], torch.zeros(2)) and torch.equal(flat[107:], torch.zeros(1))


def test_views_share_the_unsharded_storage(one_rank):
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    h = FlatParamHandle(registered_params(model), rank=0, world_size=1)
    assert not h.is_unsharded and h.unsharded.untyped_storage().nbytes() == 0  # freed
    h.unshard()
    h.use_unsharded_views()
    base = h.unsharded.data_ptr()
    for info, want in zip(h.infos, before):
        view = getattr(info.module, info.name)
        assert view.data_ptr() == base + 4 * info.offset and torch.equal(view, want)
    round_trip = h.unflatten(h.unsharded.detach())
    assert all(torch.equal(a, b) for a, b in zip(round_trip, before))
    h.reshard()
    assert h.unsharded.untyped_storage().nbytes() == 0
    h.unshard()  # the same storage comes back, with the data
    assert h.unsharded.data_ptr() != 0 and torch.equal(model[0].weight, before[0])


@pytest.mark.parametrize("kind,policy,units", [
    ("cnn", size_based_auto_wrap_policy(10_000), ["conv2", "fc1"]),
    ("gpt", transformer_auto_wrap_policy({Block}), ["blocks.0", "blocks.1"]),
    ("gpt", size_based_auto_wrap_policy(3000),
     [f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "mlp.fc", "mlp.proj")]),
])
def test_policies_pick_the_units_torch_picks(one_rank, kind, policy, units):
    """Our policies, run by us and by torch's FSDP1, and torch's own policy run by us: the same
    units (the GPT here: d_model 32, as in the launches)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import wrap

    def make():
        torch.manual_seed(0)
        return build_model(kind, **({} if kind == "cnn" else {"d_model": 32}))

    def wrapped(model, cls):
        return sorted(_clean(n) for n, m in model.named_modules() if isinstance(m, cls))

    assert [n for n, _ in plan_units(make(), policy)] == units
    ours = fsdp1.FSDP(make(), auto_wrap_policy=policy)
    theirs = TorchFSDP(make(), device_id=torch.device("cpu"), auto_wrap_policy=policy)
    assert wrapped(ours, fsdp1.FSDP) == wrapped(theirs, TorchFSDP) == sorted(["", *units])
    torch_policy = (functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=10_000)
                    if kind == "cnn" else None)
    if torch_policy:
        assert wrapped(fsdp1.FSDP(make(), auto_wrap_policy=torch_policy), fsdp1.FSDP) == \
            sorted(["", *units])


def test_tied_parameter_goes_to_the_unit_enclosing_its_users():
    gpt = GPT(GPTConfig(tie_embeddings=True))
    owner = assign_owners(gpt, [gpt.tok_emb, gpt.head, gpt.blocks[0]])
    assert owner[id(gpt.tok_emb.weight)] is gpt  # used by tok_emb and head: only the root has both
    assert owner[id(gpt.blocks[0].attn.qkv.weight)] is gpt.blocks[0]
    assert owner[id(gpt.blocks[1].attn.qkv.weight)] is gpt


def test_wrapping_a_module_twice_is_an_error(one_rank):
    gpt = GPT(GPTConfig(d_model=32))
    fsdp1.FSDP(gpt.blocks[0])
    with pytest.raises(ValueError, match=r"Block \(\(root\)\) is already wrapped"):
        fsdp1.FSDP(gpt.blocks[0])
    with pytest.raises(ValueError, match=r"Block \(blocks.0\) is already wrapped by another"):
        fsdp1.FSDP(gpt)  # blocks.0 is another wrapper's unit, not replaced by it in the model
    inner = fsdp1.FSDP(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="FullyShardedDataParallel .* is already wrapped"):
        fsdp1.FSDP(inner)


def test_bad_input_is_a_clear_error(one_rank):
    with torch.device("meta"):
        meta = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="'weight' is on the meta device"):
        fsdp1.FSDP(meta)
    with pytest.raises(ValueError, match="unknown sharding strategy 'hybrid_shard'; choose from"):
        fsdp1.FSDP(nn.Linear(2, 2), sharding_strategy="hybrid_shard")
    with pytest.raises(ValueError, match="cpu_offload must be a CPUOffload"):
        fsdp1.FSDP(nn.Linear(2, 2), cpu_offload=True)
    with pytest.raises(ValueError, match="auto_wrap_policy must be callable"):
        fsdp1.FSDP(nn.Linear(2, 2), auto_wrap_policy=10_000)
    with pytest.raises(ValueError, match="layer_classes must be nn.Module subclasses"):
        transformer_auto_wrap_policy(["Block"])
    tied = GPT(GPTConfig(d_model=32, tie_embeddings=True))
    tied.tok_emb = fsdp1.FSDP(tied.tok_emb)  # by hand: the head's weight is flattened in there
    with pytest.raises(ValueError, match="'head.weight' is tied to a parameter that unit 'Embed"):
        fsdp1.FSDP(tied)


def test_checkpointing_a_whole_unit_is_refused_clearly(one_rank):
    """``checkpoint(unit, x)`` would re-run the unit's forward, and its unshard/reshard, inside
    backward; FSDP1 here does not handle that (fsdp2 does), so the recomputation raises."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0] = fsdp1.FSDP(model[0])
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="activation checkpointing of a whole unit is not "
                                           "supported"):
        checkpoint(model, x, use_reentrant=False).sum().backward()


def train_steps(model, opt, gpt_cfg, steps=3, micro=1, no_grad_eval=False) -> list[float]:
    losses = []
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        for _ in range(micro):
            x = torch.randint(0, gpt_cfg.vocab_size, (4, 16), generator=g)
            loss = F.cross_entropy(model(x).flatten(0, 1), x.roll(-1, 1).flatten())
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
        if no_grad_eval:
            with torch.no_grad():
                losses.append(float(model(x).sum()))
    return losses


@pytest.mark.parametrize("sharding", ["full_shard", "shard_grad_op", "no_shard"])
@pytest.mark.parametrize("setup", ["one_unit", "blocks", "blocks_offload", "tied_size_2000",
                                   "accumulate"])
def test_one_rank_trains_exactly_like_the_plain_model(one_rank, sharding, setup):
    """At N = 1 FSDP1 must be the identity: the same losses and parameters, bit for bit, for
    every strategy, with units, CPU offload, a tied weight whose users would sit in two units
    (tok_emb and head are each picked by the size policy, so the root takes the weight), two
    backwards per step, and evaluation forwards in between."""
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32,
                    tie_embeddings=setup == "tied_size_2000")
    torch.manual_seed(0)
    plain = GPT(cfg)
    model = copy.deepcopy(plain)
    policy = {"blocks": transformer_auto_wrap_policy({Block}),
              "blocks_offload": transformer_auto_wrap_policy({Block}),
              "tied_size_2000": size_based_auto_wrap_policy(2000)}.get(setup)
    wrapped = fsdp1.FSDP(model, sharding_strategy=sharding, auto_wrap_policy=policy,
                         cpu_offload=fsdp1.CPUOffload(setup == "blocks_offload"))
    if setup == "tied_size_2000":
        assert wrapped.tok_emb._handle is None and wrapped.head._handle is None  # empty units
    micro = 2 if setup == "accumulate" else 1
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, wrapped)]
    want = train_steps(plain, opts[0], cfg, micro=micro, no_grad_eval=True)
    got = train_steps(wrapped, opts[1], cfg, micro=micro, no_grad_eval=True)
    assert got == want
    ref, sd = plain.state_dict(), wrapped.state_dict()
    assert list(sd) == list(ref)
    parity.assert_bitwise(sd, ref, names=("fsdp1", "plain"))
    handles = [u._handle for u in wrapped._units if u._handle is not None]
    assert all(h.is_unsharded == (sharding == "no_shard" and not h.offload) for h in handles)


def test_names_inside_and_outside_summon_full_params(one_rank):
    torch.manual_seed(0)
    cnn = MnistCNN(dropout=0.0)
    names = [(n, tuple(p.shape)) for n, p in cnn.named_parameters()]
    model = fsdp1.FSDP(cnn, auto_wrap_policy=size_based_auto_wrap_policy(10_000))
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [
        ("flat_param", (1610,)), ("conv2.flat_param", (18_496,)), ("fc1.flat_param", (1_179_776,))]
    with fsdp1.summon_full_params(model):
        assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == names
        model.fc2.bias.fill_(1.0)  # written back on exit
        model.fc1.weight[0, 0] = 2.0
    with fsdp1.summon_full_params(model, writeback=False):
        assert torch.equal(model.fc2.bias, torch.ones(10)) and model.fc1.weight[0, 0] == 2.0
        model.fc2.bias.zero_()  # not written back
    assert torch.equal(fsdp1.full_state_dict(model)["fc2.bias"], torch.ones(10))
    assert [n for n, _ in model.named_parameters()][0] == "flat_param"
    x = torch.randn(2, 1, 28, 28)
    cnn_plain = MnistCNN(dropout=0.0)
    cnn_plain.load_state_dict(fsdp1.full_state_dict(model))
    with torch.no_grad():
        assert_bitwise(model(x), cnn_plain(x), names=("FSDP1", "plain CNN"), where="logits")


def test_sync_module_states_broadcasts_rank_0(one_rank):
    """At one rank the broadcast changes nothing, but it runs (one logged call per tensor)."""
    from minifsdp import comm

    model = mlp()
    want = [p.detach().clone() for p in model.parameters()]
    with comm.logging_comm() as log:
        wrapped = fsdp1.FSDP(model, sync_module_states=True)
    assert log.summary()["broadcast"]["calls"] == 4
    with fsdp1.summon_full_params(wrapped):
        assert all(torch.equal(p, w) for p, w in zip(wrapped.parameters(), want))
