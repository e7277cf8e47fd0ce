"""One training entry point for every chapter, run under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m minifsdp.train --strategy torch_ddp --model cnn --steps 50 --global-batch 64

Each rank writes ``rank{r}.json`` (via ``minifsdp.dist.finish``) with the global loss of every
step, step times, the memory timeline of the tracked steps, the communication log and the
run's configuration. Notebooks launch it with ``minifsdp.launch.torchrun`` and plot the JSON.

Strategies are registered by name in ``STRATEGIES``; each chapter adds its own (``ddp``,
``zero1``, ``fsdp2`` ...) next to the PyTorch implementation it is checked against.

Note [global loss]: every strategy logs the loss of the *global* batch (the mean over ranks
of the local mean losses, all equal-sized), so loss curves of a 1-process and an N-process
run are directly comparable; see Note [same global batch] in ``minifsdp.data``.

Note [bitwise parity]: what N data-parallel ranks compute is the *average of N shard
gradients*, each the gradient of a B/N-sample mean. One process can compute exactly that:
run the N shards as micro-batches, backpropagate ``loss_r / N`` (scaling by 1/N is exact for
N a power of two) and let ``.grad`` accumulate. ``--strategy single --data-shards N`` does
this, and matches DDP and FSDP bit for bit at N = 2 (tests/test_train.py). The textbook
reference, one backward of the 64-sample mean (``--full-batch``), is the same mathematics but
a different float sum: it agrees to rounding (~1e-7), and Adam, which divides by the
gradient's own magnitude, can amplify that to ~1e-6 in the weights within a few steps.

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
import contextlib
import functools
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minifsdp import comm
from minifsdp.data import MarkovTokens, global_batch_loader, mnist, rank_loader
from minifsdp.dist import DistInfo, dist_setup, finish, report_progress, seed_everything
from minifsdp.memory import MemoryTracker
from minifsdp.models import apply_activation_checkpointing, build_model, count_params

# name -> function(model, info, args) returning the module to train (wrapped in place or not),
# or ``(module, optimizer)`` when the strategy owns the optimizer (ZeRO shards its state).
Setup = nn.Module | tuple[nn.Module, torch.optim.Optimizer]
STRATEGIES: dict[str, Callable[[nn.Module, DistInfo, argparse.Namespace], Setup]] = {}


def strategy(name: str):
    """Register a data-parallel strategy under ``name`` (decorator).

    The function gets the unwrapped model (already on ``info.device``, same init on every
    rank), ``info`` and the parsed ``args``; it returns the module to train, or ``(module,
    optimizer)`` to build the optimizer itself (use ``make_optimizer(params, args)``).
    """

    def register(fn):
        STRATEGIES[name] = fn
        return fn

    return register


@strategy("single")
def _single(model, info, args):
    if info.world_size != 1:
        raise ValueError(f"--strategy single runs on one process, got world size {info.world_size}")
    return model


@strategy("torch_ddp")
def _torch_ddp(model, info, args):
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=args.bucket_cap_mb)


@strategy("torch_fsdp1")
def _torch_fsdp1(model, info, args):
    # FSDP1 runs on CPU only when told its device is the CPU (DESIGN.md, measured).
    from torch.distributed.fsdp import CPUOffload, FullyShardedDataParallel, ShardingStrategy, wrap

    if args.cpu_offload and info.device.type == "cpu":
        raise ValueError("--cpu-offload: torch FSDP1's CPUOffload needs an accelerator (on CPU "
                         "the parameters are in host memory already); --strategy fsdp1 runs it "
                         "on CPU, as the same code path (Note [CPU offload] in minifsdp/fsdp1.py)")
    policies = {
        "none": None,
        "size": functools.partial(wrap.size_based_auto_wrap_policy,
                                  min_num_params=args.min_num_params),
        "transformer": functools.partial(wrap.transformer_auto_wrap_policy,
                                         transformer_layer_cls=unit_classes(model)),
    }
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision

    return FullyShardedDataParallel(
        model, device_id=info.device, use_orig_params=True,
        sharding_strategy=ShardingStrategy[args.sharding_strategy.upper()],
        auto_wrap_policy=policies[args.auto_wrap],
        cpu_offload=CPUOffload(offload_params=args.cpu_offload),
        **fsdp1_knobs(args, MixedPrecision, BackwardPrefetch, torch_default="backward_pre"))


@strategy("fsdp1")
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


FSDP1_PREFETCH = ("none", "backward_pre", "backward_post")


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
    # FSDP2's values (implicit, explicit: parse_args's default for the other strategies) set
    # nothing here: the library's own default holds.
    asked = args.backward_prefetch if args.backward_prefetch in FSDP1_PREFETCH else None
    bp = asked or torch_default
    if bp is not None:
        out["backward_prefetch"] = None if bp == "none" else prefetch_cls[bp.upper()]
    return out


@strategy("torch_fsdp2")
def _torch_fsdp2(model, info, args):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = shard_bottom_up(fully_shard, model, info, args, MixedPrecisionPolicy)
    return set_prefetch(model, args)  # explicit lists only: parse_args refuses the rest


def shard_bottom_up(fully_shard, model, info, args, policy_cls=None):
    """``fully_shard`` (torch's or ours) on each of ``shard_units(model)``, children before the
    root, then on the root, over ``data_parallel_mesh``; ``policy_cls``: that
    implementation's ``MixedPrecisionPolicy``, for ``--param-dtype`` and co."""
    mesh = data_parallel_mesh(info, args)
    unit_mp, root_mp = mixed_precision_kwargs(args, policy_cls)
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=args.reshard_after_forward,
                    **unit_mp)
    return fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard_after_forward,
                       **root_mp)


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


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


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


@strategy("ddp")
def _ddp(model, info, args):
    from minifsdp.ddp import NaiveDDP

    return NaiveDDP(model)


@strategy("bucketed_ddp")
def _bucketed_ddp(model, info, args):
    from minifsdp.ddp import BucketedDDP

    return BucketedDDP(model, bucket_cap_mb=args.bucket_cap_mb)


@strategy("zero1")
def _zero1(model, info, args):
    from minifsdp.zero import setup_zero

    return setup_zero(model, lambda params: make_optimizer(params, args), stage=1,
                      bucket_cap_mb=args.bucket_cap_mb)


@strategy("zero2")
def _zero2(model, info, args):
    from minifsdp.zero import setup_zero

    return setup_zero(model, lambda params: make_optimizer(params, args), stage=2,
                      bucket_cap_mb=args.bucket_cap_mb)


@strategy("fsdp2")
def _fsdp2(model, info, args):
    # torch_fsdp2's units and options, with minifsdp.fsdp2.fully_shard. Its parameters are
    # DTensors too, so save_full_params' get_model_state_dict gathers them as it does torch's.
    from minifsdp.fsdp2 import MixedPrecisionPolicy, fully_shard

    model = shard_bottom_up(fully_shard, model, info, args, MixedPrecisionPolicy)
    return set_prefetch(model, args)


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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategy", default="single", help=f"one of {sorted(STRATEGIES)}")
    p.add_argument("--model", choices=["cnn", "gpt"], default="cnn")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--data-shards", type=int, default=None,
                   help="ranks the data is split for (default: world size); with --strategy "
                   "single, N reproduces the global batches of an N-rank run")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0,
                   help="torch_ddp, bucketed_ddp, zero1, zero2: gradient bucket size in MiB "
                   "(torch DDP's default: 25)")
    p.add_argument("--sharding-strategy", choices=["full_shard", "shard_grad_op", "no_shard"],
                   default="full_shard", help="fsdp1, torch_fsdp1 (Note [sharding strategies] "
                   "in minifsdp/fsdp1.py)")
    p.add_argument("--auto-wrap", choices=["none", "size", "transformer"], default="none",
                   help="fsdp1, torch_fsdp1: the units; none: the whole model is one unit; size: "
                   "wherever --min-num-params are not yet wrapped; transformer: each of the "
                   "model's blocks (the CNN: each layer)")
    p.add_argument("--min-num-params", type=int, default=10_000,
                   help="--auto-wrap size: the threshold (torch's min_num_params)")
    p.add_argument("--cpu-offload", action="store_true",
                   help="fsdp1, torch_fsdp1: keep the parameter shards and their gradients in "
                   "host memory (torch's needs an accelerator)")
    p.add_argument("--full-batch", action="store_true",
                   help="with --strategy single: one backward over the whole global batch "
                   "instead of accumulating its --data-shards micro-batches "
                   "(Note [bitwise parity])")
    p.add_argument("--optimizer", choices=["adam", "adamw", "sgd", "adadelta"], default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.0, help="see Note [dropout and parity]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=64)
    p.add_argument("--tie-embeddings", action="store_true",
                   help="GPT: the head shares the token embedding's weight")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="GPT: recompute each block's attn and mlp in backward instead of "
                   "saving their activations (Note [activation checkpointing] in "
                   "minifsdp/models.py); any strategy")
    p.add_argument("--hsdp", type=int, default=None, metavar="R",
                   help="fsdp2, torch_fsdp2: hybrid sharding on the 2-D mesh (R, world/R): "
                   "shard within groups of world/R ranks, replicate across R of them (Note "
                   "[HSDP] in minifsdp/fsdp2/hsdp.py); default: shard over every rank")
    p.add_argument("--track-memory", type=int, default=0, metavar="K",
                   help="record the memory timeline of the first K steps")
    p.add_argument("--torch-memtracker", action="store_true",
                   help="torch_fsdp2: also measure the last --track-memory step with torch's "
                        "FSDPMemTracker, alongside ours (results: torch_memtracker)")
    p.add_argument("--eval", action="store_true",
                   help="--model cnn: after training, evaluate on MNIST's test images as the "
                   "FSDP tutorial does (each rank its shard, counts all-reduced; any strategy) "
                   "and write test_accuracy, test_loss, test_correct, test_samples to the "
                   "results (Note [test accuracy])")
    p.add_argument("--eval-samples", type=int, default=10_000,
                   help="--eval on the first N test images (default: all 10,000, ~4 s of one "
                   "core in all, split over the ranks)")
    p.add_argument("--save-params", action="store_true",
                   help="rank 0 saves the full final parameters to <out>/params.pt")
    p.add_argument("--checkpoint-dir", metavar="DIR", help="save sharded checkpoints "
                   "(minifsdp.checkpoint) as DIR/step_NNNNNN after every --save-every steps "
                   "and after the last step; DIR/latest names the newest")
    p.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="with --checkpoint-dir: save after every K-th step too")
    p.add_argument("--keep", type=int, default=2, metavar="K",
                   help="with --checkpoint-dir: keep the K newest checkpoints")
    p.add_argument("--resume", metavar="PATH", help="continue from a checkpoint: a "
                   "--checkpoint-dir (its latest) or one step_NNNNNN directory, at any world "
                   "size (bit for bit at the saving run's: Note [bitwise resume])")
    p.add_argument("--kill-at-step", type=int, metavar="S",
                   help="crash (SIGKILL, no clean exit) right after step S: resume tests")
    p.add_argument("--kill-during-save", type=int, metavar="S",
                   help="crash (SIGKILL) in the save after step S, once its files are written "
                   "and before it is committed (Note [atomic save])")
    p.add_argument("--kill-rank", type=int, metavar="R",
                   help="--kill-*: only rank R kills itself (default: every rank)")
    p.add_argument("--reshard-after-forward", choices=["true", "false"], default=None,
                   type=str.lower, help="fsdp2, torch_fsdp2: free the unsharded parameters "
                   "after forward (default: true, except the root's, as torch 2.14)")
    p.add_argument("--forward-prefetch", choices=["none", "implicit", "explicit"],
                   default="none", help="fsdp2 (torch_fsdp2: explicit only): all-gather the "
                   "next unit during this one's forward (default none, as torch)")
    p.add_argument("--backward-prefetch", choices=["implicit", "explicit", "none",
                                                   "backward_pre", "backward_post"],
                   default=None, help="fsdp2 (torch_fsdp2: not none): all-gather the next "
                   "unit during this one's backward (implicit, explicit, none; default implicit, "
                   "as torch); fsdp1, torch_fsdp1: backward_pre, backward_post or none (Note "
                   "[backward prefetch] in minifsdp/fsdp1_options.py; default: each library's "
                   "own, torch backward_pre, ours none)")
    p.add_argument("--buffer-dtype", choices=sorted(DTYPES), default=None,
                   help="fsdp1, torch_fsdp1: mixed precision, the dtype of the buffers "
                   "(MixedPrecision.buffer_dtype)")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="single, torch_ddp, fsdp1, torch_fsdp1, fsdp2, torch_fsdp2: scale the "
                   "gradients to total 2-norm <= MAX before each optimizer step (FSDP1: "
                   "model.clip_grad_norm_; the others torch.nn.utils.clip_grad_norm_); the "
                   "norms before clipping go to the results as grad_norms")
    for flag, what in (("param", "all-gather, forward and backward (the unsharded parameters)"),
                       ("reduce", "gradient reduce-scatter (default: --param-dtype)"),
                       ("output", "root's floating-point outputs (default: as computed)")):
        p.add_argument(f"--{flag}-dtype", choices=sorted(DTYPES), default=None,
                       help=f"fsdp2, torch_fsdp2 (param, reduce: also fsdp1, torch_fsdp1): "
                       f"mixed precision, the dtype of the {what}; no --*-dtype flag: no "
                       "MixedPrecisionPolicy / MixedPrecision")
    args = p.parse_args(argv)
    fsdp1_like, fsdp2_like = ("fsdp1", "torch_fsdp1"), ("fsdp2", "torch_fsdp2")
    if (args.param_dtype, args.reduce_dtype) != (None, None) and (
            args.strategy not in fsdp1_like + fsdp2_like):
        p.error("--param-dtype / --reduce-dtype apply to --strategy fsdp1, torch_fsdp1, fsdp2 "
                "and torch_fsdp2 only (mixed precision's reference is torch's FSDP with the same "
                "policy; single has no counterpart)")
    if args.output_dtype is not None and args.strategy not in fsdp2_like:
        p.error("--output-dtype applies to --strategy fsdp2 and torch_fsdp2 only")
    if args.buffer_dtype is not None and args.strategy not in fsdp1_like:
        p.error("--buffer-dtype applies to --strategy fsdp1 and torch_fsdp1 only (FSDP2 leaves "
                "buffers alone)")
    if args.clip_grad_norm is not None and args.strategy not in (
            "single", "torch_ddp") + fsdp1_like + fsdp2_like:
        p.error("--clip-grad-norm applies to --strategy single, torch_ddp, fsdp1, torch_fsdp1, "
                "fsdp2 and torch_fsdp2 (ZeRO's sharded gradients need a norm across ranks "
                "that minifsdp.zero does not compute)")
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        p.error(f"--clip-grad-norm {args.clip_grad_norm}: the maximum norm must be > 0")
    if args.strategy in fsdp1_like:
        if args.backward_prefetch in ("implicit", "explicit"):
            p.error(f"--backward-prefetch {args.backward_prefetch}: FSDP1 takes backward_pre, "
                    "backward_post or none")
        if args.forward_prefetch == "explicit":
            p.error("--forward-prefetch explicit: FSDP1 has no explicit lists; implicit is its "
                    "forward_prefetch=True (the first iteration's order)")
    else:
        if args.backward_prefetch in ("backward_pre", "backward_post"):
            p.error(f"--backward-prefetch {args.backward_prefetch} applies to --strategy fsdp1 "
                    "and torch_fsdp1 only")
        args.backward_prefetch = args.backward_prefetch or "implicit"
    if args.hsdp is not None and args.strategy not in ("fsdp2", "torch_fsdp2"):
        p.error("--hsdp applies to --strategy fsdp2 and torch_fsdp2 only")
    if args.hsdp is not None and args.hsdp < 1:
        p.error(f"--hsdp {args.hsdp}: the replicate degree R must be >= 1")
    if args.activation_checkpointing and args.model != "gpt":
        p.error("--activation-checkpointing needs --model gpt (it checkpoints each Block's "
                "attn and mlp)")
    if (args.forward_prefetch, args.backward_prefetch) not in (("none", "implicit"),
                                                               ("none", None)) and (
            args.strategy not in fsdp1_like + fsdp2_like):
        p.error("--forward-prefetch / --backward-prefetch apply to --strategy fsdp1, "
                "torch_fsdp1, fsdp2 and torch_fsdp2 only")
    if args.strategy == "torch_fsdp2" and args.forward_prefetch == "implicit":
        p.error("--forward-prefetch implicit: torch's fully_shard has no such switch (on GPUs "
                "its separate all-gather streams overlap the forward without one); use "
                "explicit, or --strategy fsdp2")
    if args.strategy == "torch_fsdp2" and args.backward_prefetch == "none":
        p.error("--backward-prefetch none: torch's fully_shard always prefetches in backward "
                "(implicitly, or its explicit lists); only --strategy fsdp2 can turn it off")
    if args.reshard_after_forward is not None:
        args.reshard_after_forward = args.reshard_after_forward == "true"
    if args.eval and args.model != "cnn":
        p.error("--eval needs --model cnn (the token data has no test set)")
    if args.eval and not 1 <= args.eval_samples <= 10_000:
        p.error(f"--eval-samples {args.eval_samples}: MNIST has 10,000 test images, use 1..10000")
    if args.strategy not in STRATEGIES:
        p.error(f"unknown --strategy {args.strategy!r}; choose from {sorted(STRATEGIES)}")
    if args.torch_memtracker and not (args.strategy == "torch_fsdp2" and args.track_memory):
        p.error("--torch-memtracker needs --strategy torch_fsdp2 and --track-memory K >= 1 "
                "(it watches step K alongside our tracker)")
    if (args.save_every or args.kill_during_save) and not args.checkpoint_dir:
        p.error("--save-every / --kill-during-save need --checkpoint-dir")
    if args.kill_during_save and not (args.kill_during_save == args.steps or (
            args.save_every and args.kill_during_save % args.save_every == 0)):
        p.error(f"--kill-during-save {args.kill_during_save}: no save after that step "
                f"(--save-every {args.save_every}, --steps {args.steps})")
    return args


def make_model(args: argparse.Namespace) -> nn.Module:
    if args.model == "cnn":
        return build_model("cnn", dropout=args.dropout)
    model = build_model("gpt", vocab_size=args.vocab_size, seq_len=args.seq_len,
                        n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                        dropout=args.dropout, tie_embeddings=args.tie_embeddings)
    if args.activation_checkpointing:
        apply_activation_checkpointing(model)  # before any wrapping; names unchanged
    return model


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


def make_batches(args: argparse.Namespace, info: DistInfo, start_step: int = 0):
    """Yield ``(inputs, targets)`` for this rank; see Note [same global batch].

    ``start_step = s`` starts at step s's batch without loading the ones before: batch
    ``s mod E`` of epoch ``s // E``, E batches an epoch (Note [bitwise resume] in
    ``minifsdp.checkpoint``)."""
    shards = args.data_shards or info.world_size
    if args.global_batch % shards:
        raise ValueError(f"--global-batch {args.global_batch} is not divisible by "
                         f"{shards} ranks: every rank needs the same local batch size")
    if args.strategy != "single" and shards != info.world_size:
        raise ValueError(f"--data-shards {shards} != world size {info.world_size}")
    if args.model == "cnn":
        ds = mnist(train=True)
    else:
        ds = MarkovTokens(args.vocab_size, args.seq_len, seed=1234)
    local = args.global_batch // shards
    epoch, skip = divmod(start_step, len(rank_loader(ds, local, 0, shards)))
    while True:  # restart the loaders each epoch (sampler seed + epoch = a new shuffle)
        seed = args.seed + epoch
        it = (global_batch_loader(ds, local, shards, seed, skip) if args.strategy == "single"
              else rank_loader(ds, local, info.rank, info.world_size, seed, skip))
        for x, y in it:
            yield x.to(info.device), y.to(info.device)
        epoch, skip = epoch + 1, 0


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:  # GPT logits (B, T, V)
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.nll_loss(out, y)


def train_step(model, opt, x, y, tracker: MemoryTracker | None = None,
               micro_batches: int = 1, clip: float | None = None,
               grad_norms: list[float] | None = None) -> torch.Tensor:
    """forward -> backward -> (clip) -> optimizer step -> zero_grad, in named memory phases.

    With ``micro_batches = N`` the batch is split into N equal parts whose gradients
    accumulate, each loss scaled by 1/N (Note [bitwise parity]). With ``clip``, the gradients
    are scaled to total norm <= clip and the norm before is appended to ``grad_norms``.
    Returns the batch's mean loss.
    """
    phase = lambda name: _phase(name, tracker)
    losses = []
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        with phase("forward"):
            loss = loss_fn(model(xs), ys)
        with phase("backward"):
            (loss / micro_batches if micro_batches > 1 else loss).backward()
        losses.append(loss.detach())
    if clip is not None:
        with phase("clip"):
            norm = clip_grad_norm(model, clip)
        if grad_norms is not None:
            grad_norms.append(norm)
    with phase("optimizer step"):
        opt.step()
    with phase("zero_grad"):
        opt.zero_grad(set_to_none=True)
    # Summed then divided, in rank order: the same float operations as global_mean's
    # all-reduce over N ranks.
    return torch.stack(losses).sum() / micro_batches if micro_batches > 1 else losses[0]


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """FSDP1's (ours or torch's) ``model.clip_grad_norm_``, else torch.nn.utils' (plain or
    DTensor gradients: FSDP2's norm is a DTensor reduced across ranks). Returns the norm."""
    if hasattr(model, "clip_grad_norm_"):
        norm = model.clip_grad_norm_(max_norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor
        norm = norm.full_tensor()
    return float(norm)


@contextlib.contextmanager
def _phase(name: str, tracker: MemoryTracker | None):
    """A named part of the step: a memory phase (if tracked) and a compute span in the comm
    log, so timelines show collectives against forward / backward / optimizer step."""
    with tracker.phase(name) if tracker else contextlib.nullcontext(), comm.span(name):
        yield


def global_mean(t: torch.Tensor, info: DistInfo) -> float:
    if info.world_size > 1:
        t = t.clone()
        dist.all_reduce(t)
        t /= info.world_size
    return float(t)


@torch.no_grad()
def evaluate(model: nn.Module, info: DistInfo, samples: int = 10_000, batch: int = 500) -> dict:
    """Test loss and accuracy of the trained model on the first ``samples`` MNIST test images,
    as the PyTorch FSDP tutorial's ``test()`` reports them: each rank evaluates its shard, the
    sums are all-reduced (Note [test accuracy]).

    Returns ``{"test_accuracy", "test_loss", "test_correct", "test_samples"}``, the same on every
    rank: ``test_correct`` of ``test_samples`` images right, ``test_loss`` the mean NLL.

    Note [test accuracy]: rank r takes the contiguous images ``[r P, (r + 1) P)``, P = ceil(n /
    N), in batches of ``batch`` -- the tutorial's DistributedSampler would pad the last shard
    with repeated images and count them twice. Every rank runs the *same* number of forwards
    of the same shapes (a short shard's missing rows are masked out, not skipped): under FSDP a
    forward is collective (each unit all-gathers), so a rank with one forward fewer would hang
    the others. The forwards are the wrapped model's own, under ``no_grad`` and ``eval()``:
    sharded strategies gather each unit and free it again as in training (a root that keeps
    its parameters for a backward that never comes is resharded at the end). With the same
    parameters and the same batches, strategies that are bitwise equal therefore report the
    same count and the same loss, bit for bit (tests/test_train.py).
    """
    ds = mnist(train=False)
    n = min(samples, len(ds.tensors[1]))
    per = -(-n // info.world_size)
    first = info.rank * per
    sums = torch.zeros(3, dtype=torch.float64, device=info.device)  # loss, correct, images
    model.eval()
    for start in range(0, per, batch):
        idx = torch.arange(first + start, first + min(start + batch, per))
        mine = idx < n  # the last shard is short: its missing rows are masked
        x, y = ds.tensors[0][idx.clamp(max=n - 1)], ds.tensors[1][idx.clamp(max=n - 1)]
        out = model(x.to(info.device))
        y, mine = y.to(info.device), mine.to(info.device)
        nll = F.nll_loss(out.float(), y, reduction="none")
        right = (out.argmax(1) == y) & mine
        sums += torch.stack([nll[mine].double().sum(), right.sum().double(), mine.sum().double()])
    model.train()
    _reshard(model)
    if info.world_size > 1:
        dist.all_reduce(sums)
    loss, correct, count = sums.tolist()
    return {"test_accuracy": correct / count, "test_loss": loss / count,
            "test_correct": int(correct), "test_samples": int(count)}


def _reshard(model: nn.Module) -> None:
    """Free what FSDP2 (ours or torch's) kept unsharded after a forward without backward: its
    root keeps its parameters for the backward (``reshard_after_forward`` is False there)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from minifsdp.fsdp2 import FSDPModule

    for m in model.modules():
        if isinstance(m, (FSDPModule, TorchFSDPModule)):
            m.reshard()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = dist_setup()
    seed_everything(args.seed)  # same init on every rank
    model = make_model(args).to(info.device)
    n_params = count_params(model)
    setup = STRATEGIES[args.strategy](model, info, args)
    if isinstance(setup, tuple):
        model, opt = setup
    else:
        model, opt = setup, make_optimizer(setup.parameters(), args)
    ckpt = {"start_step": 0, "resumed_from": None, "checkpoints": []}
    if args.resume:
        ckpt.update(resume(args, model, opt))
    start = ckpt["start_step"]
    batches = make_batches(args, info, start)

    micro = (args.data_shards or 1) if args.strategy == "single" and not args.full_batch else 1
    log = comm.comm_log()
    log.clear()
    losses, step_times, memory, torch_mem = [], [], [], None
    layout = param_layout(model)
    grad_norms: list[float] = []
    clip = {"clip": args.clip_grad_norm, "grad_norms": grad_norms}
    for step in range(start, args.steps):
        x, y = next(batches)
        tracker = None
        if step < args.track_memory:
            tracker = MemoryTracker(model=model, optimizer=opt, device=info.device)
            tracker.track_modules(model)
        t0 = time.perf_counter()
        if tracker:
            # Note [two trackers, one step] (torch_memtracker below)
            theirs = (torch_memtracker(model, opt, (x, y))
                      if args.torch_memtracker and step == args.track_memory - 1
                      else contextlib.nullcontext())
            with theirs as peak, tracker:
                tracker.register((x, y), "activations")  # the first layer saves the batch
                loss = train_step(model, opt, x, y, tracker, micro, **clip)
            torch_mem = peak if peak is not None else torch_mem
            memory.append(tracker.to_dict())
        else:
            loss = train_step(model, opt, x, y, micro_batches=micro, **clip)
        step_times.append(time.perf_counter() - t0)  # tracked steps are slower: not timings
        losses.append(global_mean(loss, info))
        report_progress(step + 1, args.steps, loss=losses[-1])
        after_step(step + 1, args, info, model, opt, ckpt, losses)

    results = {
        **run_header(args, info), "num_params": n_params, "losses": losses,
        "step_times": step_times, "memory": memory, "comm": log.to_list(),
        "param_layout": layout, "torch_memtracker": torch_mem, "grad_norms": grad_norms,
    }
    # which steps these losses are, so a resumed run's curve continues the killed one's
    results.update(ckpt, steps=list(range(start + 1, start + len(losses) + 1)), finished=True)
    if args.eval:
        results.update(evaluate(model, info, args.eval_samples))
    if args.save_params:
        save_full_params(model, info)
    finish(results)


def resume(args: argparse.Namespace, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """``--resume``: load the checkpoint into ``model`` and ``opt`` (any world size) and
    return where to continue: ``{"start_step", "resumed_from", "load_s", "rng_restored"}``."""
    from minifsdp.checkpoint import load_checkpoint

    t0 = time.perf_counter()
    loaded = load_checkpoint(args.resume, model, opt)
    for key in ("global_batch", "seed"):  # the data position means nothing otherwise
        saved = loaded["extra"].get(key, getattr(args, key))
        if saved != getattr(args, key):
            raise ValueError(f"--resume {loaded['path']}: saved with --{key.replace('_', '-')} "
                             f"{saved}, this run has {getattr(args, key)}: the resumed run "
                             "would not see the data the saved one would have")
    return {"start_step": loaded["step"], "resumed_from": str(loaded["path"]),
            "load_s": time.perf_counter() - t0, "rng_restored": loaded["rng_restored"]}


def run_header(args: argparse.Namespace, info: DistInfo) -> dict:
    """The fields every results file starts with, finished or not: which run and which rank."""
    return {"strategy": args.strategy, "model": args.model, "rank": info.rank,
            "world_size": info.world_size, "device": str(info.device),
            "backend": info.backend, "config": vars(args)}


def after_step(done: int, args: argparse.Namespace, info: DistInfo, model: nn.Module,
               opt: torch.optim.Optimizer, ckpt: dict, losses: list[float]) -> None:
    """After ``done`` steps: save a checkpoint if one is due (``--checkpoint-dir``,
    ``--save-every``, the last step) and write this rank's results so far, so a run that
    dies later still reports its steps; then crash here if ``--kill-at-step`` says so."""
    from minifsdp.checkpoint import rank_bytes, save_checkpoint
    from minifsdp.dist import save_results

    if args.checkpoint_dir and (done == args.steps or (args.save_every
                                                       and done % args.save_every == 0)):
        t0 = time.perf_counter()
        crash = (lambda _: _kill(args, info)) if args.kill_during_save == done else None
        path = save_checkpoint(args.checkpoint_dir, model, opt, step=done, keep=args.keep,
                               before_commit=crash,
                               extra={"strategy": args.strategy, "model": args.model,
                                      "global_batch": args.global_batch, "seed": args.seed})
        ckpt["checkpoints"].append({"step": done, "path": str(path),
                                    "save_s": time.perf_counter() - t0,
                                    "bytes": rank_bytes(path, info.rank)})
        start = ckpt["start_step"]
        save_results({**run_header(args, info), "losses": losses,
                      "steps": list(range(start + 1, done + 1)), **ckpt, "finished": False})
    if args.kill_at_step == done:
        _kill(args, info)


def _kill(args: argparse.Namespace, info: DistInfo) -> None:
    """A real crash: SIGKILL runs no handler, flushes nothing, writes no results."""
    import os
    import signal
    import sys

    if args.kill_rank is None or args.kill_rank == info.rank:
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def param_layout(model: nn.Module) -> list[dict]:
    """What this rank's model holds as parameters: name, class, logical shape and the local
    (physical) shape -- e.g. ``{"name": "blocks.0.mlp.fc.weight", "type": "DTensor",
    "shape": [1024, 256], "local_shape": [512, 256], "placements": "(Shard(dim=0),)"}``
    under FSDP2 at N = 2, or one flat 1-D shard per unit under FSDP1."""
    from torch.distributed.tensor import DTensor

    out = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        out.append({"name": name, "type": type(p).__name__,
                    "shape": list(p.shape), "local_shape": list(local.shape),
                    "placements": str(p.placements) if isinstance(p, DTensor) else None})
    return out


@contextlib.contextmanager
def torch_memtracker(model, opt, inputs):
    """Run the body under torch's ``FSDPMemTracker`` (torch ``fully_shard`` models only) and
    fill the yielded dict, on exit, with its peak per category in bytes (``"Total"`` included).

    Example::

        with torch_memtracker(model, opt, (x, y)) as peak:
            train_step(model, opt, x, y)
        peak["Total"], peak["Sharded Param"], peak["OptState"]

    Note [two trackers, one step]: torch's tracker runs *around* our ``MemoryTracker`` on the
    same step (two nested ``TorchDispatchMode``s see every op and every storage's death), not
    on the next step. A peak is a property of one step's schedule: on the CNN at N = 2, torch's
    step 3 has peaked 2.9 MB above its step 2 (a buffer that dies on gloo's thread), and on the
    chapter-05 GPT step 3 sat 131,072 B off step 2. Watching one step, the two trackers agree
    byte for byte (tests/test_fsdp2.py), which is what lets one check the other.
    """
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        raise ValueError("--torch-memtracker needs a model sharded by torch's fully_shard "
                         f"(--strategy torch_fsdp2), got {type(model).__name__}")
    mt = FSDPMemTracker(model, opt)
    mt.track_inputs(inputs)
    out: dict = {}
    with mt:
        yield out
    (peak,) = mt.get_tracker_snapshot("peak").values()  # one device
    out.update({str(getattr(k, "value", k)): v for k, v in peak.items()})


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters under the model's own names, on the CPU, whatever the
    strategy (a collective: every rank calls it). For parity checks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from minifsdp.fsdp1 import FullyShardedDataParallel, full_state_dict

    if isinstance(model, FullyShardedDataParallel):  # ours: torch's helper does not know it
        sd = full_state_dict(model)
    else:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    # torch strips its own DDP's "module." prefix; our wrappers (NaiveDDP, BucketedDDP) need
    # the same so that every strategy saves the model's own parameter names.
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
    return {k: v.detach().cpu() for k, v in sd.items()}


def save_full_params(model: nn.Module, info: DistInfo) -> None:
    """Gather the full (unsharded) parameters and save them from rank 0 for parity checks."""
    from minifsdp.dist import results_dir

    sd = full_params(model)
    if info.rank == 0:
        results_dir().mkdir(parents=True, exist_ok=True)
        torch.save(sd, results_dir() / "params.pt")


if __name__ == "__main__":
    main()
