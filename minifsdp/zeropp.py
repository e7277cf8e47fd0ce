"""ZeRO++ on FSDP2: qwZ, hpZ and qgZ through torch's own extension points (chapter 12).

ZeRO++ (Wang et al., arXiv 2306.10209; DeepSpeed's blog ``blogs/zeropp``) cuts ZeRO-3's three
collectives per step -- forward all-gather M, backward all-gather M, gradient reduce-scatter M,
M = the model in fp16 bytes -- to 0.5M + 0 + 0.25M across nodes. Each technique is one knob of
FSDP2, so this module adds only the two pieces torch leaves to the user::

    qwZ  forward all-gather in int8      QuantizedWeight: fsdp_pre/post_all_gather (extensions)
    hpZ  backward all-gather in the node fully_shard(..., reshard_after_forward=k)  (no code here)
    qgZ  reduce-scatter as int4 all-to-all   QuantizedReduceScatter: torch's ReduceScatter
                                         protocol, for FSDPModule.set_custom_reduce_scatter

Notes defined here: Note [block quantization], Note [qwZ], Note [hpZ is reshard to k],
Note [qgZ], Note [wire bytes of ZeRO++].

Note [block quantization]: a flat fp32 tensor is cut into blocks of B consecutive elements
(the last one padded with zeros); block b gets ``scale_b = amax_b / qmax`` (qmax = 127 for
int8, 7 for int4; a block of zeros gets scale 1), and ``q = clamp(round(x / scale_b), +-qmax)``.
Symmetric, round to nearest even. Dequantized ``q * scale_b`` differs from x by at most half a
step, ``scale_b / 2``, plus fp32's roundings of ``x / scale`` and ``q * scale`` (relative 2^-24
each, |q| <= 127): ``|x - q * scale| <= scale * (1/2 + 2^-16)`` -- ``error_bound``. One scale
per block, not per tensor, so an outlier spoils only its own B elements (the paper's
block-based quantization; DeepSpeed's qgZ cuts a 2-D gradient into max(rows, columns, world
size) groups, ``intra_quant_group`` in ``all_to_all_quant_reduce``, each about as long as the
smaller dimension).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp

from minifsdp import comm
from minifsdp.fsdp2.extensions import ExtensionWeight, write_unsharded

QWZ_BLOCK = 64  # elements per scale for the weights (Note [qwZ])


def qmax(bits: int) -> int:
    """The largest |q| of a symmetric ``bits``-bit code: 127 for 8, 7 for 4."""
    if bits not in (4, 8):
        raise ValueError(f"zeropp: bits must be 4 or 8, got {bits!r}")
    return 2 ** (bits - 1) - 1


@torch.no_grad()
def quantize_blocks(x: torch.Tensor, block: int, bits: int = 8,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Note [block quantization] of ``x`` (any shape, flattened): ``(q, scales)``, ``q`` int8
    with ``x``'s numel, ``scales`` fp32 with ``ceil(numel / block)`` entries.

    Example:
        >>> q, s = quantize_blocks(torch.tensor([1.0, -0.5, 0.25, 2.0]), block=2)
        >>> q.tolist(), s.tolist()
        ([127, -64, 16, 127], [0.007874015718698502, 0.015748031437397003])
    """
    if block < 1:
        raise ValueError(f"quantize_blocks: block must be >= 1, got {block}")
    flat = x.detach().reshape(-1).to(torch.float32)
    n, top = flat.numel(), qmax(bits)
    nb = -(-n // block)
    rows = torch.cat([flat, flat.new_zeros(nb * block - n)]).view(nb, block)
    amax = rows.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    q = torch.round(rows / scales[:, None]).clamp_(-top, top).to(torch.int8)
    return q.reshape(-1)[:n], scales


@torch.no_grad()
def dequantize_blocks(q: torch.Tensor, scales: torch.Tensor, block: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Flat ``q * scale`` of each block, computed in fp32, then cast to ``dtype``.

    Example:
        >>> dequantize_blocks(*quantize_blocks(torch.tensor([1.0, -0.5, 0.25, 2.0]), 2), 2)
        tensor([ 1.0000, -0.5039,  0.2520,  2.0000])
    """
    flat = q.reshape(-1).to(torch.float32)
    n, nb = flat.numel(), scales.numel()
    rows = torch.cat([flat, flat.new_zeros(nb * block - n)]).view(nb, block)
    return (rows * scales[:, None]).reshape(-1)[:n].to(dtype)


def error_bound(scales: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    """Per element, the most ``dequantize(quantize(x))`` can differ from x in fp32:
    ``scale * (1/2 + 2^-16)`` of its block (Note [block quantization])."""
    return scales.repeat_interleave(block)[:numel] * (0.5 + 2.0 ** -16)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Two int4 codes (-8..7) per byte, element 2i in the low nibble: ``ceil(n / 2)`` uint8.

    Example:
        >>> unpack_int4(pack_int4(torch.tensor([-7, 3, 7], dtype=torch.int8)), 3).tolist()
        [-7, 3, 7]
    """
    flat = q.reshape(-1).to(torch.int16) & 0xF
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of ``pack_int4``: the first ``numel`` codes, int8, sign restored."""
    b = packed.to(torch.int16)
    codes = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:numel]
    return torch.where(codes >= 8, codes - 16, codes).to(torch.int8)


# ----------------------------------------------------------------------------------- qwZ

class QuantizedWeight(ExtensionWeight):
    """A parameter whose FSDP all-gather sends int8 codes and fp32 block scales (Note [qwZ]).

    Note [qwZ]: every unshard, each rank quantizes its *own* fp32 shard (Note [block
    quantization], blocks of ``QWZ_BLOCK`` along the flattened shard, so no scale needs an
    agreement across ranks -- unlike chapter 07's per-tensor fp8 scale, no amax all-reduce);
    the group's all-gather carries the codes, 1 byte per element, in its one uint8 buffer
    (Note [all-gather extensions] in ``fsdp2/fsdp_param.py``), and the pre-hook all-gathers
    the fp32 scales itself, 4 bytes per block, as Float8Weight's hook all-reduces its amax:
    minifsdp wants every all-gather input of an extension in the padded shard's shape (torch
    only for uneven shards), which the scales are not. The copy-out dequantizes rank by rank
    with each rank's own scales into ``param_dtype``. Backward is straight-through: the
    gradient w.r.t. the dequantized weight goes to the fp32 master shard. The master weights
    stay fp32, so the error does not accumulate over steps: each step's forward sees the
    master within ``error_bound`` (then rounded to ``param_dtype``). DeepSpeed quantizes the
    same place: ``zero_quantized_weights`` in its ZeRO-3 all-gather of the fp16 partitions.
    Shards must be even (dim 0 divisible by N): torch hands the hook the unpadded local shard,
    minifsdp the padded one, and only even shards make them -- and every rank's number of
    scales, which the scales' all-gather needs -- the same.

    Example:
        >>> lin = nn.Linear(4, 4)
        >>> lin.weight = nn.Parameter(QuantizedWeight(lin.weight.detach()))
        >>> type(lin.weight).__name__, type(lin.weight * 2).__name__
        ('QuantizedWeight', 'Tensor')
    """

    def fsdp_pre_all_gather(self, mesh, outer_size: torch.Size, outer_stride: tuple[int, ...],
                            module: nn.Module, mp_policy: Any,
                            ) -> tuple[tuple[torch.Tensor, ...], Any]:
        """``((int8 codes of this shard,), (every rank's scales, N, shard shape))``: the
        codes go into FSDP's all-gather, the scales into one of their own, here."""
        n = mesh.size()
        if outer_size[0] % n:
            raise ValueError(f"QuantizedWeight: a parameter of shape {tuple(outer_size)} shards "
                             f"unevenly over {n} ranks; qwZ needs dim 0 divisible by {n} "
                             "(Note [qwZ]): leave this parameter unquantized")
        q, scales = quantize_blocks(self, QWZ_BLOCK, 8)
        every = scales.new_empty(n * scales.numel())
        comm.all_gather_into_tensor(every, scales, group=mesh.get_group())  # tagged by the caller
        return (q.view(self.shape),), (every, n, tuple(self.shape))

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Dequantize each rank's piece with its own scales; the unsharded parameter in
        ``param_dtype`` (first call), or written into ``out`` (later calls)."""
        (codes,), (scales, n, shape) = all_gather_outputs, metadata
        codes, scales = codes.reshape(n, -1), scales.reshape(n, -1)
        full = torch.cat([dequantize_blocks(codes[r], scales[r], QWZ_BLOCK, param_dtype)
                          for r in range(n)]).view(n * shape[0], *shape[1:])
        if out is None:
            return full, (full,)
        write_unsharded(out, full)
        return None


def enable_qwz(model: nn.Module) -> list[str]:
    """Make every floating-point parameter of ``model`` a ``QuantizedWeight`` (DeepSpeed's
    qwZ quantizes all of them); call before ``fully_shard``. Returns the names.

    Example:
        >>> enable_qwz(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
        ['0.bias', '0.weight', '1.bias', '1.weight']
    """
    names = []
    for mname, m in model.named_modules():
        for attr, p in list(m.named_parameters(recurse=False)):
            if p.is_floating_point() and not isinstance(p, QuantizedWeight):
                setattr(m, attr, nn.Parameter(QuantizedWeight(p.detach()), p.requires_grad))
                names.append(f"{mname}.{attr}" if mname else attr)
    return sorted(names)


# ----------------------------------------------------------------------------------- hpZ
"""
Note [hpZ is reshard to k]: hpZ keeps a secondary copy of the weights sharded over the k
ranks of a node, so backward gathers them inside the node. FSDP2's
``reshard_after_forward=k`` is exactly that (Note [reshard to k ranks] in fsdp2/hsdp.py):
after forward each rank keeps 1/k of the unsharded parameters, and backward all-gathers
over the k-rank groups ``DeviceMesh(mesh.mesh.view(-1, k))`` -- contiguous ranks, one node
when ranks are numbered node by node (torchrun's default). The values are the same, only
the group changes, so training is bitwise that of ``True``; the price is P/k more elements per
rank (param_dtype) between forward and backward, beside the P/N shard. Unlike DeepSpeed's hpZ
(``zero_hpz_partition_size``), the copy lives only from forward to backward, and it cannot follow a
QuantizedWeight: the extension rebuilds its parameter from its own all-gather outputs, so
both torch and minifsdp refuse ``reshard_after_forward=k`` for it (Note [qwZ]).
"""


# ----------------------------------------------------------------------------------- qgZ

class QuantizedReduceScatter:
    """qgZ as torch's ``ReduceScatter`` comm (``_fsdp_api.py``): quantize, all-to-all,
    dequantize, sum in fp32. Pass it to ``FSDPModule.set_custom_reduce_scatter``.

    Note [qgZ]: the reduce-scatter input is N chunks, chunk j destined for rank j. Each rank
    block-quantizes every chunk on its own (``bits`` = 4 packs two codes a byte, 8 one) and
    one ``all_to_all`` sends chunk j's codes to rank j, a second one its fp32 scales; rank j
    then holds every rank's codes for its chunk, dequantizes them and adds them in fp32 in
    rank order 0..N-1 -- one quantization per contribution, never a sum of quantized sums
    (the paper's point against a ring or tree of quantized reductions). ``op`` AVG divides the
    fp32 sum by N once. Error against the exact sum: at most the sum over ranks of their
    blocks' ``error_bound`` (divided by N for AVG), plus the fp32 sum's and the output dtype's
    roundings. This is the 1-hop form; DeepSpeed's ``all_to_all_quant_reduce``
    (``deepspeed/runtime/comm/coalesced_collectives.py``) runs two hops -- int4 all-to-all
    inside the node, reduce, re-quantize, all-to-all across nodes -- so a node sends
    M/Z instead of N_gpu * M/Z across (Z = 4 for int4 from fp16; the blog's accounting).

    Example (inside a torchrun worker)::

        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh).set_custom_reduce_scatter(QuantizedReduceScatter(4))
    """

    def __init__(self, bits: int = 4, block: int = 64, tag: str = "qgZ") -> None:
        qmax(bits)
        self.bits, self.block, self.tag = bits, block, tag

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A plain buffer (torch's default comm does the same)."""
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any = ReduceOp.SUM, async_op: bool = False):
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"QuantizedReduceScatter: op {op!r} is not SUM or AVG; set "
                             "gradient_divide_factor to None (qgZ divides the fp32 sum)")
        n = dist.get_world_size(group)
        if input_tensor.numel() != n * output_tensor.numel():
            raise ValueError(f"QuantizedReduceScatter: input has {input_tensor.numel()} "
                             f"elements, output {output_tensor.numel()}; need input = "
                             f"{n} x output")
        c = output_tensor.numel()
        pieces = [quantize_blocks(chunk, self.block, self.bits)
                  for chunk in input_tensor.reshape(n, c)]
        codes = torch.stack([pack_int4(q) if self.bits == 4 else q.view(torch.uint8)
                             for q, _ in pieces])
        scales = torch.stack([s for _, s in pieces])
        got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
        comm.all_to_all_single(got_codes, codes, group=group, tag=f"{self.tag} codes")
        comm.all_to_all_single(got_scales, scales, group=group, tag=f"{self.tag} scales")
        total = torch.zeros(c, dtype=torch.float32, device=output_tensor.device)
        for r in range(n):  # rank order: the same sum on every run
            q = unpack_int4(got_codes[r], c) if self.bits == 4 else got_codes[r].view(torch.int8)
            total += dequantize_blocks(q, got_scales[r], self.block)
        if op == ReduceOp.AVG:
            total /= n
        output_tensor.copy_(total.view_as(output_tensor))
        return None


# ----------------------------------------------------------------------------------- bytes

def wire_bytes(numel: int, n: int, *, kind: str, dtype_bytes: int = 2, block: int = 64,
               bits: int = 8) -> float:
    """Bytes one rank sends for one group in one collective, by the Note below.

    Note [wire bytes of ZeRO++]: what one rank sends for one group of ``numel`` (evenly
    sharded) elements in one collective over ``n`` ranks, as ``minifsdp.comm`` counts it
    (Note [bytes vs wire bytes]: ring all-gather, direct all-to-all).

        "all_gather"      (n-1)/n * numel * dtype_bytes               baseline, hpZ (n = k)
        "qwz_all_gather"  (n-1)/n * (numel + 4 * n * ceil(numel/n / block))   int8 + scales
        "qgz_all_to_all"  (n-1) * (ceil(c * bits/8) + 4 * ceil(c / block)),  c = numel / n

    Example:
        >>> wire_bytes(4096, 4, kind="qwz_all_gather") / wire_bytes(4096, 4, kind="all_gather")
        0.53125
    """
    if kind == "all_gather":
        return (n - 1) / n * numel * dtype_bytes
    shard = numel // n
    if kind == "qwz_all_gather":
        return (n - 1) / n * (numel + 4 * n * -(-shard // block))
    if kind == "qgz_all_to_all":
        return (n - 1) * (-(-shard * bits // 8) + 4 * -(-shard // block))
    raise ValueError(f"wire_bytes: unknown kind {kind!r}")
