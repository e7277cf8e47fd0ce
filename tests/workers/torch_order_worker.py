"""Worker for tests/test_torch_order.py: ``minifsdp.torch_order`` records torch's FSDP1 and
FSDP2 collectives at N = 2, where FSDP1 shards (at N = 1 torch runs it as NO_SHARD).

A root with a Linear of its own before and after two units (``blocks.0``, ``blocks.1``), two
steps; per configuration the second step's events as ``Event.short`` strings, with ``F u``
where unit u's forward starts (a forward pre-hook on FSDP1's wrapper).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        tests/workers/torch_order_worker.py
"""

import contextlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from minifsdp import torch_order
from minifsdp.dist import dist_setup, finish

info = dist_setup()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Net(nn.Module):
    """Parameters in the root before and after the units: the first unit's input needs a
    gradient, so every unit's reduction runs from its own backward hook."""

    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(8, 8), nn.Sequential(Block(), Block()), \
            nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def second_step(model: nn.Module, order: torch_order.Recorder) -> list[str]:
    """Step 0 unrecorded (lazy initialization, the first iteration's bookkeeping); step 1's
    events."""
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + info.rank))
        with order.record() if step == 1 else contextlib.nullcontext() as events:
            model(x).square().sum().backward()
    return [e.short for e in events]


def fsdp1(**kw) -> list[str]:
    torch.manual_seed(0)
    model = FSDP(Net(), device_id=info.device, auto_wrap_policy=ModuleWrapPolicy({Block}), **kw)
    order = torch_order.Recorder("fsdp1")
    for unit, m in order.watch(model).items():
        m.register_forward_pre_hook(lambda *_, u=unit: order.mark("forward", u))
    return second_step(model, order)


def fsdp2() -> list[str]:
    torch.manual_seed(0)
    model, mesh = Net(), init_device_mesh(info.device.type, (info.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return second_step(model, torch_order.Recorder("fsdp2"))


finish({"rank": info.rank, "world_size": info.world_size, "events": {
    "fsdp2": fsdp2(),
    "fsdp1_none": fsdp1(backward_prefetch=None),
    "fsdp1_backward_pre": fsdp1(backward_prefetch=BackwardPrefetch.BACKWARD_PRE),
    "fsdp1_no_shard": fsdp1(sharding_strategy=ShardingStrategy.NO_SHARD),
}})
