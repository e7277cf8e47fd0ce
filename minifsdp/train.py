"""One training entry point for every chapter, run under torchrun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m minifsdp.train --strategy torch_ddp --model cnn --steps 50 --global-batch 64

Each rank writes ``rank{r}.json`` (via ``minifsdp.dist.finish``) with the global loss of every
step, step times, the memory timeline of the tracked steps, the communication log and the
run's configuration. Notebooks launch it with ``minifsdp.launch.torchrun`` and plot the JSON.

Strategies are registered by name in ``minifsdp.strategies`` (``ddp``, ``zero1``, ``fsdp2``
... next to the PyTorch implementation each is checked against), each with the flags it takes;
``parse_args`` checks them in one loop. The test accuracy lives in ``minifsdp.evaluation``,
what is recorded beside the losses (layouts, torch's memory tracker, full parameters) in
``minifsdp.probes``, the optimizer in ``minifsdp.strategies`` (``make_optimizer``); this module
keeps the loop, the model and the data.

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
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from minifsdp import comm
from minifsdp.data import MarkovTokens, global_batch_loader, mnist, rank_loader
from minifsdp.dist import (
    DistInfo,
    dist_setup,
    finish,
    report_progress,
    run_header,
    seed_everything,
)
from minifsdp.evaluation import evaluate
from minifsdp.memory import MemoryTracker
from minifsdp.models import apply_activation_checkpointing, build_model, count_params
from minifsdp.probes import (
    full_params,
    largest_reduce_scatter_input,
    param_layout,
    save_full_params,
    torch_memtracker,
)
from minifsdp.resume import after_step, resume
from minifsdp.strategies import (
    DTYPES,
    STRATEGIES,
    check_flags,
    data_parallel_mesh,
    make_optimizer,
    set_prefetch,
    shard_bottom_up,
    shard_units,
    takers,
    unit_classes,
    use_foreach,
)

# re-exported: what tests, demos and labs import from here (the torchrun target stays here)
__all__ = ["DTYPES", "STRATEGIES", "data_parallel_mesh", "evaluate", "full_params",
           "loss_fn", "main", "make_batches", "make_model", "make_optimizer", "parse_args",
           "set_prefetch", "shard_bottom_up", "shard_units", "train_step", "unit_classes",
           "use_foreach"]

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
                   "in minifsdp/fsdp1/fully_sharded.py)")
    p.add_argument("--auto-wrap", choices=["none", "size", "transformer"], default="none",
                   help="fsdp1, torch_fsdp1: the units; none: the whole model is one unit; size: "
                   "wherever --min-num-params are not yet wrapped; transformer: each of the "
                   "model's blocks (the CNN: each layer)")
    p.add_argument("--min-num-params", type=int, default=10_000,
                   help="--auto-wrap size: the threshold (torch's min_num_params)")
    p.add_argument("--cpu-offload", action="store_true",
                   help="keep the parameter shards and their gradients in host memory: fsdp1, "
                   "torch_fsdp1 (torch's needs an accelerator); fsdp2, torch_fsdp2 "
                   "(CPUOffloadPolicy: the optimizer steps on the CPU too)")
    p.add_argument("--comm-buffers", choices=["default", "process-group", "symm-mem"],
                   default="default",
                   help="fsdp2, torch_fsdp2: where every group's collective buffers come from: "
                   "the process group's allocator "
                   "(set_allocate_memory_from_process_group_for_comm), or symmetric memory "
                   "(set_symm_mem_for_comm: CUDA and NCCL only); Note [comm buffers from the "
                   "process group] in minifsdp/fsdp2/comm_buffers.py")
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
                   "[backward prefetch] in minifsdp/fsdp1/options.py; default: each library's "
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
    for action in p._actions:  # who takes each strategy-specific flag, from the registry
        if action.help and (who := takers(action.dest)):
            action.help += f" [--strategy {', '.join(who)}]"
    args = p.parse_args(argv)
    if args.strategy not in STRATEGIES:
        p.error(f"unknown --strategy {args.strategy!r}; choose from {sorted(STRATEGIES)}")
    check_flags(args, {a.dest: a.default for a in p._actions}, p.error)
    if args.clip_grad_norm is not None and not args.clip_grad_norm > 0:
        p.error(f"--clip-grad-norm {args.clip_grad_norm}: the maximum norm must be > 0")
    if args.hsdp is not None and args.hsdp < 1:
        p.error(f"--hsdp {args.hsdp}: the replicate degree R must be >= 1")
    if args.activation_checkpointing and args.model != "gpt":
        p.error("--activation-checkpointing needs --model gpt (it checkpoints each Block's "
                "attn and mlp)")
    if args.reshard_after_forward is not None:
        args.reshard_after_forward = args.reshard_after_forward == "true"
    if args.eval and args.model != "cnn":
        p.error("--eval needs --model cnn (the token data has no test set)")
    if args.eval and not 1 <= args.eval_samples <= 10_000:
        p.error(f"--eval-samples {args.eval_samples}: MNIST has 10,000 test images, use 1..10000")
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


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    info = dist_setup()
    finish(run(args, info))


def run(args: argparse.Namespace, info: DistInfo) -> dict:
    """One training run, as ``parse_args(argv)`` describes it, in the process group ``info``
    set up; returns this rank's results (what ``rank{r}.json`` holds). ``--save-params`` and
    checkpoints go to ``minifsdp.dist.results_dir()``. ``main`` runs it once per job;
    ``minifsdp.sweep`` runs several, one after another, in one job (Note [a sweep of runs]).

    Example (inside a torchrun worker)::

        info = dist_setup()
        results = run(parse_args(["--strategy", "fsdp2", "--model", "gpt", "--steps", 2]), info)
        results["losses"]          # [global loss of step 1, of step 2]
    """
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
    if torch_mem is not None:  # what may part the two trackers (Note [two trackers, one step])
        results["largest_reduce_scatter_input"] = largest_reduce_scatter_input(model)
    # which steps these losses are, so a resumed run's curve continues the killed one's
    results.update(ckpt, steps=list(range(start + 1, start + len(losses) + 1)), finished=True)
    if args.eval:
        results.update(evaluate(model, info, args.eval_samples))
    if args.save_params:
        save_full_params(model, info)
    return results


if __name__ == "__main__":
    main()
