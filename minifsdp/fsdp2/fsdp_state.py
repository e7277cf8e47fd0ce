"""``FSDPState``: the hooks that drive one ``fully_shard``-ed module's group through a step.

FSDP2 changes no module's ``forward``; everything happens in hooks::

    forward pre-hook    root: lazy init (first call).  unshard (all-gather) and wait.
                        wrap the inputs in a post-backward barrier (below).  prefetch
    forward post-hook   reshard if reshard_after_forward.  hook the outputs: pre-backward
    output grad hook    = pre-backward: unshard again and wait (the group's backward is
                        next), then prefetch (backward: the previous group, by default);
                        the first one also queues the end-of-backward callback
    group's backward    = post-backward (below): reshard, reduce-scatter the gradients
    end of backward     finalize every group (post-backward where it has not run), reset

Note [when is a group's backward over?]: the post-backward may free the unsharded
parameters, so it must wait for every backward node that uses them. Those nodes compute
gradients of (a) the group's trainable parameters or (b) its forward inputs -- anything else
they compute flows into (a) or (b) (unless a tensor reaches the module other than through
its arguments, e.g. as an attribute: not covered). So the group is done when both happened:
  (a) every trainable unsharded parameter's gradient has been accumulated: a
      post-accumulate-grad hook on each (it runs once per backward, after all of the
      parameter's uses are summed);
  (b) the gradient w.r.t. the forward inputs is complete: the inputs go through
      ``_PostBackwardBarrier``, an identity autograd Function whose backward runs exactly
      then -- after every node of the module between its inputs and outputs.
A counter of outstanding events (one per trainable parameter, one per barrier) runs
post-backward when it reaches zero. torch uses (b) alone (``RegisterPostBackwardFunction``),
relying on autograd running parameters' accumulate-grad nodes first; (a) alone is not
enough: a frozen layer at the start of a group still needs its weight for the input's
gradient after every trainable parameter is done. The barrier also orders things well: its
backward (block i's reshard) runs before the grad hook on block i's input, which is block
i-1's output (its pre-backward unshard), so without prefetching two blocks are never
unsharded at once (prefetching makes them overlap on purpose: Note [prefetch memory] in
``prefetch.py``).
If an event never comes -- a parameter unused in this backward, inputs that need no grad and
no trainable parameter, a forward whose graph was dropped -- the counter stays above zero
and the end-of-backward callback does the work. Counting can only err upwards (late, never
early), so this fallback makes it safe.

Note [recomputed in backward]: ``checkpoint(block, x)`` around a ``fully_shard``-ed block
saves nothing of the block in forward and, in backward, re-runs ``Block.__call__`` -- our
forward hooks included -- when the first saved tensor is needed. By then the block's
pre-backward has all-gathered its parameters. Run as in forward, the pre-hook would count a
barrier event whose backward never runs (the recomputed graph is only read for its saved
tensors, never differentiated), so the group's post-backward would wait for the end of
backward, holding every block's unsharded parameters and gradients; and the post-hook would
reshard -- free the storage the recomputed graph has just saved (measured: "setStorage: ...
out of bounds for storage of size 0" with early stopping off, when the recomputation reaches
the post-hook). So inside backward (torch's ``is_bw()``: autograd's engine has a graph task
on this thread) the pre-hook only makes sure the group is unsharded (a no-op after its
pre-backward; a nested unit inside the checkpointed one may still be sharded) and the
post-hook does nothing: the post-backward reshards, as without checkpointing. torch's FSDP2
returns early in the same places. Checkpointing regions *inside* a unit never re-runs these
hooks: Note [activation checkpointing] in ``minifsdp/models.py``.

Note [forward methods]: the hooks above run around ``forward`` only, because ``nn.Module``
calls them from ``__call__``. A method that uses the module's own parameters without going
through ``forward`` -- a ``generate`` that calls ``self.emb`` and ``self.head`` itself -- finds
them sharded: DTensors of this rank's rows, and the first op that mixes one with a plain
tensor raises ("got mixed torch.Tensor and DTensor"). Nested ``fully_shard`` modules it calls
are fine (their ``__call__`` runs their hooks); the module's own group is not.
``register_fsdp_forward_method(module, "generate")`` wraps the method in the same pre- and
post-forward hooks (torch's function of the same name, in ``_fully_shard.py``; chapter 11).

Note [not the last backward]: ``set_is_last_backward(False)`` (torch's, for micro-batches)
says that another backward follows before the optimizer step. The end-of-backward callback
then still runs the post-backward of every group whose backward did not end on its own (its
reduce-scatter is due now), but skips torch's ``finalize_backward``: it neither waits for
nor discards backward prefetches still in flight, nor forgets the post-forward order (and
each group's places in it) that the implicit backward prefetch follows. So the orders of
the step's forwards pile up: in the next backward, the group that ran first in forward
(place 0 of its own forward, but now preceded by the last forward's groups) prefetches the
last group of the *previous* forward -- an all-gather torch issues too, whose result that
group's next pre-forward then uses instead of gathering again. With our blocking
reduce-scatter there is nothing else to wait for. The step's last backward must run with
``True`` (the default), which drops what is in flight and clears the orders. Both keep the
flag in the root's context, shared by every module under it after the first forward: set
it on the root (before the first forward, a non-root's setting is lost at lazy init, as in
torch).

Note [several modules, one group]: ``fully_shard([emb, head])`` (torch's list form) makes ONE
group of the parameters under several sibling modules -- one all-gather and one
reduce-scatter a step where two calls would make two each -- e.g. a tied embedding and head
(a parameter two modules hold must be in one group) without the rest of their parent, or
small neighbours not worth a collective each. The modules share one ``FSDPState``
(``module._fsdp_state`` is the same object, as torch's ``fully_shard.state(m)``; each is
class-swapped), and its hooks are on each of them, gated by the set of modules still to run
this pass (``_to_run``, torch's ``_modules_to_run_forward`` in
``_register_group_forward_hooks``, ``_fsdp_state.py``):
  * pre-forward of any of them: refill ``_to_run`` if empty; the group is unsharded (a no-op
    after the first); only the first one this pass (state not yet FORWARD) counts backward
    events, wraps its inputs in the barrier and records the group in the forward order (and
    issues forward prefetches) -- so ``emb`` all-gathers, and ``head`` finds it unsharded.
  * post-forward: ``head`` leaves ``_to_run``; only the one that empties it finishes the
    forward: reshard, record the post-forward order, hook its outputs for the pre-backward.
    In between (the blocks' forwards) the group stays unsharded: one group's memory for the
    whole span, the price of its one all-gather.
  * a module that did not run (a chunked loss calls ``head`` after the model's forward): the
    root's post-forward finishes such groups on its own output (torch's
    ``_force_complete_incomplete_states``), so the next pass starts clean.
Backward is unchanged: the pre-backward runs once per pass (on the last module's outputs),
and the post-backward counts the group's parameters and the first module's inputs (Note
[when is a group's backward over?]). Such a state cannot be the root (it has no single
module to run forward first through), which torch refuses too. Where we part from torch:
with a chunked loss, torch's group reduce-scatters when the barrier on the first chunk's
input fires, all-gathers again for the pre-backward the root's output triggers, and
reduce-scatters the rest at the end (3 all-gathers and 2 reduce-scatters a step for it);
ours waits for all of the group's gradients (2 and 1), with the same numbers
(tests/test_fsdp2.py pins both).

Not handled (torch does): moving the inputs to the device, and several roots sharing one
backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from minifsdp.fsdp2 import prefetch
from minifsdp.fsdp2.fsdp_param_group import FSDPParamGroup, TrainingState
from minifsdp.memory import tag


@dataclass
class _RootContext:
    """Shared by every state under one root (set at the root's lazy init)."""

    states: list[FSDPState] = field(default_factory=list)  # named_modules order, root first
    callback_queued: bool = False
    is_last_backward: bool = True  # set_is_last_backward: Note [not the last backward]
    # prefetching (prefetch.py, Note [which group is next]): this forward's pre-forward order
    # of groups, the last forward's, whether this one has matched it so far, and the
    # post-forward order that backward reverses
    forward_order: list[FSDPParamGroup] = field(default_factory=list)
    last_forward_order: list[FSDPParamGroup] = field(default_factory=list)
    on_track: bool = True
    post_forward_order: list[FSDPParamGroup] = field(default_factory=list)
    post_optim_event: object | None = None  # set_post_optim_event: Note [post-optimizer event]


class FSDPState:
    """The hooks of one ``fully_shard``-ed module and its parameter group (``None`` when the
    module manages no parameters of its own, e.g. a root whose children hold them all).

    Example (what ``fully_shard`` does)::

        state = FSDPState(module, FSDPParamGroup(params, mesh, None, "block"))
        module.__dict__["_fsdp_state"] = state
    """

    def __init__(self, module: nn.Module | tuple[nn.Module, ...], group: FSDPParamGroup | None):
        self.modules = tuple(module) if isinstance(module, (tuple, list)) else (module,)
        self.module, self.group = self.modules[0], group
        self._to_run: set[nn.Module] = set()  # Note [several modules, one group]
        self.is_root: bool | None = None  # decided at the first forward (lazy init)
        self.ctx = _RootContext()
        self.training_state = TrainingState.IDLE
        self._pending = 0  # backward events before post-backward may run (Note above)
        self._params_counted = False  # this backward's parameter events are in _pending
        self._hooked: set[int] = set()  # ids of unsharded params with our grad hook
        # prefetching (prefetch.py): explicit targets, the implicit switches (torch's
        # defaults), this group's places in ctx.post_forward_order
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] = []
        self.implicit_forward_prefetch, self.implicit_backward_prefetch = False, True
        self.post_forward_indices: list[int] = []
        for m in self.modules:
            if len(self.modules) == 1:
                m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
                m.register_forward_hook(self._post_forward)
            else:  # Note [several modules, one group]
                m.register_forward_pre_hook(self._group_pre_forward, prepend=True,
                                            with_kwargs=True)
                m.register_forward_hook(self._group_post_forward)
            # a state dict holds the sharded DTensors: reshard first (e.g. after an eval
            # forward, where the root keeps its unsharded parameters)
            m.register_state_dict_pre_hook(lambda *_: self._reshard())
            m.register_load_state_dict_pre_hook(lambda *_: self._reshard())
            m.register_load_state_dict_post_hook(self._check_loaded_in_place)

    def _reshard(self) -> None:
        if self.group is not None:
            self.group.reshard()

    def _check_loaded_in_place(self, module: nn.Module, incompatible_keys: Any) -> None:
        for p in self.group.fsdp_params if self.group is not None else []:
            if any(getattr(m, name) is not p.sharded_param for m, name in p.owners):
                raise RuntimeError("load_state_dict(assign=True) replaced a sharded parameter; "
                                   "load into the existing shards (assign=False)")

    # ---- lazy init ---------------------------------------------------------------------------

    def _lazy_init(self) -> None:
        """The first state to run forward is the root: it finds every state below it, shares
        its context with them and initializes their groups."""
        if len(self.modules) > 1:  # Note [several modules, one group]
            raise RuntimeError(
                "fully_shard: the group of "
                f"{', '.join(type(m).__name__ for m in self.modules)} (one fully_shard([...]) "
                "call) ran forward first, so it would be the root, which needs a single "
                "module: apply fully_shard to their common parent too, and run forward "
                "through it")
        self.is_root = True
        names: dict[FSDPState, list[str]] = {}  # a state of several modules comes up again
        for name, module in self.module.named_modules():
            state = module.__dict__.get("_fsdp_state")
            if state is None:
                continue
            if state not in names:
                if state is not self:
                    if state.is_root is not None:
                        raise RuntimeError(f"fully_shard: {name!r} ran forward before the "
                                           "root module; run forward through the root first")
                    state.is_root, state.ctx = False, self.ctx
                self.ctx.states.append(state)
            names.setdefault(state, []).append(name or "root")
        for state in self.ctx.states:
            if state.group is not None:
                state.group.name = ", ".join(names[state])  # torch's _module_fqn
                state.group.lazy_init(is_root=state is self)

    # ---- forward -----------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if _in_backward():  # Note [recomputed in backward]: the parameters, and nothing else
            if self.group is not None:
                self.group.unshard()
                self.group.wait_for_unshard()
            return args, kwargs
        if self.is_root is None:
            self._lazy_init()
        if self.is_root:
            prefetch.begin_forward(self.ctx)
            if (event := self.ctx.post_optim_event) is not None:  # Note [post-optimizer event]
                device = next((p.device for p in self.module.parameters()), None)
                if device is not None:  # no parameter, no all-gather to order
                    torch.get_device_module(device).current_stream().wait_event(event)
                self.ctx.post_optim_event = None  # one event per iteration, as torch
        # the first of the group's modules this pass (always, for one module): Note
        # [several modules, one group]
        first = self.training_state is not TrainingState.FORWARD
        self.training_state = TrainingState.FORWARD
        if self.group is not None:
            self.group.pre_forward()
            if first and torch.is_grad_enabled():
                args, kwargs = self._register_post_backward(args, kwargs)
        if first:
            prefetch.after_pre_forward(self)  # after our own all-gather: issue the next
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if _in_backward():  # Note [recomputed in backward]: the group's backward reshards
            return output
        self._finish_forward(output)
        if self.is_root:  # groups whose modules did not all run: Note [several modules, ...]
            for state in reversed(self.ctx.states):
                if state._to_run:
                    state._to_run.clear()
                    state._finish_forward(output)
            prefetch.end_forward(self.ctx)
        return output

    def _finish_forward(self, output: Any) -> None:
        """Reshard, record the post-forward order, hook ``output`` for the pre-backward."""
        if self.group is not None:
            self.group.post_forward()
        prefetch.after_post_forward(self)
        if torch.is_grad_enabled():
            for t in _tensors_requiring_grad(output):
                t.register_hook(self._pre_backward)
        self.training_state = TrainingState.IDLE

    def _group_pre_forward(self, module: nn.Module, args: tuple, kwargs: dict
                           ) -> tuple[tuple, dict]:
        """Any module of a group of several: Note [several modules, one group]."""
        if not self._to_run:
            self._to_run.update(self.modules)
        return self._pre_forward(module, args, kwargs)

    def _group_post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        """Only the module that completes the pass finishes the group's forward."""
        if module in self._to_run:
            self._to_run.discard(module)
            if not self._to_run:
                return self._post_forward(module, args, output)
        return output

    # ---- backward ----------------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> None:
        """Grad hook on the module's outputs: its backward is about to run."""
        self._queue_end_of_backward()
        if self.training_state is not TrainingState.PRE_BACKWARD:
            self.training_state = TrainingState.PRE_BACKWARD
            if self.group is not None:
                self.group.pre_backward()
            prefetch.after_pre_backward(self)  # after our own all-gather: issue the next

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Count this forward's backward events (Note [when is a group's backward over?])."""
        if not self._params_counted:
            self._params_counted = True
            for p in self.group.fsdp_params:
                u = p.unsharded_param
                if u.requires_grad:
                    self._pending += 1
                    if id(u) not in self._hooked:  # the same object every step
                        self._hooked.add(id(u))
                        u.register_post_accumulate_grad_hook(self._on_param_grad)
        leaves, spec = tree_flatten((args, kwargs))
        needs_grad = [i for i, x in enumerate(leaves)
                      if isinstance(x, torch.Tensor) and x.requires_grad]
        if needs_grad:
            self._pending += 1
            outs = _PostBackwardBarrier.apply(self, *(leaves[i] for i in needs_grad))
            for i, out in zip(needs_grad, outs):
                leaves[i] = out
            args, kwargs = tree_unflatten(leaves, spec)
        return args, kwargs

    def _on_param_grad(self, param: torch.Tensor) -> None:
        tag(param.grad, "grads")  # Note [FSDP2 memory categories]
        self._backward_event()

    def _backward_event(self) -> None:
        self._pending -= 1
        if self._pending == 0 and self.group.training_state is not TrainingState.POST_BACKWARD:
            self.group.post_backward()

    def _queue_end_of_backward(self) -> None:
        """Once per backward: run ``_end_of_backward`` when autograd's engine is done."""
        if not self.ctx.callback_queued:
            self.ctx.callback_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Finalize every group under the root, in the same order on every rank (their
        reduce-scatters are collectives), and reset the per-step state. Not the last backward:
        keep this backward's prefetch state (Note [not the last backward])."""
        for state in self.ctx.states:
            if state.group is not None:
                state.group.finalize_backward()
            state.training_state = TrainingState.IDLE
            state._pending, state._params_counted = 0, False
            state._to_run.clear()
        if self.ctx.is_last_backward:
            prefetch.end_backward(self.ctx)
        self.ctx.callback_queued = False

    def reset_iter_state(self) -> None:
        """The root's recovery after an exception cut a forward or backward short (torch's
        ``FSDPState._reset_iter_state``): every group resharded with nothing in flight, the
        backward counters and orders of the lost iteration forgotten. The next forward starts
        clean; the lost iteration's gradients are gone."""
        if self.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module (the "
                               f"one forward runs through first), not on this "
                               f"{type(self.module).__name__}")
        self._forget_partial_forwards()  # Note [several modules, one group]
        for state in self.ctx.states:
            if state.group is not None:
                state.group.reset_iter_state()
            state.training_state = TrainingState.IDLE
            state._pending, state._params_counted = 0, False
            state.post_forward_indices.clear()
        # the cut forward's order is partial: keep guessing from the last whole one
        self.ctx.forward_order = self.ctx.last_forward_order
        self.ctx.post_forward_order.clear()
        self.ctx.callback_queued = False  # a cut backward's callback never runs


    def _forget_partial_forwards(self) -> None:
        """A cut forward's groups of several modules forget which of them ran (torch's reset
        clears ``_modules_to_run_forward``)."""
        for state in self.ctx.states:
            state._to_run.clear()


class _PostBackwardBarrier(torch.autograd.Function):
    """Identity on the forward inputs; its backward tells the state that the gradient w.r.t.
    the inputs is complete (Note [when is a group's backward over?])."""

    @staticmethod
    def forward(ctx, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs  # autograd hands out new tensors (aliases) with this node as grad_fn

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.state._backward_event()
        return (None, *grads)


def _in_backward() -> bool:
    """Is autograd's engine running a backward on this thread (torch's ``is_bw``)?"""
    return torch._C._current_graph_task_id() != -1


def _tensors_requiring_grad(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def listed_modules(module: nn.Module | list[nn.Module]) -> tuple[nn.Module, ...]:
    """``(module,)``, or a list's modules less those inside another listed one (torch's
    ``_get_root_modules``), each refused if a ``fully_shard`` already took it (``fully_shard``'s
    argument; Note [several modules, one group])."""
    if isinstance(module, nn.Module):
        listed = [module]
    elif isinstance(module, (list, tuple)):
        listed = list(module)
        if not listed:
            raise ValueError("fully_shard([]): the list of modules is empty; pass at least one "
                             "module")
        for i, m in enumerate(listed):
            if not isinstance(m, nn.Module):
                raise TypeError(f"fully_shard: module[{i}] is a {type(m).__name__}, not an "
                                "nn.Module")
            if any(m is other for other in listed[:i]):
                raise ValueError(f"fully_shard: module[{i}] ({type(m).__name__}) is listed "
                                 "twice; list each module once")
    else:
        raise TypeError(f"fully_shard takes an nn.Module or a list of them, got "
                        f"{type(module).__name__}")
    for i, m in enumerate(listed):
        if "_fsdp_state" in m.__dict__:
            where = "" if isinstance(module, nn.Module) else f"module[{i}], "
            raise ValueError(f"fully_shard was already applied to this {where}"
                             f"{type(m).__name__}; apply it once per module, children before "
                             "parents")
    return tuple(m for m in listed
                 if not any(o is not m and any(d is m for d in o.modules()) for o in listed))


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` inside FSDP's pre- and post-forward hooks, as ``forward``
    (Note [forward methods]). Not a ``fully_shard`` module: nothing happens, so one script
    runs with and without FSDP (as torch's). A missing method is a ``ValueError``.

    Example (``model`` a ``fully_shard`` root whose ``generate`` calls its layers itself)::

        register_fsdp_forward_method(model, "generate")
        tokens = model.generate(prompt, steps=8)    # the root's parameters all-gathered first
    """
    state = module.__dict__.get("_fsdp_state")
    if state is None:
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    method = getattr(module, method_name)

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped.__get__(module, type(module)))

