"""Every data-parallel strategy ``minifsdp.train`` runs, each declaring the flags it takes.

    @strategy("fsdp2", takes={"hsdp": ANY, "backward_prefetch": ("implicit", "explicit", "none")})
    def _fsdp2(model, info, args): ...          # returns the module to train

``train.parse_args`` checks every strategy-specific flag in one loop (``check_flags``): a flag
set on a strategy that does not take it, or a value it does not take, is refused with the
strategies that do ("--hsdp applies to --strategy fsdp2 and torch_fsdp2 only"), and ``--help``
lists who takes each flag (``takers``). FSDP1's prefetch values (``backward_pre``,
``backward_post``) and FSDP2's (``implicit``, ``explicit``) share a flag but are separate
choices: each builder declares its own set.

Note [strict and listed flags]: the flags in ``STRICT`` are refused where they do not apply.
The others (bucket size, FSDP1's wrapping, ``--reshard-after-forward`` ...) are only listed:
a strategy that does not take them ignores them, because one argument list is shared by the
jobs of a comparison (chapter 04 runs ``single`` with FSDP1's ``--auto-wrap``).

Note [one optimizer path]: torch's optimizers pick their kernels by the *type* of the
parameters: on a GPU they use the multi-tensor ``foreach`` kernels only if every parameter's
type is exactly ``Tensor``, ``Parameter`` or ``DTensor`` (``torch.optim.optimizer.
_default_to_fused_or_foreach``), else the per-tensor loop. Our FSDP1 hands the optimizer
``FlatParameter``s (a ``Parameter`` subclass), torch's FSDP1 with ``use_orig_params=True`` plain
``Parameter``s: on CUDA the two would run different Adam kernels, which round differently --
the likely cause of the 4.8e-5 gpucheck measured between them on an H200, while FSDP2 (DTensor
on both sides) and DDP were bitwise; on CPU neither uses foreach, so nothing showed (the
evidence, and the pairs that confirm it on a GPU: Note [FSDP1 on CUDA] in gpucheck). So
``make_optimizer`` chooses ``foreach`` itself, by device only, and every strategy gets the
same kernels as its torch counterpart.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from minifsdp.dist import DistInfo

# what a builder returns: the module to train, or (module, optimizer) when the strategy owns
# the optimizer (ZeRO shards its state)
Setup = nn.Module | tuple[nn.Module, torch.optim.Optimizer]
ANY = None  # a flag a strategy takes with any value


@dataclass(frozen=True)
class Strategy:
    """A registered strategy: ``build(model, info, args) -> Setup`` and the strategy-specific
    flags it takes (dest -> the values it takes, or ``ANY``); ``why`` says, per flag, why a
    value it does not take is refused; ``defaults`` fills flags left unset."""

    name: str
    build: Callable[[nn.Module, DistInfo, argparse.Namespace], Setup]
    takes: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)
    why: Mapping[str, str] = field(default_factory=dict)
    defaults: Mapping[str, object] = field(default_factory=dict)

    def __call__(self, model: nn.Module, info: DistInfo, args: argparse.Namespace) -> Setup:
        return self.build(model, info, args)


STRATEGIES: dict[str, Strategy] = {}

# refused where they do not apply (Note [strict and listed flags]), with why they belong
# where they do
STRICT = {
    "param_dtype": "mixed precision's reference is torch's FSDP with the same policy; single "
                   "has no counterpart",
    "reduce_dtype": "mixed precision's reference is torch's FSDP with the same policy",
    "output_dtype": "",
    "buffer_dtype": "FSDP2 leaves buffers alone",
    "clip_grad_norm": "ZeRO's sharded gradients need a norm across ranks that minifsdp.zero "
                      "does not compute",
    "forward_prefetch": "",
    "backward_prefetch": "",
    "hsdp": "",
    "comm_buffers": "",
}
# every strategy but FSDP1's: torch fully_shard's default (the others ignore it)
DEFAULTS = {"backward_prefetch": "implicit"}


def strategy(name: str, takes: Mapping[str, tuple[str, ...] | None] | None = None,
             why: Mapping[str, str] | None = None, defaults: Mapping[str, object] | None = None):
    """Register a data-parallel strategy under ``name`` (decorator).

    The function gets the unwrapped model (already on ``info.device``, same init on every
    rank), ``info`` and the parsed ``args``; it returns the module to train, or ``(module,
    optimizer)`` to build the optimizer itself (``make_optimizer(params, args)``, below).
    """

    def register(fn):
        STRATEGIES[name] = Strategy(name, fn, dict(takes or {}), dict(why or {}),
                                    dict(DEFAULTS if defaults is None else defaults))
        return fn

    return register


def takers(dest: str, value: object = None) -> list[str]:
    """The strategies that take flag ``dest`` (with ``value``, if given)."""
    return [s.name for s in STRATEGIES.values() if dest in s.takes and (
        value is None or s.takes[dest] is ANY or value in s.takes[dest])]


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def check_flags(args: argparse.Namespace, parser_defaults: Mapping[str, object],
                error: Callable[[str], None]) -> None:
    """Refuse every strict flag ``args.strategy`` does not take (or a value it does not take),
    naming the strategies that do; then fill the strategy's defaults. ``error`` reports (and
    raises), as ``ArgumentParser.error``."""
    s = STRATEGIES[args.strategy]
    for dest, note in STRICT.items():
        value = getattr(args, dest)
        unset = (parser_defaults[dest], s.defaults.get(dest, parser_defaults[dest]))
        if value in unset:
            continue
        flag = "--" + dest.replace("_", "-")
        note = f" ({note})" if note else ""
        if dest not in s.takes:
            error(f"{flag} applies to --strategy {_names(takers(dest))} only{note}")
        allowed = s.takes[dest]
        if allowed is not ANY and value not in allowed:
            error(f"{flag} {value}: {s.why[dest]}" if dest in s.why else
                  f"{flag} {value} applies to --strategy {_names(takers(dest, value))} only")
    for dest, value in s.defaults.items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)


# ---- the strategies -----------------------------------------------------------------------------
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FSDP1_PREFETCH = ("none", "backward_pre", "backward_post")
FSDP1_TAKES = {"param_dtype": ANY, "reduce_dtype": ANY, "buffer_dtype": ANY,
               "clip_grad_norm": ANY, "backward_prefetch": FSDP1_PREFETCH,
               "forward_prefetch": ("none", "implicit"), "sharding_strategy": ANY,
               "auto_wrap": ANY, "min_num_params": ANY, "cpu_offload": ANY}
FSDP1_WHY = {"backward_prefetch": "FSDP1 takes backward_pre, backward_post or none",
             "forward_prefetch": "FSDP1 has no explicit lists; implicit is its "
                                 "forward_prefetch=True (the first iteration's order)"}
FSDP2_TAKES = {"param_dtype": ANY, "reduce_dtype": ANY, "output_dtype": ANY,
               "clip_grad_norm": ANY, "hsdp": ANY, "reshard_after_forward": ANY,
               "forward_prefetch": ("none", "implicit", "explicit"),
               "backward_prefetch": ("implicit", "explicit", "none"), "cpu_offload": ANY,
               "comm_buffers": ANY}
BUCKETS = {"bucket_cap_mb": ANY}


@strategy("single", takes={"clip_grad_norm": ANY})
def _single(model, info, args):
    if info.world_size != 1:
        raise ValueError(f"--strategy single runs on one process, got world size {info.world_size}")
    return model


@strategy("torch_ddp", takes={**BUCKETS, "clip_grad_norm": ANY})
def _torch_ddp(model, info, args):
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb)


@strategy("fsdp1", takes=FSDP1_TAKES, why=FSDP1_WHY, defaults={})
def _fsdp1(model, info, args):
    from minifsdp import fsdp1

    policies = {"none": lambda: None,
                "size": lambda: fsdp1.size_based_auto_wrap_policy(args.min_num_params),
                "transformer": lambda: fsdp1.transformer_auto_wrap_policy(unit_classes(model))}
    return fsdp1.FullyShardedDataParallel(
        model, sharding_strategy=args.sharding_strategy, device_id=info.device,
        cpu_offload=fsdp1.CPUOffload(offload_params=args.cpu_offload),
        auto_wrap_policy=policies[args.auto_wrap](),
        **fsdp1_knobs(args, fsdp1.MixedPrecision, fsdp1.BackwardPrefetch, torch_default=None))


def fsdp1_knobs(args, mp_cls, prefetch_cls, torch_default: str | None) -> dict:
    """FSDP1's ``mixed_precision``, ``backward_prefetch`` and ``forward_prefetch`` from
    ``--param-dtype``, ``--reduce-dtype``, ``--buffer-dtype``, ``--backward-prefetch`` and
    ``--forward-prefetch implicit`` (ours or torch's classes: the same names). Without
    ``--backward-prefetch`` each library keeps its own default (``torch_default`` names
    torch's, BACKWARD_PRE; ours is none): pass it to compare like with like."""
    names = (args.param_dtype, args.reduce_dtype, args.buffer_dtype)
    out: dict = {"forward_prefetch": args.forward_prefetch == "implicit"}
    if names != (None, None, None):
        out["mixed_precision"] = mp_cls(*(DTYPES[n] if n else None for n in names))
    # arguments parsed for an FSDP2 strategy carry its values (implicit, explicit): FSDP1
    # keeps its own default then
    asked = args.backward_prefetch if args.backward_prefetch in FSDP1_PREFETCH else None
    bp = asked or torch_default
    if bp is not None:
        out["backward_prefetch"] = None if bp == "none" else prefetch_cls[bp.upper()]
    return out


@strategy("torch_fsdp1", takes=FSDP1_TAKES, why=FSDP1_WHY, defaults={})
def _torch_fsdp1(model, info, args):
    # FSDP1 runs on CPU only when told its device is the CPU (DESIGN.md, measured).
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
        wrap,
    )

    if args.cpu_offload and info.device.type == "cpu":
        raise ValueError("--cpu-offload: torch FSDP1's CPUOffload needs an accelerator (on CPU "
                         "the parameters are in host memory already); --strategy fsdp1 runs it "
                         "on CPU, as the same code path (Note [CPU offload] in "
                         "minifsdp/fsdp1/fully_sharded.py)")
    policies = {
        "none": None,
        "size": functools.partial(wrap.size_based_auto_wrap_policy,
                                  min_num_params=args.min_num_params),
        "transformer": functools.partial(wrap.transformer_auto_wrap_policy,
                                         transformer_layer_cls=unit_classes(model)),
    }
    return FullyShardedDataParallel(
        model, device_id=info.device, use_orig_params=True,
        sharding_strategy=ShardingStrategy[args.sharding_strategy.upper()],
        auto_wrap_policy=policies[args.auto_wrap],
        cpu_offload=CPUOffload(offload_params=args.cpu_offload),
        **fsdp1_knobs(args, MixedPrecision, BackwardPrefetch, torch_default="backward_pre"))


@strategy("fsdp2", takes=FSDP2_TAKES)
def _fsdp2(model, info, args):
    # torch_fsdp2's units and options, with minifsdp.fsdp2.fully_shard. Its parameters are
    # DTensors too, so save_full_params' get_model_state_dict gathers them as it does torch's.
    from minifsdp.fsdp2 import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = shard_bottom_up(fully_shard, model, info, args, MixedPrecisionPolicy,
                            CPUOffloadPolicy)
    return set_prefetch(model, args)


@strategy("torch_fsdp2", takes={**FSDP2_TAKES, "forward_prefetch": ("none", "explicit"),
                                "backward_prefetch": ("implicit", "explicit")},
          why={"forward_prefetch": "torch's fully_shard has no such switch (on GPUs its "
                                   "separate all-gather streams overlap the forward without "
                                   "one); use explicit, or --strategy fsdp2",
               "backward_prefetch": "torch's fully_shard always prefetches in backward "
                                    "(implicitly, or its explicit lists); only --strategy "
                                    "fsdp2 can turn it off"})
def _torch_fsdp2(model, info, args):
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    model = shard_bottom_up(fully_shard, model, info, args, MixedPrecisionPolicy,
                            CPUOffloadPolicy)
    return set_prefetch(model, args)  # explicit lists only: check_flags refuses the rest


@strategy("ddp")
def _ddp(model, info, args):
    from minifsdp.ddp import NaiveDDP

    return NaiveDDP(model)


@strategy("bucketed_ddp", takes=BUCKETS)
def _bucketed_ddp(model, info, args):
    from minifsdp.ddp import BucketedDDP

    return BucketedDDP(model, bucket_cap_mb=args.bucket_cap_mb)


def _zero(stage: int):
    def build(model, info, args):
        from minifsdp.zero import setup_zero

        return setup_zero(model, lambda params: make_optimizer(params, args), stage=stage,
                          bucket_cap_mb=args.bucket_cap_mb)
    return build


strategy("zero1", takes=BUCKETS)(_zero(1))
strategy("zero2", takes=BUCKETS)(_zero(2))


# ---- what the FSDP2 builders share --------------------------------------------------------------
def shard_bottom_up(fully_shard, model, info, args, policy_cls=None, offload_cls=None):
    """``fully_shard`` (torch's or ours) on each of ``shard_units(model)``, children before the
    root, then on the root, over ``data_parallel_mesh``; ``policy_cls``: that
    implementation's ``MixedPrecisionPolicy``, for ``--param-dtype`` and co.; ``offload_cls``:
    its ``CPUOffloadPolicy``, for ``--cpu-offload`` (pinned where the ranks compute on an
    accelerator: pinning needs one, Note [FSDP2 CPU offload])."""
    mesh = data_parallel_mesh(info, args)
    unit_mp, root_mp = mixed_precision_kwargs(args, policy_cls)
    off = {}
    if getattr(args, "cpu_offload", False):
        off["offload_policy"] = offload_cls(pin_memory=info.device.type != "cpu")
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=args.reshard_after_forward,
                    **unit_mp, **off)
    model = fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard_after_forward,
                        **root_mp, **off)
    return set_comm_buffers(model, getattr(args, "comm_buffers", "default"))


def set_comm_buffers(model, where: str):
    """``--comm-buffers``: every FSDP module's buffers from the process group's allocator or
    symmetric memory (both setters act on one module's group: Note [comm buffers from the
    process group] in ``minifsdp/fsdp2/comm_buffers.py``)."""
    method = {"default": None, "process-group": "set_allocate_memory_from_process_group_for_comm",
              "symm-mem": "set_symm_mem_for_comm"}[where]
    if method is None:
        return model
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from minifsdp.fsdp2 import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]
    if not hasattr(modules[0], method):
        raise ValueError(f"--comm-buffers {where}: this torch ({torch.__version__}) has no "
                         f"FSDPModule.{method}")
    for m in modules:
        getattr(m, method)(*(() if where == "symm-mem" else (True,)))
    return model


def data_parallel_mesh(info: DistInfo, args: argparse.Namespace):
    """Every rank in a 1-D mesh (FSDP), or with ``--hsdp R`` the 2-D mesh ``(R, N / R)``
    named ``("replicate", "shard")`` (HSDP, Note [HSDP] in ``minifsdp/fsdp2/hsdp.py``): ranks
    ``0..S-1`` form the first shard group (on a cluster: one node, as torchrun numbers ranks
    node by node), rank r's replicas are ``r mod S + k S``."""
    from torch.distributed.device_mesh import init_device_mesh

    if not args.hsdp:
        return init_device_mesh(info.device.type, (info.world_size,))
    if info.world_size % args.hsdp:
        raise ValueError(f"--hsdp {args.hsdp}: the world size {info.world_size} is not "
                         "divisible by the replicate degree; HSDP needs R groups of equal size")
    return init_device_mesh(info.device.type, (args.hsdp, info.world_size // args.hsdp),
                            mesh_dim_names=("replicate", "shard"))


def mixed_precision_kwargs(args, policy_cls) -> tuple[dict, dict]:
    """``({"mp_policy": ...} or {}, same for the root)`` from ``--param-dtype``,
    ``--reduce-dtype``, ``--output-dtype``: no flag, no policy at all. ``--output-dtype`` goes
    to the root only: on a unit it would cast the unit's output -- the next unit's input --
    e.g. back to fp32, which the root's bf16 layers after the units then refuse (torch's
    ``output_dtype`` acts on every module it is given to; Note [mixed precision] in
    ``minifsdp/fsdp2/mixed_precision.py``). The oracle for mixed precision is torch's
    ``fully_shard`` with the same policy: ``single`` has no counterpart."""
    names = (args.param_dtype, args.reduce_dtype, args.output_dtype)
    if policy_cls is None or names == (None, None, None):
        return {}, {}
    param, reduce, output = (DTYPES[n] if n else None for n in names)
    return ({"mp_policy": policy_cls(param_dtype=param, reduce_dtype=reduce)},
            {"mp_policy": policy_cls(param_dtype=param, reduce_dtype=reduce,
                                     output_dtype=output)})


def set_prefetch(model, args):
    """``--forward-prefetch`` / ``--backward-prefetch`` on a model that ``shard_bottom_up``
    sharded (ours or torch's). ``explicit``: one unit ahead in ``shard_units`` order (our
    models' forward order) -- in forward the root prefetches the first unit and unit i unit
    i+1; in backward the root the last unit and unit i unit i-1. ``implicit`` / ``none``:
    minifsdp's ``set_implicit_prefetch`` (Note [which group is next] in
    minifsdp/fsdp2/prefetch.py); torch's defaults are forward none, backward implicit."""
    units = shard_units(model)
    if args.forward_prefetch == "explicit":
        for module, nxt in zip([model, *units], units):
            module.set_modules_to_forward_prefetch([nxt])
    if args.backward_prefetch == "explicit":
        for module, prev in zip([model, *units[::-1]], units[::-1]):
            module.set_modules_to_backward_prefetch([prev])
    if hasattr(model, "set_implicit_prefetch"):  # ours
        model.set_implicit_prefetch(forward=args.forward_prefetch == "implicit",
                                    backward=args.backward_prefetch == "implicit")
    return model


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The sub-modules that FSDP wraps as units: transformer blocks, or the CNN's layers."""
    if hasattr(model, "blocks"):
        return list(model.blocks)
    return [m for m in model.children() if any(True for _ in m.parameters())]


def unit_classes(model: nn.Module) -> set[type]:
    """``--auto-wrap transformer``'s layer classes: those of ``shard_units`` (GPT: ``Block``;
    CNN: ``Conv2d`` and ``Linear``), so FSDP1 wraps the units that FSDP2 shards."""
    return {type(m) for m in shard_units(model)}


# ---- the optimizer every strategy steps (Note [one optimizer path]) --------------------------

def make_optimizer(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    """``args.optimizer`` over ``params``, with ``foreach`` chosen by device only (Note [one
    optimizer path])."""
    params = list(params)
    foreach = use_foreach(params)
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr, foreach=foreach)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1, foreach=foreach)
    if args.optimizer == "adadelta":  # the FSDP tutorial's choice (lr=1.0)
        return torch.optim.Adadelta(params, lr=args.lr, foreach=foreach)
    return torch.optim.SGD(params, lr=args.lr, foreach=foreach)


def use_foreach(params: list[torch.Tensor]) -> bool:
    """torch's default ``foreach`` choice without its type test: every parameter on a device
    with multi-tensor kernels (CUDA: yes; CPU: no). Note [one optimizer path]."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    devices = _get_foreach_kernels_supported_devices()
    return bool(params) and all(p.device.type in devices for p in params)
