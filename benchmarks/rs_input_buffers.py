"""What torch's retained reduce-scatter inputs cost at the step's peak (Note [reduce-scatter
inputs in flight] in ``minifsdp/fsdp2/comm_buffers.py``), measured in one job::

    python benchmarks/rs_input_buffers.py                  # world sizes 2 and 4
    python benchmarks/rs_input_buffers.py --world-sizes 2

torch's ``fully_shard`` keeps each group's reduce-scatter input alive until a later group's
post-backward (``set_reduce_scatter_max_input_buffers``: at most K, default 1); ours frees it
when its reduce-scatter returns. Per world size, the benchmark GPT (``harness.gpt_and_batch``;
its blocks and the root as groups) trains 2 warm-up steps, then one step under
``MemoryTracker`` (the same tracker for all), in five variants: torch with K = 1 and K = 2;
torch with nothing kept -- an experiment, not a setting: its private list of retained inputs
replaced by one that keeps nothing, which is safe only because gloo's reduce-scatter has
finished when it returns; and ours with K = 1 and K = 2. The peak is the largest over ranks.
Not part of the test suite.
"""

from __future__ import annotations

import argparse

import harness

VARIANTS = ("torch, K = 1", "torch, K = 2", "torch, nothing kept", "ours, K = 1", "ours, K = 2")


class _KeepsNothing(list):
    """torch's ``comm_ctx.reduce_scatter_states`` that drops what it is given (the experiment)."""

    def append(self, state) -> None:
        pass


def worker(args: argparse.Namespace) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minifsdp.dist import dist_setup, finish, seed_everything
    from minifsdp.fsdp2 import fully_shard
    from minifsdp.models import GPT

    info = dist_setup()
    cfg, x, y = harness.gpt_and_batch(args, info)
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    peaks = {}
    for variant in VARIANTS:
        seed_everything(0)
        model = GPT(cfg).to(info.device)
        fs = torch_fully_shard if variant.startswith("torch") else fully_shard
        for block in model.blocks:
            fs(block, mesh=mesh)
        fs(model, mesh=mesh)
        if variant.endswith("K = 2"):
            model.set_reduce_scatter_max_input_buffers(2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):
            harness.train_step(model, opt, x, y)
        if variant == "torch, nothing kept":  # after lazy init made the context
            model._get_fsdp_state()._comm_ctx.reduce_scatter_states = _KeepsNothing()
        peaks.update(harness.tracked_peaks({variant: model}, {variant: opt}, x, y, info))
    finish({"peaks": peaks, "device": str(info.device)})


def driver(args: argparse.Namespace) -> None:
    from minifsdp.launch import torchrun

    argv = [v for flag, *_ in harness.COMMON for v in (flag, getattr(args, flag[2:].replace(
        "-", "_")))]
    print(f"GPT: {args.n_layer} blocks, d_model {args.d_model}, {args.batch} x {args.seq_len} "
          "tokens per rank; the peak of one step after 2 warm-up steps (MemoryTracker), the "
          "largest over ranks\n")
    print(f"{'ranks':>5}  {'variant':<20} {'peak':>10} {'vs torch, K = 1':>16}  "
          "comm / other at the peak (rank 0)")
    for n in args.world_sizes:
        run = torchrun(__file__, *argv, nproc=n, chapter="benchmarks", name=f"rs_inputs_{n}")
        peaks = {v: max(r["peaks"][v]["total"] for r in run.ranks) for v in VARIANTS}
        for v in VARIANTS:
            mine = run.ranks[0]["peaks"][v]
            print(f"{n:>5}  {v:<20} {peaks[v] / 2**20:>8.2f}Mi "
                  f"{peaks[v] / peaks['torch, K = 1']:>15.3f}x  "
                  f"{mine.get('comm', 0) / 2**20:.2f} / {mine.get('other', 0) / 2**20:.2f} MiB")


if __name__ == "__main__":
    harness.main(worker, driver, harness.parse_args(__doc__))
