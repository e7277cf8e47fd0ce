"""Chapter 08 (checkpointing): the exercises' one-line checkers.

Each ``check_*`` takes the reader's function, runs it on cases whose answers come from the
package's own implementation (or from a real run), prints one line (✓ or ✗ with the first
failing case) and returns True/False. ``tests/test_exercises.py`` checks that every checker
accepts a correct solution and rejects a wrong one.
"""

from __future__ import annotations

import math

from minifsdp.labs.ch05 import FSDP2_SHAPES, dim0_rows
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
