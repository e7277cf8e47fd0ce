"""Chapter 02 (DDP): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_02.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check


def _bucket_cases():
    """Parameter lists (in ``model.parameters()`` order) and caps for the bucket exercises."""
    from minifsdp.models import MnistCNN

    e = torch.empty
    return [
        ([e(100), e(300), e(50)], 1000),                  # the docstring's example
        ([e(100), e(300), e(50)], 4000),                  # everything fits in one bucket
        ([e(10)] * 7, 80),                                # closes on *reaching* the cap
        ([e(1000), e(1), e(1), e(1000)], 100),            # a big tensor overshoots the cap
        ([e(8), e(8, dtype=torch.float64), e(8)], 10**6),  # a dtype change closes a bucket
        (list(MnistCNN().parameters()), 25 * 2**20),      # torch's default cap: one bucket
        (list(MnistCNN().parameters()), 2**20),
    ]


def check_assign_buckets(fn) -> bool:
    """``fn(params, cap_bytes)`` -> lists of parameter indices, one list per bucket, in the
    order backward fills them (``minifsdp.ddp.assign_buckets``, Note [buckets])."""
    from minifsdp.ddp import assign_buckets

    cases = [((ps, cap), assign_buckets(ps, cap)) for ps, cap in _bucket_cases()]
    return check("bucket assignment", cases, fn)


def ddp_step_comm(numels: list[int], world_size: int, cap_bytes: int) -> tuple[int, float]:
    """``(all-reduces per step, bytes one rank sends per step)`` for fp32 ``BucketedDDP``,
    counting wire bytes as ``minifsdp.comm`` does (2(N-1)/N of each bucket's bytes)."""
    from minifsdp.ddp import assign_buckets

    buckets = assign_buckets([torch.empty(n) for n in numels], cap_bytes)
    sent = sum(2 * (world_size - 1) / world_size * 4 * sum(numels[i] for i in b)
               for b in buckets)
    return len(buckets), sent


def check_ddp_step_comm(fn) -> bool:
    """``fn(numels, world_size, cap_bytes)`` -> ``(number of all-reduces, wire bytes sent by
    one rank)`` in one step of fp32 ``BucketedDDP`` (Notes [buckets] and [ring bytes])."""
    from minifsdp.models import GPT, GPTConfig, MnistCNN

    models = [MnistCNN(), GPT(GPTConfig(n_layer=4, d_model=128))]
    cases = []
    for m in models:
        numels = [p.numel() for p in m.parameters()]
        for n, cap in [(2, 25 * 2**20), (4, 2**20), (8, 2**18), (1, 2**20)]:
            cases.append(((numels, n, cap), ddp_step_comm(numels, n, cap)))
    close = lambda a, b: a[0] == b[0] and abs(a[1] - b[1]) <= 1e-9 * max(1.0, b[1])
    return check("DDP bytes per step", cases, fn, close=close)


def stalled_buckets(buckets: list[list[int]], used: set[int]) -> list[int]:
    """Buckets that cannot be all-reduced during backward when only ``used`` get gradients:
    the first bucket with a missing gradient never fills, and later ones wait behind it
    because buckets are launched in order (Notes [buckets] and [unused parameters])."""
    for k, b in enumerate(buckets):
        if any(i not in used for i in b):
            return list(range(k, len(buckets)))
    return []


def check_stalled_buckets(fn) -> bool:
    """``fn(buckets, used)`` -> indices of the buckets that backward cannot launch."""
    cases = [(([[3, 2], [1], [0]], {0, 1, 2, 3}), []),
             (([[3, 2], [1], [0]], {0, 1, 2}), [0, 1, 2]),
             (([[3, 2], [1], [0]], {1, 2, 3}), [2]),
             (([[5, 4], [3, 2], [1, 0]], {0, 1, 4, 5, 2}), [1, 2]),
             (([[7], [6, 5, 4], [3], [2, 1, 0]], {7, 6, 5, 4, 3, 2, 0}), [3]),
             (([[0]], set()), [0])]
    return check("stalled buckets", cases, fn)


# ---- lab 02: BucketedDDP's gradient hook and in-order bucket launch ---------------------------

HOOK, LAUNCH = "ddp.grad_hook", "ddp.launch"
ORDER = "bucket all-reduces, in issue order"
EARLY = "bucket all-reduces issued during backward"
WAITED = "bucket all-reduces waited for inside backward"


def _crossed_model(rank: int):
    """Parameters defined in one order, used in another: ``out`` comes first in
    ``parameters()`` but runs last, so its gradient arrives first while its bucket is the last
    to launch; ``a`` and ``b`` run in a rank-dependent order, so their gradients arrive in
    another order on each rank; ``frozen`` trains not (no slot, no bucket)."""
    import torch.nn as nn

    class Crossed(nn.Module):
        def __init__(self):
            super().__init__()
            self.out, self.inp = nn.Linear(6, 3), nn.Linear(5, 6)
            self.frozen = nn.Linear(6, 6).requires_grad_(False)
            self.a, self.b, self.mix = nn.Linear(6, 7, bias=False), nn.Linear(6, 7), nn.Linear(7, 6)

        def forward(self, x):
            h = self.frozen(torch.relu(self.inp(x)))
            z = self.a(h) + self.b(h) if rank % 2 == 0 else self.b(h) + self.a(h)
            return self.out(torch.tanh(self.mix(z)))

    torch.manual_seed(0)
    return Crossed()


def _ddp_steps(model, steps: int, rank: int, on_step=None) -> list[dict]:
    """``steps`` AdamW steps on this rank's (4, 5) batches; each step's loss, gradients and
    parameters. ``on_step(step, log, record)`` sees the step's comm log after backward."""
    from minifsdp import comm

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        with comm.logging_comm() as log:
            loss = (model(x) - y).square().mean()
            loss.backward()
        rec = {"loss": loss.detach().clone(),
               "grads": [p.grad.clone() for p in model.module.parameters() if p.requires_grad]}
        if on_step:
            on_step(step, log, rec)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["params"] = [p.detach().clone() for p in model.module.parameters()]
        out.append(rec)
    return out


def _branchy_model():
    """A branch ``extra`` that some steps use on some ranks only (Note [unused parameters])
    and a frozen layer (no slot, no bucket); built alike on every rank."""
    import torch.nn as nn

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.out, self.inp = nn.Linear(6, 3), nn.Linear(5, 6)
            self.extra = nn.Linear(6, 6)
            self.frozen = nn.Linear(6, 6).requires_grad_(False)
            self.mix = nn.Linear(6, 6)

        def forward(self, x, use_extra: bool):
            h = self.frozen(torch.relu(self.inp(x)))
            if use_extra:
                h = h + torch.tanh(self.extra(h))
            return self.out(torch.tanh(self.mix(h)))

    torch.manual_seed(0)
    return Branchy()


def _uses_extra(step: int, micro: int, group_rank: int) -> bool:
    """Step 0: everywhere. Step 1: in the no_sync backward everywhere, in the synced one on
    group rank 0 only (elsewhere its gradient was accumulated, not fresh). Step 2: only in
    group rank 0's synced backward (elsewhere it has no gradient at all)."""
    return step == 0 or (step == 1 and (micro == 0 or group_rank == 0)) or (
        step == 2 and micro == 1 and group_rank == 0)


def _accum_steps(model, steps: int, rank: int, group_rank: int, on_step=None) -> list[dict]:
    """``steps`` AdamW steps of two backwards each, the first under ``no_sync()``; each step's
    losses, gradients (None where the optimizer must skip) and parameters."""
    import contextlib

    from minifsdp import comm

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for step in range(steps):
        rec: dict = {"loss": []}
        for micro in range(2):
            g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            sync = contextlib.nullcontext() if micro else model.no_sync()
            with comm.logging_comm() as log:
                with sync:
                    loss = (model(x, _uses_extra(step, micro, group_rank)) - y).square().mean()
                loss.backward()
            rec["loss"].append(loss.detach().clone())
            rec.setdefault("logs", []).append(log)
        rec["grads"] = [None if p.grad is None else p.grad.clone()
                        for p in model.module.parameters() if p.requires_grad]
        if on_step:
            on_step(step, rec)
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec["params"] = [p.detach().clone() for p in model.module.parameters()]
        out.append(rec)
    return out


def _group_ranks(n: int) -> list[int]:
    """The group case's ranks: 1..N-1 at N >= 3 (a group smaller than the world, whose rank 0
    is global rank 1), all ranks as a group object at N = 2."""
    return list(range(1, n)) if n >= 3 else list(range(n))


def run_lab(t, info) -> None:
    """Lab 02's cases: the crossed model, one parameter per bucket (torch DDP is bitwise at
    every N) and several per bucket (torch at N = 2, the package's BucketedDDP at N = 3); then
    gradient accumulation under no_sync with a branch some ranks skip
    (find_unused_parameters=True) over a process group of 2 ranks, against torch DDP."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from minifsdp.ddp import FINAL_SPAN, BucketedDDP
    from minifsdp.labs import heartbeat, seams

    n, r = info.world_size, info.rank

    class Reference(BucketedDDP):  # the package's own hook and launch: the oracle at N = 3
        _on_grad_ready = seams.reference(HOOK)
        _launch_ready_buckets = seams.reference(LAUNCH)

    cases = [("one parameter per bucket", 1e-9, "torch"),
             ("several parameters per bucket", 4e-4, "torch" if n == 2 else "reference")]
    for title, cap, oracle in cases:
        vs = "torch DDP" if oracle == "torch" else "the package's BucketedDDP"
        with t.case(f"{title}, 3 AdamW steps vs {vs}", (HOOK, LAUNCH)):
            if oracle == "torch":  # bucket_cap_mb_list: torch's buckets = ours from step 0 on
                k = sum(p.requires_grad for p in _crossed_model(r).parameters())
                kwargs = ({"bucket_cap_mb_list": [cap] * k} if cap < 1e-6
                          else {"bucket_cap_mb": cap})
                want = _ddp_steps(DistributedDataParallel(_crossed_model(r), **kwargs), 3, r)
            else:
                want = _ddp_steps(Reference(_crossed_model(r), bucket_cap_mb=cap), 3, r)
            ours = BucketedDDP(_crossed_model(r), bucket_cap_mb=cap)
            n_buckets = len(ours.buckets)
            names = [nm for nm, p in ours.module.named_parameters() if p.requires_grad]

            def after_backward(step, log, rec, n_buckets=n_buckets, want=want, names=names):
                t.expect("loss", rec["loss"], want[step]["loss"], step=step, phase="forward")
                final = [x for x in log.records if x.kind == "compute" and x.op == FINAL_SPAN]
                end = final[0].t_start if final else float("inf")
                ars = log.comms("all_reduce")
                t.expect(ORDER, [x.tag for x in ars], [f"bucket {k}" for k in range(n_buckets)],
                         step=step, phase="backward")
                t.expect(EARLY, sum(x.t_start < end for x in ars), n_buckets, step=step,
                         phase="backward")
                t.expect(WAITED, sum(x.t_wait is not None and x.t_wait < end for x in ars), 0,
                         step=step, phase="backward")
                for name, got, exp in zip(names, rec["grads"], want[step]["grads"]):
                    t.expect(f"{name}.grad", got, exp, step=step, phase="backward")

            got = _ddp_steps(ours, 3, r, after_backward)
            all_names = [nm for nm, _ in ours.module.named_parameters()]
            for step, rec in enumerate(got):
                for name, p, exp in zip(all_names, rec["params"], want[step]["params"]):
                    t.expect(name, p, exp, step=step, phase="optimizer step")

    ranks = _group_ranks(n)
    group = dist.new_group(ranks)  # every rank takes part in creating it
    if r not in ranks:  # rank 0 at N = 3: not in the group; wait for the members at the
        heartbeat.set_timeout(120.0)  # final barrier, however long a loaded machine makes them
        return
    g_rank, cap = ranks.index(r), 4e-4
    with t.case(f"no_sync + a synced backward per step, an unused branch, over a process "
                f"group of ranks {ranks}, 3 AdamW steps vs torch DDP", (HOOK, LAUNCH)):
        want = _accum_steps(DistributedDataParallel(
            _branchy_model(), process_group=group, find_unused_parameters=True,
            bucket_cap_mb=cap), 3, r, g_rank)
        ours = BucketedDDP(_branchy_model(), bucket_cap_mb=cap, find_unused_parameters=True,
                           process_group=group)
        n_buckets = len(ours.buckets)
        names = [nm for nm, p in ours.module.named_parameters() if p.requires_grad]

        def after_step(step, rec, n_buckets=n_buckets, want=want, names=names):
            for k, loss in enumerate(rec["loss"]):
                t.expect(f"loss of backward {k}", loss, want[step]["loss"][k], step=step,
                         phase="forward")
            t.expect(f"{ORDER} (backward 0, under no_sync)",
                     [x.tag for x in rec["logs"][0].comms()], [], step=step, phase="backward")
            t.expect(f"{ORDER} (backward 1)",
                     [x.tag for x in rec["logs"][1].comms("all_reduce")],
                     [f"bucket {k}" for k in range(n_buckets)], step=step, phase="backward")
            for name, got, exp in zip(names, rec["grads"], want[step]["grads"]):
                if got is None or exp is None:
                    t.expect(f"{name}.grad is None", got is None, exp is None, step=step,
                             phase="backward")
                else:
                    t.expect(f"{name}.grad", got, exp, step=step, phase="backward")

        got = _accum_steps(ours, 3, r, g_rank, after_step)
        all_names = [nm for nm, _ in ours.module.named_parameters()]
        for step, rec in enumerate(got):
            for name, p, exp in zip(all_names, rec["params"], want[step]["params"]):
                t.expect(name, p, exp, step=step, phase="optimizer step")


def hint(name: str, got, expected, n: int) -> str | None:
    if name.startswith(ORDER) and not expected and got:
        return ("all-reduces inside no_sync(): those gradients must only accumulate in .grad "
                "(Note [no_sync])")
    if name.startswith(ORDER) and sorted(got) == sorted(expected):
        return ("every bucket started, in another order: ranks match collectives by their order "
                "of issue, so buckets start strictly 0, 1, 2, ... (Note [buckets])")
    if name == EARLY and isinstance(got, int):
        return (f"{expected - got} bucket(s) started only in the final callback: a bucket must "
                "start as soon as its last gradient arrives (Note [buckets])")
    if name == WAITED and isinstance(got, int):
        return ("waiting in the hook stalls backward until the all-reduce is done, so nothing "
                "overlaps; the final callback waits (Notes [buckets], [when backward ends])")
    if name.endswith(".grad") and isinstance(got, torch.Tensor) and n > 2 \
            and torch.allclose(got, expected * (n - 1) / n, rtol=1e-4, atol=1e-7) \
            and torch.count_nonzero(expected) > 0:
        return (f"yours = expected × {n - 1}/{n}: scaled by 1/{n}, the world's size, in a group "
                f"of {n - 1} ranks? ddp.world_size and ddp.process_group are the group's")
    if name.endswith(".grad") and isinstance(got, torch.Tensor) and n > 2 \
            and torch.allclose(got, expected, rtol=1e-5, atol=1e-7):
        return ("last-bit differences at N = 3: g / 3 and g * (1/3), or dividing after the sum, "
                "round differently; torch multiplies by 1/N first (Note [divide first])")
    return None


LAB = Lab(
    id="02",
    title="DDP gradient hook and in-order buckets",
    skeleton="labs/lab02_ddp.py",
    seams=(Seam(HOOK, "minifsdp.ddp", "BucketedDDP._on_grad_ready"),
           Seam(LAUNCH, "minifsdp.ddp", "BucketedDDP._launch_ready_buckets")),
    notes=("buckets", "divide first", "when backward ends", "no_sync", "unused parameters"),
    run=run_lab,
    hint=hint,
    oracle="torch DDP",
    hints=(
        "Backward produces gradients last layer first. Each arriving gradient is scaled by 1/N "
        "and copied into its bucket; a bucket whose gradients have all arrived is all-reduced "
        "at once, asynchronously, while backward goes on -- but only after every earlier "
        "bucket, because ranks pair collectives by their order of issue. Read Note [buckets], "
        "Note [divide first], Note [when backward ends] and Note [unused parameters] in "
        "minifsdp/ddp.py.",
        "Per bucket: buffer (the flat gradients), pending (how many gradients are still to "
        "come in this backward), work (its all-reduce, None until started). Per parameter: "
        "ddp._slot[i] = (bucket, view into bucket.buffer). Per backward: ddp._next_bucket, the "
        "first bucket not started. Invariants: buckets 0 .. _next_bucket-1 have started, in "
        "order, once each; a bucket may start when its pending is 0 and all earlier ones have "
        "started; the final callback fills missing gradients and counts them in pending too, so "
        "pending -- not who called the hook -- is what says a bucket is full.",
        "hook: (bucket, view) = slot of i; view <- grad scaled by 1/N as torch does (one "
        "multiplication, out= the view); bucket.pending -= 1; launch(). launch: while "
        "_next_bucket < number of buckets: b = buckets[_next_bucket]; if b still waits for a "
        "gradient: stop; start b's all-reduce over ddp.process_group without waiting, tagged "
        "'bucket k'; _next_bucket += 1.",
    ),
)
