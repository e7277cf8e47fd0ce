"""Lab 11: a training script with FSDP2's pitfalls. Read chapter 11, Note [unused parameters in a
group], Note [divide factor], Note [forward methods].

Seam "pitfalls.train" (minifsdp.labs.ch11.train). Check: python -m minifsdp.labs 11
(start: --start)   Hints: --hint (1, 2, 3)
Bar: bit for bit with the reference script run with torch's fully_shard, at N = 2 and 3: each
step's loss and every full parameter after each of 3 SGD steps, then the tokens generate() makes.

``broken_train`` below runs, and trains the wrong model (or stops with an error): it walks into
four of the chapter's six pitfalls. Run it (``broken_train(fsdp2.fully_shard,
fsdp2.register_fsdp_forward_method, mesh, rank, n)`` under torchrun), read what goes wrong, and
write ``train``: the same script, fixed.
"""

import torch
import torch.nn.functional as F

from minifsdp.labs.ch11 import STEPS, LabLM, full_params, global_batch, prompt


def broken_train(fully_shard, register_fsdp_forward_method, mesh, rank, world_size):
    """The script as a user wrote it. Four of chapter 11's pitfalls are in it."""
    model = LabLM()
    fully_shard(model.body, mesh=mesh)
    fully_shard(model.experts, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = {"losses": [], "params": []}
    for step in range(STEPS):
        x, y = global_batch(step, world_size)
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        loss = F.cross_entropy(model(x, rank).flatten(0, 1), y.flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["params"].append(full_params(model))
    out["tokens"] = model.generate(prompt(rank), 4, rank)
    return out


def train(fully_shard, register_fsdp_forward_method, mesh, rank, world_size):
    """``broken_train``, fixed: train as one process would on the global batch.

    Given: ``fully_shard`` and ``register_fsdp_forward_method`` (the package's; the reference
    runs the same script with torch's), a 1-D ``mesh`` over the ``world_size`` ranks, this
    ``rank``. The caller seeds torch just before: build one ``LabLM()`` first, as the broken
    script does, and keep its optimizer (SGD, lr 0.5), steps and data (``global_batch``, this
    rank's rows ``chunk(world_size)[rank]``, the experts routed by ``rank``).
    Returns ``{"losses": [STEPS floats], "params": [STEPS dicts name -> full tensor, after each
    step's update], "tokens": model.generate(prompt(rank), 4, rank)}``, as the broken script.
    Must hold: each step's loss is this rank's summed token loss over the real tokens (targets
    != -100) of the whole global batch, so that the ranks' gradients *summed* are one process's
    gradient of the mean over every real token; every parameter equals the reference's bit for
    bit after each step; the head's weight stays the embedding's (one parameter); generate()
    runs on the sharded model. Chapter 11, Sections 1, 2, 4 and 5.
    """
    # TODO(lab 11): the contract above; `python -m minifsdp.labs 11 --hint` when stuck.
    raise NotImplementedError("lab 11: train in labs/lab11_pitfalls.py")
