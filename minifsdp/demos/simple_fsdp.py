"""Chapter 10's worker: SimpleFSDP (``minifsdp.simple_fsdp``) next to torch's and our
``fully_shard``, eager and compiled (``minifsdp.graph_passes``). Run under torchrun, e.g.::

    run = torchrun("minifsdp.demos.simple_fsdp", "--compile", nproc=2, chapter="10")
    run.ranks[0]["parity"]["simple"]          # {"losses": True, "params": True, ...}

A 2-block GPT (d_model 32, vocab 64: uneven rows at N = 3), AdamW, ``--steps`` steps on the
same batches in every variant. Per rank it reports:

- ``parity``: each eager variant (SimpleFSDP resharding / keeping, ours) against torch's
  ``fully_shard``, fp32 and bf16/fp32: losses and full parameters bit for bit, largest diffs,
  and where they first differ (``same``);
- ``at_rest``: bytes of the sharded parameters; ``eager_counts``: collectives per phase;
  ``hook_order``: our ``fully_shard``'s collectives of one step (from the comm log, by group);
- with ``--compile``: SimpleFSDP compiled with each set of passes (``VARIANTS``): the forward
  and backward graphs' collectives, the forward's ``schedule``, compiled == eager bitwise,
  compile seconds, the error with which ``prefetch_all_gathers`` refuses an unbucketed graph,
  the most collectives each graph has in flight as planned and as run (on gloo the backend runs
  it serialized: Note [one collective in flight on gloo]);
  and ``measured``, every variant eager and compiled side by side: step seconds, collectives and
  wire bytes of one step, its exposed communication and its peak memory (``measure``);
- with ``--inductor``: a 2-layer MLP under ``backend="inductor"``: compile seconds, the largest
  loss difference with eager, and the most collectives in flight
  (``serial_collectives.InFlightGuard``), or the exception's type and first line.

tests/workers/simple_fsdp_worker.py builds, feeds and compares its variants with the functions
here (``build``, ``batch``, ``train``, ``full``, ``same``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import tempfile
import time
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from minifsdp import comm, fsdp2
from minifsdp import graph_passes as gp
from minifsdp import serial_collectives as sc
from minifsdp.dist import dist_setup, finish
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPT, GPTConfig
from minifsdp.parity import divergence_line, max_abs_diff
from minifsdp.simple_fsdp import data_parallel, param_name

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
LOCAL = 2  # sequences per rank


def gpt(cfg: GPTConfig = CFG) -> GPT:
    """The same initial GPT on every rank and in every variant."""
    torch.manual_seed(0)
    return GPT(cfg)


def build(kind: str, mesh, mp: bool = False, cfg: GPTConfig = CFG):
    """``torch``, ``ours``, ``ours_prefetch``, ``simple`` (reshard) or ``simple_keep``: ``cfg``'s
    GPT, each block and then the root sharded (SimpleFSDP: the whole model) over ``mesh``;
    ``mp``: bf16 parameters, fp32 reduction."""
    model = gpt(cfg)
    if kind.startswith("simple"):
        kw = {"mp_policy": fsdp2.MixedPrecisionPolicy(**BF16)} if mp else {}
        return data_parallel(model, mesh, reshard_after_forward=kind == "simple", **kw)
    shard, kw = (torch_fully_shard, {"mp_policy": TorchMP(**BF16)}) if kind == "torch" else (
        fsdp2.fully_shard, {"mp_policy": fsdp2.MixedPrecisionPolicy(**BF16)})
    kw = kw if mp else {}
    for block in model.blocks:
        shard(block, mesh=mesh, **kw)
    shard(model, mesh=mesh, **kw)
    if kind == "ours_prefetch":
        blocks = list(model.blocks)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    return model


def batch(step: int, rank: int, n: int, cfg: GPTConfig = CFG, local: int = LOCAL):
    """Step ``step``'s global batch (``local`` sequences per rank), rank ``rank``'s share."""
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (n * local, cfg.seq_len + 1), generator=g)
    return x[:, :-1].chunk(n)[rank], x[:, 1:].chunk(n)[rank]


class CountCollectives(TorchDispatchMode):
    """Eager functional collectives by phase: ``{"forward all_gather_into_tensor": k}``."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.__name__.startswith(("all_", "reduce")):
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            key = f"{phase} {func.__name__.split('.')[0]}"
            self.counts[key] = self.counts.get(key, 0) + 1
        return func(*args, **(kwargs or {}))


def train(model, rank, n, steps, count=False, cfg: GPTConfig = CFG, local: int = LOCAL):
    """``steps`` AdamW steps: losses, step seconds, collective counts of step 0 (if ``count``)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, times, counter = [], [], CountCollectives()
    for step in range(steps):
        x, y = batch(step, rank, n, cfg, local)
        t0 = time.perf_counter()
        with counter if count and step == 0 else contextlib.nullcontext():
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    return losses, times, counter.counts


def full(model) -> dict[str, torch.Tensor]:
    return {param_name(k): v.full_tensor() for k, v in model.named_parameters()}


def same(a, b, names: tuple[str, str] = ("ours", "torch")) -> dict:
    """Two runs' ``(losses, full params)``, ``a`` named ``names[0]``, ``b`` ``names[1]``: bitwise
    equal (Note [parity] in minifsdp/parity.py)? the largest differences (float64), and
    ``divergence``: the line saying where the losses first differ, else the parameters, or
    None."""
    losses, params = (divergence_line(x, y, names=names) for x, y in zip(a, b))
    return {"losses": losses is None, "params": params is None,
            "loss_diff": max_abs_diff(a[0], b[0], names=names),
            "param_diff": max_abs_diff(a[1], b[1], names=names),
            "divergence": f"losses, {losses}" if losses else
            f"parameters, {params}" if params else None}


def at_rest(model) -> int:
    return sum(p.to_local().untyped_storage().nbytes() for p in model.parameters())


def peak_bytes(model, rank, n) -> int:
    x, y = batch(99, rank, n)
    with MemoryTracker(model) as mt:
        F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
    model.zero_grad()
    return mt.peak


def hook_order(model, rank, n) -> list[list[str]]:
    """Our fully_shard's collectives in one step: ``[op, group]`` from the comm log."""
    x, y = batch(99, rank, n)
    with comm.logging_comm() as log:
        F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).backward()
    model.zero_grad()
    return [[r.op, (r.tag or "").split()[-1]] for r in log.records
            if r.kind == "comm" and (r.tag or "").startswith("fsdp2")]


def eager(rank, n, steps) -> dict:
    out = {"parity": {}, "at_rest": {}, "eager_counts": {}}
    for mp in (False, True):
        runs = {}
        for kind in ("torch", "ours", "simple", "simple_keep"):
            model = build(kind, mesh, mp)
            if not mp:
                out["at_rest"][kind] = at_rest(model)
            losses, times, counts = train(model, rank, n, steps, count=kind.startswith("simple"))
            runs[kind] = (losses, full(model))
            if not mp:
                if counts:
                    out["eager_counts"][kind] = counts
                if kind == "ours":
                    out["hook_order"] = hook_order(model, rank, n)
        for kind in ("ours", "simple", "simple_keep"):
            out["parity"][kind + ("_bf16" if mp else "")] = same(runs[kind], runs["torch"],
                                                                      names=(kind, "torch"))
        if not mp:
            out["_eager"] = runs["simple"]
    return out


PASSES = {"none": (), "bucket": (gp.bucket_all_gathers,),
          "both": (gp.bucket_all_gathers, gp.prefetch_all_gathers)}
# what section 4 measures: name -> (build kind, passes; None = eager)
VARIANTS = {"simple": ("simple", None), "simple_keep": ("simple_keep", None),
            "ours": ("ours", None), "ours_prefetch": ("ours_prefetch", None),
            "compiled": ("simple", "none"), "compiled_keep": ("simple_keep", "none"),
            "compiled_bucket": ("simple", "bucket"), "compiled_both": ("simple", "both")}


def compiled(rank, n, steps, reference) -> dict:
    """Compile SimpleFSDP with each set of passes (``VARIANTS``): the graphs' collectives,
    compiled == eager bitwise over ``steps`` AdamW steps, compile seconds. Returns the models
    too, for ``measure``."""
    out = {"collectives": {}, "schedule": {}, "in_flight": {}, "compiled": {}, "compile_s": {},
           "_models": {}}
    for name, (kind, passes) in VARIANTS.items():
        if passes is None:
            continue
        model, graphs = build(kind, mesh), []
        run = torch.compile(model, backend=gp.backend(PASSES[passes], graphs), fullgraph=True)
        t0 = time.perf_counter()
        losses, times, _ = train(run, rank, n, steps)
        out["compile_s"][name] = time.perf_counter() - t0 - sum(times[1:])
        out["compiled"][name] = same((losses, full(model)), reference,
                                       names=(name, "eager"))
        if kind == "simple":
            out["collectives"][passes] = {k: gp.collectives(g) for k, g in graphs[:2]}
            out["schedule"][passes] = gp.schedule(graphs[0][1])
            out["in_flight"][passes] = {k: [sc.in_flight(g), sc.in_flight(g.meta["ran"]),
                                            gp.schedule(g.meta["ran"])] for k, g in graphs[:2]}
            if passes == "none":  # prefetch without buckets: refused (Note [collectives in flight])
                try:
                    gp.prefetch_all_gathers(copy.deepcopy(graphs[0][1]))
                except ValueError as e:
                    out["prefetch_unbucketed"] = str(e)
        out["_models"][name] = (run, model)
    return out


def measure(models: dict, rank: int, n: int, rounds: int) -> dict:
    """Per variant, on the same batches: step seconds (median of ``rounds``, the variants taking
    turns so that a change in the machine's load hits them alike); then one step under the comm
    log (``comm.FunctionalCollectives`` for DTensor's and the graphs' collectives, Note
    [functional collectives]): collectives by op, wire bytes, exposed seconds; then one step
    under ``MemoryTracker`` (compiled graphs too, Note [compiled code]): the peak."""
    def step(run, module, s):
        x, y = batch(s, rank, n)
        F.cross_entropy(run(x).flatten(0, 1).float(), y.flatten()).backward()
        module.zero_grad(set_to_none=True)

    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds):
        for k, (run, module) in models.items():
            t0 = time.perf_counter()
            step(run, module, 100 + r)
            times[k].append(time.perf_counter() - t0)
    out = {}
    for k, (run, module) in models.items():
        with comm.logging_comm() as log, comm.FunctionalCollectives():
            t0 = time.perf_counter()
            step(run, module, 200)
            logged_s = time.perf_counter() - t0  # the step its exposed seconds come from
        with MemoryTracker(module) as mt:
            step(run, module, 201)
        out[k] = {"step_s": statistics.median(times[k]),
                  "exposed_s": comm.exposed_seconds(log.comms()), "logged_step_s": logged_s,
                  "collectives": dict(Counter(r.op for r in log.comms())),
                  "wire_bytes": log.total_bytes(wire=True), "peak": mt.peak,
                  # the bytes one collective's buffers hold at most (input + output, N + 1
                  # times its logged input): what gloo's thread may free a little later in one
                  # run than another, one collective being in flight at a time on gloo
                  "one_collective_bytes": (n + 1) * max(r.bytes for r in log.comms()),
                  "peak_by_category": mt.peak_by_category}
    return out


def inductor(rank, n, steps) -> dict:
    """A 2-layer MLP under SimpleFSDP, compiled by Inductor (a fresh cache: a cold compile),
    against the same model eager: compile seconds, step seconds, largest difference; or the
    exception's type and first line if Inductor fails."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="minifsdp_inductor_")

    def mlp():
        torch.manual_seed(0)
        return data_parallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), mesh)

    def run(model):
        losses, times = [], []
        for step in range(steps):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            t0 = time.perf_counter()
            loss = model(x).square().mean()
            loss.backward()
            times.append(time.perf_counter() - t0)
            losses.append(loss.detach())
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        return losses, times

    reference, model = run(mlp())[0], mlp()
    # Inductor schedules its own waits (graph_passes.backend does not run): the guard raises if
    # it ever puts two collectives in flight (Note [one collective in flight on gloo])
    guard = sc.InFlightGuard()
    try:
        with guard:
            losses, times = run(torch.compile(model, backend="inductor", fullgraph=True))
    except Exception as e:  # noqa: BLE001 -- the failure is the result
        return {"ok": False, "error": type(e).__name__, "first_line": str(e).splitlines()[0]}
    return {"ok": True, "first_step_s": times[0], "step_s": statistics.median(times[1:]),
            "loss_diff": max(float((a - b).abs()) for a, b in zip(losses, reference)),
            "issued": guard.issued, "most_in_flight": guard.most}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--rounds", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--inductor", action="store_true")
    args = parser.parse_args()
    info = dist_setup()
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    results = eager(info.rank, info.world_size, args.steps)
    reference = results.pop("_eager")
    if args.compile:
        more = compiled(info.rank, info.world_size, args.steps, reference)
        models = more.pop("_models")
        for name, (kind, passes) in VARIANTS.items():
            if passes is None:
                models[name] = (m := build(kind, mesh), m)
        models = {k: models[k] for k in VARIANTS}
        results.update(more, measured=measure(models, info.rank, info.world_size, args.rounds))
    if args.inductor:
        results["inductor"] = inductor(info.rank, info.world_size, args.steps)
    finish(results)
