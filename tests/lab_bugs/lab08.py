"""Lab 08's planted bugs: row arithmetic a learner plausibly gets wrong when a checkpoint saved
at one world size is loaded at another (Note [resharding]).

Each function replaces the seam (``@replaces``); tests/test_labs.py checks that the checker
rejects it and points where the bug shows first.
"""

from minifsdp.labs.seams import replaces


@replaces("checkpoint.rows_to_read")
def floor_rows_per_rank(d0, world_size, rank, saved):
    """``d0 // N`` rows per rank instead of ``ceil(d0 / N)``: with 7 rows at N = 2 rank 0 reads
    rows 0-3 where DTensor holds 0-4 (Note [resharding]: ``chunk_dim0`` is ``torch.chunk``)."""
    per = d0 // world_size
    lo, hi = min(rank * per, d0), min((rank + 1) * per, d0)
    return [(i, max(lo, a), min(hi, b)) for i, (a, b) in enumerate(saved)
            if min(hi, b) > max(lo, a)]


@replaces("checkpoint.rows_to_read")
def balanced_split_like_numpy(d0, world_size, rank, saved):
    """Splits rows as ``numpy.array_split`` does (the first ``d0 % N`` ranks one more), not as
    ``torch.chunk``: the same at N = 2, not at N = 3 for 10 rows (Note [resharding])."""
    q, rem = divmod(d0, world_size)
    lo = rank * q + min(rank, rem)
    hi = lo + q + (rank < rem)
    return [(i, max(lo, a), min(hi, b)) for i, (a, b) in enumerate(saved)
            if min(hi, b) > max(lo, a)]


@replaces("checkpoint.rows_to_read")
def touching_chunks_overlap(d0, world_size, rank, saved):
    """Off by one in the overlap test (``>=``): a saved chunk that only touches this rank's
    rows at a boundary gives an empty read (2 rows at N = 3)."""
    per = -(-d0 // world_size)
    lo, hi = min(rank * per, d0), min((rank + 1) * per, d0)
    return [(i, max(lo, a), min(hi, b)) for i, (a, b) in enumerate(saved)
            if min(hi, b) >= max(lo, a) and b > a]


@replaces("checkpoint.rows_to_read")
def rows_relative_to_the_chunk(d0, world_size, rank, saved):
    """Returns rows counted inside the saved chunk (``start - a``) instead of global rows: right
    for the first chunk only, so it shows when a rank reads a later chunk."""
    per = -(-d0 // world_size)
    lo, hi = min(rank * per, d0), min((rank + 1) * per, d0)
    return [(i, max(lo, a) - a, min(hi, b) - a) for i, (a, b) in enumerate(saved)
            if min(hi, b) > max(lo, a)]


EXPECTED = {
    "floor_rows_per_rank": dict(status="diverged", world_sizes=(2,), rank=0,
                                case="saved at N = 1, loaded at N = 2: the reads",
                                name="b (7, 2), saved chunks [(0, 7)]: reads",
                                hint="ceil(d0 / N)"),
    "balanced_split_like_numpy": dict(status="diverged", world_sizes=(3,), rank=1,
                                      case="saved at N = 2, loaded at N = 3: the reads",
                                      hint="Note [resharding]"),
    "touching_chunks_overlap": dict(status="diverged", world_sizes=(3,),
                                    case="saved at N = 2, loaded at N = 3: the reads"),
    "rows_relative_to_the_chunk": dict(status="diverged", world_sizes=(2,),
                                       case="saved at N = 2, loaded at N = 1: the reads"),
}
