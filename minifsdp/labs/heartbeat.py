"""The lab worker's watchdog (Note [a lab never hangs] in ``minifsdp.labs.worker``)."""

from __future__ import annotations

import faulthandler
import sys

_SECONDS: float | None = None


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
