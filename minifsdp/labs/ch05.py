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


# ---- lab 05: FSDP2's unshard and reshard, copy-out and copy-in ---------------------------------

from minifsdp.labs.report import _generic_hint  # noqa: E402
from minifsdp.labs.seams import Lab, Seam  # noqa: E402
from minifsdp.labs.uninitialized import NaNForEmpty  # noqa: E402

LAB_STEPS = 3
COPY_OUT, COPY_IN = "fsdp2.all_gather_copy_out", "fsdp2.reduce_scatter_copy_in"
UNSHARD, WAIT, RESHARD = "fsdp2.unshard", "fsdp2.wait_for_unshard", "fsdp2.reshard"
ALL_SEAMS = (UNSHARD, WAIT, RESHARD, COPY_OUT, COPY_IN)


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
                   memory: bool = False, no_sync: bool = False) -> dict:
    """``LAB_STEPS`` Adam steps of ``lab_net`` with our ``fully_shard`` and torch's (same units,
    same ``MixedPrecisionPolicy(**policy)``), comparing per step: the unsharded weights each
    Linear sees in forward, the loss, ``on_backward(t, step, log, model)`` (our comm log and
    model), the gradients and the parameters (as full tensors). ``micro`` backwards (one
    micro-batch each) accumulate before each step, all but the last without gradient sync
    with ``no_sync``. With ``memory``: the unsharded parameters' storage must be 0 bytes after
    forward (non-root groups) and after backward (all groups); so must every all-gather buffer
    and slot the copy-ins made, and every reduced slot ``to_sharded_grads`` cast up (Note
    [freeing with resize_]). Returns our model."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minifsdp import fsdp2
    from minifsdp.fsdp2 import reduce
    from minifsdp.fsdp2.fsdp_param_group import FSDPParamGroup

    n = info.world_size
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

    gathered: list[torch.Tensor] = []  # every all-gather buffer and slot since the last check
    now = {"step": 0}

    def capture(copy_in):
        def wrapped(self):
            my_slot, buffer = copy_in(self)
            gathered.extend((my_slot, buffer))
            return my_slot, buffer
        return wrapped

    def freeing(to_shards):
        def wrapped(group, params, out):
            to_shards(group, params, out)
            if out.dtype != group.dtypes.orig:
                dt = str(out.dtype).removeprefix("torch.")
                t.expect(f"group {group.name}: bytes behind the reduced {dt} slot after "
                         "to_sharded_grads", out.untyped_storage().nbytes(), 0,
                         step=now["step"], phase="backward")
        return wrapped

    def storage_freed(when: str, step: int, phase: str, which) -> None:
        for gname in which:
            got = sum(_unsharded_bytes(p) for p in groups[gname].fsdp_params)
            t.expect(f"group {gname}: unsharded parameter bytes {when}", got, 0, step=step,
                     phase=phase)
        t.expect(f"all-gather buffers and slots: bytes {when}",
                 sum(x.untyped_storage().nbytes() for x in gathered), 0, step=step, phase=phase)
        gathered.clear()

    spied = [(FSDPParamGroup, name, capture) for name in ("_all_gather_copy_in",
                                                          "_post_forward_copy_in")]
    spied.append((reduce, "to_sharded_grads", freeing))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in spied]
    if memory:
        for owner, name, spy in spied:
            setattr(owner, name, spy(getattr(owner, name)))
    try:
        _steps(t, info, models, opts, seen, groups, on_backward, micro, memory, no_sync,
               storage_freed, now)
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
    return models["ours"]


def _steps(t, info, models, opts, seen, groups, on_backward, micro, memory, no_sync,
           storage_freed, now) -> None:
    """``train_vs_torch``'s loop: ``LAB_STEPS`` steps of ``micro`` micro-batches each."""
    import torch.nn.functional as F

    from minifsdp import comm

    n, r = info.world_size, info.rank
    for step in range(LAB_STEPS):
        now["step"] = step
        with comm.logging_comm() as log:
            for k in range(micro):
                if no_sync:
                    for m in models.values():
                        m.set_requires_gradient_sync(k == micro - 1)
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


def _held_bytes(tensors) -> int:
    return sum(x.untyped_storage().nbytes() for x in tensors)


def _unshard_reshard_cases(t, group, key: str, names, full: dict, one_rank) -> None:
    """The reader's unshard, wait_for_unshard and reshard on one group, called as the hooks
    and prefetching call them: blocking; again while unsharded; issued, then waited; dropped
    in flight by a reshard; and (``one_rank``: a process group of this rank alone) from the
    piece a ``reshard_after_forward=k`` group keeps after forward, with k = 1. The expected
    values are the parameters of a fresh ``layout_net`` (``full``); the expected collectives,
    states, owners and bytes come from the contract, never from the run. Every gathered
    buffer the copy-in makes is held here, so a buffer left allocated shows whoever else
    holds it."""
    from minifsdp import comm
    from minifsdp.fsdp2.fsdp_param_group import FSDPParamGroup, ShardedState
    from minifsdp.fsdp2.hsdp import PostForwardInfo

    params = group.fsdp_params
    elt = torch.empty(0, dtype=params[0].unsharded_dtype).element_size()
    slot_bytes = elt * sum(p.padded_shard_numel for p in params)
    gather_tag = f"fsdp2 params {group.name}"
    buffers: list[torch.Tensor] = []  # every all-gather buffer of this case

    def capture(copy_in):
        def wrapped(self):
            my_slot, gathered = copy_in(self)
            buffers.append(gathered)
            return my_slot, gathered
        return wrapped

    def expect_gathers(what: str, log, want: list) -> None:
        got = [(r.op, r.tag, r.group_size, r.bytes) for r in log.comms()]
        t.expect(f"{key}: the collectives of {what} (op, tag, ranks, input bytes)", got, want,
                 phase="unshard")

    def expect_state(what: str, state, in_flight: bool) -> None:
        phase = "reshard" if "reshard" in what else "unshard"
        t.expect(f"{key}: sharded_state after {what}", group.sharded_state.name, state.name,
                 phase=phase)
        t.expect(f"{key}: an all-gather in flight after {what}", group._in_flight is not None,
                 in_flight, phase=phase)

    def expect_owners(what: str, unsharded: bool, held=None) -> None:
        phase = "reshard" if "reshard" in what else "unshard"
        for i, p in enumerate(params):
            name = names[id(p.sharded_param)]
            want = p.unsharded_param if unsharded else p.sharded_param
            which = "unsharded parameter" if unsharded else "sharded DTensor"
            holds = all(getattr(m, attr) is want for m, attr in p.owners)
            t.expect(f"{name}: its module holds the {which} after {what}", holds, True,
                     phase=phase)
            if held is not None:
                t.expect(f"{name}: the same unsharded tensor object after {what} (autograd "
                         "saved it)", p.unsharded_param is held[i], True, phase=phase)
            if unsharded:
                t.expect(f"{name}, unsharded after {what}", p.unsharded_param.detach(),
                         full[name], phase=phase)

    def expect_freed(what: str, tensors, thing: str) -> None:
        t.expect(f"{key}: bytes behind {thing} after {what}", _held_bytes(tensors), 0,
                 phase="reshard" if "reshard" in what else "unshard")

    # over one rank nothing is issued: the copy-in already filled the buffer (Note [a shard
    # group of one rank])
    one_gather = ([("all_gather", gather_tag, group.world_size, slot_bytes)]
                  if group.world_size > 1 else [])
    originals = {name: getattr(FSDPParamGroup, name)
                 for name in ("_all_gather_copy_in", "_post_forward_copy_in")}
    for name, copy_in in originals.items():
        setattr(FSDPParamGroup, name, capture(copy_in))
    try:
        with comm.logging_comm() as log:
            group.unshard()
        what = "unshard()"
        expect_gathers(what, log, one_gather)
        expect_state(what, ShardedState.UNSHARDED, False)
        expect_owners(what, True)
        expect_freed(what, buffers, "the all-gather buffer")
        held = [p.unsharded_param for p in params]
        unsharded_bytes = sum(elt * group.world_size * p.padded_shard_numel for p in params)
        t.expect(f"{key}: bytes behind the unsharded parameters after {what}",
                 _held_bytes(held), unsharded_bytes, phase="unshard")
        with comm.logging_comm() as log:
            group.unshard()
        expect_gathers("unshard() while unsharded", log, [])
        group.reshard()
        what = "reshard()"
        expect_state(what, ShardedState.SHARDED, False)
        expect_owners(what, False, held)
        expect_freed(what, held, "the unsharded parameters")
        group.reshard()
        expect_state("reshard() while sharded", ShardedState.SHARDED, False)

        with comm.logging_comm() as log:
            group.unshard(async_op=True)
            group.unshard(async_op=True)
        what = "unshard(async_op=True), twice"
        expect_gathers(what, log, one_gather)
        expect_state(what, ShardedState.SHARDED, True)
        expect_owners(what, False)
        group.wait_for_unshard()
        what = "unshard(async_op=True), then wait_for_unshard()"
        expect_state(what, ShardedState.UNSHARDED, False)
        expect_owners(what, True, held)
        expect_freed(what, buffers, "the all-gather buffers")
        group.wait_for_unshard()
        expect_state("wait_for_unshard() with nothing in flight", ShardedState.UNSHARDED, False)
        group.reshard()
        expect_freed("reshard()", held, "the unsharded parameters")

        group.unshard(async_op=True)
        group.reshard()
        what = "unshard(async_op=True), then reshard() (the all-gather dropped)"
        expect_state(what, ShardedState.SHARDED, False)
        expect_owners(what, False, held)
        expect_freed(what, buffers, "the all-gather buffers")
        expect_freed(what, held, "the unsharded parameters")

        if one_rank is None or not _all_ranks_matched(t):  # a wrong state crashes the rest
            return
        # reshard_after_forward=k with k = 1: the piece is the whole padded buffer, and a
        # "gather" over this rank alone is no collective at all (Note [reshard to k ranks],
        # Note [a shard group of one rank])
        group.post_forward_ranks = PostForwardInfo(one_rank, 0, 1)
        for reshard_after in (False, True):
            group.unshard()
            group._reshard_post_forward()  # given: keep the piece, register the shards
            piece = group._post_forward_data
            if reshard_after:
                group.reshard()
                what = "reshard() from SHARDED_POST_FORWARD"
                t.expect(f"{key}: the piece kept for k ranks is dropped by {what}",
                         group._post_forward_data is None, True, phase="reshard")
                expect_state(what, ShardedState.SHARDED, False)
                expect_owners(what, False, held)
                expect_freed(what, held, "the unsharded parameters")
                continue
            with comm.logging_comm() as log:
                group.unshard()
            what = "unshard() from SHARDED_POST_FORWARD (k = 1)"
            expect_gathers(what, log, [])
            expect_state(what, ShardedState.UNSHARDED, False)
            expect_owners(what, True, held)
            t.expect(f"{key}: the piece kept for k ranks is dropped by {what}",
                     group._post_forward_data is None and piece is not None, True,
                     phase="unshard")
            expect_freed(what, buffers, "the all-gather buffers")
            group.reshard()
    finally:
        for name, copy_in in originals.items():
            setattr(FSDPParamGroup, name, copy_in)
        group.post_forward_ranks = None
        if group._in_flight is None and group.sharded_state is not ShardedState.SHARDED:
            group.reshard()


def _all_ranks_matched(t) -> bool:
    """Whether no rank has diverged yet; every rank gets the same answer, so all stop or all
    go on together (a later case's crash would otherwise hide the first divergence)."""
    import torch.distributed as dist

    flag = torch.tensor([0.0 if t.first is None else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


UNSHARD_CASE = ("unshard and reshard of one group (blocking, issued then waited, dropped in "
                "flight, from a piece kept for k ranks)")


def run_lab(t, info) -> None:
    """Lab 05's cases, on every rank: one group's copy-out (N slots and 1, fp32 and bf16), its
    unshard and reshard (``_unshard_reshard_cases``) and its copy-in (fp32, a bf16 reduce
    dtype, a shard group of one rank) against the Note's layout and the package's reference,
    then three training steps of two micro-batches each against
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
    nets["fp32"][1].bias.requires_grad_(False)  # a frozen parameter is unsharded all the same
    names = {id(p): name for net in nets.values() for name, p in net.named_parameters()}
    with t.case("copy-out of one group (7 and 10 rows; N slots and 1; fp32 and bf16)",
                (COPY_OUT,)):
        for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            _copy_out_cases(t, nets[key].fsdp_state.group, names, n, dtype)
    with t.case(UNSHARD_CASE, (UNSHARD, WAIT, RESHARD, COPY_OUT)):
        full = {key: dict(layout_net(dtype).named_parameters())
                for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16),
                                   ("shard group of 1 rank", torch.float32))}
        for key in nets:
            if not _all_ranks_matched(t):
                break
            _unshard_reshard_cases(
                t, nets[key].fsdp_state.group, key, names,
                {k: v.detach() for k, v in full[key].items()},
                hsdp.get_group(1) if key != "shard group of 1 rank" else None)
    with t.case("copy-in of one group (7 and 10 rows; fp32, a bf16 reduce dtype, a shard "
                "group of 1 rank)", (COPY_IN,)):
        # last: only the second parameter has a gradient (the first frozen, or unused this
        # backward): foreach_reduce passes those with one, and the slot is theirs alone
        for key, dtype, first in (("fp32", torch.float32, 0), ("fp32", torch.bfloat16, 0),
                                  ("shard group of 1 rank", torch.float32, 0),
                                  ("fp32", torch.float32, 1)):
            group = nets[key].fsdp_state.group
            params = group.fsdp_params[first:]
            g = torch.Generator().manual_seed(7 + info.rank)
            grads = [torch.randn(p.orig_size, generator=g) for p in params]
            want = seams.reference(COPY_IN)(group, params, [x.clone() for x in grads], dtype)
            with NaNForEmpty():  # padding left unwritten shows as NaN, not as luck's zeros
                got = reduce.reduce_scatter_copy_in(group, params, [x.clone() for x in grads],
                                                    dtype)
            dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
            t.expect(f"reduce-scatter input ({group.world_size} slots, padding zero, {dt}"
                     + (f", {key}" if key != "fp32" else "")
                     + (f", only {len(params)} of {len(group.fsdp_params)} parameters with a "
                        "gradient" if first else "") + ")", got, want, phase="copy-in")
    if not _all_ranks_matched(t):  # training on a wrong layout would crash, hiding the cause
        return
    with t.case("3 Adam steps of 2 micro-batches against torch's fully_shard (3 groups, "
                "uneven rows)", ALL_SEAMS):
        train_vs_torch(t, info, micro=2, memory=True)


def hint(name: str, got, expected, n: int) -> str | None:
    if "(op, tag, ranks, input bytes)" in name:
        return ("unshard issues one all-gather per call that finds the group neither unsharded "
                "nor in flight, none otherwise; from SHARDED_POST_FORWARD it gathers the kept "
                "piece over the k ranks of group.post_forward_ranks, not the shards over all N; "
                "over a group of one rank it issues none at all (Note [issue and wait] in "
                "prefetch.py, Note [reshard to k ranks] in hsdp.py, Note [a shard group of one "
                "rank] in fsdp_param_group.py)")
    if "sharded_state after" in name and expected == "UNSHARDED":
        return ("wait_for_unshard finishes an unshard: once the modules hold the gathered "
                "parameters the group is UNSHARDED, and nothing is in flight any more (Note "
                "[issue and wait])")
    if "sharded_state after" in name or "in flight after" in name:
        return ("unshard(async_op=True) only issues: the group stays SHARDED, its all-gather in "
                "group._in_flight, until wait_for_unshard finishes it; reshard leaves SHARDED "
                "with nothing in flight, whatever it found: an all-gather in flight is waited "
                "for and dropped (Note [issue and wait])")
    if "its module holds" in name or "same unsharded tensor object" in name:
        return ("register on every (module, name) in p.owners; the unsharded parameter is one "
                "tensor object for the group's whole life, given its bytes back by "
                "alloc_unsharded and freed by resize_(0), never replaced: autograd saved it in "
                "forward (Note [freeing with resize_])")
    if name.endswith("after unshard()") and "unsharded parameters" in name:
        return ("the unsharded buffers hold N padded shards each (Note [padding])")
    if name.startswith("all-gather buffers and slots"):
        return ("an unshard is finished only once its all-gather buffer is freed with "
                "resize_(0), the slot with it (a view of it): dropping references leaves the "
                "bytes to gloo's thread (Note [freeing with resize_])")
    if "bytes behind" in name:
        return ("free storage, not references: untyped_storage().resize_(0) frees the bytes "
                "under every view of them, including the tensors autograd saved and the one "
                "gloo may still hold (Note [freeing with resize_])")
    if "piece kept for k ranks" in name:
        return ("the piece kept after forward (group._post_forward_data) is needed only by the "
                "next unshard: drop it once it is gathered, or when a reshard comes first (Note "
                "[reshard to k ranks])")
    if "parameters with a gradient" in name:
        return ("lay out the parameters you are given (params, with grads), not all of the "
                "group's: a frozen parameter, or one unused in this backward, has no gradient "
                "and no place in the slot (FSDPParamGroup.post_backward passes only those with "
                "one)")
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
        if name.endswith(")") and "after" in name:
            return ("the module computes with what the copy-out wrote: gather, wait, copy out, "
                    "then register (Note [issue and wait], Note [copy-in and copy-out])")
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
    title="FSDP2's unshard and reshard, copy-out and copy-in",
    skeleton="labs/lab05_fsdp2.py",
    seams=(Seam(UNSHARD, "minifsdp.fsdp2.fsdp_param_group", "FSDPParamGroup.unshard",
                "unshard"),
           Seam(WAIT, "minifsdp.fsdp2.fsdp_param_group", "FSDPParamGroup.wait_for_unshard",
                "wait_for_unshard"),
           Seam(RESHARD, "minifsdp.fsdp2.fsdp_param_group", "FSDPParamGroup.reshard",
                "reshard"),
           Seam(COPY_OUT, "minifsdp.fsdp2.fsdp_param_group",
                "FSDPParamGroup._all_gather_copy_out", "all_gather_copy_out"),
           Seam(COPY_IN, "minifsdp.fsdp2.reduce", "reduce_scatter_copy_in",
                "reduce_scatter_copy_in")),
    notes=("copy-in and copy-out", "padding", "dim-0 chunks", "version counter",
           "freeing with resize_", "issue and wait", "reshard to k ranks",
           "a shard group of one rank"),
    run=run_lab,
    hint=hint,
    oracle="torch's fully_shard (and the package's layouts)",
    hints=(
        "A group lives in two states. Unsharded: one all-gather of every parameter's padded "
        "shard, in one buffer, then each parameter's N pieces copied out of that rank-major "
        "buffer into its own piece-major buffer, and the modules switched to those full "
        "tensors. Sharded again: the modules switched back to the DTensors and the full "
        "tensors' bytes given back -- the bytes, not the tensors, which autograd holds. "
        "Issuing and finishing an all-gather are two calls, so that a prefetch can put one on "
        "the wire early. The copy-in of the gradients is the copy-out backwards, with zero "
        "padding. Read Note [copy-in and copy-out], Note [freeing with resize_], Note [issue "
        "and wait] (prefetch.py), Note [reshard to k ranks] (hsdp.py), then Note [padding], "
        "Note [dim-0 chunks] (fsdp_param.py) and Note [version counter].",
        "unshard: nothing to do while group.sharded_state is UNSHARDED or group._in_flight is "
        "set; else pick the copy-in and the process group by the state (the kept piece over "
        "post_forward_ranks' k ranks in SHARDED_POST_FORWARD, else the shards over all N), "
        "issue one tagged all-gather with async_op as given -- none when that group is one "
        "rank: the copy-in already filled the buffer -- remember (work, gathered, world) "
        "in _in_flight (work None if nothing was issued), and finish at once unless "
        "async_op. wait_for_unshard: nothing in flight, nothing to do; else wait on the work "
        "if there is one, copy out with the world "
        "it was gathered over, resize the buffer's storage to 0, forget the kept piece, put "
        "p.unsharded_param on every owner, set UNSHARDED, clear _in_flight. reshard: drop "
        "what is in flight and the kept piece; if UNSHARDED, put p.sharded_param on every "
        "owner and resize each p._unsharded_data's storage to 0; set SHARDED. Copy-out: "
        "gathered viewed as (world, S); parameter i owns the same column block of every row, "
        "w_i = p.padded_shard_numel * N / world wide, and p.alloc_unsharded() viewed as "
        "(world, w_i) receives exactly that block, in place, the version counter unchanged. "
        "Copy-in: a fresh 1-D (N * S,) tensor in `dtype`, N = group.world_size; slot r = for "
        "each parameter, chunk r of its gradient (torch.chunk on dim 0, maybe short or "
        "empty), flattened, then zeros up to p.padded_shard_numel.",
        "unshard: if UNSHARDED or in flight: return. if SHARDED_POST_FORWARD: (slot, buf) = "
        "post-forward copy-in; pg, world = post_forward_ranks' group and size; else: (slot, "
        "buf) = _all_gather_copy_in(); pg, world = process_group, world_size. work = None "
        "if world == 1 else all_gather_into_tensor(buf, slot, pg, async_op, tag); "
        "_in_flight = (work, buf, "
        "world); if not async_op: wait_for_unshard(). wait: if nothing in flight: return; "
        "(work, buf, world) = _in_flight; work.wait() if work; copy-out(buf, world); free "
        "buf's storage; piece = None; for p, for (m, name) in p.owners: setattr(m, name, "
        "p.unsharded_param); state, _in_flight = UNSHARDED, None. reshard: discard_unshard(); "
        "piece = None; if UNSHARDED: setattr the sharded_param on every owner, free each "
        "_unsharded_data's storage; state = SHARDED. Copy-out: bufs = [alloc_unsharded(p) as "
        "(world, -1)]; under preserve-version-counter(bufs): split gathered as (world, -1) "
        "along dim 1 by the bufs' widths, copy block i into bufs[i]. Copy-in: flat = zeros "
        "(N * S,) in dtype; for r: offset = 0; for p, g: c = chunk_dim0(g, N)[r] flattened; "
        "slot r[offset : offset + len(c)] = c; offset += p.padded_shard_numel. (One torch call "
        "can do each copy's loops: see the torch ops the Note names.)",
    ),
)
