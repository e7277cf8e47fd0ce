"""Prefetching in ``minifsdp.fsdp2`` (``minifsdp/fsdp2/prefetch.py``): the order of the
collectives per configuration and against torch's ``fully_shard``, bitwise parity with
prefetching on and off and with torch, the memory it costs, and its errors.

Two launches of ``tests/workers/fsdp2_prefetch_worker.py`` (gloo, CPU): N = 2 (order, parity,
memory) and N = 3 (order and parity with uneven rows: d_model 32 over 3 ranks). The worker
trains a 3-block GPT (units: each block, then the root with the embeddings and the head)
three steps per configuration and reports the last step's events in time order:

    AG g   all-gather of group g issued        W g    waited for (the copy-out follows)
    RS g   reduce-scatter of group g           F g    g's forward starts

The in-process tests at the end use a world of one (``cpu_mesh`` in conftest.py), where an
unshard issues no all-gather (Note [a shard group of one rank]): they count the copy-ins, one
per unshard issued, instead.
"""

import argparse
import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from jobs import Job, fixture_of

from minifsdp import parity
from minifsdp.fsdp2 import FSDPModule, ShardedState, UnshardHandle, fully_shard
from minifsdp.fsdp2.fsdp_param_group import FSDPParamGroup
from minifsdp.models import GPT, GPTConfig
from minifsdp.train import STRATEGIES, parse_args

PARALLEL = 2
WORKER = str(Path(__file__).parent / "workers" / "fsdp2_prefetch_worker.py")
WORLDS = {2: ("order", "memory"), 3: ("order",)}


# the worker at each N with what it checks there, run in runs/tests/fsdp2_prefetch_worker_2, _3
WORKERS = {n: Job(f"worker_{n}", WORKER, n, checks) for n, checks in WORLDS.items()}


@fixture_of(*WORKERS.values())
def worker(launched) -> dict[int, list[dict]]:
    return {n: launched[job].result().ranks for n, job in WORKERS.items()}


# ---- order -------------------------------------------------------------------------------------

B0, B1, B2 = "blocks.0", "blocks.1", "blocks.2"
# forward: the root (embeddings), then the blocks; the root keeps its parameters after forward
FORWARD = {
    # each all-gather issued just in time, waited for at once
    "none": ["AG root", "W root", "F root",
             f"AG {B0}", f"W {B0}", f"F {B0}",
             f"AG {B1}", f"W {B1}", f"F {B1}",
             f"AG {B2}", f"W {B2}", f"F {B2}"],
    # the next group's all-gather issued before this group computes: it overlaps F
    "prefetch": ["AG root", "W root", f"AG {B0}", "F root",
                 f"W {B0}", f"AG {B1}", f"F {B0}",
                 f"W {B1}", f"AG {B2}", f"F {B1}",
                 f"W {B2}", f"F {B2}"],
}
# backward: the root's pre-backward (on the logits), then the blocks in reverse; the root's
# reduce-scatter last (its embeddings' gradients come last)
BACKWARD = {
    "none": [f"AG {B2}", f"W {B2}", f"RS {B2}",
             f"AG {B1}", f"W {B1}", f"RS {B1}",
             f"AG {B0}", f"W {B0}", f"RS {B0}", "RS root"],
    # the next group's all-gather issued before this group's backward (and reduce-scatter)
    "prefetch": [f"AG {B2}", f"W {B2}", f"AG {B1}", f"RS {B2}",
                 f"W {B1}", f"AG {B0}", f"RS {B1}",
                 f"W {B0}", f"RS {B0}", "RS root"],
}
EXPECTED = {  # configuration: (forward, backward)
    "none": ("none", "none"),
    "implicit_backward": ("none", "prefetch"),  # the default, torch's
    "implicit_forward": ("prefetch", "prefetch"),
    "explicit": ("prefetch", "prefetch"),  # one unit ahead: train.set_prefetch
    "torch": ("none", "prefetch"),
    "torch_explicit": ("prefetch", "prefetch"),
}


@pytest.mark.parametrize("config", EXPECTED)
def test_order_of_collectives(worker, config):
    """The last step's all-gathers, waits, reduce-scatters and forwards, on every rank at
    N = 2 and 3. Implicit forward prefetching guesses from the previous step's forward, so
    from step 2 on it issues exactly what the explicit lists do."""
    fwd, bwd = EXPECTED[config]
    for ranks in worker.values():
        for r in ranks:
            assert r["runs"][config]["events"] == FORWARD[fwd] + BACKWARD[bwd], (
                r["world_size"], r["rank"])


def test_default_order_is_torch_fully_shards(worker):
    """Measured, not only expected: our default (implicit backward) issues and waits exactly
    where torch 2.14's ``fully_shard`` does, and our explicit lists like torch's same lists."""
    for ranks in worker.values():
        for r in ranks:
            runs = r["runs"]
            assert runs["implicit_backward"]["events"] == runs["torch"]["events"]
            assert runs["explicit"]["events"] == runs["torch_explicit"]["events"]


# ---- parity ------------------------------------------------------------------------------------

def test_prefetching_changes_no_bit(worker):
    """Prefetching moves *when* the all-gathers run, never what they carry or how gradients are
    summed: losses and final parameters bitwise equal in every configuration, ours and
    torch's, at N = 2 and 3 (uneven rows at 3)."""
    for n, ranks in worker.items():
        for r in ranks:
            losses = r["runs"]["torch"]["losses"]
            assert len(losses) == 3
            for config, run in r["runs"].items():
                assert run["losses"] == losses, (n, config)
                assert run["vs_torch"] is None and run["max_diff_torch"] == 0.0, (
                    n, config, run["vs_torch"])


# ---- memory ------------------------------------------------------------------------------------

# Measured (N = 2, 4 units of Linear(256, 256), U = 263,168 B; every rank, every run): the
# attributed peak (all but "other") is 1,455,624 B without prefetching and 1,587,208 B with
# (backward, or forward + backward): +131,584 B = U/2. Not a full U: without prefetching the
# peak is the *last* unit's reduce-scatter, where the most sharded gradients exist; with it,
# the peak moves one unit earlier, where a prefetched buffer (+U) is in flight but one unit's
# sharded gradients (U/2) are not yet there. The *total* peak also holds gloo's temporaries,
# which its thread frees when it likes: without prefetching 1,583,112 B in most runs but
# 1,722,888 B (the usual prefetching peak) in some, with prefetching 1,722,888 to 1,858,568 B,
# all on a loaded machine. So the test compares what is deterministic (Note [prefetch memory]).
def test_prefetch_holds_two_groups_at_once(worker):
    """Note [prefetch memory]: each prefetch is issued while the current group is unsharded,
    so for a while one group's unsharded parameters (``params`` = shards + U) and the next
    group's all-gather buffer (``comm`` = U) coexist -- never without prefetching. The
    step's attributed peak grows, by at most one group (U), and ``comm`` reaches twice U:
    the reduce-scatter input *and* a prefetched buffer."""
    for r in worker[2]:
        mem = r["memory"]
        none, U, Ps = mem["none"], mem["none"]["U"], mem["none"]["Ps"]
        assert none["moments"] == []
        assert none["comm_max"] == U
        for config in ("backward", "forward_backward"):
            m = mem[config]
            moments = m["moments"]
            # forward prefetching adds the forward's three moments to backward's three
            assert len(moments) == (3 if config == "backward" else 6), config
            for moment in moments:
                assert moment["params"] == Ps + U and moment["comm"] == U, moment
                assert len(moment["unsharded"]) == 1
            assert 0 < m["attributed_peak"] - none["attributed_peak"] <= U, config
            assert m["comm_max"] == 2 * U, config


# ---- in process: a world of one ----------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh(cpu_mesh):
    return cpu_mesh


class Stack(nn.Sequential):
    """Units ``0``, ``2``, ``4`` (Linear) and ``spare``, which forward never runs."""

    def __init__(self):
        super().__init__(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 2))
        self.spare = nn.Linear(8, 8)

    def forward(self, x):
        return self[4](self[3](self[2](self[1](self[0](x)))))


def stack(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = Stack()
    for m in (model[0], model[2], model[4], model.spare):
        fully_shard(m, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@contextlib.contextmanager
def issued():
    """The names of the groups whose unshard was issued inside the block, in order: each issue
    is one all-gather copy-in (over one rank, the only trace of it)."""
    names, copy_in = [], FSDPParamGroup._all_gather_copy_in

    def spy(self):
        names.append(self.name)
        return copy_in(self)

    FSDPParamGroup._all_gather_copy_in = spy
    try:
        yield names
    finally:
        FSDPParamGroup._all_gather_copy_in = copy_in


def test_unshard_async_returns_a_handle_and_is_idempotent(mesh):
    """``FSDPModule.unshard(async_op=True)`` issues and returns an ``UnshardHandle``; issuing
    again is a no-op, ``wait()`` finishes it (twice is harmless), and a forward uses the
    gathered parameters instead of all-gathering again."""
    model = stack(mesh)
    model(torch.randn(2, 4)).sum().backward()  # lazy init: the groups have their names
    group = model[2].fsdp_state.group
    w = model[2].weight.full_tensor()
    with issued() as names:
        handle = model[2].unshard(async_op=True)
        assert isinstance(handle, UnshardHandle)
        assert group.sharded_state is ShardedState.SHARDED and group._in_flight is not None
        model[2].unshard(async_op=True)
        handle.wait()
        handle.wait()
        assert group.sharded_state is ShardedState.UNSHARDED and group._in_flight is None
        assert torch.equal(model[2].weight, w)
        assert model[2].unshard() is None  # already unsharded: nothing to do
    assert names == [group.name]
    model.reshard()
    model[2].reshard()
    with issued() as names:
        model[0].unshard(async_op=True)  # prefetch the first unit before the forward
        model(torch.randn(2, 4)).sum().backward()
    # the prefetch (no second in forward) + backward's
    assert names.count(model[0].fsdp_state.group.name) == 2


def test_mistargeted_prefetches_are_discarded(mesh):
    """Note [mistargeted prefetches]: ``spare`` never runs. Prefetched in forward it is
    discarded at the end of the forward, in backward at the end of backward; ``reshard()``
    discards one too. Gradients are right, and no group is left with a stale buffer."""
    model, ref = stack(mesh), stack(mesh)
    model.set_modules_to_forward_prefetch([model.spare])
    model[2].set_modules_to_backward_prefetch([model.spare])
    x = torch.randn(3, 4)
    with issued() as names:
        out = model(x)
        spare = model.spare.fsdp_state.group
        assert spare._in_flight is None and spare.sharded_state is ShardedState.SHARDED
        out.square().sum().backward()
    assert spare._in_flight is None and spare.sharded_state is ShardedState.SHARDED
    assert names.count(spare.name) == 2
    ref(x).square().sum().backward()
    parity.assert_bitwise({k: p.grad.full_tensor() for k, p in model.named_parameters()
                           if not k.startswith("spare")},
                          {k: q.grad.full_tensor() for k, q in ref.named_parameters()
                           if not k.startswith("spare")}, names=("prefetched", "no prefetch"))
    model.spare.unshard(async_op=True)
    model.spare.reshard()
    assert spare._in_flight is None and spare.sharded_state is ShardedState.SHARDED


def test_implicit_prefetch_switches(mesh):
    """``set_implicit_prefetch`` (minifsdp only) sets every state below, or one."""
    model = stack(mesh)
    states = [m.fsdp_state for m in model.modules() if isinstance(m, FSDPModule)]
    assert all(not s.implicit_forward_prefetch and s.implicit_backward_prefetch for s in states)
    model.set_implicit_prefetch(forward=True, backward=False)
    assert all(s.implicit_forward_prefetch and not s.implicit_backward_prefetch for s in states)
    model[0].set_implicit_prefetch(forward=False, recurse=False)
    assert not model[0].fsdp_state.implicit_forward_prefetch
    assert model.fsdp_state.implicit_forward_prefetch


def test_prefetch_list_errors(mesh):
    model = stack(mesh)
    with pytest.raises(ValueError, match=r"modules\[1\] is a Tanh, not an FSDPModule"):
        model[0].set_modules_to_forward_prefetch([model[2], model[3]])
    with pytest.raises(TypeError, match="takes a list of modules.*wrap it in a list"):
        model[2].set_modules_to_backward_prefetch(model[0])
    model.set_modules_to_forward_prefetch(nn.ModuleList([model[0]]))  # a ModuleList is a list
    assert model.fsdp_state.forward_prefetch == [model[0].fsdp_state]


def small_gpt_args(*flags) -> argparse.Namespace:
    return parse_args(["--model", "gpt", "--n-layer", "3", "--d-model", "16", "--n-head", "2",
                       "--seq-len", "8", *flags])


@pytest.mark.parametrize("strategy", ["fsdp2", "torch_fsdp2"])
def test_train_explicit_flags_set_one_unit_ahead(mesh, strategy):
    """``--forward-prefetch explicit --backward-prefetch explicit``: forward root -> block 0
    -> 1 -> 2, backward root -> block 2 -> 1 -> 0, on ours and on torch's modules alike."""
    args = small_gpt_args("--strategy", strategy, "--forward-prefetch", "explicit",
                          "--backward-prefetch", "explicit")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=3, n_head=2, d_model=16))
    model = STRATEGIES[strategy](model, SimpleNamespace(device=torch.device("cpu"),
                                                        world_size=1), args)
    if strategy == "fsdp2":
        fwd = lambda m: m.fsdp_state.forward_prefetch
        bwd = lambda m: m.fsdp_state.backward_prefetch
        state = lambda m: m.fsdp_state
        assert not model.fsdp_state.implicit_backward_prefetch
    else:
        fwd = lambda m: m._get_fsdp_state()._states_to_forward_prefetch
        bwd = lambda m: m._get_fsdp_state()._states_to_backward_prefetch
        state = lambda m: m._get_fsdp_state()
    b = list(model.blocks)
    assert [fwd(m) for m in (model, *b)] == [[state(b[0])], [state(b[1])], [state(b[2])], []]
    assert [bwd(m) for m in (model, *b)] == [[state(b[2])], [], [state(b[0])], [state(b[1])]]


@pytest.mark.parametrize("flags,message", [
    (("--strategy", "torch_fsdp2", "--forward-prefetch", "implicit"), "has no such switch"),
    (("--strategy", "torch_fsdp2", "--backward-prefetch", "none"), "always prefetches"),
    (("--strategy", "ddp", "--forward-prefetch", "explicit"), "fsdp2 and torch_fsdp2 only"),
])
def test_train_refuses_what_the_strategy_cannot_do(flags, message, capsys):
    with pytest.raises(SystemExit):
        small_gpt_args(*flags)
    assert message in capsys.readouterr().err
