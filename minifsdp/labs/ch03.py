"""Chapter 03 (ZeRO): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_03.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check


def flat_partition(numels: list[int], rank: int, world_size: int) -> list[tuple[int, int, int]]:
    """``(parameter index, start, stop)``: the elements of each parameter that ``rank`` owns in
    ZeRO's flat partition (one bucket; Note [flat partition]), from ``minifsdp.zero``."""
    from minifsdp.zero import flatten_into_buckets

    params = [torch.nn.Parameter(torch.empty(n)) for n in numels]
    [b] = flatten_into_buckets(params, rank, world_size, cap_bytes=float("inf"))
    lo, hi = rank * b.shard.numel(), (rank + 1) * b.shard.numel()
    owned = []
    for i, (p, o) in enumerate(zip(b.params, b.offsets)):
        start, stop = max(lo, o) - o, min(hi, o + p.numel()) - o
        if start < stop:
            owned.append((i, start, stop))
    return owned


def check_flat_partition(fn) -> bool:
    """``fn(numels, rank, world_size)`` -> list of ``(param index, start, stop)`` slices of the
    parameters (flattened) that ``rank`` owns, in parameter order."""
    shapes = [[8], [6, 2], [5, 5, 5], [1, 1000, 3], [7], [4, 4, 4, 4]]
    cases = [((s, r, n), flat_partition(s, r, n)) for s in shapes for n in (1, 2, 3, 4)
             for r in range(n)]
    return check("flat partition", cases, fn)


def zero_model_state_bytes(psi: int, n: int, stage: str) -> dict[str, int]:
    """Per-rank bytes of our fp32 Adam ZeRO (one bucket) after a step's backward, from step 2
    on: padded flat parameters, gradients, Adam's two shard-sized states and its ``step``."""
    shard = -(-psi // n)
    grads = 4 * n * shard if stage == "zero1" else 4 * shard
    return {"params": 4 * n * shard, "grads": grads, "optimizer": 8 * shard + 4}


def check_zero_model_state_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(psi, n, stage)`` -> ``{"params", "grads", "optimizer"}`` bytes on one rank
    (``stage`` is ``"zero1"`` or ``"zero2"``; Note [ZeRO memory categories]). ``measured``:
    ``((psi, n, stage), bytes)`` pairs from real runs, checked too."""
    cases = [((psi, n, st), zero_model_state_bytes(psi, n, st))
             for psi in (1_199_882, 30_592, 10) for n in (1, 2, 3, 4, 8)
             for st in ("zero1", "zero2")]
    return check("ZeRO model-state bytes", [*cases, *(measured or [])], fn)


def zero_step_wire_bytes(psi: int, n: int, stage: str) -> float:
    """Bytes one rank sends per fp32 step (one bucket; ``minifsdp.comm``'s accounting):
    DDP all-reduces 4 psi; ZeRO-1 all-reduces and all-gathers the padded flat buffer; ZeRO-2
    reduce-scatters and all-gathers it (Note [ZeRO-1 traffic])."""
    if stage == "ddp":
        return 2 * (n - 1) / n * 4 * psi
    flat = 4 * n * -(-psi // n)
    return (2 if stage == "zero1" else 1) * (n - 1) / n * flat + (n - 1) / n * flat


def check_zero_step_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(psi, n, stage)`` -> wire bytes one rank sends per step under ``"ddp"``,
    ``"zero1"`` or ``"zero2"``. ``measured``: ``((psi, n, stage), bytes)`` from real runs."""
    cases = [((psi, n, st), zero_step_wire_bytes(psi, n, st))
             for psi in (1_199_882, 30_592, 10) for n in (1, 2, 3, 4)
             for st in ("ddp", "zero1", "zero2")]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("ZeRO bytes per step", [*cases, *(measured or [])], fn, close=close)


# ---- lab 03: the ZeRO-2 step ------------------------------------------------------------------

REDUCE, STEP = "zero.reduce", "zero.step"
COLLECTIVES = "collectives of the step, in issue order"
INTO_FLAT = "each all-gather of the step writes into a bucket's flat"
FREED = "full bucket gradient freed after backward (b.grad is None)"
STORAGE = "bytes of the storage behind shard.grad"
CAP_MB = 64 / 2**20  # 64 bytes: three buckets of 15, 4 and 20 elements (padding at N = 2, 3)


def _zero_model(dtype: torch.dtype = torch.float32):
    """Two trainable layers around a frozen one: 39 trainable elements, uneven at N = 2, 3."""
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4).requires_grad_(False),
                         nn.Tanh(), nn.Linear(4, 3)).to(dtype)


def _zero_steps(model, opt, steps: int, micro: int, rank: int,
                dtype: torch.dtype = torch.float32) -> list[dict]:
    """``steps`` steps of ``micro`` backwards each on this rank's (4, 5) batches; per step the
    losses, the optimizer's per-bucket state after backward, the collectives and parameters."""
    from minifsdp import comm

    out = []
    for step in range(steps):
        rec: dict = {"loss": []}
        with comm.logging_comm() as log:
            for m in range(micro):
                g = torch.Generator().manual_seed(100 * step + 10 * m + rank)
                x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
                loss = (model(x.to(dtype)) - y.to(dtype)).square().mean()
                loss.backward()
                rec["loss"].append(loss.detach().clone())
            if hasattr(opt, "buckets"):
                rec["freed"] = [b.grad is None for b in opt.buckets]
                rec["shard grads"] = [None if b.shard.grad is None else b.shard.grad.clone()
                                      for b in opt.buckets]
                rec["grad storage"] = [None if b.shard.grad is None
                                       else b.shard.grad.untyped_storage().nbytes()
                                       for b in opt.buckets]
            gathered_into: list[int] = []  # where each all-gather of the step writes
            real = comm.all_gather_into_tensor

            def spy(output, *args, into=gathered_into, real=real, **kwargs):
                into.append(output.untyped_storage().data_ptr())
                return real(output, *args, **kwargs)

            comm.all_gather_into_tensor = spy
            try:
                opt.step()
            finally:
                comm.all_gather_into_tensor = real
            if hasattr(opt, "buckets"):
                flats = {b.flat.untyped_storage().data_ptr() for b in opt.buckets}
                rec["into flat"] = [ptr in flats for ptr in gathered_into]
        rec["collectives"] = [f"{r.op} {tuple(r.shape)} {str(r.dtype).replace('torch.', '')}"
                              f" over {r.group_size} ranks" for r in log.comms()]
        opt.zero_grad(set_to_none=True)
        rec["params"] = [p.detach().clone() for p in model.parameters()]
        out.append(rec)
    return out


def _group_ranks(n: int) -> list[int]:
    """The group case's ranks: 1..N-1 at N >= 3 (opt.rank is never the global rank), all
    ranks as a group object at N = 2."""
    return list(range(1, n)) if n >= 3 else list(range(n))


def run_lab(t, info) -> None:
    """Lab 03's cases, each against the package's ZeroOptimizer: ZeRO-2 (three buckets,
    padding, a frozen layer) and ZeRO-1 with two backwards per step, both also against torch
    DDP at N = 2 (bitwise there: x * 0.5 + y * 0.5 == (x + y) / 2); last, ZeRO-2 in bf16 with
    two backwards per step over a process group of two ranks (ranks 1 and 2 at N = 3)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from minifsdp.labs import heartbeat, seams
    from minifsdp.zero import ZeroOptimizer, setup_zero

    n, r = info.world_size, info.rank

    class Reference(ZeroOptimizer):  # the package's own reduce and step: the oracle
        _reduce = seams.reference(REDUCE)
        step = seams.reference(STEP)

    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)
    ranks = _group_ranks(n)
    # stage, backwards per step, steps, dtype, over a group?
    cases = ((2, 1, 3, torch.float32, False), (1, 2, 2, torch.float32, False),
             (2, 2, 2, torch.bfloat16, True))
    for stage, micro, steps, dtype, grouped in cases:
        group = dist.new_group(ranks) if grouped else None  # every rank creates it
        if grouped and r not in ranks:  # rank 0 at N = 3: not in the group; wait for the
            heartbeat.set_timeout(120.0)  # members at the final barrier, however long they take
            continue
        title = f"ZeRO-{stage}, 3 buckets, {steps} AdamW steps" + (
            f", {micro} backwards per step" if micro > 1 else "") + (
            ", bf16" if dtype == torch.bfloat16 else "") + (
            f", over a process group of ranks {ranks}" if grouped else "")
        with t.case(title, (REDUCE, STEP)):
            model = _zero_model(dtype)
            ref = Reference(model.parameters(), adamw, stage, CAP_MB, group)
            want = _zero_steps(model, ref, steps, micro, r, dtype)
            ddp = None
            # torch is bitwise where 1/N is exact and the sums come in the same order: N = 2,
            # except ZeRO-2 accumulating (a sum of averages, where DDP averages a sum)
            if n == 2 and not grouped and (stage == 1 or micro == 1):
                model = DistributedDataParallel(_zero_model())
                ddp = _zero_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), steps,
                                  micro, r)
            model, opt = setup_zero(_zero_model(dtype), adamw, stage, CAP_MB, group)
            got = _zero_steps(model, opt, steps, micro, r, dtype)
            names = [nm for nm, _ in model.named_parameters()]
            for step, (g, w) in enumerate(zip(got, want)):
                for k, loss in enumerate(g["loss"]):
                    t.expect(f"loss of backward {k}", loss, w["loss"][k], step=step,
                             phase="forward")
                for i, (fg, fw) in enumerate(zip(g["freed"], w["freed"])):
                    t.expect(f"bucket {i}: {FREED}", fg, fw, step=step, phase="backward")
                for i, (sg, sw) in enumerate(zip(g["shard grads"], w["shard grads"])):
                    t.expect(f"bucket {i}: shard.grad", sg, sw, step=step, phase="backward")
                for i, (sg, sw) in enumerate(zip(g["grad storage"], w["grad storage"])):
                    t.expect(f"bucket {i}: {STORAGE}", sg, sw, step=step, phase="backward")
                t.expect(COLLECTIVES, g["collectives"], w["collectives"], step=step,
                         phase="backward and step")
                t.expect(INTO_FLAT, g["into flat"], w["into flat"], step=step, phase="step")
                for name, p, pw in zip(names, g["params"], w["params"]):
                    t.expect(name, p, pw, step=step, phase="optimizer step")
                if ddp:
                    for k, loss in enumerate(g["loss"]):
                        t.expect(f"loss of backward {k} (vs torch DDP)", loss,
                                 ddp[step]["loss"][k], step=step, phase="forward")
                    for name, p, pw in zip(names, g["params"], ddp[step]["params"]):
                        t.expect(f"{name} (vs torch DDP)", p, pw, step=step,
                                 phase="optimizer step")


def hint(name: str, got, expected, n: int) -> str | None:
    if name == INTO_FLAT:
        return ("all-gather straight into b.flat: the parameters are views of it, so that one "
                "collective updates them in place; a temporary and a copy add a bucket's bytes "
                "and a pass over them (Note [flat partition])")
    if name == COLLECTIVES and isinstance(got, list):
        ops = lambda xs: [x.split(" ")[0] for x in xs]
        if "all_reduce" in ops(got) and "all_reduce" not in ops(expected):
            return ("an all-reduce hands every rank the whole average: stage 1's traffic; stage 2 "
                    "reduce-scatters, so each rank receives only its slice (Note [ZeRO-1 traffic])")
        if ops(got).count("all_gather") < ops(expected).count("all_gather"):
            return ("fewer all-gathers: the slices other ranks stepped never reach your parameters "
                    "(Note [flat partition])")
        return "the same collectives on every rank, in bucket order, through minifsdp.comm"
    if name.endswith(FREED) and got is False:
        return ("stage 2 keeps only its slice: drop the bucket's full gradient once it is reduced "
                "(Note [ZeRO memory categories])")
    if name.endswith(STORAGE) and isinstance(got, int) and expected and got > expected:
        return (f"shard.grad is a view into {got} bytes where its slice needs {expected}: it "
                "keeps a bigger tensor alive (the full bucket gradient?); reduce-scatter into a "
                "tensor of the slice's size (Note [ZeRO memory categories])")
    if name.endswith("shard.grad") and isinstance(got, torch.Tensor) and n > 2 \
            and got.shape == expected.shape and torch.count_nonzero(expected) > 0 \
            and torch.allclose(got.double(), expected.double() * (n - 1) / n, rtol=1e-2,
                               atol=1e-6):
        return (f"yours = expected × {n - 1}/{n}: divided by {n}, the world's size, in a group "
                f"of {n - 1} ranks? opt.world_size and opt.group are the group's")
    if name.endswith("shard.grad") and got is None:
        return "no gradient on the shard: the inner optimizer skips it"
    return None


LAB = Lab(
    id="03",
    title="the ZeRO-2 step",
    skeleton="labs/lab03_zero.py",
    seams=(Seam(REDUCE, "minifsdp.zero", "ZeroOptimizer._reduce"),
           Seam(STEP, "minifsdp.zero", "ZeroOptimizer.step")),
    notes=("flat partition", "ZeRO-1 traffic", "ZeRO memory categories"),
    run=run_lab,
    hint=hint,
    oracle="the package's ZeroOptimizer (and torch DDP at N = 2)",
    hints=(
        "Stage 2 shards the gradients as well as the optimizer state: of a bucket's full "
        "gradient each rank needs only the average of its own slice, which one reduce-scatter "
        "delivers for half an all-reduce's bytes; after it the full gradient can go. The step "
        "updates each rank's slice, and one all-gather per bucket makes every rank's flat "
        "buffer whole again -- in place, since the parameters are views of it. Read Note [flat "
        "partition], Note [ZeRO-1 traffic] and Note [ZeRO memory categories] in "
        "minifsdp/zero.py.",
        "Per bucket: flat (N * shard_numel elements, the parameters' storage), shard (slice "
        "opt.rank of flat, what the inner optimizer steps), grad (the full flat gradient while "
        "backward fills it), shard.grad (what the inner optimizer reads). Invariants: shard.grad "
        "has the slice's shape and the bucket's dtype, its storage no bigger than the slice; "
        "several backwards before a step add up in shard.grad; b.grad is None once reduced; "
        "opt.rank, opt.world_size and opt.group -- never the default group or dist.get_rank() "
        "-- say who is who; every rank issues the same collectives in bucket order.",
        "reduce (stage 2): mine = new tensor of the slice's size and dtype, tagged 'grads'; "
        "reduce-scatter the average of b.grad into mine over opt.group; drop b.grad; "
        "shard.grad = mine if it was None, else shard.grad += mine. step: the inner optimizer "
        "steps every shard; then for each bucket in order: all-gather the shards over "
        "opt.group, with b.flat as the output and b.shard as the input.",
    ),
)
