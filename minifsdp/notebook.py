"""Small helpers the notebooks use to show the package's code and check exercises.

The notebooks never copy package code into cells: they print the real source with
``show_source`` (so what a reader sees is what runs) and then launch it.
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
        i = next(k for k, ln in enumerate(lines) if start in ln)
        lines, first = lines[i:], first + i
    if end is not None:
        j = next(k for k, ln in enumerate(lines) if end in ln)
        lines = lines[: j + 1]
    path = Path(inspect.getsourcefile(obj)).resolve()
    rel = path.relative_to(path.parents[1]) if path.parent.name == "minifsdp" else path.name
    if path.parent.parent.name == "minifsdp":  # a sub-package, e.g. minifsdp/demos
        rel = path.relative_to(path.parents[2])
    print(f"# {rel}, line {first}")
    print("".join(lines).rstrip())


def check(name: str, cases: Iterable[tuple[tuple, Any]], fn: Callable,
          close: Callable[[Any, Any], bool] | None = None) -> bool:
    """Run ``fn(*args)`` on each ``(args, expected)`` case; print one verdict line.

    Returns True when every case matches (``close`` decides equality, default ``==``).
    Used by the exercises' one-line checkers, e.g. ``check_ring_bytes(my_fn)``.
    """
    close = close or (lambda a, b: a == b)
    cases = list(cases)
    for args, expected in cases:
        try:
            got = fn(*args)
        except NotImplementedError:
            print(f"✗ {name}: not implemented yet")
            return False
        if not close(got, expected):
            print(f"✗ {name}: {fn.__name__}{args} returned {got!r}, expected {expected!r}")
            return False
    print(f"✓ {name}: all {len(cases)} cases pass")
    return True
