"""What ``minifsdp.train`` does around checkpoints (chapter 08): resume from one, save one
when it is due, and crash on request (``--kill-at-step``, ``--kill-during-save``) so that the
tests can prove a resumed run continues the killed one bit for bit (Note [bitwise resume] and
Note [atomic save] in ``minifsdp.checkpoint``)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn

from minifsdp.dist import DistInfo


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


def after_step(done: int, args: argparse.Namespace, info: DistInfo, model: nn.Module,
               opt: torch.optim.Optimizer, ckpt: dict, losses: list[float]) -> None:
    """After ``done`` steps: save a checkpoint if one is due (``--checkpoint-dir``,
    ``--save-every``, the last step) and write this rank's results so far, so a run that
    dies later still reports its steps; then crash here if ``--kill-at-step`` says so."""
    from minifsdp.checkpoint import rank_bytes, save_checkpoint
    from minifsdp.dist import run_header as _header
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
        save_results({**_header(args, info), "losses": losses,
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
