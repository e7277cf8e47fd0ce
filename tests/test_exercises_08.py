"""Chapter 08 (checkpointing): the exercises' solutions, right and wrong, for the checkers in
minifsdp/labs/ch08.py; the tests that every checker gets are in tests/exercise_checks.py."""

import math

from exercise_checks import checker_tests

from minifsdp.labs import ch08


def _bounds(d0, n):
    per = -(-d0 // n)
    return [(min(d0, r * per), min(d0, (r + 1) * per)) for r in range(n)]


def reshard_reads(d0, saved_world, new_world, new_rank):
    lo, hi = _bounds(d0, new_world)[new_rank]
    return [(r, max(lo, a), min(hi, b)) for r, (a, b) in enumerate(_bounds(d0, saved_world))
            if min(hi, b) > max(lo, a)]


def reshard_reads_even_split(d0, saved_world, new_world, new_rank):
    """Splits rows as evenly as possible, not torch.chunk's way."""
    def bounds(n):
        cuts = [d0 * r // n for r in range(n + 1)]
        return list(zip(cuts, cuts[1:]))
    lo, hi = bounds(new_world)[new_rank]
    return [(r, max(lo, a), min(hi, b)) for r, (a, b) in enumerate(bounds(saved_world))
            if min(hi, b) > max(lo, a)]


def reshard_reads_whole_files(d0, saved_world, new_world, new_rank):
    """Reads every overlapping saved shard whole instead of just the overlap."""
    lo, hi = _bounds(d0, new_world)[new_rank]
    return [(r, a, b) for r, (a, b) in enumerate(_bounds(d0, saved_world))
            if min(hi, b) > max(lo, a)]


def shard_payload_bytes(shapes, world_size, rank):
    return sum(12 * (lambda b: b[1] - b[0])(_bounds(s[0], world_size)[rank]) * math.prod(s[1:])
               for s in shapes)


def shard_payload_bytes_padded(shapes, world_size, rank):
    """Stores the padded shard: DCP writes the DTensor's local rows only."""
    return sum(12 * -(-s[0] // world_size) * math.prod(s[1:]) for s in shapes)


def shard_payload_bytes_params_only(shapes, world_size, rank):
    """Forgets Adam's two states."""
    return shard_payload_bytes(shapes, world_size, rank) // 3


def after_saves(events, keep=2):
    latest, dirs = None, []
    for ev in events:
        kind, step = ev.split()
        name = f"step_{int(step):06d}"
        if kind == "crash":
            dirs.append(name + ".tmp")
        else:
            done = sorted({d for d in dirs if not d.endswith(".tmp")} | {name})
            dirs, latest = done[-keep:], name
    return latest, sorted(set(dirs))


def after_saves_latest_moves_on_crash(events, keep=2):
    """Points `latest` at a save that never completed."""
    latest, dirs = after_saves(events, keep)
    crashed = [e for e in events if e.startswith("crash")]
    if crashed and events[-1] == crashed[-1]:
        latest = f"step_{int(crashed[-1].split()[1]):06d}"
    return latest, dirs


def after_saves_keeps_tmp(events, keep=2):
    """Never cleans up a crashed save's .tmp directory."""
    latest, dirs = after_saves(events, keep)
    tmps = {f"step_{int(e.split()[1]):06d}.tmp" for e in events if e.startswith("crash")}
    return latest, sorted(set(dirs) | tmps)


# checker -> (the name it prints, a correct solution, wrong solutions)
SOLUTIONS = {
    "check_reshard_reads": ("reshard reads", reshard_reads,
                            [reshard_reads_even_split, reshard_reads_whole_files]),
    "check_shard_payload_bytes": ("checkpoint bytes per rank", shard_payload_bytes,
                                  [shard_payload_bytes_padded, shard_payload_bytes_params_only]),
    "check_after_saves": ("checkpoint directory after saves", after_saves,
                          [after_saves_latest_moves_on_crash, after_saves_keeps_tmp]),
}

(test_every_checker_has_solutions_here, test_accepts_a_correct_solution,
 test_rejects_a_wrong_solution, test_a_wrong_solution_gets_a_one_line_verdict,
 test_a_stub_is_not_implemented_yet) = checker_tests(ch08, SOLUTIONS)
