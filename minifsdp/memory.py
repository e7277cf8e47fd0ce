"""Live tensor memory over time, by category: a small ``TorchDispatchMode``.

On CPU there is no allocator to ask (and RSS is noise), so we count tensors ourselves. Every
tensor lives in an ``UntypedStorage``, the unit of memory. ``MemoryTracker`` sees every op
(it is a dispatch mode), remembers each new storage by *weak* reference and adds its bytes
to a category; when the storage dies, the weakref's callback subtracts them. That is the
whole mechanism; the rest is naming categories and phases. It is a teaching-sized version of
torch's ``torch.distributed._tools.mem_tracker.MemTracker`` and reports the same peak, byte
for byte, on the same step (``tests/test_memory.py``).

Note [storages, not tensors]: views share their base's storage, so summing tensors would count
a view twice; summing storages counts memory once. A weak reference keeps the tracker from
extending any lifetime, and its callback is our "free" event. ``storage.resize_`` bypasses the
dispatcher, and FSDP frees and re-allocates unsharded parameters exactly that way
(``resize_(0)`` / ``resize_(n)``), so while a tracker is active we patch it.

Note [categories]: each storage has one of ``CATEGORIES``.
  * ``params``, ``grads``, ``optimizer``: found in the model and optimizer we are given, and
    re-found at every phase boundary, because all three appear or move while we watch: grads
    are born in backward, Adam's state inside its first ``step()``, and FSDP swaps sharded and
    unsharded parameters in and out of the module.
  * ``activations``: whatever an op creates outside backward and ``optimizer.step()``, i.e.
    in the forward pass and the loss. What outlives the forward is exactly what autograd
    saved for backward (plus the loss); forward temporaries count here for the short time
    they live. Register the input batch as ``activations``: the first layer saves it.
  * ``other``: what is created inside backward (gradients of activations, temporaries of
    backward ops) or inside ``optimizer.step()`` and is not optimizer state.
  * ``comm``: buffers that a collective reads or writes and that are not params, grads or
    state (an all-gather output, a DDP bucket), and whatever ``tag(t, "comm")`` names.

Note [DTensor]: a ``fully_shard`` model's parameters are ``DTensor``s, wrappers around a local
tensor. For an op on DTensors we return ``NotImplemented``: DTensor then runs the op on its
local tensors, which come back through this mode and are counted. The wrapper owns no memory.
DTensor's sharding propagation may run ops under a fake mode; those allocate nothing, skip them.
No DTensor exists before ``torch.distributed.tensor`` is imported, so we look the class up only
once something has imported it: importing it here would cost every DDP or ZeRO rank about a
second of CPU at startup (mostly sympy), for a type it never meets.

Note [labels]: categories say *what* memory is for; a label says *whose* it is. A storage
tagged with ``label="blocks.1"`` is also counted under that name, and every sample then has
``"labels": {name: bytes}`` -- e.g. how many bytes of each FSDP2 group are unsharded over a
step (``minifsdp.plot.plot_label_timeline``). A label sticks to its storage through
``resize_(0)`` / ``resize_(n)``, so a freed and re-gathered parameter keeps its name.

Note [compiled code]: ``torch.compile`` will not trace under a dispatch mode, unless the mode
says ``ignore_compile_internals()``: then compile turns it off while it traces and back on
while the compiled graphs run. Ours says so. A graph run as Python (``aot_eager``,
``minifsdp.graph_passes.backend``) calls ATen ops one by one, and we see each of them, so a
compiled step is measured like an eager one (chapter 10). Inductor's generated code allocates
its buffers outside the dispatcher: for it we would see only the ops it did not fuse.

Note [CUDA]: the caching allocator rounds every block up to 512 bytes, so we round too (as
torch's MemTracker does) and record ``torch.cuda.memory_allocated()`` in each sample as
``"allocator"``, a cross-check that also sees what no dispatch mode can (workspaces, NCCL
buffers). This path is untested on the CPU-only machine it was written on.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from contextlib import contextmanager
from functools import partial

import torch
from torch._guards import active_fake_mode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "other")
MODEL_STATE = ("params", "grads", "optimizer")
_ACTIVE: list[MemoryTracker] = []  # trackers inside their `with` block, for `tag`


def tag(tensor, category: str, label: str | None = None) -> None:
    """Count ``tensor``'s storage as ``category`` in every active tracker; a no-op otherwise.

    Lets code that knows nothing about trackers (``minifsdp.comm``) label its buffers.
    ``label`` also counts it under that name (Note [labels]), e.g. FSDP2's unsharded
    parameters under their group's name.

    Example:
        >>> tag(torch.empty(1024), "comm")  # no tracker active: nothing happens
    """
    for tracker in _ACTIVE:
        tracker.register(tensor, category, label)


def _is_dtensor(cls: type) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # Note [DTensor]: not imported here
    return dtensor is not None and issubclass(cls, dtensor.DTensor)


_WRAPPER: dict[type, bool] = {}  # tensor type -> is it a wrapper subclass (a DTensor)?


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``t``'s data: its own, or its inner tensors' for a DTensor."""
    # Called for every tensor of every op while tracking: the type's answer is looked up once.
    wrapper = _WRAPPER.get(type(t))
    if wrapper is None:
        wrapper = _WRAPPER[type(t)] = is_traceable_wrapper_subclass_type(type(t))
    if wrapper:
        inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
        return [s for x in inner if isinstance(x, torch.Tensor) for s in _storages(x)]
    return [t.untyped_storage()] if t.layout == torch.strided else []


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in ``tree`` in pytree order; a tensor, list or tuple without the pytree walk."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if type(tree) in (list, tuple):
        return [t for x in tree for t in _tensors(x)]
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class MemoryTracker(TorchDispatchMode):
    """Live tensor bytes per category after every op, the peak, and a timeline.

    Args:
        model: its parameters and buffers count as ``params``, their ``.grad`` as ``grads``.
        optimizer: its ``state`` counts as ``optimizer``; ``step()`` is the phase
            ``"optimizer step"``.
        device: whose memory to count (default: the model's device, else CPU).
        max_samples: when the timeline grows past this, adjacent samples are merged,
            keeping the larger, so peaks stay visible.

    Results: ``peak`` (bytes), ``peak_by_category`` (at that moment), ``peak_phase``,
    ``timeline`` (``[{"i": event, "phase": str, "total": bytes, <category>: bytes}, ...]``),
    ``current()`` and ``to_dict()`` (JSON). One tracker per process (per rank).

    Example:
        >>> model = torch.nn.Linear(256, 256)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> with MemoryTracker(model, opt) as mt:
        ...     model(torch.randn(8, 256)).sum().backward()
        ...     opt.step()
        >>> mt.peak_by_category["params"] == 4 * (256 * 256 + 256)
        True
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # Note [compiled code]
        return True

    def __init__(self, model=None, optimizer=None, device=None, max_samples: int = 4096):
        super().__init__()
        if device is None:
            p = next(model.parameters(), None) if model is not None else None
            device = _storages(p)[0].device if p is not None else "cpu"
        self.device = torch.device(device)
        self.model, self.optimizer, self.max_samples = model, optimizer, max_samples
        self._live: dict[int, list] = {}  # id(storage) -> [weakref, bytes, category]
        self._labels: dict[int, str] = {}  # id(storage) -> label (Note [labels])
        self._label_bytes: dict[str, int] = {}
        self._bytes = dict.fromkeys(CATEGORIES, 0)
        self._phases = ["(none)"]  # a stack, pushed by `phase()` and `optimizer.step()`
        self._module_phase: str | None = None  # set by `track_modules`'s hooks; wins if set
        self._module_stack: list[str] = []
        self._caller: dict[str, str | None] = {}  # module name -> the module that called it
        self._module_roots: list[torch.nn.Module] = []  # from `track_modules`
        self._modules: list[torch.nn.Module] | None = None  # the model's, taken on first use
        self._in_optimizer = self._state_pending = False
        self._handles, self._events = [], 0
        self.timeline: list[dict] = []
        self.peak, self.peak_by_category, self.peak_phase, self.peak_i = 0, {}, "", 0

    # ---- storages ------------------------------------------------------------------------

    def _track(self, st: torch.UntypedStorage, category: str, force: bool = False) -> bool:
        """Count ``st`` if new, else refresh its size; if ``force``, move it to ``category``.

        Returns whether any count changed."""
        key = id(st)
        entry = self._live.get(key)
        if entry is None:
            dev = st.device
            if dev.type != self.device.type or self.device.index not in (None, dev.index):
                return False
            ref = weakref.ref(st, partial(self._on_free, key))
            entry = self._live[key] = [ref, 0, category]
        nbytes, old_bytes, old_category = st.nbytes(), entry[1], entry[2]
        if self.device.type == "cuda":
            nbytes = -(-nbytes // 512) * 512  # Note [CUDA]
        new_category = category if force else old_category
        if nbytes == old_bytes and new_category == old_category:
            return False  # the common case: a rescan finding what it found last time
        entry[1], entry[2] = nbytes, new_category
        self._bytes[old_category] -= old_bytes
        self._bytes[new_category] += nbytes
        if key in self._labels:
            self._label_bytes[self._labels[key]] += nbytes - old_bytes
        return True

    def _on_free(self, key: int, ref: weakref.ref) -> None:
        entry = self._live.get(key)  # Python calls this as the storage dies
        if entry is not None and entry[0] is ref:
            del self._live[key]
            self._bytes[entry[2]] -= entry[1]
            if key in self._labels:
                self._label_bytes[self._labels.pop(key)] -= entry[1]
            self._record()

    def register(self, tensors, category: str, label: str | None = None) -> None:
        """Count ``tensors`` (a tensor or any nest of them) as ``category`` from now on, and
        under ``label`` if given (Note [labels]).

        Example:
            >>> x = torch.randn(64, 1, 28, 28)
            >>> with MemoryTracker() as mt:
            ...     mt.register(x, "activations")
            >>> mt.peak_by_category["activations"] == 64 * 784 * 4
            True
        """
        assert category in CATEGORIES, f"unknown category {category!r}"
        storages = [st for t in _tensors(tensors) for st in _storages(t)]
        changed = [self._track(st, category, True) for st in storages]
        if label is not None:
            for st in storages:
                if id(st) in self._live and self._labels.get(id(st)) != label:
                    old = self._labels.get(id(st))
                    if old is not None:
                        self._label_bytes[old] -= self._live[id(st)][1]
                    self._labels[id(st)] = label
                    self._label_bytes[label] = (self._label_bytes.get(label, 0)
                                                + self._live[id(st)][1])
                    changed.append(True)
        if any(changed):
            self._record()

    def _rescan(self) -> None:
        """Re-find params, grads and optimizer state (Note [categories])."""
        if self.model is not None:
            for t in self._model_tensors():
                self.register(t, "params")
                if t.grad is not None:
                    self.register(t.grad, "grads")
        if self.optimizer is not None:
            self.register([list(s.values()) for s in self.optimizer.state.values()], "optimizer")

    def _model_tensors(self):
        """``(*model.parameters(), *model.buffers())``, in that order, without walking the
        module tree again: a rescan runs at every module boundary, and the tree does not
        change while the tracker is active (FSDP swaps *parameters*, read afresh here)."""
        if self._modules is None:
            self._modules = list(self.model.modules())
        for attr in ("_parameters", "_buffers"):
            seen = set()
            for module in self._modules:
                for t in getattr(module, attr).values():
                    if t is not None and id(t) not in seen:
                        seen.add(id(t))
                        yield t

    # ---- the dispatch mode ---------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(_is_dtensor(t) for t in types):
            return NotImplemented  # Note [DTensor]: DTensor calls us back with local tensors
        out = func(*args, **(kwargs or {}))
        if active_fake_mode() is not self._fake_mode:
            return out  # DTensor's shape propagation: nothing real was allocated
        in_backward = torch._C._current_graph_task_id() != -1
        n_live = len(self._live)
        for t in _tensors(out):
            for st in _storages(t):
                self._track(st, "other" if in_backward or self._in_optimizer else "activations")
        if func.namespace in ("c10d", "_c10d_functional"):  # a collective's buffers are comm
            for t in _tensors((args, kwargs, out)):
                for st in _storages(t):
                    if self._live.get(id(st), [0, 0, "comm"])[2] not in (*MODEL_STATE, "comm"):
                        self._track(st, "comm", force=True)
        if self._in_optimizer and self._state_pending and len(self._live) > n_live:
            # Adam creates its state lazily, inside its first step(): name it as soon as it
            # exists rather than at the end of step(), which is often where the peak is.
            self.register([list(s.values()) for s in self.optimizer.state.values()], "optimizer")
        self._record()
        return out

    def _resize(self, resize, st: torch.UntypedStorage, size: int):
        out = resize(st, size)  # Note [storages, not tensors]: FSDP's free and re-alloc
        if (id(st) in self._live or size > 0) and self._track(st, "other"):
            self._record()
        return out

    # ---- samples and the peak ------------------------------------------------------------

    @property
    def current_phase(self) -> str:
        """A module's name if inside one, else the innermost ``phase()``."""
        if self._module_phase:
            return self._module_phase
        if self._phases[-1] == "(none)" and torch._C._current_graph_task_id() != -1:
            return "backward"  # e.g. the loss's backward, before the model's hooks fire
        return self._phases[-1]

    def current(self) -> dict[str, int]:
        """Live bytes by category right now, plus ``"total"``."""
        return {**self._bytes, "total": sum(self._bytes.values())}

    def _record(self) -> None:
        if self not in _ACTIVE:
            return  # a storage freed after __exit__: counts stay right, no samples
        self._events += 1
        total, phase = sum(self._bytes.values()), self.current_phase
        if total > self.peak:
            self.peak, self.peak_by_category = total, dict(self._bytes)
            self.peak_phase, self.peak_i = phase, self._events
        last = self.timeline[-1] if self.timeline else {}
        labels = dict(self._label_bytes) if self._label_bytes else None
        if (last.get("phase") == phase and last.get("labels") == labels
                and all(last[c] == self._bytes[c] for c in CATEGORIES)):
            return  # nothing to see since the last sample
        sample = {"i": self._events, "phase": phase, "total": total, **self._bytes}
        if labels is not None:
            sample["labels"] = labels
        if self.device.type == "cuda":
            sample["allocator"] = torch.cuda.memory_allocated(self.device)
        self.timeline.append(sample)
        if len(self.timeline) > self.max_samples:
            pairs = zip(self.timeline[::2], self.timeline[1::2] + [{"total": -1}])
            self.timeline = [a if a["total"] >= b["total"] else b for a, b in pairs]

    def reset_peak(self) -> None:
        """Forget the peak: from now on it is measured from the current total."""
        self.peak, self.peak_by_category = sum(self._bytes.values()), dict(self._bytes)
        self.peak_phase, self.peak_i = self.current_phase, self._events

    def to_dict(self) -> dict:
        """All results as a JSON-serializable dict (workers write it into ``rank{r}.json``)."""
        return {
            "device": str(self.device),
            "categories": list(CATEGORIES),
            "peak": self.peak,
            "peak_by_category": self.peak_by_category,
            "peak_phase": self.peak_phase,
            "peak_i": self.peak_i,
            "current": self.current(),
            "timeline": self.timeline,
        }

    # ---- phases --------------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str):
        """Name what runs inside: ``with tracker.phase("forward"): loss = ...``."""
        self._phases.append(name)
        self._set_module_phase(None)
        try:
            yield self
        finally:
            self._phases.pop()
            self._set_module_phase(None)

    def track_modules(self, model: torch.nn.Module) -> None:
        """Name phases after ``model``'s modules, like ``"forward conv1"``, ``"backward fc1"``.

        The hooks are installed while the tracker is active. Forward hooks nest, so a stack
        suffices. In backward, a module's pre-hook names the phase after it and its post-hook
        hands the name back to the module that called it, so functional ops in between
        (``F.relu``) are attributed to their caller.
        """
        self._module_roots.append(model)

    def _hook_modules(self, model: torch.nn.Module) -> None:
        # A module none of whose inputs needs grad (the first layer) gets its post-backward
        # hook called *before* its backward, with a warning. `_exit_bw` ignores that call
        # (its grads are all None), so the warning has nothing to tell.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        for name, mod in model.named_modules():
            self._handles += [
                mod.register_forward_pre_hook(partial(self._enter_fw, name)),
                mod.register_forward_hook(self._exit_fw, always_call=True),
                mod.register_full_backward_pre_hook(partial(self._enter_bw, name)),
                mod.register_full_backward_hook(partial(self._exit_bw, name)),
            ]

    def _set_module_phase(self, phase: str | None = None) -> None:
        self._module_phase = phase.rstrip() if phase else None  # the root's name is ""
        self._rescan()

    def _enter_fw(self, name, module, args):
        self._caller[name] = self._module_stack[-1] if self._module_stack else None
        self._module_stack.append(name)
        self._set_module_phase(f"forward {name}")

    def _exit_fw(self, module, args, output):
        self._module_stack.pop()
        self._set_module_phase(f"forward {self._module_stack[-1]}" if self._module_stack else None)

    def _enter_bw(self, name, module, grad_output):
        if name == "":  # the root: when backward is over, stop naming phases after modules
            torch.autograd.Variable._execution_engine.queue_callback(self._set_module_phase)
        self._set_module_phase(f"backward {name}")

    def _exit_bw(self, name, module, grad_input, grad_output):
        if self._caller.get(name) is not None and any(g is not None for g in grad_input):
            self._set_module_phase(f"backward {self._caller[name]}")

    # ---- entering and leaving ------------------------------------------------------------

    def __enter__(self):
        self._fake_mode = active_fake_mode()
        self._modules = None  # taken afresh each time the tracker is entered
        _ACTIVE.append(self)
        if self.model is not None:
            # A post-accumulate-grad hook names a grad the moment it lands in `p.grad`, so the
            # peak in backward is split correctly. FSDP assigns its sharded grads outside
            # autograd, where no such hook fires: the rescans at phase boundaries catch those.
            for p in self.model.parameters():
                if p.requires_grad:
                    hook = p.register_post_accumulate_grad_hook(
                        lambda p: self.register(p.grad, "grads")
                    )
                    self._handles.append(hook)
        for root in self._module_roots:
            self._hook_modules(root)
        if self.optimizer is not None:
            self._handles += [
                self.optimizer.register_step_pre_hook(self._pre_step),
                self.optimizer.register_step_post_hook(self._post_step),
            ]
        self._rescan()
        self._resize_before = resize = torch.UntypedStorage.resize_
        torch.UntypedStorage.resize_ = lambda st, size: self._resize(resize, st, size)
        self.reset_peak()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize_before
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _ACTIVE.remove(self)

    def _pre_step(self, optimizer, args, kwargs):
        self._phases.append("optimizer step")
        self._set_module_phase(None)
        self._in_optimizer = True
        params = (p for group in optimizer.param_groups for p in group["params"])
        self._state_pending = any(p.grad is not None and not optimizer.state.get(p) for p in params)

    def _post_step(self, optimizer, args, kwargs):
        self._in_optimizer = False
        self._phases.pop()
        self._set_module_phase(None)
