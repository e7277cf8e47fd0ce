"""Torchrun worker for chapter 08: a sharded checkpoint vs a full one, on the same model.

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m minifsdp.demos.checkpoint_costs --out runs/08/costs

Builds the chapter-05 GPT (``minifsdp.train``'s flags), shards it with our ``fully_shard``,
trains one step (so AdamW's state exists), then saves it twice:

* **sharded**: ``minifsdp.checkpoint.save_checkpoint`` -- every rank writes its own rows;
* **full**: ``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True``
  (every DTensor all-gathered; ``cpu_offload=True`` keeps the result on rank 0 only), then
  ``torch.save`` on rank 0.

For each it reports per rank: seconds (after a barrier), bytes this rank wrote, the peak of
*extra* live tensor memory while saving (``MemoryTracker``, above what the model and optimizer
already hold: DCP's and gloo's temporaries included, so it varies a little between machines),
and ``gathered_bytes``: the exact bytes of the tensors the save builds and holds besides the
model's and optimizer's own (the full save's gathered state dict on rank 0; none for the
sharded save, which hands DCP the DTensors each rank already holds). Results:
``rank{r}.json`` under ``MINIFSDP_OUT``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from minifsdp.checkpoint import rank_bytes, save_checkpoint
    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.memory import MemoryTracker
    from minifsdp.train import STRATEGIES, loss_fn, make_model, make_optimizer, parse_args

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="directory for the checkpoints")
    own, rest = p.parse_known_args()
    args = parse_args(["--strategy", "fsdp2", *rest])
    info = dist_setup()
    seed_everything(args.seed)
    model = STRATEGIES["fsdp2"](make_model(args).to(info.device), info, args)
    opt = make_optimizer(model.parameters(), args)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab_size, (args.global_batch // info.world_size, args.seq_len),
                      generator=g)
    loss_fn(model(x), x).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out = Path(own.out)

    def measure(save) -> dict:
        dist.barrier()
        tracker = MemoryTracker(model=model, optimizer=opt, device=info.device)
        t0 = time.perf_counter()
        with tracker:
            base = tracker.current()["total"]
            written, gathered = save()
        dist.barrier()
        return {"seconds": time.perf_counter() - t0, "bytes_written": written,
                "extra_peak": tracker.peak - base, "gathered_bytes": gathered}

    def tensor_bytes(tree) -> int:  # every tensor in a nested dict / list, counted once
        if isinstance(tree, torch.Tensor):
            return tree.numel() * tree.element_size()
        if isinstance(tree, dict):
            return sum(tensor_bytes(v) for v in tree.values())
        if isinstance(tree, (list, tuple)):
            return sum(tensor_bytes(v) for v in tree)
        return 0

    def sharded() -> tuple[int, int]:
        step_dir = save_checkpoint(out / "sharded", model, opt, step=1, keep=1)
        return rank_bytes(step_dir, info.rank), 0

    def full() -> tuple[int, int]:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {"model": get_model_state_dict(model, options=opts),
                 "optim": get_optimizer_state_dict(model, opt, options=opts)}
        if info.rank != 0:
            return 0, tensor_bytes(state)
        (out / "full").mkdir(parents=True, exist_ok=True)
        torch.save(state, out / "full" / "model_and_optim.pt")
        return (out / "full" / "model_and_optim.pt").stat().st_size, tensor_bytes(state)

    results = {"sharded": measure(sharded), "full": measure(full)}
    finish({**results, "num_params": sum(p.numel() for p in model.parameters()),
            "param_tensors": len(list(model.parameters())),
            "world_size": info.world_size})


if __name__ == "__main__":
    main()
