"""Chapter 07 (mixed precision): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_07.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import contextlib
import math

import torch

from minifsdp.labs.ch05 import FSDP2_SHAPES, dim0_rows
from minifsdp.notebook import check


def check_bf16_round(fn) -> bool:
    """``fn(x)`` -> the bfloat16 value nearest to the float ``x`` (ties to even), as a Python
    float: what ``torch.tensor(x).to(torch.bfloat16)`` keeps of an fp32 number."""
    xs = [1.0, 1.00390625, 1.005859375, 1.01171875, 3.14159265, -2.71828, 1e-3, 65504.0, 0.1,
          1 + 2**-8, 1 + 3 * 2**-8, 255.5, 256.5, -0.0078125 * 3]
    cases = [((x,), torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).item()) for x in xs]
    return check("bf16 rounding", cases, fn)


def unsharded_group_bytes(shapes: list[tuple], world_size: int, element_size: int) -> int:
    """Bytes of one FSDP2 group's unsharded parameters: N padded shards of each parameter in
    the all-gather dtype (``param_dtype`` under mixed precision)."""
    n = world_size
    return element_size * n * sum(dim0_rows(s[0], n)[0] * math.prod(s[1:]) for s in shapes)


def check_unsharded_group_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, element_size)`` -> bytes of a group's unsharded parameters.
    ``measured``: ``((shapes, n, element_size), bytes)`` from real runs' label timelines."""
    cases = [((shapes, n, e), unsharded_group_bytes(shapes, n, e))
             for shapes, ns in FSDP2_SHAPES for n in ns for e in (4, 2)]
    return check("unsharded group bytes", [*cases, *(measured or [])], fn)


def mp_group_wire_bytes(shapes: list[tuple], world_size: int, param_bytes: int,
                        reduce_bytes: int, reshard_after_forward: bool) -> float:
    """Bytes one rank sends per step for one FSDP2 group under a mixed-precision policy:
    all-gathers move ``param_bytes`` per element, the reduce-scatter ``reduce_bytes``."""
    n = world_size
    elems = n * sum(dim0_rows(s[0], n)[0] * math.prod(s[1:]) for s in shapes)
    gathers = 2 if reshard_after_forward else 1
    return (n - 1) / n * elems * (gathers * param_bytes + reduce_bytes)


def check_mp_group_wire_bytes(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size, param_bytes, reduce_bytes, reshard_after_forward)`` -> wire
    bytes per step for one group. ``measured``: ``(args, bytes)`` from real runs."""
    cases = [((shapes, n, p, r, raf), mp_group_wire_bytes(shapes, n, p, r, raf))
             for shapes, ns in FSDP2_SHAPES for n in ns for p, r in ((4, 4), (2, 4), (2, 2))
             for raf in (True, False)]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("mixed-precision group bytes", [*cases, *(measured or [])], fn, close=close)


# ---- lab 07: the mixed-precision casts ---------------------------------------------------------

from minifsdp.labs.seams import Lab, Seam  # noqa: E402
from minifsdp.labs.uninitialized import NaNForEmpty  # noqa: E402

COPY_IN, REDUCE_DTYPE, TO_SHARDS = ("fsdp2.all_gather_copy_in", "fsdp2.reduce_dtype",
                                    "fsdp2.grads_to_shards")
BF16_FP32 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
BF16 = {"param_dtype": torch.bfloat16}  # reduce_dtype None: reduce in bf16
REDUCE_CASE = ("the reduce dtype and the sharded gradients of one group (bf16 gradients, fp32 "
               "accumulators beside bf16 ones, a bf16 slot added twice)")
BF16_CASE = ("3 Adam steps against torch's fully_shard, param_dtype=bf16, reduce in bf16, "
             "2 backwards per step")
NO_SYNC_CASE = ("3 Adam steps against torch's fully_shard, param_dtype=bf16, reduce_dtype=fp32, "
                "2 backwards per step, the first without gradient sync")


def _check_comm(policy: dict, n: int, micro: int = 1, synced: int | None = None):
    """``on_backward`` for ``train_vs_torch``: the collectives of our step, as a sorted list
    of (tag, dtype, input bytes), against the list the model's structure implies -- never
    against the run's own log. Per backward of ``lab_net``'s three groups (torch's
    ``fully_shard`` defaults): each group all-gathered in forward, the non-root groups again
    in backward (``reshard_after_forward=True``; the root stays unsharded until its backward,
    as torch's ``FSDPState._lazy_init`` leaves it), each group reduce-scattered once. The
    all-gather's input is my padded slot in ``param_dtype``; the reduce-scatter's all N slots
    in the reduce dtype; ``synced`` of the ``micro`` backwards reduce-scatter (all by
    default; the others run without gradient sync). A missing, extra or wrongly typed
    collective shows here."""
    def check(t, step, log, model) -> None:
        from minifsdp.fsdp2 import FSDPModule

        groups = {m.fsdp_state.group.name: m.fsdp_state.group
                  for m in model.modules() if isinstance(m, FSDPModule)}
        root = model.fsdp_state.group.name
        reduce = policy.get("reduce_dtype") or policy["param_dtype"]
        for op, word, dtype, per in (("all_gather", "params", policy["param_dtype"], 1),
                                     ("reduce_scatter", "grads", reduce, n)):
            size = torch.empty(0, dtype=dtype).element_size()
            want = []
            for name, group in groups.items():
                slot = sum(p.padded_shard_numel for p in group.fsdp_params)
                if op == "reduce_scatter":
                    times = micro if synced is None else synced
                else:
                    times = (1 if name == root else 2) * micro
                want += [(f"fsdp2 {word} {name}", str(dtype).removeprefix("torch."),
                          per * slot * size)] * times
            got = sorted((r.tag, r.dtype, r.bytes) for r in log.comms(op))
            t.expect(f"{op.replace('_', '-')}s of the step (tag, dtype, input bytes)", got,
                     sorted(want), step=step, phase="backward")
    return check


def _reduce_cases(t, info) -> None:
    """The reader's ``reduce_scatter_dtype`` and ``to_sharded_grads`` on one group, called
    directly with inputs made here: gradients of one dtype (left as they are), fp32
    accumulators beside fresh bf16 gradients (after backwards without sync: all in the reduce
    dtype, values unchanged, Note [accumulating in the reduce dtype]), and a reduced bf16 slot
    turned into fp32 ``.grad`` twice (assigned, then added in fp32), its storage freed. The
    expected values are casts of the inputs, made here."""
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp import fsdp2
    from minifsdp.fsdp2 import reduce

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    g = torch.Generator().manual_seed(11 + info.rank)
    for label, policy in (("bf16 reduce", BF16), ("bf16 params, fp32 reduce", BF16_FP32)):
        torch.manual_seed(3)
        net = nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 2))
        fsdp2.fully_shard(net, mesh=mesh, mp_policy=fsdp2.MixedPrecisionPolicy(**policy))
        group = net.fsdp_state.group
        params = group.fsdp_params
        names = {id(p): name for name, p in net.named_parameters()}
        reduce_dtype = policy.get("reduce_dtype") or policy["param_dtype"]
        fresh = [torch.randn(p.orig_size, generator=g).to(torch.bfloat16) for p in params]
        grads = list(fresh)
        dtype = reduce.reduce_scatter_dtype(group, grads)
        what = f"{label}, bf16 gradients"
        t.expect(f"reduce dtype ({what})", dtype, reduce_dtype, phase="backward")
        t.expect(f"the gradients left as they are ({what}: the copy-in casts them)",
                 [x is y for x, y in zip(grads, fresh)], [True] * len(fresh), phase="backward")
        if policy.get("reduce_dtype") is not None:
            # after a backward without sync: fp32 accumulators of some parameters beside
            # this backward's bf16 gradients of the others
            mixed = [x if i % 2 == 0 else torch.randn(p.orig_size, generator=g)
                     for i, (x, p) in enumerate(zip(fresh, params))]
            want = [x.to(reduce_dtype) for x in mixed]
            grads = list(mixed)
            same_list = grads
            dtype = reduce.reduce_scatter_dtype(group, grads)
            what = f"{label}, fp32 accumulators beside bf16 gradients"
            t.expect(f"reduce dtype ({what})", dtype, reduce_dtype, phase="backward")
            t.expect(f"the same list object ({what})", grads is same_list, True,
                     phase="backward")
            for i, (got, w) in enumerate(zip(grads, want)):
                t.expect(f"gradient {i} ({what})", got, w, phase="backward")
        # the reduced slot: this rank's rows of every parameter, padding after each
        slot = sum(p.padded_shard_numel for p in params)
        total = {id(p): None for p in params}
        for k in range(2):  # the second adds into the first (2 backwards before a step)
            out = torch.randn(slot, generator=g).to(reduce_dtype)
            rows, offset = [], 0
            for p in params:
                rows.append(out[offset: offset + p.sharded_numel].view(p.sharded_size)
                            .to(torch.float32, copy=True))  # .grad may view out itself
                offset += p.padded_shard_numel
            reduce.to_sharded_grads(group, params, out)
            what = f"{label}, backward {k + 1} of 2"
            for p, r in zip(params, rows):
                want = r if total[id(p)] is None else total[id(p)] + r
                total[id(p)] = want
                grad = p.sharded_param.grad
                got = None if grad is None else grad.to_local().detach()
                t.expect(f"{names[id(p.sharded_param)]}.grad, the local rows ({what})", got, want,
                         phase="backward")
            if out.dtype != torch.float32:
                t.expect(f"bytes behind the {str(out.dtype).removeprefix('torch.')} slot after "
                         f"to_sharded_grads ({what})", out.untyped_storage().nbytes(), 0,
                         phase="backward")


def run_lab(t, info) -> None:
    """Lab 07's cases, on every rank: one group's copy-in (bytes on the wire, the buffer)
    against the package's; the reduce dtype and the sharded gradients called directly
    (``_reduce_cases``); then three training steps against torch's ``fully_shard`` with
    ``param_dtype=bf16`` and ``reduce_dtype`` fp32, then bf16 with two backwards per step (the
    second reduce-scatter's gradient is added into the first's ``.grad``), then fp32 reduce
    with two backwards per step, the first without sync (fp32 accumulators, Note
    [accumulating in the reduce dtype]); all three with the buffers' bytes checked
    (``train_vs_torch(memory=True)``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp import comm, fsdp2
    from minifsdp.labs import seams
    from minifsdp.labs.ch05 import _all_ranks_matched, lab_net, train_vs_torch

    n = info.world_size
    with t.case("the all-gather copy-in of each group, bf16 params", (COPY_IN,)):
        m = lab_net()
        policy = fsdp2.MixedPrecisionPolicy(**BF16_FP32)
        mesh = init_device_mesh(info.device.type, (n,))
        for unit in (m.body, m.narrow, m):
            fsdp2.fully_shard(unit, mesh=mesh, mp_policy=policy)
        for name, unit in (("body", m.body), ("narrow", m.narrow), ("root", m)):
            group = unit.fsdp_state.group
            bufs = []
            for mine, copy_in in ((False, seams.reference(COPY_IN)),
                                  (True, type(group)._all_gather_copy_in)):
                with comm.logging_comm() as log:
                    # yours under NaNForEmpty: padding left unwritten shows as NaN, every run
                    with NaNForEmpty() if mine else contextlib.nullcontext():
                        slot, gathered = copy_in(group)
                    comm.all_gather_into_tensor(gathered, slot, group.process_group)
                bufs.append((int(log.total_bytes("all_gather", wire=True)), gathered))
            (want_bytes, want), (got_bytes, got) = bufs
            t.expect(f"{name}: all-gather wire bytes", got_bytes, want_bytes, phase="copy-in")
            t.expect(f"{name}: all-gathered buffer", got, want, phase="copy-in")
    # a copy-in of the wrong dtype would crash the copy-out below: stop here, on every rank
    diverged = torch.tensor([float(t.first is not None)])
    dist.all_reduce(diverged)
    if diverged.item():
        return
    with t.case(REDUCE_CASE, (REDUCE_DTYPE, TO_SHARDS)):
        _reduce_cases(t, info)
    if not _all_ranks_matched(t):
        return
    with t.case("3 Adam steps against torch's fully_shard, param_dtype=bf16, reduce_dtype=fp32",
                (COPY_IN, REDUCE_DTYPE, TO_SHARDS)):
        train_vs_torch(t, info, BF16_FP32, _check_comm(BF16_FP32, n), memory=True)
    with t.case(BF16_CASE, (COPY_IN, REDUCE_DTYPE, TO_SHARDS)):
        train_vs_torch(t, info, BF16, _check_comm(BF16, n, micro=2), micro=2, memory=True)
    with t.case(NO_SYNC_CASE, (COPY_IN, REDUCE_DTYPE, TO_SHARDS)):
        train_vs_torch(t, info, BF16_FP32, _check_comm(BF16_FP32, n, micro=2, synced=1),
                       micro=2, memory=True, no_sync=True)


def hint(name: str, got, expected, n: int) -> str | None:
    if name.startswith("reduce dtype ("):
        return ("the reduce dtype is the group's, group.dtypes.reduce (the policy's "
                "reduce_dtype, else its param_dtype), else the gradients' own (Note [mixed "
                "precision])")
    if name.startswith("the gradients left as they are"):
        return ("gradients of one dtype go to the copy-in as they are (it casts as it lays them "
                "out); copies made here would be a second set of unsharded gradients alive at "
                "once (Note [mixed precision])")
    if "accumulators beside" in name:
        return ("fp32 accumulators hold the sums of backwards without sync: bring every "
                "gradient to the reduce dtype, never the accumulators down to bf16 (Note "
                "[accumulating in the reduce dtype])")
    if ".grad, the local rows" in name:
        return ("each backward's rows are cast up to the shards' dtype, then set as .grad or "
                "added to the fp32 .grad in fp32: no sum is rounded to the reduce dtype (Note "
                "[accumulating in the reduce dtype])")
    if "slot after to_sharded_grads" in name:
        return ("once the rows are cast up, resize the low-precision slot's storage to 0 "
                "before returning: gloo may still hold a reference (Note [freeing with "
                "resize_])")
    if name.startswith("all-gather buffers and slots"):
        return ("my_slot must be a view of gathered, which the caller frees after the copy-out; "
                "a slot of its own is a second buffer that outlives the all-gather (Note "
                "[copy-in and copy-out])")
    if name.endswith("wire bytes") and isinstance(got, int) and expected:
        return (f"yours moved {got / expected:.3g}× the bytes: cast the shards to param_dtype "
                "in the copy-in, before the all-gather (Note [mixed precision])")
    if "(tag, dtype, input bytes)" in name:
        return ("each group is all-gathered once in forward (the non-root ones again in "
                "backward) and reduce-scattered once per backward, nothing more; the "
                "all-gather in param_dtype, the reduce-scatter in reduce_dtype, else "
                "param_dtype (Note [mixed precision])")
    return None


LAB = Lab(
    id="07",
    title="the mixed-precision casts",
    skeleton="labs/lab07_mixed_precision.py",
    seams=(Seam(COPY_IN, "minifsdp.fsdp2.fsdp_param_group", "FSDPParamGroup._all_gather_copy_in",
                "all_gather_copy_in"),
           Seam(REDUCE_DTYPE, "minifsdp.fsdp2.reduce", "reduce_scatter_dtype",
                "reduce_scatter_dtype"),
           Seam(TO_SHARDS, "minifsdp.fsdp2.reduce", "to_sharded_grads", "to_sharded_grads")),
    notes=("mixed precision", "accumulating in the reduce dtype", "who owns the shard's storage",
           "freeing with resize_"),
    run=run_lab,
    hint=hint,
    oracle="torch's fully_shard with the same MixedPrecisionPolicy (and the package's copy-in)",
    hints=(
        "Mixed precision changes dtypes at exactly three places: the copy into the all-gather"
        " buffer (the cast to param_dtype happens there, before the wire, so the all-gather "
        "carries 2 bytes an element), the choice of the reduce dtype, and the way back from "
        "the reduced slot to each fp32 shard's .grad (the optimizer steps the fp32 master "
        "weights). Read Note [mixed precision], Note [copy-in and copy-out] and Note "
        "[accumulating in the reduce dtype].",
        "Copy-in: the buffer holds N slots of S elements, rank-major; your slot is a view of "
        "it, and each input has its own range of the slot, one after the other. copy_() "
        "casts as it copies, so copying an fp32 input into a range of a bf16 buffer is the "
        "whole cast: no separate cast, no temporary. Reduce dtype: the group's own "
        "(dtypes.reduce), else the gradients'; only when they arrive in two dtypes are they "
        "replaced, in the same list (a slice assignment keeps the list object). To shards: "
        "cast the whole slot once, if its dtype is not dtypes.orig, and free the low-"
        "precision one's storage at once; then walk the parameters with a running offset that"
        " advances by padded_shard_numel while you keep only sharded_numel elements.",
        "copy-in: S = sum of the inputs' numels; gathered = inputs[0].new_empty(N * S, "
        "dtype=group.dtypes.gather); tag it ('comm', label 'all-gather buffers'); my_slot = "
        "gathered[r * S:(r + 1) * S]; o = 0; per input x: my_slot[o:o + x.numel()].copy_(x); "
        "o += x.numel(); return (my_slot, gathered). reduce dtype: d = dtypes.reduce, or "
        "grads[0].dtype when that is None; if the gradients' dtypes form a set of two: "
        "grads[:] = copies .to(d); return d. to shards: if out's dtype differs from orig: "
        "low = out; out = low.to(orig); tag(out, 'grads'); resize low's untyped storage to 0."
        " Then o = 0; per p: rows = out[o:o + p.sharded_numel].view(p.sharded_size); o += "
        "p.padded_shard_numel; no .grad yet: .grad = p.to_sharded_dtensor(rows); else add "
        "rows into .grad._local_tensor.",
    ),
)
