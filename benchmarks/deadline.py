"""Run a command with a deadline, and leave nothing of it behind: ``benchmarks/gpu_check.sh``.

    python benchmarks/deadline.py SECONDS [--grace S] -- command args...

The command runs in a session of its own. At the deadline it gets SIGINT (pytest then prints
its summary of what ran), ``--grace`` seconds later every process below it is killed. Its
descendants are collected *before* anything is killed: ``minifsdp.launch`` starts each torchrun
job in a session of its own, so a process-group kill would miss them and leave them orphaned.
Exit status: the command's, or 124 when the deadline ended it (as coreutils' ``timeout``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``: ``pgrep -P`` where there is one, else ``/proc``."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True)
            children = [int(c) for c in out.stdout.split()]
        except FileNotFoundError:
            children = []
            for stat in Path("/proc").glob("[0-9]*/stat"):
                try:
                    fields = stat.read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[1]) == parent:
                    children.append(int(stat.parent.name))
        found += children
        todo += children
    return found


def kill_tree(proc: subprocess.Popen, also: list[int] = ()) -> None:
    """SIGKILL ``proc``, its descendants (and ``also``: ones collected earlier, orphaned since)
    and their process groups (a torchrun and its ranks)."""
    doomed = [*also, *(descendants(proc.pid) if proc.poll() is None else ()), proc.pid]
    for pid in dict.fromkeys(doomed):
        try:
            pgid = os.getpgid(pid)
            if pgid != os.getpgrp():  # never our own group
                os.killpg(pgid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run(cmd: list[str], seconds: float, grace: float = 20.0) -> int:
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pass
    except KeyboardInterrupt:  # Ctrl-C on the script: the command is in another session
        pass
    print(f"\n[deadline] {seconds:.0f} s (or Ctrl-C): interrupting {' '.join(cmd[:4])} ...",
          flush=True)
    below = descendants(proc.pid)  # before they are orphaned
    proc.send_signal(signal.SIGINT)
    t_end = time.monotonic() + grace
    while time.monotonic() < t_end and proc.poll() is None:
        time.sleep(0.5)
    kill_tree(proc, below)
    return 124


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    cut = argv.index("--")
    opts, cmd = argv[:cut], argv[cut + 1:]
    seconds, grace = float(opts[0]), 20.0
    if "--grace" in opts:
        grace = float(opts[opts.index("--grace") + 1])
    return run(cmd, seconds, grace)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
