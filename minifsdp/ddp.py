"""Data parallelism by hand, in two steps. ``NaiveDDP`` averages every gradient once backward
has finished; ``BucketedDDP`` packs gradients into buckets and all-reduces each bucket *while
backward is still running*, as ``torch.nn.parallel.DistributedDataParallel`` does::

    model = BucketedDDP(model, bucket_cap_mb=25)  # every rank now holds rank 0's weights
    loss = loss_fn(model(x), y)                    # x: this rank's B/N samples
    loss.backward()                                # on return, .grad = the average over ranks
    opt.step()                                     # the same update on every rank

Note [data parallel in one paragraph]: every rank holds the whole model and sees its own B/N
samples. If the replicas start equal (a broadcast from rank 0) and all apply the same update,
computed from the average of the N local gradients (which *is* the gradient of the global
batch's mean loss), they stay equal without ever exchanging weights. The one communication is
an all-reduce of the gradients per step; this file is about *when*, and *in what pieces*.

Note [divide first]: torch DDP multiplies each gradient by 1/N while copying it into its bucket
(reducer.cpp: ``mul_out(bucket_view, grad, 1/N)``), then all-reduces with SUM; it uses neither
ReduceOp.AVG nor a division of the sum. We do the same float operations, so at N = 2 both
compute ``g0 * 0.5 + g1 * 0.5``, bit for bit. (For N a power of two, scaling first or last is
exact either way; for N = 3, ``g * float(1/3)`` and ``g / 3`` can differ in the last bit.)
Scaling first also keeps a low-precision sum from overflowing.

Note [when backward ends]: modules have no "backward finished" hook, but autograd's engine
runs callbacks queued with ``Variable._execution_engine.queue_callback`` once the whole graph is
done, still inside ``loss.backward()``. The first gradient hook of a backward queues ours, so
the loop stays ``loss.backward(); opt.step()``. torch's DDP and FSDP end backward the same way.

Note [buckets]: an all-reduce per parameter pays a collective's fixed latency once per tensor,
and starting after backward leaves the network idle while backward runs. Buckets sit between:
parameters are grouped in *reverse* order (backward produces gradients roughly last layer
first) into flat buffers of about ``bucket_cap_mb``. A gradient hook copies each gradient into
its bucket; when a bucket's last gradient arrives, its all-reduce is launched asynchronously and
backward goes on computing earlier layers meanwhile. Buckets launch strictly in order 0, 1, 2,
... even if a later one fills first: ranks match collectives by their order of issue, so all
must issue the same sequence (torch's reducer does the same). The final callback waits for
every bucket and copies the averages back into ``.grad``.

Note [bucket copies vs views]: our buckets hold a *copy* of the gradients, so gradient memory
is counted twice while ``.grad`` exists (the buckets live as long as the model), and copying in
and out costs two passes over it. torch's default, ``gradient_as_bucket_view=False``, does the
same. With ``True``, each ``.grad`` is a view into its bucket: autograd accumulates straight
into the bucket, the copy back disappears and gradients are stored once. The price is aliasing:
``zero_grad(set_to_none=True)`` no longer frees gradient memory (the bucket stays), and when
``.grad`` is replaced the reducer must notice and re-point it. We keep the simpler copy;
``tag(bucket, "comm")`` shows the buckets in a ``MemoryTracker``.

Note [no_sync]: gradient accumulation over k micro-batches needs no communication until the
last one. A forward inside ``with model.no_sync():`` leaves the hooks disarmed, so gradients add
up in ``.grad``; the next synced backward's hooks fire after *its* gradient was added, so the
accumulated sum is what gets scaled by 1/N and all-reduced, as in torch DDP. As in torch, the
flag is read in ``forward``: the forward must run inside the block, the backward may follow it.

Note [unused parameters]: a parameter without a gradient (a branch not taken) never fires its
hook, so its bucket never fills. A rank must not just skip that bucket: another rank may have
used the parameter and would wait forever for its partner. So in the final callback every rank
fills the missing slots and launches every bucket still pending, in order. Then all ranks must
learn who missed what, to take the same decision: with ``find_unused_parameters=False`` all raise
the same error naming parameters and ranks; with ``True`` a missing gradient counts as zero, and
a parameter no rank used keeps ``.grad = None`` so the optimizer skips it, as in torch. The facts
take one small all-gather of a status per parameter. With ``True`` it runs every step (torch
all-reduces its map of used parameters every step too). With ``False`` a missing gradient is an
error, so its slot's values no longer matter, and they can carry the news instead: a rank fills
a missing slot with NaN, and since NaN plus anything is NaN, after the all-reduce every rank
finds NaN in that slot (the all-reduce hands every rank the same sums). So every rank looks at
the first element of each parameter's slot, and runs the all-gather only if one is NaN: never
in a healthy step, which costs no message at all; also when a gradient really is NaN, where the
status then says that nobody missed anything. torch skips the check when
``find_unused_parameters=False`` and finds out at the next forward, on the ranks that missed a
gradient only; a rank that did not is left waiting in backward for a bucket that never comes.
(With ``True``, torch also searches the autograd graph after forward, so an unused parameter's
bucket need not wait for the end of backward; ours just launches late.)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.autograd import Variable

from minifsdp import comm
from minifsdp.memory import tag

FINAL_SPAN = "ddp final callback"  # the comm log's compute span of the final callback


@torch.no_grad()
def broadcast_module_state(module: nn.Module, group: Any = None) -> None:
    """Overwrite every rank's parameters and buffers with the group's rank 0's, in place.

    One logged broadcast per tensor (torch coalesces them into a few large ones).

    Example (under ``torchrun --nproc-per-node 2``)::

        layer = nn.Linear(4, 4)            # a different random init on each rank...
        broadcast_module_state(layer)      # ...and now rank 0's on both
    """
    for t in [*module.parameters(), *module.buffers()]:
        comm.broadcast(t.detach(), group=group, group_src=0, tag="init")


class NaiveDDP(nn.Module):
    """Data parallelism in its simplest correct form: when backward has finished, all-reduce
    every gradient, one parameter at a time (Note [when backward ends], Note [divide first]).

    Communication starts only after the last gradient exists, and every tensor pays the
    collective's fixed latency: ``BucketedDDP`` fixes both. Every rank must give every trainable
    parameter a gradient in every backward (a missing one is reduced as zeros, so ranks never
    disagree on the number of collectives). Buffers are broadcast once, at construction.

    Args:
        module: the model, built identically on every rank; rank 0's weights win.
        process_group: the ranks to average over (default: all).

    Shapes: whatever ``module`` takes and returns. After ``loss.backward()`` every ``p.grad``
    (shaped like ``p``) holds the mean of the ranks' gradients.

    Example (under ``torchrun --nproc-per-node 2``)::

        model = NaiveDDP(nn.Linear(4, 1))
        model(torch.randn(8, 4)).sum().backward()  # each rank: its own 8 samples
        model.module.weight.grad                   # (1, 4), identical on both ranks
    """

    def __init__(self, module: nn.Module, process_group: Any = None):
        super().__init__()
        self.module, self.process_group = module, process_group
        self.world_size = dist.get_world_size(process_group)
        broadcast_module_state(module, process_group)
        self._named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._queued = False
        for _, p in self._named:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._queued:  # the first gradient of this backward
            self._queued = True
            Variable._execution_engine.queue_callback(self._all_reduce_grads)

    def _all_reduce_grads(self) -> None:
        self._queued = False
        with comm.span(FINAL_SPAN):
            for name, p in self._named:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.mul_(1 / self.world_size)  # Note [divide first]
                comm.all_reduce(p.grad, group=self.process_group, tag=name)


def assign_buckets(params: list[torch.Tensor], cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of about ``cap_bytes``, in *reverse* order.

    Walking from the last parameter to the first, a bucket is closed as soon as it holds
    ``cap_bytes`` or more (so one large parameter may overshoot the cap, as in torch), or when
    the dtype or device changes (a bucket is one flat tensor).

    Example:
        >>> ps = [torch.empty(100), torch.empty(300), torch.empty(50)]  # 400, 1200, 200 bytes
        >>> assign_buckets(ps, cap_bytes=1000)
        [[2, 1], [0]]
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(params))):
        p = params[i]
        if current and (p.dtype, p.device) != (params[current[0]].dtype,
                                               params[current[0]].device):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + [current] if current else buckets


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose gradients it holds, back to back.

    ``params``: indices into ``BucketedDDP._params``. ``buffer``: ``(sum of their numel,)``,
    their dtype and device. ``firsts``: ``(len(params),)``, where each one's slot starts in
    ``buffer`` (Note [unused parameters]). ``pending``: gradients still to arrive in this
    backward; at 0 the bucket may be launched. ``work``: its in-flight all-reduce.
    """

    index: int
    params: list[int]
    buffer: torch.Tensor
    firsts: torch.Tensor
    pending: int = 0
    work: Any = None


# Per parameter, after a synced backward (Note [unused parameters]).
READY, MISSING_WITH_GRAD, MISSING = 0, 1, 2


class BucketedDDP(nn.Module):
    """torch-style DDP: gradient hooks fill flat buckets, and each full bucket's all-reduce runs
    while backward computes the earlier layers' gradients (Note [buckets]).

    Args:
        module: the model, built identically on every rank; rank 0's weights win.
        bucket_cap_mb: bucket size in MiB (torch's default, 25; torch, when its
            ``bucket_cap_mb`` is left unset, also caps its first bucket at 1 MiB, which we do
            not). Smaller: more, earlier all-reduces (more overlap, more per-call latency);
            larger: fewer, later ones.
        find_unused_parameters: if False, a parameter without a gradient in a synced backward is
            an error on every rank; if True, it counts as zero (Note [unused parameters]).
        process_group: the ranks to average over (default: all).

    Attributes: ``buckets`` (launch order; bucket 0 holds the *last* parameters) and
    ``require_backward_grad_sync`` (False inside ``no_sync()``, Note [no_sync]).

    Shapes: whatever ``module`` takes and returns; after a synced ``loss.backward()`` every
    ``p.grad`` (shaped like ``p``) holds the mean of the ranks' (accumulated) gradients.

    Example (under ``torchrun --nproc-per-node 2``)::

        model = BucketedDDP(GPT(GPTConfig()), bucket_cap_mb=0.05)
        len(model.buckets)                         # 7: 450 KB of gradients, 52 KB a bucket
        with model.no_sync():                      # accumulate without communicating
            loss_fn(model(x1), y1).backward()
        loss_fn(model(x2), y2).backward()          # all-reduces the accumulated sum
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0,
                 find_unused_parameters: bool = False, process_group: Any = None):
        super().__init__()
        self.module, self.process_group = module, process_group
        self.find_unused_parameters = find_unused_parameters
        self.require_backward_grad_sync = True
        self.world_size = dist.get_world_size(process_group)
        broadcast_module_state(module, process_group)

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # not frozen
        self._names, self._params = [n for n, _ in named], [p for _, p in named]
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[Bucket, torch.Tensor]] = {}  # param index -> where it goes
        for k, ids in enumerate(assign_buckets(self._params, int(bucket_cap_mb * 2**20))):
            ps = [self._params[i] for i in ids]
            numels = [p.numel() for p in ps]
            buffer = torch.zeros(sum(numels), dtype=ps[0].dtype, device=ps[0].device)
            views = [v.view(p.shape) for v, p in zip(buffer.split(numels), ps)]
            # each slot's first element: where NaN says "missed" (Note [unused parameters])
            firsts = torch.tensor([0, *itertools.accumulate(numels)][:-1], device=buffer.device)
            self.buckets.append(Bucket(k, ids, buffer, firsts))
            self._slot.update({i: (self.buckets[-1], v) for i, v in zip(ids, views)})
        self._views = [self._slot[i][1] for i in range(len(self._params))]  # in param order
        # 1/N as a CPU double scalar, made once: torch.mul with a Python float builds one per
        # call (half the cost of a small multiply), and a CPU scalar multiplies the same bits
        # as torch's C++ wrapped scalar, for any dtype and on a GPU too (Note [divide first])
        self._scale = torch.tensor(1 / self.world_size, dtype=torch.float64)
        # an empty parameter has no element to carry a NaN: then the status goes every step
        self._in_band = not find_unused_parameters and all(p.numel() for p in self._params)
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(functools.partial(self._on_grad_ready, i))
        self._armed = False  # set by a synced forward, cleared by the final callback
        self._reset()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Like torch, the decision to sync is taken here: the backward of this output will
        # all-reduce unless we are inside no_sync() (Note [no_sync]).
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._reset()
            self._armed = True
            tag([b.buffer for b in self.buckets], "comm")  # visible to an active MemoryTracker
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside the block, forward/backward only accumulate ``.grad`` locally."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def _reset(self) -> None:
        self._ready = [False] * len(self._params)
        for b in self.buckets:
            b.pending, b.work = len(b.params), None
        self._next_bucket, self._queued = 0, False

    # ---- during backward ---------------------------------------------------------------

    # seam "ddp.grad_hook" (lab 02): labs/lab02_ddp.py's on_grad_ready replaces this method.
    def _on_grad_ready(self, i: int, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: ``param.grad`` now holds this backward's contribution."""
        if not self._armed:  # inside no_sync: the gradient just stays in .grad
            return
        if not self._queued:
            self._queued = True
            Variable._execution_engine.queue_callback(self._finish_backward)
        if self._ready[i]:
            raise RuntimeError(f"BucketedDDP: {self._names[i]} received a gradient twice in one "
                               "backward (reentrant checkpointing?), which is not supported")
        self._ready[i] = True
        bucket, view = self._slot[i]
        torch.mul(param.grad, self._scale, out=view)  # Note [divide first]
        bucket.pending -= 1
        if not bucket.pending:  # only a bucket that just filled can let one start
            self._launch_ready_buckets()

    # seam "ddp.launch" (lab 02): labs/lab02_ddp.py's launch_ready_buckets replaces this method.
    def _launch_ready_buckets(self) -> None:
        # In order only: collectives match by their order of issue (Note [buckets]).
        while self._next_bucket < len(self.buckets):
            b = self.buckets[self._next_bucket]
            if b.pending:
                return
            b.work = comm.all_reduce(b.buffer, group=self.process_group, async_op=True,
                                     tag=f"bucket {b.index}")
            self._next_bucket += 1

    # ---- after backward (Note [when backward ends]) ------------------------------------

    def _finish_backward(self) -> None:
        try:
            with comm.span(FINAL_SPAN):
                mine = self._fill_missing()
                self._launch_ready_buckets()  # now every bucket, on every rank
                stuck = [b for b in self.buckets if b.work is None]
                counting = [b.index for b in stuck if b.pending]
                if counting:  # a hook that did not count its gradient
                    raise RuntimeError(f"BucketedDDP: buckets {counting} were never launched: "
                                       "their pending counts did not reach 0 (Note [buckets])")
                if stuck:  # every gradient counted, yet a launch left ready buckets behind
                    raise RuntimeError(
                        f"BucketedDDP: buckets {[b.index for b in stuck]} were never launched "
                        "although their pending counts reached 0: a bucket is ready when its "
                        "count is 0, and one launch starts every ready bucket in order, not "
                        "only the next (Note [buckets])")
                for b in self.buckets:
                    b.work.wait()
                # Note [unused parameters]: every rank sees the same sums, so takes the same path
                status = self._exchange_status(mine) if self._maybe_missed() else None
                self._raise_if_unused(status)  # the same decision on every rank
                self._copy_back(status)
        finally:
            self._armed = False
            self._reset()

    def _fill_missing(self) -> list[int]:
        """Fill the slots of parameters that got no gradient in this backward; returns each
        parameter's status (READY, MISSING_WITH_GRAD, MISSING)."""
        status = [READY] * len(self._params)
        if all(self._ready):  # the usual step
            return status
        for i, p in enumerate(self._params):
            if self._ready[i]:
                continue
            bucket, view = self._slot[i]
            status[i] = MISSING if p.grad is None else MISSING_WITH_GRAD
            if self._in_band:  # an error anyway: the slot carries the news (Note [unused ...])
                view.fill_(float("nan"))
            elif p.grad is not None:  # accumulated under no_sync, unused in this step
                torch.mul(p.grad, self._scale, out=view)
            else:
                view.zero_()
            bucket.pending -= 1
        return status

    def _maybe_missed(self) -> bool:
        """After the all-reduces: may some rank have missed a gradient? With ``_in_band``, only
        if a slot's first element is NaN (Note [unused parameters]); else always."""
        if not self._in_band:
            return True
        firsts = [b.buffer[b.firsts].isnan().any() for b in self.buckets]
        return bool(torch.stack(firsts).any())

    def _exchange_status(self, mine: list[int]) -> list[list[int]]:
        """Every rank's status per parameter, ``[param][rank]``: one all-gather."""
        device = self.buckets[0].buffer.device
        status = torch.empty(self.world_size * len(mine), dtype=torch.int32, device=device)
        comm.all_gather_into_tensor(status, torch.tensor(mine, dtype=torch.int32, device=device),
                                    group=self.process_group, tag="unused check")
        return status.view(self.world_size, -1).T.tolist()

    def _copy_back(self, status: list[list[int]] | None) -> None:
        """``.grad = bucket view``: the averaged gradients leave the buckets (Note [bucket
        copies vs views]). ``status`` is None when no rank missed a gradient; a parameter no
        rank had a gradient for keeps ``.grad = None``."""
        if status is None:  # every rank had every gradient: one call copies them all
            torch._foreach_copy_([p.grad for p in self._params], self._views)
            return
        for i, p in enumerate(self._params):
            if status is not None and all(s == MISSING for s in status[i]):
                continue
            view = self._slot[i][1]
            if p.grad is None:  # unused here, used on another rank
                p.grad = torch.empty_like(p).copy_(view)
            else:
                p.grad.copy_(view)

    def _raise_if_unused(self, status: list[list[int]] | None) -> None:
        if self.find_unused_parameters or status is None:
            return
        missing = [f"  {name} (rank {', '.join(str(r) for r, s in enumerate(ss) if s)})"
                   for name, ss in zip(self._names, status) if any(ss)]
        if missing:
            raise RuntimeError(
                "BucketedDDP: these parameters received no gradient in this backward:\n"
                + "\n".join(missing) + "\nEvery rank raises this error. If some steps use only "
                "part of the model, pass find_unused_parameters=True; parameters that should "
                "not train need requires_grad=False.")
