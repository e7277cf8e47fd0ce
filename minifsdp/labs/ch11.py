"""Chapter 11 (FSDP2's pitfalls): the exercises' one-line checkers, and lab 11.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from a small
autograd experiment or from the rule of a collective, prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_11.py`` checks that every checker
accepts a correct solution and rejects wrong ones.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check


def measured_token_weights(real_tokens: list[int], mode: str) -> list[float]:
    """The weight of one token of each rank in the averaged gradient, measured: every token's
    loss is the same scalar parameter ``w``, each rank's loss is formed as ``mode`` says, each
    rank's gradient is taken by autograd, and the ranks' gradients are reduced as FSDP2 does
    (``mean``: AVG over N; ``global``: divide factor 1, a SUM). Float64, so the weights come out
    to the last digit of the exact fractions."""
    n, total = len(real_tokens), sum(real_tokens)
    grads = []
    for tokens in real_tokens:
        w = torch.ones((), dtype=torch.float64, requires_grad=True)
        token_losses = w * torch.ones(tokens, dtype=torch.float64)
        loss = token_losses.sum() / (tokens if mode == "mean" else total)
        loss.backward()
        grads.append(w.grad / tokens)  # per token of this rank
    reduced = [g / n if mode == "mean" else g for g in grads]
    return [float(g) for g in reduced]


def check_token_weights(fn) -> bool:
    """``fn(real_tokens, mode)`` -> for each rank, the weight one of its real tokens has in the
    reduced gradient: ``mode="mean"`` when each rank's loss is the mean over its own tokens and
    FSDP averages over the N ranks; ``"global"`` when each rank's loss is its token sum over the
    global token count and ``set_gradient_divide_factor(1.0)`` (Section 2)."""
    cases = [((tokens, mode), measured_token_weights(tokens, mode))
             for tokens in ([16, 3], [5, 5], [7, 1, 4], [1, 2, 3, 10])
             for mode in ("mean", "global")]
    return check("token weights", cases, fn,
                 close=lambda a, b: len(a) == len(b) and all(
                     abs(x - y) <= 1e-12 * abs(y) for x, y in zip(a, b)))


# What one reduce-scatter over every rank does when the ranks send what they send (Section 1):
# one parameter list everywhere -> "ok"; lists that differ but have the same total size -> the
# collective runs and sums different parameters, "silently wrong"; different sizes -> "fails"
# (gloo aborts with a size mismatch; on NCCL the outcome is undefined: a hang or wrong data).
REDUCE_SCATTER_CASES = [
    ([[("a", 8), ("b", 4)], [("a", 8), ("b", 4)]], "ok"),
    ([[("e0", 16)], [("e1", 16)]], "silently wrong"),
    ([[("e0", 16)], [("e1", 12)]], "fails"),
    ([[("a", 8), ("e0", 16)], [("a", 8), ("e1", 16)], [("a", 8), ("e0", 16)]], "silently wrong"),
    ([[("a", 8)], [("a", 8)], [("a", 8), ("b", 4)]], "fails"),
    ([[("a", 4), ("b", 8)], [("b", 8), ("a", 4)]], "silently wrong"),
    ([[], []], "ok"),
    ([[("x", 6)], [("x", 6)], [("x", 6)]], "ok"),
]


def check_reduce_scatter_outcome(fn) -> bool:
    """``fn(sends)`` -> ``"ok"``, ``"silently wrong"`` or ``"fails"``: what one reduce-scatter
    does when rank r's input is laid out from ``sends[r]``, its list of (parameter, padded
    numel) in order."""
    return check("reduce-scatter outcome", [((s,), want) for s, want in REDUCE_SCATTER_CASES],
                 fn)


# ---- Lab 11: a training script with four of the chapter's six pitfalls, fixed ---------------
#
# The reader gets a script that trains a tiny language model (tied embedding and head, two experts
# routed per rank, a generate() that skips forward, a token-mean loss over uneven sequences) and
# is wrong in four of the chapter's ways; they write ``train``, the script fixed. The checker runs
# it with our ``fully_shard`` and compares every step with the reference script run with
# torch's ``fully_shard`` (``seams.reference``): losses, full parameters, generated tokens.

TRAIN = "pitfalls.train"
VOCAB, T, STEPS = 32, 8, 3


class Experts(nn.Module):
    """Two experts of one shape; ``route`` 0 takes expert 0, any other route expert 1."""

    def __init__(self):
        super().__init__()
        self.e = nn.ModuleList([nn.Linear(16, 16), nn.Linear(16, 16)])

    def forward(self, h: torch.Tensor, route: int) -> torch.Tensor:
        return torch.tanh(self.e[0 if route == 0 else 1](h))


class LabLM(nn.Module):
    """``(B, T)`` tokens -> ``(B, T, VOCAB)`` logits: an embedding, a body, two experts (every
    token of rank 0 goes to expert 0, of other ranks to expert 1: ``route`` is the rank whose
    rows these are), a head whose weight *is* the embedding's (tied)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.body = nn.Linear(16, 16)
        self.experts = Experts()
        self.head = nn.Linear(16, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def hidden(self, x: torch.Tensor, route: int) -> torch.Tensor:
        h = torch.tanh(self.body(self.emb(x)))
        return h + self.experts(h, route)

    def forward(self, x: torch.Tensor, route: int) -> torch.Tensor:
        return self.head(self.hidden(x, route))

    @torch.no_grad()
    def generate(self, x: torch.Tensor, steps: int, route: int) -> torch.Tensor:
        """Greedy decoding that calls the layers itself, not ``forward``."""
        for _ in range(steps):
            x = torch.cat([x, self.head(self.hidden(x[:, -1:], route)).argmax(-1)], dim=1)
        return x


def global_batch(step: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's global batch, the same on every rank: 2 sequences per rank of ``T`` tokens;
    rank 0's are full, the others' have 2 and 1 real tokens (targets ``-100`` after them).
    Rank r's rows are ``x.chunk(world_size)[r]``."""
    real = [T, T] + [2, 1] * (world_size - 1)
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, VOCAB, (len(real), T), generator=g)
    y = torch.randint(0, VOCAB, x.shape, generator=g)
    for i, n in enumerate(real):
        y[i, n:] = -100
    return x, y


def prompt(rank: int) -> torch.Tensor:
    """This rank's prompts for ``generate``: ``(2, 2)`` tokens."""
    return (torch.arange(4).view(2, 2) + 4 * rank) % VOCAB


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (``full_tensor()`` of a sharded one: a collective on every rank)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.named_parameters()}


def train(fully_shard, register_fsdp_forward_method, mesh, rank: int, world_size: int) -> dict:
    """The reference script (lab 11's solution; the checker runs it with torch's fully_shard)."""
    import torch.nn.functional as F

    model = LabLM()
    fully_shard(model.body, mesh=mesh)
    fully_shard(model.experts, mesh=mesh)
    fully_shard(model, mesh=mesh)  # emb and head: one tied parameter, in the root's group
    model.experts.set_reduce_scatter_unused_params(True)  # each rank routes to one expert
    for m in (model.body, model.experts, model):
        m.set_gradient_divide_factor(1.0)  # the loss is already divided by the global count
        m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    register_fsdp_forward_method(model, "generate")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = {"losses": [], "params": []}
    for step in range(STEPS):
        x, y = global_batch(step, world_size)
        count = (y != -100).sum()  # real tokens of the whole global batch
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        loss = F.cross_entropy(model(x, rank).flatten(0, 1), y.flatten(), ignore_index=-100,
                               reduction="sum") / count
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["params"].append(full_params(model))
    out["tokens"] = model.generate(prompt(rank), 4, rank)
    return out


def run_lab(t, info) -> None:
    """Lab 11's one case, on every rank: the reader's ``train`` with our ``fully_shard``
    against the reference with torch's, from the same seed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    from minifsdp import fsdp2
    from minifsdp.labs import ch11, seams

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    with t.case("the fixed script, 3 SGD steps and a generate(), against the reference "
                "with torch's fully_shard", (TRAIN,)):
        torch.manual_seed(0)
        want = seams.reference(TRAIN)(torch_fully_shard, torch_register, mesh, info.rank,
                                      info.world_size)
        torch.manual_seed(0)
        got = ch11.train(fsdp2.fully_shard, fsdp2.register_fsdp_forward_method, mesh,
                         info.rank, info.world_size)
        for step in range(STEPS):
            t.expect("loss", got["losses"][step], want["losses"][step], step=step,
                     phase="forward")
            t.expect("parameter names", sorted(got["params"][step]),
                     sorted(want["params"][step]), step=step, phase="optimizer step")
            for name, p in want["params"][step].items():
                t.expect(name, got["params"][step].get(name), p, step=step,
                         phase="optimizer step")
        t.expect("generated tokens", got["tokens"], want["tokens"], phase="generate")


def _last_bits_only(got, expected) -> bool:
    """Whether ``got`` differs from ``expected`` only by rounding: the same arithmetic in
    another order (a mean rescaled instead of a sum divided), not another formula."""
    g = torch.as_tensor(got, dtype=torch.float64)
    e = torch.as_tensor(expected, dtype=torch.float64)
    return g.shape == e.shape and bool(torch.allclose(g, e, rtol=1e-5, atol=1e-7))


def lab_hint(name: str, got, expected, n: int) -> str | None:
    if name == "parameter names":
        return ("your model's parameters are not the reference's: the head's weight must stay "
                "the embedding's, one tied parameter (named once, emb.weight); put the tied "
                "modules in one group instead of untying them (Section 5)")
    if isinstance(got, (float, torch.Tensor)) and _last_bits_only(got, expected):
        return ("only the last bits differ: right in exact arithmetic, rounded differently. The "
                "bar is bitwise, so compute the loss as the contract says, in that order: the "
                "token losses summed (reduction='sum'), then divided by the global count of real "
                "tokens; not a mean rescaled, nor a scale applied to the loss (Section 2)")
    if name == "loss":
        return ("the loss is not the reference's at the same parameters. Either its formula (each "
                "rank's token sum over the real tokens of the whole global batch, not its own "
                "mean, Section 2), or the forward ran other weights: ranks that use different "
                "experts must not gather them as groups of their own, each rank would all-gather "
                "another expert and mix their shards (keep both experts in one group, Section 1)")
    if name.startswith("experts."):
        return ("the experts' gradients were summed slot by slot with another rank's expert: "
                "set_reduce_scatter_unused_params(True) on the experts' module (Section 1)")
    if name == "generated tokens":
        return "generate must run inside the root's hooks: register it on the root (Section 4)"
    if isinstance(got, torch.Tensor):
        return ("the gradients were divided again after the global count: "
                "set_gradient_divide_factor(1.0) on every fully_shard module, with "
                "set_force_sum_reduction_for_comms(True) on gloo (Section 2)")
    return None


LAB = Lab(
    id="11",
    title="a training script with FSDP2's pitfalls, fixed",
    skeleton="labs/lab11_pitfalls.py",
    seams=(Seam(TRAIN, "minifsdp.labs.ch11", "train"),),
    notes=("unused parameters in a group", "divide factor", "forward methods"),
    run=run_lab,
    hint=lab_hint,
    oracle="the reference script with torch's fully_shard",
    hints=(
        "Run the broken script as it is (labs/lab11_pitfalls.py shows it) and read the first "
        "error; then go through the chapter's sections one by one and ask of each line of the "
        "script whether it walks into that section's pitfall. Four of the six are in it. Read "
        "Note [unused parameters in a group], Note [divide factor] and Note [forward methods].",
        "The four: a tied weight split over two groups (Section 5); experts that each rank uses "
        "one of (Section 1); a loss that each rank averages over its own tokens while FSDP "
        "averages the ranks (Section 2); a generate() that never goes through forward "
        "(Section 4). Each has a one- or two-line fix in the chapter.",
        "Shard body, experts and the root only; experts.set_reduce_scatter_unused_params(True); "
        "loss = token sum / real tokens of the global batch, and on every fully_shard module "
        "set_gradient_divide_factor(1.0) and set_force_sum_reduction_for_comms(True); "
        "register_fsdp_forward_method(model, 'generate') on the root.",
    ),
)
