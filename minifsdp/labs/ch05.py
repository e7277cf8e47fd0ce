"""Chapter 05 (FSDP2's per-parameter sharding): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_05.py`` checks that every checker
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


def layout_net(dtype: torch.dtype = torch.float32):
    """One group whose row counts tell splits apart: 7 and 10 rows (3k + 1: at N = 3
    ``torch.chunk`` gives 3, 3, 1 and 4, 4, 2 rows, ``torch.tensor_split`` 3, 2, 2 and 4, 3, 3)
    and 1 row (empty shards at N = 2 and 3)."""
    import torch.nn as nn

    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 7), nn.Linear(7, 10), nn.Linear(10, 1)).to(dtype)


def _unsharded_bytes(p) -> int:
    """Bytes behind the unsharded parameter that autograd saves (0 once resharded)."""
    return 0 if p.unsharded_param is None else p.unsharded_param.untyped_storage().nbytes()


def train_vs_torch(t, info, policy: dict | None = None, on_backward=None, *, micro: int = 1,
                   memory: bool = False) -> dict:
    """``LAB_STEPS`` Adam steps of ``lab_net`` with our ``fully_shard`` and torch's (same units,
    same ``MixedPrecisionPolicy(**policy)``), comparing per step: the unsharded weights each
    Linear sees in forward, the loss, ``on_backward(t, step, log, model)`` (our comm log and
    model), the gradients and the parameters (as full tensors). ``micro`` backwards (one
    micro-batch each) accumulate before each step; with ``memory`` the unsharded parameters'
    storage must be 0 bytes after forward (non-root groups) and after backward (all groups).
    Returns our model."""
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
    groups = {name or "(root)": mod.fsdp_state.group
              for name, mod in models["ours"].named_modules() if hasattr(mod, "fsdp_state")}

    def storage_freed(when: str, step: int, phase: str, which) -> None:
        for gname in which:
            got = sum(_unsharded_bytes(p) for p in groups[gname].fsdp_params)
            t.expect(f"group {gname}: unsharded parameter bytes {when}", got, 0, step=step,
                     phase=phase)

    for step in range(LAB_STEPS):
        with comm.logging_comm() as log:
            for k in range(micro):
                g = torch.Generator().manual_seed(100 + micro * step + k)
                x, y = torch.randn(n * 4, 8, generator=g), torch.randint(0, 3, (n * 4,),
                                                                         generator=g)
                x, y = x.chunk(n)[r], y.chunk(n)[r]
                loss = F.cross_entropy(models["ours"](x), y)
                if memory:
                    storage_freed("after forward", step, "forward",
                                  [gname for gname in groups if gname != "(root)"])
                loss.backward()
                if memory:
                    storage_freed("after backward", step, "backward", groups)
                theirs = F.cross_entropy(models["torch"](x), y)
                theirs.backward()
                for name in seen["torch"]:
                    t.expect(f"{name}.weight, unsharded", seen["ours"].get(name),
                             seen["torch"][name], step=step, phase="forward")
                t.expect("loss" if micro == 1 else f"loss of micro-batch {k}", loss.detach(),
                         theirs.detach(), step=step, phase="forward")
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


def _gathered(world: int, slot: int, dtype: torch.dtype) -> torch.Tensor:
    """An all-gather buffer of ``world`` slots: in fp32 every element says where it sits (rank
    r's slot holds r * 1000 + index), in bf16 (too few bits for that) seeded random values."""
    if dtype == torch.float32:
        return (torch.arange(world).repeat_interleave(slot) * 1000
                + torch.arange(slot).repeat(world)).float()
    return torch.randn(world * slot, generator=torch.Generator().manual_seed(world)).to(dtype)


def _copy_out_cases(t, group, names, n: int, dtype: torch.dtype) -> None:
    """The reader's copy-out from a buffer of N slots, then of 1 (``reshard_after_forward=k``
    with k = 1 ranks: each slot holds N pieces of every parameter). The expected parameters
    come from Note [copy-in and copy-out]'s rule in storage of their own, and the unsharded
    buffers are filled with NaN first, so a copy-out must write every element it owns."""
    dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    for world in (n, 1):
        pieces = [p.padded_shard_numel * n // world for p in group.fsdp_params]
        gathered = _gathered(world, sum(pieces), dtype)
        rows = gathered.view(world, -1).split(pieces, dim=1)
        want = [piece.reshape(-1)[: math.prod(p.orig_size)].view(p.orig_size).clone()
                for p, piece in zip(group.fsdp_params, rows)]
        for p in group.fsdp_params:
            p.alloc_unsharded().fill_(float("nan"))
        versions = [p.unsharded_param._version for p in group.fsdp_params]
        buffers = [p._unsharded_data.untyped_storage().data_ptr() for p in group.fsdp_params]
        group._all_gather_copy_out(gathered, world)
        what = f"{world}-rank buffer, {dt}" + (" (reshard_after_forward=k)" if world != n else "")
        for p, w, v, b in zip(group.fsdp_params, want, versions, buffers):
            name = names[id(p.sharded_param)]
            t.expect(f"{name}, unsharded from a {what}", p.unsharded_param.detach(), w,
                     phase="copy-out")
            t.expect(f"{name}: the unsharded parameter still views its own buffer ({what})",
                     p.unsharded_param.untyped_storage().data_ptr() == b, True, phase="copy-out")
            t.expect(f"{name}: version counter unchanged by the copy-out ({what})",
                     p.unsharded_param._version, v, phase="copy-out")
        for p in group.fsdp_params:
            p.free_unsharded()


def _all_ranks_matched(t) -> bool:
    """Whether no rank has diverged yet; every rank gets the same answer, so all stop or all
    go on together (a later case's crash would otherwise hide the first divergence)."""
    import torch.distributed as dist

    flag = torch.tensor([0.0 if t.first is None else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def run_lab(t, info) -> None:
    """Lab 05's cases, on every rank: one group's copy-out (N slots and 1, fp32 and bf16) and
    copy-in (fp32, a bf16 reduce dtype, a shard group of one rank) against the Note's layout and
    the package's reference, then three training steps of two micro-batches each against
    torch's ``fully_shard``."""
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp import fsdp2
    from minifsdp.fsdp2 import reduce
    from minifsdp.labs import seams

    n = info.world_size
    mesh = init_device_mesh(info.device.type, (n,))
    hsdp = init_device_mesh(info.device.type, (n, 1), mesh_dim_names=("replicate", "shard"))
    nets = {}
    for key, dtype, m in (("fp32", torch.float32, mesh), ("bf16", torch.bfloat16, mesh),
                          ("shard group of 1 rank", torch.float32, hsdp)):
        nets[key] = layout_net(dtype)
        fsdp2.fully_shard(nets[key], mesh=m)
    names = {id(p): name for net in nets.values() for name, p in net.named_parameters()}
    with t.case("copy-out of one group (7 and 10 rows; N slots and 1; fp32 and bf16)",
                (COPY_OUT,)):
        for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            _copy_out_cases(t, nets[key].fsdp_state.group, names, n, dtype)
    with t.case("copy-in of one group (7 and 10 rows; fp32, a bf16 reduce dtype, a shard "
                "group of 1 rank)", (COPY_IN,)):
        for key, dtype in (("fp32", torch.float32), ("fp32", torch.bfloat16),
                           ("shard group of 1 rank", torch.float32)):
            group = nets[key].fsdp_state.group
            g = torch.Generator().manual_seed(7 + info.rank)
            grads = [torch.randn(p.orig_size, generator=g) for p in group.fsdp_params]
            want = seams.reference(COPY_IN)(group, group.fsdp_params,
                                            [x.clone() for x in grads], dtype)
            got = reduce.reduce_scatter_copy_in(group, group.fsdp_params,
                                                [x.clone() for x in grads], dtype)
            dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
            t.expect(f"reduce-scatter input ({group.world_size} slots, padding zero, {dt}"
                     + (f", {key}" if key != "fp32" else "") + ")", got, want, phase="copy-in")
    if not _all_ranks_matched(t):  # training on a wrong layout would crash, hiding the cause
        return
    with t.case("3 Adam steps of 2 micro-batches against torch's fully_shard (3 groups, "
                "uneven rows)", (COPY_OUT, COPY_IN)):
        train_vs_torch(t, info, micro=2, memory=True)


def hint(name: str, got, expected, n: int) -> str | None:
    if "version counter" in name:
        return ("the copy-out wrote into tensors autograd saved in forward and let their version "
                "counter move: backward would refuse them (Note [version counter])")
    if "views its own buffer" in name or "parameter bytes" in name:
        return ("the unsharded parameter must keep viewing the same storage (alloc_unsharded), "
                "written in place: only then does reshard's resize_(0) free what autograd "
                "holds (Note [freeing with resize_])")
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    if ", unsharded" in name:
        if got.dtype.is_floating_point and torch.isnan(got.double()).any():
            return ("yours still holds the NaN the checker put there: the copy-out never wrote "
                    "these elements into the unsharded buffer (Note [copy-in and copy-out])")
        if "reshard_after_forward" in name:
            return ("the buffer has `world` rows (k after reshard_after_forward=k), not "
                    "group.world_size: each row then holds N / k pieces of every parameter "
                    "(Note [copy-in and copy-out], Note [reshard to k ranks])")
        return ("the all-gather buffer is rank-major: row r of gathered.view(world, -1) is rank "
                "r's slot, and parameter i is column block i of every row (Note [copy-in and "
                "copy-out])")
    if name.startswith("reduce-scatter input") or name.endswith(".grad"):
        return _generic_hint(got, expected, n) or (
            "slot r must hold chunk r (torch.chunk on dim 0) of every gradient, each zero-padded "
            "to its padded shard size (Note [copy-in and copy-out], Note [padding], Note "
            "[dim-0 chunks])")
    return None


LAB = Lab(
    id="05",
    title="FSDP2's copy-out and copy-in",
    skeleton="labs/lab05_fsdp2.py",
    seams=(Seam(COPY_OUT, "minifsdp.fsdp2.fsdp_param_group",
                "FSDPParamGroup._all_gather_copy_out", "all_gather_copy_out"),
           Seam(COPY_IN, "minifsdp.fsdp2.reduce", "reduce_scatter_copy_in",
                "reduce_scatter_copy_in")),
    notes=("copy-in and copy-out", "padding", "dim-0 chunks", "version counter",
           "freeing with resize_"),
    run=run_lab,
    hint=hint,
    oracle="torch's fully_shard (and the package's layouts)",
    hints=(
        "Both functions only move bytes between two layouts of the same numbers. The all-gather "
        "concatenates the ranks' slots, so its buffer is rank-major; each parameter's unsharded "
        "buffer is piece-major (its N padded pieces, in rank order). The copy-in is the same "
        "move backwards, with zero padding. Read Note [copy-in and copy-out], Note [padding] "
        "and Note [dim-0 chunks] (fsdp_param.py), then Note [freeing with resize_] and Note "
        "[version counter] (fsdp_param_group.py).",
        "Copy-out: gathered viewed as (world, S) -- world rows, S the slot; parameter i owns "
        "the same column block [o_i, o_i + w_i) of every row, w_i = p.padded_shard_numel * "
        "N / world, and p.alloc_unsharded() viewed as (world, w_i) receives exactly that block. "
        "Invariants: written in place into alloc_unsharded()'s storage (the same every step), "
        "the version counter unchanged, nothing kept of gathered. Copy-in: a fresh 1-D "
        "(N * S,) tensor in `dtype`, N = group.world_size (the shard group, not the world); "
        "slot r = for each parameter, chunk r of its gradient (torch.chunk on dim 0, possibly "
        "short or empty), flattened, then zeros up to p.padded_shard_numel.",
        "Copy-out: bufs = [alloc_unsharded(p) as (world, -1) for p]; under "
        "preserve-version-counter(bufs): split gathered as (world, -1) along dim 1 by the "
        "bufs' widths, copy block i into bufs[i]. Copy-in: flat = new zeros (N * S,) in dtype; "
        "for r in 0..N-1: offset = 0; for p, g: c = chunk_dim0(g, N)[r] flattened; "
        "slot r[offset : offset + len(c)] = c; offset += p.padded_shard_numel; return flat. "
        "(One torch call can do each loop: see the torch ops the Note names.)",
    ),
)
