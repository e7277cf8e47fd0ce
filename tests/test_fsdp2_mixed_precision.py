"""Mixed precision for ``minifsdp.fsdp2`` (Note [mixed precision] in
``minifsdp/fsdp2/mixed_precision.py``): parity with torch's ``fully_shard`` under the same
``MixedPrecisionPolicy``, bytes on the wire, memory, forward casts, and errors.

Two launches: ``tests/workers/fsdp2_mp_worker.py`` at N = 2 (tied GPT and MNIST CNN) and
N = 3 (GPT: d_model 32 over 3 ranks is uneven, so padding is cast and gathered too); the
worker also shards the GPT the way ``minifsdp.train`` does from ``--param-dtype bf16
--reduce-dtype fp32 --output-dtype fp32`` (its ``parse_args`` and ``shard_bottom_up``), for
``fsdp2`` and ``torch_fsdp2``. The oracle for mixed precision is torch's ``fully_shard`` (a
one-process run has no mixed-precision counterpart). The in-process tests at the end use a
world of one.

Tolerance: none -- every mixed-precision run matches torch bit for bit (measured, N = 2 and
3, every policy below). That is expected, not lucky: both cast the fp32 shard with the same
round-to-nearest-even conversion before the all-gather, run the same bf16 ops on the same
bf16 parameters, cast the bf16 gradients into the same reduce-dtype buffer layout, call the
same gloo reduce-scatter with the same op (AVG, or SUM between the same pre- and
post-divisions for fp16) and cast the result up the same way.
"""

import dataclasses
import doctest
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from jobs import Job, fixture_of
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
from torch.distributed.tensor import DTensor

from minifsdp import parity
from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard, mixed_precision
from minifsdp.memory import MemoryTracker
from minifsdp.numerics import adam_divergence_bound
from minifsdp.train import parse_args

PARALLEL = 2
JOB_PREFIX = "fsdp2_mp_"  # run names: runs/tests/fsdp2_mp_<job name>
WORKER = str(Path(__file__).parent / "workers" / "fsdp2_mp_worker.py")
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32


# the worker at N = 2 and 3, run in runs/tests/fsdp2_mp_worker_2 and _3
WORKERS = {n: Job(f"worker_{n}", WORKER, n) for n in (2, 3)}


@fixture_of(*WORKERS.values())
def worker(launched) -> dict[int, list[dict]]:
    return {n: launched[job].result().ranks for n, job in WORKERS.items()}


def cases(worker, suffix: str):
    """``(n, rank, case name, case)`` for every case whose name ends with ``suffix``."""
    return [(n, r["rank"], k, c) for n, ranks in worker.items() for r in ranks
            for k, c in r["cases"].items() if k.endswith(suffix)]


# ---- (a) a policy that changes nothing changes nothing -------------------------------------

def test_default_and_fp32_policies_are_bitwise_no_policy(worker):
    """``MixedPrecisionPolicy()`` and an all-fp32 policy (param, reduce, output) on an fp32
    model: parameters, losses and every collective record (op, bytes, dtype, tag) equal to
    no policy at all, GPT at N = 2 and 3, CNN at N = 2."""
    found = cases(worker, "_vs_none")
    assert len(found) == 2 * (2 * 2 + 3 * 1)  # 2 policies x (N=2: 2 ranks x 2 models, N=3)
    for n, rank, name, c in found:
        assert c["bitwise"] and c["losses_equal"] and c["comm_equal"], (n, rank, name,
                                                                         c["divergence"])


# ---- (b), (c): ours == torch under the same policy ------------------------------------------

@pytest.mark.parametrize("policy", ["bf16_fp32", "bf16_fp32_out", "bf16", "fp16",
                                    "bf16_fp32/no_sync", "bf16/no_sync"])
def test_matches_torch_fully_shard_with_the_same_policy(worker, policy):
    """bf16 params with an fp32 reduce (b), bf16 reduce (c), fp16 (pre/post division),
    ``output_dtype=fp32`` on the root, and accumulation over 2 micro-batches without sync
    (in fp32 / in bf16, Note [accumulating in the reduce dtype]): bit for bit, losses equal,
    at N = 2 (GPT; CNN for bf16_fp32 and bf16) and N = 3 (GPT). The master weights stay fp32,
    and the run really is low precision: measured distance from fp32 training after 3 Adam
    steps (lr 1e-2) 2.5e-2 .. 3.8e-2 (GPT, N = 2 and 3), 5.2e-2 (CNN). Its upper bound is
    Adam's, by construction: no two runs of 3 steps at lr 1e-2 can be further apart than
    0.0601 whatever their gradients (``numerics.adam_divergence_bound``, Note [error models]);
    the lower bound 1e-3 says the policy changed the numbers at all (bf16 rounds weights
    ~0.02 by up to 8e-5, and Adam turns sign flips of small gradients into steps of lr)."""
    found = [(n, r, k, c) for n, r, k, c in cases(worker, "/" + policy)
             if k.split("/", 1)[1] == policy]
    assert {(n, k.split("/")[0]) for n, _, k, _ in found} >= {(2, "gpt"), (3, "gpt")}
    for n, rank, name, c in found:
        assert c["bitwise"] and c["max_abs_diff"] == 0.0, c["divergence"]
        parity.assert_bitwise(c["losses"]["ours"], c["losses"]["torch"],
                              where=f"N = {n}, rank {rank}, {name}, losses")
        assert c["param_dtypes"] == ["torch.float32"], "the sharded parameters stay fp32"
        want_out = "torch.float32" if policy.endswith("_out") else (
            "torch.float16" if policy.startswith("fp16") else "torch.bfloat16")
        assert c["out_dtype"] == want_out, (n, name)
        if "vs_fp32" in c:
            assert 1e-3 < c["vs_fp32"] < adam_divergence_bound(1e-2, 3), (n, name, c["vs_fp32"])


# ---- (d) bytes -------------------------------------------------------------------------------

def _ops(calls: list[dict], op: str) -> list[dict]:
    return [c for c in calls if c["op"] == op]


def test_all_gather_bytes_halve_and_reduce_scatter_bytes_follow_reduce_dtype(worker):
    """Same collectives, same tags; every all-gather moves exactly half of fp32's bytes in
    bf16 (and fp16); the reduce-scatter moves fp32's bytes with ``reduce_dtype=fp32`` and
    half with bf16 / fp16 reduction."""
    for n, ranks in worker.items():
        for r in ranks:
            runs = r["cases"]
            models = ["gpt", "cnn"] if n == 2 else ["gpt"]
            for model in models:
                base = runs[f"{model}/none"]["comm"]
                for policy, rs_factor in (("bf16_fp32", 1.0), ("bf16", 0.5), ("fp16", 0.5)):
                    if f"{model}/{policy}" not in runs:
                        continue
                    calls = runs[f"{model}/{policy}"]["comm"]
                    assert [(c["op"], c["tag"]) for c in calls] == [
                        (c["op"], c["tag"]) for c in base]
                    ag, ag0 = _ops(calls, "all_gather"), _ops(base, "all_gather")
                    rs, rs0 = _ops(calls, "reduce_scatter"), _ops(base, "reduce_scatter")
                    assert ag and rs
                    assert all(2 * a["bytes"] == b["bytes"] for a, b in zip(ag, ag0))
                    assert {c["dtype"] for c in ag} == {policy.split("_")[0].replace(
                        "bf16", "bfloat16").replace("fp16", "float16")}
                    assert all(a["bytes"] == rs_factor * b["bytes"] for a, b in zip(rs, rs0))
                    assert {c["dtype"] for c in ag0} == {c["dtype"] for c in rs0} == {"float32"}


# ---- (e) memory ------------------------------------------------------------------------------

def test_unsharded_parameters_take_half_the_memory(worker):
    """MemoryTracker on step 2 of the GPT (Adam's state exists): at rest the same fp32 shards
    and optimizer state; the unsharded parameters on top of the shards (root + one block at
    a time) take exactly half of fp32's bytes in bf16. Measured at N = 2: shards 56,064 B,
    unsharded 61,312 B fp32 -> 30,656 B bf16; step peak 631,164 -> 411,766 B (bf16_fp32;
    activations and gradients are bf16 too)."""
    for n, ranks in worker.items():
        for r in ranks:
            none = r["cases"]["gpt/none"]["memory"]
            for policy in ("bf16_fp32", "bf16", "fp16"):
                mp = r["cases"][f"gpt/{policy}"]["memory"]
                assert mp["params_at_rest"] == none["params_at_rest"]
                assert mp["optimizer"] == none["optimizer"]
                unsharded = mp["params"] - mp["params_at_rest"]
                assert 2 * unsharded == none["params"] - none["params_at_rest"] > 0, (n, policy)
                assert mp["peak"] < 0.8 * none["peak"], (n, policy)


# ---- train.py --------------------------------------------------------------------------------

def test_train_flags_build_the_same_policy_for_ours_and_torch(worker):
    """``--param-dtype bf16 --reduce-dtype fp32 --output-dtype fp32`` through
    ``minifsdp.train``'s ``parse_args`` and ``shard_bottom_up``: ours and torch's train the
    tied GPT bit for bit alike, gathering bf16, reducing fp32, returning fp32 logits (the
    root's ``output_dtype``; the blocks get none)."""
    for n, rank, _, c in cases(worker, "/flags"):
        assert c["bitwise"], c["divergence"]
        parity.assert_bitwise(c["losses"]["ours"], c["losses"]["torch"],
                              where=f"N = {n}, rank {rank}, flags, losses")
        assert c["out_dtype"] == "torch.float32"
        assert {x["dtype"] for x in _ops(c["comm"], "all_gather")} == {"bfloat16"}
        assert {x["dtype"] for x in _ops(c["comm"], "reduce_scatter")} == {"float32"}


def test_train_flags_are_refused_where_there_is_no_policy():
    with pytest.raises(SystemExit):
        parse_args(["--strategy", "single", "--param-dtype", "bf16"])
    args = parse_args(["--strategy", "fsdp2", "--param-dtype", "bf16"])
    assert (args.param_dtype, args.reduce_dtype, args.output_dtype) == ("bf16", None, None)


# ---- in process: a world of one --------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh(cpu_mesh):
    return cpu_mesh


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def test_policy_is_torchs_dataclass():
    ours, theirs = dataclasses.fields(MixedPrecisionPolicy), dataclasses.fields(TorchPolicy)
    assert [(f.name, f.default) for f in ours] == [(f.name, f.default) for f in theirs]
    with pytest.raises(dataclasses.FrozenInstanceError):
        MixedPrecisionPolicy().param_dtype = bf16
    assert doctest.testmod(mixed_precision).failed == 0


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_gradient_divide_factors_are_torchs(n):
    group = type("Group", (), {"size": lambda self: n})()
    for dtype in (fp32, bf16, fp16, torch.float64):
        pre, post, op, _ = _get_gradient_divide_factors(group, None, dtype, "cpu")
        assert mixed_precision.gradient_divide_factors(n, dtype) == (pre, post, op), (n, dtype)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_gradient_divide_factor_and_force_sum_are_torchs(n):
    """Note [divide factor]: with ``set_gradient_divide_factor`` and / or
    ``set_force_sum_reduction_for_comms``, the same pre / post divisions and op as torch's
    (a PREMUL_SUM where torch makes one: its factor is not readable back from the op)."""
    group = type("Group", (), {"size": lambda self: n})()
    for dtype in (fp32, bf16, fp16):
        for factor in (None, float(n), 2.5, 6.0, 16.0):
            for force in (False, True):
                pre, post, op, _ = _get_gradient_divide_factors(group, None, dtype, "cpu",
                                                                factor, force)
                ours = mixed_precision.gradient_divide_factors(n, dtype, factor=factor,
                                                               force_sum=force)
                where = (n, dtype, factor, force)
                assert ours[:2] == (pre, post), (where, ours, (pre, post))
                if "PREMUL" in str(op):
                    assert "PREMUL" in str(ours[2]) and factor not in (None, float(n)), where
                else:
                    assert ours[2] == op, (where, ours[2], op)
    # HSDP with a factor: tests/test_fsdp2_hsdp.py; a shard group of 1 is refused
    with pytest.raises(NotImplementedError, match="HSDP mesh with a shard group of 1"):
        mixed_precision.gradient_divide_factors(1, fp32, replicate_size=2, factor=3.0)


def test_dtypes_of_every_tensor(mesh):
    """Note [mixed precision]'s table, read off a step: fp32 DTensor shards before and after;
    bf16 unsharded parameters in forward; bf16 unsharded gradients; an fp32 sharded .grad."""
    model = small_model()
    pol = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    fully_shard(model[0], mesh=mesh, mp_policy=pol)
    fully_shard(model, mesh=mesh, mp_policy=pol)
    seen = {}

    def spy(module, args):  # after FSDPState's pre-forward: unsharded
        seen["weight"] = module.weight.dtype
        module.weight.register_hook(lambda g: seen.update(unsharded_grad=g.dtype))

    model[0].register_forward_pre_hook(spy)
    model(torch.randn(5, 4)).float().sum().backward()
    assert seen == {"weight": bf16, "unsharded_grad": bf16}
    for p in model.parameters():
        assert isinstance(p, DTensor) and p.dtype == fp32
        assert isinstance(p.grad, DTensor) and p.grad.dtype == fp32


def test_forward_casts_match_torch(mesh):
    """(g) ``cast_forward_inputs``: floating inputs (args and kwargs) reach the module in
    ``param_dtype``, integer inputs untouched; off: the fp32 input reaches the bf16 layer and
    F.linear refuses the mix -- for ours and torch's alike. ``output_dtype``: the outputs,
    and gradients through the cast, equal torch's bit for bit."""

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x, ids, *, scale):
            self.seen = (x.dtype, ids.dtype, scale.dtype)
            return self.lin(x) * scale

    x, ids, scale = torch.randn(2, 4), torch.arange(2), torch.ones(1)
    for impl, policy_cls in ((fully_shard, MixedPrecisionPolicy), (torch_fully_shard,
                                                                    TorchPolicy)):
        probe = impl(Probe(), mesh=mesh, mp_policy=policy_cls(param_dtype=bf16))
        assert probe(x, ids, scale=scale).dtype == bf16
        assert probe.seen == (bf16, torch.int64, bf16)
        off = impl(Probe(), mesh=mesh, mp_policy=policy_cls(param_dtype=bf16,
                                                             cast_forward_inputs=False))
        with pytest.raises(RuntimeError, match="dtype"):
            off(x, ids, scale=scale)
    grads = []
    for impl, policy_cls in ((fully_shard, MixedPrecisionPolicy), (torch_fully_shard,
                                                                    TorchPolicy)):
        model = small_model()
        pol = policy_cls(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32)
        impl(model[0], mesh=mesh, mp_policy=policy_cls(param_dtype=bf16, reduce_dtype=fp32))
        impl(model, mesh=mesh, mp_policy=pol)
        out = model(torch.randn(5, 4, generator=torch.Generator().manual_seed(0)))
        assert out.dtype == fp32
        out.square().sum().backward()
        grads.append({k: p.grad.full_tensor() for k, p in model.named_parameters()})
    parity.assert_bitwise(*grads, names=("ours", "torch"))


def test_memory_categories_with_bf16(mesh):
    """Note [FSDP2 memory categories] under bf16: at rest the fp32 shards (4 B per element);
    during the step the unsharded parameters at 2 B per element -- with both groups
    unsharded at most 4 + 2 B per element -- and fp32 sharded gradients."""
    model = small_model()
    pol = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    fully_shard(model[0], mesh=mesh, mp_policy=pol)
    fully_shard(model, mesh=mesh, mp_policy=pol)
    opt = torch.optim.Adam(model.parameters())
    for _ in range(2):
        with MemoryTracker(model, opt) as mt:
            model(torch.randn(5, 4)).float().sum().backward()
            opt.step()
            opt.zero_grad()
    numel = 51
    params = max(s["params"] for s in mt.timeline)
    assert mt.timeline[-1]["params"] == 4 * numel
    assert params == 4 * numel + 2 * numel  # the root keeps its group unsharded, + model[0]
    assert max(s["grads"] for s in mt.timeline) >= 4 * numel  # the fp32 sharded grads


def test_errors_are_clear_and_leave_the_module_alone(mesh):
    """(f) float8 on gloo (gloo itself fails at the first collective with 'Invalid scalar
    type'), parameters of several dtypes in one group without a policy, and trainable
    parameters of several dtypes even with one: refused by ``fully_shard`` before it touches
    anything."""
    f8 = torch.float8_e4m3fn
    for pol in (MixedPrecisionPolicy(param_dtype=f8), MixedPrecisionPolicy(reduce_dtype=f8)):
        model = small_model()
        with pytest.raises(ValueError, match=r"'gloo' backend cannot .*float8_e4m3fn"):
            fully_shard(model, mesh=mesh, mp_policy=pol)
        assert type(model) is nn.Sequential and type(model[0].weight) is nn.Parameter
    mixed = small_model()
    mixed[2].half()
    with pytest.raises(ValueError, match=r"float32.*float16.*MixedPrecisionPolicy\(param_dtype"):
        fully_shard(mixed, mesh=mesh)
    with pytest.raises(ValueError, match="trainable parameters of dtypes"):
        fully_shard(mixed, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
    assert type(mixed[2].weight) is nn.Parameter
    mixed[2].requires_grad_(False)  # frozen fp16 next to trainable fp32: gathered in bf16
    fully_shard(mixed, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=bf16))
    mixed(torch.randn(2, 4)).float().sum().backward()
    assert mixed[0].weight.grad.dtype == fp32 and mixed[2].weight.grad is None
