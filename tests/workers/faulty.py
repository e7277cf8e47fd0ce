"""A worker that misbehaves on purpose, for tests/test_launch.py.

    --mode ok     every rank all-reduces and reports
    --mode crash  rank 1 raises before the collective
    --mode hang   rank 1 sleeps forever, so rank 0 waits in all_reduce
    --mode exit   rank 1 exits with code 3 without a traceback
    --mode kill   rank 1 is killed by SIGKILL (the OOM killer's signal) while rank 0 waits
    --mode segv   rank 1 crashes in native code (reads address 0) while rank 0 waits
"""

import argparse
import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist

from minifsdp.dist import dist_setup, finish, report_progress

p = argparse.ArgumentParser()
p.add_argument("--mode", default="ok")
args = p.parse_args()

info = dist_setup()
t = torch.ones(2) * (info.rank + 1)
if info.rank == 1:
    if args.mode == "crash":
        raise ValueError("deliberate failure on rank 1")
    if args.mode == "hang":
        time.sleep(10_000)
    if args.mode == "exit":
        os._exit(3)
    if args.mode == "kill":
        time.sleep(1)  # rank 0 is inside all_reduce by now
        os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "segv":
        time.sleep(1)
        ctypes.string_at(0)  # SIGSEGV, as a crash inside a library would
for i in range(3):
    report_progress(i + 1, 3, loss=1.0 / (i + 1))
dist.all_reduce(t)
finish({"rank": info.rank, "world_size": info.world_size, "sum": t.tolist()})
