"""ZeRO stages 1 and 2: shard the optimizer state, then the gradients, over data-parallel ranks.

DDP keeps a full copy of the parameters (P), gradients (G) and optimizer state (OS) on every
rank. But an optimizer step is elementwise, so rank r only *needs* to update 1/N of the
parameters -- and only needs the optimizer state and the averaged gradient of that 1/N. That
is ZeRO (Rajbhandari et al. 2020)::

    model, opt = setup_zero(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), stage=2)
    for x, y in batches:                 # this rank's local batch
        loss_fn(model(x), y).backward()  # gradients averaged bucket by bucket, in backward
        opt.step()                       # step my shard, then all-gather the parameters
        opt.zero_grad(set_to_none=True)

Per rank, fp32 Adam, Psi parameters (``minifsdp.analytic.model_state_bytes``)::

              params   grads     optimizer   communication per step (S = 4 Psi bytes)
    DDP       4 Psi    4 Psi     8 Psi       all-reduce G                     2(N-1)/N S
    ZeRO-1    4 Psi    4 Psi     8 Psi / N   all-reduce G + all-gather P      3(N-1)/N S
    ZeRO-2    4 Psi    4 Psi / N 8 Psi / N   reduce-scatter G + all-gather P  2(N-1)/N S

Stage 1 and stage 2 differ in one collective (``ZeroOptimizer._reduce``), see Note [ZeRO-1
traffic]. The model itself is not wrapped: ZeRO-1/2 leave forward and backward alone, so
``setup_zero`` returns the same module (its parameters now views, Note [flat partition]).

Note [flat partition]: which elements does rank r own? Flatten all trainable parameters, in
``model.parameters()`` order, into one 1-D buffer, pad it with zeros to a multiple of N and
cut it into N equal contiguous slices: rank r owns slice r. Every rank then holds exactly
1/N of the optimizer state (plus at most N-1 padding elements in total), whatever the shapes
-- a per-tensor split would leave fc1 (98% of the CNN) on one rank. The inner optimizer steps
slice r as *one* 1-D parameter, and the layout is what the collectives want: a
reduce-scatter of the flat gradient hands rank r the average of exactly its slice, and an
all-gather of the N slices rebuilds the flat parameters. The flattening is physical: every
parameter becomes a view into the flat buffer (``p.data = flat[o:o + n].view(shape)``), as
in FSDP1's FlatParameter and DeepSpeed. So the optimizer updates the model in place through
slice r, and the all-gather writes the other slices straight into the parameters (in place:
its input is its own output's slice r) -- no copy of the weights, no copying back. (FSDP1
also pads each parameter to a 16-byte boundary for kernels that want aligned pointers; we
pack them tightly, and the parity tests include parameters at odd offsets.)

Note [ZeRO buckets]: stage 2 frees a full gradient as soon as it has been reduce-scattered, so it
must reduce-scatter *during* backward, a bucket at a time, not the whole flat gradient at the
end. A reduce-scatter splits its own input N ways, hence the partition is per bucket: each
bucket is a flat buffer of consecutive parameters (Note [flat partition]) and rank r owns
slice r of every bucket. With one bucket -- the default 25 MiB cap holds both our models --
this is exactly the single contiguous slice. Buckets are filled from the last parameters,
whose gradients backward produces first. (DeepSpeed instead keeps one contiguous partition
and sends each bucket's pieces to their owners with ``dist.reduce``; FSDP makes each wrapped
unit a bucket, as here.) We keep the collectives blocking: overlapping them with backward is
chapter 02's topic, and this chapter's is memory.

Note [elementwise optimizers]: stepping one flat 1-D shard equals stepping each parameter
only if an element's update depends on nothing but its own gradient, its own state and
scalars (lr, the step count). True for SGD (momentum, Nesterov, weight decay), Adam, AdamW,
Adadelta, Adagrad, Adamax, NAdam, RAdam, RMSprop, Rprop and ASGD. Not true for optimizers
that look at a whole tensor or at all parameters: Adafactor (row/column statistics of 2-D
weights), Muon (orthogonalizes 2-D matrices), LAMB/LARS (per-tensor norms), LBFGS (global dot
products). Gradient clipping by global norm likewise needs the shards' squared norms summed
over ranks. All shards share the inner optimizer's hyperparameters: per-parameter options
(no weight decay on biases) would need one set of buckets per parameter group.

Note [ZeRO-1 traffic]: stage 1 all-reduces gradients exactly as DDP does, so after backward
``p.grad`` holds the averaged full gradient on every rank (clipping and gradient logging work
unchanged) -- yet each rank then uses only its 1/N of it, and pays another (N-1)/N S to
all-gather the parameters: 1.5x DDP's bytes. A reduce-scatter delivers just the slice each
rank needs for half an all-reduce's bytes; stage 2 uses it and frees the rest, which brings
the traffic back to DDP's 2(N-1)/N S ("no additional communication", the paper's section 7;
7.2.1 derives it).
Those are the ring algorithm's bytes, which NCCL's reduce-scatter sends; gloo has none of its
own and runs it as an all-reduce of a copy of the input (torch's
``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), so on gloo stage 2 saves no traffic.

Note [ZeRO memory categories]: how ``MemoryTracker`` sees these tensors. ``params``: the flat
buffers, padding included (the shards are views, not copies). ``optimizer``: the inner
optimizer's state, via ``opt.state`` (the inner optimizer's own dict): per bucket, Adam keeps
two slice-sized tensors and one 0-d fp32 ``step``, i.e. ``8 * shard_numel + 4`` bytes. ``grads``:
stage 1's flat gradient buffers (the ``p.grad`` are views into them), stage 2's gradient
shards, tagged with ``memory.tag`` since no model parameter points to them. ``comm``: stage
2's bucket while backward fills it -- the whole model's size with one bucket, so a smaller
``bucket_cap_mb`` is what bounds stage 2's transient gradient memory. A gradient that
autograd has just made, before our hook copies it into its bucket, is ``other`` (created in
backward), one tensor at a time. Also ``other``: on gloo, the copy of the whole bucket that
stage 2's reduce-scatter makes inside the call (see Note [ZeRO-1 traffic]; NCCL makes none),
and, in the step, the inner optimizer's temporaries over the shard (torch's single-tensor
AdamW, its CPU default, makes two of the shard's size: 8 bytes per shard element).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp

from minifsdp import comm
from minifsdp.memory import tag

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(eq=False)
class Bucket:
    """Consecutive parameters flattened into one padded buffer, sharded N ways.

    ``flat`` has shape ``(N * shard_numel,)``; ``params[i]`` is the view
    ``flat[offsets[i]:offsets[i] + params[i].numel()]``; ``shard`` is slice ``rank`` of
    ``flat`` (a view, as an ``nn.Parameter`` for the inner optimizer). ``grad`` is this rank's
    flat gradient (same shape as ``flat``) while backward fills it; ``pending`` counts the
    parameters whose gradient has not arrived yet in this backward.
    """

    params: list[nn.Parameter]
    offsets: list[int]
    flat: torch.Tensor
    shard: nn.Parameter
    grad: torch.Tensor | None = None
    pending: int = 0

    @property
    def numel(self) -> int:
        """Elements of the parameters, without the padding."""
        return sum(p.numel() for p in self.params)


def flatten_into_buckets(params: list[nn.Parameter], rank: int, world_size: int,
                         cap_bytes: float) -> list[Bucket]:
    """Group ``params`` into buckets of at most ``cap_bytes`` (a larger parameter gets a bucket
    of its own), copy each group into a zero-padded flat buffer and make the parameters views
    of it (Notes [flat partition] and [buckets]). Buckets come in backward order (last
    parameters first); inside a bucket parameters keep their order.

    Example:
        >>> lin = nn.Linear(3, 2)                            # 6 + 2 = 8 elements
        >>> [b] = flatten_into_buckets(list(lin.parameters()), rank=1, world_size=3,
        ...                            cap_bytes=2**20)
        >>> b.flat.shape, b.offsets, b.shard.shape           # padded to 9, rank 1 owns 3:6
        (torch.Size([9]), [0, 6], torch.Size([3]))
        >>> lin.weight.data_ptr() == b.flat.data_ptr()
        True
    """
    if not params:
        raise ValueError("ZeRO needs at least one parameter with requires_grad")
    groups: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in reversed(params):
        if groups[-1] and size + p.nbytes > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.nbytes
    buckets = []
    for group in groups:
        group.reverse()
        if len({(p.dtype, p.device) for p in group}) > 1:
            raise ValueError("ZeRO flattens parameters into one buffer per bucket: they must "
                             "share dtype and device (mixed precision is FSDP's chapter)")
        offsets = [sum(p.numel() for p in group[:i]) for i in range(len(group))]
        shard_numel = -(-sum(p.numel() for p in group) // world_size)  # ceil: pad the tail
        flat = group[0].new_zeros(world_size * shard_numel)
        with torch.no_grad():
            for p, o in zip(group, offsets):
                view = flat[o:o + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view  # the parameter now lives in the flat buffer
        shard = nn.Parameter(flat[rank * shard_numel:(rank + 1) * shard_numel])
        buckets.append(Bucket(group, offsets, flat, shard))
    return buckets


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO stage 1 or 2 around any elementwise ``torch.optim`` optimizer.

    Args:
        params: the model's parameters; those with ``requires_grad`` are sharded.
        make_opt: ``make_opt(shards) -> torch.optim.Optimizer``, the optimizer to run on this
            rank's shards: one 1-D parameter of shape ``(shard_numel,)`` per bucket, a view
            of the bucket's flat buffer (Note [elementwise optimizers]).
        stage: 1 shards the optimizer state, 2 also the gradients.
        bucket_cap_mb: bucket size in MiB (Note [ZeRO buckets]).
        group: the data-parallel process group (default: the world).

    ``state`` and ``param_groups`` *are* the inner optimizer's, so LR schedulers and
    ``MemoryTracker`` work unchanged. ``state_dict()`` is this rank's shard of the state (a
    sharded checkpoint: load it back at the same world size and bucket layout); there is no
    full (unsharded) optimizer state dict -- that is the checkpoint chapter's subject.
    A parameter that gets no gradient in a backward counts as a zero gradient in buckets that
    did get some (torch.optim would skip it); every rank must leave out the same parameters.

    Example (N ranks, each with its own ``x``)::

        opt = ZeroOptimizer(model.parameters(), lambda ps: torch.optim.Adam(ps), stage=2)
        model(x).sum().backward()    # each rank keeps the averaged gradient of its shards
        opt.step()                   # shards stepped, then all-gathered: replicas equal
        opt.zero_grad()
    """

    def __init__(self, params: Iterable[nn.Parameter], make_opt: MakeOptimizer, stage: int = 1,
                 bucket_cap_mb: float = 25.0, group: dist.ProcessGroup | None = None):
        if stage not in (1, 2):
            raise ValueError(f"ZeRO stage must be 1 or 2, got {stage} (stage 3 is FSDP)")
        self.stage, self.group = stage, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        trainable = [p for p in params if p.requires_grad]
        self.buckets = flatten_into_buckets(trainable, self.rank, self.world_size,
                                            bucket_cap_mb * 2**20)
        shards = [b.shard for b in self.buckets]
        self.inner = make_opt(shards)
        super().__init__(shards, self.inner.defaults)  # the hooks machinery of Optimizer
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        for i, b in enumerate(self.buckets):
            for p, offset in zip(b.params, b.offsets):
                p.register_post_accumulate_grad_hook(partial(self._on_grad, i, offset))

    # ---- backward: gradients into buckets, buckets reduced as soon as they are full -------

    @torch.no_grad()
    def _on_grad(self, i: int, offset: int, p: nn.Parameter) -> None:
        """Runs when ``p.grad`` is final for this backward: copy it into bucket ``i``."""
        b = self.buckets[i]
        if b.pending == 0:  # the bucket's first gradient in this backward
            b.pending = len(b.params)
        if b.grad is None:  # zeros: the padding's gradient
            b.grad = torch.zeros_like(b.flat)
            tag(b.grad, "grads" if self.stage == 1 else "comm")
        view = b.grad[offset:offset + p.numel()].view_as(p)
        view.copy_(p.grad)  # a no-op when p.grad is already this view (stage 1 accumulating)
        # Stage 1 keeps the full gradient, in the bucket (as DDP's gradient_as_bucket_view);
        # stage 2 frees it now instead of after the step.
        p.grad = view if self.stage == 1 else None
        b.pending -= 1
        if b.pending == 0:
            self._reduce(i)

    def _reduce(self, i: int) -> None:
        """Average bucket ``i``'s gradient over ranks, leaving this rank's slice of it in the
        shard's ``.grad``. The one place where stage 1 and stage 2 differ."""
        b = self.buckets[i]
        b.pending = 0
        n = b.shard.numel()
        if self.stage == 1:  # DDP's all-reduce: every rank gets the whole average ...
            comm.all_reduce(b.grad, ReduceOp.AVG, self.group, tag=f"zero1 grads {i}")
            b.shard.grad = b.grad[self.rank * n:(self.rank + 1) * n]  # ... and uses 1/N
            return
        mine = b.flat.new_empty(n)
        tag(mine, "grads")
        comm.reduce_scatter_tensor(mine, b.grad, ReduceOp.AVG, self.group, tag=f"zero2 grads {i}")
        b.grad = None  # the bucket is freed: only the shard's gradient survives
        if b.shard.grad is None:
            b.shard.grad = mine
        else:  # gradient accumulation over several backwards
            b.shard.grad += mine

    # ---- the step: each rank its shard, then everyone everything --------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's shards with the inner optimizer, then all-gather the parameters."""
        if closure is not None:
            raise NotImplementedError("ZeroOptimizer.step takes no closure")
        for i, b in enumerate(self.buckets):
            if b.pending:  # a parameter got no gradient: reduce what the bucket has
                self._reduce(i)
        self.inner.step()
        for i, b in enumerate(self.buckets):
            comm.all_gather_into_tensor(b.flat, b.shard, self.group, tag=f"zero params {i}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the shards' gradients and the model's (``set_to_none`` frees them)."""
        self.inner.zero_grad(set_to_none)
        for b in self.buckets:
            if set_to_none:
                b.grad = None
                for p in b.params:
                    p.grad = None
            elif b.grad is not None:  # stage 1: the parameters' .grad are views into it
                b.grad.zero_()

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state (see the class docstring)."""
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` saved by this rank with the same world size and buckets."""
        self.inner.load_state_dict(state_dict)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state


def setup_zero(model: nn.Module, make_opt: MakeOptimizer, stage: int = 1,
               bucket_cap_mb: float = 25.0,
               group: dist.ProcessGroup | None = None) -> tuple[nn.Module, ZeroOptimizer]:
    """Make ``model``'s replicas identical (rank 0's values) and build its ZeRO optimizer.

    Returns ``(model, optimizer)``: the same module, its trainable parameters now views into
    the buckets' flat buffers, and a ``ZeroOptimizer`` (see it for the arguments).

    Example (inside a torchrun worker; ``minifsdp.train --strategy zero2`` does this)::

        model, opt = setup_zero(MnistCNN(), lambda ps: torch.optim.Adam(ps, lr=1e-3), stage=2)
    """
    opt = ZeroOptimizer(model.parameters(), make_opt, stage, bucket_cap_mb, group)
    with torch.no_grad():
        for i, b in enumerate(opt.buckets):  # one broadcast per bucket, not per tensor
            comm.broadcast(b.flat, group=group, group_src=0, tag=f"zero init {i}")
        frozen = [p for p in model.parameters() if not p.requires_grad]
        for t in [*frozen, *model.buffers()]:
            comm.broadcast(t, group=group, group_src=0, tag="zero init")
    return model, opt
