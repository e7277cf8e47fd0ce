"""Lab 09's planted bugs: HSDP reductions a learner plausibly writes (Note [HSDP], Note [HSDP
accumulation], Note [mixed precision], Note [freeing with resize_]).

Each function replaces the seam (``@replaces``); tests/planted.py checks that the checker
rejects it and points where the bug shows first, at N = 2 (meshes 2 x 1 and 1 x 2: the cheap
job) except post_divides_before_the_all_reduce (only N = 4 has an fp16 post-factor other than 1),
the two divide-factor bugs (only the 2 x 2 mesh has a factor and replicas) and
all_reduces_first (on 2 x 1 nothing is scattered, so all-reducing first is right there).
"""

import torch

from minifsdp import comm
from minifsdp.fsdp2.mixed_precision import divide_if_needed, gradient_divide_factors
from minifsdp.labs.seams import replaces
from minifsdp.memory import tag


def _factors(group, flat):
    return gradient_divide_factors(group.world_size, flat.dtype, group.mesh_info.replicate_size)


def _scatter(group, flat, op, *, over_one_rank=False, free=True):
    """Done right (Note [a shard group of one rank]: no collective over one rank; ``flat``
    freed) unless ``over_one_rank`` or not ``free``."""
    out = flat.new_empty(flat.numel() // group.world_size)
    tag(out, "grads")
    if group.world_size == 1 and not over_one_rank:
        out.copy_(flat)
    else:
        comm.reduce_scatter_tensor(out, flat, op, group.reduce_scatter_group)
    if free:
        flat.untyped_storage().resize_(0)
    return out


def _keep(group, out):
    """Note [HSDP accumulation], done right (the bugs below differ elsewhere)."""
    if group.partial_reduce_output is None:
        group.partial_reduce_output = out
    else:
        group.partial_reduce_output += out


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def all_reduces_first(group, flat):
    """All-reduces the whole ``flat`` across the replicas, then reduce-scatters within the shard
    group: the same average in exact arithmetic, but S times the bytes cross the slow links --
    the cost HSDP exists to avoid (Note [HSDP])."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    if group.replicate_group is not None and group.all_reduce_grads:
        comm.all_reduce(flat, op, group.replicate_group)
    out = _scatter(group, flat, op)
    if group.replicate_group is not None and not group.all_reduce_grads:
        _keep(group, out)
        return None
    divide_if_needed(out, post)
    return out


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def divides_twice(group, flat):
    """Lets both collectives average (AVG) and then divides by R once more, as if the
    all-reduce only summed: the gradients come out R times too small (Note [HSDP]: AVG then
    AVG is already the average over R S ranks)."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op)
    if group.replicate_group is not None:
        if not group.all_reduce_grads:
            _keep(group, out)
            return None
        if group.partial_reduce_output is not None:
            out += group.partial_reduce_output
            group.partial_reduce_output = None
        comm.all_reduce(out, op, group.replicate_group)
        out /= group.mesh_info.replicate_size
    divide_if_needed(out, post)
    return out


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def forgets_the_all_reduce(group, flat):
    """Reduce-scatters within the shard group and stops: each replica keeps the average of its
    own node only, and the replicas drift apart (Note [HSDP])."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op)
    divide_if_needed(out, post)
    return out


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def all_reduces_in_bf16(group, flat):
    """Casts the slot to bf16 for the inter-node all-reduce to halve its bytes, and back: the
    policy's fp32 reduce dtype is silently dropped on the slow links (Note [mixed precision]:
    the reduce dtype is the dtype of every reduction)."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op)
    if group.replicate_group is not None:
        if not group.all_reduce_grads:
            _keep(group, out)
            return None
        if group.partial_reduce_output is not None:
            out += group.partial_reduce_output
            group.partial_reduce_output = None
        low = out.to(torch.bfloat16)
        comm.all_reduce(low, op, group.replicate_group)
        out.copy_(low)
    divide_if_needed(out, post)
    return out


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def ignores_set_requires_all_reduce(group, flat):
    """Always all-reduces: right values, but the slow links carry one all-reduce per
    micro-batch instead of one per step (Note [HSDP accumulation])."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op)
    if group.replicate_group is not None:
        comm.all_reduce(out, op, group.replicate_group)
    divide_if_needed(out, post)
    return out


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def scatters_over_the_replicate_dim(group, flat):
    """Swaps the mesh dims: reduce-scatters over the replicate group and all-reduces over the
    shard group, as if dim 0 sharded (Note [HSDP]: dim 0 replicates, dim 1 shards)."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = flat.new_empty(flat.numel() // group.world_size)
    comm.reduce_scatter_tensor(out, flat, op, group.replicate_group)
    comm.all_reduce(out, op, group.process_group)
    divide_if_needed(out, post)
    return out



@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def reduce_scatters_over_one_rank(group, flat):
    """Reduce-scatters over the shard group whatever its size: right values, but on a mesh
    (R, 1) a collective over one rank per group per step, which torch does not issue (Note [a
    shard group of one rank])."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op, over_one_rank=True)
    return _across_replicas(group, out, op, post)


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def keeps_flat(group, flat):
    """Reduces right but never frees ``flat``: the learner drops it with the function's return,
    trusting the garbage collector -- while the caller and gloo's thread still hold it, so a
    whole unsharded gradient's bytes outlive every reduction (the contract: resize_(0) once the
    reduce-scatter returns; Note [freeing with resize_])."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op, free=False)
    return _across_replicas(group, out, op, post)


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def overwrites_the_partial_sum(group, flat):
    """Keeps each micro-batch's slot under set_requires_all_reduce(False) by storing it in
    ``partial_reduce_output`` instead of adding: with two such micro-batches before the synced
    one, the first one's gradients are lost (Note [HSDP accumulation]: the kept slot is a sum
    over every backward since the last all-reduce)."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op)
    if group.replicate_group is not None:
        if not group.all_reduce_grads:
            group.partial_reduce_output = out
            return None
        if group.partial_reduce_output is not None:
            out += group.partial_reduce_output
            group.partial_reduce_output = None
        comm.all_reduce(out, op, group.replicate_group)
    divide_if_needed(out, post)
    return out


def _across_replicas(group, out, op, post):
    """The second hop done right (the bugs around it differ before it): keep or fold in the
    partial sum, all-reduce across the replicas with ``op``, divide by ``post``."""
    if group.replicate_group is not None:
        if not group.all_reduce_grads:
            _keep(group, out)
            return None
        if group.partial_reduce_output is not None:
            out += group.partial_reduce_output
            group.partial_reduce_output = None
        comm.all_reduce(out, op, group.replicate_group)
    divide_if_needed(out, post)
    return out


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def pre_divides_after_the_reduce_scatter(group, flat):
    """Divides by ``pre`` after the reduce-scatter, on the S-times smaller slot (fewer
    divisions): the same numbers in exact arithmetic, but the fp16 sum over the shard group
    overflows to inf where torch's pre-divided one does not -- avoiding that is why fp16
    pre-divides at all (Note [mixed precision])."""
    pre, post, op = _factors(group, flat)
    out = _scatter(group, flat, op)
    divide_if_needed(out, pre)
    return _across_replicas(group, out, op, post)


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def post_divides_before_the_all_reduce(group, flat):
    """Finishes the average within the node -- divides by ``post`` before the all-reduce -- so
    that the replicas only sum: exact for normal fp16 numbers (the factors are powers of two),
    but each replica's subnormal sums lose their last bit before they are added (Note [mixed
    precision]: torch divides by post once, after the all-reduce). Shows only at N = 4, where
    post = 2 (at N = 2, post = 1)."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op)
    if group.replicate_group is not None:
        if not group.all_reduce_grads:
            _keep(group, out)
            return None
        if group.partial_reduce_output is not None:
            out += group.partial_reduce_output
            group.partial_reduce_output = None
        divide_if_needed(out, post)
        comm.all_reduce(out, op, group.replicate_group)
        return out
    divide_if_needed(out, post)
    return out


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def ignores_the_divide_factor(group, flat):
    """Takes torch's factors for an average over R x S ranks and never reads
    ``group.gradient_divide_factor``: right until ``set_gradient_divide_factor`` is called,
    then the mean instead of the sum divided by the factor (Note [divide factor]). Shows only
    at N = 4: on 1 x 2 the factor S is the world size, and 2 x 1 refuses a factor."""
    pre, post, op = _factors(group, flat)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op)
    return _across_replicas(group, out, op, post)


@replaces("fsdp2.reduce_grads")
@torch.no_grad()
def all_reduces_with_the_scatter_op(group, flat):
    """Reads the factor, but all-reduces across the replicas with the reduce-scatter's op, as
    without one: under ``set_gradient_divide_factor(S)`` that op is AVG, so the replicas'
    sum is divided by R once more; torch SUMs there (``all_reduce_op``, Note [divide factor])."""
    pre, post, op = gradient_divide_factors(
        group.world_size, flat.dtype, group.mesh_info.replicate_size,
        group.gradient_divide_factor, group.force_sum_reduction_for_comms)
    divide_if_needed(flat, pre)
    out = _scatter(group, flat, op)
    return _across_replicas(group, out, op, post)


CASE_FP32 = "HSDP on a 2 x 1 mesh, fp32: 3 Adam steps against torch's fully_shard"
CASE_ACCUM = ("HSDP on a 2 x 1 mesh, bf16 parameters, fp32 reduce, 3 micro-batches, "
              "set_requires_all_reduce(False) on the first 2: 3 Adam steps against torch's "
              "fully_shard")
FP16 = ("fp32 parameters, fp16 reduce (pre- and post-division), the loss scaled by 125000 on "
        "replicate 0 at step 0 (an fp16 sum without the pre-division overflows) and by 2^-14 at "
        "step 1 (fp16 subnormals): 3 Adam steps against torch's fully_shard")
FACTOR = ("HSDP on a 2 x 2 mesh, fp32, set_gradient_divide_factor(S) on every group (the "
          "factor's op in the reduce-scatter, SUM across replicas): 3 Adam steps against torch's "
          "fully_shard")
COLLECTIVES = "the reduction's collectives in backward (op, group size, dtype, numel)"
EXPECTED = {
    # on 2 x 1 all-reducing first is right: nothing is scattered (the 2 x 2 mesh shows it)
    "all_reduces_first": dict(status="diverged", world_sizes=(4,),
                              case="HSDP on a 2 x 2 mesh, fp32: 3 Adam steps against torch's "
                                   "fully_shard", name=COLLECTIVES, step=0, phase="backward",
                              hint="the all-reduce came first"),
    "divides_twice": dict(status="diverged", world_sizes=(2,), case=CASE_FP32,
                          name="scale.grad", step=0, phase="backward",
                          hint="divided by the world size once too often"),
    "forgets_the_all_reduce": dict(status="diverged", world_sizes=(2,), case=CASE_FP32,
                                   name=COLLECTIVES, step=0, phase="backward",
                                   hint="no all-reduce across the replicate group"),
    "all_reduces_in_bf16": dict(status="diverged", world_sizes=(2,), case=CASE_FP32,
                                name=COLLECTIVES, step=0, phase="backward",
                                hint="another dtype than the reduce dtype"),
    "ignores_set_requires_all_reduce": dict(
        status="diverged", world_sizes=(2,), step=0, phase="backward", case=CASE_ACCUM,
        name=COLLECTIVES + ", without the all-reduce", hint="Note [HSDP accumulation]"),
    "scatters_over_the_replicate_dim": dict(status="crash", world_sizes=(2,),
                                            where="lab_bugs/lab09.py:142"),
    "reduce_scatters_over_one_rank": dict(status="diverged", world_sizes=(2,), case=CASE_FP32,
                                          name=COLLECTIVES, step=0, phase="backward",
                                          hint="a reduce-scatter over a shard group of one"),
    "keeps_flat": dict(status="diverged", world_sizes=(2,), case=CASE_FP32,
                       name="group root: bytes behind flat after reduce_grads returned", step=0,
                       phase="backward", hint="flat.untyped_storage().resize_(0) once the "
                                              "reduce-scatter returns"),
    "overwrites_the_partial_sum": dict(status="diverged", world_sizes=(2,), case=CASE_ACCUM,
                                       name="scale.grad after 3 micro-batches", step=0,
                                       phase="backward", hint="not stored over it"),
    "pre_divides_after_the_reduce_scatter": dict(
        status="diverged", world_sizes=(2,), case="HSDP on a 1 x 2 mesh, " + FP16,
        name="head.bias.grad", step=0, phase="backward",
        hint="divide flat by the pre-factor *before* the reduce-scatter"),
    "ignores_the_divide_factor": dict(
        status="diverged", world_sizes=(4,), case=FACTOR, name="scale.grad", step=0,
        phase="backward", hint="a factor of R"),
    "all_reduces_with_the_scatter_op": dict(
        status="diverged", world_sizes=(4,), case=FACTOR, name="scale.grad", step=0,
        phase="backward", hint="the all-reduce across replicas SUMs"),
    "post_divides_before_the_all_reduce": dict(
        status="diverged", world_sizes=(4,), case="HSDP on a 2 x 2 mesh, " + FP16,
        name="body.0.weight.grad", step=1, phase="backward",
        hint="post once after the all-reduce"),
}
