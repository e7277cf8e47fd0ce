"""Chapter 05's activation-checkpointing worker: what checkpointing saves, what it costs, and
how it composes with ``reshard_after_forward``. Run under torchrun, e.g.::

    run = torchrun("minifsdp.demos.activation_checkpointing", nproc=2, chapter="05")
    run.ranks[0]["configs"]["ours ac raf"]["end_of_forward"]["activations"]

A 4-block GPT (d_model 128, T 64, vocab 128), 8 sequences per rank, AdamW, ``STEPS`` steps on
the same batches in every configuration:

- ``ours {plain|ac} {raf|keep}``: our ``fully_shard`` (each Block, then the root) without /
  with ``apply_activation_checkpointing`` (Note [activation checkpointing] in
  ``minifsdp/models.py``), ``reshard_after_forward`` True (``raf``) or False (``keep``);
- ``ours wrapper raf``: ours with torch's ``checkpoint_wrapper`` around each whole Block (the
  recomputation re-runs the Block's FSDP hooks: Note [recomputed in backward]);
- ``torch plain``, ``torch ac``, ``torch wrapper``: torch's ``fully_shard``, the oracle;
- ``fsdp1 plain``, ``fsdp1 ac``: our FSDP1, a unit per Block, the regions checkpointed inside
  the units (a whole unit it refuses: ``FullyShardedDataParallel.forward`` in
  fsdp1/fully_sharded.py).

Per configuration and rank: the losses; ``bitwise``: every full parameter after the last step
equal to ``ours plain raf``'s bit for bit, and ``divergence``: where the losses, else the
parameters, first differ from its (Note [parity] in ``minifsdp/parity.py``), or None;
``counts``: the ops of step 2 by phase (all-gathers, reduce-scatters, SDPA and gelu forwards,
counted below the dispatcher, so torch's collectives count too); for ours, ``end_of_forward``
(``MemoryTracker``'s bytes by category once the loss exists) and the tracker's ``memory`` of
step 2. Then ``flops`` (``FlopCounterMode``: a plain step, a checkpointed step, a no-grad
forward) and ``times`` (plain and checkpointed steps, interleaved).

``saved_for_backward`` (used in-process by the notebook) lists what autograd saves for one call.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from minifsdp import fsdp1, fsdp2
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPT, Block, GPTConfig, apply_activation_checkpointing
from minifsdp.parity import divergence_line

CFG = GPTConfig(vocab_size=128, seq_len=64, n_layer=4, n_head=4, d_model=128)
LOCAL, STEPS, TRACKED, TIMED = 8, 3, 1, 8  # sequences per rank; steps; step 2; timed rounds
WRAPPED = "_checkpoint_wrapped_module."  # the prefix torch's checkpoint_wrapper adds to names
# op (its name below the dispatcher) -> what the notebook calls it
COUNTED = {"_allgather_base_": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
           "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced":
           "reduce_scatter", "_scaled_dot_product_flash_attention_for_cpu": "attention",
           "_scaled_dot_product_flash_attention": "attention",  # CUDA's kernels from here on
           "_scaled_dot_product_efficient_attention": "attention",
           "_scaled_dot_product_cudnn_attention": "attention", "gelu": "gelu"}


# ---- what autograd saves ---------------------------------------------------------------------

class _Caller(TorchFunctionMode):
    """The ``torch.nn.functional``-level call running now (``linear``, ``layer_norm`` ...).
    Pack hooks fire inside it: before the kernel for the inputs an op saves, after it for
    its outputs, so the last kernel that ran would often name the wrong op."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.stack.append(getattr(func, "__name__", str(func)))
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.stack.pop()


def saved_for_backward(fn, *args) -> list[dict]:
    """What autograd saves for backward while ``fn(*args)`` runs, one row per saved tensor
    except parameters (model state, not activations): ``{"op", "shape", "dtype", "bytes",
    "new"}``. ``op`` is the functional call that saved it (``"checkpoint"``: a checkpointed
    region's input, saved by the checkpoint itself); ``bytes`` is the storage's size; ``new``
    is False for a storage already listed (a view: ``q``, ``k``, ``v`` share qkv's output).
    Sum ``bytes`` over ``new`` rows for the memory (inputs included, as in
    ``minifsdp.analytic``).

    Example:
        >>> lin = torch.nn.Linear(4, 3)
        >>> [(r["op"], r["shape"], r["new"]) for r in saved_for_backward(lin, torch.ones(2, 4))]
        [('linear', [2, 4], True)]
    """
    params = {id(p.untyped_storage()) for p in _params(fn)}
    rows, seen, keep = [], set(), []
    caller = _Caller()

    def pack(t):
        st = t.untyped_storage()
        if id(st) not in params:
            rows.append({"op": caller.stack[0] if caller.stack else "checkpoint",
                         "shape": list(t.shape), "dtype": str(t.dtype).split(".")[-1],
                         "bytes": st.nbytes(), "new": id(st) not in seen})
            seen.add(id(st))
            keep.append(st)  # ids stay unique while the storages are alive
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), caller:
        out = fn(*args)
    if not out.requires_grad:
        raise ValueError("nothing was saved: no input or parameter of fn requires grad")
    return rows


def _params(fn) -> list[torch.Tensor]:
    owner = getattr(fn, "__self__", fn)  # a module, its bound forward, or has .parameters
    return list(owner.parameters()) if hasattr(owner, "parameters") else []


class CountOps(TorchDispatchMode):
    """Calls of the ``COUNTED`` ops by phase: ``{"backward all_gather": 4, ...}``."""

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = COUNTED.get(func.__name__.split(".")[0])
        if name is not None:
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            self.counts[f"{phase} {name}"] = self.counts.get(f"{phase} {name}", 0) + 1
        return func(*args, **(kwargs or {}))


# ---- the configurations ----------------------------------------------------------------------

def build(name: str, mesh, device: torch.device) -> torch.nn.Module:
    """``"ours plain raf"`` ... ``"fsdp1 ac"`` (see the module docstring)."""
    torch.manual_seed(0)
    model = GPT(CFG).to(device)
    if " ac" in name:
        apply_activation_checkpointing(model)
    if name.startswith("fsdp1"):  # a unit per Block; checkpointed regions inside the units
        return fsdp1.FullyShardedDataParallel(
            model, device_id=device, auto_wrap_policy=fsdp1.transformer_auto_wrap_policy({Block}))
    if "wrapper" in name:  # torch's way: a wrapper module around each whole Block
        for i, block in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(block)
    shard = torch_fully_shard if name.startswith("torch") else fsdp2.fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh, reshard_after_forward=not name.endswith("keep"))
    shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (inputs, targets) of step ``step``: two storages of their own."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CFG.vocab_size, (n * LOCAL, CFG.seq_len + 1), generator=g)
    mine = tokens.chunk(n)[rank]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def step(model, opt, x, y, tracker: MemoryTracker | None = None) -> tuple[float, dict]:
    """One AdamW step; the tracker's bytes once the loss exists (``{}`` if no tracker)."""
    phase = tracker.phase if tracker is not None else lambda name: contextlib.nullcontext()
    with phase("forward"):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    end_of_forward = tracker.current() if tracker is not None else {}
    with phase("backward"):
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item(), end_of_forward


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter, whole (all-gathered), under ``GPT``'s own names."""
    if isinstance(model, fsdp1.FullyShardedDataParallel):
        return fsdp1.full_state_dict(model)
    return {k.replace(WRAPPED, ""): p.full_tensor() for k, p in model.named_parameters()}


def run(name: str, mesh, info) -> tuple[dict, dict, torch.nn.Module]:
    """``STEPS`` steps of configuration ``name``: its results, full parameters and model."""
    model = build(name, mesh, info.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out, counter = {"losses": []}, CountOps()
    for i in range(STEPS):
        x, y = (t.to(info.device) for t in batch(i, info.rank, info.world_size))
        if i != TRACKED:
            out["losses"].append(step(model, opt, x, y)[0])
            continue
        tracker = MemoryTracker(model, opt, max_samples=512) if name.startswith("ours") else None
        if tracker is not None:
            tracker.register((x, y), "activations")  # the embedding and the loss save them
        with tracker if tracker is not None else contextlib.nullcontext(), counter:
            loss, out["end_of_forward"] = step(model, opt, x, y, tracker)
        out["losses"].append(loss)
        out["counts"] = counter.counts
        if tracker is not None:
            out["memory"] = tracker.to_dict()
    return out, full_params(model), model


def main() -> None:
    from minifsdp.dist import dist_setup, finish

    info = dist_setup()
    n = info.world_size
    mesh = init_device_mesh(info.device.type, (n,))
    names = ["ours plain raf", "ours ac raf", "ours plain keep", "ours ac keep",
             "ours wrapper raf", "torch plain", "torch ac", "torch wrapper", "fsdp1 plain",
             "fsdp1 ac"]
    configs, models, ref = {}, {}, None
    for name in names:
        configs[name], params, models[name] = run(name, mesh, info)
        ref = ref or (configs[name]["losses"], params)  # ours plain raf's
        sides, where = (name, names[0]), f"rank {info.rank}"
        losses = divergence_line(configs[name]["losses"], ref[0], names=sides,
                                 where=f"{where}, losses")
        line = divergence_line(params, ref[1], names=sides, where=where)
        configs[name]["bitwise"] = list(params) == list(ref[1]) and line is None
        configs[name]["divergence"] = losses or line

    # cost of the recomputation: FLOPs (exact) and step time (noisy), same batch each time
    x, y = (t.to(info.device) for t in batch(STEPS, info.rank, n))
    plain, ac = models["ours plain raf"], models["ours ac raf"]
    flops = {}
    for key, model in (("plain step", plain), ("ac step", ac)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        with FlopCounterMode(display=False) as fc:
            step(model, opt, x, y)
        flops[key] = fc.get_total_flops()
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        plain(x)
    flops["forward"] = fc.get_total_flops()
    times = {"plain": [], "ac": []}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in (("plain", plain),
                                                                       ("ac", ac))}
    for i in range(TIMED):  # interleaved, so a burst of load hits both alike
        for key in ("plain", "ac") if i % 2 else ("ac", "plain"):
            model = plain if key == "plain" else ac
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step(model, opts[key], x, y)
            times[key].append(time.perf_counter() - t0)
    finish({"configs": configs, "flops": flops, "times": times, "world_size": n,
            "local_batch": LOCAL, "cfg": CFG.to_dict()})


if __name__ == "__main__":
    main()
