"""Lab 10's planted bugs: the bucketing rewrite as a learner plausibly gets it wrong (Note [a bucket
in the graph], Note [copy-in and copy-out], Note [padding]).

Each function replaces the seam "graph_passes.bucket" (``@replaces``); tests/test_labs.py checks
that the checker rejects it and points where the bug shows first.
"""

import torch

from minifsdp.graph_passes import AG, WAIT, _aten, _hoist, _wait_of
from minifsdp.labs.seams import replaces


def _bucket(g, run, *, flatten=True, reverse_cat=False, param_major=False, erase=True,
            skip_pad=False):
    """The reference rewrite with one mistake switched on (each bug below names its own)."""
    order = {n: i for i, n in enumerate(g.nodes)}
    first, first_wait = run[0], min((_wait_of(a) for a in run), key=order.get)
    size, name = first.args[1], first.args[2]
    for a in run:
        _hoist(a.args[0], first, order)
    shards = [a.args[0] for a in run]
    if skip_pad:
        shards = [s.args[0] if s.target is _aten.constant_pad_nd.default else s for s in shards]
    with g.inserting_before(first):
        flat = [g.call_function(_aten.reshape.default, (s, [-1])) if flatten else s
                for s in shards]
        ag = g.call_function(AG, (g.call_function(
            _aten.cat.default, (flat[::-1] if reverse_cat else flat,)), size, name))
    numels = [s.meta["val"].numel() for s in shards]
    with g.inserting_before(first_wait):
        waited = g.call_function(WAIT, (ag,))
        rows = g.call_function(_aten.view.default, (waited, [size, sum(numels)]))
        o = 0
        for a, k in zip(run, numels):
            if param_major:
                piece = g.call_function(_aten.slice.Tensor, (waited, 0, size * o, size * (o + k)))
            else:
                piece = g.call_function(_aten.slice.Tensor, (rows, 1, o, o + k))
            out = g.call_function(_aten.reshape.default, (
                g.call_function(_aten.clone.default, (piece,)), list(a.meta["val"].shape)))
            o += k
            _wait_of(a).replace_all_uses_with(out)
    if erase:
        for a in run:
            g.erase_node(_wait_of(a))
            g.erase_node(a)
    ag.meta["param"] = ",".join(a.meta["param"] for a in run)
    ag.meta["val"] = torch.empty(size * sum(numels), device="meta")


@replaces("graph_passes.bucket")
def slices_parameter_major(g, run):
    """Reads the gathered bucket as if it held parameter 0 of every rank, then parameter 1...:
    parameter j = elements [N o_j, N (o_j + numel_j)). The bucket is rank-major: rank r's
    shards sit together in row r (Note [copy-in and copy-out], again, in a graph)."""
    _bucket(g, run, param_major=True)


@replaces("graph_passes.bucket")
def cats_shards_unflattened(g, run):
    """Concatenates the shards as they are, (3, 4) next to (4,): ``aten.cat`` wants tensors of
    one rank. Flatten each shard first (Note [a bucket in the graph]). The graph crashes the
    first time it runs."""
    _bucket(g, run, flatten=False)


@replaces("graph_passes.bucket")
def cat_order_reversed(g, run):
    """Builds the cat from the run's last shard back to its first but slices front to back:
    the offsets no longer follow the cat's order, so each parameter receives another's numbers
    (Note [a bucket in the graph])."""
    _bucket(g, run, reverse_cat=True)


@replaces("graph_passes.bucket")
def old_all_gathers_left(g, run):
    """Points every user at the bucket's slices but never erases the old all-gathers and
    waits: the graph still issues one collective per parameter besides the bucket, so
    bucketing saves nothing (Note [one collective per parameter])."""
    _bucket(g, run, erase=False)


@replaces("graph_passes.bucket")
def gathers_unpadded_shards(g, run):
    """Skips the pad ("why send padding?") and concatenates the raw shards: on a rank whose
    shard of a 7-row parameter is short, the bucket is smaller than its peers', so the ranks'
    all-gathers disagree on size (Note [padding]: a collective moves equal-sized pieces) and
    gloo stops the job at once ("Is there a distributed collective mismatch?")."""
    _bucket(g, run, skip_pad=True)


# What the checker must say about each bug: the report's status, the jobs to run (the smallest
# that shows the bug), and where the first divergence is (case, checked value) or the line.
HAND = "a hand-made graph: 8 parameter reads, 2 blocks, uneven rows"
EXPECTED = {
    "slices_parameter_major": dict(status="diverged", world_sizes=(2,), case=HAND,
                                   name="blocks.0.ln.weight, gathered", hint="rank-major"),
    "cats_shards_unflattened": dict(status="crash", world_sizes=(2,),
                                    hint="must have same number of dimensions"),
    "cat_order_reversed": dict(status="diverged", world_sizes=(2,), case=HAND,
                               name="blocks.0.ln.weight, gathered"),
    "old_all_gathers_left": dict(status="diverged", world_sizes=(2,), case=HAND,
                                 name="collectives after your pass", hint="still in the graph"),
    "gathers_unpadded_shards": dict(status="crash", world_sizes=(2,),
                                    hint="collective mismatch"),
}
