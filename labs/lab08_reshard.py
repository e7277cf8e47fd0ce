"""Lab 08: resharding a checkpoint on load. Read Note [resharding] and Note [what DCP stores].

Write rows_to_read below: which rows of which saved chunk this rank loads. The package's DCP
load planner (minifsdp.checkpoint.ReshardingLoadPlanner, used by load_checkpoint) calls it
through seam "checkpoint.rows_to_read" for every dim-0 sharded tensor, and turns each answer
into one DCP read. Check: python -m minifsdp.labs 08   (start: python -m minifsdp.labs 08 --start)
Bar: saved at N - 1 and loaded at N, and back, every rank's rows equal the full tensor's bit for
bit at N = 2 and 3; a fully_shard model's load_checkpoint and next AdamW step equal the saver's.
"""


def rows_to_read(d0, world_size, rank, saved):
    """Which global rows ``rank`` of ``world_size`` needs from each saved chunk.

    Args:
        d0: rows of the whole tensor (dim 0); it is sharded on dim 0 like FSDP2's parameters.
        world_size, rank: the *loading* run.
        saved: one ``(start, stop)`` of global rows per saved chunk, in ``.metadata`` order
            (the saving run's ranks; a saving rank with no rows may have a chunk of none);
            together they tile rows ``[0, d0)``, no gaps, no overlaps.

    Returns ``[(chunk, start, stop), ...]`` in row order: global rows ``[start, stop)`` of
    ``saved[chunk]`` that lie in this rank's rows, one entry per overlapping chunk, none empty.
    This rank's rows are ``torch.chunk``'s: ``ceil(d0 / world_size)`` per rank, the last ranks
    fewer or none. Example: ``rows_to_read(10, 3, 1, [(0, 3), (3, 6), (6, 9), (9, 10)])`` ->
    ``[(1, 4, 6), (2, 6, 8)]``.
    """
    # TODO(lab 08): return the reads. The contract, which the checker holds you to:
    #   - together they cover exactly this rank's rows, each row once (a rank with no rows
    #     reads nothing);
    #   - each (chunk, start, stop) names saved[chunk] by its index in saved as given, and
    #     reads only rows that chunk holds; start < stop; at most one entry per chunk;
    #   - entries in row order, whatever the order of saved;
    #   - saved is the only truth about the saving run: its chunks may be uneven, empty or
    #     listed out of order (another framework's split), so never re-derive them from d0.
    #   Stuck? python -m minifsdp.labs 08 --hint (three graded hints).
    raise NotImplementedError("lab 08: rows_to_read in labs/lab08_reshard.py")
