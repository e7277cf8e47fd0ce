"""``minifsdp.parity``: each comparison passes what is equal and catches what is not, at the
right step, name and index, with both values' bits (Note [parity]). No torchrun."""

import math

import pytest
import torch

from minifsdp.parity import (
    Divergence,
    assert_bitwise,
    assert_close,
    bits,
    divergence_line,
    first_divergence,
    max_abs_diff,
    worst_divergence,
)


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"blocks.0.attn.qkv.weight": torch.randn(6, 4, generator=g),
            "blocks.0.ln.bias": torch.randn(4, generator=g).bfloat16(),
            "step": torch.tensor(3)}


def one_ulp_away(t: torch.Tensor, index: tuple) -> torch.Tensor:
    """A copy of ``t`` with one element one ulp further from zero (its bits + 1)."""
    out = t.clone()
    ints = out.view({2: torch.int16, 4: torch.int32}[t.element_size()])
    ints[index] += 1
    return out


def test_bits_of_known_values():
    assert bits(1.0, torch.float32) == "0x3f800000"
    assert bits(-2.0, torch.float64) == "0xc000000000000000"
    assert bits(1.0, torch.bfloat16) == "0x3f80" and bits(1.0, torch.float16) == "0x3c00"
    assert bits(5, torch.int32) == "5"


def test_equal_results_pass_every_check():
    a, b = state(), state()
    assert first_divergence(a, b) is None
    assert first_divergence([a, a], [b, b]) is None
    assert worst_divergence(a, b) is None and max_abs_diff(a, b) == 0.0
    assert_bitwise(a, b)
    assert_close(a, b, atol=0, rtol=0)
    assert first_divergence(2.5, 2.5) is None and first_divergence([1, 2], [1, 2]) is None
    assert first_divergence({"g": None}, {"g": None}) is None  # no gradient on either side
    assert divergence_line(a, b) is None


@pytest.mark.parametrize("name,index", [("blocks.0.attn.qkv.weight", (3, 1)),
                                        ("blocks.0.ln.bias", (2,))])
def test_one_ulp_is_found_at_its_index_with_its_bits(name, index):
    ours, theirs = state(), state()
    theirs[name] = one_ulp_away(theirs[name], index)
    d = first_divergence([ours, ours, ours], [ours, ours, theirs], where="rank 1")
    assert (d.kind, d.step, d.where, d.name, d.index) == ("value", 2, "rank 1", name, index)
    assert (d.count, d.numel) == (1, ours[name].numel())
    x, y = ours[name][index].item(), theirs[name][index].item()
    assert (d.ours, d.theirs) == (x, y) and x != y
    dtype = ours[name].dtype
    assert (d.ours_bits, d.theirs_bits) == (bits(x, dtype), bits(y, dtype))
    assert int(d.theirs_bits, 16) == int(d.ours_bits, 16) + 1  # one ulp
    line = str(d)
    assert line.startswith(f"step 2, rank 1, {name}[{', '.join(map(str, index))}]: ours ")
    assert f"({d.ours_bits}) vs torch " in line and f"({d.theirs_bits})" in line
    assert "\n" not in line
    assert divergence_line([ours, ours, ours], [ours, ours, theirs], where="rank 1") == line
    with pytest.raises(AssertionError, match=r"^step 2, rank 1, " + name.replace(".", r"\.")):
        assert_bitwise([ours, ours, ours], [ours, ours, theirs], where="rank 1")
    # a bound of 0 catches it too, at the same element; one ulp of the value lets it pass
    w = worst_divergence(ours, theirs)
    assert (w.name, w.index, w.count) == (name, index, 1)
    assert max_abs_diff(ours, theirs) == abs(x - y) > 0
    with pytest.raises(AssertionError, match=r"elements outside the bound"):
        assert_close(ours, theirs, atol=0, rtol=0)
    assert_close(ours, theirs, atol=abs(x - y), rtol=0)


def test_the_first_of_several_differences_is_reported_with_the_count():
    ours = {"a": torch.zeros(3, 3), "b": torch.zeros(2)}
    theirs = {"a": torch.zeros(3, 3), "b": torch.zeros(2)}
    theirs["a"][2, 0], theirs["a"][1, 2], theirs["b"][0] = 1.0, 2.0, 3.0
    d = first_divergence(ours, theirs)
    assert (d.name, d.index, d.count, d.numel) == ("a", (1, 2), 2, 9)  # row-major first
    assert str(d) == "a[1, 2]: ours 0 (0x00000000) vs torch 2 (0x40000000); 2 of 9 elements differ"
    w = worst_divergence(ours, theirs, atol=0.5, rtol=0)  # the worst over every name
    assert (w.name, w.index, w.count, w.numel, w.allowed) == ("b", (0,), 3, 11, 0.5)
    assert str(w) == ("b[0]: ours 0 (0x00000000) vs torch 3 (0x40400000); |diff| 3 > 0.5; "
                      "3 of 11 elements outside the bound")
    assert max_abs_diff(ours, theirs) == 3.0


def test_signed_zero_differs():
    d = first_divergence(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert (d.ours_bits, d.theirs_bits) == ("0x00000000", "0x80000000")
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # which torch.equal misses
    assert worst_divergence(torch.tensor([0.0]), torch.tensor([-0.0])) is None  # |diff| = 0


def test_nan_never_equals_nan_unless_asked():
    nan = torch.tensor([1.0, math.nan])
    d = first_divergence({"w": nan}, {"w": nan.clone()})
    assert (d.name, d.index, d.ours_bits, d.theirs_bits) == ("w", (1,), "0x7fc00000", "0x7fc00000")
    assert not torch.equal(nan, nan)  # as torch.equal
    assert first_divergence({"w": nan}, {"w": nan.clone()}, equal_nan=True) is None
    other = nan.clone().view(torch.int32)
    other[1] += 1  # another NaN payload: different bits, not equal even with equal_nan
    assert first_divergence(nan, other.view(torch.float32), equal_nan=True).index == (1,)
    assert math.isnan(max_abs_diff([0.5, 0.25], [0.5, math.nan]))  # so `<= bound` fails
    assert math.isnan(max_abs_diff([0.5, math.nan], [0.5, 0.25]))  # whichever side
    w = worst_divergence(torch.tensor([1.0, 5.0, 2.0]), torch.tensor([1.0, 9.0, math.nan]),
                         atol=1.0, rtol=0)
    assert (w.index, w.count) == ((2,), 2) and "a NaN is outside any bound" in str(w)
    assert_close(nan, nan.clone(), atol=0, rtol=0, equal_nan=True)
    with pytest.raises(AssertionError):
        assert_close(nan, nan.clone(), atol=1.0, rtol=1.0)


def test_infinities_are_equal_to_themselves_only():
    inf = torch.tensor([math.inf, -math.inf])
    assert first_divergence(inf, inf.clone()) is None and max_abs_diff(inf, inf.clone()) == 0.0
    assert max_abs_diff(inf, torch.tensor([math.inf, 0.0])) == math.inf


def test_shape_dtype_and_missing_names_are_reported():
    a = state()
    wrong_shape = dict(a, **{"blocks.0.attn.qkv.weight": torch.zeros(4, 6)})
    d = first_divergence(a, wrong_shape, names=("fsdp2", "torch_fsdp2"))
    assert (d.kind, d.name, d.ours, d.theirs) == ("shape", "blocks.0.attn.qkv.weight", (6, 4),
                                                   (4, 6))
    assert str(d) == "blocks.0.attn.qkv.weight: shape (6, 4) in fsdp2, (4, 6) in torch_fsdp2"
    d = first_divergence(a, dict(a, **{"blocks.0.ln.bias": a["blocks.0.ln.bias"].float()}))
    assert str(d) == "blocks.0.ln.bias: dtype bfloat16 in ours, float32 in torch"
    fewer = {k: v for k, v in a.items() if k != "step"}
    assert str(first_divergence(fewer, a)) == "step: missing from ours"
    assert str(first_divergence(a, fewer, where="rank 0")) == "rank 0, step: missing from torch"
    assert str(first_divergence([a], [a, a])) == (
        "step 1: missing from ours (ours has 1 step(s), torch 2)")
    assert str(first_divergence({"g": None}, {"g": torch.ones(1)})) == (
        "g: None in ours, a tensor in torch")
    with pytest.raises(AssertionError, match="dtype bfloat16 in ours, float32 in torch"):
        assert_close(a, dict(a, **{"blocks.0.ln.bias": a["blocks.0.ln.bias"].float()}),
                     atol=1.0, rtol=0)
    with pytest.raises(ValueError, match="step: missing from torch"):
        max_abs_diff(a, fewer)


def test_numbers_per_step_compare_as_float64():
    d = first_divergence([2.5, 2.25, 1.0], [2.5, 2.375, 1.0], names=("zero2", "single"))
    assert str(d) == "step 1: zero2 2.25 (0x4002000000000000) vs single 2.375 (0x4003000000000000)"
    assert first_divergence([0.1], [0.1 + 2**-56]).step == 0  # below fp32's resolution
    assert max_abs_diff([1.0, 2.0], [1.0, 2.5]) == 0.5
    assert first_divergence([1, 2, 3], [1, 2, 4]).ours == 3  # integers: no bits, the value
    assert str(first_divergence([1, 2, 3], [1, 2, 4])) == "step 2: ours 3 vs torch 4"


def test_masks_leave_padding_out():
    """torch FSDP1's padding holds 42s, ours zeros (Note [parity]): masked, they agree."""
    ours = {"flat": torch.tensor([1.0, 2.0, 0.0, 0.0])}
    theirs = {"flat": torch.tensor([1.0, 2.0, 42.0, 42.0])}
    real = {"flat": torch.tensor([True, True, False, False])}
    assert first_divergence(ours, theirs).index == (2,)
    assert first_divergence(ours, theirs, masks=real) is None
    assert max_abs_diff(ours, theirs, masks=real) == 0.0
    assert_close(ours, theirs, atol=0, rtol=0, masks=real)
    theirs["flat"][1] = 3.0
    assert first_divergence(ours, theirs, masks=real).index == (1,)
    with pytest.raises(ValueError, match="the mask of 'flat' must be a bool tensor of shape"):
        first_divergence(ours, theirs, masks={"flat": torch.ones(3, dtype=torch.bool)})


def test_rtol_scales_with_the_oracle():
    ours, theirs = torch.tensor([100.0, 1.0]), torch.tensor([100.5, 1.004])
    assert_close(ours, theirs, atol=0, rtol=0.005)  # 0.5 <= 0.5025, 0.004 <= 0.00502
    w = worst_divergence(ours, theirs, atol=0, rtol=0.001)
    assert w.index == (0,) and w.count == 2 and w.allowed == pytest.approx(0.1005)


def test_bad_input_names_the_thing():
    with pytest.raises(TypeError, match="'w' is a str"):
        first_divergence({"w": "x"}, {"w": "x"})
    with pytest.raises(TypeError, match="ours is a dict, torch a list"):
        first_divergence({"w": torch.ones(1)}, [torch.ones(1)])
    with pytest.raises(TypeError, match="compare a dict with a dict"):
        first_divergence([{"w": torch.ones(1)}], [torch.ones(1)])


def test_a_divergence_is_one_line_whatever_its_kind():
    lines = [str(Divergence("value", name="w", index=(0,), ours=1.0, theirs=2.0,
                            dtype=torch.float32, count=1, numel=1)),
             str(Divergence("shape", name="w", ours=(1,), theirs=(2,))),
             str(Divergence("missing", name="w", detail="missing from torch"))]
    assert lines == ["w[0]: ours 1 vs torch 2", "w: shape (1,) in ours, (2,) in torch",
                     "w: missing from torch"]
