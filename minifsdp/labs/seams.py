"""Seams: where the real package calls the reader's code.

A lab's skeleton (``labs/labNN_*.py``) defines one or more functions; each replaces one named
attribute of the reference package, looked up at call time::

    Seam("ring.reduce_scatter", "minifsdp.ring", "ring_reduce_scatter")
    Seam("ddp.grad_hook", "minifsdp.ddp", "BucketedDDP._on_grad_ready")   # a method: 1st arg = self

Everything around the seam stays the real minifsdp, so lab 05 never needs lab 02.

Note [installing a seam]: the checker passes the reader's file to every worker in
``MINIFSDP_LAB_FILE`` (``launch.torchrun(env=...)`` forwards it); ``install`` runs first in
each worker, loads the file, and sets each seam's attribute to the reader's function wrapped in
a call counter. A spec is a path (every seam function must be in the file), ``path:name`` (one
function of the file replaces the seam named by its ``__seam__``; the others stay the
reference: this is how ``tests/lab_bugs`` plants one bug at a time), or ``"reference"`` (the
package's own functions, still counted: a check of the harness itself). The counter lets a case
insist that its seams were reached -- a seam no case calls would pass any code at all.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minifsdp.labs import heartbeat

LAB_IDS = ("00", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11")
REFERENCE = "reference"


@dataclass(frozen=True)
class Seam:
    """One replaceable attribute: ``owner`` module, ``attr`` (``"fn"`` or ``"Class.method"``),
    and ``function``, the name the skeleton gives it (default: the attribute's last part)."""

    name: str
    owner: str
    attr: str
    function: str = ""

    @property
    def fn_name(self) -> str:
        return self.function or self.attr.split(".")[-1].lstrip("_")

    def target(self) -> tuple[Any, str]:
        """The object that holds the attribute, and the attribute's name."""
        obj: Any = importlib.import_module(self.owner)
        *path, last = self.attr.split(".")
        for part in path:
            obj = getattr(obj, part)
        return obj, last


@dataclass(frozen=True)
class Lab:
    """A chapter's lab: what the reader writes, where it plugs in, how it is checked.

    ``run(trace, info)`` runs every case inside a torchrun worker (see ``report.Trace``);
    ``hint(name, got, expected, world_size)`` may explain a divergence in the chapter's words;
    ``world_sizes`` are the jobs the checker launches, one after another; ``hints`` are the
    graded hints ``python -m minifsdp.labs NN --hint`` gives one at a time, from a nudge
    towards the right Note to the shape of the solution (never its code).
    """

    id: str
    title: str
    skeleton: str  # relative to the repository root
    seams: tuple[Seam, ...]
    notes: tuple[str, ...]
    run: Callable[..., None]
    hint: Callable[..., str | None] | None = None
    world_sizes: tuple[int, ...] = (2, 3)
    oracle: str = "torch"
    extra: dict[str, Any] = field(default_factory=dict)
    hints: tuple[str, ...] = ()


def get_lab(lab_id: str) -> Lab:
    """The ``Lab`` of chapter ``lab_id`` ("00", "02", ...), defined in ``minifsdp/labs/chNN.py``."""
    lab_id = str(lab_id).zfill(2)
    if lab_id not in LAB_IDS:
        raise ValueError(f"no lab {lab_id!r}: labs are {', '.join(LAB_IDS)}")
    return importlib.import_module(f"minifsdp.labs.ch{lab_id}").LAB


class LabFileError(ValueError):
    """The reader's file cannot be used: missing, unloadable, or a function is misnamed."""


def load(lab: Lab, spec: str) -> dict[str, Callable]:
    """The functions ``spec`` puts into ``lab``'s seams, by seam name (Note [installing a
    seam]). Raises ``LabFileError`` naming the file and the missing or mis-signed function."""
    if spec == REFERENCE:
        return {s.name: getattr(*s.target()) for s in lab.seams}
    path, _, one = spec.partition(":") if not Path(spec).exists() else (spec, "", "")
    file = Path(path)
    if not file.exists():
        raise LabFileError(f"lab {lab.id}: no file {path}")
    name = f"_minifsdp_lab{lab.id}_{abs(hash(str(file.resolve()))) % 10**8}"
    mod_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        mod_spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        raise LabFileError(f"lab {lab.id}: {file}:{e.lineno}: SyntaxError: {e.msg}") from None
    except Exception as e:  # a NameError, an ImportError... at import: name the file's line
        sys.modules.pop(name, None)
        where = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == file]
        line = f":{where[-1].lineno}" if where else ""
        raise LabFileError(f"lab {lab.id}: {file}{line}: importing it raised "
                           f"{type(e).__name__}: {e}") from None
    if one:
        fn = getattr(module, one, None)
        seam = next((s for s in lab.seams if s.name == getattr(fn, "__seam__", None)), None)
        if fn is None or seam is None:
            raise LabFileError(f"lab {lab.id}: {file} has no function {one!r} marked with the "
                               f"seam it replaces (@replaces(...))")
        chosen = {seam.name: fn}
    else:
        chosen = {}
        for s in lab.seams:
            fn = getattr(module, s.fn_name, None)
            if not callable(fn):
                raise LabFileError(f"lab {lab.id}: {file} defines no function {s.fn_name}() "
                                   f"(seam {s.name!r})")
            chosen[s.name] = fn
    for s in lab.seams:
        if s.name in chosen:
            _check_signature(lab, s, chosen[s.name], file)
    return chosen


def replaces(seam_name: str) -> Callable[[Callable], Callable]:
    """Mark a function as the replacement for ``seam_name`` (used by ``path:name`` specs)."""
    def mark(fn: Callable) -> Callable:
        fn.__seam__ = seam_name
        return fn
    return mark


def _check_signature(lab: Lab, seam: Seam, fn: Callable, file: Path) -> None:
    """The reader's parameters must match the skeleton's (the skeleton is the spec)."""
    skeleton = _skeleton_module(lab)
    want = list(inspect.signature(getattr(skeleton, seam.fn_name)).parameters)
    got = list(inspect.signature(fn).parameters)
    if got != want:
        raise LabFileError(f"lab {lab.id}: {file}: {fn.__name__}({', '.join(got)}) must take "
                           f"({', '.join(want)}) like the skeleton {lab.skeleton}")


def _skeleton_module(lab: Lab) -> Any:
    from minifsdp.launch import repo_root

    path = repo_root() / lab.skeleton
    name = f"_minifsdp_skeleton{lab.id}"
    if name not in sys.modules:
        mod_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[name] = module
        mod_spec.loader.exec_module(module)
    return sys.modules[name]


# ---- inside a worker ------------------------------------------------------------------------

CALLS: dict[str, int] = {}
_REFERENCE: dict[str, Callable] = {}
_ORIGINAL: dict[str, tuple[Any, str, Any]] = {}  # seam -> (owner, attr, what install replaced)


def install(lab: Lab, spec: str | None = None) -> None:
    """Put the functions of ``spec`` (default: ``$MINIFSDP_LAB_FILE``) into ``lab``'s seams,
    each wrapped in a call counter; remember the reference functions (``reference``).
    ``uninstall`` puts the package's own functions back."""
    spec = spec or os.environ.get("MINIFSDP_LAB_FILE", REFERENCE)
    uninstall(lab)
    chosen = load(lab, spec)
    for s in lab.seams:
        owner, attr = s.target()
        original = inspect.getattr_static(owner, attr)
        _ORIGINAL[s.name] = (owner, attr, original)
        _REFERENCE[s.name] = getattr(owner, attr)
        fn = chosen.get(s.name, original)
        setattr(owner, attr, _counted(s.name, fn))
        CALLS[s.name] = 0


def uninstall(lab: Lab) -> None:
    """Undo ``install``: every seam of ``lab`` holds the package's own function again."""
    for s in lab.seams:
        if s.name in _ORIGINAL:
            owner, attr, original = _ORIGINAL.pop(s.name)
            setattr(owner, attr, original)


def reference(seam_name: str) -> Callable:
    """The package's own function behind ``seam_name`` (an oracle for intermediate values)."""
    return _REFERENCE[seam_name]


def _counted(name: str, fn: Callable) -> Callable:
    if isinstance(fn, (staticmethod, classmethod)):
        raise TypeError(f"seam {name}: static and class methods are not supported")

    def counted(*args: Any, **kwargs: Any) -> Any:
        CALLS[name] += 1
        heartbeat.beat()
        return fn(*args, **kwargs)

    counted.__name__ = getattr(fn, "__name__", name)
    counted.__wrapped__ = fn
    return counted
