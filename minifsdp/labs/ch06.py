"""Chapter 06 (prefetch and overlap): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_06.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import contextlib

import torch

from minifsdp import torch_order
from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check


def backward_collectives(post_forward_order: list[str], prefetch: bool) -> list[tuple[str, str]]:
    """The collectives one backward issues, in order, for groups whose forwards ended in
    ``post_forward_order`` (the root last; it keeps its parameters, so it is not gathered):
    ``[("all_gather", "blocks.3"), ("reduce_scatter", "blocks.3"), ...]``. With implicit
    backward prefetch each group's pre-backward issues the previous group's all-gather right
    after its own (the root's issues the last unit's); Note [which group is next]."""
    *units, root = post_forward_order
    rev, events = units[::-1], []
    if prefetch and rev:
        events.append(("all_gather", rev[0]))
    for k, g in enumerate(rev):
        if not prefetch:
            events.append(("all_gather", g))
        elif k + 1 < len(rev):
            events.append(("all_gather", rev[k + 1]))
        events.append(("reduce_scatter", g))
    return events + [("reduce_scatter", root)]


def check_backward_collectives(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(post_forward_order, prefetch)`` -> ``[(op, group), ...]`` issued in one backward.
    ``measured``: ``((order, prefetch), events)`` read from real runs' comm logs."""
    orders = [["blocks.0", "blocks.1", "blocks.2", "blocks.3", "root"], ["a", "root"],
              ["conv", "fc1", "fc2", "root"], ["root"]]
    cases = [((o, p), backward_collectives(o, p)) for o in orders for p in (False, True)]
    return check("backward collectives", [*cases, *(measured or [])], fn)


def forward_events(forward_order: list[str], prefetch: bool) -> list[tuple[str, str]]:
    """Issue / wait / compute events of one forward over groups in ``forward_order`` (the root
    first; its forward runs around everyone else's, so its own compute starts right after
    its pre-forward). With implicit forward prefetch a pre-forward issues the next group's
    all-gather right after waiting for its own."""
    events = []
    for k, g in enumerate(forward_order):
        if not (prefetch and k > 0):
            events.append(("issue", g))
        events.append(("wait", g))
        if prefetch and k + 1 < len(forward_order):
            events.append(("issue", forward_order[k + 1]))
        events.append(("compute", g))
    return events


def check_forward_events(fn) -> bool:
    """``fn(forward_order, prefetch)`` -> ``[("issue"|"wait"|"compute", group), ...]``."""
    orders = [["root", "blocks.0", "blocks.1", "blocks.2"], ["root", "a"], ["root"],
              ["root", "conv", "fc1", "fc2"]]
    return check("forward events", [((o, p), forward_events(o, p)) for o in orders
                                    for p in (False, True)], fn)


def exposed_ms(compute_ms: list[float], comm_ms: list[float], prefetch: bool) -> float:
    """Milliseconds a forward waits for all-gathers: group i needs ``comm_ms[i]`` on the wire
    and computes ``compute_ms[i]``. Without prefetch every all-gather is waited for in full;
    with one-ahead prefetch group i+1's transfer overlaps group i's compute (the first cannot
    hide), and one transfer at a time is on the wire."""
    if not prefetch:
        return float(sum(comm_ms))
    # group i+1's all-gather is issued when group i starts computing: only what outlasts
    # that compute is waited for
    return comm_ms[0] + sum(max(0.0, m - c) for c, m in zip(compute_ms, comm_ms[1:]))


def check_exposed_ms(fn) -> bool:
    """``fn(compute_ms, comm_ms, prefetch)`` -> exposed all-gather milliseconds of a forward."""
    cases = [((c, m, p), exposed_ms(c, m, p))
             for c, m in [([5, 5, 5, 5], [2, 2, 2, 2]), ([1, 1, 1], [3, 3, 3]),
                          ([4, 1, 4], [1, 5, 2]), ([10], [3]), ([2, 8, 2, 8], [6, 6, 6, 6]),
                          ([8, 1, 8], [1, 1, 9])]
             for p in (False, True)]
    close = lambda a, b: abs(a - b) <= 1e-9 * max(1.0, b)
    return check("exposed all-gather time", cases, fn, close=close)


# ---- lab 06: the prefetch schedule ------------------------------------------------------------

FWD, BWD = "prefetch.forward", "prefetch.backward"


class _Stack(torch.nn.Module):
    """Four ``Linear(8, 8) + Tanh`` units under a root with no parameters of its own: the first
    unit's predecessor in post-forward order is nothing, not the root."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4))
        self.order: list[int] | None = None  # a step may run the units in another order

    def forward(self, x):
        for i in self.order or range(len(self.blocks)):
            x = self.blocks[i](x)
        return x


def _train(impl: str, model_name: str, config: str, info, steps: int = 3) -> list[dict]:
    """Train ``steps`` steps; per step the loss and the collectives issued in forward (with
    ``F g`` where g's forward starts, after its pre-forward hook) and in backward; the last
    entry holds the final parameters. ``impl``: "yours" (the installed seams), "reference"
    (the package's functions behind them), or "torch" (torch's fully_shard)."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor

    from minifsdp import comm, fsdp2
    from minifsdp.fsdp2 import prefetch
    from minifsdp.labs import seams
    from minifsdp.models import GPT, GPTConfig

    n, rank = info.world_size, info.rank
    mesh = init_device_mesh(info.device.type, (n,))
    torch.manual_seed(0)
    if model_name == "gpt":  # d_model 32 over 3 ranks: uneven rows
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=3, n_head=4, d_model=32))
    else:
        model = _Stack()
    shard = torch_fully_shard if impl == "torch" else fsdp2.fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    units = list(model.blocks)
    if config == "explicit far":  # two lists only, each naming a unit that is not next: the
        model.set_modules_to_forward_prefetch(units[2:3])  # groups without one keep the
        units[-1].set_modules_to_backward_prefetch(units[:1])  # default; with one, only it
    elif config.startswith("explicit"):  # lists of 1 or 2 units ahead, on every rank (Note
        ahead = 2 if config == "explicit two ahead" else 1  # [same order on every rank])
        for j, module in enumerate([model, *units]):  # root -> units[0:a], unit j -> j+1..
            if units[j:j + ahead]:
                module.set_modules_to_forward_prefetch(units[j:j + ahead])
        rev = units[::-1]
        for j, module in enumerate([model, *rev]):  # in backward order, the same way
            if rev[j:j + ahead]:
                module.set_modules_to_backward_prefetch(rev[j:j + ahead])
    elif impl != "torch":
        model.set_implicit_prefetch(forward=config.startswith("implicit forward"),
                                    backward=config != "none")
    marks: list[tuple[int, str]] = []
    logs: list[comm.CommLog] = []
    torch_events = torch_order.Recorder("fsdp2")  # records torch's while impl == "torch"

    def mark(name):
        if torch_events.recording:
            torch_events.mark("forward", name)
        elif logs:
            marks.append((len(logs[0].comms()), f"F {name}"))

    for name, m in [("root", model), *((f"blocks.{i}", b) for i, b in enumerate(units))]:
        m.register_forward_pre_hook(lambda *_, name=name: mark(name))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    swap = impl == "reference"
    saved = (prefetch.after_pre_forward, prefetch.after_pre_backward)
    if swap:
        prefetch.after_pre_forward = seams.reference(FWD)
        prefetch.after_pre_backward = seams.reference(BWD)
    out = []
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            if model_name == "gpt":
                x, y = (torch.randint(0, 64, (n * 4, 16), generator=g).chunk(n)[rank]
                        for _ in range(2))
            else:
                x = torch.randn(n * 4, 8, generator=g).chunk(n)[rank]
            if config == "implicit forward, reordered":  # step 1 leaves last step's order
                model.order = [0, 2, 1, 3] if step == 1 else None
            events = {}
            for phase in ("forward", "backward"):
                marks.clear()
                with comm.logging_comm() as log, (torch_events.record() if impl == "torch"
                                                  else contextlib.nullcontext()) as recorded:
                    logs[:] = [log]
                    if phase == "forward":
                        out_ = model(x)
                        loss = (F.cross_entropy(out_.flatten(0, 1), y.flatten())
                                if model_name == "gpt" else out_.square().mean())
                    else:
                        loss.backward()
                    logs.clear()
                events[phase] = ([e.short for e in recorded if e.op != "wait"]
                                 if impl == "torch" else _ours(log, marks))
            opt.step()
            opt.zero_grad()
            out.append(dict(loss=loss.detach(), **events))
    finally:
        if swap:
            prefetch.after_pre_forward, prefetch.after_pre_backward = saved
    out.append({k: v.full_tensor() if isinstance(v, DTensor) else v
                for k, v in model.state_dict().items()})
    return out


def _ours(log, marks: list[tuple[int, str]]) -> list[str]:
    """Our comm log's all-gathers (at issue) and reduce-scatters, with the forward marks."""
    out, m = [], 0
    for j, r in enumerate(log.comms()):
        while m < len(marks) and marks[m][0] <= j:
            out.append(marks[m][1])
            m += 1
        out.append(f"{'AG' if r.op == 'all_gather' else 'RS'} {r.tag.split(' ', 2)[2]}")
    return out + [s for _, s in marks[m:]]


def run_lab(t, info) -> None:
    """Lab 06's cases, on every rank: a 3-block GPT (uneven rows at N = 3) three steps per
    prefetch configuration, against torch's fully_shard or the package's reference; each step's
    collectives in forward and backward, its loss, and the final parameters."""
    cases = [("GPT, torch's default: implicit backward prefetch", "gpt", "default", "torch"),
             ("GPT, explicit lists one block ahead (forward and backward)", "gpt", "explicit",
              "torch"),
             ("GPT, implicit forward prefetch (minifsdp only)", "gpt", "implicit forward",
              "reference"),
             ("GPT, prefetching switched off", "gpt", "none", "reference"),
             ("4 units under a root with no parameters, default prefetch", "stack", "default",
              "torch"),
             ("4 units under a root with no parameters, explicit lists two ahead", "stack",
              "explicit two ahead", "torch"),
             ("GPT, explicit lists two blocks ahead (forward and backward)", "gpt",
              "explicit two ahead", "torch"),
             ("4 units, two explicit lists naming units that are not next (the root's in "
              "forward: unit 2; unit 3's in backward: unit 0)", "stack", "explicit far",
              "torch"),
             ("4 units, implicit forward prefetch, step 1 runs them as 0, 2, 1, 3 (minifsdp "
              "only)", "stack", "implicit forward, reordered", "reference")]
    for title, model_name, config, oracle in cases:
        with t.case(f"{title}, vs {'torch' if oracle == 'torch' else 'the reference'}",
                    (FWD, BWD)):
            yours = _train("yours", model_name, config, info)
            want = _train(oracle, model_name, config, info)
            for step, (y, w) in enumerate(zip(yours[:-1], want[:-1])):
                for phase in ("forward", "backward"):
                    t.expect(f"collectives in {phase}", y[phase], w[phase], step=step,
                             phase=phase)
                t.expect("loss", y["loss"], w["loss"], step=step)
            for k, v in want[-1].items():
                t.expect(f"{k} after the last step", yours[-1][k], v)


def hint(name: str, got, expected, n: int) -> str | None:
    if not name.startswith("collectives") or not isinstance(got, list):
        return None
    ag = lambda ev: [e for e in ev if e.startswith("AG")]
    if len(ag(got)) > len(ag(expected)):
        return ("yours issued more all-gathers than the reference: a prefetch of a group that "
                "does not run next, issued, waited for and thrown away (Note [mistargeted "
                "prefetches]); in backward the next group is the one *before* this one in "
                "post-forward order (Note [which group is next])")
    follows = "F" if name.endswith("forward") else "RS"
    if ag(got) and all(i + 1 < len(got) and got[i + 1] == f"{follows} {e[3:]}"
                       for i, e in enumerate(got) if e.startswith("AG") and e != "AG root"):
        return ("yours never prefetched here: every all-gather was issued by its own group's "
                "hook, just in time. After a group's own all-gather, issue the next group's "
                "(Note [which group is next]); an explicit list replaces the guess")
    j = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if j is not None and j + 1 < len(got) and expected[j].startswith("AG"):
        if got[j].startswith("AG") and got[j + 1] == expected[j] and got[j] == expected[j + 1]:
            return ("two all-gathers swapped: an explicit list is issued in its own order (a "
                    "backward list is already in backward order; Note [which group is next])")
        if j > 0 and expected[j - 1].startswith("AG") and not got[j].startswith("AG"):
            return ("yours issued fewer all-gathers at this point than expected: a list of "
                    "several modules is issued whole, in its order, by its module's hook "
                    "(Note [which group is next])")
    return ("the same collectives in another order: the prefetch targets another group than "
            "the reference's, or comes where the reference issues none: an explicit list "
            "decides alone, and once this forward leaves the last one's order (ctx.on_track) "
            "there is no guess (Note [which group is next])")


LAB = Lab(
    id="06",
    title="the prefetch schedule",
    skeleton="labs/lab06_prefetch.py",
    seams=(Seam(FWD, "minifsdp.fsdp2.prefetch", "after_pre_forward"),
           Seam(BWD, "minifsdp.fsdp2.prefetch", "after_pre_backward")),
    notes=("which group is next", "issue and wait", "same order on every rank",
           "mistargeted prefetches"),
    run=run_lab,
    hint=hint,
    oracle="torch's fully_shard (and the package's reference for minifsdp-only switches)",
    hints=(
        'Prefetching is guessing which group runs next and starting its all-gather now, so '
        'that it is done when that group needs it. Read Note [which group is next] and Note '
        '[issue and wait]: an explicit list (set_modules_to_*_prefetch, of one module or of '
        "several) is not a hint, it replaces the guess; the guess is 'what ran next last "
        "time'.",
        "Forward: ctx.last_forward_order is last forward's order of groups, ctx.forward_order"
        " this one's so far, ctx.on_track whether the two agree up to here. Backward runs the"
        ' groups in the reverse of ctx.post_forward_order; state.post_forward_indices says '
        'where this group sits. issue() is safe to call with None or with a group already '
        'gathered or in flight, and every rank must issue the same groups in the same order.',
        'forward: if explicit list: issue(those groups) / elif implicit and on track and a '
        'next group exists in last order: issue(it). backward: if explicit list: issue(those)'
        ' / elif implicit and i is not None and i > 0: issue(post_forward_order[i - 1]).',
    ),
)
