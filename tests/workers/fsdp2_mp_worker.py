"""Worker for tests/test_fsdp2_mixed_precision.py: ``minifsdp.fsdp2`` with a
``MixedPrecisionPolicy`` next to torch's ``fully_shard`` with the same policy. Run at N = 2
and N = 3; reports raw numbers, the test asserts on them.

Each case trains a fresh, identically seeded model for ``STEPS`` Adam steps (lr 1e-2, so the
fp32 master weights really move) with ours and with torch's, units as ``minifsdp.train``
makes them (each GPT block / CNN layer, then the root), and returns the final full
parameters' distance, the losses, and per run the all-gather / reduce-scatter records of the
comm log. The tiny tied-embedding GPT at every N, the MNIST CNN (on random images of MNIST's
shape) at N = 2 only (its 1.2M parameters make it the slow one).
"""

import contextlib

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from minifsdp import comm, fsdp2
from minifsdp.dist import dist_setup, finish
from minifsdp.memory import MemoryTracker
from minifsdp.models import GPT, GPTConfig, MnistCNN
from minifsdp.parity import divergence_line, max_abs_diff
from minifsdp.train import loss_fn, parse_args, shard_bottom_up, shard_units

info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
STEPS, LOCAL = 3, 4
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
POLICIES = {
    "none": None,  # no mp_policy argument at all
    "default": {},  # MixedPrecisionPolicy()
    "fp32": {"param_dtype": fp32, "reduce_dtype": fp32, "output_dtype": fp32},
    "bf16_fp32": {"param_dtype": bf16, "reduce_dtype": fp32},
    "bf16": {"param_dtype": bf16},  # reduce_dtype None: reduce in bf16
    "bf16_fp32_out": {"param_dtype": bf16, "reduce_dtype": fp32, "output_dtype": fp32},
    "fp16": {"param_dtype": fp16},  # SUM between a pre- and a post-division
}
FLAGS = ["--strategy", "fsdp2", "--param-dtype", "bf16", "--reduce-dtype", "fp32",
         "--output-dtype", "fp32"]


def model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(info.device):
        if name == "cnn":
            return MnistCNN(dropout=0.0)
        return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=4, d_model=32,
                             tie_embeddings=True))


def shard(m: torch.nn.Module, impl: str, policy: str) -> torch.nn.Module:
    """Policy ``"flags"``: as ``minifsdp.train`` builds it from ``FLAGS`` (its wiring).
    ``output_dtype`` on the root only: on a block it would cast the block's output, the
    next block's input, to fp32 -- and the bf16 root layers after the blocks would refuse it
    (torch's the same); the root's inputs are cast at its entry, not in its middle."""
    fully_shard, cls = ((fsdp2.fully_shard, fsdp2.MixedPrecisionPolicy) if impl == "ours"
                        else (torch_fully_shard, TorchPolicy))
    if policy == "flags":
        return shard_bottom_up(fully_shard, m, info, parse_args(FLAGS), cls)
    kw = POLICIES[policy]
    unit_kw = {} if kw is None else {"mp_policy": cls(**{**kw, "output_dtype": None})}
    for unit in shard_units(m):
        fully_shard(unit, mesh=mesh, **unit_kw)
    return fully_shard(m, mesh=mesh, **({} if kw is None else {"mp_policy": cls(**kw)}))


def batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch of ``step``."""
    g = torch.Generator().manual_seed(step)
    if name == "cnn":
        x, y = torch.randn(N * LOCAL, 1, 28, 28, generator=g), torch.randint(0, 10, (N * LOCAL,),
                                                                             generator=g)
    else:
        x, y = (torch.randint(0, 64, (N * LOCAL, 16), generator=g) for _ in range(2))
    return x.chunk(N)[rank].to(info.device), y.chunk(N)[rank].to(info.device)


def train(name: str, impl: str, policy: str, micro: int = 1, track: bool = False) -> dict:
    """STEPS steps; ``micro`` > 1: gradient accumulation without sync (only the last
    micro-batch's backward reduce-scatters). ``track``: MemoryTracker on step 2."""
    m = shard(model(name), impl, policy)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses, memory, out_dtype = [], None, None
    with comm.logging_comm() as log:
        for step in range(STEPS):
            x, y = batch(name, step)
            tracker = MemoryTracker(m, opt) if track and step == 1 else None
            with tracker or contextlib.nullcontext():
                for k, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
                    if micro > 1:
                        m.set_requires_gradient_sync(k == micro - 1)
                    out = m(xs)
                    out_dtype = str(out.dtype)
                    loss = loss_fn(out, ys)
                    (loss / micro).backward()
                    losses.append(loss.item())
                opt.step()
                opt.zero_grad()
            if tracker:
                tl = tracker.timeline
                memory = {"peak": tracker.peak, **{c: max(s[c] for s in tl) for c in
                                                   ("params", "grads", "comm")},
                          "params_at_rest": tl[-1]["params"], "optimizer": tl[-1]["optimizer"]}
    calls = [{k: r.__dict__[k] for k in ("op", "bytes", "dtype", "tag")} for r in log.comms()]
    params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
              for k, v in m.named_parameters()}
    return {"losses": losses, "params": params, "comm": calls, "memory": memory,
            "out_dtype": out_dtype,
            "param_dtypes": sorted({str(p.dtype) for p in m.parameters()})}


def compare(name: str, policy: str, micro: int = 1, track: bool = False,
            ref: dict | None = None) -> tuple[dict, dict]:
    """Ours vs torch with one policy. Returns (summary, our run); ``divergence`` is the first
    difference's line, None if bit for bit (Note [parity] in minifsdp/parity.py)."""
    ours, theirs = (train(name, impl, policy, micro, track) for impl in ("ours", "torch"))
    line = divergence_line(ours["params"], theirs["params"],
                           where=f"N = {N}, rank {rank}, {name}/{policy}, micro {micro}")
    summary = {
        "bitwise": line is None, "divergence": line,
        "max_abs_diff": max_abs_diff(ours["params"], theirs["params"]),
        "losses": {"ours": ours["losses"], "torch": theirs["losses"]},
        "comm": ours["comm"],
        "memory": ours["memory"], "out_dtype": ours["out_dtype"],
        "param_dtypes": ours["param_dtypes"],
    }
    if ref is not None:  # how far this precision drifts from fp32 training
        summary["vs_fp32"] = max_abs_diff(ours["params"], ref["params"])
    return summary, ours


out = {"rank": rank, "world_size": N, "cases": {}}
models = ["gpt", "cnn"] if N == 2 else ["gpt"]
for name in models:
    cases = out["cases"]
    none = train(name, "ours", "none", track=name == "gpt")
    # (a) no policy, the default policy and an all-fp32 policy: the same run, bit for bit
    for policy in ("default", "fp32"):
        run = train(name, "ours", policy)
        line = divergence_line(run["params"], none["params"], names=(policy, "no policy"),
                               where=f"N = {N}, rank {rank}, {name}")
        cases[f"{name}/{policy}_vs_none"] = {
            "bitwise": line is None, "divergence": line,
            "losses_equal": run["losses"] == none["losses"], "comm_equal": run["comm"] == none[
                "comm"]}
    cases[f"{name}/none"] = {"comm": none["comm"], "memory": none["memory"]}
    # (b), (c), fp16, output_dtype: ours vs torch with the same policy
    for policy in ("bf16_fp32", "bf16", "fp16", "bf16_fp32_out"):
        if name == "cnn" and policy in ("fp16", "bf16_fp32_out"):
            continue  # the GPT covers them; the CNN is the slow model
        cases[f"{name}/{policy}"], _ = compare(name, policy, track=name == "gpt", ref=none)
    if name == "gpt":  # accumulation without sync: in fp32 (reduce_dtype) or in bf16
        for policy in ("bf16_fp32", "bf16"):
            cases[f"{name}/{policy}/no_sync"], _ = compare(name, policy, micro=2)
        cases[f"{name}/flags"], _ = compare(name, "flags")
finish(out)
