"""ZeRO++ on FSDP2 (``minifsdp/zeropp.py``, chapter 12): qwZ, hpZ, qgZ.

One launch of ``minifsdp/demos/zeropp.py`` at N = 4 (nodes of K = 2 ranks) reads: ours ==
torch's ``fully_shard`` bit for bit with the same hooks (qwZ) and without them (base, hpZ);
hpZ == ZeRO-3 bit for bit; every collective's bytes equal the formula of Note [wire bytes of
ZeRO++]; the backward all-gathers of hpZ stay inside a node; the memory hpZ keeps is 1/K of
the blocks' unsharded parameters; qgZ and qwZ stay inside their error bounds (Note [block
quantization], Note [qgZ]). The in-process tests check the quantizer against an independent
float64 computation and the error paths.
"""

import doctest
import math

import pytest
import torch
import torch.nn as nn
from jobs import Job, fixture_of
from torch.distributed import ReduceOp

from minifsdp import zeropp
from minifsdp.zeropp import (
    QuantizedReduceScatter,
    QuantizedWeight,
    dequantize_blocks,
    enable_qwz,
    error_bound,
    pack_int4,
    quantize_blocks,
    unpack_int4,
    wire_bytes,
)

DEMO = Job("demo_4", "minifsdp.demos.zeropp", 4, ("--steps", 3))


def reference_quantize(x: torch.Tensor, block: int, bits: int) -> tuple[list[int], list[float]]:
    """Note [block quantization] written out element by element in float64 Python."""
    top = 2 ** (bits - 1) - 1
    flat = [float(v) for v in x.reshape(-1).tolist()]
    codes, scales = [], []
    for b in range(0, len(flat), block):
        blk = flat[b: b + block]
        amax = max(abs(v) for v in blk)
        # the scale is computed in fp32, as torch does: amax / qmax rounded to fp32
        s = float(torch.tensor(amax, dtype=torch.float32) / top) if amax > 0 else 1.0
        scales.append(s)
        codes += [max(-top, min(top, round(v / s))) for v in blk]
    return codes, scales


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block, numel", [(64, 1000), (7, 50), (128, 128)])
def test_quantize_blocks_against_an_independent_computation(bits, block, numel):
    """Codes equal a float64 loop's except where x / scale sits within fp32's rounding of a
    .5 tie; every dequantized element lies within ``error_bound`` of x."""
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-4, 1, numel)
    q, s = quantize_blocks(x, block, bits)
    codes, scales = reference_quantize(x, block, bits)
    assert s.tolist() == scales
    differ = [i for i, (a, b) in enumerate(zip(q.tolist(), codes)) if a != b]
    for i in differ:  # only ties broken differently by fp32's x / scale
        frac = abs(float(x[i]) / scales[i // block]) % 1
        assert abs(frac - 0.5) < 1e-5, (i, q[i].item(), codes[i])
    back = dequantize_blocks(q, s, block)
    err = (back.double() - x.double()).abs()
    assert (err <= error_bound(s, block, numel).double()).all(), (err.max(), s.max())
    assert q.abs().max().item() == 2 ** (bits - 1) - 1  # each block's amax maps to qmax


def test_a_zero_block_and_int4_packing():
    q, s = quantize_blocks(torch.zeros(10), 4, 8)
    assert q.tolist() == [0] * 10 and s.tolist() == [1.0, 1.0, 1.0]
    codes = torch.arange(-7, 8, dtype=torch.int8)  # every int4 code, odd count
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    assert torch.equal(unpack_int4(packed, 15), codes)


def test_wire_bytes_formula():
    assert wire_bytes(4096, 4, kind="all_gather") == 3 / 4 * 4096 * 2
    assert wire_bytes(4096, 4, kind="qwz_all_gather") == 3 / 4 * (4096 + 4 * 4 * 16)
    assert wire_bytes(4096, 4, kind="qgz_all_to_all", bits=4) == 3 * (512 + 4 * 16)
    assert wire_bytes(4096, 4, kind="qgz_all_to_all", bits=8) == 3 * (1024 + 4 * 16)
    with pytest.raises(ValueError, match="unknown kind 'ring'"):
        wire_bytes(4, 2, kind="ring")


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="bits must be 4 or 8, got 2"):
        QuantizedReduceScatter(bits=2)
    with pytest.raises(ValueError, match="block must be >= 1"):
        quantize_blocks(torch.ones(3), 0)
    rs = QuantizedReduceScatter()
    with pytest.raises(ValueError, match="op .* is not SUM or AVG"):
        rs(torch.empty(2), torch.empty(4), None, ReduceOp.MAX)

    class Mesh:  # the one thing the hook asks of a mesh before its collective
        def size(self):
            return 3

    w = QuantizedWeight(torch.randn(4, 2))
    with pytest.raises(ValueError, match=r"shape \(4, 2\) shards unevenly over 3 ranks"):
        w.fsdp_pre_all_gather(Mesh(), torch.Size([4, 2]), (2, 1), nn.Linear(2, 4), None)


def test_enable_qwz_and_doctests():
    m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    assert enable_qwz(m) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert all(isinstance(p, QuantizedWeight) and p.requires_grad for p in m.parameters())
    assert doctest.testmod(zeropp).failed == 0


# ------------------------------------------------------------------------ the N = 4 job

@fixture_of(DEMO)
def ranks(launched) -> list[dict]:
    return launched[DEMO].result().ranks


def test_ours_equals_torch_and_hpz_equals_zero3(ranks):
    for r in ranks:
        # each pair's first difference on this rank (step, parameter, index, both values)
        assert r["divergence"] and not any(r["divergence"].values()), r["divergence"]
        assert r["bitwise"] and all(r["bitwise"].values()), r["bitwise"]
        for pair in ("ours base == torch base", "ours hpz == torch hpz",
                     "ours qwz == torch qwz", "ours hpz == ours base",
                     "torch hpz+qgz == torch qgz"):
            assert r["bitwise"][pair], pair
        assert all(r["bitwise_losses"].values()), r["bitwise_losses"]
        # hpZ and ZeRO-3 drift from fp32 identically; quantization adds its own
        drift = {k: v["drift"] for k, v in r["runs"].items()}
        assert drift["ours hpz"] == drift["ours base"] and drift["ours fp32"] == [0.0] * 3
        assert drift["ours qwz"] != drift["ours base"]
        assert drift["torch qgz"] != drift["ours base"]


def by_kind(calls, *, group_size=None):
    out = {}
    for c in calls:
        if group_size is None or c["group_size"] == group_size:
            key = (c["op"], c["dtype"])
            out[key] = out.get(key, 0) + c["wire_bytes"]
    return out


def test_bytes_follow_the_formula(ranks):
    """Step 0's collectives, per kind, against Note [wire bytes of ZeRO++]."""
    r = ranks[0]
    n, k, block = r["world_size"], r["K"], r["block"]
    numels = r["numels"]
    root = sum(v for name, v in numels.items() if not name.startswith("blocks."))
    blocks = [sum(v for name, v in numels.items() if name.startswith(f"blocks.{i}."))
              for i in range(2)]
    total = root + sum(blocks)
    runs = r["runs"]
    ag = lambda e, m=n: wire_bytes(e, m, kind="all_gather")  # noqa: E731
    groups = [root, *blocks]  # every group resharded after forward, the root too
    assert by_kind(runs["ours base"]["comm"]) == {
        ("all_gather", "bfloat16"): 2 * sum(ag(e) for e in groups),
        ("reduce_scatter", "bfloat16"): ag(total)}
    hpz = runs["ours hpz"]["comm"]
    assert by_kind(hpz, group_size=k) == {("all_gather", "bfloat16"): sum(ag(e, k)
                                                                          for e in groups)}
    assert all(c["phase"] == "backward" for c in hpz if c["group_size"] == k)
    assert by_kind(hpz, group_size=n)[("all_gather", "bfloat16")] == sum(ag(e) for e in groups)
    qwz = by_kind(runs["ours qwz"]["comm"])
    scale_bytes = 2 * sum(4 * (n - 1) * math.ceil(v // n / block) for v in numels.values())
    assert qwz == {("all_gather", "uint8"): (n - 1) / n * 2 * total,
                   ("all_gather", "float32"): scale_bytes,
                   ("reduce_scatter", "bfloat16"): ag(total)}
    qgz = by_kind(runs["torch qgz"]["comm"])  # torch's own collectives bypass the log
    assert qgz == {("all_to_all", "uint8"): sum(3 * math.ceil(e // n / 2) for e in groups),
                   ("all_to_all", "float32"): sum(3 * 4 * math.ceil(e // n / 64)
                                                  for e in groups)}
    assert sum(qgz.values()) == sum(wire_bytes(e, n, kind="qgz_all_to_all", bits=4)
                                    for e in groups)


def test_hpz_stays_in_the_node_and_keeps_one_kth(ranks):
    for r in ranks:
        k = r["K"]
        (group,) = r["hpz_groups"]
        assert r["rank"] in group and {g // k for g in group} == {r["rank"] // k}
        total = sum(r["numels"].values())
        mem = {name: r["runs"][name]["memory"] for name in ("ours base", "ours hpz", "ours keep")}
        assert mem["ours hpz"]["kept"] == 2 * total // k  # bf16 bytes, 1/k of every group
        after = {name: m["after_forward"]["params"] for name, m in mem.items()}
        assert after["ours hpz"] - after["ours base"] == 2 * total // k
        assert after["ours keep"] - after["ours base"] == 2 * total


def test_quantization_stays_inside_its_bounds(ranks):
    for r in ranks:
        assert r["qwz_check"]["dtype"] == "torch.bfloat16"
        assert 0 < r["qwz_check"]["worst_ratio"] <= 1, r["qwz_check"]
        for bits in ("8", "4"):
            assert 0 < r["qgz_check"][bits]["worst_ratio"] <= 1, (bits, r["qgz_check"])
        assert r["qgz_check"]["4"]["max_err"] > r["qgz_check"]["8"]["max_err"]
