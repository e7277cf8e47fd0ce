"""Lab 09: HSDP's gradient reduction on a 2-D mesh. Read Note [HSDP], Note [HSDP accumulation].

Seam "fsdp2.reduce_grads" (minifsdp.fsdp2.reduce.reduce_grads, called by foreach_reduce).
Check: python -m minifsdp.labs 09   (start: --start)   Hints: --hint (1, 2, 3)
Bar: bit for bit with torch's fully_shard on a 2-D DeviceMesh ("replicate", "shard"): a 2 x 2 mesh
at N = 4, then 2 x 1 and 1 x 2 at N = 2; fp32, bf16 parameters with an fp32 reduce (three
micro-batches, the first two under set_requires_all_reduce(False)), an fp16 reduce with the loss
scaled so that a sum without the pre-division overflows (step 0) and into fp16's subnormals
(step 1), fp32 under set_gradient_divide_factor(S) (not on the 2 x 1 mesh); 3 Adam steps: flat's
bytes after each call (0), the reduction's collectives (op, group size, dtype, numel, order),
losses, gradients, parameters.
Also read Note [mixed precision] and Note [divide factor] (torch's divide factors).
"""

import torch

from minifsdp import comm  # noqa: F401  comm.reduce_scatter_tensor / comm.all_reduce (logged)
from minifsdp.memory import tag  # noqa: F401  tag(t, "grads" / "comm"): the memory tracker's books


@torch.no_grad()
def reduce_grads(group, flat):
    """One group's gradients, reduced: returns this rank's slot averaged over all R x S ranks,
    or None while HSDP only accumulates.

    Given: ``flat``, 1-D, ``S * slot`` elements in the reduce dtype, laid out by the copy-in
    (slot r = rank r's rows of every gradient; Note [copy-in and copy-out]); ``group``:
    ``reduce_scatter_group`` (the shard group of ``world_size`` S ranks, or its copy under
    ``set_separate_reduce_scatter_group``: reduce-scatter over it), ``replicate_group`` (R =
    ``mesh_info.replicate_size`` ranks holding the same rows; None on a 1-D mesh),
    ``all_reduce_grads`` (False under ``set_requires_all_reduce(False)``),
    ``partial_reduce_output`` (None, or what an earlier backward kept),
    ``gradient_divide_factor`` (None, or ``set_gradient_divide_factor``'s f: then the sum over
    the R S ranks is divided by f instead of R S), ``force_sum_reduction_for_comms``, ``name``.
    Returns: a new ``(slot,)`` tensor in ``flat``'s dtype (tag it "grads"), this rank's slot
    averaged over the R S ranks exactly as torch averages (the same collectives on the same
    groups in the same order, the same divisions); or None after keeping the shard-group sum
    in ``group.partial_reduce_output`` when ``all_reduce_grads`` is False (HSDP only), to be
    added in before the next all-reduce. Only the slot crosses the replicate group; over a
    shard group of one rank (S = 1) nothing is scattered and no reduce-scatter is issued, as
    in torch. ``flat``'s storage is freed (``flat.untyped_storage().resize_(0)``) once the
    reduce-scatter (or its copy) returns. Notes [HSDP], [HSDP accumulation], [mixed
    precision], [divide factor], [a shard group of one rank] (fsdp_param_group.py).
    """
    # TODO(lab 09): the contract above; `python -m minifsdp.labs 09 --hint` when stuck.
    raise NotImplementedError("lab 09: reduce_grads in labs/lab09_hsdp.py")
