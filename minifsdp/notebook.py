"""Small helpers the notebooks use to show the package's code, check claims and exercises.

The notebooks never copy package code into cells: they print the real source with
``show_source`` (so what a reader sees is what runs) and then launch it.

Note [what a notebook prints]: a stored output must hold on the reader's machine, and PyTorch
picks its kernels by CPU (``ATEN_CPU_CAPABILITY``, MKL's code path, oneDNN's ISA), so the last
bits of a loss or of a difference between two implementations differ between machines. Two
kinds of output therefore exist:

- exact, machine-independent facts print as they are: byte and element counts, collective
  counts, shapes, ``torch.equal`` between two runs on *this* machine, ratios of exact counts;
- anything whose digits depend on the CPU's kernels (losses, drifts, differences that are not
  bitwise zero, timings) prints as a ``claim``: the statement and its bound, checked, and
  the measured value after a `` · measured: `` marker, so the reader sees the number. nbval's
  sanitizer (notebooks/nbval_sanitize.cfg) masks what follows the marker: the check on the
  value runs on every machine, its digits are never compared with the stored ones.

``claim`` is also how the prose stays honest: every number a markdown cell states is restated
by a ``claim`` in the code cell next to it, so a notebook whose text drifts from its
measurements fails nbval instead of misleading a reader. The test suite re-executes every
notebook as another CPU (tests/conftest.py) to prove the stored outputs are of the first kind.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any


def show_source(obj: Any, *, start: str | None = None, end: str | None = None) -> None:
    """Print the source of a function, class or module from ``minifsdp``, with its location.

    ``start``/``end`` (substrings of a line) print only the part between them, inclusive.

    Example:
        >>> from minifsdp.dist import print0
        >>> show_source(print0)  # doctest: +ELLIPSIS
        # minifsdp/dist.py, line ...
        def print0(...
    """
    obj = inspect.unwrap(obj)  # decorated functions (e.g. @torch.no_grad) show their own code
    lines, first = inspect.getsourcelines(obj)
    if start is not None:
        i = _find(lines, start, obj)
        lines, first = lines[i:], first + i
    if end is not None:
        lines = lines[: _find(lines, end, obj) + 1]
    path = Path(inspect.getsourcefile(obj)).resolve()
    rel = path.relative_to(path.parents[1]) if path.parent.name == "minifsdp" else path.name
    if path.parent.parent.name == "minifsdp":  # a sub-package, e.g. minifsdp/demos
        rel = path.relative_to(path.parents[2])
    print(f"# {rel}, line {first}")
    print("".join(lines).rstrip())


class ClaimError(AssertionError):
    """A statement a notebook makes about its own measurements is false."""


def claim(statement: str, holds: bool, measured: Any = None) -> None:
    """Print ``✓ statement · measured: <value>`` if ``holds``; else raise ``ClaimError``.

    The statement is what the prose says, bound included; ``measured`` is the number behind
    it (any object, shown short: floats to 4 significant digits, long reprs cut). nbval masks
    everything after `` · measured: `` (Note [what a notebook prints]), so a CPU-dependent
    value is shown to the reader without becoming part of what the stored output must equal.

    Example:
        >>> drift = 0.0271                       # depends on the CPU's kernels
        >>> claim("bf16 drifts from fp32 by less than 0.05", drift < 0.05, drift)
        ✓ bf16 drifts from fp32 by less than 0.05 · measured: 0.0271
        >>> ratio = 1.5
        >>> claim("ZeRO-2 sends 1x", ratio == 1, ratio)  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ClaimError: ✗ ZeRO-2 sends 1x -- measured: 1.5
    """
    if type(holds).__name__ not in ("bool", "bool_"):  # Python's or NumPy's bool only:
        # a tensor or a number here is almost always a forgotten comparison
        raise TypeError(f"claim({statement!r}, ...) needs a bool, got "
                        f"{type(holds).__name__} (compare, or use .item())")
    if not holds:
        raise ClaimError(f"✗ {statement} -- measured: {measured!r}")
    print(f"✓ {statement}" + ("" if measured is None else f" · measured: {_measured(measured)}"))


def _measured(value: Any, limit: int = 160) -> str:
    """``value`` for one line: floats to 4 significant digits (also inside tuples, lists and
    dicts), the whole cut to ``limit`` characters."""
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, (tuple, list)):
            inner = ", ".join(fmt(x) for x in v)
            return f"({inner})" if isinstance(v, tuple) else f"[{inner}]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {fmt(x)}" for k, x in v.items()) + "}"
        if hasattr(v, "item") and getattr(v, "ndim", None) == 0:  # a 0-d tensor or array
            return fmt(v.item())
        return repr(v)
    text = fmt(value).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _find(lines: list[str], marker: str, obj: Any) -> int:
    for k, line in enumerate(lines):
        if marker in line:
            return k
    raise ValueError(f"{marker!r} does not occur in the source of {obj!r}")


def check(name: str, cases: Iterable[tuple[tuple, Any]], fn: Callable,
          close: Callable[[Any, Any], bool] | None = None) -> bool:
    """Run ``fn(*args)`` on each ``(args, expected)`` case; print one verdict line.

    Returns True when every case matches (``close`` decides equality, default ``==``).
    Tensors in the answer are compared as lists, so returning ``tensor([4, 6])`` for
    ``[4, 6]`` is fine. Used by the exercises' one-line checkers, e.g.
    ``check_ring_bytes(my_fn)``.

    Example:
        >>> check("double", [((2,), 4), ((5,), 10)], lambda x: 2 * x)
        ✓ double: all 2 cases pass
        True
    """
    close = close or (lambda a, b: a == b)
    cases = list(cases)
    label = getattr(fn, "__name__", type(fn).__name__)
    for args, expected in cases:
        try:
            got = _plain(fn(*args))
        except NotImplementedError:
            print(f"✗ {name}: not implemented yet")
            return False
        try:
            ok = bool(close(got, expected))
        except Exception:  # e.g. None where a number was expected
            ok = False
        if not ok:
            shown = ", ".join(_short(a) for a in args)
            print(f"✗ {name}: {label}({shown}) returned {got!r}, expected {expected!r}")
            return False
    print(f"✓ {name}: all {len(cases)} cases pass")
    return True


def _plain(x: Any) -> Any:
    """Tensors (also inside lists/tuples) -> Python lists/numbers, for comparison."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    return x


def _short(arg: Any) -> str:
    """A one-line label for an argument: models by class and size, the rest by repr."""
    import torch

    if isinstance(arg, torch.nn.Module):
        return f"<{type(arg).__name__}: {sum(p.numel() for p in arg.parameters()):,} params>"
    if isinstance(arg, torch.Tensor):  # the shape says more than uninitialised values
        dtype = "" if arg.dtype == torch.float32 else f", {str(arg.dtype).split('.')[-1]}"
        return f"<tensor {tuple(arg.shape)}{dtype}>"
    if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
        inner = ", ".join(_short(a) for a in arg)
        return f"[{inner}]" if isinstance(arg, list) else f"({inner})"
    text = " ".join(repr(arg).split())  # one line, whatever the repr
    return text if len(text) <= 80 else text[:77] + "..."
