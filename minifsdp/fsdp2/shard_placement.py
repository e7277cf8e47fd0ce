"""``fully_shard(..., shard_placement_fn=...)``: a parameter cut on dim i instead of dim 0.

``shard_placement_fn(param)`` returns ``Shard(i)`` or ``None`` (``Shard(0)``), as torch 2.14's
(``_fsdp_param.py``: ``FSDPParam._init_sharded_param``). The use it was made for: a stacked
mixture-of-experts weight ``(E, d, h)`` with fewer experts than ranks, cut on ``d`` or ``h``
so that every rank holds a slice of *every* expert instead of whole experts on some ranks and
nothing on the others. Only the parameter's own layout changes: this module holds the
functions that ``fsdp_param.py``, ``api.py`` and ``reduce.py`` call for it.

Note [Shard(i) layout]: W (2, 6) on dim 1 at N = 3. Rank r's shard is columns 2r, 2r + 1,
copied at init into a contiguous (2, 2) tensor (the padded shard; the all-gather input is it,
flat)::

    W = | a0 a1 | a2 a3 | a4 a5 |     rank 0: a0 a1 / b0 b1  ->  1-D  a0 a1 b0 b1
        | b0 b1 | b2 b3 | b4 b5 |     rank 1: a2 a3 / b2 b3  ->  1-D  a2 a3 b2 b3
          rank 0  rank 1  rank 2      rank 2: a4 a5 / b4 b5  ->  1-D  a4 a5 b4 b5

    all-gather, the group buffer viewed (N, S): world x padded shards, rank-major (the same
    for every placement; this parameter is one column block of it)
        row 0:  ... | a0 a1 b0 b1 | ...
        row 1:  ... | a2 a3 b2 b3 | ...
        row 2:  ... | a4 a5 b4 b5 | ...
    copy-out, 1: the dim-0 copy-out (split_with_sizes_copy, unchanged) fills the unsharded
        buffer, which read as (N * 2, 2) holds the shards stacked on dim 0:
                                                a0 a1 / b0 b1 / a2 a3 / b2 b3 / a4 a5 / b4 b5
    copy-out, 2 (FSDPParam.to_unsharded): chunk a copy of it N ways on dim 0 and cat the
        chunks on dim 1, back into the buffer, the unsharded parameter (2, 6):
                                                a0 a1 a2 a3 a4 a5 / b0 b1 b2 b3 b4 b5
    reduce-scatter copy-in, the inverse: chunk the unsharded gradient G (2, 6) N ways on dim 1
        and cat on dim 0, (N * 2, 2), G's shards stacked as above; the dim-0 copy-in then puts
        its rows 2r, 2r + 1 in slot r, and the reduced slot, viewed (2, 2), is rank r's
        Shard(1) gradient with no copy-out at all.

A Shard(0) parameter needs neither step 2 nor the inverse: its N pieces back to back already
are its rows in order (Note [copy-in and copy-out] in ``fsdp_param_group.py``).

torch's step 1 copies into a staging buffer and its step 2 cats from it into place (two
copies); ours copies into place and re-lays from a clone (three), so that the copy-out -- lab
05's seam, whose source chapter 05 prints -- stays the dim-0 one for every parameter. The bits
are the same (copies round nothing), and the clone is made after ``wait_for_unshard`` freed
the group's all-gather buffer, so the two never coexist.

Why torch keeps the wire format dim-0: ``all_gather_into_tensor`` and ``reduce_scatter_tensor``
concatenate and split their buffer on dim 0 -- NCCL's collectives move flat byte ranges, and
there is no "gather on dim 1". A group has one buffer for parameters of every shape and
placement, so each rank's contribution must be one contiguous slot; with every shard made
contiguous at init, copy-in, the collective and the split are the same code for every
parameter, the all-gather input stays a view of the shard the optimizer steps (Note [who owns
the shard's storage] in ``fsdp_param.py``), and the sharded gradient is a view of the
reduce-scatter output. Only the parameter's side pays: in torch one more copy (and a staging
buffer of its unsharded size) per all-gather, in ours two (above); one more copy of its
gradient per reduce-scatter in both.

Why only even cuts (torch: ``NotImplementedError: FSDP does not support uneven sharding on
dim i``, which we raise too): 4 columns at N = 3 would give 2, 2, 0; padded to 2 each, the
gathered (2, 6) holds padding *inside* every row, so the unsharded (2, 4) parameter is no
longer the first ``numel`` elements of its buffer (Note [padding] in ``fsdp_param.py``): a
third copy per all-gather, and one to pad every gradient; and a short shard (5 columns: 2, 2,
1) would be a non-contiguous slice of its padded (2, 2). Even cuts have no padding at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import Shard

from minifsdp.memory import tag


def chunk_on_dim(tensor: torch.Tensor, world_size: int, dim: int) -> list[torch.Tensor]:
    """``torch.chunk`` on ``dim``, with empty chunks appended up to ``world_size`` (torch's
    ``_chunk_with_empty``; ``chunk_dim0`` for dim 0). Chunk r is rank r's slice, a view.

    Example:
        >>> [tuple(c.shape) for c in chunk_on_dim(torch.zeros(2, 6), 3, 1)]
        [(2, 2), (2, 2), (2, 2)]
    """
    chunks = list(torch.chunk(tensor, world_size, dim=dim))
    return chunks + [tensor.narrow(dim, 0, 0)] * (world_size - len(chunks))


def resolve_shard_dims(named: list[tuple[str, nn.Parameter]],
                       shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
                       shard_size: int, where: str) -> list[int]:
    """The dim each parameter is cut on: ``shard_placement_fn(param)``'s ``Shard(i).dim``
    (negative dims counted from the end, as torch), 0 for ``None`` or without a function.

    Refused, naming the parameter by its path under the module (``where``) -- before any
    parameter is replaced, so an error leaves the module as it was -- as torch refuses them:
    a result that is not a ``Shard`` (torch: ``ValueError``), a dim out of range (torch:
    ``AssertionError``), a dim > 0 that ``shard_size`` does not divide (torch:
    ``NotImplementedError``, Note [Shard(i) layout]). Beyond torch: its ``ShardPlacementResult``
    (a mesh per parameter) and a dim > 0 for an all-gather extension (Note [all-gather
    extensions] in ``fsdp_param.py``), which minifsdp does not build.

    Example:
        >>> w, b = nn.Parameter(torch.zeros(4, 6)), nn.Parameter(torch.zeros(4))
        >>> resolve_shard_dims([("w", w), ("b", b)],
        ...                    lambda p: Shard(-1) if p.ndim == 2 else None, 3, "Linear")
        [1, 0]
    """
    if shard_placement_fn is None:
        return [0] * len(named)
    if not callable(shard_placement_fn):
        raise TypeError(f"fully_shard({where}): shard_placement_fn must be a callable "
                        f"(nn.Parameter) -> Shard | None, got {shard_placement_fn!r}")
    dims = []
    for path, param in named:
        placement = shard_placement_fn(param)
        if placement is None:
            dims.append(0)
            continue
        if type(placement).__name__ == "ShardPlacementResult":
            raise NotImplementedError(
                f"fully_shard({where}): shard_placement_fn returned a ShardPlacementResult for "
                f"{path}: a mesh per parameter is torch's, not minifsdp's; return Shard(i) or "
                "None, and shard parameters on another mesh in a fully_shard call of their own")
        if type(placement) is not Shard:  # _StridedShard is a Shard subclass: not ours either
            raise ValueError(f"fully_shard({where}): shard_placement_fn returned {placement!r} "
                             f"for {path}; it must return Shard(i) or None")
        dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < param.ndim:
            raise ValueError(f"fully_shard({where}): Shard({placement.dim}) for {path} of shape "
                             f"{tuple(param.shape)}: a {param.ndim}-D tensor has dims 0 to "
                             f"{param.ndim - 1} (or -1 to -{param.ndim})")
        if dim > 0 and param.shape[dim] % shard_size:
            raise NotImplementedError(
                f"fully_shard({where}): Shard({placement.dim}) for {path} of shape "
                f"{tuple(param.shape)}: {param.shape[dim]} does not divide evenly over "
                f"{shard_size} ranks. Like torch 2.14, minifsdp shards dims > 0 only evenly "
                "(Note [Shard(i) layout]); shard it on dim 0 (return None) or on a dim that "
                f"{shard_size} divides")
        if dim > 0 and hasattr(param, "fsdp_pre_all_gather"):
            raise NotImplementedError(
                f"fully_shard({where}): {path} is a {type(param).__name__}, an all-gather "
                "extension, whose hooks rebuild it from dim-0 pieces; shard it on dim 0")
        dims.append(dim)
    return dims


# ---- all-gather copy-out, step 2 (called from FSDPParam.to_unsharded) -----------------------

def unsharded_to_shard_dim(p) -> None:
    """Step 2 of the copy-out in Note [Shard(i) layout], in place: ``p``'s unsharded buffer,
    which the dim-0 copy-out filled with the N padded shards stacked on dim 0, re-laid from a
    copy of it: chunked N ways on dim 0, concatenated on ``p.shard_dim`` (torch: the cat in
    ``foreach_all_gather_copy_out``). An in-place write into tensors autograd may have saved,
    restoring the values they had: Note [version counter]."""
    d, shard, world = p.shard_dim, p.padded_sharded_size, p.world_size
    buf = p._unsharded_data
    with torch.no_grad():
        stacked = buf.clone()  # dies here; the group's all-gather buffer is already freed
        tag(stacked, "comm", label="all-gather buffers")
        full = buf.view(*shard[:d], world * shard[d], *shard[d + 1:])
        with torch.autograd._unsafe_preserve_version_counter(buf):
            torch.cat(torch.chunk(stacked.view(world * shard[0], *shard[1:]), world, dim=0),
                      dim=d, out=full)


# ---- reduce-scatter copy-in (called from reduce.foreach_reduce) -----------------------------

def grads_to_dim0_layout(params: list, grads: list[torch.Tensor], world: int) -> None:
    """The inverse for gradients, in place in ``grads``: each Shard(i), i > 0, parameter's
    unsharded gradient chunked ``world`` ways on dim i and concatenated on dim 0, so the
    dim-0 reduce-scatter copy-in puts rank r's shard in slot r (Note [Shard(i) layout];
    torch: in ``foreach_reduce``, before ``foreach_reduce_scatter_copy_in``). The old gradient
    dies here; the new one is a copy of it (``grads``)."""
    if world == 1:  # one chunk: the layouts agree (torch skips this too)
        return
    for j, (p, g) in enumerate(zip(params, grads)):
        if p.shard_dim:
            grads[j] = torch.cat(torch.chunk(g, world, dim=p.shard_dim), dim=0)
            tag(grads[j], "grads")
