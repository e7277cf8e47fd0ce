"""Worker for tests/test_fsdp2_custom_comm.py: ``set_custom_all_gather`` /
``set_custom_reduce_scatter`` (Note [custom collectives] in minifsdp/fsdp2/custom_comm.py),
ours against torch's ``fully_shard`` with the same comm classes. Run at N = 2 and 3; reports
raw results, the test asserts on them.

The net is ``Pair`` (``pair_model.py``), one group per module: ``emb`` has 10
rows (4, 4, 2 at N = 3), ``head`` 4 (2, 2, 0 at N = 3: an empty shard). Every group but
``blocks.1``'s gets its own comm objects (set per module: the setters are not recursive, so
``blocks.1`` keeps the default and must never reach them), all appending to one log:

- ``SelfAllocAllGather`` allocates NaN-filled buffers itself (a slot FSDP failed to fill would
  poison the parameters), keeps every one (so a buffer FSDP freed under it shows), and
  all-gathers with ``torch.distributed`` directly;
- ``AllReduceSlice`` reduce-scatters as ``all_reduce`` of the input, then a copy of this
  rank's slot (on gloo the same sums as gloo's reduce-scatter, which is itself an all-reduce
  and a slice: the test pins that the results are also bitwise ours-default).

Each case trains 3 Adam steps and reports the first divergence (None: bit for bit) of losses,
sharded-then-gathered gradients and parameters, ours against torch's with the same comms; the
calls each side's comms saw, in order (allocate: size, dtype; call: numels, dtype, group
size, op); the ``async_op`` flags apart (ours issues prefetches asynchronously, torch in
streams: see the test); whether every kept buffer still has its bytes; ours with custom comms
against ours with the defaults; and what ``minifsdp.comm`` logged for ours. ``knob_case``
does the same for the built-in buffer settings (``comm_buffers.py``) without custom comms.
"""

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from pair_model import Pair
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from minifsdp import comm, fsdp2
from minifsdp.dist import dist_setup, finish
from minifsdp.parity import divergence_line

info = dist_setup()
rank, N = info.rank, info.world_size
mesh = init_device_mesh(info.device.type, (N,))
STEPS, LOCAL = 3, 4
AT = f"N = {N}, rank {rank}"
DEFAULT_ONLY = "blocks.1"  # keeps the default comms
# torch 2.14's names for all_gather_into_tensor (deprecated there), older ones' otherwise
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def records() -> dict[str, list]:
    """What a module's comms write down, shared by every module's: ``log`` (allocate: size,
    dtype; call: numels, dtype, group size), ``async`` (each all-gather's async_op), ``kept``
    (every buffer allocated, kept alive), ``groups`` (each call's kind and group_label)."""
    return {"log": [], "async": [], "kept": [], "groups": []}


class SelfAllocAllGather(fsdp2.AllGather):
    def __init__(self, name: str, rec: dict[str, list]):
        self.name, self.log, self.flags = name, rec["log"], rec["async"]
        self.kept, self.groups = rec["kept"], rec["groups"]

    def allocate(self, size, *, dtype, device):
        self.log.append(f"{self.name} AG allocate {tuple(size)} {dtype}")
        buf = torch.full(tuple(size), float("nan"), dtype=dtype, device=device)
        self.kept.append(buf)
        return buf

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.log.append(f"{self.name} AG {input_tensor.numel()} -> {output_tensor.numel()} "
                        f"{output_tensor.dtype} over {group.size()}")
        self.flags.append(async_op)
        self.groups.append(("AG", group_label(group)))
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class AllReduceSlice(fsdp2.ReduceScatter):
    def __init__(self, name: str, rec: dict[str, list]):
        self.name, self.log, self.kept, self.groups = name, rec["log"], rec["kept"], rec["groups"]

    def allocate(self, size, *, dtype, device):
        self.log.append(f"{self.name} RS allocate {tuple(size)} {dtype}")
        buf = torch.full(tuple(size), float("nan"), dtype=dtype, device=device)
        self.kept.append(buf)
        return buf

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.log.append(f"{self.name} RS {input_tensor.numel()} -> {output_tensor.numel()} "
                        f"{input_tensor.dtype} over {group.size()} op {op}")
        self.groups.append(("RS", group_label(group)))
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])


def group_label(group) -> str:
    """"mesh" for the mesh's own group; else the group's ranks and its id (to tell copies apart)."""
    if group is mesh.get_group():
        return "mesh"
    return f"copy {tuple(dist.get_process_group_ranks(group))} {id(group)}"


def make() -> Pair:
    torch.manual_seed(0)
    return Pair().to(info.device)


def shard(model: Pair, theirs: bool, policy: dict | None, custom: bool,
          separate: bool = False) -> dict:
    """Shard bottom-up; with ``custom``, give every module but ``DEFAULT_ONLY`` its comms;
    with ``separate``, ``set_separate_reduce_scatter_group()`` on the root (every module).
    Returns the comms' records."""
    fs = torch_fully_shard if theirs else fsdp2.fully_shard
    kw = {} if policy is None else {
        "mp_policy": (TorchPolicy if theirs else fsdp2.MixedPrecisionPolicy)(**policy)}
    for name in ("emb", "blocks.0", "blocks.1", "head", ""):
        fs(model.get_submodule(name), mesh=mesh, **kw)
    rec = records()
    if separate:
        model.set_separate_reduce_scatter_group()
    if custom:
        for name in ("emb", "blocks.0", "head", ""):  # the root's: not recursive
            m = model.get_submodule(name)
            m.set_custom_all_gather(SelfAllocAllGather(name or "root", rec))
            m.set_custom_reduce_scatter(AllReduceSlice(name or "root", rec))
    return rec


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(N * LOCAL, 8, generator=g), torch.randint(0, 4, (N * LOCAL,), generator=g)
    return x.chunk(N)[rank].to(info.device), y.chunk(N)[rank].to(info.device)


def full(tensors: dict) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in tensors.items()}


def train(model: nn.Module) -> dict:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = {"losses": [], "grads": [], "params": []}
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        out["losses"].append({"loss": loss.detach().clone().float()})
        out["grads"].append(full({k: p.grad for k, p in model.named_parameters()}))
        opt.step()
        opt.zero_grad()
        # set_post_optim_event (Note [post-optimizer event]) on both sides: it must change no bit
        event = torch.get_device_module(x.device).Event()
        event.record()
        model.set_post_optim_event(event)
        out["params"].append(full(dict(model.named_parameters())))
    return out


def first_divergence(a: dict, b: dict, names: tuple[str, str]) -> str | None:
    for step in range(STEPS):
        for what in ("losses", "grads", "params"):
            line = divergence_line(a[what][step], b[what][step], names=names,
                                   where=f"{AT}, step {step} {what}")
            if line is not None:
                return line
    return None


def case(policy: dict | None, separate: bool = False) -> dict:
    ours, theirs, plain = make(), make(), make()
    rec = {"ours": shard(ours, False, policy, True, separate),
           "torch": shard(theirs, True, policy, True, separate)}
    shard(plain, False, policy, False)
    with comm.logging_comm() as log:
        got = train(ours)
    logged = [f"{r.op} {r.tag}" for r in log.comms()]
    want, default = train(theirs), train(plain)
    return {
        "vs_torch": first_divergence(got, want, ("fsdp2", "torch")),
        "vs_default": first_divergence(got, default, ("custom", "default")),
        "calls": {k: v["log"] for k, v in rec.items()},
        "async": {k: v["async"] for k, v in rec.items()},
        "kept_alive": {k: all(b.untyped_storage().nbytes() == b.numel() * b.element_size()
                              for b in v["kept"]) for k, v in rec.items()},
        "logged": logged,
        "groups": {k: v["groups"] for k, v in rec.items()},
    }


def errors() -> dict:
    """What ours and torch's setters do with objects that are not comms, and ours with an
    ``allocate`` that returns the wrong size."""
    out = {}

    class NoAllocate:
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return None

    class WrongSize(SelfAllocAllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(size[0] + 1, dtype=dtype, device=device)

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except Exception as e:  # the type and first line
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    for side, fs in (("ours", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        model = make()
        fs(model.blocks[0], mesh=mesh)
        fs(model, mesh=mesh)
        attempt(f"{side}_no_allocate", lambda m=model: m.blocks[0].set_custom_all_gather(
            NoAllocate()))
        attempt(f"{side}_not_callable", lambda m=model: m.set_custom_reduce_scatter(object()))
        attempt(f"{side}_swapped", lambda m=model: m.set_custom_all_gather(
            AllReduceSlice("x", records())))
    model = make()
    fsdp2.fully_shard(model, mesh=mesh)
    model.set_custom_all_gather(WrongSize("root", records()))
    attempt("ours_wrong_size", lambda: model(batch(0)[0]))
    return out


def knob_case(knob: str) -> dict:
    """The built-in buffer settings (Note [comm buffers from the process group], Note
    [reduce-scatter inputs in flight] in minifsdp/fsdp2/comm_buffers.py) on both sides, fp32:
    ``pg_alloc``, every module's ``set_allocate_memory_from_process_group_for_comm(True)``
    (not recursive); ``max_buffers``, the root's ``set_reduce_scatter_max_input_buffers(2)``
    (recursive). Reports the divergences as ``case`` does, ours' comm classes, and at each of
    ours' reduce-scatter copy-ins how many earlier inputs still hold their bytes."""
    from minifsdp.fsdp2 import reduce

    models = {"ours": make(), "torch": make(), "plain": make()}
    for side, model in models.items():
        shard(model, side == "torch", None, False)
        if side == "plain":
            continue
        if knob == "pg_alloc":
            for m in model.modules():
                if hasattr(m, "set_allocate_memory_from_process_group_for_comm"):
                    m.set_allocate_memory_from_process_group_for_comm(True)
        else:
            model.set_reduce_scatter_max_input_buffers(2)
    inputs, alive = [], []
    allocate = reduce.allocate

    def spy(comm_, numel, dtype, device, what):
        buf = allocate(comm_, numel, dtype, device, what)
        if what.endswith("reduce-scatter input"):  # a strong reference: only a free empties it
            alive.append(sum(b.untyped_storage().nbytes() > 0 for b in inputs))
            inputs.append(buf)
        return buf

    reduce.allocate = spy
    try:
        got = train(models["ours"])
    finally:
        reduce.allocate = allocate
    want, default = train(models["torch"]), train(models["plain"])
    groups = [m.fsdp_state.group for m in models["ours"].modules()
              if hasattr(m, "fsdp_state") and m.fsdp_state.group is not None]
    return {"vs_torch": first_divergence(got, want, ("fsdp2", "torch")),
            "vs_default": first_divergence(got, default, (knob, "default")),
            "comms": sorted({f"{type(g.all_gather_comm).__name__} "
                             f"{type(g.reduce_scatter_comm).__name__}" for g in groups}),
            "caps": sorted({g.reduce_scatter_max_input_buffers for g in groups}),
            "alive_at_copy_in": alive}


out = {"rank": rank, "world_size": N, "fp32": case(None),
       "bf16": case({"param_dtype": torch.bfloat16}), "errors": errors()}
# set_separate_reduce_scatter_group (Note [a reduce-scatter group of its own]), where this
# torch has it (2.14; the GPU machine's 2.11 does not): the fp32 case again, on its own group
if hasattr(torch.distributed.fsdp.FSDPModule, "set_separate_reduce_scatter_group"):
    out["separate"] = case(None, separate=True)
# torch 2.14's buffer settings, where this torch has them (2.11 on the GPU machine has not)
if hasattr(torch.distributed.fsdp.FSDPModule, "set_reduce_scatter_max_input_buffers"):
    out["pg_alloc"], out["max_buffers"] = knob_case("pg_alloc"), knob_case("max_buffers")
finish(out)
