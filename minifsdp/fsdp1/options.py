"""FSDP1's knobs, spelled as torch FSDP1 spells them, so a config file reads the same::

    FullyShardedDataParallel(model, auto_wrap_policy=policy,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True,  # default: None
        cpu_offload=CPUOffload(offload_params=False))

Each is a value object; what it does lives in ``fully_sharded.py`` and ``flat_param.py``,
which cite the Notes below.

Note [FSDP1 mixed precision]: the FlatParameter shard, the optimizer's copy, stays in full precision
(fp32): low precision is only for the trip to compute and back. To unshard, the shard is *cast*
to ``param_dtype`` and the low-precision shards are all-gathered (half the wire bytes and half
the unsharded memory of fp32 for bf16); forward and backward run on bf16 views, so the unsharded
gradient is bf16 too. It is cast to ``reduce_dtype`` (if that differs), divided, reduce-scattered
in ``reduce_dtype``, divided again, and only then cast to fp32 and added to ``flat_param.grad``
(torch's ``_reduce_grad`` and ``_accumulate_sharded_grad``, in that order: the same operations
give the same bits). ``reduce_dtype=None`` with a ``param_dtype`` means reduce in
``param_dtype``, as torch does. Buffers are cast to ``buffer_dtype`` once, at the root's first
forward (torch's lazy init), and the root casts floating-point inputs to ``param_dtype`` (torch's
``cast_root_forward_inputs``). ``summon_full_params`` and the full state dict gather the fp32
shards (torch's ``_force_full_precision``): what is saved is the optimizer's copy, not its
rounding. What halves: the all-gather's bytes, the unsharded parameters and the unsharded
gradients; what does not: the shards, their gradients and the optimizer state (fp32, 16 bytes an
element with Adam), and a reduce in fp32 moves fp32 bytes.

Note [backward prefetch]: without prefetch a unit's all-gather starts when its backward needs it,
and the computation waits for it. With a prefetch the *next* unit's all-gather is issued early,
so on a GPU it runs during this unit's computation, at the price of one more unit unsharded at
once. "Next" is the reverse of the order in which units *finished* their forward in this
iteration (torch's ``_ExecOrderData.handles_post_forward_order``, recorded anew every forward):
``BACKWARD_PRE`` issues it in this unit's pre-backward hook, right after its own all-gather (two
units' parameters alive during a backward, plus a gradient); ``BACKWARD_POST`` in the
post-backward hook, after this unit freed its parameters and before its reduce-scatter (less
memory, less overlap). A unit is prefetched only if it will still need an all-gather in this
backward. torch FSDP1's default is ``BACKWARD_PRE``; ours is None, so that the memory a unit
costs reads plainly in chapter 04 (one unit gathered at a time) and prefetch is a choice you see.
Compare with torch at equal settings: pass the same ``backward_prefetch`` to both.

Note [forward prefetch]: ``forward_prefetch=True`` issues the next unit's all-gather in this
unit's pre-forward, after its own. "Next" follows the order of the *first* iteration's forward
(recorded once: it assumes a static graph), so the first iteration prefetches nothing. The
forward's all-gathers come in the same order as without it; what changes is that unit k + 1 is
gathered before unit k computes: one more unit alive during forward. The prefetch also makes
the unit's views (as torch does), so autograd numbers their backward nodes before the
computation of unit k: in backward, unit k's pre-backward all-gather then comes *before* unit
k + 1's reduce-scatter (autograd runs the later-created of two ready nodes first), as in torch.

Note [FSDP1 no_sync]: inside ``with model.no_sync():`` a backward keeps each unit's unsharded
gradient (autograd adds the next micro-batch's into it) and communicates nothing; the first backward
outside reduce-scatters the sum once. Price: every unit's unsharded gradient, the whole model's
in fp32 (4 Psi bytes, not 4 Psi / N) lives from the first micro-batch to the last; under
SHARD_GRAD_OP the unsharded parameters stay too (torch keeps them as a speed-for-memory trade).

Note [frozen parameters]: a unit may mix trainable and frozen (``requires_grad=False``)
parameters, as torch FSDP1 allows with ``use_orig_params=True``. They share one FlatParameter,
so the frozen ones are still gathered, computed with, and their gradient elements still
reduce-scattered (autograd differentiates the flat tensor as a whole): the price of freezing
inside a unit, versus a unit of its own. What must not happen is a step. torch hands the
optimizer the original parameters, a frozen one with ``grad=None``, which every optimizer skips.
Ours sees one FlatParameter, and skipping part of a tensor is not something an optimizer can
be told; a zero gradient is not enough either: AdamW's weight decay moves an element whatever
its gradient (``p -= lr * wd * p``), and SGD's momentum carries old steps. So we do two things:
the reduced gradient's frozen elements are set to zero (what the optimizer, ``clip_grad_norm_``
and a reader of ``flat_param.grad`` see: nothing to learn), and around every ``optimizer.step()``
(a process-wide pre/post step hook, installed by the first unit with a frozen parameter) the
frozen elements of each FlatParameter it steps are saved and written back. For an elementwise
optimizer (SGD, Adam, AdamW, Adagrad, Adadelta: each element's update reads only that element's
value, gradient and state) this is exactly "not stepped", and the trainable elements get the
same bits as torch's per-parameter step (tests/test_fsdp1_knobs.py). An optimizer that mixes
elements of one tensor (LAMB's per-tensor trust ratio, Shampoo) would see frozen values inside
the flat tensor: use FSDP2 (a parameter per tensor) for those. A unit whose parameters are all
frozen has a FlatParameter with ``requires_grad=False``: no gradient, no reduce-scatter.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ShardingStrategy(enum.Enum):
    """Note [sharding strategies] in ``fully_sharded.py``. ``ShardingStrategy.parse("no_shard")``
    also accepts names."""

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    NO_SHARD = "no_shard"

    @classmethod
    def parse(cls, value: ShardingStrategy | str) -> ShardingStrategy:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"unknown sharding strategy {value!r}; choose from "
                             f"{[s.value for s in cls]}") from None


class BackwardPrefetch(enum.Enum):
    """When to issue the next unit's all-gather in backward (Note [backward prefetch]).
    ``BackwardPrefetch.parse("backward_post")`` also accepts names; ``"none"`` gives None."""

    BACKWARD_PRE = "backward_pre"
    BACKWARD_POST = "backward_post"

    @classmethod
    def parse(cls, value: BackwardPrefetch | str | None) -> BackwardPrefetch | None:
        if value is None or isinstance(value, cls):
            return value
        if str(value).lower() == "none":
            return None
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(f"unknown backward_prefetch {value!r}; choose from "
                             f"{[s.value for s in cls] + ['none']}") from None


@dataclass(frozen=True)
class CPUOffload:
    """Keep the sharded parameters and their gradients in host memory (Note [CPU offload] in
    ``fully_sharded.py``)."""

    offload_params: bool = False


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes of the trip to compute and back (Note [FSDP1 mixed precision]); None keeps the
    parameters' own dtype (``reduce_dtype=None`` with a ``param_dtype``: reduce in it).

    Example:
        >>> mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> mp.param_dtype, mp.reduce_dtype, mp.buffer_dtype
        (torch.bfloat16, torch.float32, None)
        >>> MixedPrecision(param_dtype="bf16")
        Traceback (most recent call last):
        ...
        ValueError: MixedPrecision.param_dtype must be a floating torch.dtype or None, got 'bf16'
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            v = getattr(self, field)
            if v is not None and not (isinstance(v, torch.dtype) and v.is_floating_point):
                raise ValueError(f"MixedPrecision.{field} must be a floating torch.dtype "
                                 f"or None, got {v!r}")

    def dtypes_for(self, dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
        """``(param, reduce)`` dtypes for parameters of ``dtype`` (torch's inference rule).

        Example:
            >>> MixedPrecision(param_dtype=torch.bfloat16).dtypes_for(torch.float32)
            (torch.bfloat16, torch.bfloat16)
        """
        if self.param_dtype is not None and self.reduce_dtype is None:
            return self.param_dtype, self.param_dtype
        return self.param_dtype or dtype, self.reduce_dtype or dtype
