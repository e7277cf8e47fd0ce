"""FP8 all-gather (``minifsdp/fsdp2/float8.py``, Note [FP8 all-gather]) and the all-gather
extension point it uses (Note [all-gather extensions] in ``fsdp_param.py``, ``extensions.py``).

Two launches of ``tests/workers/fsdp2_float8_worker.py``, run side by side: N = 2 (the GPT in
fp32, bf16, fp8 and fp8 + bf16, 3 Adam steps; the fp8 runs also with torch's ``fully_shard``
calling the same hooks) and N = 3 (fp8; the fc, proj and head weights are cut unevenly). The
in-process tests at the end use a world of one.

Oracles: (1) a single-process simulation of the same quantization (``demos/float8.py``'s
``simulate``): the scale from the *full* weight's amax, quantize, dequantize, the ranks'
batches one by one, their gradients averaged -- bitwise at N = 2; (2) torch's
``fully_shard`` driving the same two hooks -- bitwise at N = 2. At N = 3 the simulation's
three-way gradient sum is another float sum than gloo's ring (Note [bitwise parity] in
``minifsdp/train.py``), so there only what does not depend on it is bitwise (the unsharded
weights, the first loss) and the rest is held to a bound.
"""

import doctest
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from jobs import Job, fixture_of

from minifsdp.fsdp2 import MixedPrecisionPolicy, float8, fsdp_param_group, fully_shard
from minifsdp.fsdp2.float8 import Float8Weight, enable_float8_all_gather

PARALLEL = 2
WORKER = str(Path(__file__).parent / "workers" / "fsdp2_float8_worker.py")
FP8_MODES = ("fp8", "fp8_bf16")
N3_PARAM_BOUND = 3e-4  # measured 2.8e-5 (max |ours - simulation|, N = 3, 3 steps)


# the worker at N = 2 and 3, run in runs/tests/fsdp2_float8_worker_2 and _3
WORKERS = {n: Job(f"worker_{n}", WORKER, n) for n in (2, 3)}


@fixture_of(*WORKERS.values())
def worker(launched) -> dict[int, list[dict]]:
    return {n: launched[job].result().ranks for n, job in WORKERS.items()}


def test_bitwise_with_a_single_process_simulation(worker):
    """N = 2: every parameter after 3 steps and every loss equal the simulation's bit for
    bit, in fp32 and bf16 compute, on every rank."""
    for r in worker[2]:
        for mode in FP8_MODES:
            run = r["runs"][mode]
            assert run["sim_divergence"] is None, f"{mode}: {run['sim_divergence']}"
            # the booleans notebook 07 prints agree (a parameter per name, a loss per step)
            assert len(run["sim_params_bitwise"]) == 29 and all(
                run["sim_params_bitwise"].values()) and run["sim_max_abs_diff"] == 0.0, mode
            assert run["sim_losses_equal"] == [True] * 3, (r["rank"], mode)


def test_matches_torch_fully_shard_calling_the_same_hooks(worker):
    """Our extension point is torch's: torch's ``fully_shard`` calling ``Float8Weight``'s two
    hooks trains the same parameters and losses bit for bit, with as many amax all-reduces
    (17 per step: 9 weights gathered in forward, the 8 of the resharded blocks again in
    backward)."""
    for r in worker[2]:
        for mode in FP8_MODES:
            t = r["runs"][mode]["torch"]
            for what in ("losses", "params"):  # minifsdp.parity's line, or None
                assert t[what] is None, f"{mode}, {what}: {t[what]}"
            assert t["amax_calls"] == [17 * 3] * 2, t["amax_calls"]


def test_uneven_shards(worker):
    """N = 3, padded tail shards: after one all-gather every unsharded parameter equals the
    simulation's (``quantize_dequantize`` of the full weight for the 9 float8 weights, the
    bf16 cast for the rest) bit for bit; the first step's losses too. Later steps differ by a
    float sum (module docstring), pinned to a bound."""
    for r in worker[3]:
        assert len(r["float8_names"]) == 9
        assert r["unsharded_compared"] > 9 and r["unsharded_vs_sim"] is None, (
            r["rank"], r["unsharded_vs_sim"])
        run = r["runs"]["fp8"]
        assert run["sim_losses_equal"][0], r["rank"]
        assert run["sim_max_abs_diff"] <= N3_PARAM_BOUND, run["sim_worst"]


def _slot_bytes(group: list[dict], n: int, elem: int) -> int:
    """A group's all-gather input, from shapes alone: ``ceil(d0 / N) * rest`` elements a
    parameter, 1 byte each for float8, else ``elem`` (Note [dim-0 chunks], [padding])."""
    return sum(math.ceil(p["shape"][0] / n) * math.prod(p["shape"][1:])
               * (1 if p["float8"] else elem) for p in group)


def test_wire_bytes_exact(worker):
    """Step 0's log, per group: one all-gather each time a group is gathered (forward, and
    backward for the resharded blocks), of exactly the bytes the shapes give -- float8
    weights at 1 byte an element, a quarter of fp32 and half of bf16 -- in a uint8 buffer;
    each preceded by one 4-byte amax all-reduce per float8 weight, tagged with the group."""
    for n, ranks in worker.items():
        for r in ranks:
            for mode, run in r["runs"].items():
                elem = 2 if mode.endswith("bf16") else 4
                fp8 = mode.startswith("fp8")
                calls = [c for c in run["comm"] if c["op"] in ("all_gather", "all_reduce")]
                gathers = [c for c in calls if c["op"] == "all_gather"]
                order = ["root", "blocks.0", "blocks.1", "blocks.1", "blocks.0"]
                assert [c["tag"] for c in gathers] == [f"fsdp2 params {g}" for g in order]
                for c in gathers:
                    group = run["groups"][c["tag"].removeprefix("fsdp2 params ")]
                    assert c["bytes"] == _slot_bytes(group, n, elem), (n, mode, c["tag"])
                    assert c["wire_bytes"] == (n - 1) * c["bytes"]
                    assert c["dtype"] == ("uint8" if fp8 else
                                          {2: "bfloat16", 4: "float32"}[elem])
                amax = [c for c in calls if c["op"] == "all_reduce"]
                assert len(amax) == (17 if fp8 else 0), (n, mode)
                assert all(c["bytes"] == 4 and c["dtype"] == "float32" for c in amax)
                # each all-gather is preceded by its group's amaxes
                seq, i = [], 0
                for c in calls:
                    if c["op"] == "all_reduce":
                        seq.append(c["tag"].removeprefix("fsdp2 Float8Weight "))
                    else:
                        g = order[i]
                        i += 1
                        k = sum(p["float8"] for p in run["groups"][g]) if fp8 else 0
                        assert seq == [g] * k, (n, mode, g, seq)
                        seq = []
            if n == 2:  # the float8 part of a block's slot: 1/4 of fp32's, 1/2 of bf16's
                w = [p for p in r["runs"]["fp8"]["groups"]["blocks.0"] if p["float8"]]
                assert _slot_bytes(w, n, 4) * 4 == _slot_bytes(
                    [{**p, "float8": False} for p in w], n, 4) == 24576


def test_memory_by_category(worker):
    """MemoryTracker on step 1: the fp32 shards at rest and the unsharded parameters and
    gradients are float8's business not at all (equal to the fp32 / bf16 run's peaks, byte
    for byte); the all-gather buffers shrink: one group's uint8 buffer plus the gathered
    fp8 of its largest weight (dequantized one weight at a time). Measured at N = 2:
    50,816 -> 18,048 B (fp32 compute), 25,408 -> 17,216 B (bf16 compute)."""
    for n, ranks in worker.items():
        for r in ranks:
            runs = r["runs"]
            for fp8, base in (("fp8", "fp32"), ("fp8_bf16", "bf16")):
                if base not in runs:
                    continue
                a, b = runs[fp8]["memory"], runs[base]["memory"]
                assert a["params"] == b["params"] and a["grads"] == b["grads"], (n, fp8)
                groups = runs[fp8]["groups"]
                elem = 2 if fp8.endswith("bf16") else 4
                want = max(n * _slot_bytes(g, n, elem) + max(
                    [n * math.ceil(p["shape"][0] / n) * math.prod(p["shape"][1:])
                     for p in g if p["float8"]] or [0]) for g in groups.values())
                assert a["all-gather buffers"] == want, (n, fp8, a, want)
                assert b["all-gather buffers"] == max(n * _slot_bytes(g, n, elem) for g in
                                                      [[{**p, "float8": False} for p in g]
                                                       for g in groups.values()])
                assert a["all-gather buffers"] < b["all-gather buffers"]
            if n == 2:
                assert (runs["fp32"]["memory"]["all-gather buffers"],
                        runs["fp8"]["memory"]["all-gather buffers"],
                        runs["bf16"]["memory"]["all-gather buffers"],
                        runs["fp8_bf16"]["memory"]["all-gather buffers"]) == (
                            50816, 18048, 25408, 17216)


def test_loss_next_to_fp32_and_bf16(worker):
    """Every step's loss of the fp8 runs stays near the fp32 run's: within 0.01 with fp32
    compute (measured 1e-3), within 16 ulps of a bf16 loss near 4 with bf16 compute (whose
    logits and loss are bf16: one ulp is 1/32 there; bound 0.5, measured 4.5e-2 = 1.5 ulps).
    fp8 weights with fp32 compute are closer to fp32 than bf16 compute is."""
    for r in worker[2]:
        gap = {mode: max(abs(a - b) for a, b in zip(run["losses"], r["runs"]["fp32"]["losses"]))
               for mode, run in r["runs"].items()}
        assert 0 < gap["fp8"] < 0.01 and gap["fp8_bf16"] < 16 / 32, gap
        assert gap["fp8"] < gap["bf16"]


# ---- in one process: the helpers, misuse -----------------------------------------------------

@pytest.fixture
def mesh(cpu_mesh):
    return cpu_mesh


def test_doctests():
    assert doctest.testmod(float8).failed == 0


def test_quantization_matches_torchao_conventions():
    """scale = 448 / amax (float64, then fp32); saturating cast; the amax element maps to
    exactly 448; a zero tensor gets a finite scale and stays zero."""
    w = torch.tensor([[0.5, -3.0], [1e-3, 2.0]])
    scale = float8.amax_to_scale(w.abs().amax())
    assert scale.dtype == torch.float32 and float(scale) == float(torch.tensor(448 / 3.0))
    q = float8.quantize(w, scale)
    assert q.dtype == torch.float8_e4m3fn and float(q[0, 1]) == -448.0
    z = float8.quantize_dequantize(torch.zeros(3))
    assert torch.equal(z, torch.zeros(3))


def test_enable_keeps_ties_and_refuses_integer_weights():
    m = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    m[1].weight = m[0].weight
    assert enable_float8_all_gather(m) == ["0.weight"]
    assert m[0].weight is m[1].weight and isinstance(m[0].weight, Float8Weight)
    assert type(m(torch.randn(2, 4))) is torch.Tensor  # computes like a plain tensor
    half = nn.Sequential(nn.Linear(4, 4).half())
    with pytest.raises(ValueError, match=r"0\.weight is torch\.float16"):
        enable_float8_all_gather(half)


def test_float8_param_dtype_without_the_subclass_is_still_refused(mesh):
    with pytest.raises(ValueError, match="cannot all-gather the parameters in torch.float8"):
        fully_shard(nn.Linear(4, 4), mesh=mesh,
                    mp_policy=MixedPrecisionPolicy(param_dtype=torch.float8_e4m3fn))


def test_a_type_with_one_hook_is_refused(mesh):
    class Half(torch.Tensor):
        def fsdp_pre_all_gather(self, *args):
            return (self,), None

    lin = nn.Linear(4, 4)
    lin.weight = nn.Parameter(lin.weight.detach().as_subclass(Half))
    with pytest.raises(ValueError, match=r"Linear\.weight is a Half, which defines only "
                       "fsdp_pre_all_gather"):
        fully_shard(lin, mesh=mesh)


def test_a_hook_returning_the_wrong_shape_names_the_parameter(mesh):
    class Flat(Float8Weight):
        def fsdp_pre_all_gather(self, *args):
            (data,), meta = super().fsdp_pre_all_gather(*args)
            return (data.reshape(-1),), meta

    lin = nn.Linear(4, 3)
    lin.weight = nn.Parameter(Flat(lin.weight.detach()))
    fully_shard(lin, mesh=mesh)
    with pytest.raises(ValueError, match=r"Flat\.fsdp_pre_all_gather of Linear\.weight returned "
                       r"tensors of shapes \[\(12,\)\]; each must have the padded shard's shape "
                       r"\(3, 4\)"):
        lin(torch.randn(2, 4))


def test_reshard_to_k_ranks_is_refused(mesh, monkeypatch):
    """``reshard_after_forward=k`` needs 4+ ranks; the refusal is checked with the k-rank
    group faked (the error comes before any use of it)."""
    monkeypatch.setattr(fsdp_param_group, "post_forward_info", lambda info, k: (True, object()))
    lin = nn.Linear(4, 4)
    enable_float8_all_gather(lin)
    with pytest.raises(NotImplementedError, match=r"fully_shard\(Linear\): reshard_after_forward"
                       r"=2 .* but Linear\.weight \(Float8Weight\) rebuild"):
        fully_shard(lin, mesh=mesh, reshard_after_forward=2)
