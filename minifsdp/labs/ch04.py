"""Chapter 04 (FSDP1's FlatParameter): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import torch

from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check


def check_flat_layout(fn) -> bool:
    """``fn(numels, world_size, align)`` -> ``(offsets, padded_numel)``: each parameter starts
    at a multiple of ``align`` elements, the total is padded to a multiple of ``world_size``
    (``minifsdp.flat_param.flat_layout``, Note [flat layout])."""
    from minifsdp.flat_param import flat_layout

    layouts = [([70, 7, 21, 3], 3, 4), ([70, 7, 21, 3], 1, 4), ([5], 4, 1), ([8, 8], 2, 4),
               ([1, 1, 1], 2, 4), ([288, 32, 18432, 64], 4, 4), ([3, 5, 7], 8, 2), ([0, 4], 2, 4)]
    return check("flat layout", [(args, flat_layout(*args)) for args in layouts], fn)


def check_size_wrap(fn) -> bool:
    """``fn(model, min_num_params)`` -> names of the units that a size-based auto-wrap policy
    picks, children before parents (``minifsdp.wrap.plan_units``, Note [policy contract]): a
    module becomes a unit when the elements of it that no unit below took are at least
    ``min_num_params``; a ``ModuleList``/``ModuleDict`` is never a unit, nor is the root."""
    from minifsdp.models import GPT, GPTConfig, MnistCNN
    from minifsdp.wrap import plan_units, size_based_auto_wrap_policy

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


def run_lab(t, info) -> None:
    """Lab 04's cases, on every rank: our FSDP1 and torch FSDP1 wrap the same MLP (two units);
    the shards, the views, the freed storage and three Adam steps are compared."""
    import copy
    import functools

    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import wrap

    from minifsdp import fsdp1
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
        # A layout whose shards are not N equal parts cannot be all-gathered: every rank
        # agrees on that first and stops here, in lockstep, with the divergence above.
        equal = torch.tensor([float(all(u._handle.flat_param.numel() * n == u._handle.padded_numel
                                        for u in units))])
        dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    if not equal.item():
        return
    with t.case("unshard: the original names are views of the gathered flat tensor",
                (VIEWS, RESHARD)):
        for u in units:
            h = u._handle
            h.unshard()
            h.use_unsharded_views()
            for info_ in h.infos:
                view = getattr(info_.module, info_.name)
                name = f"unit {u._name}: {info_.fqn}"
                t.expect(f"{name} (values)", view.detach(), base.get_parameter(
                    f"{u._name}.{info_.fqn}" if u._name != "(root)" else info_.fqn).detach())
                ptr = h.unsharded.untyped_storage().data_ptr()
                t.expect(f"{name} shares the unsharded storage",
                         view.untyped_storage().data_ptr() == ptr, True)
            h.reshard()
            t.expect(f"unit {u._name}: unsharded storage bytes after reshard",
                     h._buffer.untyped_storage().size(), 0)
    with t.case("three Adam steps against torch FSDP1 (FULL_SHARD, 2 units)",
                (VIEWS, RESHARD)):
        opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (ours, theirs)]
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(4 * n, 33, generator=g), torch.randint(0, 10, (4 * n,), generator=g)
            x, y = x.chunk(n)[r], y.chunk(n)[r]
            losses = [loss_fn(m(x), y) for m in (ours, theirs)]
            t.expect("loss", losses[0].detach(), losses[1].detach(), step=step, phase="forward")
            for u in units[1:]:  # FULL_SHARD frees every unit but the root after forward
                t.expect(f"unit {u._name}: unsharded storage bytes after forward",
                         u._handle._buffer.untyped_storage().size(), 0, step=step,
                         phase="forward")
            for loss in losses:
                loss.backward()
            for u in units:
                t.expect(f"unit {u._name}: the FlatParameter has a gradient",
                         u._handle.flat_param.grad is not None, True, step=step, phase="backward")
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
            for u, tu, mask in zip(units, TorchFSDP.fsdp_modules(theirs), masks):
                t.expect(f"unit {u._name}: shard after the step", u._handle.flat_param.detach(),
                         tu._handle.flat_param.detach().masked_fill(mask, 0.0), step=step,
                         phase="optimizer")
                t.expect(f"unit {u._name}: unsharded storage bytes after the step",
                         u._handle._buffer.untyped_storage().size(), 0, step=step,
                         phase="optimizer")


def hint(name: str, got, expected, n: int) -> str | None:
    if "storage bytes" in name:
        return ("the unsharded flat tensor still owns its bytes: free its storage with "
                "untyped_storage().resize_(0) (Note [freeing storage])")
    if "shares the unsharded storage" in name or "has a gradient" in name:
        return ("the original names must be views of the unsharded flat tensor, not copies: "
                "only then does backward deliver one flat gradient (Note [views, not copies])")
    if "numel" in name:
        return ("parameters start at 16-byte boundaries and the total is padded to a multiple of "
                "N, so all N shards are equal (Note [flat layout], Note [alignment])")
    if name.endswith("(values)"):
        return ("parameter i is flat[offset_i:offset_i + numel_i]: the offsets skip the "
                "alignment gaps (Note [alignment])")
    if "padding zeroed" in name:
        return ("rank r keeps elements [r*s, (r+1)*s) of the padded flat tensor, s = "
                "padded_numel / N; the padding sits at the end, on the last rank "
                "(Note [flat layout])")
    return None


LAB = Lab(
    id="04",
    title="the FlatParameter: flatten, pad, shard, view, free",
    skeleton="labs/lab04_flat_param.py",
    seams=(Seam(LAYOUT, "minifsdp.flat_param", "flat_layout"),
           Seam(SHARD, "minifsdp.flat_param", "rank_shard"),
           Seam(VIEWS, "minifsdp.flat_param", "FlatParamHandle.unflatten"),
           Seam(RESHARD, "minifsdp.flat_param", "FlatParamHandle.reshard")),
    notes=("flat layout", "alignment", "views, not copies", "freeing storage"),
    run=run_lab,
    hint=hint,
    oracle="torch FSDP1 (use_orig_params=True)",
)
