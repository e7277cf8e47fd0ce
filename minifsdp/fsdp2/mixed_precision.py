"""Mixed precision for ``fully_shard``: ``MixedPrecisionPolicy`` and its dtype rules (chapter 07).

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters())   # the fp32 shards: the master weights
    loss_fn(model(x), y).backward()               # bf16 compute, gradients averaged in fp32

The same class and semantics as torch 2.14's ``torch.distributed.fsdp.MixedPrecisionPolicy``:
precision is set per *module* (per ``fully_shard`` call), not per op as with autocast, so
activations are saved in the low dtype and casts happen only at module boundaries and in the
collectives' copy-ins.

Note [mixed precision]: the tensors of one parameter and their dtypes, for
``param_dtype=bf16, reduce_dtype=fp32`` on an fp32 model (``fsdp_param.py`` and
``fsdp_param_group.py`` do the work)::

    sharded parameter (DTensor over the padded shard)  fp32  the master weights: the optimizer
                                                             steps them, checkpoints hold them
    all-gather input (my slot) and output buffer       bf16  cast in the copy-in
    unsharded parameter                                bf16  what forward and backward use
    activations, unsharded gradients                   bf16  autograd computes in the params' dtype
    reduce-scatter input and output                    fp32  reduce_dtype; default param_dtype
    sharded gradient (.grad, a DTensor)                fp32  the output cast to the shard's dtype
    Adam's state                                       fp32

Why the cast sits in the all-gather copy-in: the padded shards must be copied into the flat
buffer anyway, and ``slot.copy_(fp32_shard)`` into a bf16 slot *is* the cast -- no extra pass,
no extra buffer. Each rank casts only its own 1/N of the parameters, and the wire and the
N-slot buffer carry 2 bytes per element instead of 4: half of fp32's all-gather traffic.
Casting after the all-gather would move fp32 and need an fp32 N-slot buffer, for nothing.
(torch casts into a flat bf16 temporary with ``_foreach_copy_`` and then copies that in: the
same round-to-nearest-even conversion, so the same bits, plus one slot-sized temporary.)
Gradients mirror this: the reduce-scatter copy-in lays the bf16 gradients into a buffer of
``reduce_dtype`` (``torch._chunk_cat`` casts as it copies), and the output is cast to fp32.

Memory per rank, Psi parameters, Adam: at rest 4 Psi/N (fp32 shards) + 8 Psi/N (Adam) and, from
backward to ``zero_grad``, 4 Psi/N (fp32 grads): ZeRO's 16 Psi / N. ZeRO's mixed-precision
16 Psi is 2 (fp16 params) + 2 (fp16 grads) + 12 (fp32 master copy, m, v) (bf16 alike); here the fp32
sharded parameter *is* the master copy, so nothing is stored twice, and the bf16 copy exists
only transiently, unsharded, for the groups being computed: their parameters, gradients and
all-gather buffers at 2 bytes per element instead of 4 (and activations at half, too). The
reduce-scatter input is 4 bytes per element with an fp32 reduce_dtype, 2 with bf16.

Numerics of reducing in bf16: bf16 keeps 8 significant bits (unit roundoff u = 2^-8). A
reduce-scatter sums N values with N - 1 additions, and gloo rounds every partial sum to
bf16, in ring order, which differs from chunk to chunk: the error is up to about
(N - 1) u sum|g_i|, and small contributions vanish against a large one. Measured on gloo at
N = 3: 1 + 2^-8 + 2^-8 = 1.0078125 is a bf16 number, yet the chunk whose ring adds 1 + 2^-8
first returns 1.0 (1 + 2^-8 rounds to 1, twice). The bf16 gradients are already rounded once
each; an fp32 ``reduce_dtype`` adds no further error in the sum, at twice the reduce-scatter
bytes -- the usual choice at large N. fp16 has a 10-bit mantissa but a range of only 65504:
gloo's AVG is a SUM followed by a division, so N large gradients overflow (measured: the AVG
of 3 x 30000 in fp16 is inf). Hence ``gradient_divide_factors``: fp32 and bf16 use the
backend's AVG; other dtypes divide by about sqrt(N) before the SUM and by the rest after.

An fp32 policy on an fp32 model, and the default policy, must be bitwise identical to no
policy: ``resolve_dtypes`` clamps a ``param_dtype`` equal to the parameter's dtype to
``None`` (no cast) and a ``reduce_dtype`` equal to ``param_dtype`` to ``None`` (reduce in the
gradients' dtype), so the very same operations run (tests/test_fsdp2_mixed_precision.py).

Note [gloo dtypes] (measured, torch 2.14.1, 2 and 3 ranks): float32, float64, float16 and
bfloat16 all-gather and reduce-scatter with SUM and AVG; ``PREMUL_SUM`` is refused for every
dtype; float8 (e4m3fn, e5m2) fails every collective with "Invalid scalar type" -- so
``check_backend`` refuses it at ``fully_shard`` time, naming the dtype and the backend.
NCCL is not checked here (untested on this CPU-only machine; NCCL has bf16 and fp8 types).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp
from torch.utils._pytree import tree_map_only


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """The dtypes of one ``fully_shard`` call (torch's class; Note [mixed precision]).

    Attributes:
        param_dtype: dtype of the unsharded parameters, hence of the all-gather, forward and
            backward. ``None``: the parameters' own dtype. The optimizer always steps the
            sharded parameters in their own dtype.
        reduce_dtype: dtype of the gradient reduce-scatter. ``None``: the gradients' dtype,
            i.e. ``param_dtype``. Without sync (``set_requires_gradient_sync(False)``) the
            unsharded gradients are accumulated in this dtype.
        output_dtype: cast the module's floating-point forward outputs to it (``None``: no).
        cast_forward_inputs: cast the floating-point forward inputs to ``param_dtype``.

    Example:
        >>> p = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        >>> resolve_dtypes(p, torch.float32)      # all-gather in bf16, reduce in bf16 (grads)
        (torch.bfloat16, None)
        >>> resolve_dtypes(MixedPrecisionPolicy(torch.float32), torch.float32)
        (None, None)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


def resolve_dtypes(policy: MixedPrecisionPolicy, orig_dtype: torch.dtype,
                   ) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(param_dtype, reduce_dtype)`` for one parameter of dtype ``orig_dtype``, ``None``
    meaning "no cast" (torch: ``FSDPParam.init_dtype_attrs``). A ``reduce_dtype`` equal to
    ``param_dtype`` is what the gradients already are; a ``param_dtype`` equal to the
    parameter's is no cast, and non-floating parameters are never cast."""
    param_dtype, reduce_dtype = policy.param_dtype, policy.reduce_dtype
    if reduce_dtype == param_dtype:
        reduce_dtype = None
    if param_dtype == orig_dtype or not orig_dtype.is_floating_point:
        param_dtype = None
    return param_dtype, reduce_dtype


@dataclass(frozen=True)
class GroupDtypes:
    """One parameter group's dtypes: ``gather`` (all-gather buffer, unsharded parameters),
    ``orig`` (the sharded parameters and their ``.grad``) and ``reduce`` (the reduce-scatter);
    the last two ``None`` for a frozen group of several dtypes (Note [frozen parameters'
    dtypes])."""

    gather: torch.dtype
    orig: torch.dtype | None
    reduce: torch.dtype | None


def group_dtypes(params: list[tuple[str, torch.dtype, bool]], policy: MixedPrecisionPolicy,
                 group: str) -> GroupDtypes:
    """Check and return the dtypes of a group of ``(name, dtype, requires_grad)`` parameters.

    One flat all-gather buffer needs one dtype (torch falls back to gathering raw bytes; we
    refuse), and the reduce-scatter output is cast back to one dtype (torch refuses too).

    Note [frozen parameters' dtypes]: the reduce and original dtypes come from the trainable
    parameters, read at the first forward (``lazy_init``); frozen ones get no gradient, so
    their dtype is free (pytorch#154103). A group with no trainable parameter at that moment
    -- frozen for a first eval pass or a staged unfreezing -- takes them from its floating
    parameters, so that unfreezing it later reduces in the policy's ``reduce_dtype``
    (torch 2.14.1's ``_init_mp_dtypes``, since pytorch#187376 fixed pytorch#186998; before,
    such a group reduce-scattered in ``param_dtype``); if those disagree, like torch, nothing
    is resolved (``orig`` and ``reduce`` None) and a later reduction is refused. The dtypes
    are not read again: a frozen parameter of another dtype that is unfrozen after the first
    forward fails at the next backward, in torch as here (chapter 11, section 7)."""
    gather: dict[torch.dtype, list[str]] = {}
    for name, dtype, _ in params:
        gather.setdefault(resolve_dtypes(policy, dtype)[0] or dtype, []).append(name)
    if len(gather) > 1:
        found = "; ".join(f"{d}: {', '.join(n[:3])}{' ...' if len(n) > 3 else ''}"
                          for d, n in gather.items())
        fix = ("pass mp_policy=MixedPrecisionPolicy(param_dtype=...) to gather every "
               "floating-point parameter in one dtype, " if policy.param_dtype is None else
               "non-floating parameters are never cast (torch gathers them as bytes), so ")
        raise ValueError(f"fully_shard({group}): one group all-gathers its parameters through "
                         f"one flat buffer of one dtype, but they would be gathered as "
                         f"{found}. To fix: {fix}give the parameters one dtype "
                         "(module.to(dtype)), or shard them in separate fully_shard calls")
    trainable = [d for _, d, grad in params if grad]
    basis = trainable or [d for _, d, _ in params if d.is_floating_point]
    origs = set(basis)
    if trainable and len(origs) > 1:
        raise ValueError(f"fully_shard({group}): trainable parameters of dtypes "
                         f"{sorted(map(str, origs))} in one group; their reduce-scatter output "
                         "is cast back to one dtype (torch refuses this too): give them one "
                         "dtype or shard them in separate fully_shard calls")
    (gather_dtype,) = gather
    if len(origs) != 1:  # frozen, of several dtypes (Note [frozen parameters' dtypes])
        return GroupDtypes(gather_dtype, None, None)
    (orig,) = origs
    return GroupDtypes(gather_dtype, orig, resolve_dtypes(policy, orig)[1] or gather_dtype)


GLOO_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # Note [gloo dtypes]


def check_backend(dtypes: GroupDtypes, process_group: dist.ProcessGroup, device_type: str,
                  group: str) -> None:
    """Refuse, at ``fully_shard`` time, a floating dtype that gloo cannot all-gather or
    reduce-scatter (Note [gloo dtypes]): otherwise the first forward fails inside gloo with
    "Invalid scalar type" -- on the ranks that get that far, while the others wait."""
    backend = str(dist.get_backend(process_group))
    if device_type != "cpu" and backend != "gloo":  # NCCL (or another accelerator backend)
        return
    for what, dtype in (("all-gather the parameters in", dtypes.gather),
                        ("reduce-scatter the gradients in", dtypes.reduce)):
        if dtype is not None and dtype.is_floating_point and dtype not in GLOO_DTYPES:
            raise ValueError(
                f"fully_shard({group}): the {backend!r} backend cannot {what} {dtype} (torch "
                f"{torch.__version__.split('+')[0]}'s gloo supports "
                f"{', '.join(str(d) for d in GLOO_DTYPES)} for these collectives; float8 "
                "fails with 'Invalid scalar type'). Choose param_dtype / reduce_dtype among "
                "those, or run on GPUs with NCCL")


def gradient_divide_factors(world_size: int, reduce_dtype: torch.dtype,
                            replicate_size: int = 1, factor: float | None = None,
                            force_sum: bool = False) -> tuple[float | None, float | None, Any]:
    """``(pre, post, op)``: divide the reduce-scatter input by ``pre``, reduce with ``op``,
    divide the output by ``post`` -- together an average over ``world_size`` ranks (torch:
    ``_get_gradient_divide_factors``). fp32 and bf16 have fp32's range: let the backend
    average (AVG; SUM at N = 1, where NCCL's AVG has been unreliable). Other dtypes (fp16)
    could overflow in the sum (Note [mixed precision]): divide by about sqrt(N) first.

    HSDP (``replicate_size`` R > 1, Note [HSDP] in ``hsdp.py``): ``op`` is also the
    all-reduce's, which runs between the reduce-scatter and ``post``; N is then R S (torch's
    ``data_parallel_size``): AVG twice for fp32 / bf16, else ``pre`` and ``post`` over R S.

    Note [divide factor]: ``factor`` (``FSDPModule.set_gradient_divide_factor``) divides the
    sum by ``factor`` instead of N, e.g. a token count, or N x the micro-batches. fp32 / bf16
    then reduce with AVG when ``factor`` is N, else NCCL's ``PREMUL_SUM(1 / factor)``, which
    scales inside the collective and which gloo does not have (torch refuses it there, as we
    do). ``force_sum`` (``set_force_sum_reduction_for_comms``) asks for SUM in every case,
    scaling before and after the collective instead (NCCL's zero-copy transfers, gloo); the
    division then moves after the reduction, or around it for fp16. A world of one runs no
    collective: the input is only divided by ``factor`` (torch copies ``input / factor``; with
    ``force_sum`` or fp16 torch 2.14 then also applies its post-factor, dividing twice; we
    divide once).
    Under HSDP (``replicate_size`` R > 1) ``factor`` divides the sum over all R S ranks, as on a
    1-D mesh of R S ranks (pytorch#155903, fixed by pytorch#155915): ``op`` (AVG only when
    ``factor`` is the shard size S, else PREMUL_SUM, or SUM with ``force_sum``) is the
    reduce-scatter's, and the all-reduce across replicas then SUMs (``all_reduce_op``). So
    the mean is ``factor = R S``; the shard size S gives R times the gradient (chapter 11,
    section 8). HSDP with S = 1 and a factor is refused: torch runs no reduce-scatter there
    and divides twice under ``force_sum``.

    Example:
        >>> gradient_divide_factors(4, torch.float16)
        (2, 2.0, <RedOpType.SUM: 0>)
        >>> gradient_divide_factors(2, torch.float16, replicate_size=2)   # HSDP 2 x 2
        (2, 2.0, <RedOpType.SUM: 0>)
        >>> gradient_divide_factors(4, torch.float32, factor=8.0, force_sum=True)
        (None, 8.0, <RedOpType.SUM: 0>)
    """
    ranks = world_size * replicate_size
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if factor is not None and replicate_size > 1 and world_size == 1:
        raise NotImplementedError("set_gradient_divide_factor on an HSDP mesh with a shard group "
                                  "of 1: torch runs no reduce-scatter and divides twice there "
                                  "under force_sum; minifsdp refuses it (Note [divide factor])")
    if factor is not None and ranks == 1 and not overflow_risk:
        return None, factor, ReduceOp.SUM  # no collective: the input over factor
    if not overflow_risk and not force_sum:
        if factor is None:
            return None, None, ReduceOp.AVG if ranks > 1 else ReduceOp.SUM
        if factor == world_size:
            return None, None, ReduceOp.AVG
        return None, None, dist._make_nccl_premul_sum(1 / factor)
    if factor is None:
        factor = float(ranks)
    if not overflow_risk:
        return None, factor, ReduceOp.SUM  # post-divide: less data than pre
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return pre, factor / pre, ReduceOp.SUM


def all_reduce_op(op: Any, factor: float | None) -> Any:
    """HSDP's all-reduce op, given the reduce-scatter's ``op`` from ``gradient_divide_factors``:
    the same op, but SUM under ``set_gradient_divide_factor`` -- the reduce-scatter (or the
    post-division) already divides by the whole ``factor`` (Note [divide factor]; torch:
    ``_get_gradient_divide_factors``' fourth value)."""
    return op if factor is None else ReduceOp.SUM


def divide_if_needed(tensor: torch.Tensor, factor: float | None) -> None:
    if factor is not None and factor != 1:
        tensor.div_(factor)


# ---- forward inputs and outputs -----------------------------------------------------------------

def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor in ``tree`` (tuples, lists, dicts) cast to ``dtype``;
    integer tensors (token ids, labels) and other leaves unchanged."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
                         tree)


def register_forward_casts(module: nn.Module, policy: MixedPrecisionPolicy) -> None:
    """Install the policy's input and output casts as forward hooks on ``module``.

    Called by ``fully_shard`` *after* ``FSDPState`` installed its hooks: the pre-hook is
    prepended, so inputs are cast before FSDPState wraps them for its post-backward barrier
    (as torch does: the barrier then sees bf16 inputs); the post-hook is appended, so the
    output cast comes after FSDPState's pre-backward hooks were put on the uncast outputs --
    the gradient of a cast output flows back through the cast into those hooks, as torch.
    """
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        def cast_inputs(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return cast_floating((args, kwargs), policy.param_dtype)

        module.register_forward_pre_hook(cast_inputs, prepend=True, with_kwargs=True)
    if policy.output_dtype is not None:
        module.register_forward_hook(
            lambda module, args, output: cast_floating(output, policy.output_dtype))
