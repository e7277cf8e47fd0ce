"""Plots every chapter reuses: loss curves, memory timelines by category, peak bars.

All functions take the plain JSON objects that workers write (``RunResult.ranks[r]``) and an
optional matplotlib ``Axes``; they return the ``Axes`` so a notebook can adjust titles.
Memory is shown in MiB (2**20 bytes), time in the tracker's event order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt

MiB = 2**20
CATEGORIES = ("params", "grads", "optimizer", "activations", "comm", "other")
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868",
          "activations": "#C44E52", "comm": "#8172B3", "other": "#937860"}


def _ax(ax):
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    return ax


def plot_losses(curves: Mapping[str, Sequence[float]], ax=None, title="Training loss",
                ylabel="loss (nats)", styles: Mapping[str, dict] | None = None):
    """One line per run. ``curves``: label -> loss per step.

    Example:
        >>> plot_losses({"torch DDP": run.ranks[0]["losses"]})   # doctest: +SKIP
    """
    ax = _ax(ax)
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, **(styles or {}).get(label, {}))
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def plot_memory_timeline(memory: Mapping, ax=None, title="Live tensor memory", legend=True):
    """Stacked area of live bytes per category over one tracked step.

    ``memory`` is a ``MemoryTracker.to_dict()``: its ``timeline`` holds samples
    ``{"i", "phase", "total", <category>: bytes}``. The step's coarse phases (forward,
    backward, optimizer step, ...) are drawn as labelled bands; the peak is marked with the
    fine-grained phase it happened in (e.g. ``backward conv2``).
    """
    ax = _ax(ax)
    tl = memory["timeline"]
    xs = list(range(len(tl)))
    cats = [c for c in CATEGORIES if any(s.get(c, 0) for s in tl)]
    ax.stackplot(xs, *[[s.get(c, 0) / MiB for s in tl] for c in cats], labels=cats,
                 colors=[COLORS[c] for c in cats], alpha=0.85, step="post")
    top = max(s["total"] for s in tl) / MiB
    _draw_phases(ax, tl, top)
    i_peak = max(xs, key=lambda i: tl[i]["total"])
    ax.annotate(f"peak {tl[i_peak]['total'] / MiB:.2f} MiB\n({tl[i_peak]['phase']})",
                (i_peak, top), xytext=(i_peak, top * 1.32), fontsize=8, ha="center",
                arrowprops={"arrowstyle": "->", "color": "0.3"})
    ax.set(title=title, xlabel=XLABEL, ylabel="live memory (MiB)", ylim=(0, top * 1.5),
           xlim=(0, max(xs[-1], 1)))
    if legend:
        ax.legend(loc="upper left", fontsize=7, ncol=len(cats), frameon=False,
                  bbox_to_anchor=(0, -0.14))
    return ax


def plot_label_timeline(memory: Mapping, ax=None, title="Live memory by label"):
    """Stacked area of the bytes counted under each label (``MemoryTracker``'s Note
    [labels]) over one tracked step, on the same x axis as ``plot_memory_timeline``: e.g.
    which FSDP2 groups are unsharded when. Labels that never hold memory are left out.

    Example:
        >>> plot_label_timeline(run.ranks[0]["memory"][1])   # doctest: +SKIP
    """
    ax = _ax(ax)
    tl = memory["timeline"]
    names = [n for n in dict.fromkeys(k for s in tl for k in s.get("labels") or {})
             if any((s.get("labels") or {}).get(n, 0) for s in tl)]
    # buffers (e.g. FSDP2's all-gather buffers) on top, in grey: they are in transit
    names.sort(key=lambda n: n.endswith("buffers"))
    ys = [[(s.get("labels") or {}).get(n, 0) / MiB for s in tl] for n in names]
    cmap = plt.get_cmap("tab10")
    ax.stackplot(range(len(tl)), *ys, labels=names, step="post", alpha=0.85,
                 colors=["0.65" if n.endswith("buffers") else cmap(k % 10)
                         for k, n in enumerate(names)])
    top = max([sum(col) for col in zip(*ys)] or [1])
    _draw_phases(ax, tl, top)
    ax.set(title=title, xlabel=XLABEL, ylabel="live memory (MiB)",
           xlim=(0, max(len(tl) - 1, 1)), ylim=(0, top * 1.3))
    ax.legend(loc="upper left", fontsize=7, ncol=min(len(names), 8), frameon=False,
              bbox_to_anchor=(0, -0.14))
    return ax


XLABEL = "memory event: each allocation or free, in the order of the step"


def _draw_phases(ax, timeline: Sequence[Mapping], top: float) -> None:
    """Shade the step's coarse phases in alternating bands and name each band above the data
    (from ``top``), at its left edge: two narrow neighbours take two rows so that their names
    never overlap. The tracker's ``(none)`` (before the first phase) stays unnamed."""
    spans = _phase_spans([_coarse(s["phase"]) for s in timeline])
    n, row_end = len(timeline), [-1.0, -1.0]  # where each row's last name ends
    for k, (start, end, phase) in enumerate(spans):
        ax.axvspan(start, end, color="0.93" if k % 2 else "white", zorder=0)
        if end - start < 0.04 * n or phase == "(none)":
            continue
        # a character takes about 1.5% of the width at fontsize 8 on a 5-inch axis (on the
        # safe side: a wider axis only leaves more room)
        x, width = start + 0.005 * n, 0.015 * n * len(phase)
        row = 0 if x >= row_end[0] else 1  # would run into the previous name: the next row
        right = x + width > n  # the last band: name it from its right edge, inside the axes
        # on a white box above the peak's arrow, which may pass behind it
        ax.text(end if right else x, top * (1.04 + 0.09 * row), phase, va="bottom",
                ha="right" if right else "left", fontsize=8, color="0.25", zorder=5,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.5, "alpha": 0.9})
        row_end[row] = x + width


def _coarse(phase: str) -> str:
    """``"forward conv1"`` -> ``"forward"``: the step-level phase of a fine-grained one."""
    first = phase.split(" ", 1)[0]
    return first if first in ("forward", "backward") else phase


def _phase_spans(phases):
    """Contiguous runs of the same phase name: ``[(start, end, phase), ...]``."""
    spans, start = [], 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[start]:
            spans.append((start, i, phases[start]))
            start = i
    return spans


def plot_peak_bars(labels: Sequence[str], measured: Sequence[float],
                   predicted: Sequence[float] | None = None, ax=None,
                   title="Peak memory: predicted vs measured", ylabel="peak memory (MiB)"):
    """Grouped bars, bytes in, MiB shown, each bar labelled with its value."""
    ax = _ax(ax)
    xs = range(len(labels))
    width = 0.4 if predicted is not None else 0.6
    series = [("measured", measured, "#4C72B0")]
    if predicted is not None:
        series.insert(0, ("predicted (analytic)", predicted, "#BBBBBB"))
    for k, (name, values, color) in enumerate(series):
        offs = (k - (len(series) - 1) / 2) * width
        bars = ax.bar([x + offs for x in xs], [v / MiB for v in values], width, label=name,
                      color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(list(xs), labels, rotation=15 if max(map(len, labels)) > 10 else 0)
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return ax


def plot_category_bars(breakdowns: Mapping[str, Mapping[str, float]], ax=None,
                       title="Memory at the peak, by category", ylabel="memory (MiB)"):
    """Stacked bars: one bar per run/rank, one segment per category (bytes in)."""
    ax = _ax(ax)
    labels = list(breakdowns)
    bottom = [0.0] * len(labels)
    for c in CATEGORIES:
        vals = [breakdowns[lab].get(c, 0) / MiB for lab in labels]
        if any(vals):
            ax.bar(labels, vals, bottom=bottom, label=c, color=COLORS[c])
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(title=title, ylabel=ylabel)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_collectives(ranks: Sequence[Mapping], ops: Sequence[str] | None = None):
    """One row per collective: every rank's input (left) and output (right) as a grid of the
    actual numbers, from ``minifsdp.demos.collectives --demo collectives``.

    ``ranks[r]["collectives"][op] = {"input": [...], "output": [...]}``.
    """
    ops = list(ops or ranks[0]["collectives"])
    n = len(ranks)
    fig, axes = plt.subplots(len(ops), 2, figsize=(10, 1.15 * n * len(ops) / 2 + 1),
                             gridspec_kw={"width_ratios": [1, 1]}, squeeze=False)
    for row, op in enumerate(ops):
        for col, key in enumerate(("input", "output")):
            ax = axes[row][col]
            vals = [r["collectives"][op][key] for r in ranks]
            width = max(map(len, vals))
            ax.set_xlim(-0.5, width - 0.5)
            ax.set_ylim(n - 0.5, -0.5)
            for r, v in enumerate(vals):
                for j, x in enumerate(v):
                    ax.add_patch(plt.Rectangle((j - 0.45, r - 0.4), 0.9, 0.8,
                                               color=plt.cm.tab10(r % 10), alpha=0.25))
                    ax.text(j, r, f"{x:g}", ha="center", va="center", fontsize=8)
            ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=8)
            ax.set_xticks([])
            for side in ("top", "right", "bottom"):
                ax.spines[side].set_visible(False)
            ax.set_title(f"{op}: {key}", fontsize=10, loc="left")
    fig.suptitle(f"Collectives on {n} processes: what each rank holds before and after")
    fig.tight_layout()
    return fig


PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer step": "#55A868",
                "zero_grad": "#BBBBBB"}


def plot_comm_timeline(records: Sequence[Mapping], step: int = -1, ax=None,
                       title="Compute and communication in one step"):
    """Two lanes for one rank's step: compute spans (forward, backward, optimizer step) and
    each collective from issue to completion (``t_done``, Note [async completion] in
    ``minifsdp.comm``; a thin line continues an async one until its ``wait()``), in
    milliseconds from the start of the step's forward. Nested compute spans (the DDP final
    callback inside backward) are drawn on top of the span that contains them.

    ``records`` is a rank's comm log (``RunResult.ranks[r]["comm"]``, from ``minifsdp.comm``);
    ``step`` picks the step by its forward span (``-1``: the last).
    """
    ax = _ax(ax)
    starts = [r["t_start"] for r in records if r["kind"] == "compute" and r["op"] == "forward"]
    t0 = starts[step]
    later = [t for t in starts if t > t0]
    t1 = later[0] if later else float("inf")
    inside = [r for r in records if t0 <= r["t_start"] < t1]
    few = sum(r["kind"] != "compute" for r in inside) <= 16  # label collectives if readable
    # Longest first, so that a span nested in another (e.g. a final callback run inside
    # backward) is drawn over it rather than hidden under it.
    for r in sorted(inside, key=lambda r: r["t_start"] - r["t_end"]):
        done = r.get("t_done")
        done = r["t_end"] if done is None else done
        ms = ((r["t_start"] - t0) * 1e3, (done - r["t_start"]) * 1e3)
        if r["kind"] == "compute":
            ax.broken_barh([ms], (1.1, 0.8), color=PHASE_COLORS.get(r["op"], "0.6"),
                           label=r["op"])
        else:
            ax.broken_barh([ms], (0.1, 0.8), color=COLORS["comm"], alpha=0.6,
                           edgecolor="black", linewidth=0.5)
            if r["t_end"] > done:  # waited on later: the result sat ready until then
                ax.plot([(done - t0) * 1e3, (r["t_end"] - t0) * 1e3], [0.5, 0.5],
                        color=COLORS["comm"], lw=1, ls=":")
            if r.get("tag") and few:
                ax.text(ms[0] + ms[1] / 2, 0.5, r["tag"], ha="center", va="center", fontsize=6,
                        rotation=90)
    ax.set_yticks([0.5, 1.5], ["communication", "compute"])
    # ylim to 2.6: the legend gets the band above the compute lane, never over a span
    ax.set(title=title, xlabel="time since the step's forward began (ms)", ylim=(0, 2.6))
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    first = {}  # legend in the order the phases began, not the order they were drawn
    for r in inside:
        first.setdefault(r["op"], r["t_start"])
    order = sorted(seen, key=lambda op: first.get(op, 0.0))
    ax.legend([seen[op] for op in order], order, fontsize=7, loc="upper right", ncol=5,
              frameon=False)
    ax.grid(axis="x", alpha=0.3)
    return ax
