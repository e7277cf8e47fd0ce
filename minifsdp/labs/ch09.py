"""Chapter 09 (capstone): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_09.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

from minifsdp.notebook import check


def fits(psi: float, n: int, strategy: str, gpu_bytes: float) -> bool:
    """Do mixed-precision Adam's model states (the ZeRO table, 2 + 2 + 12 bytes per parameter)
    fit on each of ``n`` GPUs (``minifsdp.analytic.model_state_bytes``)?"""
    from minifsdp.analytic import model_state_bytes

    return model_state_bytes(psi, n, strategy)["total"] <= gpu_bytes


def check_fits(fn) -> bool:
    """``fn(psi, n, strategy, gpu_bytes)`` -> bool, strategy in ddp / zero1 / zero2 / fsdp."""
    cases = [((psi, n, s, g), fits(psi, n, s, g))
             for psi in (7.5e9, 70e9, 405e9) for n in (1, 8, 64, 1024)
             for s in ("ddp", "zero1", "zero2", "fsdp") for g in (40e9, 80e9)]
    return check("fits", cases, fn)


def hsdp_wire_bytes(psi: float, replicate: int, shard: int) -> tuple[float, float]:
    """``(intra_node, inter_node)`` bytes one rank sends per fp32 step for one unit of
    ``psi`` parameters under HSDP: all-gather (x2) and reduce-scatter among ``shard`` ranks, an
    all-reduce of the 1/shard slice among ``replicate`` ranks."""
    full = 4 * psi
    return (3 * (shard - 1) / shard * full, 2 * (replicate - 1) / replicate * full / shard)


def check_hsdp_wire_bytes(fn) -> bool:
    """``fn(psi, replicate, shard)`` -> ``(intra_node, inter_node)`` wire bytes per step."""
    cases = [((psi, r, s), hsdp_wire_bytes(psi, r, s))
             for psi in (1e6, 3_429_888) for r, s in ((1, 8), (2, 2), (8, 1), (4, 8), (16, 8))]
    close = lambda a, b: all(abs(x - y) <= 1e-9 * max(1.0, y) for x, y in zip(a, b))
    return check("HSDP bytes per step", cases, fn, close=close)


def min_gpus(psi: float, gpu_bytes: float) -> int | None:
    """The smallest power of two N <= 2**20 with FSDP's 16 psi / N <= ``gpu_bytes``."""
    n = 1
    while n <= 2**20:
        if 16 * psi / n <= gpu_bytes:
            return n
        n *= 2
    return None


def check_min_gpus(fn) -> bool:
    """``fn(psi, gpu_bytes)`` -> the fewest GPUs (a power of two) for FSDP's model states."""
    cases = [((psi, g), min_gpus(psi, g)) for psi in (1e6, 5e9, 10e9, 7e9, 70e9, 405e9, 1e15)
             for g in (16e9, 80e9, 192e9)]
    return check("fewest GPUs", cases, fn)


# ---- lab 09: HSDP's gradient reduction -----------------------------------------------------------

import torch  # noqa: E402

from minifsdp.labs.report import _generic_hint  # noqa: E402
from minifsdp.labs.seams import Lab, Seam  # noqa: E402

LAB_STEPS = 3
REDUCE = "fsdp2.reduce_grads"
MICRO = 3
# fp16's overflow and subnormal ranges: only there does the place of a division by a power of
# two change any bit (dividing a normal fp16 number by 2 is exact), so the fp16 case scales the
# loss into them. Step 0: replicate 0's ranks scale their loss by OVERFLOW_SCALE, which puts
# the largest sum of two ranks' fp16 gradients in the shard group above 65504 (inf) while each
# rank's gradient, and torch's sum of pre-divided ones, stay below it (at N = 4: 0.54 x 125000
# = 67400 over 2 ranks, the largest single gradient 0.42 x 125000; at N = 2: 0.79 and 0.51);
# step 1: every rank scales by SUBNORMAL_SCALE, which makes every gradient an fp16 subnormal
# (|g| < 1 -> < 2^-14), where each division rounds bits away.
OVERFLOW_SCALE = 125_000.0
SUBNORMAL_EXP = -14
SUBNORMAL_SCALE = 2.0**SUBNORMAL_EXP
# (name, param dtype, reduce dtype, micro-batches, all-reduce every micro-batch, per step the
# loss scale of replicate 0's ranks and of the others, set_gradient_divide_factor's factor as a
# multiple of S); the meshes come from the world size: (2, 2) at N = 4, (2, 1) and (1, 2) at N = 2
POLICIES = (
    ("fp32", None, None, 1, True, None, None),
    (f"bf16 parameters, fp32 reduce, {MICRO} micro-batches, set_requires_all_reduce(False) on "
     f"the first {MICRO - 1}", torch.bfloat16, torch.float32, MICRO, False, None, None),
    (f"fp32 parameters, fp16 reduce (pre- and post-division), the loss scaled by "
     f"{OVERFLOW_SCALE:.0f} on replicate 0 at step 0 (an fp16 sum without the pre-division "
     f"overflows) and by 2^{SUBNORMAL_EXP} at step 1 (fp16 subnormals)", None, torch.float16, 1,
     True, ((OVERFLOW_SCALE, 1.0), (SUBNORMAL_SCALE, SUBNORMAL_SCALE), (1.0, 1.0)), None),
    # Note [divide factor]: the factor divides the sum over all R S ranks, so the reduce-scatter
    # takes the factor's op (AVG where it is S; gloo has no PREMUL_SUM for any other) and the
    # all-reduce SUMs: R times the mean. (S = 1 meshes skip it: minifsdp refuses a factor
    # there, where torch, running no reduce-scatter, divides twice under force-sum or in fp16.)
    ("fp32, set_gradient_divide_factor(S) on every group (the factor's op in the "
     "reduce-scatter, SUM across replicas)", None, None, 1, True, None, 1),
)


_FACTOR_CASE = {"on": False}  # is a divide factor set? (for the hint, in this rank's process)


def _meshes(n: int) -> list[tuple[int, int]]:
    return [(2, 2)] if n == 4 else [(n, 1), (1, n)]


def train_hsdp_vs_torch(t, info, shape: tuple[int, int], policy: tuple) -> None:
    """``LAB_STEPS`` Adam steps of chapter 05's ``lab_net`` under HSDP on an (R, S) mesh, our
    ``fully_shard`` against torch's with the same ``MixedPrecisionPolicy``, comparing per step:
    the bytes behind ``flat`` after each call of the seam (0: the contract frees it), the
    reduction's collectives (op, group size, dtype, numel, in issue order), each loss, the
    gradients and the parameters (full tensors)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minifsdp import comm, fsdp2
    from minifsdp.fsdp2 import reduce
    from minifsdp.labs.ch05 import lab_net

    _, param_dtype, reduce_dtype, micro, every, scales, factor = policy
    r_deg, s_deg = shape
    mesh = init_device_mesh(info.device.type, shape, mesh_dim_names=("replicate", "shard"))
    models, opts = {}, {}
    for impl, shard, cls in (("ours", fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy),
                             ("torch", torch_fully_shard, TorchPolicy)):
        m = lab_net()
        kw = {}
        if param_dtype is not None or reduce_dtype is not None:
            kw["mp_policy"] = cls(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for unit in (m.body, m.narrow, m):
            shard(unit, mesh=mesh, **kw)
            if factor is not None:  # per group, not recursive (torch's too)
                unit.set_gradient_divide_factor(float(factor * s_deg))
        models[impl], opts[impl] = m, torch.optim.Adam(m.parameters(), lr=1e-2)
    # the reduction's collectives as Note [HSDP] lays them out: per group, in the order the
    # groups finish backward (the root, whose head's gradients come first, then narrow, then
    # body), a reduce-scatter of S slots over the shard group, then -- where this backward
    # all-reduces -- the slot over the R replicas
    groups = [models["ours"], models["ours"].narrow, models["ours"].body]
    slots = [sum(p.padded_shard_numel for p in g.fsdp_state.group.fsdp_params) for g in groups]
    dt = str(reduce_dtype or param_dtype or torch.float32).removeprefix("torch.")
    n, r = info.world_size, info.rank
    now = {"step": 0}

    def freeing(reduce_grads):  # wraps the installed seam: it sees flat after the call
        def wrapped(group, flat):
            out = reduce_grads(group, flat)
            t.expect(f"group {group.name}: bytes behind flat after reduce_grads returned",
                     flat.untyped_storage().nbytes(), 0, step=now["step"], phase="backward")
            return out
        return wrapped

    saved = reduce.reduce_grads
    reduce.reduce_grads = freeing(saved)
    _FACTOR_CASE["on"] = factor is not None
    try:
        for step in range(LAB_STEPS):
            now["step"] = step
            # ranks 0 .. S - 1 make up replicate 0 (the mesh is row-major)
            scale = None if scales is None else scales[step][0 if r < s_deg else 1]
            for k in range(micro):
                last = k == micro - 1
                reduce_all = every or last
                for impl in ("ours", "torch"):
                    models[impl].set_requires_all_reduce(reduce_all)
                g = torch.Generator().manual_seed(100 + micro * step + k)
                x, y = torch.randn(n * 4, 8, generator=g), torch.randint(0, 3, (n * 4,),
                                                                         generator=g)
                x, y = x.chunk(n)[r], y.chunk(n)[r]
                loss = F.cross_entropy(models["ours"](x), y)
                if scale is not None and scale != 1.0:
                    loss = loss * scale
                with comm.logging_comm() as log:
                    loss.backward()
                got = [(c.op, c.group_size, c.dtype, int(torch.Size(c.shape).numel()))
                       for c in log.comms() if c.op in ("reduce_scatter", "all_reduce")]
                want = []
                for slot in slots:
                    if s_deg > 1:  # Note [a shard group of one rank]: else a copy
                        want.append(("reduce_scatter", s_deg, dt, s_deg * slot))
                    if reduce_all:
                        want.append(("all_reduce", r_deg, dt, slot))
                t.expect("the reduction's collectives in backward (op, group size, dtype, numel)"
                         + ("" if reduce_all else ", without the all-reduce"), got, want,
                         step=step, phase="backward")
                theirs = F.cross_entropy(models["torch"](x), y)
                if scale is not None and scale != 1.0:
                    theirs = theirs * scale
                theirs.backward()
                t.expect("loss" if micro == 1 else f"loss of micro-batch {k}", loss.detach(),
                         theirs.detach(), step=step, phase="forward")
            ours, theirs = (dict(models[k].named_parameters()) for k in ("ours", "torch"))
            after = "" if micro == 1 else f" after {micro} micro-batches"
            for name, p in theirs.items():
                mine = ours[name].grad
                t.expect(f"{name}.grad{after}", None if mine is None else mine.full_tensor(),
                         p.grad.full_tensor(), step=step, phase="backward")
            for impl in ("ours", "torch"):
                opts[impl].step()
                opts[impl].zero_grad()
            for name, p in theirs.items():
                t.expect(name, ours[name].detach().full_tensor(), p.detach().full_tensor(),
                         step=step, phase="optimizer step")
    finally:
        reduce.reduce_grads = saved
        _FACTOR_CASE["on"] = False


def run_lab(t, info) -> None:
    """Lab 09's cases, on every rank: for each mesh of the job ((2, 2) at N = 4; (2, 1) and
    (1, 2) at N = 2) and each policy in ``POLICIES``, three Adam steps against torch's
    ``fully_shard`` on the same 2-D mesh."""
    from minifsdp.labs.ch05 import _all_ranks_matched

    for shape in _meshes(info.world_size):
        for policy in POLICIES:
            if policy[-1] is not None and shape[1] == 1:
                continue  # a divide factor with S = 1: refused (Note [divide factor])
            with t.case(f"HSDP on a {shape[0]} x {shape[1]} mesh, {policy[0]}: 3 Adam steps "
                        "against torch's fully_shard", (REDUCE,)):
                train_hsdp_vs_torch(t, info, shape, policy)
            if not _all_ranks_matched(t):
                return


def hint(name: str, got, expected, n: int) -> str | None:
    if name.startswith("the reduction's collectives"):
        if isinstance(got, list) and isinstance(expected, list):
            ops = [c[0] for c in got]
            if "all_reduce" not in ops and "all_reduce" in [c[0] for c in expected]:
                return ("no all-reduce across the replicate group: each replica keeps the "
                        "average of its own shard group only (Note [HSDP])")
            if any(c[0] == "reduce_scatter" and c[1] == 1 for c in got):
                return ("a reduce-scatter over a shard group of one rank: there is nothing to "
                        "scatter, and torch issues none -- copy flat into the slot (Note [a "
                        "shard group of one rank] in fsdp_param_group.py)")
            if ops and ops[0] == "all_reduce" and expected and expected[0][0] != "all_reduce":
                return ("the all-reduce came first: reduce-scatter within the shard group "
                        "first, so that only your 1/S slot crosses the slow links (Note [HSDP])")
            if any(c[2] != e[2] for c, e in zip(got, expected)):
                return ("a collective ran in another dtype than the reduce dtype: average in "
                        "the dtype of `flat` (Note [mixed precision], Note [HSDP])")
            if "without the all-reduce" in name:
                return ("set_requires_all_reduce(False): reduce-scatter, keep the sum in "
                        "group.partial_reduce_output, return None (Note [HSDP accumulation])")
        return "op, group size, dtype and numel per collective: Note [HSDP]"
    if "bytes behind flat" in name:
        return ("the contract frees flat: flat.untyped_storage().resize_(0) once the "
                "reduce-scatter returns -- dropping your reference frees nothing, the caller and "
                "gloo's thread still hold it (Note [freeing with resize_] in "
                "fsdp_param_group.py)")
    if not isinstance(got, torch.Tensor) or not isinstance(expected, torch.Tensor):
        return None
    grad = ".grad" in name
    if grad and got.shape == expected.shape and got.is_floating_point():
        if not torch.isfinite(got).all() and torch.isfinite(expected).all():
            return ("yours overflowed to inf where torch's stayed finite: with an fp16 reduce, "
                    "divide flat by the pre-factor *before* the reduce-scatter, so that the sum "
                    "over the shard group cannot overflow; post divides after the all-reduce "
                    "(Note [mixed precision], gradient_divide_factors)")
        differ = got != expected
        tiny = 2.0**-14  # fp16's smallest normal number
        if differ.any() and (expected[differ].abs() < tiny).all() and (
                got[differ].abs() < tiny).all():
            return ("only fp16 subnormals differ, where every division rounds bits away: "
                    "divide exactly where torch does, by pre before the reduce-scatter and by "
                    "post once after the all-reduce, not before it (Note [mixed precision], "
                    "gradient_divide_factors)")
    if grad or name == "loss" or name.startswith("loss of"):
        if grad and "micro-batches" in name:
            return _generic_hint(got, expected, n) or (
                "under set_requires_all_reduce(False) each micro-batch's reduce-scattered slot "
                "is added into group.partial_reduce_output (the first one kept, every later "
                "one added, not stored over it); the synced micro-batch adds that sum into its "
                "slot before the all-reduce and clears it (Note [HSDP accumulation])")
        e64, g64 = expected.double(), got.double()
        for k in (0.5, 2.0) if _FACTOR_CASE["on"] else ():  # R = 2 on the 2 x 2 mesh
            if grad and torch.count_nonzero(e64) and torch.allclose(g64, e64 * k, rtol=1e-5,
                                                                    atol=1e-7):
                return (f"yours = expected x {k:g}, a factor of R (the replicate group's size): "
                        "with group.gradient_divide_factor set, the factor divides the sum over "
                        "all R x S ranks once, in the reduce-scatter (its op) or the "
                        "post-division, and the all-reduce across replicas SUMs; without one, "
                        "both collectives average (Note [divide factor], all_reduce_op)")
        return _generic_hint(got, expected, n) or (
            "the average must run over all R x S ranks, with torch's divide factors: AVG in "
            "both collectives for fp32 / bf16, SUM between a pre- and a post-division "
            "otherwise (Note [HSDP], gradient_divide_factors in fsdp2/mixed_precision.py)")
    return None


LAB = Lab(
    id="09",
    title="HSDP: the 2-D gradient reduction",
    skeleton="labs/lab09_hsdp.py",
    seams=(Seam(REDUCE, "minifsdp.fsdp2.reduce", "reduce_grads", "reduce_grads"),),
    notes=("HSDP", "HSDP accumulation", "mixed precision", "divide factor",
           "freeing with resize_", "a shard group of one rank"),
    run=run_lab,
    hint=hint,
    world_sizes=(4, 2),
    oracle="torch's fully_shard on a 2-D DeviceMesh",
    hints=(
        "HSDP averages a gradient over R x S ranks in two hops: within the shard group (the "
        "ranks that hold different rows of the same parameters), then across the replicate "
        "group (the ranks that hold the same rows). Only the second hop crosses nodes, so it "
        "must carry as few bytes as possible. Read Note [HSDP] and Note [HSDP accumulation] "
        "(fsdp2/hsdp.py), and Note [mixed precision] for how torch divides.",
        "Given flat, (S * slot,) in the reduce dtype: reduce-scatter over "
        "group.reduce_scatter_group (the shard group, S = group.world_size ranks, or its copy "
        "under set_separate_reduce_scatter_group), the replicate group group.replicate_group (R = "
        "group.mesh_info.replicate_size; None on a 1-D mesh). torch's factors for N = R S "
        "ranks: fp32 and bf16 let the backend average (ReduceOp.AVG, in both collectives, "
        "nothing else divides); other dtypes divide by pre before and post after, with SUM. "
        "With group.gradient_divide_factor f set, the sum over all R S ranks is divided by f "
        "instead: the reduce-scatter takes f's op and the all-reduce SUMs (Note [divide "
        "factor]). "
        "Over a shard group of one rank there is nothing to scatter: torch issues no "
        "collective there (Note [a shard group of one rank]). "
        "Invariants: the result is (slot,), flat's dtype, summed in the order torch sums; "
        "with group.all_reduce_grads False nothing crosses the replicate group.",
        "pre, post, op = torch's factors for (S, flat.dtype, R, f, force_sum); flat /= pre; "
        "out = empty slot; reduce-scatter flat -> out over the shard group with op (S = 1: "
        "out.copy_(flat), no collective); free "
        "flat's storage; if there is a replicate group: if not all_reduce_grads: add out into "
        "partial_reduce_output (or keep it) and return None; else add a kept partial into "
        "out, clear it, all-reduce out over the replicate group with op (SUM if f is set); "
        "out /= post; return out.",
    ),
)
