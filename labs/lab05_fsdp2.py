"""Lab 05: an FSDP2 group's unshard and reshard, its copy-out and copy-in. Read Note [copy-in
and copy-out] (fsdp_param_group.py) first.

Seams "fsdp2.unshard", "fsdp2.wait_for_unshard", "fsdp2.reshard" (FSDPParamGroup's methods),
"fsdp2.all_gather_copy_out" (FSDPParamGroup._all_gather_copy_out) and
"fsdp2.reduce_scatter_copy_in" (minifsdp.fsdp2.reduce.reduce_scatter_copy_in).
Check: python -m minifsdp.labs 05   (start: --start)   Hints: --hint (1, 2, 3)
Bar: bit for bit at N = 2 and 3: one group unsharded and resharded (blocking, issued then waited,
an all-gather dropped in flight, from a piece kept for k ranks), its collectives, its buffers'
bytes; each parameter from buffers of N slots and of 1 (fp32, bf16); the reduce-scatter input (also
for a subset of the parameters: only those with a gradient); 3 Adam steps of 2 micro-batches each
against torch's fully_shard (uneven rows, empty shards); the unsharded storage freed after forward
and backward.
Also read Note [padding], Note [dim-0 chunks], Note [freeing with resize_], Note [version
counter], Note [issue and wait] (prefetch.py), Note [reshard to k ranks] (hsdp.py) and Note [a
shard group of one rank]. Groups with all-gather extensions (chapter 07's float8) never reach
your three methods here.
"""

import torch

from minifsdp import comm  # noqa: F401  comm.all_gather_into_tensor(out, in, group, async_op, tag=)
from minifsdp.fsdp2.fsdp_param import chunk_dim0  # noqa: F401  rank r's rows: chunk_dim0(t, N)[r]
from minifsdp.fsdp2.fsdp_param_group import ShardedState  # noqa: F401  SHARDED, UNSHARDED, ...
from minifsdp.memory import tag  # noqa: F401  tag(t, "params" / "comm"): the memory tracker's books


def unshard(group, async_op=False):
    """Issue the group's all-gather: one collective for all its parameters.

    Given: ``group.sharded_state`` (a ``ShardedState``), ``group._in_flight`` (``None``, or
    ``(work, gathered, world)`` of an all-gather issued but not finished); the copy-ins that
    return ``(my_slot, gathered)``, ``my_slot`` a view of ``gathered``:
    ``group._all_gather_copy_in()`` (this rank's padded shards; over ``group.process_group``,
    ``group.world_size`` ranks) and, in state SHARDED_POST_FORWARD,
    ``group._post_forward_copy_in()`` (the piece kept after forward; over
    ``group.post_forward_ranks.group``, ``.size`` ranks: Note [reshard to k ranks]);
    ``comm.all_gather_into_tensor(gathered, my_slot, process_group, async_op, tag=...)``
    returns the work handle (``None`` when blocking).
    Must hold afterwards: while UNSHARDED or with an all-gather in flight, nothing happened
    (no collective); else exactly one all-gather was issued, tagged
    ``f"fsdp2 params {group.name}"``, over the group that matches the state -- none if that
    group is one rank, whose copy-in already filled ``gathered`` (Note [a shard group of one
    rank]) -- and ``group._in_flight`` holds its handle (or ``None``), buffer and world size;
    with ``async_op`` nothing waits and the modules still hold their sharded parameters;
    without, the unshard is finished (``group.wait_for_unshard()``). Notes [copy-in and
    copy-out], [issue and wait].
    """
    # TODO(lab 05): the contract above; `python -m minifsdp.labs 05 --hint` when stuck.
    raise NotImplementedError("lab 05: unshard in labs/lab05_fsdp2.py")


def wait_for_unshard(group):
    """Finish the all-gather that ``unshard`` issued: the modules compute with full parameters.

    Given: ``group._in_flight`` as ``unshard`` left it (``work.wait()`` blocks until the
    collective is done; ``work`` is ``None`` for a blocking one); ``group._all_gather_copy_out``
    (yours, below); per parameter ``p`` in ``group.fsdp_params``: ``p.unsharded_param`` and
    ``p.owners``, the ``(module, attribute name)`` pairs that hold it.
    Must hold afterwards: when nothing was in flight, nothing changed; else every parameter's
    owners hold ``p.unsharded_param`` (the same tensor object every step: autograd saved it)
    with the gathered values; the gathered buffer's storage holds 0 bytes now (free it with
    ``resize_``, not by dropping it: gloo may still hold a reference); no piece kept for k
    ranks remains (``group._post_forward_data`` is ``None``); ``group.sharded_state`` is
    UNSHARDED and ``group._in_flight`` is ``None``. Notes [freeing with resize_], [issue and
    wait].
    """
    # TODO(lab 05): the contract above; `python -m minifsdp.labs 05 --hint` when stuck.
    raise NotImplementedError("lab 05: wait_for_unshard in labs/lab05_fsdp2.py")


def reshard(group):
    """Free the group's unsharded parameters: the modules hold the sharded DTensors again.

    Given: ``group.discard_unshard()`` waits for an all-gather in flight and drops it (every
    rank issued it, so it must complete); per parameter: ``p.sharded_param``, ``p.owners``,
    ``p.unsharded_param`` and its 1-D buffer ``p._unsharded_data`` (``None`` before the first
    unshard).
    Must hold afterwards, from any state: nothing is in flight; every owner holds
    ``p.sharded_param``; the unsharded tensors still exist -- the same objects, which autograd
    may hold -- but their storage holds 0 bytes; no piece kept for k ranks remains
    (``group._post_forward_data`` is ``None``); ``group.sharded_state`` is SHARDED. Notes
    [freeing with resize_], [reshard to k ranks].
    """
    # TODO(lab 05): the contract above; `python -m minifsdp.labs 05 --hint` when stuck.
    raise NotImplementedError("lab 05: reshard in labs/lab05_fsdp2.py")


@torch.no_grad()
def all_gather_copy_out(group, gathered, world):
    """After the all-gather: every parameter of ``group`` gets its unsharded values.

    Given: ``gathered``, 1-D, ``world`` slots of S elements, as the all-gather left it
    (``world`` is the shard group's N, or k after ``reshard_after_forward=k``); per parameter
    ``p`` in ``group.fsdp_params`` (in slot order): ``p.padded_shard_numel`` (its piece of one
    rank's slot when world == N), ``p.orig_size``, and ``p.alloc_unsharded()``, its 1-D unsharded
    buffer of ``N * p.padded_shard_numel`` elements whose first ``numel`` elements are
    ``p.unsharded_param`` (tag it "params", label=group.name).
    Must hold afterwards: ``p.unsharded_param`` equals the full parameter, written in place into
    that buffer's storage (the same storage every step); its version counter has not moved;
    nothing refers to ``gathered`` (the caller frees it). Notes [copy-in and copy-out],
    [padding], [freeing with resize_], [version counter].
    """
    # TODO(lab 05): the contract above; `python -m minifsdp.labs 05 --hint` when stuck.
    raise NotImplementedError("lab 05: all_gather_copy_out in labs/lab05_fsdp2.py")


@torch.no_grad()
def reduce_scatter_copy_in(group, params, grads, dtype):
    """Before the reduce-scatter: the unsharded gradients, laid out so that each rank receives
    exactly its rows. Returns the reduce-scatter's input.

    Given: ``grads[i]``, parameter ``params[i]``'s full-shape gradient; ``group.world_size`` N
    (the shard group's, which need not be the world's); ``p.padded_shard_numel`` per parameter;
    ``dtype``, the reduce dtype. Returns: a new 1-D tensor of ``N * S`` elements in ``dtype``
    (S = the sum of the padded shard numels; tag it "comm") whose slot r, in ``params`` order,
    holds rank r's rows of every gradient (Note [dim-0 chunks]), each zero-padded to its padded
    shard numel. The caller frees it. Notes [copy-in and copy-out], [padding].
    """
    # TODO(lab 05): the contract above; `python -m minifsdp.labs 05 --hint` when stuck.
    raise NotImplementedError("lab 05: reduce_scatter_copy_in in labs/lab05_fsdp2.py")

