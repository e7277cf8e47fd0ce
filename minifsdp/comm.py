"""Collectives that log every byte they move, and when: comm volume vs theory, and comm
timelines. (The ring all-reduce built from send/recv lives in ``minifsdp.ring``.)

Drop-in wrappers with ``torch.distributed``'s signatures, plus a keyword-only ``tag`` label
(point-to-point calls, whose ``tag`` is torch's integer, are labelled with ``comm.tagged``)::

    from minifsdp import comm
    with comm.logging_comm() as log:
        with log.span("backward"):
            loss.backward()
        work = comm.all_reduce(grad, async_op=True, tag="bucket 3")
        work.wait()                     # the record's t_end is stamped here
    log.total_bytes("all_reduce", wire=True)   # 2(N-1)/N * grad's bytes

Note [bytes vs wire bytes]: a record keeps two sizes. ``bytes`` is the payload of the
*input* tensor, as torch's own logs define it (for all_gather that is the small shard). The
``wire_bytes`` are what this rank *sends* under the ring algorithm, with S the bytes of the
full (unsharded) tensor. NCCL runs Ring for many sizes and topologies but chooses among Ring,
Tree, NVLS and CollNet (``NCCL_ALGO`` forces one); the others move the same data on other paths:
    all_reduce      2(N-1)/N * S    (a reduce-scatter, then an all-gather)
    reduce_scatter   (N-1)/N * S    (S = the input; each rank keeps one of N chunks)
    all_gather       (N-1)/N * S    (S = the output; each rank already has its own chunk)
    all_to_all       (N-1)/N * S    (every chunk but the one addressed to itself)
    broadcast                 S     (see Note [broadcast bytes])
    send / recv          S / 0
The wrappers compute these from the formula; ``minifsdp.ring`` *measures* them, one send at
a time, and ``minifsdp.demos.collectives --demo ring`` shows that the two agree.
They are the ring's bytes on every backend, so one log reads the same on CPU and GPU. gloo
runs its own algorithms: a ring for all-reduce and all-gather, but no reduce-scatter of its
own -- ``ProcessGroupGloo::reduce_scatter_tensor_coalesced`` all-reduces a clone of the input
and keeps one chunk, so on gloo a reduce-scatter sends an all-reduce's 2(N-1)/N * S (chapter
03 measures the clone).

Note [broadcast bytes]: in the pipelined chain (ring) broadcast, every rank except the last
in the chain forwards the whole payload once, so S per rank is the maximum and (N-1)/N * S
the average. Tree algorithms differ: a binomial tree makes the root send log2(N) * S. We log
S, the ring's upper bound, so that all the formulas here describe the same algorithm.

Note [timing]: ``t_start``/``t_end`` are ``time.perf_counter()`` seconds since the log
started (``log.t0``, the same clock in every process on one machine). A blocking call ends
when it returns; an ``async_op=True`` call ends when its handle's ``wait()`` returns, so a
timeline shows communication overlapping the compute ``span``s recorded between. On CUDA
these are still *host* times: NCCL calls return once the work is queued, and ``wait()`` only
makes the compute stream wait, so the log says when work was issued, not when it ran. For
device-side truth on GPUs use ``torch.profiler``.

Note [exposed communication]: what overlap buys is time the caller does *not* spend blocked.
A blocking collective blocks from ``t_start`` to ``t_end``; an async one only from the moment
its ``wait()`` is called (``t_wait``) to when that returns (``t_end``) -- zero if the bytes had
already arrived. ``CommRecord.exposed`` is that time, and ``exposed_seconds(records)`` sums it
over a log: the communication a step actually waits for. (Host times: on CUDA a ``wait()``
returns at once and the *stream* waits, so measure GPU overlap with ``torch.profiler``.)

Note [async completion]: ``t_end`` (the ``wait()``) says when the *caller* needed the result,
which for a bucket launched early in backward is long after the bytes arrived. ``t_done`` says
when the collective itself finished: the work's future runs a callback that stamps it. On gloo
the future completes when the collective has completed on gloo's own thread, so ``t_start`` to
``t_done`` is the real transfer window. On NCCL the future completes once the work is ordered
on the CUDA stream -- again a host time, not the kernel's end (Note [timing]). For blocking
calls ``t_done == t_end``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.distributed_c10d import _resolve_process_group as _resolve_group
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type


@dataclass
class CommRecord:
    """One collective (``kind="comm"``) or one compute span (``kind="compute"``)."""

    kind: str
    op: str
    bytes: int
    wire_bytes: float
    group_size: int
    dtype: str | None
    shape: list[int] | None
    t_start: float
    t_end: float | None  # None while an async op has not been waited on
    tag: str | None
    # When the collective itself finished (Note [async completion]); = t_end for blocking ones.
    t_done: float | None = None
    # When the caller started to wait (Note [exposed communication]); = t_start for blocking
    # ones, None while an async op has not been waited on.
    t_wait: float | None = None

    @property
    def exposed(self) -> float:
        """Seconds the caller sat blocked on this collective (Note [exposed communication])."""
        if self.kind != "comm" or self.t_end is None:
            return 0.0
        return self.t_end - (self.t_wait if self.t_wait is not None else self.t_start)


class CommLog:
    """The records of one process, oldest first.

    Example:
        >>> log = CommLog()
        >>> with log.span("forward"):
        ...     pass
        >>> [r.op for r in log.records], log.total_bytes()
        (['forward'], 0)
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []
        self.t0 = time.perf_counter()

    def clear(self) -> None:
        """Forget every record and restart the clock (call it after a barrier to line ranks
        up)."""
        self.records.clear()
        self.t0 = time.perf_counter()

    def comms(self, op: str | None = None) -> list[CommRecord]:
        """The communication records, optionally only those of one ``op`` (e.g. "send")."""
        return [r for r in self.records if r.kind == "comm" and op in (None, r.op)]

    def total_bytes(self, op: str | None = None, *, wire: bool = False) -> float:
        """Sum of ``bytes`` (or of ``wire_bytes`` with ``wire=True``) over ``op``'s records."""
        return sum(r.wire_bytes if wire else r.bytes for r in self.comms(op))

    def summary(self) -> dict[str, dict[str, float]]:
        """``{op: {"calls", "bytes", "wire_bytes"}}``, for a quick table."""
        out: dict[str, dict[str, float]] = {}
        for r in self.comms():
            s = out.setdefault(r.op, {"calls": 0, "bytes": 0, "wire_bytes": 0.0})
            s["calls"] += 1
            s["bytes"] += r.bytes
            s["wire_bytes"] += r.wire_bytes
        return out

    def to_list(self) -> list[dict[str, Any]]:
        """The records as plain dicts, ready for ``json.dumps`` / ``finish({...})``."""
        return [asdict(r) for r in self.records]

    def span(self, name: str, tag: str | None = None) -> contextlib.AbstractContextManager:
        """Record the time spent in the ``with`` block as a compute span in this log."""
        return _span([self], name, tag)


# Every record goes to every *active* log: the process-wide one, plus any opened with
# ``logging_comm()``. Nested logs thus each see exactly what happened inside them.
_ACTIVE: list[CommLog] = [CommLog()]
_TAGS: list[str] = []


def exposed_seconds(records: list[dict[str, Any]] | list[CommRecord],
                    tag_prefix: str | None = None) -> float:
    """Total seconds callers sat blocked on collectives (Note [exposed communication]), over
    ``records`` -- ``CommRecord``s or their dicts from a rank's JSON -- optionally only those
    whose tag starts with ``tag_prefix``.

    Example:
        >>> exposed_seconds(run.ranks[0]["comm"], "fsdp2")   # doctest: +SKIP
        0.0213
    """
    total = 0.0
    for r in records:
        r = r if isinstance(r, dict) else asdict(r)
        if r["kind"] != "comm" or r["t_end"] is None:
            continue
        if tag_prefix is not None and not (r["tag"] or "").startswith(tag_prefix):
            continue
        total += r["t_end"] - (r.get("t_wait") if r.get("t_wait") is not None else r["t_start"])
    return total


def comm_log() -> CommLog:
    """The process-wide log: it records every wrapped call since the process started."""
    return _ACTIVE[0]


@contextlib.contextmanager
def logging_comm() -> Iterator[CommLog]:
    """A fresh log that records what happens inside the ``with`` block."""
    log = CommLog()
    _ACTIVE.append(log)
    try:
        yield log
    finally:
        _ACTIVE.remove(log)


@contextlib.contextmanager
def tagged(tag: str) -> Iterator[None]:
    """Label every record made inside the block (point-to-point calls have no ``tag=``
    keyword of ours, since torch's ``send(..., tag=int)`` already means something else)."""
    _TAGS.append(tag)
    try:
        yield
    finally:
        _TAGS.pop()


def current_tag() -> str | None:
    """The innermost ``tagged`` block's label, or None: what a wrapper of this module's
    collectives reads when its caller labels them with ``with tagged(...)`` rather than
    ``tag=`` (FSDP2's group comms do: Note [custom collectives] in fsdp2/custom_comm.py)."""
    return _TAGS[-1] if _TAGS else None


def span(name: str, tag: str | None = None) -> contextlib.AbstractContextManager:
    """Like ``CommLog.span`` but recorded in every active log: for library code that has no
    log object at hand (e.g. ``with comm.span("forward"): ...`` inside a training step)."""
    return _span(list(_ACTIVE), name, tag)


@contextlib.contextmanager
def _span(logs: list[CommLog], name: str, tag: str | None) -> Iterator[None]:
    t = time.perf_counter()
    yield  # an exception inside the block records nothing: the span never finished
    for log in logs:
        log.records.append(_record(log, "compute", name, 0, 0.0, 1, None, t,
                                   time.perf_counter(), tag))


def _record(log: CommLog, kind: str, op: str, nbytes: int, wire: float, group_size: int,
            tensor: torch.Tensor | None, t0: float, t1: float | None,
            tag: str | None) -> CommRecord:
    t1 = None if t1 is None else t1 - log.t0
    return CommRecord(
        kind, op, nbytes, wire, group_size,
        None if tensor is None else str(tensor.dtype).removeprefix("torch."),
        None if tensor is None else list(tensor.shape),
        t0 - log.t0, t1,
        tag if tag is not None else (_TAGS[-1] if _TAGS else None),
        t1,
        None if t1 is None else t0 - log.t0,
    )


class LoggedWork:
    """A ``dist.Work`` handle whose ``wait()`` stamps ``t_end`` on its records. Everything
    else (``is_completed``, ``get_future``, ...) is passed through to the real handle."""

    def __init__(self, work: Any, records: list[tuple[CommLog, CommRecord]]):
        self._work, self._records = work, records
        try:  # Note [async completion]
            work.get_future().then(self._stamp_done)
        except (AttributeError, RuntimeError):  # a backend without futures: wait() stamps it
            pass

    def _stamp_done(self, fut: Any) -> None:
        t = time.perf_counter()
        for log, rec in self._records:
            if rec.t_done is None:
                rec.t_done = t - log.t0

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t_wait = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        t = time.perf_counter()
        for log, rec in self._records:
            if rec.t_wait is None:
                rec.t_wait = t_wait - log.t0
            if rec.t_end is None:
                rec.t_end = t - log.t0
            if rec.t_done is None or rec.t_done > rec.t_end:
                rec.t_done = rec.t_end
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _logged(op: str, tensor: torch.Tensor | None, wire: float, group: Any, tag: str | None,
            async_op: bool, call: Callable[[], Any]) -> Any:
    """Run ``call`` (the real torch.distributed call) and record it in every active log."""
    t0 = time.perf_counter()
    out = call()
    t1 = None if async_op else time.perf_counter()
    n, s = dist.get_world_size(group), 0 if tensor is None else _nbytes(tensor)
    recs = [(log, _record(log, "comm", op, s, wire, n, tensor, t0, t1, tag)) for log in _ACTIVE]
    for log, rec in recs:
        log.records.append(rec)
    return LoggedWork(out, recs) if async_op and out is not None else out


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------- logged collectives
# Same signatures as torch.distributed (see its docs); S = bytes, N = group size.

def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, *, tag=None):
    """In place: every rank ends with the reduction of all ranks' ``tensor``.
    Wire: 2(N-1)/N * S. Example: ranks hold [1, 2] and [3, 4] -> both hold [4, 6]."""
    n, s = dist.get_world_size(group), _nbytes(tensor)
    return _logged("all_reduce", tensor, 2 * (n - 1) / n * s, group, tag, async_op,
                   lambda: dist.all_reduce(tensor, op, group, async_op))


# torch 2.14 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single (same
# signatures) and deprecates the old names; older releases only have the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False, *,
                           tag=None):
    """``output (N*k, ...)`` = the ``input (k, ...)`` of ranks 0..N-1, concatenated.
    Wire: (N-1)/N * S_out. Example: ranks hold [1] and [2] -> both get [1, 2]."""
    n = dist.get_world_size(group)
    return _logged("all_gather", input_tensor, (n - 1) / n * _nbytes(output_tensor), group,
                   tag, async_op,
                   lambda: _all_gather_single(output_tensor, input_tensor, group, async_op))


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False, *,
                          tag=None):
    """``output (k, ...)`` on rank r = chunk r of the reduction of every rank's ``input
    (N*k, ...)``. Wire: (N-1)/N * S_in. Example: [1, 2] and [3, 4] -> [4] on rank 0, [6] on 1."""
    n = dist.get_world_size(group)
    return _logged("reduce_scatter", input, (n - 1) / n * _nbytes(input), group, tag, async_op,
                   lambda: _reduce_scatter_single(output, input, op, group, async_op))


all_gather_single = all_gather_into_tensor  # torch >= 2.14's name
reduce_scatter_single = reduce_scatter_tensor


def all_gather(tensor_list, tensor, group=None, async_op=False, *, tag=None):
    """List form of ``all_gather_into_tensor``. Wire: (N-1) * S_in."""
    n = dist.get_world_size(group)
    return _logged("all_gather", tensor, (n - 1) * _nbytes(tensor), group, tag, async_op,
                   lambda: dist.all_gather(tensor_list, tensor, group, async_op))


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None, *, tag=None):
    """In place: every rank gets ``src``'s ``tensor``. Wire: S (Note [broadcast bytes])."""
    return _logged("broadcast", tensor, float(_nbytes(tensor)), group, tag, async_op,
                   lambda: dist.broadcast(tensor, src, group, async_op, group_src))


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False, *, tag=None):
    """Rank r sends chunk j of ``input`` (dim 0) to rank j and receives rank j's chunk r into
    chunk j of ``output``: a distributed transpose. Wire: S_in minus the chunk kept."""
    n, me, s = dist.get_world_size(group), dist.get_rank(group), _nbytes(input)
    rows = input.shape[0] if input.dim() else 1
    own = input_split_sizes[me] if input_split_sizes else rows // n
    wire = s - own * (s // rows if rows else 0)
    return _logged("all_to_all", input, float(wire), group, tag, async_op,
                   lambda: dist.all_to_all_single(output, input, output_split_sizes,
                                                  input_split_sizes, group, async_op))


def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Blocking send; on gloo it returns only once ``dst`` has received (Note [ring
    deadlock] in ``minifsdp.ring``). Wire: S."""
    return _logged("send", tensor, float(_nbytes(tensor)), group, None, False,
                   lambda: dist.send(tensor, dst, group, tag, group_dst))


def recv(tensor, src=None, group=None, tag=0, group_src=None):
    """Blocking receive into ``tensor``; returns the sender's rank. Wire: 0 (nothing sent)."""
    return _logged("recv", tensor, 0.0, group, None, False,
                   lambda: dist.recv(tensor, src, group, tag, group_src))


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    """Non-blocking send; ``wait()`` on the handle. Wire: S."""
    return _logged("send", tensor, float(_nbytes(tensor)), group, None, True,
                   lambda: dist.isend(tensor, dst, group, tag, group_dst))


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    """Non-blocking receive into ``tensor``; ``wait()`` on the handle. Wire: 0."""
    return _logged("recv", tensor, 0.0, group, None, True,
                   lambda: dist.irecv(tensor, src, group, tag, group_src))


def batch_isend_irecv(p2p_op_list, *, tag=None):
    """``dist.batch_isend_irecv`` (a list of ``dist.P2POp(dist.isend | dist.irecv, ...)``),
    logging each op. Returns one handle per op (NCCL coalesces them into one handle, which
    then ends every record)."""
    t0 = time.perf_counter()
    works = dist.batch_isend_irecv(p2p_op_list)
    recs = []
    for p in p2p_op_list:
        sends = p.op is dist.isend
        n, s = dist.get_world_size(p.group), _nbytes(p.tensor)
        for log in _ACTIVE:
            rec = _record(log, "comm", "send" if sends else "recv", s, float(s if sends else 0),
                          n, p.tensor, t0, None, tag)
            log.records.append(rec)
            recs.append((log, rec))
    if len(works) == len(p2p_op_list):  # gloo: one handle per op
        per_op = len(_ACTIVE)
        return [LoggedWork(w, recs[i * per_op:(i + 1) * per_op]) for i, w in enumerate(works)]
    return [LoggedWork(w, recs) for w in works]


def barrier(group=None, async_op=False, device_ids=None, *, tag=None):
    """Wait until every rank of ``group`` arrives. Wire: logged as 0 (a token exchange)."""
    return _logged("barrier", None, 0.0, group, tag, async_op,
                   lambda: dist.barrier(group, async_op, device_ids))


# ---------------------------------------------------------------- functional collectives

class FunctionalCollectives(TorchDispatchMode):
    """Log DTensor's and compiled graphs' collectives too: ``with FunctionalCollectives():``
    records every ``_c10d_functional`` all-gather, reduce-scatter and all-reduce in the active
    logs, as the wrappers above do, and stamps its ``wait_tensor``.

    Note [functional collectives]: DTensor (so SimpleFSDP, chapter 10) and ``torch.compile``
    do not call ``torch.distributed``: they call ``torch.ops._c10d_functional`` ops, which issue
    the collective and return its future output at once, and a separate ``wait_tensor`` op that
    blocks until it is there. A dispatch mode sees both, in eager code and in a compiled graph
    that runs as Python (``ignore_compile_internals``: the mode is off while compile traces,
    on while its graphs run). The collective is ``t_start``; its ``wait_tensor`` is ``t_wait``
    to ``t_end``, so ``exposed_seconds`` means the same as for our own async calls (Note
    [exposed communication]). Eager DTensor waits at the first use of the output, i.e. at
    once: everything is exposed; a graph pass that issues early can hide it.
    """

    WIRE = {"all_gather_into_tensor": ("all_gather", lambda n, s: (n - 1) * s),
            "reduce_scatter_tensor": ("reduce_scatter", lambda n, s: (n - 1) / n * s),
            "all_reduce": ("all_reduce", lambda n, s: 2 * (n - 1) / n * s)}

    def __init__(self) -> None:
        super().__init__()
        self._pending: dict[int, list[tuple[CommLog, CommRecord]]] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(t is not torch.Tensor and is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor: it comes back with its local tensors
        name = func.__name__.split(".")[0]
        if func.namespace != "_c10d_functional" or name not in (*self.WIRE, "wait_tensor"):
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if name == "wait_tensor":
            t = time.perf_counter()
            for log, rec in self._pending.pop(out.untyped_storage().data_ptr(), []):
                rec.t_wait, rec.t_end = t0 - log.t0, t - log.t0
                rec.t_done = rec.t_end
            return out
        op, wire = self.WIRE[name]
        tensor = args[0]
        group = _resolve_group(args[-1])
        recs = [(log, _record(log, "comm", op, _nbytes(tensor), wire(group.size(), _nbytes(tensor)),
                              group.size(), tensor, t0, None, None)) for log in _ACTIVE]
        for log, rec in recs:
            log.records.append(rec)
        self._pending[out.untyped_storage().data_ptr()] = recs
        return out
