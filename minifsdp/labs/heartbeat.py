"""The lab worker's watchdog and collective timeout (Note [a lab never hangs] in
``minifsdp.labs.worker``)."""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import sys
from collections.abc import Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# the public ``dist.set_timeout`` is new (torch 2.12+); before it, the same call was private
_set_pg_timeout = getattr(dist, "set_timeout", None) or c10d._set_pg_timeout

_SECONDS: float | None = None  # the watchdog's silence limit, while armed
_TIMEOUT: float | None = None  # the collectives' short timeout, once set


def set_timeout(seconds: float) -> None:
    """Every collective from now on raises after waiting ``seconds`` for its peers."""
    global _TIMEOUT
    _TIMEOUT = seconds
    _set_pg_timeout(datetime.timedelta(seconds=seconds))


def arm(seconds: float) -> None:
    """From now on, a silence of ``seconds`` dumps every thread's stack and exits."""
    global _SECONDS
    _SECONDS = seconds
    beat()


def beat() -> None:
    """Progress: restart the countdown (cheap; called on every check and seam call)."""
    if _SECONDS is not None:
        faulthandler.dump_traceback_later(_SECONDS, exit=True, file=sys.stderr)


def disarm() -> None:
    global _SECONDS
    _SECONDS = None
    faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def patient(seconds: float = 120.0) -> Iterator[None]:
    """Harness work that is slow, and uneven across ranks, inside a case: compiling a graph.

    A rank that finishes compiling first waits in the graph's first collective for a rank
    still compiling -- on a loaded machine, longer than the short timeout. Inside the block
    collectives wait up to ``seconds`` and the watchdog sleeps; at its end every rank meets at
    a barrier, and the short limits return."""
    watchdog, timeout = _SECONDS, _TIMEOUT
    disarm()
    if timeout is not None:
        _set_pg_timeout(datetime.timedelta(seconds=seconds))
    try:
        yield
        if timeout is not None:
            dist.barrier()
    finally:
        if timeout is not None:
            set_timeout(timeout)
        if watchdog is not None:
            arm(watchdog)
