"""Chapter 08 (checkpointing): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises_08.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import math

from minifsdp.labs.ch05 import FSDP2_SHAPES, dim0_rows
from minifsdp.labs.seams import Lab, Seam
from minifsdp.notebook import check


def reshard_reads(d0: int, saved_world: int, new_world: int,
                  new_rank: int) -> list[tuple[int, int, int]]:
    """``[(saved_rank, start_row, stop_row), ...]``: the global rows that ``new_rank`` of a
    ``new_world``-rank run reads from each saving rank's file, for a parameter of ``d0`` rows
    sharded with ``chunk_dim0`` (Note [resharding] in ``minifsdp/checkpoint.py``)."""
    def bounds(n):
        rows, out, lo = dim0_rows(d0, n), [], 0
        for r in rows:
            out.append((lo, lo + r))
            lo += r
        return out

    lo, hi = bounds(new_world)[new_rank]
    reads = []
    for r, (a, b) in enumerate(bounds(saved_world)):
        if min(hi, b) > max(lo, a):
            reads.append((r, max(lo, a), min(hi, b)))
    return reads


def check_reshard_reads(fn) -> bool:
    """``fn(d0, saved_world, new_world, new_rank)`` -> ``[(saved_rank, start, stop), ...]``."""
    cases = [((d0, s, n, r), reshard_reads(d0, s, n, r))
             for d0, s, n in [(10, 4, 3), (10, 4, 2), (10, 2, 4), (2, 4, 3), (768, 2, 3),
                              (7, 3, 1), (5, 1, 4)] for r in range(n)]
    return check("reshard reads", cases, fn)


def shard_payload_bytes(shapes: list[tuple], world_size: int, rank: int) -> int:
    """Tensor bytes of one rank's rows in a sharded FSDP2 checkpoint with fp32 Adam(W): the
    parameter, ``exp_avg`` and ``exp_avg_sq`` rows it owns (no padding: DCP stores each
    DTensor's local rows). Replicated values (Adam's ``step``) and DCP's metadata not counted."""
    return sum(12 * dim0_rows(s[0], world_size)[rank] * math.prod(s[1:]) for s in shapes)


def check_shard_payload_bytes(fn) -> bool:
    """``fn(shapes, world_size, rank)`` -> bytes of the rank's rows (params + Adam state)."""
    cases = [((shapes, n, r), shard_payload_bytes(shapes, n, r))
             for shapes, ns in FSDP2_SHAPES for n in ns for r in range(n)]
    return check("checkpoint bytes per rank", cases, fn)


def after_saves(events: list[str], keep: int = 2) -> tuple[str | None, list[str]]:
    """What a checkpoint directory holds after ``events`` -- ``"save 3"`` (a completed save of
    step 3) or ``"crash 9"`` (a save of step 9 killed before its rename) -- with ``keep``:
    ``(latest, sorted directory names)`` (Note [atomic save]). A crashed save leaves
    ``step_000009.tmp``; the next completed save deletes every ``.tmp``."""
    latest, dirs = None, set()
    for ev in events:
        kind, step = ev.split()
        name = f"step_{int(step):06d}"
        if kind == "crash":
            dirs.add(name + ".tmp")
            continue
        dirs = {d for d in dirs if not d.endswith(".tmp")} | {name}
        latest = name
        done = sorted(d for d in dirs if not d.endswith(".tmp"))
        dirs -= set(done[:-keep])
    return latest, sorted(dirs)


def check_after_saves(fn) -> bool:
    """``fn(events, keep)`` -> ``(latest, sorted directory names)``."""
    runs = [["save 3", "save 6", "save 9"], ["save 3", "crash 6"], ["save 3", "crash 6", "save 6"],
            ["crash 3"], ["save 2", "save 4", "crash 6", "crash 8"], ["save 5", "save 10"]]
    cases = [((ev, k), after_saves(ev, k)) for ev in runs for k in (1, 2, 3)]
    return check("checkpoint directory after saves", cases, fn)


# ---- lab 08: resharding on load: which rows of which saved chunk -------------------------------

ROWS = "checkpoint.rows_to_read"
LAB_SHAPES = {"a": (10, 3), "b": (7, 2), "c": (2, 3), "d": (12,)}  # uneven, rows < N, 1-D


def _lab_tensor(shape, seed: int):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _my_rows(d0: int, n: int, rank: int) -> tuple[int, int]:
    per = -(-d0 // n)  # torch.chunk, DTensor's Shard(0)
    return min(rank * per, d0), min((rank + 1) * per, d0)


def _reshard_cases(t, root, save_mesh, load_mesh, n: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor

    from minifsdp import checkpoint
    from minifsdp.labs import seams

    ns, nl = save_mesh.size(), load_mesh.size()
    path = root / f"saved_at_{ns}"
    full = {k: _lab_tensor(s, i) for i, (k, s) in enumerate(LAB_SHAPES.items())}
    if save_mesh.get_coordinate() is not None:  # the saving ranks: the package's DCP format
        dcp.save({k: distribute_tensor(v, save_mesh, [Shard(0)]) for k, v in full.items()},
                 checkpoint_id=path, process_group=save_mesh.get_group())
    dist.barrier()
    loading = load_mesh.get_coordinate() is not None
    used = (ROWS,) if loading else ()
    meta = dcp.FileSystemReader(path).read_metadata()
    ok = True
    with t.case(f"saved at N = {ns}, loaded at N = {nl}: the reads", used):
        if loading:
            me = load_mesh.get_local_rank()
            for k, v in full.items():
                saved = [(c.offsets[0], c.offsets[0] + c.sizes[0])
                         for c in meta.state_dict_metadata[k].chunks]
                got = checkpoint.rows_to_read(v.shape[0], nl, me, saved)
                want = seams.reference(ROWS)(v.shape[0], nl, me, saved)
                ok &= t.expect(f"{k} {tuple(v.shape)}, saved chunks {saved}: reads",
                               list(got), want)
    # Reads that do not fit this rank's rows would fail inside DCP: every rank agrees first
    # and skips the load in lockstep, with the divergence above.
    flag = torch.tensor([float(ok)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item():
        with t.case(f"saved at N = {ns}, loaded at N = {nl}: dcp.load with the package's "
                    "planner", used):
            if loading:
                me = load_mesh.get_local_rank()
                state = {k: distribute_tensor(torch.full(v.shape, float("nan")), load_mesh,
                                              [Shard(0)]) for k, v in full.items()}
                dcp.load(state, checkpoint_id=path, planner=checkpoint.ReshardingLoadPlanner(),
                         process_group=load_mesh.get_group())
                for k, v in full.items():
                    lo, hi = _my_rows(v.shape[0], nl, me)
                    t.expect(f"{k} {tuple(v.shape)}: loaded rows {lo}-{hi}",
                             state[k].to_local(), v[lo:hi])
    dist.barrier()


# Saved layouts that torch.chunk never makes: another framework's (or a hand-written) split,
# an empty chunk between two others, chunks listed out of row order. DCP's .metadata can hold
# any of them (it records each chunk's offsets and sizes), so the reads must come from
# ``saved`` itself, never from re-deriving the saving run's split.
OTHER_LAYOUTS = [(10, [(0, 1), (1, 7), (7, 10)]), (10, [(0, 4), (4, 4), (4, 10)]),
                 (10, [(6, 10), (0, 6)]), (9, [(0, 8), (8, 9)]),
                 (5, [(0, 2), (2, 2), (2, 3), (3, 5)])]


def _reads_by_rows(d0: int, n: int, rank: int, saved) -> list[tuple[int, int, int]]:
    """The expected reads from the rows themselves: this rank's rows are torch.chunk's (torch
    itself, not a formula), each row read from the saved chunk holding it, runs merged."""
    import torch

    parts = torch.arange(d0).chunk(n)
    mine = parts[rank].tolist() if rank < len(parts) else []
    reads: list[list[int]] = []
    for row in mine:
        i = next(i for i, (a, b) in enumerate(saved) if a <= row < b)
        if reads and reads[-1][0] == i and reads[-1][2] == row:
            reads[-1][2] = row + 1
        else:
            reads.append([i, row, row + 1])
    return [tuple(x) for x in reads]


def _other_layouts_case(t, n: int, rank: int) -> None:
    from minifsdp import checkpoint

    with t.case("saved layouts that are not torch.chunk splits (the reads, no DCP)", (ROWS,)):
        for d0, saved in OTHER_LAYOUTS:
            t.expect(f"d0 = {d0}, saved chunks {saved}: reads",
                     list(checkpoint.rows_to_read(d0, n, rank, list(saved))),
                     _reads_by_rows(d0, n, rank, saved))


def _train_step(model, opt, n: int, r: int, step: int):
    import torch

    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(4 * n, 3, generator=g).chunk(n)[r], torch.randn(4 * n, 5, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y.chunk(n)[r])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def run_lab(t, info) -> None:
    """Lab 08's cases, on every rank: DTensors saved at N - 1 ranks (a sub-mesh) and loaded at
    N, saved at N and loaded at N - 1, against the full tensors' rows; the reads from saved
    layouts that are not torch.chunk splits (``OTHER_LAYOUTS``); then a real
    ``save_checkpoint`` / ``load_checkpoint`` of a ``fully_shard`` model and one AdamW step."""
    import shutil
    import tempfile
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from minifsdp import checkpoint

    n, r = info.world_size, info.rank
    box = [tempfile.mkdtemp(prefix="minifsdp_lab08_") if r == 0 else None]
    dist.broadcast_object_list(box)
    root = Path(box[0])
    full_mesh = init_device_mesh(info.device.type, (n,))
    small = DeviceMesh("cpu", list(range(n - 1)))
    _reshard_cases(t, root, small, full_mesh, n)
    _reshard_cases(t, root / "back", full_mesh, small, n)
    _other_layouts_case(t, n, r)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh(), torch.nn.Linear(2, 5))
        fully_shard(model, mesh=full_mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    with t.case("load_checkpoint into a fully_shard model (a (2, 3) weight: rows < N at "
                "N = 3), then one AdamW step", (ROWS,)):
        model, opt = build()
        _train_step(model, opt, n, r, 0)
        checkpoint.save_checkpoint(root / "ck", model, opt, step=1)
        model2, opt2 = build()
        checkpoint.load_checkpoint(root / "ck", model2, opt2)
        for (name, p), q in zip(model.named_parameters(), model2.parameters()):
            t.expect(f"{name}: loaded rows", q.to_local().detach(), p.to_local().detach())
        t.expect("loss of the next step", _train_step(model2, opt2, n, r, 1),
                 _train_step(model, opt, n, r, 1), step=1)
        for (name, p), q in zip(model.named_parameters(), model2.parameters()):
            t.expect(f"{name} after the step", q.to_local().detach(), p.to_local().detach(),
                     step=1, phase="optimizer")
    dist.barrier()
    if r == 0:
        shutil.rmtree(root, ignore_errors=True)


def hint(name: str, got, expected, n: int) -> str | None:
    if name.endswith("reads"):
        return ("this rank's rows are torch.chunk's: ceil(d0 / N) each, the last ranks fewer or "
                "none; read the overlap [max(lo, a), min(hi, b)) of every saved chunk (a, b) "
                "that overlaps them, and nothing else (Note [resharding])")
    return None


LAB = Lab(
    id="08",
    title="resharding a checkpoint on load",
    skeleton="labs/lab08_reshard.py",
    seams=(Seam(ROWS, "minifsdp.checkpoint", "rows_to_read"),),
    notes=("resharding", "what DCP stores"),
    run=run_lab,
    hint=hint,
    oracle="the full tensors' rows (DCP, saved at N ± 1) and the uninterrupted run",
    hints=(
        'A checkpoint saved at N ranks holds each tensor as N row chunks; loading at another '
        'N means each new rank reads the rows it will own from whichever saved chunks overlap'
        " them. Read Note [resharding] and Note [what DCP stores]. (torch's own default load "
        'planner already reshards like this; the lab builds the rule it follows.)',
        'This rank owns the rows [lo, hi) that torch.chunk gives it over d0 rows at '
        'world_size: ceil(d0 / world_size) rows a chunk, the last ones shorter or empty. Each'
        ' saved chunk is a half-open row range (a, b), known by its index in saved; the answer'
        ' lists the non-empty intersections of [lo, hi) with those ranges, each with its '
        "chunk's index, sorted by row (saved may list its chunks in any order).",
        'per = ceil(d0 / world_size); lo = min(rank * per, d0); hi = min(lo + per, d0); for '
        'each index i of saved, taken in the order of the chunks\' starts: (a, b) = saved[i];'
        ' s, e = max(lo, a), min(hi, b); if s < e: keep (i, s, e). Return what you kept.',
    ),
)
