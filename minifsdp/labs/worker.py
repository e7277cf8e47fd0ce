"""The torchrun worker behind ``labs.check``: install the reader's code, run the lab's cases.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m minifsdp.labs.worker 00

(with ``MINIFSDP_LAB_FILE=labs/mine/lab00_ring.py``; Note [installing a seam]). Each rank writes
its ``Trace``'s results; ``minifsdp.labs.check`` reads them back and writes the report.

Note [a lab never hangs]: the process group starts with the usual generous timeout, because
ranks may take a while to import torch on a busy machine; once every rank has passed a barrier,
``dist.set_timeout`` cuts it to ``MINIFSDP_LAB_TIMEOUT`` seconds (10 by default). The cases'
collectives take milliseconds, so a collective still waiting after that was issued on some ranks
only -- or in another order on each -- and it raises, the launcher stops every rank, and the
report says "hang" with where each rank was, seconds after the mistake instead of never.
Blocking point-to-point calls ignore that timeout on gloo (a ``dist.send`` that no peer
receives waits forever), so a watchdog backs it up: ``faulthandler.dump_traceback_later``
prints every thread's stack and ends the process when no check and no seam call happened for
``WATCHDOG_S`` seconds (``report.heartbeat`` re-arms it). Compiling is the one slow thing a
case does (lab 10), and ranks finish it apart: it runs inside ``heartbeat.patient()``.

Note [a batch of lab files]: ``MINIFSDP_LAB_FILE`` may name several files, one per line
(``labs.check_many``; the tests check 106 planted bugs this way). Each runs the lab's cases as
if alone -- its functions installed, the seed reset, a fresh ``Trace`` -- and the package's
own functions are put back before the next. A launch costs about 6 s of starting processes and
a lab's cases 1-5 s, so one job for a lab's bugs instead of one each saves most of the time.
Every rank runs every case of every file to the end (Note [a lab never hangs] holds per file),
so a file that diverges leaves no collective open for the next one.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from minifsdp.dist import dist_setup, finish, seed_everything
from minifsdp.labs import heartbeat, seams
from minifsdp.labs.report import Trace

LAB_TIMEOUT_S = 10.0
WATCHDOG_S = 15.0


def main(argv: list[str]) -> None:
    lab = seams.get_lab(argv[0])
    info = dist_setup()
    specs = os.environ.get("MINIFSDP_LAB_FILE", seams.REFERENCE).split("\n")
    results = []
    for spec in specs:  # Note [a batch of lab files]
        seams.install(lab, spec)
        dist.barrier()  # every rank is here: from now on a wait longer than a few seconds is a bug
        heartbeat.set_timeout(float(os.environ.get("MINIFSDP_LAB_TIMEOUT", LAB_TIMEOUT_S)))
        heartbeat.arm(float(os.environ.get("MINIFSDP_LAB_WATCHDOG", WATCHDOG_S)))
        seed_everything(0)
        trace = Trace(info.rank, info.world_size, lab.hint)
        lab.run(trace, info)
        heartbeat.disarm()
        results.append(trace.results())
        seams.uninstall(lab)
    finish({"files": results})


if __name__ == "__main__":
    main(sys.argv[1:])
