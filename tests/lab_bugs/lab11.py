"""Lab 11's planted bugs: the broken script itself, and fixes a learner plausibly writes that
stop short (chapter 11's sections; Note [unused parameters in a group], Note [divide factor],
Note [forward methods]).

Each function replaces the seam (``@replaces``); tests/planted.py checks that the checker
rejects it where it first shows. ``script`` is the reference script with one switch per fix, so
each bug below differs from the solution in exactly the way its docstring says.
"""

import torch
import torch.nn.functional as F

from minifsdp.labs.ch11 import STEPS, LabLM, full_params, global_batch, prompt
from minifsdp.labs.seams import replaces

CASE = ("the fixed script, 3 SGD steps and a generate(), against the reference with torch's "
        "fully_shard")


def script(fully_shard, register, mesh, rank, world_size, *, shard_head=False,
           unused_on=("experts",), global_count=True, divide_factor=True, force_sum=True,
           register_on="root", experts_apart=False, untie=False, mean_rescaled=False):
    model = LabLM()
    if untie:
        model.head.weight = torch.nn.Parameter(model.emb.weight.detach().clone())
        shard_head = True
    fully_shard(model.body, mesh=mesh)
    if experts_apart:
        for e in model.experts.e:
            fully_shard(e, mesh=mesh)
    else:
        fully_shard(model.experts, mesh=mesh)
    if shard_head:
        fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    mods = {"body": model.body, "experts": model.experts, "root": model}
    if experts_apart:
        mods.update({"e0": model.experts.e[0], "e1": model.experts.e[1]})
        unused_on = ("e0", "e1")
        del mods["experts"]
    if shard_head:
        mods["head"] = model.head
    for name in unused_on:
        mods[name].set_reduce_scatter_unused_params(True)
    for m in mods.values():
        if divide_factor:
            m.set_gradient_divide_factor(1.0)
        if force_sum:
            m.set_force_sum_reduction_for_comms(True)
    if register_on is not None:
        register(mods[register_on], "generate")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = {"losses": [], "params": []}
    for step in range(STEPS):
        x, y = global_batch(step, world_size)
        count = (y != -100).sum()
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        logits = model(x, rank).flatten(0, 1)
        if mean_rescaled:  # the same number in exact arithmetic, rounded in another order
            loss = F.cross_entropy(logits, y.flatten(), ignore_index=-100) * (
                (y != -100).sum() / count)
        elif global_count:
            loss = F.cross_entropy(logits, y.flatten(), ignore_index=-100, reduction="sum") / count
        else:
            loss = F.cross_entropy(logits, y.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["params"].append(full_params(model))
    out["tokens"] = model.generate(prompt(rank), 4, rank)
    return out


@replaces("pitfalls.train")
def the_broken_script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size):
    """The skeleton's broken_train handed in unchanged: the head sharded alone splits the tied
    weight over two groups (Section 5), refused at once."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  shard_head=True, unused_on=(), global_count=False, divide_factor=False,
                  force_sum=False, register_on=None)


@replaces("pitfalls.train")
def each_rank_averages_its_tokens(fully_shard, register_fsdp_forward_method, mesh, rank,
                                  world_size):
    """Every fix but the loss: each rank's mean over its own tokens, with the divide factor at
    1, so FSDP sums means (Section 2, Note [divide factor])."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  global_count=False)


@replaces("pitfalls.train")
def forgets_the_divide_factor(fully_shard, register_fsdp_forward_method, mesh, rank,
                              world_size):
    """Divides by the global count but lets FSDP average the ranks too: every gradient N times
    too small (Section 2, Note [divide factor])."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  divide_factor=False, force_sum=False)


@replaces("pitfalls.train")
def divide_factor_without_force_sum(fully_shard, register_fsdp_forward_method, mesh, rank,
                                    world_size):
    """Sets the divide factor to 1 but not the sum reduction: that needs NCCL's PREMUL_SUM,
    which gloo refuses (Note [divide factor])."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  force_sum=False)


@replaces("pitfalls.train")
def no_unused_params(fully_shard, register_fsdp_forward_method, mesh, rank, world_size):
    """Forgets set_reduce_scatter_unused_params: each rank's expert gradient is summed with the
    other rank's other expert (Section 1, Note [unused parameters in a group])."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  unused_on=())


@replaces("pitfalls.train")
def unused_params_on_the_body(fully_shard, register_fsdp_forward_method, mesh, rank,
                              world_size):
    """Sets the unused-parameters flag on the body, the group that runs before the experts:
    the flag is each group's own, and it reaches a module's own group and the groups below it
    (``recurse=True``: on the root it would reach the experts), never a sibling (Section 1)."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  unused_on=("body",))


@replaces("pitfalls.train")
def generate_not_registered(fully_shard, register_fsdp_forward_method, mesh, rank, world_size):
    """Every training fix, and generate() called as it is: the root's parameters are sharded
    DTensors there (Section 4, Note [forward methods])."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  register_on=None)


@replaces("pitfalls.train")
def registers_generate_on_the_body(fully_shard, register_fsdp_forward_method, mesh, rank,
                                   world_size):
    """Registers generate on the body, which has no generate: the method is the root's, and so
    are the parameters it needs (Note [forward methods])."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  register_on="body")


@replaces("pitfalls.train")
def each_expert_its_own_group(fully_shard, register_fsdp_forward_method, mesh, rank,
                              world_size):
    """Every fix, but each expert sharded as a group of its own, both with the unused-parameters
    flag: rank 0 runs expert 0's pre-forward and rank 1 expert 1's, so one all-gather of equal
    size gathers shards of two different experts, and the forward already computes with a mix
    (Section 1: the ranks' collectives must carry the same parameters)."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  experts_apart=True)


@replaces("pitfalls.train")
def unties_the_head(fully_shard, register_fsdp_forward_method, mesh, rank, world_size):
    """Avoids the tied-weight refusal by giving the head a copy of the embedding's weight and
    sharding it alone: it runs, but the model now has two parameters that learn apart
    (Section 5)."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  untie=True)


@replaces("pitfalls.train")
def rescales_each_ranks_mean(fully_shard, register_fsdp_forward_method, mesh, rank,
                             world_size):
    """Keeps each rank's mean and rescales it by its share of the global count: right in exact
    arithmetic, rounded in another order than the contract's sum over the global count, so
    the weights differ in their last bits (Section 2)."""
    return script(fully_shard, register_fsdp_forward_method, mesh, rank, world_size,
                  mean_rescaled=True)


EXPECTED = {
    "the_broken_script": dict(status="crash", world_sizes=(2,), where="lab_bugs/lab11.py:35"),
    "each_rank_averages_its_tokens": dict(status="diverged", world_sizes=(2,), case=CASE,
                                          name="loss", step=0, hint="not its own mean"),
    "forgets_the_divide_factor": dict(status="diverged", world_sizes=(2,), case=CASE,
                                      name="emb.weight", step=0,
                                      hint="set_gradient_divide_factor(1.0)"),
    "divide_factor_without_force_sum": dict(status="crash", world_sizes=(2,)),
    "no_unused_params": dict(status="diverged", world_sizes=(2,), case=CASE,
                             name="experts.e.0.weight", step=0,
                             hint="set_reduce_scatter_unused_params(True)"),
    "unused_params_on_the_body": dict(status="diverged", world_sizes=(2,), case=CASE,
                                      name="experts.e.0.weight", step=0,
                                      hint="set_reduce_scatter_unused_params(True)"),
    "generate_not_registered": dict(status="crash", world_sizes=(2,)),
    "registers_generate_on_the_body": dict(status="crash", world_sizes=(2,)),
    "each_expert_its_own_group": dict(status="diverged", world_sizes=(2,), case=CASE,
                                      name="loss", step=0, hint="mix their shards"),
    "unties_the_head": dict(status="diverged", world_sizes=(2,), case=CASE,
                            name="parameter names", step=0, hint="one tied parameter"),
    # which check shows it first (a loss or a weight, which step) is the CPU's rounding's to say
    "rescales_each_ranks_mean": dict(status="diverged", world_sizes=(2,), case=CASE,
                                     hint="only the last bits differ"),
}
