"""Chapter 05 (FSDP2's per-parameter sharding): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import math

import torch

from minifsdp.notebook import check

FSDP2_SHAPES = [  # (shapes, world sizes) the checkers try: uneven rows, fewer rows than ranks
    ([(7, 10), (7,), (3, 7), (3,)], (1, 2, 3, 4)),
    ([(512, 256), (32, 256), (256,), (768, 256), (1024, 256), (256, 1024)], (2, 3, 4, 8)),
    ([(1,), (2, 5), (10, 8)], (3, 4)),
]


def dim0_rows(d0: int, world_size: int) -> list[int]:
    from minifsdp.fsdp2 import chunk_dim0

    return [c.shape[0] for c in chunk_dim0(torch.empty(d0, 0), world_size)]


def check_dim0_rows(fn) -> bool:
    """``fn(d0, world_size)`` -> rows each rank holds of a ``d0``-row parameter under FSDP2
    (``minifsdp.fsdp2.chunk_dim0``: ``torch.chunk``, then empty shards)."""
    cases = [((d0, n), dim0_rows(d0, n))
             for d0, n in [(10, 4), (12, 4), (2, 3), (5, 4), (1, 8), (7, 3), (1024, 3), (9, 1)]]
    return check("dim-0 rows", cases, fn)


def fsdp2_rest_bytes(shapes: list[tuple], world_size: int, rank: int) -> int:
    """Bytes one rank holds between FSDP2 steps with fp32 Adam(W): padded shards (4 B per
    element of chunk 0's size), ``exp_avg`` + ``exp_avg_sq`` of its own rows, one 4-byte step
    per parameter."""
    total = 0
    for shape in shapes:
        rest = math.prod(shape[1:])
        rows = dim0_rows(shape[0], world_size)
        total += 4 * rows[0] * rest + 8 * rows[rank] * rest + 4
    return total


def check_fsdp2_rest_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, rank)`` -> model-state bytes of ``rank`` at rest under FSDP2
    with fp32 Adam. ``measured``: ``((shapes, n, rank), bytes)`` from real runs."""
    cases = [((shapes, n, r), fsdp2_rest_bytes(shapes, n, r))
             for shapes, ns in FSDP2_SHAPES for n in ns for r in range(n)]
    return check("FSDP2 bytes at rest", [*cases, *(measured or [])], fn)


def fsdp2_group_wire_bytes(shapes: list[tuple], world_size: int,
                           reshard_after_forward: bool) -> float:
    """Bytes one rank sends per fp32 step for one FSDP2 group: the all-gather buffer is N padded
    shards; forward all-gather, a second one for backward if resharded, one reduce-scatter."""
    n = world_size
    buffer = 4 * n * sum(dim0_rows(s[0], n)[0] * math.prod(s[1:]) for s in shapes)
    return (3 if reshard_after_forward else 2) * (n - 1) / n * buffer


def check_fsdp2_group_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, reshard_after_forward)`` -> wire bytes one rank sends per step
    for one group. ``measured``: ``((shapes, n, reshard), bytes)`` from real runs."""
    cases = [((shapes, n, raf), fsdp2_group_wire_bytes(shapes, n, raf))
             for shapes, ns in FSDP2_SHAPES for n in ns for raf in (True, False)]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("FSDP2 group bytes per step", [*cases, *(measured or [])], fn, close=close)


# ---- lab 05: FSDP2's copy-out and copy-in ------------------------------------------------------

from minifsdp.labs.report import _generic_hint  # noqa: E402
from minifsdp.labs.seams import Lab, Seam  # noqa: E402

LAB_STEPS = 3
COPY_OUT, COPY_IN = "fsdp2.all_gather_copy_out", "fsdp2.reduce_scatter_copy_in"


def lab_net():
    """``(B, 8) -> (B, 3)``, seeded. Units: ``body`` = Linear(8, 6), Tanh, Linear(6, 5) (5 rows:
    3 + 2 at N = 2, 2 + 2 + 1 at N = 3) and ``narrow`` = Linear(5, 2) (2 rows: an empty shard
    at N = 3); the root keeps ``head`` = Linear(2, 3) and ``scale`` (1 element)."""
    import torch.nn as nn

    class LabNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 5))
            self.narrow = nn.Linear(5, 2)
            self.head = nn.Linear(2, 3)
            self.scale = nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.head(torch.tanh(self.narrow(torch.tanh(self.body(x))))) * self.scale

    torch.manual_seed(0)
    return LabNet()


def train_vs_torch(t, info, policy: dict | None = None, on_backward=None) -> dict:
    """``LAB_STEPS`` Adam steps of ``lab_net`` with our ``fully_shard`` and torch's (same units,
    same ``MixedPrecisionPolicy(**policy)``), comparing per step: the unsharded weights each
    Linear sees in forward, the loss, ``on_backward(t, step, log, model)``
    (our comm log and model), the
    gradients and the parameters (as full tensors). Returns our model."""
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minifsdp import comm, fsdp2

    n, r = info.world_size, info.rank
    mesh = init_device_mesh(info.device.type, (n,))
    models, opts, seen = {}, {}, {}
    for impl, shard, cls in (("ours", fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy),
                             ("torch", torch_fully_shard, TorchPolicy)):
        m = lab_net()
        kw = {} if policy is None else {"mp_policy": cls(**policy)}
        for unit in (m.body, m.narrow, m):
            shard(unit, mesh=mesh, **kw)
        seen[impl] = {}
        for name, mod in m.named_modules():
            if isinstance(mod, nn.Linear):
                mod.register_forward_pre_hook(
                    lambda mod, args, name=name, d=seen[impl]: d.__setitem__(
                        name, mod.weight.detach().clone()))
        models[impl], opts[impl] = m, torch.optim.Adam(m.parameters(), lr=1e-2)
    for step in range(LAB_STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(n * 4, 8, generator=g), torch.randint(0, 3, (n * 4,), generator=g)
        x, y = x.chunk(n)[r], y.chunk(n)[r]
        losses = {}
        with comm.logging_comm() as log:
            losses["ours"] = F.cross_entropy(models["ours"](x), y)
            losses["ours"].backward()
        losses["torch"] = F.cross_entropy(models["torch"](x), y)
        losses["torch"].backward()
        for name in seen["torch"]:
            t.expect(f"{name}.weight, unsharded", seen["ours"].get(name), seen["torch"][name],
                     step=step, phase="forward")
        t.expect("loss", losses["ours"].detach(), losses["torch"].detach(), step=step,
                 phase="forward")
        if on_backward is not None:
            on_backward(t, step, log, models["ours"])
        ours, theirs = (dict(models[k].named_parameters()) for k in ("ours", "torch"))
        for name, p in theirs.items():
            got = ours[name].grad
            t.expect(f"{name}.grad", None if got is None else got.full_tensor(),
                     p.grad.full_tensor(), step=step, phase="backward")
        for k in ("ours", "torch"):
            opts[k].step()
            opts[k].zero_grad()
        for name, p in theirs.items():
            t.expect(name, ours[name].detach().full_tensor(), p.detach().full_tensor(),
                     step=step, phase="optimizer step")
    return models["ours"]


def run_lab(t, info) -> None:
    """Lab 05's cases, on every rank: one group's layouts against the package's reference,
    then three training steps against torch's ``fully_shard``."""
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp import fsdp2
    from minifsdp.fsdp2 import reduce
    from minifsdp.labs import seams

    n = info.world_size
    with t.case("copy-out and copy-in of one group (uneven rows, an empty shard at N = 3)",
                (COPY_OUT, COPY_IN)):
        m = lab_net()
        fsdp2.fully_shard(m, mesh=init_device_mesh(info.device.type, (n,)))
        group = m.fsdp_state.group
        slot = sum(p.padded_shard_numel for p in group.fsdp_params)
        # a buffer whose every element says where it sits: rank r's slot holds r * 1000 + i
        gathered = (torch.arange(n).repeat_interleave(slot) * 1000
                    + torch.arange(slot).repeat(n)).float()
        seams.reference(COPY_OUT)(group, gathered, n)
        want = [p.unsharded_param.detach().clone() for p in group.fsdp_params]
        group._all_gather_copy_out(gathered, n)
        names = {id(p): name for name, p in m.named_parameters()}
        for p, w in zip(group.fsdp_params, want):
            t.expect(f"{names[id(p.sharded_param)]}, unsharded (element = rank * 1000 + index "
                     "in the slot)", p.unsharded_param.detach(), w, phase="copy-out")
        g = torch.Generator().manual_seed(7 + info.rank)
        grads = [torch.randn(p.orig_size, generator=g) for p in group.fsdp_params]
        want = seams.reference(COPY_IN)(group, group.fsdp_params, list(grads), torch.float32)
        got = reduce.reduce_scatter_copy_in(group, group.fsdp_params, list(grads),
                                            torch.float32)
        t.expect("reduce-scatter input (N slots, padding zero)", got, want, phase="copy-in")
        group.reshard()
    with t.case("3 Adam steps against torch's fully_shard (3 groups, uneven rows)",
                (COPY_OUT, COPY_IN)):
        train_vs_torch(t, info)


def hint(name: str, got, expected, n: int) -> str | None:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    if name.endswith("unsharded") or "unsharded (" in name:
        return ("the all-gather buffer is rank-major: row r of gathered.view(world, -1) is rank "
                "r's slot, and parameter i is column block i of every row (Note [copy-in and "
                "copy-out])")
    if name.startswith("reduce-scatter input") or name.endswith(".grad"):
        return _generic_hint(got, expected, n) or (
            "slot r must hold chunk r of every gradient, each zero-padded to its padded shard "
            "size (Note [copy-in and copy-out], Note [padding])")
    return None


LAB = Lab(
    id="05",
    title="FSDP2's copy-out and copy-in",
    skeleton="labs/lab05_fsdp2.py",
    seams=(Seam(COPY_OUT, "minifsdp.fsdp2.fsdp_param_group",
                "FSDPParamGroup._all_gather_copy_out", "all_gather_copy_out"),
           Seam(COPY_IN, "minifsdp.fsdp2.reduce", "reduce_scatter_copy_in",
                "reduce_scatter_copy_in")),
    notes=("copy-in and copy-out", "padding", "dim-0 chunks", "version counter"),
    run=run_lab,
    hint=hint,
    oracle="torch's fully_shard (and the package's layouts)",
)
