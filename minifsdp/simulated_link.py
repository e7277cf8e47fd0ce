"""A simulated network link for CPU runs: collectives whose completion takes bytes / bandwidth
(+ a latency), so that overlap can be seen where the "network" would otherwise be the CPU.

Note [simulated link]: on 2 CPU cores with gloo, communication *is* computation -- gloo's
worker thread copies the bytes on the cores the model computes on -- so prefetching has little
to hide behind. Inside ``with simulated_link(bandwidth, latency):`` the all-gathers and
reduce-scatters of ``minifsdp.comm`` still run for real on gloo (the data is exactly what gloo
computes, so every bit is the same as without the link), but their *completion* is held back:
an async collective's ``wait()`` returns only once a timer thread says ``latency + wire_bytes /
bandwidth`` seconds have passed on the link since the transfer started, and a blocking one
returns no earlier than that. The link is one NIC: one transfer at a time, in issue order (a
transfer starts when it is issued or when the previous one ends, whichever is later; a real
link would also need the other rank to have issued it). ``wire_bytes`` are comm's (Note [bytes
vs wire bytes] in comm.py). The timer costs no CPU while it waits, so time that the main thread
spends computing while a transfer is "on the wire" is hidden communication -- as with a real
NIC or NVLink. A collective completes at the *later* of the link's end and gloo's own end, so
the link hides nothing of gloo's time: pick a bandwidth whose transfers clearly outlast gloo's
(the link then sets the pace) and read the wait as two parts (Note [link's share of the wait]).
Each booking is kept (``SimulatedLink.transfers``: issue, start and end on the link, and when
gloo itself finished). On GPUs no simulation is needed: NCCL runs on its own CUDA stream and
the copy engines / NICs move the bytes while the compute stream runs kernels (torch FSDP2's
Note on overlapping the all-gather, above ``FSDPCommContext`` in
torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, and the ``fully_shard`` docs on
implicit and explicit prefetching). This is a model of a link, not a measurement of one.

Note [link's share of the wait]: a rank blocked on a collective (from its ``wait()``, or from
the call for a blocking one, to the return: Note [exposed communication] in comm.py) waits
either while the link still carries what it waits for (up to that transfer's end, including
the transfers queued before it) -- the *link's share* -- or after it: then it waits for gloo
itself (its worker thread on busy cores), for the other rank arriving late at the collective
(whose cores other work took), or for the timer thread to wake -- the *rest*, which a real
link would not remove and prefetching cannot hide. ``split_wait`` computes the two. The link's
share plus the link time that passed while the rank was not waiting (computing) is, up to a
few Python calls per collective, the link's busy time; prefetching moves link time from the
first into the second.

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
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from minifsdp import comm


@dataclass
class Transfer:
    """One booking on the link (``time.perf_counter()`` times): issued by the caller at
    ``issued``, on the wire from ``start`` (its issue, or the end of the transfer before it) to
    ``end``; ``gloo_done``: when the real gloo collective finished (None until it has)."""

    issued: float
    start: float
    end: float
    wire_bytes: float
    gloo_done: float | None = None


class SimulatedLink:
    """One serial link: ``book(wire_bytes)`` reserves the next slot and returns its
    ``Transfer``; ``transfers`` lists them in issue order. Thread-safe; ends only grow."""

    def __init__(self, bandwidth: float, latency: float = 0.0):
        if bandwidth <= 0 or latency < 0:
            raise ValueError(f"bandwidth {bandwidth} B/s must be > 0, latency {latency} s >= 0")
        self.bandwidth, self.latency = float(bandwidth), float(latency)
        self.free_at = 0.0  # when the last booked transfer ends
        self.busy = 0.0  # seconds booked so far (the sum of transfer_time)
        self.transfers: list[Transfer] = []
        self._lock = threading.Lock()

    def transfer_time(self, wire_bytes: float) -> float:
        return self.latency + wire_bytes / self.bandwidth

    def book(self, wire_bytes: float) -> Transfer:
        with self._lock:
            t, now = self.transfer_time(wire_bytes), time.perf_counter()
            start = max(now, self.free_at)
            self.free_at = start + t
            self.busy += t
            self.transfers.append(Transfer(now, start, self.free_at, float(wire_bytes)))
            return self.transfers[-1]


def _sleep_until(deadline: float) -> None:
    while (left := deadline - time.perf_counter()) > 0:  # never released early
        time.sleep(left)


class SimulatedWork:
    """The real ``dist.Work`` plus a release: ``wait()`` waits for the real collective, then
    for the timer thread that fires at the link's deadline (``transfer.end``). ``get_future()``
    completes at the release too, so comm's ``t_done`` is the later of the two. The real
    collective's own end is stamped on ``transfer.gloo_done`` by its future's callback."""

    def __init__(self, work: Any, transfer: Transfer):
        self._work, self.transfer, self.deadline = work, transfer, transfer.end
        self._released = threading.Event()
        self._future: torch.futures.Future = torch.futures.Future()
        real = work.get_future()

        def stamp(fut: Any) -> None:  # runs when gloo's thread completes the collective
            transfer.gloo_done = time.perf_counter()

        real.then(stamp)

        def release() -> None:
            try:
                real.wait()  # the data is there (gloo's thread) ...
                _sleep_until(transfer.end)  # ... and the simulated bytes have arrived
            finally:
                self._released.set()
                self._future.set_result(None)

        timer = threading.Timer(max(0.0, transfer.end - time.perf_counter()), release)
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
        transfer = link.book(wire_bytes(output, input, group))  # the transfer starts now
        work = real(output, input, *rest, group, async_op)
        if async_op:
            return SimulatedWork(work, transfer)
        transfer.gloo_done = time.perf_counter()
        _sleep_until(transfer.end)  # blocking: returns once the bytes have "arrived"
        return work

    return call


def split_wait(records: list[dict], transfers: list[dict]) -> tuple[float, float]:
    """Split the seconds a rank sat blocked on the link's collectives (Note [exposed
    communication] in comm.py) in two (Note [link's share of the wait]): ``(on_link, rest)``.
    ``records``: a comm log's dicts; ``transfers``: the link's bookings in issue order (dicts
    with ``end``, ``wire_bytes``, on the log's clock), one per all-gather / reduce-scatter."""
    comms = [r for r in records if r["kind"] == "comm"
             and r["op"] in ("all_gather", "reduce_scatter")]
    if len(comms) != len(transfers):
        raise ValueError(f"{len(comms)} all-gathers and reduce-scatters in the log but "
                         f"{len(transfers)} transfers on the link: not the same step?")
    on_link = rest = 0.0
    for r, x in zip(comms, transfers):
        if r["wire_bytes"] != x["wire_bytes"]:
            raise ValueError(f"log and link disagree at {r['tag']}: {r['wire_bytes']} wire "
                             f"bytes logged, {x['wire_bytes']} booked")
        if r["t_end"] is None:  # never waited for
            continue
        wait = r["t_wait"] if r.get("t_wait") is not None else r["t_start"]
        on_link += max(0.0, min(r["t_end"], x["end"]) - wait)
        rest += max(0.0, r["t_end"] - max(wait, x["end"]))
    return on_link, rest


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
    p.add_argument("--bandwidth", type=float, default=2e7, help="bytes per second")
    p.add_argument("--latency", type=float, default=50e-6, help="seconds per transfer")
    p.add_argument("--rounds", type=int, default=5, help="steps per configuration")
    p.add_argument("--batch", type=int, default=16, help="global batch")
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
            records = log.to_list()
            if link is not None:  # the seconds booked on the link: bytes / bandwidth
                transfers = [_on_clock(x, log.t0) for x in link.transfers]
                on_link, rest = split_wait(records, transfers)
                res[k].setdefault("link_s", []).append(link.busy)
                res[k].setdefault("wait_link_s", []).append(on_link)
                res[k].setdefault("wait_rest_s", []).append(rest)
            res[k]["step_s"].append(t)
            res[k]["exposed_s"].append(comm.exposed_seconds(records, "fsdp2"))
            res[k]["losses"].append(loss.item())
            if rnd == args.rounds - 1:
                res[k]["comm"] = records
                res[k]["blocks"] = [(n, ph, a - log.t0, b - log.t0) for n, ph, a, b in spans[k]]
                if link is not None:
                    res[k]["link"] = transfers
    for k, m in models.items():
        state = {n: v.full_tensor() if isinstance(v, DTensor) else v
                 for n, v in m.state_dict().items()}
        res[k]["bitwise_vs_no_link"] = all(
            torch.equal(v, ref) for v, ref in zip(state.values(), _state(models[names[-1]])))
    med = statistics.median
    finish({"configs": res, "link_seconds_per_step": med(res[CONFIGS[0]]["link_s"]),
            "bandwidth": args.bandwidth, "latency": args.latency, "rounds": args.rounds,
            "batch": args.batch})


def _on_clock(x: Transfer, t0: float) -> dict:
    """A transfer as a dict, its times in seconds since ``t0`` (a comm log's clock)."""
    d = asdict(x)
    for key in ("issued", "start", "end", "gloo_done"):
        d[key] = None if d[key] is None else d[key] - t0
    return d


def _state(model) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [v.full_tensor() if isinstance(v, DTensor) else v for v in model.state_dict().values()]


def plot_step(result: dict, ax, title: str) -> None:
    """One configuration's last step from ``main``'s results, four lanes in ms: each block's
    compute (forward f0.., backward b0..); the main thread waiting for a collective (Note
    [exposed communication] in comm.py), red while the link still carries what it waits for,
    grey after (Note [link's share of the wait]); the link's simulated transfers (AG / RS and
    the group, from their start to their end on the wire); and gloo's real collectives (from
    the issue to gloo's own end)."""
    recs, blocks, transfers = result["comm"], result["blocks"], result["link"]
    t0 = next(r["t_start"] for r in recs if r["kind"] == "compute" and r["op"] == "forward")
    ms = lambda a, b: ((a - t0) * 1e3, (b - a) * 1e3)
    colors = {"forward": "#4C72B0", "backward": "#DD8452"}
    for name, phase, a, b in blocks:
        ax.broken_barh([ms(a, b)], (3.1, 0.8), color=colors[phase], edgecolor="white")
        ax.text((a + b) / 2 * 1e3 - t0 * 1e3, 3.5, f"{phase[0]}{name.split('.')[-1]}",
                ha="center", va="center", fontsize=8, color="white")
    comms = [r for r in recs if r["kind"] == "comm" and r["op"] in ("all_gather", "reduce_scatter")]
    for r, x in zip(comms, transfers, strict=True):
        label = f"{'AG' if r['op'] == 'all_gather' else 'RS'} {(r['tag'] or '').split()[-1]}"
        label = label.replace("blocks.", "")
        ax.broken_barh([ms(x["start"], x["end"])], (1.1, 0.8), color="#8172B3", alpha=0.7,
                       edgecolor="black", linewidth=0.5)
        ax.text((x["start"] + x["end"]) / 2 * 1e3 - t0 * 1e3, 1.5, label, ha="center",
                va="center", fontsize=7, rotation=90)
        if x["gloo_done"] is not None:
            ax.broken_barh([ms(x["issued"], x["gloo_done"])], (0.2, 0.6), color="#937860",
                           edgecolor="black", linewidth=0.5)
        wait = r["t_wait"] if r.get("t_wait") is not None else r["t_start"]
        if r["t_end"] is not None and r["t_end"] > wait:
            mid = min(max(x["end"], wait), r["t_end"])
            ax.broken_barh([ms(wait, mid)], (2.1, 0.8), color="#C44E52")
            ax.broken_barh([ms(mid, r["t_end"])], (2.1, 0.8), color="#999999")
    ax.set_yticks([0.5, 1.5, 2.5, 3.5], ["gloo", "link", "waiting", "compute"])
    ax.set(title=title, xlabel="ms since the step's forward began", ylim=(0, 4))
    ax.grid(axis="x", alpha=0.3)


if __name__ == "__main__":
    main()
