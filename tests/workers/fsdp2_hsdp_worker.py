"""Worker for tests/test_fsdp2_hsdp.py: ``minifsdp.fsdp2`` on a 2-D HSDP mesh next to torch's
``fully_shard`` on the same mesh, on what ``minifsdp.train`` does not reach. Run at N = 4
(mesh (2, 2): shard groups {0, 1} and {2, 3}, replicate groups {0, 2} and {1, 3}); reports
raw numbers, the test asserts on them.

Cases train the tiny tied-embedding GPT (units: each block, then the root) ``STEPS`` AdamW
steps with ours and with torch's: mixed precision policies (bf16 with an fp32 and a bf16
reduce, and an fp16 reduce, whose divisions are split around the two collectives) and
gradient accumulation without sync. Then state dicts on the 2-D mesh, ``reshard_after_forward=2``
on a 1-D mesh of the 4 ranks, and the mesh errors.
"""

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from minifsdp import comm, fsdp2
from minifsdp.dist import dist_setup, finish
from minifsdp.fsdp2 import chunk_dim0
from minifsdp.models import GPT, GPTConfig
from minifsdp.parity import divergence_line, max_abs_diff, worst_divergence

info = dist_setup()
rank, N = info.rank, info.world_size
R, S = 2, N // 2
mesh = init_device_mesh(info.device.type, (R, S), mesh_dim_names=("replicate", "shard"))
STEPS, LOCAL = 3, 4
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
POLICIES = {
    "fp32": None,
    "bf16_fp32": {"param_dtype": bf16, "reduce_dtype": fp32},
    "bf16": {"param_dtype": bf16},  # reduce in bf16: AVG in both collectives
    "fp16_reduce": {"reduce_dtype": fp16},  # pre-divide 2, SUM, SUM, post-divide 2
}


def gpt() -> GPT:
    torch.manual_seed(0)
    with torch.device(info.device):
        return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32,
                             tie_embeddings=True))


def shard(model: GPT, impl: str, policy: dict | None = None) -> GPT:
    fully_shard, cls = ((fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy) if impl == "ours"
                        else (torch_fully_shard, TorchPolicy))
    kw = {} if policy is None else {"mp_policy": cls(**policy)}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of one micro-step."""
    g = torch.Generator().manual_seed(100 * step + micro)
    x, y = (torch.randint(0, 64, (N * LOCAL, 16), generator=g).chunk(N)[rank] for _ in range(2))
    return x.to(info.device), y.to(info.device)


def train(model: GPT, steps: int = STEPS, micro: int = 1, no_sync: bool = False,
          all_reduce_last: bool = False) -> list[float]:
    """no_sync: only the last micro-batch reduces; all_reduce_last: every micro-batch
    reduce-scatters, only the last all-reduces across replicas (Note [HSDP accumulation])."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        for m in range(micro):
            if no_sync:
                model.set_requires_gradient_sync(m == micro - 1)
            if all_reduce_last:
                model.set_requires_all_reduce(m == micro - 1)
            x, y = batch(step, m)
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            (loss / micro).backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def full(model: GPT) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().detach().clone() for k, v in model.named_parameters()}


def vs(ours: dict, theirs: dict, names: tuple[str, str] = ("ours", "torch")) -> str | None:
    """The first difference's line, None if bit for bit (Note [parity] in minifsdp/parity.py)."""
    return divergence_line(ours, theirs, names=names, where=f"rank {rank}")


def run_case(policy: dict | None, micro: int = 1, no_sync: bool = False,
             all_reduce_last: bool = False) -> dict:
    out = {}
    for impl in ("ours", "torch"):
        model = shard(gpt(), impl, policy)
        with comm.logging_comm() as log:
            losses = train(model, micro=micro, no_sync=no_sync, all_reduce_last=all_reduce_last)
        out[impl] = (losses, full(model))
        if impl == "ours":
            calls = [(c.op, c.group_size, str(c.dtype)) for c in log.comms()]
    return {"losses": {k: v[0] for k, v in out.items()},
            "vs_torch": vs(out["ours"][1], out["torch"][1]),
            "calls": sorted({c: calls.count(c) for c in set(calls)}.items())}


def state_dicts() -> dict:
    """Sharded state dicts carry the 2-D placements and communicate nothing; full ones equal
    torch's (DCP's full state dict of the torch model trained alike); both load back, and a
    loaded model trains on exactly like the one it was saved from."""
    ours, theirs = shard(gpt(), "ours"), shard(gpt(), "torch")
    train(ours)
    train(theirs)
    with comm.logging_comm() as log, CommDebugMode() as debug:
        sd = ours.state_dict()
    counts = [len(log.comms()), debug.get_total_counts()]
    full_ours = fsdp2.full_state_dict(ours)
    full_torch = get_model_state_dict(theirs, options=StateDictOptions(full_state_dict=True))
    local_rows = vs({k: v.to_local() for k, v in sd.items()},
                    {k: chunk_dim0(full_ours[k], S)[rank % S] for k in sd},
                    ("local rows", f"chunk {rank % S} of the full state dict"))
    saved = {k: v.detach().clone() for k, v in full_ours.items()}
    sharded = {k: v.detach().clone() for k, v in sd.items()}
    fresh = shard(gpt(), "ours")
    fsdp2.load_full_state_dict(fresh, saved)
    from_full = fsdp2.full_state_dict(fresh)
    fresh2 = shard(gpt(), "ours")
    fresh2.load_state_dict(sharded)
    from_sharded = fsdp2.full_state_dict(fresh2)
    after = {}
    for name, m in (("saved", ours), ("from_full", fresh), ("from_sharded", fresh2)):
        train(m, steps=1)
        after[name] = full(m)
    return {
        "comm_during_state_dict": counts,
        "placements": sorted({str(v.placements) for v in sd.values()}),
        # each the first difference's line, None if bit for bit
        "local_rows": local_rows,
        "full_vs_torch": vs(full_ours, {k: full_torch[k] for k in full_ours}),
        "same_keys_as_torch": sorted(full_ours) == sorted(full_torch),
        "full_round_trip": vs(from_full, saved, ("loaded", "saved")),
        "sharded_round_trip": vs(from_sharded, saved, ("loaded", "saved")),
        "trained_unlike": vs(after["from_full"], after["saved"], ("from full", "saved"))
        or vs(after["from_sharded"], after["saved"], ("from sharded", "saved")),
    }


def reshard_to_k() -> dict:
    """``reshard_after_forward=2`` on a 1-D mesh of 4 (Note [reshard to k ranks]): ours and
    torch's, each block a unit, AdamW, accumulation of 2 micro-batches; what a block keeps
    between forward and backward; the all-gathers' group sizes; and a k that does not divide."""
    flat = init_device_mesh(info.device.type, (N,))
    out = {}
    for impl, fully_shard in (("ours", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = gpt()
        for block in model.blocks:
            fully_shard(block, mesh=flat, reshard_after_forward=2)
        fully_shard(model, mesh=flat)
        with comm.logging_comm() as log:
            losses = train(model, micro=2)
        out[impl] = (losses, full(model))
        if impl == "ours":
            calls = [(c.op, c.group_size) for c in log.comms()]
            group = model.blocks[0]._fsdp_state.group
            x, _ = batch(0, 0)
            model(x)  # forward only: what block 0 keeps for its backward
            kept = {"state": group.sharded_state.name, "numel": group._post_forward_data.numel(),
                    "unsharded_numel": sum(p.numel() for p in model.blocks[0].parameters()),
                    "padded_unsharded_numel": sum(N * p.padded_shard_numel
                                                  for p in group.fsdp_params)}
            with comm.logging_comm() as again:  # a forward without backward in between:
                model(x)  # drop the piece, gather the (maybe stepped) shards over all ranks
            kept["second_forward_gathers"] = [c.group_size for c in again.comms()
                                              if c.tag.endswith("blocks.0")]
            kept["after_second_forward"] = group.sharded_state.name
    bad = gpt()
    try:
        fsdp2.fully_shard(bad.blocks[0], mesh=flat, reshard_after_forward=3)
        error = None
    except ValueError as e:
        error = str(e)
    return {"losses": {k: v[0] for k, v in out.items()},
            "vs_torch": vs(out["ours"][1], out["torch"][1]),
            "calls": sorted({c: calls.count(c) for c in set(calls)}.items()), "kept": kept,
            "error": error, "error_untouched": not isinstance(bad.blocks[0].ln1.weight, DTensor)}


def errors() -> dict:
    out = {}
    meshes = {
        "3d": lambda: init_device_mesh(info.device.type, (1, R, S), mesh_dim_names=("a", "b", "c")),
        "unnamed": lambda: init_device_mesh(info.device.type, (R, S)),
        "swapped": lambda: init_device_mesh(info.device.type, (R, S),
                                            mesh_dim_names=("shard", "replicate")),
    }
    for name, make in meshes.items():
        model = gpt()
        try:
            fsdp2.fully_shard(model, mesh=make())
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
        out[name + "_untouched"] = not isinstance(model.tok_emb.weight, DTensor)
    return out


def simple_fsdp_hsdp() -> dict:
    """SimpleFSDP's ``hybrid_shard`` mode (``minifsdp.simple_fsdp``, chapter 10) against torch's
    ``fully_shard`` on the same 2-D mesh: DTensor derives the gradient's reduce-scatter within
    a shard group and all-reduce across replicas from ``(Partial, Partial) -> (Replicate,
    Shard(0))``; its collectives come from the functional log (Note [functional collectives])."""
    from minifsdp.simple_fsdp import data_parallel, param_name
    ref = shard(gpt(), "torch")
    losses_ref, full_ref = train(ref), full(ref)
    out = {}
    for name, reshard in (("reshard", True), ("keep", False)):
        model = data_parallel(gpt(), mesh, "hybrid_shard", reshard_after_forward=reshard)
        with comm.logging_comm() as log, comm.FunctionalCollectives():
            losses = train(model)
        placements = {param_name(k): [str(p) for p in v.placements]
                      for k, v in model.named_parameters()}
        calls = [(c.op, c.group_size) for c in log.comms()]  # over STEPS steps
        grads = [c.op for c in log.comms() if c.op != "all_gather"][:2]  # the first gradient's
        mine = {param_name(k): v.full_tensor().detach().clone()
                for k, v in model.named_parameters()}
        worst = worst_divergence(mine, full_ref, names=(f"simple_fsdp {name}", "torch"),
                                 where=f"rank {rank}")
        out[name] = {"losses": losses, "ref_losses": losses_ref,
                     "max_diff": max_abs_diff(mine, full_ref),
                     # the largest difference's line, or None (the test holds it to a bound)
                     "worst": None if worst is None else str(worst),
                     "placements": sorted({str(v) for v in placements.values()}),
                     "first_gradient": grads,
                     "calls": sorted({c: calls.count(c) for c in set(calls)}.items())}
    return out


out = {
    "rank": rank, "world_size": N,
    "simple_fsdp": simple_fsdp_hsdp(),
    "cases": {name: run_case(p) for name, p in POLICIES.items()},
    "accumulate_no_sync": run_case(None, micro=2, no_sync=True),
    "accumulate_all_reduce_last": run_case(None, micro=2, all_reduce_last=True),
    "state_dict": state_dicts(),
    "reshard_to_k": reshard_to_k(),
    "errors": errors(),
}
finish(out)
