"""Chapter 10 (SimpleFSDP and its graph passes): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own rules (and, where the notebook passes them, from a real run's graphs), prints one
line (✓ or ✗ with the first failing case) and returns True/False.
"""

from __future__ import annotations

import math

from minifsdp.notebook import check

GPT_ROOT_FRONT, GPT_ROOT_BACK, GPT_BLOCK = 2, 3, 12  # minifsdp.models.GPT's parameters, untied


def forward_all_gathers(n_blocks: int, bucketed: bool) -> int:
    """All-gathers in the forward graph of a SimpleFSDP ``GPT`` with ``n_blocks`` blocks: one
    per parameter read; bucketed, one per run of one block's (or the root's) consecutive reads:
    the embeddings, each block, then ``ln_f`` + ``head``."""
    if bucketed:
        return n_blocks + 2
    return GPT_ROOT_FRONT + GPT_BLOCK * n_blocks + GPT_ROOT_BACK


def check_forward_all_gathers(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(n_blocks, bucketed)`` -> the forward graph's all-gathers. ``measured``:
    ``((n_blocks, bucketed), count)`` from real graphs."""
    cases = [((b, k), forward_all_gathers(b, k)) for b in (1, 2, 4, 12, 32) for k in (False, True)]
    return check("forward all-gathers", [*cases, *(measured or [])], fn)


def bucket_numel(shapes: list[tuple], world_size: int) -> int:
    """Elements of one bucketed all-gather's output: each parameter's shard is padded to chunk
    0's rows (``ceil(d0 / N)``), the shards are concatenated, and N ranks' buckets gathered."""
    n = world_size
    return n * sum(-(-s[0] // n) * math.prod(s[1:]) for s in shapes)


def check_bucket_numel(fn, measured: list[tuple] | None = None) -> bool:
    """``fn(shapes, world_size)`` -> elements of the bucketed all-gather of parameters of
    ``shapes``. ``measured``: ``((shapes, n), numel)`` read from a real graph."""
    block = [(32,), (32,), (96, 32), (96,), (32, 32), (32,), (32,), (32,), (128, 32), (128,),
             (32, 128), (32,)]
    cases = [((shapes, n), bucket_numel(shapes, n))
             for shapes in (block, [(64, 32), (16, 32)], [(7, 10), (7,), (3, 7)], [(1,), (5, 2)])
             for n in (1, 2, 3, 4, 8)]
    return check("bucket elements", [*cases, *(measured or [])], fn)


# ---- lab 10: the bucketing pass ------------------------------------------------------------------

import torch  # noqa: E402

from minifsdp.labs.seams import Lab, Seam  # noqa: E402

BUCKET = "graph_passes.bucket"
LAB_STEPS = 3
# A hand-made graph's parameters, in read order: a lone root parameter, block 0 (7 rows: uneven
# at N = 2 and 3), block 1, and a root parameter of 2 rows (an empty shard at N = 3).
LAB_SHAPES = {"tok.weight": (6, 4), "blocks.0.ln.weight": (8,), "blocks.0.ln.bias": (8,),
              "blocks.0.fc.weight": (7, 4), "blocks.0.fc.bias": (7,),
              "blocks.1.fc.weight": (5, 3), "blocks.1.fc.bias": (5,), "head.weight": (2, 3)}


def _hand_graph(n: int, r: int):
    """An FX graph (``make_fx``) that reads each of ``LAB_SHAPES`` as SimpleFSDP's compiled
    graphs do: pad the shard to ``ceil(d0 / N)`` rows, all-gather, wait, narrow to ``d0`` rows
    (Note [padding]). Returns the graph, labelled like ``graph_passes.backend``'s, and this
    rank's shards (random, seeded by parameter and rank)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.fx.experimental.proxy_tensor import make_fx

    from minifsdp import graph_passes as gp

    c10d, group = torch.ops._c10d_functional, dist.group.WORLD.group_name

    def read_all(*shards):
        out = []
        for x, shape in zip(shards, LAB_SHAPES.values()):
            rows = -(-shape[0] // n)
            if x.shape[0] < rows:
                x = F.pad(x, [0, 0] * (x.dim() - 1) + [0, rows - x.shape[0]])
            full = c10d.wait_tensor(c10d.all_gather_into_tensor(x, n, group))
            out.append(full[:shape[0]] * 1.0)
        return out

    shards = []
    for i, shape in enumerate(LAB_SHAPES.values()):
        rows = -(-shape[0] // n)
        full = torch.randn(shape, generator=torch.Generator().manual_seed(10 + i))
        shards.append(full[r * rows:(r + 1) * rows].clone())
    gm = make_fx(read_all)(*shards)
    for node, name in zip([x for x in gm.graph.nodes if x.target is gp.AG], LAB_SHAPES):
        node.meta["param"] = name
    return gm, shards


def _reference_bucketing(gm):
    """``bucket_all_gathers`` with the package's own per-run rewrite behind the seam."""
    from minifsdp import graph_passes as gp
    from minifsdp.labs import seams

    yours = gp.bucket_run
    gp.bucket_run = seams.reference(BUCKET)
    try:
        return gp.bucket_all_gathers(gm)
    finally:
        gp.bucket_run = yours


def run_lab(t, info) -> None:
    """Lab 10's cases, on every rank: a hand-made graph bucketed and run against the same graph
    unbucketed; then a SimpleFSDP GPT compiled once with your pass, against eager SimpleFSDP."""
    import contextlib
    import copy

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from minifsdp import graph_passes as gp
    from minifsdp.labs import heartbeat
    from minifsdp.models import GPT, GPTConfig
    from minifsdp.serial_collectives import runnable
    from minifsdp.simple_fsdp import data_parallel, param_name

    n, r = info.world_size, info.rank
    with t.case("a hand-made graph: 8 parameter reads, 2 blocks, uneven rows", (BUCKET,)):
        gm, shards = _hand_graph(n, r)
        want = gp.collectives(_reference_bucketing(copy.deepcopy(gm)))
        yours = gp.bucket_all_gathers(copy.deepcopy(gm))
        t.expect("collectives after your pass", gp.collectives(yours), want, phase="pass")
        expected = runnable(gm)(*shards)  # the unbucketed graph: an all-gather per parameter
        # yours runs as graph_passes.backend would run it: on gloo, one collective in flight
        # whatever your pass left (Note [one collective in flight on gloo])
        for name, got, full in zip(LAB_SHAPES, runnable(yours)(*shards), expected):
            t.expect(f"{name}, gathered", got, full, phase="run")

    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32)
    mesh = init_device_mesh(info.device.type, (n,))

    def gpt():
        torch.manual_seed(0)
        return data_parallel(GPT(cfg), mesh)

    def batch(step):
        x = torch.randint(0, cfg.vocab_size, (2 * n, cfg.seq_len + 1),
                          generator=torch.Generator().manual_seed(step))
        return x[:, :-1].chunk(n)[r], x[:, 1:].chunk(n)[r]

    with t.case("a 2-block GPT under SimpleFSDP, compiled with your pass: 3 AdamW steps against "
                "eager SimpleFSDP", (BUCKET,)):
        graphs = []

        def bucketing(gm):  # yours on the graph; the reference's on a copy, for the lists
            want = gp.collectives(_reference_bucketing(copy.deepcopy(gm)))
            gm = gp.bucket_all_gathers(gm)
            graphs.append((gp.collectives(gm), want))
            return gm

        eager, model = gpt(), gpt()
        compiled = torch.compile(model, backend=gp.backend([bucketing]), fullgraph=True)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
        for step in range(LAB_STEPS):
            x, y = batch(step)
            # step 0 compiles the forward and the backward graph: Note [a lab never hangs]
            with heartbeat.patient() if step == 0 else contextlib.nullcontext():
                losses = [F.cross_entropy(m(x).flatten(0, 1), y.flatten())
                          for m in (eager, compiled)]
                for loss in losses:
                    loss.backward()
            if step == 0:
                for kind, (got, want) in zip(("forward", "backward"), graphs):
                    t.expect(f"{kind} graph's collectives", got, want, phase="compile")
                fw = sum(op.startswith("all_gather") for op, *_ in graphs[0][0])
                t.expect("forward graph's all-gathers (B + 2)", fw,
                         forward_all_gathers(cfg.n_layer, True), phase="compile")
            t.expect("loss", losses[1].detach(), losses[0].detach(), step=step, phase="forward")
            for opt in opts:
                opt.step()
                opt.zero_grad()
            want = dict(eager.named_parameters())
            for name, p in model.named_parameters():
                t.expect(param_name(name), p.detach().full_tensor(),
                         want[name].detach().full_tensor(), step=step, phase="optimizer step")


def hint(name: str, got, expected, n: int) -> str | None:
    if name.endswith("collectives") or name.endswith("collectives after your pass"):
        ags = [sum(op.startswith("all_gather") for op, *_ in c) for c in (got, expected)]
        if ags[0] > ags[1]:
            return (f"yours has {ags[0] - ags[1]} all-gather(s) more: are the run's old "
                    "all-gathers and waits still in the graph? Erase them once their users read "
                    "your slices")
        if ags[0] < ags[1]:
            return ("yours has fewer all-gathers: one bucket per run, no more (Note [a bucket in "
                    "the graph])")
        return ("same count, another shape or label: the bucket gathers N × the sum of the "
                "padded shards' numels (Note [padding]); label it with the run's parameters")
    if (name.endswith(", gathered") and isinstance(got, torch.Tensor)
            and got.shape == expected.shape):
        return ("the gathered bucket is rank-major, (N, total): row r is rank r's flat shards "
                "in the cat's order, so parameter j is columns [o_j, o_j + numel_j) of every row "
                "(Note [copy-in and copy-out], Note [a bucket in the graph])")
    return None


LAB = Lab(
    id="10",
    title="the bucketing pass",
    skeleton="labs/lab10_bucketing.py",
    seams=(Seam(BUCKET, "minifsdp.graph_passes", "bucket_run"),),
    notes=("a bucket in the graph", "copy-in and copy-out", "padding", "what compile sees"),
    run=run_lab,
    hint=hint,
    oracle="the unbucketed graph and eager SimpleFSDP",
    hints=(
        "Bucketing replaces a block's many small all-gathers by one: concatenate the shards, "
        "gather once, and cut each parameter's rows back out, so every consumer sees exactly "
        'the tensor it saw before. Read Note [a bucket in the graph], Note [copy-in and copy-'
        'out] and Note [padding].',
        "The gathered buffer is rank-major: N slots, each the concatenation of this block's "
        "flattened shards in run order. Viewed as [N, total], parameter p's columns are "
        '[off_p, off_p + numel_p); viewed back as [N * rows_per_rank, ...] they are its '
        "padded full tensor, whose first dim-0 rows are the real ones. Every old wait's users"
        ' must read the new tensor instead; the old nodes must go.',
        'before the first all-gather: flat = [reshape(s, [-1]) for s in shards]; cat; one AG.'
        ' Before the first wait: WAIT it; view [N, total]; per parameter: slice its columns, '
        'reshape to [N * rows, *rest], narrow to the real rows; replace_all_uses_with of its '
        'old wait; then erase the old waits and all-gathers.',
    ),
)
