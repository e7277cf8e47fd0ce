"""On gloo, functional collectives run one at a time: count them in a graph, serialize the
graph, and check at run time (Note [one collective in flight on gloo], below in ``serialize``).

``graph_passes.backend`` runs every compiled graph through ``runnable``: on a gloo group a
copy whose waits follow their collectives at once, on NCCL the graph as the passes planned it.
Eager SimpleFSDP needs nothing: DTensor's ``redistribute`` waits on each collective it issues.

    ran = runnable(gm)                 # gm itself on NCCL; a serialized copy on gloo
    in_flight(gm), in_flight(ran)      # e.g. 2 planned by the prefetch pass, 1 as run
    with InFlightGuard(): step()       # raises if a second collective is issued too early
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type

WAIT = torch.ops._c10d_functional.wait_tensor.default


def _done(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.lint()
    gm.recompile()
    return gm


def is_collective_op(func) -> bool:
    """A ``_c10d_functional`` op that issues a collective (all but ``wait_tensor`` and the
    autograd wrapper ``_wrap_tensor_autograd``)."""
    return (isinstance(func, torch._ops.OpOverload) and func.namespace == "_c10d_functional"
            and func.__name__.split(".")[0] not in ("wait_tensor", "_wrap_tensor_autograd"))


def _is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and is_collective_op(n.target)


def _waits(c: fx.Node) -> list[fx.Node]:
    """The waits of collective ``c``: on its output, or (coalesced ops) on items of it."""
    direct = [u for u in c.users if u.target is WAIT]
    items = [w for u in c.users if u.target is operator.getitem for w in u.users
             if w.target is WAIT]
    return direct + items


def _group_name(c: fx.Node) -> str | None:
    names = [a for a in (*c.args, *c.kwargs.values()) if isinstance(a, str)]
    return names[-1] if names else None


def on_gloo(gm: fx.GraphModule) -> bool:
    """Is any collective of ``gm`` on a process group whose backend is gloo?"""
    for n in gm.graph.nodes:
        if _is_collective(n) and (name := _group_name(n)) is not None:
            if dist.get_backend(_resolve_process_group(name)) == "gloo":
                return True
    return False


def runnable(gm: fx.GraphModule, serialize_on: bool | None = None) -> fx.GraphModule:
    """``gm`` itself, or on gloo (``serialize_on`` None) or if ``serialize_on``, a serialized
    copy: what to run (Note [one collective in flight on gloo])."""
    if not (serialize_on if serialize_on is not None else on_gloo(gm)):
        return gm
    ran = serialize(copy.deepcopy(gm))
    if in_flight(ran) > 1:  # serialize's postcondition, checked: the one thing that must hold
        raise AssertionError(f"serialize left {in_flight(ran)} collectives in flight")
    return ran


def in_flight(gm: fx.GraphModule) -> int:
    """The most collectives issued and not yet waited for at any point of ``gm``'s node order
    -- exact for a graph that runs as Python, node by node, as ``backend``'s do. A collective
    that is never waited for counts as in flight to the end."""
    pending: set[fx.Node] = set()
    most = 0
    for n in gm.graph.nodes:
        if _is_collective(n):
            pending.add(n)
            most = max(most, len(pending))
        elif n.target is WAIT:
            src = n.args[0]
            pending.discard(src.args[0] if src.target is operator.getitem else src)
    return most


def serialize(gm: fx.GraphModule) -> fx.GraphModule:
    """Wait for each collective right after issuing it: move its waits up to just after it
    (a collective without a wait gets one). Only waits move, earlier: their users still come
    after them, and the values are the same, bit for bit. Afterwards ``in_flight(gm) <= 1``.

    Note [one collective in flight on gloo]: torch 2.14's gloo corrupts the heap (``malloc():
    unaligned tcache chunk detected``, or a hang) when several functional collectives are in
    flight in one process: every ``_c10d_functional.all_gather_into_tensor`` calls its
    ``allgather_into_tensor_coalesced``, and both of gloo's worker threads were inside it in
    the core dump we caught. Measured, a pure-torch loop of 4000 steps at N = 2: 8 in flight
    aborted 4 of 4 runs, 4 in flight 1 of 3, 2 and 1 none of 3 -- which does not prove 2 safe
    (chapter 10's prefetched graphs, 2 in flight, aborted once on an AMD machine). So on gloo
    no pass decides how many are in flight: ``backend`` runs every graph serialized, 1 at a
    time, whatever the passes planned. Eager DTensor already waits at once (``redistribute``
    with ``async_op=False``, its default, calls ``.wait()`` on each collective's output), so
    eager SimpleFSDP has 1 in flight too. ``InFlightGuard`` checks both at run time. The cost:
    on gloo nothing overlaps -- the prefetch schedule is what NCCL (on GPUs, where a collective
    runs on its own stream) would overlap; on CPU and gloo the host waits for each one anyway.
    """
    g = gm.graph
    for c in [n for n in g.nodes if _is_collective(n)]:
        waits = _waits(c)
        if not waits:
            with g.inserting_after(c):
                g.call_function(WAIT, (c,))
            continue
        anchor = c
        for w in waits:
            src = w.args[0]
            if src is not c:  # a coalesced op's item: the getitem moves first
                anchor.append(src)
                anchor = src
            anchor.append(w)
            anchor = w
    return _done(gm)


class InFlightGuard(TorchDispatchMode):
    """Raise if a functional collective is issued while ``limit`` others wait to be waited
    for (Note [one collective in flight on gloo]): ``with InFlightGuard(): step()`` checks eager
    DTensor code and compiled graphs that run as Python (``ignore_compile_internals``, as
    ``comm.FunctionalCollectives``). ``issued`` and ``most`` count what it saw."""

    def __init__(self, limit: int = 1) -> None:
        super().__init__()
        self.limit, self.issued, self.most = limit, 0, 0
        self._pending: dict[int, str] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # a subclass: it comes back with its plain tensors
        if func is WAIT:
            out = func(*args, **kwargs)
            self._pending.pop(out.untyped_storage().data_ptr(), None)
            return out
        if not is_collective_op(func):
            return func(*args, **kwargs)
        if len(self._pending) >= self.limit:
            raise RuntimeError(
                f"{func.__name__} issued while {len(self._pending)} functional collective(s) "
                f"are in flight ({', '.join(self._pending.values())}); the limit is "
                f"{self.limit} (Note [one collective in flight on gloo] in "
                "minifsdp/serial_collectives.py)")
        out = func(*args, **kwargs)
        self.issued += 1
        for t in out if isinstance(out, (list, tuple)) else (out,):
            self._pending[t.untyped_storage().data_ptr()] = func.__name__
        self.most = max(self.most, len(self._pending))
        return out
