"""Worker for tests/test_simple_fsdp.py's gloo tests: Note [one collective in flight on gloo].

One job, ``--rounds`` rounds, each on every rank: eager SimpleFSDP and the compiled variants
(no passes, bucketed, bucketed + prefetched; each compiled once, before the rounds) train
``--steps`` AdamW steps under ``serial_collectives.InFlightGuard`` (it raises if a second functional
collective is issued before the first is waited for), then lab 10's checker runs its cases on
the reference solution. First, the guard and ``in_flight`` are shown to catch two collectives
in flight in a pure-torch graph. The job reaching ``finish`` at all is the first result: the
bug it guards against aborts the process (``malloc(): unaligned tcache chunk detected``).
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.fx.experimental.proxy_tensor import make_fx

from minifsdp import graph_passes as gp
from minifsdp import serial_collectives as sc
from minifsdp.dist import dist_setup, finish
from minifsdp.labs import ch10, seams
from minifsdp.labs.report import Trace
from minifsdp.models import GPT, GPTConfig
from minifsdp.simple_fsdp import data_parallel

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=3)
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()
# every compiled model and every lab round compiles GPT.forward again (a new module each time):
# past dynamo's default of 8 a fullgraph compile fails; --rounds may ask for many
torch._dynamo.config.recompile_limit = 8 + 2 * args.rounds
info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh("cpu", (N,))
CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
PASSES = {"none": (), "bucket": (gp.bucket_all_gathers,),
          "both": (gp.bucket_all_gathers, gp.prefetch_all_gathers)}
c10d, GROUP = torch.ops._c10d_functional, dist.group.WORLD.group_name


def two_in_flight() -> dict:
    """A graph that issues two all-gathers before waiting: ``in_flight`` says 2, serialized 1,
    and the guard refuses to issue the second (before it is issued: no rank is left waiting)."""
    def f(a, b):
        x, y = c10d.all_gather_into_tensor(a, N, GROUP), c10d.all_gather_into_tensor(b, N, GROUP)
        return c10d.wait_tensor(x) + c10d.wait_tensor(y)

    a, b = torch.full((2,), float(rank)), torch.ones(2)
    gm = make_fx(f)(a, b)
    planned = sc.in_flight(gm)
    ran = sc.runnable(gm)
    out = {"planned": planned, "ran": sc.in_flight(ran), "gloo": sc.on_gloo(gm),
           "same": torch.equal(ran(a, b), f(a, b)), "refused": None}
    first = c10d.all_gather_into_tensor(a, N, GROUP)
    try:
        with sc.InFlightGuard():
            x = c10d.all_gather_into_tensor(a, N, GROUP)
            c10d.all_gather_into_tensor(b, N, GROUP)
    except RuntimeError as e:
        out["refused"] = str(e)
        c10d.wait_tensor(x)
    c10d.wait_tensor(first)  # issued outside the guard: it does not count
    return out


def gpt():
    torch.manual_seed(0)
    return data_parallel(GPT(CFG), mesh)


def batch(step):
    x = torch.randint(0, CFG.vocab_size, (2 * N, CFG.seq_len + 1),
                      generator=torch.Generator().manual_seed(step))
    return x[:, :-1].chunk(N)[rank], x[:, 1:].chunk(N)[rank]


def main() -> dict:
    seams.install(ch10.LAB, seams.REFERENCE)  # as lab 10's worker does, with the reference
    out = {"two_in_flight": two_in_flight(), "graphs": {}, "rounds": []}
    runs = {"eager": (gpt(), None)}
    for name, passes in PASSES.items():
        model, graphs = gpt(), []
        runs[name] = (torch.compile(model, backend=gp.backend(passes, graphs), fullgraph=True),
                      graphs)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, (m, _) in runs.items()}
    step = 0
    for _ in range(args.rounds):
        res = {}
        for name, (run, graphs) in runs.items():
            guard = sc.InFlightGuard()
            losses = []
            with guard:
                for _ in range(args.steps):
                    x, y = batch(step)
                    step += 1
                    loss = F.cross_entropy(run(x).flatten(0, 1), y.flatten())
                    loss.backward()
                    opts[name].step()
                    opts[name].zero_grad()
                    losses.append(float(loss.detach()))
            res[name] = {"issued": guard.issued, "most": guard.most, "losses": losses}
            if graphs is not None and name not in out["graphs"]:
                out["graphs"][name] = {kind: {"planned": sc.in_flight(g),
                                              "ran": sc.in_flight(g.meta["ran"]),
                                              "schedule": gp.schedule(g)}
                                       for kind, g in graphs[:2]}
        trace = Trace(rank, N, ch10.hint)
        ch10.run_lab(trace, info)
        res["lab"] = trace.results()
        out["rounds"].append(res)
    return out


finish(main())
