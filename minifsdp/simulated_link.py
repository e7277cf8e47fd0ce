"""A simulated network link for CPU runs: collectives whose completion takes bytes / bandwidth
(+ a latency), so that overlap can be seen where the "network" would otherwise be the CPU.

Note [simulated link]: on 2 CPU cores with gloo, communication *is* computation -- gloo's
worker thread copies the bytes on the cores the model computes on -- so prefetching cannot hide
anything (chapter 06 measured it). Inside ``with simulated_link(bandwidth, latency):`` the
all-gathers and reduce-scatters of ``minifsdp.comm`` still run for real on gloo (the data is
exactly what gloo computes, so every bit is the same as without the link), but their
*completion* is held back: an async collective's ``wait()`` returns only once a timer thread
says ``latency + wire_bytes / bandwidth`` seconds have passed on the link since the transfer
started, and a blocking one returns no earlier than that. The link is one NIC: one transfer at
a time, in issue order (a transfer starts when it is issued or when the previous one ends,
whichever is later). ``wire_bytes`` are comm's (Note [bytes vs wire bytes] in comm.py). The
timer costs no CPU while it waits, so time that the main thread spends computing while a
transfer is "on the wire" is hidden communication -- as with a real NIC or NVLink. On GPUs no
simulation is needed: NCCL runs on its own CUDA stream and the copy engines / NICs move the
bytes while the compute stream runs kernels (torch FSDP2's Note on overlapping the all-gather,
above ``FSDPCommContext`` in torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, and
the ``fully_shard`` docs on implicit and explicit prefetching). This is a model of a link,
not a measurement of one.

Used by chapter 06 through ``python -m minifsdp.simulated_link`` (``main``): one job that trains
the chapter's GPT under no prefetch, implicit and explicit prefetch, in interleaved rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from minifsdp import comm


class SimulatedLink:
    """One serial link: ``book(wire_bytes)`` reserves the next slot and returns its deadline
    (a ``time.perf_counter()`` time). Thread-safe; deadlines only grow."""

    def __init__(self, bandwidth: float, latency: float = 0.0):
        if bandwidth <= 0 or latency < 0:
            raise ValueError(f"bandwidth {bandwidth} B/s must be > 0, latency {latency} s >= 0")
        self.bandwidth, self.latency = float(bandwidth), float(latency)
        self.free_at = 0.0  # when the last booked transfer ends
        self.busy = 0.0  # seconds booked so far (the sum of transfer_time)
        self._lock = threading.Lock()

    def transfer_time(self, wire_bytes: float) -> float:
        return self.latency + wire_bytes / self.bandwidth

    def book(self, wire_bytes: float) -> float:
        with self._lock:
            t = self.transfer_time(wire_bytes)
            self.free_at = max(time.perf_counter(), self.free_at) + t
            self.busy += t
            return self.free_at


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:  # never released early
        time.sleep(left)


class SimulatedWork:
    """The real ``dist.Work`` plus a release: ``wait()`` waits for the real collective, then
    for the timer thread that fires at the link's deadline. ``get_future()`` completes at the
    release too, so comm's ``t_done`` is the simulated end of the transfer."""

    def __init__(self, work: Any, deadline: float):
        self._work, self.deadline = work, deadline
        self._released = threading.Event()
        self._future: torch.futures.Future = torch.futures.Future()
        real = work.get_future()

        def release() -> None:
            try:
                real.wait()  # the data is there (gloo's thread) ...
                _sleep_until(deadline)  # ... and the simulated bytes have arrived
            finally:
                self._released.set()
                self._future.set_result(None)

        timer = threading.Timer(max(0.0, deadline - time.perf_counter()), release)
        timer.daemon = True
        timer.start()

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self._work.wait(*args, **kwargs)  # errors surface as without the link
        self._released.wait()
        _sleep_until(self.deadline)
        return True

    def is_completed(self) -> bool:
        return self._released.is_set()

    def get_future(self) -> torch.futures.Future:
        return self._future


def _simulated(link: SimulatedLink, real, wire_bytes) -> Any:
    """``real`` (comm's ``_all_gather_single`` or ``_reduce_scatter_single``, called as
    ``(output, input, [op,] group, async_op)``), completing on ``link``."""

    def call(output, input, *args):
        *rest, group, async_op = args
        deadline = link.book(wire_bytes(output, input, group))  # the transfer starts now
        work = real(output, input, *rest, group, async_op)
        if async_op:
            return SimulatedWork(work, deadline)
        _sleep_until(deadline)  # blocking: returns once the bytes have "arrived"
        return work

    return call


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def simulated_link(bandwidth: float, latency: float = 0.0) -> Iterator[SimulatedLink]:
    """Inside the block, ``comm.all_gather_into_tensor`` and ``comm.reduce_scatter_tensor``
    (what FSDP issues) complete on a simulated link (Note [simulated link]). ``bandwidth`` in
    bytes per second, ``latency`` in seconds per transfer. Yields the link (``link.busy``: the
    seconds booked so far)."""
    link = SimulatedLink(bandwidth, latency)
    ws = lambda group: dist.get_world_size(group)
    ag = _simulated(link, comm._all_gather_single,
                    lambda out, inp, g: (ws(g) - 1) / ws(g) * _nbytes(out))
    rs = _simulated(link, comm._reduce_scatter_single,
                    lambda out, inp, g: (ws(g) - 1) / ws(g) * _nbytes(inp))
    saved = comm._all_gather_single, comm._reduce_scatter_single
    comm._all_gather_single, comm._reduce_scatter_single = ag, rs
    try:
        yield link
    finally:
        comm._all_gather_single, comm._reduce_scatter_single = saved


# ---- chapter 06's job ---------------------------------------------------------------------------

GPT = dict(n_layer=4, d_model=256, n_head=8, vocab_size=512, seq_len=32)  # chapter 05/06's GPT
CONFIGS = ("no prefetch", "implicit backward (default)", "implicit forward + backward",
           "explicit, one ahead")


class _Mark(torch.autograd.Function):
    """Identity that stamps a time when its backward runs (a block's backward begins at its
    output's mark, ends at its input's). The gradient passes through untouched."""

    @staticmethod
    def forward(ctx, x, stamp):
        ctx.stamp = stamp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.stamp()
        return grad, None


def _timed_blocks(model, spans: list) -> None:
    """Record each block's compute, forward and backward, as (name, phase, t0, t1): the time
    between FSDP's hooks, i.e. after its parameters arrived (pre-forward / pre-backward waits
    happen outside)."""
    for i, block in enumerate(model.blocks):
        inner = block.forward

        def forward(x, inner=inner, name=f"blocks.{i}"):
            now = time.perf_counter
            t_bwd: list[float] = []
            x = _Mark.apply(x, lambda: spans.append((name, "backward", t_bwd[0], now())))
            t0 = now()
            y = inner(x)
            spans.append((name, "forward", t0, now()))
            return _Mark.apply(y, lambda: t_bwd.append(now()))

        block.forward = forward


def _build(config: str, mesh):
    from minifsdp.dist import seed_everything
    from minifsdp.fsdp2 import fully_shard
    from minifsdp.models import build_model

    seed_everything(0)
    model = build_model("gpt", **GPT)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    units = list(model.blocks)
    if config.startswith("explicit"):  # as minifsdp.train.set_prefetch
        for module, nxt in zip([model, *units], units):
            module.set_modules_to_forward_prefetch([nxt])
        for module, prev in zip([model, *units[::-1]], units[::-1]):
            module.set_modules_to_backward_prefetch([prev])
    model.set_implicit_prefetch(forward=config == "implicit forward + backward",
                                backward=config.startswith("implicit"))
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bandwidth", type=float, default=1e9, help="bytes per second")
    p.add_argument("--latency", type=float, default=50e-6, help="seconds per transfer")
    p.add_argument("--rounds", type=int, default=8, help="steps per configuration")
    p.add_argument("--batch", type=int, default=8, help="global batch")
    args = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from minifsdp.dist import dist_setup, finish

    info = dist_setup()
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    names = [*CONFIGS, "no prefetch, no link"]  # the last: the unsimulated run, for the bits
    models = {k: _build(k.removesuffix(", no link"), mesh) for k in names}
    spans: dict[str, list] = {k: [] for k in names}
    for k, m in models.items():
        _timed_blocks(m, spans[k])
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    res: dict[str, dict] = {k: {"step_s": [], "exposed_s": [], "losses": []} for k in names}
    for rnd in range(args.rounds):
        g = torch.Generator().manual_seed(rnd)
        idx = torch.randint(0, GPT["vocab_size"], (args.batch, GPT["seq_len"]), generator=g)
        idx = idx.chunk(info.world_size)[info.rank]
        order = names[rnd % len(names):] + names[:rnd % len(names)]  # rotate: no config first
        for k in order:  # always
            model, opt = models[k], opts[k]
            link_cm = (contextlib.nullcontext(None) if k.endswith("no link")
                       else simulated_link(args.bandwidth, args.latency))
            spans[k].clear()
            dist.barrier()
            with link_cm as link, comm.logging_comm() as log:
                t0 = time.perf_counter()
                with log.span("forward"):
                    logits = model(idx)
                    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten())
                with log.span("backward"):
                    loss.backward()
                with log.span("optimizer"):
                    opt.step()
                    opt.zero_grad()
                t = time.perf_counter() - t0
            if link is not None:  # the seconds booked on the link: bytes / bandwidth
                res[k].setdefault("link_s", []).append(link.busy)
            res[k]["step_s"].append(t)
            res[k]["exposed_s"].append(comm.exposed_seconds(log.comms(), "fsdp2"))
            res[k]["losses"].append(loss.item())
            if rnd == args.rounds - 1:
                res[k]["comm"] = log.to_list()
                res[k]["blocks"] = [(n, ph, a - log.t0, b - log.t0) for n, ph, a, b in spans[k]]
    for k, m in models.items():
        state = {n: v.full_tensor() if isinstance(v, DTensor) else v
                 for n, v in m.state_dict().items()}
        res[k]["bitwise_vs_no_link"] = all(
            torch.equal(v, ref) for v, ref in zip(state.values(), _state(models[names[-1]])))
    med = statistics.median
    finish({"configs": res, "link_seconds_per_step": med(res[CONFIGS[0]]["link_s"]),
            "bandwidth": args.bandwidth,
            "latency": args.latency, "rounds": args.rounds})


def _state(model) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [v.full_tensor() if isinstance(v, DTensor) else v for v in model.state_dict().values()]


def plot_step(result: dict, ax, title: str) -> None:
    """One configuration's last step from ``main``'s results, three lanes in ms: each block's
    compute (forward f0.., backward b0..), the main thread waiting for a collective (Note
    [exposed communication] in comm.py), and the link's transfers (AG / RS and the group; a
    transfer starts at its issue or when the one before it ends)."""
    recs, blocks = result["comm"], result["blocks"]
    t0 = next(r["t_start"] for r in recs if r["kind"] == "compute" and r["op"] == "forward")
    ms = lambda a, b: ((a - t0) * 1e3, (b - a) * 1e3)
    colors = {"forward": "#4C72B0", "backward": "#DD8452"}
    for name, phase, a, b in blocks:
        ax.broken_barh([ms(a, b)], (2.1, 0.8), color=colors[phase], edgecolor="white")
        ax.text((a + b) / 2 * 1e3 - t0 * 1e3, 2.5, f"{phase[0]}{name.split('.')[-1]}",
                ha="center", va="center", fontsize=8, color="white")
    free = t0
    for r in (r for r in recs if r["kind"] == "comm"):
        done = r["t_done"] if r.get("t_done") is not None else r["t_end"]
        start, free = max(r["t_start"], free), done
        group = (r["tag"] or "").split()[-1].replace("blocks.", "")
        ax.broken_barh([ms(start, done)], (0.1, 0.8), color="#8172B3", alpha=0.7,
                       edgecolor="black", linewidth=0.5)
        ax.text((start + done) / 2 * 1e3 - t0 * 1e3, 0.5,
                f"{'AG' if r['op'] == 'all_gather' else 'RS'} {group}", ha="center",
                va="center", fontsize=7, rotation=90)
        wait = r["t_wait"] if r.get("t_wait") is not None else r["t_start"]
        if r["t_end"] - wait > 1e-4:
            ax.broken_barh([ms(wait, r["t_end"])], (1.1, 0.8), color="#C44E52")
    ax.set_yticks([0.5, 1.5, 2.5], ["link", "waiting", "compute"])
    ax.set(title=title, xlabel="ms since the step's forward began", ylim=(0, 3))
    ax.grid(axis="x", alpha=0.3)


if __name__ == "__main__":
    main()
