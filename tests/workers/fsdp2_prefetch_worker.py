"""Worker for tests/test_fsdp2_prefetch.py: the order of collectives, parity and memory of
``minifsdp.fsdp2``'s prefetching, next to torch's ``fully_shard`` (run at N = 2 and 3).

* order: a 3-block GPT trained 3 steps per configuration (prefetch off, implicit backward =
  the default, implicit forward + backward, explicit lists one unit ahead; torch's default
  and torch with the same explicit lists). The last step's events, in time order:
  ``AG g`` (an all-gather of group g issued), ``W g`` (waited for: the copy-out follows),
  ``RS g`` (reduce-scatter), ``F g`` (g's forward starts, after FSDP's pre-forward hook).
  Ours come from the comm log (issue = ``t_start``, wait = ``t_end``); torch's from
  ``minifsdp.torch_order`` (Note [recording torch's collective order]).
* parity: every configuration's losses and final parameters, against torch's default.
* memory: a stack of 4 Linear(256, 256) units under a parameter-less root, one
  forward/backward under ``MemoryTracker`` per configuration, and every moment at which a
  prefetch was issued while another group was unsharded.
"""

import argparse
import contextlib
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from minifsdp import comm, fsdp2, torch_order
from minifsdp.dist import dist_setup, finish
from minifsdp.fsdp2.fsdp_param_group import FSDPParamGroup, ShardedState
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPT, GPTConfig
from minifsdp.parity import divergence_line, max_abs_diff
from minifsdp.train import set_prefetch

info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
STEPS, LOCAL = 3, 4
CONFIGS = {  # name: (implementation, --forward-prefetch, --backward-prefetch)
    "none": ("ours", "none", "none"),
    "implicit_backward": ("ours", "none", "implicit"),
    "implicit_forward": ("ours", "implicit", "implicit"),
    "explicit": ("ours", "explicit", "explicit"),
    "torch": ("torch", "none", "implicit"),
    "torch_explicit": ("torch", "explicit", "explicit"),
}
TORCH = torch_order.Recorder("fsdp2")  # torch's events, and every run's forward starts


# ---- order and parity ------------------------------------------------------------------------

def gpt(impl: str, forward: str, backward: str) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=4, d_model=32)).to(
        info.device)
    shard = fsdp2.fully_shard if impl == "ours" else torch_fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    set_prefetch(model, argparse.Namespace(forward_prefetch=forward, backward_prefetch=backward))
    # after fully_shard, so each runs after FSDP's own (prepended) pre-forward hook
    for name, m in [("root", model), *((f"blocks.{i}", b) for i, b in enumerate(model.blocks))]:
        m.register_forward_pre_hook(lambda *_, name=name: TORCH.mark("forward", name))
    return model


def comm_events(log: comm.CommLog) -> list[tuple[float, str]]:
    """Our events from the comm log: tags are ``fsdp2 params <group>`` / ``fsdp2 grads ..``."""
    out = []
    for r in log.comms():
        name = r.tag.split(" ", 2)[2]
        if r.op == "all_gather":
            out += [(log.t0 + r.t_start, f"AG {name}"), (log.t0 + r.t_end, f"W {name}")]
        else:
            out.append((log.t0 + r.t_start, f"RS {name}"))
    return out


def train(impl: str, forward: str, backward: str) -> dict:
    model = gpt(impl, forward, backward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = (torch.randint(0, 64, (N * LOCAL, 16), generator=g).chunk(N)[rank].to(info.device)
                for _ in range(2))
        last = step == STEPS - 1
        with comm.logging_comm() as log, (TORCH.record() if last
                                          else contextlib.nullcontext()) as recorded:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    events = [(e.t, e.short) for e in recorded] + (comm_events(log) if impl == "ours" else [])
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v
            for k, v in model.state_dict().items()}
    prefetched = [  # async all-gathers of the last step: (tag, issue, done, wait) in ms
        [r.tag, *(round(1e3 * t, 3) for t in (r.t_start, r.t_done, r.t_end))]
        for r in log.comms("all_gather") if r.t_done is not None and r.t_done < r.t_end]
    return {"losses": losses, "events": [e for _, e in sorted(events)], "params": full,
            "overlapped": prefetched}


def order_and_parity() -> dict:
    runs = {name: train(*cfg) for name, cfg in CONFIGS.items()}
    ref = runs["torch"]["params"]
    out = {}
    for name, run in runs.items():
        params = run.pop("params")
        run["vs_torch"] = divergence_line(params, ref, names=(name, "torch"))
        run["max_diff_torch"] = max_abs_diff(params, ref)
        out[name] = run
    return out


# ---- memory ------------------------------------------------------------------------------------

D = 256


class Stack(nn.Module):
    """4 units ``Linear(D, D) + Tanh``; the root holds no parameter of its own."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


TRACKER: list[MemoryTracker] = []
GROUPS: list[FSDPParamGroup] = []
MOMENTS: list[dict] = []
_our_unshard = FSDPParamGroup.unshard


def _watched_unshard(self, async_op=False):
    """Record the tracker's counts when a prefetch is issued while another group is
    unsharded: the moment two groups' worth of parameters coexist."""
    issues = async_op and self._in_flight is None and self.sharded_state is ShardedState.SHARDED
    _our_unshard(self, async_op)
    unsharded = [g.name for g in GROUPS if g is not self
                 and g.sharded_state is ShardedState.UNSHARDED]
    if issues and TRACKER and unsharded:
        MOMENTS.append({"in_flight": self.name, "unsharded": unsharded,
                        **TRACKER[0].current()})


FSDPParamGroup.unshard = _watched_unshard


def memory(forward: str, backward: str) -> dict:
    torch.manual_seed(0)
    model = Stack().to(info.device)
    for layer in model.layers:
        fsdp2.fully_shard(layer, mesh=mesh)
    fsdp2.fully_shard(model, mesh=mesh)
    model.set_implicit_prefetch(forward=forward == "implicit", backward=backward == "implicit")
    x = torch.randn(LOCAL, D, device=info.device)
    model(x).square().sum().backward()  # step 1: lazy init, the forward order to guess from
    for p in model.parameters():
        p.grad = None
    GROUPS[:] = [m.fsdp_state.group for m in model.layers]
    MOMENTS.clear()
    tracker = MemoryTracker(model)
    TRACKER[:] = [tracker]
    with tracker:
        tracker.register(x, "activations")
        model(x).square().sum().backward()
    TRACKER.clear()
    g = GROUPS[0]
    return {"peak": tracker.peak, "peak_by_category": tracker.peak_by_category,
            "peak_phase": tracker.peak_phase, "moments": list(MOMENTS),
            # The total peak also holds "other", untagged memory of which some is freed at
            # moments no program order fixes (Note [prefetch memory]): the total peak moves
            # between runs. The tagged categories' peak, and comm's, are deterministic.
            "attributed_peak": max(s["total"] - s.get("other", 0) for s in tracker.timeline),
            "comm_max": max(s.get("comm", 0) for s in tracker.timeline),
            "U": 4 * N * sum(p.padded_shard_numel for p in g.fsdp_params),
            "Ps": sum(4 * p.padded_shard_numel for g in GROUPS for p in g.fsdp_params)}


PARTS = sys.argv[1:] or ["order", "memory"]  # the test runs the memory part at N = 2 only
finish({
    "rank": rank, "world_size": N,
    "runs": order_and_parity() if "order" in PARTS else None,
    "memory": {"none": memory("none", "none"), "backward": memory("none", "implicit"),
               "forward_backward": memory("implicit", "implicit")} if "memory" in PARTS else None,
})
