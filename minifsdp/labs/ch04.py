"""Chapter 04 (FSDP1's FlatParameter): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_04.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.labs.ch05 import _all_ranks_matched
from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check


def check_flat_layout(fn) -> bool:
    """``fn(numels, world_size, align)`` -> ``(offsets, padded_numel)``: each parameter starts
    at a multiple of ``align`` elements, the total is padded to a multiple of ``world_size``
    (``minifsdp.fsdp1.flat_param.flat_layout``, Note [flat layout])."""
    from minifsdp.fsdp1.flat_param import flat_layout

    layouts = [([70, 7, 21, 3], 3, 4), ([70, 7, 21, 3], 1, 4), ([5], 4, 1), ([8, 8], 2, 4),
               ([1, 1, 1], 2, 4), ([288, 32, 18432, 64], 4, 4), ([3, 5, 7], 8, 2), ([0, 4], 2, 4)]
    return check("flat layout", [(args, flat_layout(*args)) for args in layouts], fn)


def check_size_wrap(fn) -> bool:
    """``fn(model, min_num_params)`` -> names of the units that a size-based auto-wrap policy
    picks, children before parents (``minifsdp.fsdp1.wrap.plan_units``, Note [policy contract]): a
    module becomes a unit when the elements of it that no unit below took are at least
    ``min_num_params``; a ``ModuleList``/``ModuleDict`` is never a unit, nor is the root."""
    from minifsdp.fsdp1.wrap import plan_units, size_based_auto_wrap_policy
    from minifsdp.models import GPT, GPTConfig, MnistCNN

    nested = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(30, 30), torch.nn.ReLU(),
                                                     torch.nn.Linear(30, 2)),
                                 torch.nn.Linear(2, 40), torch.nn.Linear(40, 40))
    cases = []
    for model, sizes in [(MnistCNN(), (100, 20_000, 1_000_000, 2_000_000)),
                         (GPT(GPTConfig()), (1_000, 10_000, 20_000)),
                         (nested, (100, 1_000, 1_500, 3_000))]:
        for n in sizes:
            plan = plan_units(model, size_based_auto_wrap_policy(n))
            cases.append(((model, n), [name for name, _ in plan]))
    return check("size-based wrap", cases, fn)


def fsdp1_step_wire_bytes(padded_numels: list[int], n: int, strategy: str) -> float:
    """Bytes one rank sends per fp32 step of ``minifsdp.fsdp1`` (``minifsdp.comm``'s
    accounting). ``padded_numels``: each unit's flat parameter, padded; the *last* is the root."""
    ag = rs = lambda numel: (n - 1) / n * 4 * numel
    if strategy == "no_shard":
        return sum(2 * (n - 1) / n * 4 * p for p in padded_numels)
    forward = sum(ag(p) for p in padded_numels)
    # FULL_SHARD frees every unit but the root after forward, so gathers them again
    backward = sum(ag(p) for p in padded_numels[:-1]) if strategy == "full_shard" else 0.0
    return forward + backward + sum(rs(p) for p in padded_numels)


def check_fsdp1_step_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(padded_numels, n, strategy)`` -> wire bytes one rank sends per step, ``strategy``
    one of ``full_shard``, ``shard_grad_op``, ``no_shard`` (Note [sharding strategies]).
    ``measured``: ``((padded_numels, n, strategy), bytes)`` from real runs."""
    cases = [((units, n, st), fsdp1_step_wire_bytes(units, n, st))
             for units in ([1_199_884], [18_752, 1_179_776, 1_396], [8_448, 8_448, 12_544])
             for n in (1, 2, 4) for st in ("full_shard", "shard_grad_op", "no_shard")]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("FSDP1 bytes per step", [*cases, *(measured or [])], fn, close=close)


# ---- lab 04: the FlatParameter (flatten, align, pad, shard; views; free) -----------------------

LAYOUT, SHARD, VIEWS, RESHARD = ("flat_param.layout", "flat_param.shard", "flat_param.views",
                                 "flat_param.reshard")
UNSHARD, REDUCE = "flat_param.unshard", "flat_param.reduce_scatter"
COLLECTIVES = "collectives of the step (op, tag, input shape, dtype, group size)"
# fp16 values whose sum over N ranks overflows (> 65504) unless each is first divided by the
# pre-division factor; every partial sum is exact (Note [divide before and after])
FP16_NEAR_MAX = {2: 32768.0, 3: 24576.0}


def _lab_mlp() -> torch.nn.Module:
    """Odd sizes: 16-byte alignment pads between parameters, and neither unit's total is a
    multiple of 3, so the last rank holds padding at N = 3 (Note [flat layout])."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.Tanh(), torch.nn.Linear(65, 10),
                               torch.nn.LogSoftmax(1))


def _torch_layout(fp, rank: int, n: int) -> tuple[int, torch.Tensor]:
    """torch FSDP1's padded numel and this rank's padding mask (its padding holds 42s)."""
    pads = [torch.full((k,), bool(p)) for k, p in zip(fp._numels_with_padding,
                                                        fp._is_padding_mask)]
    mask = torch.cat(pads)
    total = -(-mask.numel() // n) * n
    mask = torch.cat([mask, torch.ones(total - mask.numel(), dtype=torch.bool)])
    s = total // n
    return total, mask[rank * s:(rank + 1) * s]


def _view_bytes(h) -> int:
    """Bytes behind the tensors the modules (and autograd, which saved them) hold."""
    return sum(getattr(i.module, i.name).untyped_storage().nbytes() for i in h.infos)


def _no_shard_and_subgroup(t, info) -> None:
    """A NO_SHARD unit computes on its FlatParameter, so reshard must free nothing; a bf16 unit
    (16-byte alignment = 8 elements) sharded over a process group of one rank -- its own, not
    the default group -- against torch FSDP1 on the same group."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from minifsdp.fsdp1.flat_param import FlatParamHandle, registered_params

    n, r = info.world_size, info.rank
    torch.manual_seed(2)
    lin = torch.nn.Linear(5, 3)
    want = [p.detach().clone() for p in lin.parameters()]
    h = FlatParamHandle(registered_params(lin), rank=r, world_size=n, sharded=False)
    if t.expect("NO_SHARD unit: FlatParameter bytes after reshard",
                h.flat_param.untyped_storage().nbytes(), h.padded_numel * 4):
        for name, w in zip(("weight", "bias"), want):  # (freed, reading them would crash)
            t.expect(f"NO_SHARD unit: {name} (values)", getattr(lin, name).detach(), w)
    groups = [dist.new_group([i]) for i in range(n)]  # every rank creates every group
    mine = groups[r]
    torch.manual_seed(3)
    base = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 3)).to(torch.bfloat16)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    h = FlatParamHandle(registered_params(ours), rank=dist.get_rank(mine),
                        world_size=dist.get_world_size(mine), process_group=mine)
    fp = TorchFSDP(theirs, process_group=mine, device_id=info.device,
                   use_orig_params=True)._handle.flat_param
    total, mask = _torch_layout(fp, 0, 1)
    t.expect("bf16 unit on a group of one rank: padded numel", h.padded_numel, total)
    if not t.expect("bf16 unit on a group of one rank: shard (padding zeroed)",
                    h.flat_param.detach(), fp.detach().masked_fill(mask, 0.0)):
        return  # a shard of the wrong size cannot be all-gathered (this group is this rank's)
    h.unshard()
    h.use_unsharded_views()
    for i in h.infos:
        t.expect(f"bf16 unit on a group of one rank: {i.fqn} (values)",
                 getattr(i.module, i.name).detach(), base.get_parameter(i.fqn).detach())
    h.reshard()
    t.expect("bf16 unit on a group of one rank: storage bytes behind the modules' views after "
             "reshard", _view_bytes(h), 0)


def run_lab(t, info) -> None:
    """Lab 04's cases, on every rank: our FSDP1 and torch FSDP1 wrap the same MLP (two units);
    the shards, the views, the freed storage and three Adam steps are compared."""
    import copy
    import functools

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import wrap

    from minifsdp import comm, fsdp1
    from minifsdp.train import loss_fn

    n, r, dev = info.world_size, info.rank, info.device
    base = _lab_mlp()
    ours_m, theirs_m = copy.deepcopy(base), copy.deepcopy(base)
    with t.case("flatten, align, pad and shard each unit", (LAYOUT, SHARD, RESHARD)):
        ours = fsdp1.FullyShardedDataParallel(
            ours_m, device_id=dev, auto_wrap_policy=fsdp1.size_based_auto_wrap_policy(1000))
        theirs = TorchFSDP(theirs_m, device_id=dev, use_orig_params=True, auto_wrap_policy=(
            functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=1000)))
        units = [u for u in ours.modules() if isinstance(u, fsdp1.FullyShardedDataParallel)]
        masks = []
        for u, tu in zip(units, TorchFSDP.fsdp_modules(theirs)):
            h, fp = u._handle, tu._handle.flat_param
            total, mask = _torch_layout(fp, r, n)
            masks.append(mask)
            t.expect(f"unit {u._name}: padded numel", h.padded_numel, total)
            t.expect(f"unit {u._name}: shard numel", h.flat_param.numel(), fp.numel())
            t.expect(f"unit {u._name}: shard (padding zeroed)", h.flat_param.detach(),
                     fp.detach().masked_fill(mask, 0.0))
            t.expect(f"unit {u._name}: unsharded storage bytes after construction",
                     h._buffer.untyped_storage().size(), 0)
            t.expect(f"unit {u._name}: storage bytes behind the modules' views after "
                     "construction", _view_bytes(h), 0)
        # A layout whose shards are not N equal parts cannot be all-gathered: every rank
        # agrees on that first and stops here, in lockstep, with the divergence above.
        equal = torch.tensor([float(all(u._handle.flat_param.numel() * n == u._handle.padded_numel
                                        for u in units))])
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    if not equal.item():
        return
    with t.case("unshard: the original names are views of the gathered flat tensor",
                (UNSHARD, VIEWS, RESHARD)):
        for u, mask in zip(units, masks):
            h = u._handle
            stale = [getattr(i.module, i.name) for i in h.infos]  # views of the freed storage
            version = h.unsharded._version
            with comm.logging_comm() as log:
                h.unshard(f"lab {u._name}")
                h.unshard(f"lab {u._name} again")  # already unsharded: nothing to do
            t.expect(f"unit {u._name}: version counter of handle.unsharded (and of the views "
                     "autograd saved) after unshard", h.unsharded._version, version)
            t.expect(f"unit {u._name}: collectives of two unshard() calls (op, tag, input shape, "
                     "dtype, group size)", _collectives(log),
                     [("all_gather", f"lab {u._name}", (int(mask.numel()),), "float32", n)])
            t.expect(f"unit {u._name}: is_unsharded after unshard", h.is_unsharded, True)
            t.expect(f"unit {u._name}: unsharded storage bytes after unshard",
                     h._buffer.untyped_storage().nbytes(), 4 * h.padded_numel)
            readable = [t.expect(f"unit {u._name}: {i.fqn}, through the view made before the "
                                 "free: storage bytes after unshard",
                                 old.untyped_storage().nbytes(), 4 * h.padded_numel)
                        for i, old in zip(h.infos, stale)]  # (else reading it would crash)
            h.use_unsharded_views()
            for info_ in h.infos:
                view = getattr(info_.module, info_.name)
                name = f"unit {u._name}: {info_.fqn}"
                t.expect(f"{name} (values)", view.detach(), base.get_parameter(
                    f"{u._name}.{info_.fqn}" if u._name != "(root)" else info_.fqn).detach())
                ptr = h.unsharded.untyped_storage().data_ptr()
                t.expect(f"{name} shares the unsharded storage",
                         view.untyped_storage().data_ptr() == ptr, True)
                t.expect(f"{name} is made by autograd from the unsharded flat tensor",
                         view.grad_fn is not None, True)
            for info_, old, ok in zip(h.infos, stale, readable):  # what backward's saved views see
                if ok:
                    t.expect(f"unit {u._name}: {info_.fqn}, through the view made before the "
                             "free (values)", old.detach(), base.get_parameter(
                                 f"{u._name}.{info_.fqn}" if u._name != "(root)"
                                 else info_.fqn).detach())
            h.reshard()
            t.expect(f"unit {u._name}: unsharded storage bytes after reshard",
                     h._buffer.untyped_storage().size(), 0)
            t.expect(f"unit {u._name}: storage bytes behind the modules' views after reshard",
                     _view_bytes(h), 0)
        _no_shard_mixed(t, info)
    with t.case("NO_SHARD keeps its bytes; a bf16 unit on a process group of one rank",
                (LAYOUT, SHARD, VIEWS, RESHARD)):
        _no_shard_and_subgroup(t, info)
    if not _all_ranks_matched(t):  # training on a wrong layout would crash, hiding the cause
        return
    with t.case("reduce-scatter of a flat gradient: integers in fp32, fp16 near overflow, "
                "NO_SHARD, a process group of one rank", (REDUCE,)):
        _reduce_cases(t, info)
    if not _all_ranks_matched(t):
        return
    with t.case("three Adam steps of 2 micro-batches against torch FSDP1 (FULL_SHARD, 2 units)",
                (UNSHARD, VIEWS, RESHARD, REDUCE)):
        opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (ours, theirs)]
        torch_units = TorchFSDP.fsdp_modules(theirs)
        for step in range(3):
            with comm.logging_comm() as log:
                for k in range(2):  # two backwards accumulate before each step
                    g = torch.Generator().manual_seed(2 * step + k)
                    x = torch.randn(4 * n, 33, generator=g)
                    y = torch.randint(0, 10, (4 * n,), generator=g)
                    # an input that needs its gradient makes unit 0 save its weight, as every
                    # unit but the first does: the views backward's all-gather must not touch
                    x, y = x.chunk(n)[r].requires_grad_(), y.chunk(n)[r]
                    losses = [loss_fn(m(x), y) for m in (ours, theirs)]
                    t.expect(f"loss of micro-batch {k}", losses[0].detach(), losses[1].detach(),
                             step=step, phase="forward")
                    for u in units[1:]:  # FULL_SHARD frees every unit but the root after forward
                        t.expect(f"unit {u._name}: unsharded storage bytes after forward",
                                 u._handle._buffer.untyped_storage().size(), 0, step=step,
                                 phase="forward")
                        t.expect(f"unit {u._name}: storage bytes behind the modules' views "
                                 "after forward", _view_bytes(u._handle), 0, step=step,
                                 phase="forward")
                    for loss in losses:
                        loss.backward()
            t.expect(COLLECTIVES, _collectives(log), _step_collectives(units, masks, n),
                     step=step, phase="backward")
            for u, tu, mask in zip(units, torch_units, masks):
                want = tu._handle.flat_param.grad
                got = u._handle.flat_param.grad
                t.expect(f"unit {u._name}: the FlatParameter has a gradient", got is not None,
                         True, step=step, phase="backward")
                if got is not None:  # torch's is never None here: a crash if it were
                    t.expect(f"unit {u._name}: shard gradient (padding zeroed)", got,
                             want.masked_fill(mask, 0.0), step=step, phase="backward")
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            for u, tu, mask in zip(units, torch_units, masks):
                t.expect(f"unit {u._name}: shard after the step", u._handle.flat_param.detach(),
                         tu._handle.flat_param.detach().masked_fill(mask, 0.0), step=step,
                         phase="optimizer")
                t.expect(f"unit {u._name}: unsharded storage bytes after the step",
                         u._handle._buffer.untyped_storage().size(), 0, step=step,
                         phase="optimizer")


def _collectives(log) -> list[tuple]:
    """The log's collectives as sorted ``(op, tag, input shape, dtype, group size)``."""
    return sorted((c.op, c.tag, tuple(c.shape), c.dtype, c.group_size) for c in log.comms())


def _step_collectives(units, masks, n: int) -> list[tuple]:
    """What one step of 2 micro-batches must issue, from torch's layout (``masks``: each unit's
    padded numel / N) and Note [sharding strategies]: per micro-batch, each unit all-gathered in
    forward, the units but the root again in backward (FULL_SHARD frees them after forward), and
    each unit's flat gradient reduce-scattered once -- never the run's own log."""
    want = []
    for u, mask in zip(units, masks):
        shard, padded = int(mask.numel()), int(mask.numel()) * n
        want.append(("all_gather", f"{u._name} forward", (shard,), "float32", n))
        if u is not units[0]:  # units[0] is the root
            want.append(("all_gather", f"{u._name} backward", (shard,), "float32", n))
        want.append(("reduce_scatter", f"{u._name} grad", (padded,), "float32", n))
    return sorted(want * 2)


def _no_shard_mixed(t, info) -> None:
    """A NO_SHARD unit under mixed precision owns a bf16 buffer: unshard is a cast copy of the
    FlatParameter into it, with no collective (nothing is sharded)."""
    from minifsdp import comm
    from minifsdp.fsdp1.flat_param import FlatParamHandle, registered_params

    torch.manual_seed(4)
    lin = torch.nn.Linear(5, 3)
    want = {name: p.detach().to(torch.bfloat16) for name, p in lin.named_parameters()}
    h = FlatParamHandle(registered_params(lin), rank=info.rank, world_size=info.world_size,
                        sharded=False, param_dtype=torch.bfloat16)
    with comm.logging_comm() as log:
        h.unshard("lab no_shard")
    t.expect("NO_SHARD unit, bf16 compute: collectives of unshard()", _collectives(log), [])
    t.expect("NO_SHARD unit, bf16 compute: is_unsharded after unshard", h.is_unsharded, True)
    h.use_unsharded_views()
    for name, w in want.items():
        t.expect(f"NO_SHARD unit, bf16 compute: {name} (values)", getattr(lin, name).detach(), w)
    h.reshard()


def _reduce_cases(t, info) -> None:
    """The reduce-scatter seam called directly on a handle of ``Linear(7, 5)`` (41 elements: a
    3-element gap, padding at N = 2 and 3). Each rank's gradient is known to every rank, so the
    expectation is computed here: integer-valued fp32 sums are exact, and the average rounds
    once, as Note [divide before and after] says torch's two divisions do; fp16 values chosen
    so that the sum overflows unless divided first; NO_SHARD all-reduces; a group of one rank
    returns its own gradient."""
    import torch.distributed as dist

    from minifsdp import comm
    from minifsdp.fsdp1.flat_param import FlatParamHandle, registered_params
    from minifsdp.fsdp1.fully_sharded import gradient_divide_factors

    n, r = info.world_size, info.rank
    torch.manual_seed(6)
    groups = [dist.new_group([i]) for i in range(n)]  # every rank creates every group
    for label, dtype, sharded, group in (("fp32", torch.float32, True, None),
                                         ("fp16 near overflow", torch.float16, True, None),
                                         ("NO_SHARD", torch.float32, False, None),
                                         ("a process group of one rank", torch.float32, True,
                                          groups[r])):
        if dtype == torch.float16 and n not in FP16_NEAR_MAX:
            continue
        lin = torch.nn.Linear(7, 5).to(dtype)
        size = n if group is None else 1
        h = FlatParamHandle(registered_params(lin), rank=r if group is None else 0,
                            world_size=size, sharded=sharded, process_group=group)
        used = torch.zeros(h.padded_numel, dtype=torch.bool)
        for i in h.infos:
            used[i.offset:i.offset + i.numel] = True
        peers = range(n) if group is None else [r]
        if dtype == torch.float16:
            grads = [torch.full((h.padded_numel,), FP16_NEAR_MAX[n], dtype=dtype) for _ in peers]
        else:
            grads = [torch.randint(-99, 100, (h.padded_numel,),
                                   generator=torch.Generator().manual_seed(10 + k)).to(dtype)
                     for k in peers]
        grads = [g.masked_fill(~used, 0.0) for g in grads]
        average = torch.stack(grads).float().sum(0).div(size).to(dtype)  # exact sums
        s = h.shard_numel
        want = average[h.rank * s:(h.rank + 1) * s] if sharded else average
        mine = grads[r if group is None else 0].clone()
        name = f"reduce_grad, {label}"
        with comm.logging_comm() as log:
            finish = h.reduce_grad(mine, gradient_divide_factors(size), f"lab {label}")
            issued = [(c.op, c.t_end is None) for c in log.comms()]
            got = finish()
        op = "reduce_scatter" if sharded else "all_reduce"
        t.expect(f"{name}: collectives issued before finish() (op, not yet waited for)",
                 issued, [(op, True)])
        t.expect(f"{name}: collectives (op, tag, input shape, dtype, group size)",
                 _collectives(log), [(op, f"lab {label}", (h.padded_numel,),
                                      str(dtype).removeprefix("torch."), size)])
        t.expect(f"{name}: finish() waited for the collective",
                 all(c.t_end is not None for c in log.comms()), True)
        t.expect(f"{name}: this rank's part of the average", got, want)
        if sharded:
            t.expect(f"{name}: storage bytes behind the flat gradient after finish()",
                     mine.untyped_storage().nbytes(), 0)


def hint(name: str, got, expected, n: int) -> str | None:
    if name.startswith("reduce_grad") or "shard gradient" in name:
        return _reduce_hint(name, got, expected, n)
    if "collectives" in name:
        ops = [c[0] for c in got] if isinstance(got, list) else []
        want = [c[0] for c in expected] if isinstance(expected, list) else []
        if not got and expected:
            return ("no collective in minifsdp.comm's log: communicate through minifsdp.comm "
                    "(torch.distributed's signatures, plus tag=tag_)")
        if ops.count("all_gather") > want.count("all_gather"):
            return ("an all-gather too many: unshard does nothing when the handle is already "
                    "unsharded (the root keeps its parameters from forward to backward)")
        if "all_reduce" in ops and "all_reduce" not in want:
            return ("an all-reduce gives every rank the whole sum; each rank needs only its "
                    "shard's: one reduce-scatter of the padded flat gradient")
        if sorted(ops) == sorted(want):
            return ("the right collectives, but a tag, shape, dtype or group differs: pass "
                    "tag=tag_, the whole padded tensor and the handle's process group")
        return ("one all-gather per unshard of a freed unit, one reduce-scatter per unit and "
                "backward (Note [sharding strategies] in minifsdp/fsdp1/fully_sharded.py)")
    if "NO_SHARD unit, bf16 compute" in name:
        return ("a NO_SHARD unit that owns a buffer (here: mixed precision) is not sharded: "
                "unshard fills the buffer from the FlatParameter itself (a cast copy), no "
                "collective")
    if "version counter" in name:
        return ("the all-gather wrote into handle.unsharded, whose version counter autograd "
                "checks on the views it saved: write into handle._buffer, the same storage "
                "with a counter of its own (Note [two tensors, one storage])")
    if name.endswith("is_unsharded after unshard"):
        return "unshard leaves handle.is_unsharded True: reshard and the next unshard rely on it"
    if "through the view made before the free" not in name and name.endswith("after unshard"):
        return ("unshard gives the freed storage its bytes back (numel x element size) before "
                "the all-gather writes into it (Note [freeing storage])")
    if "through the view made before the free" in name:
        return ("a view made before the free no longer sees the gathered values: gather into "
                "the same storage, handle._buffer's, resized back to its bytes, not into a new "
                "tensor (Note [freeing storage], Note [two tensors, one storage])")
    if "NO_SHARD" in name and "bytes" in name:
        return ("NO_SHARD computes on the FlatParameter's own storage (handle._owns_buffer is "
                "False): reshard must free nothing there (Note [freeing storage])")
    if "behind the modules' views" in name:
        return ("the modules hold tensors with bytes of their own: copies instead of views of "
                "the flat tensor (Note [views, not copies]), or views of a storage that was "
                "rebound or deleted rather than resized to 0, which frees nothing while autograd "
                "holds them (Note [freeing storage], Note [two tensors, one storage])")
    if "storage bytes" in name:
        return ("the unsharded flat tensor still owns its bytes: free its storage with "
                "untyped_storage().resize_(0) (Note [freeing storage])")
    if ("shares the unsharded storage" in name or "has a gradient" in name
            or "made by autograd" in name):
        return ("the original names must be views of the unsharded flat tensor, not copies: "
                "only then does backward deliver one flat gradient (Note [views, not copies])")
    if "numel" in name:
        return ("parameters start at 16-byte boundaries (`align` elements: 4 in fp32, 8 in bf16) "
                "and the total is padded to a multiple of N, so all N shards are equal "
                "(Note [flat layout], Note [alignment])")
    if name.endswith("(values)"):
        return ("parameter i is flat[offset_i:offset_i + numel_i]: the offsets skip the "
                "alignment gaps (Note [alignment])")
    if "padding zeroed" in name:
        return ("rank r keeps elements [r*s, (r+1)*s) of the padded flat tensor, s = "
                "padded_numel / N; the padding sits at the end, on the last rank "
                "(Note [flat layout])")
    return None


def _reduce_hint(name: str, got, expected, n: int) -> str | None:
    if "not yet waited" in name and isinstance(got, list) and isinstance(expected, list) and (
            [c[0] for c in got] != [c[0] for c in expected]):
        return ("one collective per call: a reduce-scatter of the whole padded flat gradient "
                "(an all-reduce only when not sharded, where every rank keeps the whole)")
    if "not yet waited" in name:
        return ("issue the collective with async_op=True and wait for it in finish(): where "
                "devices have streams the package calls finish() later, overlapping the next "
                "unit's backward (Note [final callback])")
    if "storage bytes" in name:
        return ("once the collective is done the flat gradient is dead: free its storage with "
                "untyped_storage().resize_(0) (Note [final callback])")
    if isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor) and (
            got.shape == expected.shape):
        g, e = got.double(), expected.double()
        finite = torch.isfinite(g).all().item() and torch.isfinite(e).all().item()
        if not torch.isfinite(g).all().item() and torch.isfinite(e).all().item():
            return ("the sum overflowed: torch FSDP1 divides each rank's gradient by the first "
                    "factor before the SUM and the sum by the second after (Note [divide before "
                    "and after] in minifsdp/fsdp1/fully_sharded.py)")
        nz = e != 0
        if finite and nz.any():
            ratio = (g[nz] / e[nz])
            for k, what in ((n, "not divided by N at all"), (1 / n, "divided by N twice")):
                if torch.allclose(ratio, torch.full_like(ratio, float(k)), rtol=1e-2):
                    return (f"yours = expected x {k:.3g}: {what}; the two factors of Note "
                            "[divide before and after] multiply to N, one before the SUM, one "
                            "after")
        from minifsdp.labs.report import _generic_hint

        seen = _generic_hint(got, expected, n)
        return (seen + " (Note [divide before and after])" if seen else
                "rank r keeps elements [r*s, (r+1)*s) of the average of the padded flat "
                "gradients, s = padded_numel / N, each rank's divided before the SUM and the "
                "sum after (Note [divide before and after])")
    return None


LAB = Lab(
    id="04",
    title="the FlatParameter: flatten, pad, shard, gather, view, free, reduce-scatter",
    skeleton="labs/lab04_flat_param.py",
    seams=(Seam(LAYOUT, "minifsdp.fsdp1.flat_param", "flat_layout"),
           Seam(SHARD, "minifsdp.fsdp1.flat_param", "rank_shard"),
           Seam(UNSHARD, "minifsdp.fsdp1.flat_param", "FlatParamHandle.unshard"),
           Seam(VIEWS, "minifsdp.fsdp1.flat_param", "FlatParamHandle.unflatten"),
           Seam(RESHARD, "minifsdp.fsdp1.flat_param", "FlatParamHandle.reshard"),
           Seam(REDUCE, "minifsdp.fsdp1.flat_param", "FlatParamHandle.reduce_grad")),
    notes=("flat layout", "alignment", "views, not copies", "freeing storage",
           "two tensors, one storage", "divide before and after", "final callback"),
    run=run_lab,
    hint=hint,
    oracle="torch FSDP1 (use_orig_params=True)",
    hints=(
        "A unit's parameters live as one 1-D tensor: laid end to end with gaps so each starts "
        "16-byte aligned, then zero padding at the end so that N ranks get equal, contiguous "
        "parts. Compute uses views into the gathered flat tensor, never copies, and freeing "
        "means shrinking the storage those views share; gathering means filling that same "
        "storage again, so the views autograd saved see the parameters once more. Backward "
        "leaves one padded flat gradient per unit, and one reduce-scatter hands each rank the "
        "average of its own part, divided as torch divides. Read Note [flat layout], Note "
        "[alignment], Note [views, not copies], Note [freeing storage] and Note [two tensors, "
        "one storage] in minifsdp/fsdp1/flat_param.py, then Note [divide before and after] "
        "and Note [final callback] in minifsdp/fsdp1/fully_sharded.py.",
        "Layout: a running end position; before each parameter round it up to `align` (an "
        "element count); padded_numel rounds the final end up to a multiple of N. Shard: N "
        "equal, contiguous parts, part r for the `rank` you are given. Unshard: handle._buffer "
        "keeps its shape and its storage while freed; give that storage back its bytes "
        "(numel x element size), then let the all-gather write the group's shards straight "
        "into _buffer, from handle.gather_input(); NO_SHARD only copies. Views: parameter i is "
        "the elements [offset_i, offset_i + numel_i) of flat in its shape; gaps and padding "
        "belong to no view. Reshard: handle._buffer's storage is the one the views share; "
        "_owns_buffer and is_unsharded say whether there is anything to free. Reduce: "
        "divide[0] before a SUM reduce-scatter of the whole padded gradient into a new tensor "
        "of shard_numel elements, divide[1] after it; the wait, the second division and the "
        "free belong in finish().",
        "layout: end = 0; for each numel: end = round_up(end, align); record end; end += numel; "
        "return offsets, round_up(end, N). shard: s = len(full) / N; the slice [rank * s, "
        "(rank + 1) * s). unshard: if already unsharded, return; resize the buffer's untyped "
        "storage to its full byte count; if sharded, all-gather-into-tensor(buffer, "
        "gather_input(), the handle's group, tag) else buffer.copy_(flat_param); mark it "
        "unsharded. views: for each info: the slice at info.offset of info.numel elements, "
        "viewed as info.shape (no detach, no copy). reshard: if it owns a buffer and is "
        "unsharded: shrink the buffer's untyped storage to 0 bytes; is_unsharded = False. "
        "reduce_grad: grad /= before (if > 1); out = empty(shard_numel) and an async SUM "
        "reduce-scatter(out, grad, group, tag) -- or an async all-reduce of grad itself when "
        "not sharded (out = grad); def finish(): wait; free grad's storage if it is not out; "
        "out /= after (if > 1); return out; return finish.",
    ),
)
