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
from minifsdp.models import build_model, count_params

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
    return FullyShardedDataParallel(
        model, device_id=info.device, use_orig_params=True,
        sharding_strategy=ShardingStrategy[args.sharding_strategy.upper()],
        auto_wrap_policy=policies[args.auto_wrap],
        cpu_offload=CPUOffload(offload_params=args.cpu_offload))


@strategy("fsdp1")
def _fsdp1(model, info, args):
    from minifsdp import fsdp1

    policies = {"none": lambda: None,
                "size": lambda: fsdp1.size_based_auto_wrap_policy(args.min_num_params),
                "transformer": lambda: fsdp1.transformer_auto_wrap_policy(unit_classes(model))}
    return fsdp1.FullyShardedDataParallel(
        model, sharding_strategy=args.sharding_strategy, device_id=info.device,
        cpu_offload=fsdp1.CPUOffload(offload_params=args.cpu_offload),
        auto_wrap_policy=policies[args.auto_wrap]())


@strategy("torch_fsdp2")
def _torch_fsdp2(model, info, args):
    from torch.distributed.fsdp import fully_shard

    return shard_bottom_up(fully_shard, model, info, args)


def shard_bottom_up(fully_shard, model, info, args):
    """``fully_shard`` (torch's or ours) on each of ``shard_units(model)``, children before the
    root, then on the root, over a 1-D mesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for unit in shard_units(model):
        fully_shard(unit, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
    return fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard_after_forward)


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
    from minifsdp.fsdp2 import fully_shard

    return shard_bottom_up(fully_shard, model, info, args)


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
    p.add_argument("--track-memory", type=int, default=0, metavar="K",
                   help="record the memory timeline of the first K steps")
    p.add_argument("--eval", action="store_true", help="report test accuracy at the end")
    p.add_argument("--eval-samples", type=int, default=10_000,
                   help="evaluate on the first N test images (all 10,000 cost ~10 s on 1 core)")
    p.add_argument("--save-params", action="store_true",
                   help="rank 0 saves the full final parameters to <out>/params.pt")
    p.add_argument("--reshard-after-forward", choices=["true", "false"], default=None,
                   type=str.lower, help="fsdp2, torch_fsdp2: free the unsharded parameters "
                   "after forward (default: true, except the root's, as torch 2.14)")
    args = p.parse_args(argv)
    if args.reshard_after_forward is not None:
        args.reshard_after_forward = args.reshard_after_forward == "true"
    if args.eval and args.model != "cnn":
        p.error("--eval needs --model cnn (the token data has no test set)")
    if args.strategy not in STRATEGIES:
        p.error(f"unknown --strategy {args.strategy!r}; choose from {sorted(STRATEGIES)}")
    return args


def make_model(args: argparse.Namespace) -> nn.Module:
    if args.model == "cnn":
        return build_model("cnn", dropout=args.dropout)
    return build_model("gpt", vocab_size=args.vocab_size, seq_len=args.seq_len,
                       n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                       dropout=args.dropout, tie_embeddings=args.tie_embeddings)


def make_optimizer(params, args: argparse.Namespace) -> torch.optim.Optimizer:
    if args.optimizer == "adam":
        return torch.optim.Adam(params, lr=args.lr)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=args.lr, weight_decay=0.1)
    if args.optimizer == "adadelta":  # the FSDP tutorial's choice (lr=1.0)
        return torch.optim.Adadelta(params, lr=args.lr)
    return torch.optim.SGD(params, lr=args.lr)


def make_batches(args: argparse.Namespace, info: DistInfo):
    """Yield ``(inputs, targets)`` for this rank; see Note [same global batch]."""
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
    epoch = 0
    while True:  # restart the loaders each epoch (sampler seed + epoch = a new shuffle)
        seed = args.seed + epoch
        it = (global_batch_loader(ds, local, shards, seed) if args.strategy == "single"
              else rank_loader(ds, local, info.rank, info.world_size, seed))
        for x, y in it:
            yield x.to(info.device), y.to(info.device)
        epoch += 1


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:  # GPT logits (B, T, V)
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.nll_loss(out, y)


def train_step(model, opt, x, y, tracker: MemoryTracker | None = None,
               micro_batches: int = 1) -> torch.Tensor:
    """forward -> backward -> optimizer step -> zero_grad, in named memory phases.

    With ``micro_batches = N`` the batch is split into N equal parts whose gradients
    accumulate, each loss scaled by 1/N (Note [bitwise parity]). Returns the batch's mean loss.
    """
    phase = lambda name: _phase(name, tracker)
    losses = []
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        with phase("forward"):
            loss = loss_fn(model(xs), ys)
        with phase("backward"):
            (loss / micro_batches if micro_batches > 1 else loss).backward()
        losses.append(loss.detach())
    with phase("optimizer step"):
        opt.step()
    with phase("zero_grad"):
        opt.zero_grad(set_to_none=True)
    # Summed then divided, in rank order: the same float operations as global_mean's
    # all-reduce over N ranks.
    return torch.stack(losses).sum() / micro_batches if micro_batches > 1 else losses[0]


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
def evaluate(model: nn.Module, info: DistInfo, samples: int = 10_000) -> dict:
    """Test accuracy on the first ``samples`` MNIST test images, split across ranks, summed."""
    model.eval()
    ds = torch.utils.data.Subset(mnist(train=False), range(min(samples, 10_000)))
    correct = torch.zeros(2, device=info.device)
    for x, y in rank_loader(ds, 500, info.rank, info.world_size, seed=0):
        pred = model(x.to(info.device)).argmax(1)
        correct += torch.stack([(pred == y.to(info.device)).sum(), torch.tensor(len(y))])
    if info.world_size > 1:
        dist.all_reduce(correct)
    model.train()
    return {"test_accuracy": float(correct[0] / correct[1]), "test_samples": int(correct[1])}


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
    batches = make_batches(args, info)

    micro = (args.data_shards or 1) if args.strategy == "single" and not args.full_batch else 1
    log = comm.comm_log()
    log.clear()
    losses, step_times, memory = [], [], []
    for step in range(args.steps):
        x, y = next(batches)
        tracker = None
        if step < args.track_memory:
            tracker = MemoryTracker(model=model, optimizer=opt, device=info.device)
            tracker.track_modules(model)
        t0 = time.perf_counter()
        if tracker:
            with tracker:
                tracker.register((x, y), "activations")  # the first layer saves the batch
                loss = train_step(model, opt, x, y, tracker, micro)
            memory.append(tracker.to_dict())
        else:
            loss = train_step(model, opt, x, y, micro_batches=micro)
        step_times.append(time.perf_counter() - t0)
        losses.append(global_mean(loss, info))
        report_progress(step + 1, args.steps, loss=losses[-1])

    results = {
        "strategy": args.strategy, "model": args.model, "rank": info.rank,
        "world_size": info.world_size, "device": str(info.device), "backend": info.backend,
        "num_params": n_params, "config": vars(args), "losses": losses,
        "step_times": step_times, "memory": memory, "comm": log.to_list(),
    }
    if args.eval:
        results.update(evaluate(model, info, args.eval_samples))
    if args.save_params:
        save_full_params(model, info)
    finish(results)


def save_full_params(model: nn.Module, info: DistInfo) -> None:
    """Gather the full (unsharded) parameters and save them from rank 0 for parity checks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from minifsdp.dist import results_dir
    from minifsdp.fsdp1 import FullyShardedDataParallel, full_state_dict

    if isinstance(model, FullyShardedDataParallel):  # ours: torch's helper does not know it
        sd = full_state_dict(model)
    else:
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    # torch strips its own DDP's "module." prefix; our wrappers (NaiveDDP, BucketedDDP) need
    # the same so that every strategy saves the model's own parameter names.
    torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, "module.")
    if info.rank == 0:
        results_dir().mkdir(parents=True, exist_ok=True)
        torch.save({k: v.detach().cpu() for k, v in sd.items()}, results_dir() / "params.pt")


if __name__ == "__main__":
    main()
