"""Graph passes for SimpleFSDP (chapter 10): FSDP's communication schedule as FX rewrites.

``torch.compile(model, backend=backend(model, passes))`` traces a ``simple_fsdp`` model into a
forward and a backward FX graph (aot_autograd) and hands both to ``passes`` before running
them as plain Python, as ``aot_eager`` does. In those graphs each parameter read is one
``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor`` and each gradient one
``reduce_scatter_tensor`` + ``wait_tensor`` (Note [what compile sees] in simple_fsdp.py);
``collectives(gm)`` lists them. Two passes, each ``GraphModule -> GraphModule``:

    bucket_all_gathers    a block's all-gathers -> one all-gather of the concatenated shards
                          (chapter 05's flat copy-in / copy-out, done by the compiler)
    prefetch_all_gathers  each block's (bucketed) all-gather issued before the previous block
                          computes (chapter 06's prefetch, done by moving nodes)

Both only copy bytes and move nodes, so results stay bitwise. Graphs without FSDP collectives
(no all-gather the labelling traced to a parameter) pass through untouched.

On gloo the backend then runs a copy of each graph in which every collective is waited for at
once (``minifsdp.serial_collectives``, Note [one collective in flight on gloo]): the passes'
schedule is what NCCL would overlap, and the graph handed to ``graphs`` keeps it; gloo runs it
one collective at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd

from minifsdp.serial_collectives import runnable
from minifsdp.simple_fsdp import param_name

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten
AG, RS, AR = (_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default,
              _c10d.all_reduce.default)
WAIT = _c10d.wait_tensor.default
Pass = Callable[[fx.GraphModule], fx.GraphModule]


def block_of(name: str) -> str:
    """``blocks.1.attn.qkv.weight`` -> ``blocks.1``; a parameter outside a block -> ``""``."""
    m = re.match(r"(.*?\.\d+)\.", name)
    return m.group(1) if m else ""


def backend(passes: Sequence[Pass] = (), graphs: list | None = None,
            serialize_on: bool | None = None):
    """A ``torch.compile`` backend: aot_autograd, then ``passes`` on the forward and the
    backward graph, then run the graph as Python (no Inductor). ``graphs`` (a list) receives
    ``(kind, gm)`` after the passes: the schedule they planned. Before the passes each
    collective is labelled with its parameter (``node.meta["param"]``), which compile records
    in the node's module stack: ``nn_module_stack`` in forward, ``fwd_nn_module_stack`` in
    backward.

    ``serialize_on``: run a ``serialize``d copy instead (each collective waited for at once,
    ``gm.meta["ran"]``) -- by default when any collective of the graph is on a gloo group
    (Note [one collective in flight on gloo] in ``minifsdp.serial_collectives``); NCCL graphs
    run as planned."""

    def run(kind):
        def compiler(gm: fx.GraphModule, example_inputs):
            for n in gm.graph.nodes:
                if n.target in (AG, RS, AR) and "param" not in n.meta:
                    n.meta["param"] = _param_of(n)
            for p in passes:
                gm = p(gm)
            if graphs is not None:
                graphs.append((kind, gm))
            gm.meta["ran"] = ran = runnable(gm, serialize_on)
            return ran
        return compiler

    return aot_autograd(fw_compiler=run("forward"), bw_compiler=run("backward"))


def _param_of(node: fx.Node) -> str | None:
    """``L['self'].blocks[0].fc.parametrizations.weight.0`` -> ``blocks.0.fc.weight``."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    for path, cls in reversed(list(stack.values())):
        if cls.__name__ == "ReplicateCompute":
            path = re.sub(r"\[['\"]?(\w+)['\"]?\]", r".\1", path.removeprefix("L['self']"))
            return param_name(path.lstrip(".").removesuffix(".0") + ".original")
    return None


def collectives(gm: fx.GraphModule) -> list[tuple[str, tuple, str | None]]:
    """The graph's collectives in issue order: ``(op, output shape, parameter or None)``."""
    return [(n.target.__name__.split(".")[0], tuple(n.meta["val"].shape), n.meta.get("param"))
            for n in gm.graph.nodes if n.target in (AG, RS, AR)]


def schedule(gm: fx.GraphModule) -> list[str]:
    """Issues and waits of the labelled all-gathers, by block, in graph order:
    ``["AG root", "W root", "AG blocks.0", ...]`` -- where a prefetch shows (an ``AG`` before
    the previous block's ``W``)."""
    out = []
    for n in gm.graph.nodes:
        ag = n.args[0] if n.target is WAIT else n
        if ag.target is AG and ag.meta.get("param") is not None:
            out.append(f"{'W' if n is not ag else 'AG'} {block_of(ag.meta['param']) or 'root'}")
    return out


def _groups(gm: fx.GraphModule, group: Callable[[str], str]) -> list[list[fx.Node]]:
    """Labelled all-gathers, split into runs of consecutive ones from the same block."""
    runs: list[list[fx.Node]] = []
    for n in gm.graph.nodes:
        if n.target is AG and n.meta.get("param") is not None:
            key = group(n.meta["param"])
            if runs and group(runs[-1][0].meta["param"]) == key:
                runs[-1].append(n)
            else:
                runs.append([n])
    return runs


def _wait_of(ag: fx.Node) -> fx.Node:
    (w,) = [u for u in ag.users if u.target is WAIT]
    return w


def _hoist(node: fx.Node, before: fx.Node, order: dict) -> None:
    """Move ``node`` and the part of its input chain that comes after ``before`` to just
    before ``before`` (placeholders and earlier nodes stay)."""
    if node.op == "placeholder" or order[node] < order[before]:
        return
    for a in node.all_input_nodes:
        _hoist(a, before, order)
    before.prepend(node)
    order[node] = order[before] - 0.5


def _done(gm: fx.GraphModule) -> fx.GraphModule:
    gm.graph.lint()
    gm.recompile()
    return gm


def bucket_all_gathers(gm: fx.GraphModule, group: Callable[[str], str] = block_of):
    """One all-gather per run of consecutive all-gathers of one block (Note [a bucket in the
    graph]); a run of one stays as it is."""
    for run in _groups(gm, group):
        if len(run) >= 2:
            bucket_run(gm.graph, run)  # seam "graph_passes.bucket" (lab 10): one run's rewrite
    return _done(gm)


def bucket_run(g: fx.Graph, run: list[fx.Node]) -> None:
    """Replace the all-gathers of ``run`` (and their waits) in ``g`` by one bucketed all-gather.

    Note [a bucket in the graph]: assumes every all-gather of a run has the same group (size,
    name) and gathers along dim 0, so its output is the ranks' inputs stacked; each input is the
    same size on every rank (DTensor pads uneven shards before gathering, Note [padding]). Then
    the concatenated flat inputs, gathered, are ``(world, total)`` -- rank-major, as chapter
    05's buffer (Note [copy-in and copy-out]); parameter j is columns ``[o_j, o_j + numel_j)``
    of it, reshaped to its gathered shape. The bucket is issued where the run's first
    all-gather was, waited where its first wait was.
    """
    order = {n: i for i, n in enumerate(g.nodes)}
    first, first_wait = run[0], min((_wait_of(a) for a in run), key=order.get)
    size, name = first.args[1], first.args[2]
    for a in run:
        _hoist(a.args[0], first, order)
    with g.inserting_before(first):
        flat = [g.call_function(_aten.reshape.default, (a.args[0], [-1])) for a in run]
        ag = g.call_function(AG, (g.call_function(_aten.cat.default, (flat,)), size, name))
    numels = [a.args[0].meta["val"].numel() for a in run]
    with g.inserting_before(first_wait):
        rows = g.call_function(_aten.view.default,
                               (g.call_function(WAIT, (ag,)), [size, sum(numels)]))
        o = 0
        for a, k in zip(run, numels):
            piece = g.call_function(_aten.slice.Tensor, (rows, 1, o, o + k))
            shape = list(a.meta["val"].shape)
            out = g.call_function(_aten.reshape.default,
                                  (g.call_function(_aten.clone.default, (piece,)), shape))
            o += k
            _wait_of(a).replace_all_uses_with(out)
    for a in run:  # erased only now: first_wait anchored the insertions
        g.erase_node(_wait_of(a))
        g.erase_node(a)
    ag.meta["param"] = ",".join(a.meta["param"] for a in run)
    ag.meta["val"] = torch.empty(size * sum(numels), device="meta")


def prefetch_all_gathers(gm: fx.GraphModule, group: Callable[[str], str] = block_of):
    """Issue each run's all-gather just before the previous run's first wait: block i + 1's
    parameters travel while block i computes (its wait stays where it is). Run it after
    ``bucket_all_gathers``: a block must be one all-gather (Note [collectives in flight]).

    Assumes the all-gathers' inputs depend only on graph inputs (shards; their casts and pads
    move along). Costs memory: one more block's unsharded parameters live at a time.

    Note [collectives in flight]: FSDP2 prefetches one flat all-gather per group, so at most
    two are in flight. Hoisting a block's per-parameter all-gathers instead would put all of
    them in flight at once (24 in chapter 10's forward): 24 buffers and 24 collectives that
    the communication stream runs one after another anyway, while one bucket is one launch.
    So the pass prefetches buckets, as SimpleFSDP reorders bucketed collectives, and refuses
    a block of several all-gathers. (On gloo no schedule runs as planned: the backend waits
    for each collective at once, Note [one collective in flight on gloo] in
    ``minifsdp.serial_collectives``.)
    """
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    runs = _groups(gm, group)
    for run in runs:
        if len(run) > 1:
            block = group(run[0].meta["param"]) or "the root"
            raise ValueError(
                f"prefetch_all_gathers: {block} has {len(run)} all-gathers in a row "
                f"({run[0].meta['param']}, ...); bucket them first (bucket_all_gathers): "
                "prefetching them one by one puts them all in flight (Note [collectives in "
                "flight] in minifsdp/graph_passes.py)")
    for prev, run in zip(runs, runs[1:]):
        anchor = _wait_of(prev[0])
        _hoist(run[0], anchor, order)
    return _done(gm)
