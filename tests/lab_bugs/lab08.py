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


@replaces("checkpoint.rows_to_read")
def recomputes_the_saved_split(d0, world_size, rank, saved):
    """Ignores the saved chunks' bounds and recomputes them as torch.chunk of ``len(saved)``
    ranks, assuming the saving run split like this one: right for every checkpoint FSDP2
    wrote, wrong for any other layout ``.metadata`` can record (Note [what DCP stores])."""
    per, m = -(-d0 // world_size), -(-d0 // len(saved))
    lo, hi = min(rank * per, d0), min((rank + 1) * per, d0)
    bounds = [(min(i * m, d0), min((i + 1) * m, d0)) for i in range(len(saved))]
    return [(i, max(lo, a), min(hi, b)) for i, (a, b) in enumerate(bounds)
            if min(hi, b) > max(lo, a)]


@replaces("checkpoint.rows_to_read")
def keeps_metadata_order(d0, world_size, rank, saved):
    """Returns the reads in ``.metadata`` order, not row order (Note [resharding]: the reads
    are listed in row order): the same whenever the saved chunks are listed by row."""
    per = -(-d0 // world_size)
    lo, hi = min(rank * per, d0), min((rank + 1) * per, d0)
    return [(i, max(lo, a), min(hi, b)) for i, (a, b) in enumerate(saved)
            if min(hi, b) > max(lo, a)]


@replaces("checkpoint.rows_to_read")
def drops_empty_chunks_before_numbering(d0, world_size, rank, saved):
    """Filters out the saved chunks of no rows first, then numbers the rest: every chunk after
    an empty one gets the wrong index (Note [what DCP stores]: a chunk's index is its place
    in ``.metadata``, empty or not)."""
    per = -(-d0 // world_size)
    lo, hi = min(rank * per, d0), min((rank + 1) * per, d0)
    kept = [(a, b) for a, b in saved if b > a]
    return [(i, max(lo, a), min(hi, b)) for i, (a, b) in enumerate(kept)
            if min(hi, b) > max(lo, a)]


@replaces("checkpoint.rows_to_read")
def ceil_as_floor_plus_one(d0, world_size, rank, saved):
    """Writes ``ceil(d0 / N)`` as ``d0 // N + 1``: one row too many per rank whenever N
    divides d0, so every shard boundary moves (Note [resharding])."""
    per = d0 // world_size + 1
    lo, hi = min(rank * per, d0), min((rank + 1) * per, d0)
    by_row = sorted(enumerate(saved), key=lambda x: x[1])
    return [(i, max(lo, a), min(hi, b)) for i, (a, b) in by_row if min(hi, b) > max(lo, a)]


@replaces("checkpoint.rows_to_read")
def last_shard_counted_back(d0, world_size, rank, saved):
    """Takes every rank's rows as ``per`` rows ending at its stop, ``lo = hi - per``: right
    for full shards, but the uneven last shard (and an empty one, 2 rows at N = 3) starts too
    early and re-reads the previous rank's rows (Note [resharding])."""
    per = -(-d0 // world_size)
    hi = min((rank + 1) * per, d0)
    lo = max(0, hi - per)
    by_row = sorted(enumerate(saved), key=lambda x: x[1])
    return [(i, max(lo, a), min(hi, b)) for i, (a, b) in by_row if min(hi, b) > max(lo, a)]


OTHER = "saved layouts that are not torch.chunk splits (the reads, no DCP)"
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
    "recomputes_the_saved_split": dict(
        status="diverged", world_sizes=(2,), case=OTHER,
        name="d0 = 10, saved chunks [(0, 1), (1, 7), (7, 10)]: reads"),
    "keeps_metadata_order": dict(status="diverged", world_sizes=(2,), case=OTHER, rank=1,
                                 name="d0 = 10, saved chunks [(6, 10), (0, 6)]: reads"),
    "drops_empty_chunks_before_numbering": dict(
        status="diverged", world_sizes=(2,), case=OTHER,
        name="d0 = 10, saved chunks [(0, 4), (4, 4), (4, 10)]: reads"),
    "ceil_as_floor_plus_one": dict(status="diverged", world_sizes=(2,), rank=0,
                                   case="saved at N = 1, loaded at N = 2: the reads",
                                   name="a (10, 3), saved chunks [(0, 10)]: reads"),
    "last_shard_counted_back": dict(status="diverged", world_sizes=(2,), rank=1,
                                    case="saved at N = 1, loaded at N = 2: the reads",
                                    name="b (7, 2), saved chunks [(0, 7)]: reads"),
}
