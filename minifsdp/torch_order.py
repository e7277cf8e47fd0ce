"""The order in which torch's FSDP issues its collectives, recorded in torch's own processes, so
that minifsdp's order can be compared with it event by event (chapters 04 and 06, lab 06)::

    from minifsdp import torch_order
    order = torch_order.Recorder("fsdp1")   # or "fsdp2"; fails here if torch's names moved
    order.watch(model)                      # FSDP1 only: name torch's units as minifsdp does
    with order.record() as events:          # torch patched from here ...
        model(x).sum().backward()           # ... to here
    [e.short for e in events]               # ["AG (root)", "AG blocks.0", ..., "RS (root)"]

Note [recording torch's collective order]: torch logs no "all-gather of unit X issued now", so
we wrap the private functions that issue them, as torch's own tests do
(``torch.testing._internal.common_fsdp``: ``patch_unshard``, ``patch_post_backward``,
``patch_foreach_reduce``). The names, read from torch 2.14.1 and present unchanged in 2.11.0 (the
GPU machine's), are ``PATCHED`` below:

- FSDP2 (``fully_shard``), module ``torch.distributed.fsdp._fully_shard._fsdp_param_group``:
  ``FSDPParamGroup.unshard`` (an all-gather is issued when it leaves ``_all_gather_result`` set
  on a group that was neither unsharded nor in flight), ``FSDPParamGroup.wait_for_unshard``
  (waited for), ``FSDPParamGroup.post_backward`` (which group reduces) and ``foreach_reduce``
  (the reduce-scatter; looked up in that module at call time). A group is named by its
  ``_module_fqn``, the root ``"root"``, as minifsdp.fsdp2's comm tags name it.
- FSDP1 (``FullyShardedDataParallel``): ``_flat_param.FlatParamHandle._all_gather_flat_param``
  (all-gather), ``_runtime_utils._reduce_grad`` (reduce-scatter) and
  ``_runtime_utils._reduce_grad_no_shard`` (NO_SHARD's all-reduce), the latter two looked up
  in ``_runtime_utils`` at call time. A unit is named by its wrapper's path without
  ``_fsdp_wrapped_module``, the root ``"(root)"``, as minifsdp.fsdp1 names units.

They are private: any torch release may move them. So every patched name is checked before
anything is patched, and each attribute the wrappers read on torch's objects (``READ``) as it
is read; a missing one raises ``TorchNamesMoved`` naming it and torch's version, never a silent
recording of nothing. tests/test_torch_order.py checks the names on the installed torch and
that real runs record the known order. The patches exist only inside ``record()`` and are
undone on leaving it, also on an error.
"""

from __future__ import annotations

import contextlib
import importlib
import time
import weakref
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

FSDP2_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
FLAT_PARAM = "torch.distributed.fsdp._flat_param"
RUNTIME = "torch.distributed.fsdp._runtime_utils"

# api -> the (module, attribute path) pairs record() replaces; Note [recording torch's
# collective order]
PATCHED: dict[str, tuple[tuple[str, str], ...]] = {
    "fsdp2": ((FSDP2_GROUP, "FSDPParamGroup.unshard"),
              (FSDP2_GROUP, "FSDPParamGroup.wait_for_unshard"),
              (FSDP2_GROUP, "FSDPParamGroup.post_backward"),
              (FSDP2_GROUP, "foreach_reduce")),
    "fsdp1": ((FLAT_PARAM, "FlatParamHandle._all_gather_flat_param"),
              (RUNTIME, "_reduce_grad"),
              (RUNTIME, "_reduce_grad_no_shard")),
}
# api -> attributes of torch's objects the wrappers read (set in __init__, so checked on the
# object when first read): an FSDP2 group's, an FSDP1 wrapper's
READ: dict[str, tuple[str, ...]] = {
    "fsdp2": ("_all_gather_result", "is_unsharded", "_module_fqn"),
    "fsdp1": ("_handle",),
}
SHORT = {"all_gather": "AG", "wait": "W", "reduce_scatter": "RS", "all_reduce": "AR",
         "forward": "F"}
WRAPPED = "_fsdp_wrapped_module"  # torch FSDP1's (and minifsdp.fsdp1's) wrapped module


class TorchNamesMoved(RuntimeError):
    """A private torch name this module patches or reads is gone: torch moved it."""


class Event(NamedTuple):
    """One event: ``op`` is ``"all_gather"`` (issued), ``"wait"`` (FSDP2: its all-gather waited
    for), ``"reduce_scatter"``, ``"all_reduce"`` (FSDP1 NO_SHARD) or a caller's ``mark``
    (e.g. ``"forward"``); ``group`` the FSDP group or unit; ``t`` ``time.perf_counter()`` when
    it happened (an all-gather: just before the call that issued it); ``tag`` a caller's
    mark's note (empty for torch's events)."""

    op: str
    group: str
    t: float
    tag: str = ""

    @property
    def short(self) -> str:
        """``"AG blocks.0"``: the op abbreviated (``SHORT``), then the group."""
        return f"{SHORT.get(self.op, self.op)} {self.group}"


def _moved(what: str) -> TorchNamesMoved:
    return TorchNamesMoved(
        f"torch {torch.__version__} has no {what}: minifsdp.torch_order patches torch's private "
        "FSDP functions to record its collective order (Note [recording torch's collective "
        "order]), and this torch moved or renamed one. Read torch's source for where it went "
        "and update PATCHED / READ in minifsdp/torch_order.py.")


def resolve(module: str, path: str) -> tuple[Any, str, Any]:
    """``(owner, name, value)`` of ``module.path``; ``TorchNamesMoved`` if any part is missing or
    ``name`` is only inherited by ``owner`` (patching it there would not restore exactly)."""
    try:
        owner = importlib.import_module(module)
    except ImportError as e:
        raise _moved(f"module {module} ({e})") from e
    *parents, name = path.split(".")
    for part in parents:
        if not hasattr(owner, part):
            raise _moved(f"{module}.{path} ({part} is missing)")
        owner = getattr(owner, part)
    if name not in vars(owner):
        raise _moved(f"{module}.{path}")
    return owner, name, vars(owner)[name]


def check_names(api: str) -> None:
    """Raise ``TorchNamesMoved`` unless every name ``api``'s recorder patches exists here."""
    if api not in PATCHED:
        raise ValueError(f"api must be one of {sorted(PATCHED)}, not {api!r}")
    for module, path in PATCHED[api]:
        resolve(module, path)
    if api == "fsdp2":  # is_unsharded is a property: checkable on the class
        resolve(FSDP2_GROUP, "FSDPParamGroup.is_unsharded")


def _read(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _moved(f"{type(obj).__module__}.{type(obj).__qualname__}.{name}") from None


def fsdp1_unit_name(fqn: str) -> str:
    """An FSDP1 wrapper's path in ``named_modules()`` -> its unit's name as minifsdp.fsdp1 names
    it: ``"_fsdp_wrapped_module.blocks.0"`` -> ``"blocks.0"``, ``""`` -> ``"(root)"``."""
    return fqn.replace(f"{WRAPPED}.", "").replace(WRAPPED, "").rstrip(".") or "(root)"


_ACTIVE: dict[str, Recorder] = {}  # api -> the recorder whose patches are in place


class Recorder:
    """Records torch's FSDP1 or FSDP2 collectives, in issue order, while ``record()`` is active.

    ``api``: ``"fsdp2"`` (``fully_shard``) or ``"fsdp1"`` (``FullyShardedDataParallel``; call
    ``watch(model)`` for each model first, so that its units have names). Checks torch's names
    at construction (``TorchNamesMoved``). One recorder per api may record at a time."""

    def __init__(self, api: str):
        check_names(api)
        self.api = api
        self.events: list[Event] | None = None  # None: not recording
        self._names: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # FSDP1 handle
        self._reducing: list[str] = []  # FSDP2: groups inside post_backward, innermost last

    @property
    def recording(self) -> bool:
        return self.events is not None

    def mark(self, op: str, group: str, tag: str = "") -> None:
        """Add a caller's own event (a unit's forward start, one of minifsdp's collectives) to
        the same timeline; kept only while recording."""
        if self.events is not None:
            self.events.append(Event(op, group, time.perf_counter(), tag))

    def watch(self, model: torch.nn.Module) -> dict[str, torch.nn.Module]:
        """FSDP1: name every torch FSDP unit of ``model`` (``fsdp1_unit_name``); returns
        name -> its ``FullyShardedDataParallel`` wrapper."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if self.api != "fsdp1":
            raise ValueError("watch() names FSDP1 units; FSDP2 groups name themselves")
        units = {}
        for fqn, m in model.named_modules():
            if isinstance(m, FullyShardedDataParallel) and _read(m, "_handle") is not None:
                units[fsdp1_unit_name(fqn)] = m
                self._names[m._handle] = fsdp1_unit_name(fqn)
        return units

    @contextlib.contextmanager
    def record(self) -> Iterator[list[Event]]:
        """Patch torch, yield the list the events go into, undo the patches on exit."""
        if self.api in _ACTIVE:
            raise RuntimeError(f"a {self.api} Recorder is recording already: one at a time")
        wrappers = self._fsdp2() if self.api == "fsdp2" else self._fsdp1()
        saved = []
        _ACTIVE[self.api] = self
        try:
            for (module, path), wrap in zip(PATCHED[self.api], wrappers):
                owner, name, original = resolve(module, path)
                saved.append((owner, name, original))
                setattr(owner, name, wrap(original))
            self.events = events = []
            yield events
        finally:
            self.events = None
            for owner, name, original in reversed(saved):
                setattr(owner, name, original)
            del _ACTIVE[self.api]

    # ---- the wrappers: each takes torch's function, returns the one patched in ----------------

    def _fsdp2(self) -> list:
        def group(g) -> str:
            return _read(g, "_module_fqn") or "root"

        def unshard(fn):
            def unshard(g, *args, **kwargs):
                issues = _read(g, "_all_gather_result") is None and not _read(g, "is_unsharded")
                t = time.perf_counter()
                out = fn(g, *args, **kwargs)
                if issues and g._all_gather_result is not None:
                    self._add("all_gather", group(g), t)
                return out
            return unshard

        def wait_for_unshard(fn):
            def wait_for_unshard(g, *args, **kwargs):
                if _read(g, "_all_gather_result") is not None:
                    self._add("wait", group(g))
                return fn(g, *args, **kwargs)
            return wait_for_unshard

        def post_backward(fn):
            def post_backward(g, *args, **kwargs):
                self._reducing.append(group(g))
                try:
                    return fn(g, *args, **kwargs)
                finally:
                    self._reducing.pop()
            return post_backward

        def foreach_reduce(fn):
            def foreach_reduce(*args, **kwargs):
                if not self._reducing:
                    raise RuntimeError(
                        f"torch {torch.__version__} called foreach_reduce outside "
                        "FSDPParamGroup.post_backward: Note [recording torch's collective "
                        "order] no longer holds for this torch")
                self._add("reduce_scatter", self._reducing[-1])
                return fn(*args, **kwargs)
            return foreach_reduce

        return [unshard, wait_for_unshard, post_backward, foreach_reduce]

    def _fsdp1(self) -> list:
        def unit(handle) -> str:
            if handle not in self._names:
                raise RuntimeError("a torch FSDP1 unit this Recorder does not know: call "
                                   "watch(model) after wrapping the model, before record()")
            return self._names[handle]

        def all_gather(fn):
            def _all_gather_flat_param(handle, *args, **kwargs):
                self._add("all_gather", unit(handle))
                return fn(handle, *args, **kwargs)
            return _all_gather_flat_param

        def reduce(op):
            def wrap(fn):
                def reduce_grad(state, handle, *args, **kwargs):
                    self._add(op, unit(handle))
                    return fn(state, handle, *args, **kwargs)
                return reduce_grad
            return wrap

        return [all_gather, reduce("reduce_scatter"), reduce("all_reduce")]

    def _add(self, op: str, group: str, t: float | None = None) -> None:
        if self.events is not None:
            self.events.append(Event(op, group, time.perf_counter() if t is None else t))
