"""Worker for tests/test_fsdp2_float8.py: FP8 all-gather (``minifsdp/fsdp2/float8.py``) at
N = 2 and 3. Reports raw results; the test asserts on them.

Both N: ``minifsdp.demos.float8.run`` (fp32, bf16, fp8, fp8_bf16 with ours; the fp8 modes
also simulated in one process), 3 steps. N = 2: the same fp8 runs with torch's
``fully_shard`` calling the same two hooks (the oracle for the extension point). N = 3 (the
GPT's fc, proj and head weights are cut unevenly, so padding is quantized and gathered too):
the unsharded weights after one all-gather against ``quantize_dequantize`` of the full
weights.
"""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from minifsdp import comm, fsdp2
from minifsdp.demos import float8 as demo
from minifsdp.dist import dist_setup, finish
from minifsdp.fsdp2.extensions import OnTorch
from minifsdp.fsdp2.float8 import Float8Weight, quantize_dequantize
from minifsdp.parity import divergence_line
from minifsdp.train import loss_fn

info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
STEPS = 3


class TorchFloat8Weight(OnTorch):
    """``Float8Weight``'s two hooks on torch's ``fully_shard``, which calls them on the
    *unpadded* local shard: ``OnTorch`` pads it, then calls ``Float8Weight``'s."""

    ours = Float8Weight


def torch_run(mode: str) -> dict:
    """``demo.train_fsdp(mode)`` with torch's fully_shard and ``TorchFloat8Weight``."""
    torch.manual_seed(0)
    m = demo.GPT(demo.CFG)
    for mod in m.modules():
        if isinstance(mod, nn.Linear):
            mod.weight = nn.Parameter(TorchFloat8Weight(mod.weight.detach()))
    _, param_dtype, reduce_dtype = demo.MODES[mode]
    policy = TorchPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for block in m.blocks:
        torch_fully_shard(block, mesh=mesh, mp_policy=policy)
    torch_fully_shard(m, mesh=mesh, mp_policy=policy)
    opt = torch.optim.Adam(m.parameters(), lr=demo.LR)
    losses = []
    with comm.logging_comm() as log:
        for step in range(STEPS):
            x, y = (t.chunk(N)[rank] for t in demo.batch(step, N))
            loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    params = {k: v.full_tensor() for k, v in m.named_parameters()}
    params = {k: (v._t if isinstance(v, TorchFloat8Weight) else v) for k, v in params.items()}
    return {"losses": losses, "params": params, "amax_calls": len(log.comms("all_reduce"))}


out = demo.run(STEPS, list(demo.MODES) if N == 2 else ["fp8"], mesh, rank)
if N == 2:
    for mode in ("fp8", "fp8_bf16"):
        theirs = torch_run(mode)
        with comm.logging_comm() as log:
            ours = demo.train_fsdp(mode, STEPS, mesh, rank, track_step=None)
        out["runs"][mode]["torch"] = {  # where ours first differs from torch's, or None
            **{k: divergence_line(ours[k], theirs[k], where=f"rank {rank}")
               for k in ("losses", "params")},
            "amax_calls": [theirs["amax_calls"], len(log.comms("all_reduce"))]}
else:  # one all-gather over uneven shards: the unsharded weights vs the simulation's
    m = demo.model("fp8_bf16")
    policy = fsdp2.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in m.blocks:
        fsdp2.fully_shard(block, mesh=mesh, mp_policy=policy)
    fsdp2.fully_shard(m, mesh=mesh, mp_policy=policy)
    masters = {k: v.full_tensor() for k, v in m.named_parameters()}
    float8 = {k for k, v in m.named_parameters() if any(
        p.extension is not None and p.sharded_param is v
        for g in [m, *m.blocks] for p in g._fsdp_state.group.fsdp_params)}
    for unit in [m, *m.blocks]:
        unit.unshard()
    got = dict(m.named_parameters())
    out["unsharded_vs_sim"] = divergence_line(  # None: every one bit for bit
        {k: got[k] for k in masters},
        {k: quantize_dequantize(v, torch.bfloat16) if k in float8 else v.to(torch.bfloat16)
         for k, v in masters.items()}, names=("unsharded", "simulation"), where=f"rank {rank}")
    out["unsharded_compared"] = len(masters)
    out["float8_names"] = sorted(float8)
finish(out)
