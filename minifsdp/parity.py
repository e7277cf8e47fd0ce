"""Compare ours with an oracle and say where they first differ, in one line.

Every parity check -- the tests, their workers, ``minifsdp.gpucheck``, the labs' ``Trace`` --
compares results given as a tensor or number, a dict ``name -> tensor``, or a list of those,
one per step. ``first_divergence`` returns the first element that differs as a
``Divergence``, whose ``str`` is the line a failing check prints::

    step 2, rank 1, blocks.0.attn.qkv.weight[3, 5]: ours 0.1234567 (0x3dfcd6de) vs torch
    0.12345671 (0x3dfcd6df); 1 of 24,576 elements differ

``assert_bitwise`` raises it; ``assert_close`` raises the worst element outside a bound;
``max_abs_diff`` is the number a bound is held against.

Note [parity]: "bitwise" means, in this order: the same steps and names (a name on one side
only is a divergence), then per name the same shape, the same dtype, and every element's bit
pattern. So -0.0 and 0.0 differ (``torch.equal`` calls them equal), and a NaN differs from
everything, another NaN of the same bits included (as ``torch.equal``: a NaN on both sides
proves nothing about parity); ``equal_nan=True`` lets a NaN match a NaN of the same bits, as
the labs' checker does. Elements nobody reads are not compared: torch FSDP1 fills its flat
parameter's alignment padding with 42s where ours holds zeros, so FSDP1's comparisons look
only at the parameters' elements (``masks`` here; ``real`` and ``trainable`` in
tests/workers/fsdp1_knobs_worker.py). Bitwise is the bar where both sides run the same
floating-point operations in the same order (Note [bitwise parity] in minifsdp/train.py).
Where the order differs by design -- N = 3 against one process, two CPUs' matmul blockings,
bf16 against fp32 -- the claim is a bound, ``assert_close(ours, theirs, atol=..., rtol=...)``
(``|ours - theirs| <= atol + rtol |theirs|``, in float64), whose numbers come from an error
model with margin or from the oracle's own distance (Note [error models] in
minifsdp/numerics.py), never from one difference measured once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(x: float, dtype: torch.dtype) -> str:
    """The bit pattern of one element of ``dtype``; an integer prints as itself.

    Example:
        >>> bits(1.0, torch.float32), bits(-0.0, torch.bfloat16), bits(7, torch.int64)
        ('0x3f800000', '0x8000', '7')
    """
    t = torch.tensor([x], dtype=dtype)
    if dtype.is_floating_point:
        width = t.element_size()
        v = t.view(_INT_OF_WIDTH[width]).item() & ((1 << 8 * width) - 1)
        return f"0x{v:0{2 * width}x}"
    return str(int(x))


def _short(x: Any, dtype: torch.dtype | None) -> str:
    """The fewest digits that read back as the same ``dtype`` value: 0.1 for fp32's 0.1."""
    if not isinstance(x, float) or dtype is None or not math.isfinite(x):
        return str(x)
    for digits in range(1, 18):
        s = f"{x:.{digits}g}"
        if torch.tensor(float(s), dtype=dtype).item() == x:
            return s
    return repr(x)


@dataclass(frozen=True)
class Divergence:
    """Where two results first differ (``kind`` "value"), or how their structure does
    ("missing": a step or name on one side only, or None against a tensor; "shape"; "dtype").

    For "value": ``index`` into the tensor ``name`` (``()`` for a 0-d one), both elements
    (``ours``, ``theirs``) and their bits, and ``count`` of ``numel`` elements that differ in
    that tensor. From ``assert_close``: the worst element, ``allowed`` its bound, and ``count``
    of ``numel`` over everything compared. For "shape" and "dtype", ``ours`` and ``theirs``
    are the shapes or the dtypes' names; ``detail`` says the rest in words.
    """

    kind: str
    name: str = ""
    step: int | None = None
    where: str = ""
    index: tuple[int, ...] = ()
    ours: Any = None
    theirs: Any = None
    ours_bits: str = ""
    theirs_bits: str = ""
    count: int = 0
    numel: int = 0
    names: tuple[str, str] = ("ours", "torch")
    dtype: torch.dtype | None = None
    detail: str = ""
    allowed: float | None = None

    def __str__(self) -> str:
        at = ([f"step {self.step}"] if self.step is not None else []) + (
            [self.where] if self.where else [])
        idx = "[" + ", ".join(map(str, self.index)) + "]" if self.index else ""
        if self.name or idx:
            at.append(self.name + idx if self.name else f"at {idx}")
        a, b = self.names
        if self.kind == "value":
            ob = f" ({self.ours_bits})" if self.ours_bits else ""
            tb = f" ({self.theirs_bits})" if self.theirs_bits else ""
            what = (f"{a} {_short(self.ours, self.dtype)}{ob} vs "
                    f"{b} {_short(self.theirs, self.dtype)}{tb}")
            if self.allowed is not None:
                diff = abs(float(self.ours) - float(self.theirs))
                what += (f"; |diff| {diff:.3g} > {self.allowed:.3g}" if not math.isnan(
                    diff + self.allowed) else "; a NaN is outside any bound") + (
                    f"; {self.count:,} of {self.numel:,} elements outside the bound")
            elif self.numel > 1:
                what += f"; {self.count:,} of {self.numel:,} elements differ"
        elif self.kind in ("shape", "dtype"):
            what = f"{self.kind} {self.ours} in {a}, {self.theirs} in {b}"
        else:
            what = self.detail
        return f"{', '.join(at)}: {what}" if at else what


# ---- walking two results side by side ----------------------------------------------------------

def _leaf(x: Any, name: str) -> torch.Tensor | None:
    if x is None or (isinstance(x, torch.Tensor) and type(x).__name__ != "DTensor"):
        return x
    if isinstance(x, (bool, int, float)):  # a loss, a norm: a Python float is a float64
        return torch.tensor(x, dtype=torch.float64 if isinstance(x, float) else None)
    what = "a DTensor: compare its full_tensor() (a collective: call it on every rank)" if (
        isinstance(x, torch.Tensor)) else f"a {type(x).__name__}"
    raise TypeError(f"parity: {repr(name) if name else 'the value'} is {what}; compare "
                    "tensors or numbers, dicts name -> tensor, or lists of those, one per step")


def _pairs(ours: Any, theirs: Any, names: tuple[str, str], where: str,
           ) -> Iterator[Divergence | tuple[int | None, str, torch.Tensor, torch.Tensor]]:
    """Each pair of leaves as ``(step, name, ours, theirs)``, a structural mismatch as a
    ``Divergence`` (then nothing more): steps in order, names in ours' order, then theirs'."""
    steps = isinstance(ours, (list, tuple)), isinstance(theirs, (list, tuple))
    if steps[0] != steps[1]:
        raise TypeError(f"parity: {names[0]} is a {type(ours).__name__}, {names[1]} a "
                        f"{type(theirs).__name__}: compare a list of steps with a list")
    if not steps[0]:
        yield from _named(None, ours, theirs, names, where)
        return
    for step in range(max(len(ours), len(theirs))):
        if step >= min(len(ours), len(theirs)):
            short = names[0] if len(ours) < len(theirs) else names[1]
            yield Divergence("missing", step=step, where=where, names=names, detail=(
                f"missing from {short} ({names[0]} has {len(ours)} step(s), "
                f"{names[1]} {len(theirs)})"))
            return
        for item in _named(step, ours[step], theirs[step], names, where):
            yield item
            if isinstance(item, Divergence):
                return


def _named(step: int | None, ours: Any, theirs: Any, names: tuple[str, str], where: str,
           ) -> Iterator[Divergence | tuple[int | None, str, torch.Tensor, torch.Tensor]]:
    if isinstance(ours, Mapping) != isinstance(theirs, Mapping):
        raise TypeError(f"parity: {names[0]} is a {type(ours).__name__}, {names[1]} a "
                        f"{type(theirs).__name__}: compare a dict with a dict")
    items = [(k, ours[k], theirs.get(k, ...)) for k in ours] + [
        (k, ..., theirs[k]) for k in theirs if k not in ours] if isinstance(ours, Mapping) \
        else [("", ours, theirs)]
    for name, a, b in items:
        common = dict(name=name, step=step, where=where, names=names)
        if a is ... or b is ...:
            yield Divergence("missing", detail=f"missing from {names[0 if a is ... else 1]}",
                             **common)
            return
        a, b = _leaf(a, name), _leaf(b, name)
        if a is None or b is None:
            if a is None and b is None:
                continue
            side = 0 if a is None else 1
            yield Divergence("missing", detail=f"None in {names[side]}, a tensor in "
                             f"{names[1 - side]}", **common)
            return
        if a.shape != b.shape:
            yield Divergence("shape", ours=tuple(a.shape), theirs=tuple(b.shape), **common)
            return
        if a.dtype != b.dtype:
            yield Divergence("dtype", ours=str(a.dtype).replace("torch.", ""),
                             theirs=str(b.dtype).replace("torch.", ""), **common)
            return
        yield step, name, a.detach(), b.detach().to(a.device)


def _mask(masks: Mapping[str, torch.Tensor] | None, name: str, a: torch.Tensor):
    m = masks.get(name) if masks else None
    if m is not None and (m.dtype != torch.bool or m.shape != a.shape):
        raise ValueError(f"parity: the mask of {name!r} must be a bool tensor of shape "
                         f"{tuple(a.shape)}, got {m.dtype} {tuple(m.shape)}")
    return None if m is None else m.to(a.device)


def _element(kind_args: dict, a: torch.Tensor, b: torch.Tensor, flat: int) -> dict:
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) \
        if a.dim() else ()
    x, y = a.reshape(-1)[flat].item(), b.reshape(-1)[flat].item()
    floating = a.dtype.is_floating_point
    return dict(kind_args, index=index, ours=x, theirs=y, dtype=a.dtype,
                ours_bits=bits(x, a.dtype) if floating else "",
                theirs_bits=bits(y, a.dtype) if floating else "")


def _abs_diff(a: torch.Tensor, b: torch.Tensor, equal_nan: bool) -> torch.Tensor:
    """|a - b| in float64, 0 where equal (inf == inf), NaN where either is NaN (but for a
    NaN on both sides with ``equal_nan``)."""
    a64, b64 = a.double(), b.double()
    diff = torch.where(a64 == b64, 0.0, (a64 - b64).abs())
    if equal_nan:
        diff = torch.where(a64.isnan() & b64.isnan(), 0.0, diff)
    return diff


# ---- the comparisons ---------------------------------------------------------------------------

def first_divergence(ours: Any, theirs: Any, *, names: tuple[str, str] = ("ours", "torch"),
                     where: str = "", equal_nan: bool = False,
                     masks: Mapping[str, torch.Tensor] | None = None) -> Divergence | None:
    """The first difference between ``ours`` and ``theirs``, bit for bit (Note [parity]), or
    ``None`` when there is none.

    Each is a tensor or number, a dict ``name -> tensor`` (or number, or None), or a list of
    either, one per step; any shapes. "First" is the first step, then the first name in
    ``ours``' order, then the lowest index in row-major order. ``names`` name the two sides and
    ``where`` is said before the name (``"rank 1"``). ``masks`` (``name -> bool tensor`` of
    the tensor's shape) leaves the elements where it is False out.

    Example:
        >>> ours = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
        >>> theirs = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0000005]])}
        >>> print(first_divergence(ours, theirs, where="rank 1"))
        rank 1, w[1, 1]: ours 4 (0x40800000) vs torch 4.0000005 (0x40800001); 1 of 4 elements differ
        >>> print(first_divergence([2.5, 2.25], [2.5, 2.375], names=("fsdp2", "single")))
        step 1: fsdp2 2.25 (0x4002000000000000) vs single 2.375 (0x4003000000000000)
        >>> print(first_divergence({"w": torch.zeros(2)}, {"w": torch.zeros(3)}))
        w: shape (2,) in ours, (3,) in torch
        >>> first_divergence(ours, ours) is None
        True
    """
    for item in _pairs(ours, theirs, names, where):
        if isinstance(item, Divergence):
            return item
        step, name, a, b = item
        if a.dtype.is_floating_point:  # bits: -0.0 vs 0.0 and NaN payloads count
            if a.element_size() not in _INT_OF_WIDTH:
                raise TypeError(f"parity: {repr(name) if name else 'the value'}: no bitwise "
                                f"view of {a.dtype}")
            width = _INT_OF_WIDTH[a.element_size()]
            differ = a.contiguous().view(width) != b.contiguous().view(width)
            if not equal_nan:
                differ |= a.float().isnan() | b.float().isnan()
        else:
            differ = a != b
        m = _mask(masks, name, a)
        if m is not None:
            differ &= m
        count = int(differ.sum())
        if count:
            flat = int(differ.reshape(-1).nonzero()[0, 0])
            return Divergence(**_element(dict(kind="value", name=name, step=step, where=where,
                                              names=names, count=count, numel=a.numel()),
                                         a, b, flat))
    return None


def divergence_line(ours: Any, theirs: Any, **kwargs: Any) -> str | None:
    """``first_divergence``'s line, or ``None``: what a torchrun worker reports in its JSON
    for the test to assert on (``assert case["vs_torch"] is None, case["vs_torch"]``).

    Example:
        >>> divergence_line([1.0, 2.0], [1.0, 3.0], names=("zero1", "single"), where="rank 0")
        'step 1, rank 0: zero1 2 (0x4000000000000000) vs single 3 (0x4008000000000000)'
    """
    d = first_divergence(ours, theirs, **kwargs)
    return None if d is None else str(d)


def worst_divergence(ours: Any, theirs: Any, *, atol: float = 0.0, rtol: float = 0.0,
                     names: tuple[str, str] = ("ours", "torch"), where: str = "",
                     equal_nan: bool = False, masks: Mapping[str, torch.Tensor] | None = None,
                     ) -> Divergence | None:
    """The element furthest outside ``|ours - theirs| <= atol + rtol |theirs|`` over every
    step and name (at ``atol = rtol = 0``: the largest difference), with the count of elements
    outside; ``None`` if none is. Inputs as ``first_divergence``; a difference in structure
    (name, shape, dtype) is returned as it. A NaN is outside (but for one on both sides with
    ``equal_nan``), and worst.

    Example:
        >>> ours = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([5.0, 6.0])}
        >>> theirs = {"a": torch.tensor([1.0, 2.001]), "b": torch.tensor([5.0, 6.5])}
        >>> d = worst_divergence(ours, theirs, atol=0.01, rtol=0)
        >>> print(d)  # doctest: +NORMALIZE_WHITESPACE
        b[1]: ours 6 (0x40c00000) vs torch 6.5 (0x40d00000); |diff| 0.5 > 0.01;
        1 of 4 elements outside the bound
    """
    worst, worst_excess, outside, total = None, -math.inf, 0, 0
    for item in _pairs(ours, theirs, names, where):
        if isinstance(item, Divergence):
            return item
        step, name, a, b = item
        diff = _abs_diff(a, b, equal_nan)
        allowed = atol + rtol * b.double().abs()
        excess = torch.where(diff.isnan(), math.inf, diff - allowed)
        m = _mask(masks, name, a)
        if m is not None:
            excess = torch.where(m, excess, -math.inf)
        out = excess > 0
        outside, total = outside + int(out.sum()), total + a.numel()
        if out.any():
            flat = int(excess.reshape(-1).argmax())
            if float(excess.reshape(-1)[flat]) > worst_excess:
                worst_excess = float(excess.reshape(-1)[flat])
                limit = float(allowed.reshape(-1)[flat])
                worst = _element(dict(kind="value", name=name, step=step, where=where,
                                      names=names, allowed=limit), a, b, flat)
    return None if worst is None else Divergence(**worst, count=outside, numel=total)


def max_abs_diff(ours: Any, theirs: Any, *, names: tuple[str, str] = ("ours", "torch"),
                 where: str = "", masks: Mapping[str, torch.Tensor] | None = None) -> float:
    """The largest ``|ours - theirs|`` over every step, name and element, in float64 (not
    rounded to the inputs' dtype); ``nan`` if either side has a NaN, so that ``max_abs_diff(a,
    b) <= bound`` fails then. Inputs as ``first_divergence``; they must have the same names,
    shapes and dtypes (else ValueError with the ``Divergence``).

    Example:
        >>> max_abs_diff({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([1.0, 2.5])})
        0.5
        >>> max_abs_diff([0.5, 0.25], [0.5, float("nan")])
        nan
    """
    worst = 0.0
    for item in _pairs(ours, theirs, names, where):
        if isinstance(item, Divergence):
            raise ValueError(f"parity: max_abs_diff of results that differ in structure: {item}")
        _, name, a, b = item
        diff = _abs_diff(a, b, equal_nan=False)
        m = _mask(masks, name, a)
        if m is not None:
            diff = torch.where(m, diff, 0.0)
        if diff.isnan().any():
            return math.nan
        if diff.numel():
            worst = max(worst, float(diff.max()))
    return worst


def assert_bitwise(ours: Any, theirs: Any, *, names: tuple[str, str] = ("ours", "torch"),
                   where: str = "", equal_nan: bool = False,
                   masks: Mapping[str, torch.Tensor] | None = None) -> None:
    """Raise ``AssertionError`` with the first divergence's line unless ``ours`` equals
    ``theirs`` bit for bit (Note [parity]). Inputs as ``first_divergence``.

    Example:
        >>> assert_bitwise([1.0, 2.0], [1.0, 2.0])
        >>> assert_bitwise({"b": torch.tensor(0.0)}, {"b": torch.tensor(-0.0)}, where="rank 0")
        Traceback (most recent call last):
        AssertionError: rank 0, b: ours 0 (0x00000000) vs torch -0 (0x80000000)
    """
    d = first_divergence(ours, theirs, names=names, where=where, equal_nan=equal_nan,
                         masks=masks)
    if d is not None:
        raise AssertionError(str(d))


def assert_close(ours: Any, theirs: Any, *, atol: float, rtol: float,
                 names: tuple[str, str] = ("ours", "torch"), where: str = "",
                 equal_nan: bool = False,
                 masks: Mapping[str, torch.Tensor] | None = None) -> None:
    """Raise ``AssertionError`` with the worst element's line unless every element holds
    ``|ours - theirs| <= atol + rtol |theirs|`` (``theirs`` is the oracle; as
    ``torch.testing.assert_close``, but both bounds are required: say where they come from,
    Note [error models]). Names, shapes and dtypes must agree. Inputs as ``first_divergence``.

    Example:
        >>> assert_close([2.0, 3.0], [2.0, 3.0 + 1e-7], atol=1e-6, rtol=0)
        >>> assert_close([2.0, 3.0], [2.0, 3.1], atol=1e-6, rtol=0,
        ...              where="rank 1")  # doctest: +NORMALIZE_WHITESPACE
        Traceback (most recent call last):
        AssertionError: step 1, rank 1: ours 3 (0x4008000000000000) vs torch 3.1
        (0x4008cccccccccccd); |diff| 0.1 > 1e-06; 1 of 2 elements outside the bound
    """
    d = worst_divergence(ours, theirs, atol=atol, rtol=rtol, names=names, where=where,
                         equal_nan=equal_nan, masks=masks)
    if d is not None:
        raise AssertionError(str(d))
