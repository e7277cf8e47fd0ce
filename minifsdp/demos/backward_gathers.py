"""Chapter 06: a group whose backward never reads its parameters need not be gathered for it
(Note [no all-gather in backward] in ``minifsdp/fsdp2/fsdp_param_group.py``). Run under
torchrun at N = 2::

    run = torchrun("minifsdp.demos.backward_gathers", nproc=2, chapter="06")
    run.ranks[0]["cases"]["skip"]["ops"]   # ["AG emb", "AG blocks.0", ..., "RS emb", ...]

The model is token ids -> an embedding (a group, resharded after forward) -> two blocks (a
group each) -> a head (the root's group). An embedding's weight gradient scatters the output
gradient into the looked-up rows; with token ids as input (they need no gradient) nothing in
its backward reads the weight. ``emb.set_unshard_in_backward(False)`` says so, and the
embedding's backward all-gather -- and its backward prefetch, issued from ``blocks.0`` --
disappear.

Per rank, for ``default`` and ``skip`` (the setting on ``emb``), 2 Adam steps with ours and
torch's ``fully_shard``: ``ops`` (ours, the last step's all-gathers ``AG`` and
reduce-scatters ``RS`` with their groups, in issue order), ``same_ops`` (torch's recorded
order equals ours), ``vs_torch`` (the first divergence of losses and parameters, None when
bitwise), and, for ``skip``, ``vs_default`` (the same against ``default``: the gradients
never depended on the gathered weight, so None).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from minifsdp import comm, fsdp2, torch_order
from minifsdp.dist import dist_setup, finish
from minifsdp.parity import divergence_line

info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
STEPS, ROWS, VOCAB = 2, 4, 40
TORCH = torch_order.Recorder("fsdp2")


class TinyLM(nn.Module):
    """``(B, T) token ids -> (B, T, VOCAB)`` logits: embedding, two blocks, head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.head(h)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of a global batch of N x ROWS sequences of 6 tokens."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (N * ROWS, 7), generator=g)
    mine = ids.chunk(N)[rank].to(info.device)
    return mine[:, :-1], mine[:, 1:]


def train(impl: str, skip: bool) -> dict:
    fs = fsdp2.fully_shard if impl == "ours" else torch_fully_shard
    torch.manual_seed(0)
    model = TinyLM().to(info.device)
    for m in (model.emb, *model.blocks):
        fs(m, mesh=mesh)
    fs(model, mesh=mesh)
    if skip:  # the user's promise: nothing in emb's backward reads emb.weight
        model.emb.set_unshard_in_backward(False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        with comm.logging_comm() as log, TORCH.record() as events:
            x, y = batch(step)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    if impl == "ours":
        ops = [f"{'AG' if r.op == 'all_gather' else 'RS'} {r.tag.split()[-1]}"
               for r in log.comms()]
    else:
        ops = [e.short for e in events if e.op in ("all_gather", "reduce_scatter")]
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
              for k, v in model.named_parameters()}
    return {"ops": ops, "state": {"losses": torch.stack(losses), **params}}


def main() -> None:
    runs = {(impl, skip): train(impl, skip) for impl in ("ours", "torch")
            for skip in (False, True)}
    cases = {}
    for name, skip in (("default", False), ("skip", True)):
        ours, theirs = runs[("ours", skip)], runs[("torch", skip)]
        # the root's reduce-scatter is the one known move (Note [when is a group's backward
        # over?] in fsdp_state.py): ours when its last gradient is in, torch's at the very end
        but_root = [[op for op in ops if op != "RS root"] for ops in (ours["ops"], theirs["ops"])]
        cases[name] = {"ops": ours["ops"], "same_ops": but_root[0] == but_root[1],
                       "torch_ops": theirs["ops"],
                       "vs_torch": divergence_line(ours["state"], theirs["state"])}
    cases["skip"]["vs_default"] = divergence_line(runs[("ours", True)]["state"],
                                                  runs[("ours", False)]["state"])
    finish({"rank": rank, "cases": cases})


if __name__ == "__main__":
    main()
