"""Worker for tests/test_simple_fsdp.py: ``minifsdp.simple_fsdp`` and ``minifsdp.graph_passes``
next to our and torch's ``fully_shard``. Reports raw numbers; the test asserts on them.

A 2-block GPT (d_model 32, vocab 64: uneven rows at N = 3), AdamW, STEPS steps. Every run
is compared with torch's ``fully_shard`` (each block, then the root) on the same batches:
losses and full parameters, bit for bit. Compiled runs (``graph_passes.backend``, each set of
passes) are compared with eager SimpleFSDP and report their graphs' collectives. With
``--measure``: step time and peak memory per variant (a bigger GPT; printed, not asserted).
The variants are built, fed, trained and compared by chapter 10's demo
(``minifsdp.demos.simple_fsdp``), so that the test checks the code whose numbers the notebook
prints.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from minifsdp import comm
from minifsdp import graph_passes as gp
from minifsdp.demos import simple_fsdp as demo
from minifsdp.demos.simple_fsdp import PASSES, full, gpt, same
from minifsdp.dist import dist_setup, finish
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPTConfig
from minifsdp.simple_fsdp import data_parallel

parser = argparse.ArgumentParser()
parser.add_argument("--measure", action="store_true")
args = parser.parse_args()
info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh("cpu", (N,))
STEPS = 3


# chapter 10's demo builds, feeds and trains the variants: here on this rank, this mesh
def build(kind: str, mp: bool = False, cfg=demo.CFG):
    return demo.build(kind, mesh, mp, cfg)


def batch(step: int, cfg=demo.CFG, local=demo.LOCAL):
    return demo.batch(step, rank, N, cfg, local)


def train(model, steps=STEPS, cfg=demo.CFG, local=demo.LOCAL, count=False):
    return demo.train(model, rank, N, steps, count, cfg, local)


def at_rest(model) -> dict:
    """Bytes of the sharded parameters' storages on this rank, and of their unpadded rows."""
    locals_ = [p.to_local() for p in model.parameters()]
    return {"storage": sum(t.untyped_storage().nbytes() for t in locals_),
            "rows": sum(t.numel() * t.element_size() for t in locals_)}


def parity() -> dict:
    out = {"eager": {}, "compiled": {}, "counts": {}, "collectives": {}, "prefetched": {},
           "at_rest": {}}
    for mp in (False, True):
        runs = {}
        for kind in ("torch", "ours", "simple", "simple_keep"):
            model = build(kind, mp)
            if not mp:
                out["at_rest"][kind] = at_rest(model)
            losses, _, counts = train(model, count=kind.startswith("simple"))
            runs[kind] = (losses, full(model))
            if counts and not mp:
                out["counts"][kind] = counts
        for kind in runs:
            out["eager"][f"{kind}{'_bf16' if mp else ''}"] = same(
                runs[kind], runs["torch"], names=(kind, "torch"))
        if not mp:
            eager = runs["simple"]
    if N == 2:  # DDP mode: stored Replicate, the gradient's Partial("avg") -> Replicate
        ddp = torch.nn.parallel.DistributedDataParallel(gpt())
        ref = train(ddp)[0], {k.removeprefix("module."): v for k, v in ddp.named_parameters()}
        model = data_parallel(gpt(), mesh, "replicate")
        losses, _, counts = train(model, count=True)
        out["replicate"] = {**same((losses, full(model)), ref, names=("replicate", "DDP")),
                            "counts": counts}
    # Compiling costs most of this job: "none" and "both" are compiled and trained (at N = 3
    # only "both"); each single pass is applied to copies of the "none" graphs, for the lists.
    # "keep" (N = 2): no passes, reshard_after_forward=False, for the compiled peaks.
    for name in ("none", "both", "keep") if N == 2 else ("both",):
        model, graphs = build("simple_keep" if name == "keep" else "simple"), []
        passes = PASSES.get(name, ())
        compiled = torch.compile(model, backend=gp.backend(passes, graphs), fullgraph=True)
        t0 = time.perf_counter()
        losses, _, _ = train(compiled)
        out["compiled"][name] = {**same((losses, full(model)), eager, names=(name, "eager")),
                                 "seconds": time.perf_counter() - t0,
                                 **logged_step(compiled, model)}
        if name == "keep":
            continue
        out["collectives"][name] = {kind: gp.collectives(g) for kind, g in graphs[:2]}
        out["prefetched"][name] = {kind: prefetched(g) for kind, g in graphs[:2]}
        if name == "none":
            copies = [(kind, gp.bucket_all_gathers(copy.deepcopy(g))) for kind, g in graphs[:2]]
            out["collectives"]["bucket"] = {k: gp.collectives(g) for k, g in copies}
            out["prefetched"]["bucket"] = {k: prefetched(g) for k, g in copies}
            out["prefetch_unbucketed"] = {}
            for kind, g in graphs[:2]:
                try:
                    gp.prefetch_all_gathers(copy.deepcopy(g))
                except ValueError as e:
                    out["prefetch_unbucketed"][kind] = str(e)
    out["cpu_s"] = time.process_time()
    return out


def logged_step(run, model) -> dict:
    """One step under the functional comm log and one under MemoryTracker (both run inside
    compiled graphs: Note [functional collectives], Note [compiled code])."""
    x, y = batch(50)
    with comm.logging_comm() as log, comm.FunctionalCollectives():
        F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten()).backward()
    model.zero_grad(set_to_none=True)
    with MemoryTracker(model) as mt:
        F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten()).backward()
    model.zero_grad(set_to_none=True)
    waited = [r for r in log.comms() if r.t_wait is not None]
    return {"logged": [r.op for r in log.comms()], "waited": len(waited),
            "wire_bytes": log.total_bytes(wire=True), "peak": mt.peak}


def prefetched(gm) -> list[bool]:
    """Blocks in order of their first all-gather (the root's parameters count as one block):
    per consecutive pair, is every all-gather of the later block issued before the earlier
    block's first wait? (from ``gp.schedule``)"""
    sched = gp.schedule(gm)
    keys = list(dict.fromkeys(e.split()[1] for e in sched if e.startswith("AG")))
    last_ag = {e.split()[1]: i for i, e in enumerate(sched) if e.startswith("AG")}
    return [last_ag[b] < sched.index(f"W {a}") for a, b in zip(keys, keys[1:])]


def measure() -> dict:
    """Per variant: median step time (steps 2..), peak bytes of one tracked step."""
    cfg, local, res = GPTConfig(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=128), 4, {}
    for kind in ("simple", "simple_keep", "compiled", "compiled_both", "ours", "ours_prefetch"):
        model = build(kind.replace("compiled", "simple").removesuffix("_both"), cfg=cfg)
        run = model
        if kind.startswith("compiled"):
            passes = PASSES["both" if "both" in kind else "none"]
            run = torch.compile(model, backend=gp.backend(passes), fullgraph=True)
        t0 = time.perf_counter()
        eager = not kind.startswith("compiled")  # dispatch modes do not run under compile
        _, times, counts = train(run, steps=6, cfg=cfg, local=local, count=eager)
        first = time.perf_counter() - t0 - sum(times[1:])
        x, y = batch(9, cfg, local)
        peak = None
        if eager:
            with MemoryTracker(model) as mt:
                F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten()).backward()
            peak = mt.peak
        res[kind] = {"step_s": statistics.median(times[1:]), "first_step_s": first,
                     "peak": peak, "at_rest": at_rest(model)["storage"], "eager_counts": counts}
    return res


finish({"measure": measure()} if args.measure else parity())
