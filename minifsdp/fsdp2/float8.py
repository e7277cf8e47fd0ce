"""FP8 all-gather, weight-only: ``Float8Weight`` and ``enable_float8_all_gather`` (chapter 07).

FSDP2's list of what it brings over FSDP1 names "flexible FP8 all-gather": float8 weights
and other parameters mixed in the *same* all-gather. The all-gather is where FSDP spends its
parameter bandwidth; sending 1 byte per element instead of bf16's 2 halves it::

    model = GPT(cfg)
    enable_float8_all_gather(model)                # every nn.Linear weight, before sharding
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model, mesh=mesh, mp_policy=...)   # LayerNorms, embeddings, biases: bf16

Note [FP8 all-gather] (what happens to one ``Float8Weight`` W of a group, every unshard):

    copy-in   amax_r = max |W's padded shard on rank r|         (padding is zeros: harmless)
              amax = all_reduce(amax_r, MAX) over the shard group   4 bytes, one per weight
              scale = 448 / amax (fp32; 448 = float8_e4m3fn's max)   every rank: the same
              fp8 = clamp(shard * scale, -448, 448).to(float8_e4m3fn)  1 byte an element
    all-gather  the fp8 bytes, in the group's one buffer, beside the other parameters' bf16
              or fp32 bytes: the buffer is ``uint8`` (gloo has no float8 type -- Note [gloo
              dtypes] -- and one buffer cannot have two dtypes; torch's is uint8 too then)
    copy-out  unsharded W = fp8.to(fp32) / scale, cast to param_dtype: what forward uses
    backward  autograd's gradient w.r.t. that unsharded W is reduce-scattered into the fp32
              master shard's .grad as usual: a *straight-through* cast (the quantization
              is treated as the identity in backward), which is what torchao does
              (``_ToFloat8ConstrFunc`` and ``_FromFloat8ConstrFunc`` return the gradient
              unchanged).

The scale is per *tensor* and every rank must use the same one, or the N gathered pieces
would be on N different scales: hence the MAX all-reduce, which torchao runs as
``tensor_to_amax(..., reduce_amax=True)`` (one small all-reduce per weight) or, with
``precompute_float8_dynamic_scale_for_fsdp`` after the optimizer step, as one all-reduce for
all weights. We run the simple form: one per weight per unshard (a resharded group gathers
again in backward, from the same master shard: the same scale, the same bits).
The conventions are torchao's (``float8_utils.py``: ``amax_to_scale`` in float64 then fp32,
``EPS`` clamp, ``to_fp8_saturated``): with that scale nothing saturates except by rounding.

Note [where ours is simpler than torchao]: torchao keeps the unsharded weight in fp8 (a
``Float8Tensor``: data + scale) and multiplies in fp8 with ``torch._scaled_mm`` on H100-class
GPUs, so the gather *and* the matmul are cheaper. We dequantize in the copy-out and compute in
``param_dtype`` -- weight-only FP8: the communication saving, not the compute one (and the
rounding error of fp8 weights, which is the point of measuring the loss). And torchao's
weight is a wrapper subclass that survives every op FSDP runs on it (its
``_ops_to_preserve_subclass``); ours only *marks* the parameter (Note [all-gather
extensions] in ``fsdp_param.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import DeviceMesh

from minifsdp import comm
from minifsdp.fsdp2.extensions import ExtensionWeight, write_unsharded

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
EPS = 1e-12  # torchao's: a zero weight gets a huge, finite scale instead of inf


@torch.no_grad()
def amax_to_scale(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale, fp32, 0-d: ``448 / max(amax, EPS)`` computed in float64 as
    torchao's ``amax_to_scale``.

    Example:
        >>> float(amax_to_scale(torch.tensor(2.0)))
        224.0
    """
    return (E4M3_MAX / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)


@torch.no_grad()
def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` (any shape, any float dtype) to float8_e4m3fn: ``clamp(x * scale, +-448)``,
    rounded to nearest even; the same shape (torchao's ``to_fp8_saturated``)."""
    return torch.clamp(x.to(torch.float32) * scale, -E4M3_MAX, E4M3_MAX).to(E4M3)


@torch.no_grad()
def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8 ``data`` back to ``dtype``: ``data.to(fp32) / scale``, then cast (one rounding,
    in fp32, whatever ``dtype`` is; the fp8 -> fp32 conversion is exact).

    Example:
        >>> s = amax_to_scale(torch.tensor(1.0))
        >>> dequantize(quantize(torch.tensor([1.0, 0.5, -0.3]), s), s, torch.float32)
        tensor([ 1.0000,  0.5000, -0.2857])

    (-0.3 * 448 = -134.4; e4m3's 3 mantissa bits leave only -128 and -144 there.)
    """
    return (data.to(torch.float32) / scale).to(dtype)


def quantize_dequantize(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """What forward computes with, from a *full* weight in one process: the scale from the
    whole tensor's amax, then ``dequantize(quantize(...))``. The single-process simulation of
    the Note [FP8 all-gather]: FSDP's unsharded weight equals this bit for bit (the MAX of the
    shards' amaxes is the whole tensor's, and both steps are elementwise)."""
    weight = weight.detach()
    scale = amax_to_scale(weight.abs().amax())
    return dequantize(quantize(weight, scale), scale, dtype or weight.dtype)


class Float8Weight(ExtensionWeight):
    """A parameter whose FSDP all-gather sends float8_e4m3fn (Note [FP8 all-gather]).

    Holds the fp32 (or bf16) master data itself and computes like a plain tensor
    (``ExtensionWeight``). FSDP calls its two hooks, torch's all-gather extension (Note
    [all-gather extensions] in ``fsdp_param.py``); ``self`` is then this rank's padded shard.

    Example:
        >>> lin = nn.Linear(4, 2)
        >>> lin.weight = nn.Parameter(Float8Weight(lin.weight.detach()))
        >>> type(lin.weight).__name__, type(lin.weight * 2).__name__
        ('Float8Weight', 'Tensor')
    """

    def fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size,
                            outer_stride: tuple[int, ...], module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Quantize this rank's padded shard with the scale all ranks agree on.

        Returns ``((fp8 shard,), (scale,))``: the tensors to all-gather (shape of ``self``)
        and the metadata ``fsdp_post_all_gather`` receives. ``mesh``: the shard group's 1-D
        mesh; the other arguments are torch's signature, unused here."""
        amax = self.abs().amax().to(torch.float32)  # the padded shard is never empty
        comm.all_reduce(amax, ReduceOp.MAX, group=mesh.get_group())  # tagged by the caller
        scale = amax_to_scale(amax)
        return (quantize(self, scale),), (scale,)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Dequantize the gathered fp8 (``(N * padded rows, *rest)``) for compute.

        First call (``out=None``): return ``(unsharded, tensors to free at reshard)``, the
        unsharded tensor padded, ``param_dtype``. Later calls: write into ``out`` (the
        unsharded parameter, whose storage FSDP restored) and return ``None``."""
        (data,), (scale,) = all_gather_outputs, metadata
        if out is None:
            unsharded = dequantize(data, scale, param_dtype)
            return unsharded, (unsharded,)
        write_unsharded(out, dequantize(data[: out.shape[0]], scale, param_dtype))
        return None


def enable_float8_all_gather(model: nn.Module, include: Callable[[str, nn.Module], bool] | None
                             = None) -> list[str]:
    """Mark weights for FP8 all-gather: ``module.weight`` becomes a ``Float8Weight`` parameter
    for every submodule ``include(name, module)`` accepts (default: every ``nn.Linear``).
    Call it before ``fully_shard``. A weight shared with other modules (tied embeddings) is
    replaced on all of them, so the tie holds. Returns the marked weights' names.

    Example:
        >>> m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
        >>> enable_float8_all_gather(m)
        ['0.weight', '2.weight']
    """
    include = include or (lambda name, module: isinstance(module, nn.Linear))
    chosen: dict[int, str] = {}  # id(weight) -> its first name
    for name, m in model.named_modules():
        if include(name, m) and isinstance(getattr(m, "weight", None), nn.Parameter):
            chosen.setdefault(id(m.weight), f"{name}.weight" if name else "weight")
    new: dict[int, nn.Parameter] = {}
    for m in model.modules():
        for attr, p in list(m.named_parameters(recurse=False)):
            if id(p) not in chosen or isinstance(p, Float8Weight):
                continue
            if not p.is_floating_point() or p.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"enable_float8_all_gather: {chosen[id(p)]} is {p.dtype}; "
                                 "the master weight of an FP8 all-gather must be float32 or "
                                 "bfloat16")
            if id(p) not in new:
                new[id(p)] = nn.Parameter(Float8Weight(p.detach()), p.requires_grad)
            setattr(m, attr, new[id(p)])
    return sorted(chosen.values())
