"""What ``minifsdp.train`` records about a model beside its losses: the parameters' layout on
this rank, torch's ``FSDPMemTracker`` around one step, and the full parameters for parity
checks (a collective)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from minifsdp.dist import DistInfo


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
    chapter-05 GPT step 3 sat 131,072 B off step 2. Watching one step, the two trackers see the
    same storages live at every operation but one kind: a reduce-scatter's input that dies on
    gloo's thread between the inner tracker's bookkeeping of an operation and the outer one's.
    At that one operation one tracker counts it and the other does not, so their peaks agree
    byte for byte or differ by at most that input, ``largest_reduce_scatter_input(model)``
    (measured: equal in almost every run; CI once saw them differ on chapter 05's GPT).
    tests/test_fsdp2.py and notebook 05 check exactly that.
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


def largest_reduce_scatter_input(model: nn.Module) -> int:
    """Bytes of the largest reduce-scatter input a torch ``fully_shard`` model builds in a
    step: over its groups, S x the padded rows of each parameter's shard, at the sharded
    parameter's element size (S the shard group's size; the gradients are reduced in a dtype
    no wider than that). A bound, exact by construction, on what one buffer that dies on
    gloo's thread can move a tracker's peak by (Note [two trackers, one step]).

    Example: at N = 2, a model whose largest group holds one 7 x 4 fp32 parameter gives
    ``2 * 4 * 4 * 4`` = 128 bytes (7 rows padded to 2 shards of 4).
    """
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    nested = {m: {id(p) for c in m.modules() if c is not m and isinstance(c, FSDPModule)
                  for p in c.parameters()} for m in groups}
    largest = 0
    for m in groups:
        total = 0
        for p in m.parameters():
            if id(p) in nested[m]:
                continue
            s = p.device_mesh.size(-1) if hasattr(p, "device_mesh") else 1
            rows = p.shape[0] if p.dim() else 1
            total += -(-rows // s) * s * (p.numel() // max(rows, 1)) * p.element_size()
        largest = max(largest, total)
    return largest


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters under the model's own names, on the CPU, whatever the
    strategy (a collective: every rank calls it). For parity checks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from minifsdp.fsdp1 import FullyShardedDataParallel, full_state_dict

    if isinstance(model, FullyShardedDataParallel):  # ours: torch's helper does not know it
        sd = full_state_dict(model)
    else:
        # Offload only what is not on the CPU already. torch 2.11's FSDP1 with offload_to_cpu
        # on CPU parameters cloned freed memory in its full-state-dict hook and killed rank 0
        # with SIGSEGV (the H100 machine, benchmarks/RESULTS.md; not reproduced on 2 cores).
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=not on_cpu))
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
