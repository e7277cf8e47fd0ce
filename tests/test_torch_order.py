"""``minifsdp.torch_order``: torch's private FSDP names it patches exist on the installed torch,
a moved one is a loud error naming it, and real FSDP1 and FSDP2 runs record the known order
(in this process at N = 1, and a torchrun job at N = 2, where FSDP1 shards).
Note [recording torch's collective order]."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from minifsdp import torch_order
from minifsdp.launch import torchrun
from minifsdp.torch_order import PATCHED, READ, Recorder, TorchNamesMoved

WORKER = str(Path(__file__).parent / "workers" / "torch_order_worker.py")
PAIRS = [(api, module, path) for api, pairs in PATCHED.items() for module, path in pairs]

# One step after the first, for the worker's model (root: inp and head; units blocks.0 and
# blocks.1), forward then backward. FSDP2 gathers the root once (it keeps it) and by default
# prefetches the next unit's all-gather in backward; FSDP1 (F: a unit's forward starts, its
# all-gather follows inside it) without prefetch gathers each unit just in time.
FSDP2 = ["AG root", "W root", "AG blocks.0", "W blocks.0", "AG blocks.1", "W blocks.1",
         "AG blocks.1", "W blocks.1", "AG blocks.0", "RS blocks.1", "W blocks.0",
         "RS blocks.0", "RS root"]
FSDP1_FORWARD = ["F (root)", "AG (root)", "F blocks.0", "AG blocks.0", "F blocks.1",
                 "AG blocks.1"]
EXPECTED = {
    "fsdp2": FSDP2,
    "fsdp1_none": FSDP1_FORWARD + ["AG blocks.1", "RS blocks.1", "AG blocks.0", "RS blocks.0",
                                   "RS (root)"],
    "fsdp1_backward_pre": FSDP1_FORWARD + ["AG blocks.1", "AG blocks.0", "RS blocks.1",
                                           "RS blocks.0", "RS (root)"],
    "fsdp1_no_shard": ["F (root)", "F blocks.0", "F blocks.1", "AR blocks.1", "AR blocks.0",
                       "AR (root)"],
}


@pytest.mark.parametrize("api,module,path", PAIRS, ids=[f"{a}:{p}" for a, _, p in PAIRS])
def test_every_patched_name_exists_on_this_torch(api, module, path):
    owner, name, value = torch_order.resolve(module, path)
    assert callable(value), f"torch {torch.__version__}: {module}.{path} is not a function"


@pytest.mark.parametrize("api,module,path", PAIRS, ids=[f"{a}:{p}" for a, _, p in PAIRS])
def test_a_moved_name_fails_loudly_naming_it_and_torchs_version(monkeypatch, api, module, path):
    owner, name, _ = torch_order.resolve(module, path)
    monkeypatch.delattr(owner, name)
    with pytest.raises(TorchNamesMoved) as err:
        Recorder(api)
    assert f"{module}.{path}" in str(err.value) and torch.__version__ in str(err.value)


def test_a_moved_module_or_attribute_read_at_run_time_is_named(monkeypatch, cpu_mesh):
    missing = "torch.distributed.fsdp._no_such_module"
    monkeypatch.setitem(PATCHED, "fsdp2", ((missing, "unshard"),))
    with pytest.raises(TorchNamesMoved, match=missing.replace(".", r"\.")):
        Recorder("fsdp2")
    monkeypatch.undo()
    model = _fsdp2_net(cpu_mesh)
    step(model)  # lazy initialization names the groups
    order = Recorder("fsdp2")
    monkeypatch.delattr(model.blocks[0]._get_fsdp_state()._fsdp_param_group, "_all_gather_result")
    with pytest.raises(TorchNamesMoved, match=r"FSDPParamGroup\._all_gather_result"):
        with order.record():
            model(torch.randn(4, 8)).sum().backward()
    assert not order.recording  # and the patches are gone:
    _assert_unpatched()


def test_a_wrong_api_and_two_recorders_at_once_are_errors():
    with pytest.raises(ValueError, match="fsdp1"):
        Recorder("fsdp3")
    with pytest.raises(ValueError, match="FSDP1"):
        Recorder("fsdp2").watch(nn.Linear(2, 2))
    with Recorder("fsdp2").record(), pytest.raises(RuntimeError, match="one at a time"):
        with Recorder("fsdp2").record():
            pass


def test_fsdp2_records_the_known_order_only_while_recording(cpu_mesh):
    model = _fsdp2_net(cpu_mesh)
    group = model.blocks[0]._get_fsdp_state()._fsdp_param_group
    assert all(hasattr(group, name) for name in READ["fsdp2"]), READ["fsdp2"]
    order = Recorder("fsdp2")
    for name, m in [("root", model), ("blocks.0", model.blocks[0])]:
        m.register_forward_pre_hook(lambda *_, name=name: order.mark("forward", name))
    step(model)  # lazy initialization, unrecorded
    with order.record() as events:
        step(model)
    # N = 1 issues no real all-gather, but torch's group takes the same path (an all-gather
    # result set, waited for): the order is N = 2's (test_two_ranks_record_the_known_order)
    assert [e.short for e in events if e.op != "forward"] == FSDP2
    assert [e.short for e in events][:4] == ["AG root", "W root", "F root", "AG blocks.0"]
    assert [e.t for e in events] == sorted(e.t for e in events)
    _assert_unpatched()
    n = len(events)
    step(model)
    order.mark("forward", "root")
    assert len(events) == n  # nothing recorded outside record()


def test_fsdp1_records_the_known_order_and_names_unwatched_units(one_rank):
    order = Recorder("fsdp1")
    with order.record(), pytest.raises(RuntimeError, match=r"watch\(model\)"):
        step(_fsdp1_net())
    _assert_unpatched()
    model = _fsdp1_net()
    units = order.watch(model)
    assert list(units) == ["(root)", "blocks.0", "blocks.1"]
    assert all(hasattr(m, name) for m in units.values() for name in READ["fsdp1"])
    with order.record() as events:
        step(model)
    # N = 1: torch runs FSDP1 as NO_SHARD, whose reduction is an all-reduce, in backward order
    assert [e.short for e in events] == ["AR blocks.1", "AR blocks.0", "AR (root)"]
    _assert_unpatched()


def test_two_ranks_record_the_known_order():
    run = torchrun(WORKER, nproc=2, chapter="tests", name="torch_order")
    for r in run.ranks:
        assert r["events"] == EXPECTED, f"rank {r['rank']}"


# ---- helpers -------------------------------------------------------------------------------

_ORIGINAL = {(m, p): torch_order.resolve(m, p)[2] for _, m, p in PAIRS}


def _assert_unpatched() -> None:
    for (module, path), original in _ORIGINAL.items():
        assert torch_order.resolve(module, path)[2] is original, f"{module}.{path} still patched"


class _Block(nn.Module):  # the worker's model (tests/workers/torch_order_worker.py)
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(8, 8), nn.Sequential(_Block(), _Block()), \
            nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def _fsdp2_net(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = _Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp1_net() -> nn.Module:
    torch.manual_seed(0)
    return TorchFSDP(_Net(), device_id=torch.device("cpu"),
                     auto_wrap_policy=ModuleWrapPolicy({_Block}))


def step(model: nn.Module) -> None:
    model(torch.randn(4, 8)).square().sum().backward()
