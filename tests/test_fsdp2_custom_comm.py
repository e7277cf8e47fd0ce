"""``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter`` (Note [custom
collectives] in ``minifsdp/fsdp2/custom_comm.py``): ours against torch's ``fully_shard`` with
the same comm classes.

Two launches, ``tests/workers/fsdp2_custom_comm_worker.py`` at N = 2 and 3 (uneven rows, an
empty shard at 3; fp32 and a bf16 ``MixedPrecisionPolicy``): an all-gather that allocates
NaN-filled buffers itself and a reduce-scatter built from ``all_reduce`` and a slice, set on
every module but one; then the built-in buffer settings (``comm_buffers.py``: the process
group's allocator, a cap on reduce-scatter inputs in flight) on both sides. The in-process
tests at the end use a world of one.
"""

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from jobs import Job, fixture_of

from minifsdp.fsdp2 import AllGather, ReduceScatter, fully_shard
from minifsdp.fsdp2.custom_comm import DefaultAllGather, DefaultReduceScatter

PARALLEL = 2
WORKER = str(Path(__file__).parent / "workers" / "fsdp2_custom_comm_worker.py")
WORKERS = {n: Job(f"worker_{n}", WORKER, n) for n in (2, 3)}
# torch 2.14's names (the old ones are deprecated there); older releases' otherwise
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
CASES = ("fp32", "bf16")
STEPS = 3


@fixture_of(*WORKERS.values())
def worker(launched) -> dict[int, list[dict]]:
    return {n: launched[job].result().ranks for n, job in WORKERS.items()}


def every(worker):
    """``(where, case)`` for every rank, N and case (``separate``: fp32 again, with
    ``set_separate_reduce_scatter_group``, where the worker's torch has it)."""
    return [(f"N = {n}, rank {r['rank']}, {c}", r[c]) for n, ranks in worker.items()
            for r in ranks for c in (*CASES, "separate") if c in r]


def test_worker_custom_comms_train_bitwise_like_torch(worker):
    """Losses, gradients and parameters of 3 Adam steps equal torch's with the same comms, bit
    for bit, in fp32 and bf16; and equal ours with the default comms (on gloo a reduce-scatter
    *is* an all-reduce and a slice: ``minifsdp.comm``'s Note [bytes vs wire bytes])."""
    for where, case in every(worker):
        assert case["vs_torch"] is None, f"{where}: {case['vs_torch']}"
        assert case["vs_default"] is None, f"{where}: {case['vs_default']}"


def test_worker_custom_comms_see_torchs_calls(worker):
    """Each comm sees what torch's fully_shard asks of it, in order: allocate(N S) then the
    all-gather of S into N S; allocate(N S) (the reduce-scatter input), allocate(S) (the
    output), then the reduce-scatter with the same op; the dtypes bf16 under the policy. The
    root's reduce-scatter is the one known move: ours when its last gradient is in, torch's
    at the end of backward (Note [when is a group's backward over?]), so it is compared
    apart. ``blocks.1`` kept the defaults (the setters are not recursive, even on the root)."""
    not_root_rs = lambda calls: [c for c in calls if not c.startswith("root RS")]  # noqa: E731
    for where, case in every(worker):
        ours, theirs = case["calls"]["ours"], case["calls"]["torch"]
        assert not_root_rs(ours) == not_root_rs(theirs), where
        assert sorted(ours) == sorted(theirs), where
        assert not any(c.startswith("blocks.1") for c in ours + theirs), where
        n = int(where.split()[2].rstrip(","))
        dtype = "torch.bfloat16" if where.endswith("bf16") else "torch.float32"
        groups = ("emb", "blocks.0", "head", "root")
        for g in groups:
            gathers = [c for c in ours if c.startswith(f"{g} AG ") and "allocate" not in c]
            # forward, and backward for all but the root (kept unsharded after forward)
            assert len(gathers) == STEPS * (1 if g == "root" else 2), (where, g, gathers)
            for c in gathers:
                slot = int(c.split()[2])
                assert c == f"{g} AG {slot} -> {n * slot} {dtype} over {n}", (where, c)
            scatters = [c for c in ours if c.startswith(f"{g} RS ")]
            assert len(scatters) == 3 * STEPS, (where, g, scatters)
            for alloc_in, alloc_out, call in zip(*[iter(scatters)] * 3):
                slot = int(alloc_out.split("(")[1].split(",")[0])
                assert (alloc_in, alloc_out, call) == (
                    f"{g} RS allocate ({n * slot},) {dtype}", f"{g} RS allocate ({slot},) {dtype}",
                    f"{g} RS {n * slot} -> {slot} {dtype} over {n} op RedOpType.AVG"), where
        head_slot = 22  # at N = 3 the head's rows are 2, 2, 0: padded to 2 rows + 2 of bias
        assert n != 3 or f"head AG {head_slot} -> 66 {dtype} over 3" in ours, where


def test_worker_custom_buffers_are_never_freed_under_the_comm(worker):
    """A custom comm's buffers are its own: every one it handed out still has all its bytes
    after 3 steps, ours as torch's (ours frees its default buffers with resize_(0))."""
    for where, case in every(worker):
        assert case["kept_alive"] == {"ours": True, "torch": True}, where


def test_worker_async_op_is_ours_issue_and_wait(worker):
    """The one argument that differs: ours issues backward prefetches with ``async_op=True``
    and waits later (Note [issue and wait] in prefetch.py); torch passes ``False`` and
    overlaps with its all-gather stream. The two prefetched groups here (``blocks.0``, from
    ``blocks.1``'s pre-backward, and ``emb``) make 2 a step."""
    for where, case in every(worker):
        ours, theirs = case["async"]["ours"], case["async"]["torch"]
        assert len(ours) == len(theirs) and not any(theirs), where
        assert sum(ours) == 2 * STEPS, (where, ours)


def test_worker_comm_log_records_only_what_goes_through_minifsdp_comm(worker):
    """The custom comms call ``torch.distributed`` directly, so ``minifsdp.comm`` logs only
    ``blocks.1``'s default collectives (Note [custom collectives], logging): per step its
    forward and backward all-gathers and its reduce-scatter, under the group's tag."""
    for where, case in every(worker):
        assert case["logged"] == STEPS * ["all_gather fsdp2 params blocks.1",
                                          "all_gather fsdp2 params blocks.1",
                                          "reduce_scatter fsdp2 grads blocks.1"], where


def test_worker_separate_reduce_scatter_group_is_a_copy_of_the_shard_group(worker):
    """``set_separate_reduce_scatter_group()`` (Note [a reduce-scatter group of its own]):
    every group's reduce-scatter runs over one new group with the shard group's ranks, its
    all-gathers still over the mesh's, ours as torch's, and the run stays bitwise torch's and
    ours-default (the other tests cover the ``separate`` case too). Without it, both reduce
    over the mesh's group."""
    if not all("separate" in r for ranks in worker.values() for r in ranks):
        pytest.skip("this torch has no FSDPModule.set_separate_reduce_scatter_group (2.14 has)")
    for n, ranks in worker.items():
        for r in ranks:
            for side in ("ours", "torch"):
                for c in CASES:
                    assert {g for _, g in r[c]["groups"][side]} == {"mesh"}, (n, c, side)
                groups = r["separate"]["groups"][side]
                assert {g for op, g in groups if op == "AG"} == {"mesh"}, (n, side)
                rs = {g for op, g in groups if op == "RS"}
                assert len(rs) == 1 and next(iter(rs)).startswith(
                    f"copy {tuple(range(n))} "), (n, side, rs)


def test_separate_reduce_scatter_group_can_be_turned_off(cpu_mesh):
    """``False`` puts every group back on the shard group; ``True`` twice keeps one copy."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0], mesh=cpu_mesh)
    fully_shard(model, mesh=cpu_mesh)
    groups = [m.fsdp_state.group for m in (model[0], model)]
    model.set_separate_reduce_scatter_group()
    first = groups[0].reduce_scatter_group
    assert first is not groups[0].process_group and all(
        g.reduce_scatter_group is first for g in groups)
    model.set_separate_reduce_scatter_group()
    assert all(g.reduce_scatter_group is first for g in groups)
    model.set_separate_reduce_scatter_group(False)
    assert all(g.reduce_scatter_group is g.process_group for g in groups)


def test_worker_bad_comms_are_refused_by_name(worker):
    """Ours refuses an object without ``allocate``, one that is not callable, and a
    reduce-scatter given as an all-gather, naming the module, the method and what is missing;
    torch's accepts all three silently (they would fail at the first collective). An
    ``allocate`` of the wrong size fails at the first forward, naming the comm and group."""
    for ranks in worker.values():
        for r in ranks:
            e = r["errors"]
            assert e["torch_no_allocate"] is e["torch_not_callable"] is e["torch_swapped"] is None
            assert e["ours_no_allocate"].startswith(
                "TypeError: Linear.set_custom_all_gather: NoAllocate has no method allocate()")
            assert e["ours_not_callable"].startswith(
                "TypeError: Pair.set_custom_reduce_scatter: object has no method allocate()")
            assert e["ours_swapped"].startswith(
                "TypeError: Pair.set_custom_all_gather: AllReduceSlice.__call__() cannot be "
                "called as FSDP calls it (missing a required argument: 'op')"), e
            assert e["ours_wrong_size"].startswith(
                "ValueError: WrongSize.allocate for root's all-gather returned"), e


# ---- in process: a world of one -----------------------------------------------------------------

class Kept(AllGather):
    """One buffer per size, handed out again on every call (a persistent buffer)."""

    def __init__(self):
        self.bufs: dict = {}
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return self.bufs.setdefault((tuple(size), dtype), torch.empty(*size, dtype=dtype,
                                                                      device=device))

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return all_gather_single(output_tensor, input_tensor, group, async_op=async_op)


class Counted(ReduceScatter):
    def __init__(self):
        self.calls = self.allocations = 0

    def allocate(self, size, *, dtype, device):
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return reduce_scatter_single(output_tensor, input_tensor, op, group)


def model_of(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    fully_shard(model[0], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_defaults_and_not_recursive(cpu_mesh):
    model = model_of(cpu_mesh)
    group, child = model.fsdp_state.group, model[0].fsdp_state.group
    assert type(group.all_gather_comm) is DefaultAllGather
    assert type(group.reduce_scatter_comm) is DefaultReduceScatter
    ag, rs = Kept(), Counted()
    model.set_custom_all_gather(ag)
    model.set_custom_reduce_scatter(rs)
    assert (group.all_gather_comm, group.reduce_scatter_comm) == (ag, rs)
    assert type(child.all_gather_comm) is DefaultAllGather  # the child's are untouched
    assert type(child.reduce_scatter_comm) is DefaultReduceScatter


def test_a_persistent_buffer_survives_and_is_reused(cpu_mesh):
    """A comm that hands out the same buffer every time: ours must not free it (it would have
    0 bytes at the second forward, and the copy-in would fail); the results match a model
    with the default comms. Over one rank the comms allocate but are never called (Note [a
    shard group of one rank]; test_one_rank_calls_no_custom_comm_as_torch)."""
    model, plain = model_of(cpu_mesh), model_of(cpu_mesh)
    ag, rs = Kept(), Counted()
    model.set_custom_all_gather(ag)
    model.set_custom_reduce_scatter(rs)
    x = torch.randn(5, 4)
    for _ in range(2):
        for m in (model, plain):
            m(x).sum().backward()
    (buf,) = ag.bufs.values()
    assert buf.untyped_storage().nbytes() == buf.numel() * buf.element_size() > 0
    assert (ag.calls, rs.calls, rs.allocations) == (0, 0, 4)  # input and output, 2 steps
    for (k, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), k


def test_one_rank_calls_no_custom_comm_as_torch(cpu_mesh):
    """Note [a shard group of one rank]: over a world of one, torch 2.14's ``fully_shard`` calls
    neither comm (its ``unshard`` and ``foreach_reduce`` skip the collective), and neither do
    ours; both still take the reduce-scatter's buffers from its ``allocate``, and the
    gradients are the same bits."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minifsdp.parity import assert_bitwise

    grads, comms = {}, {}
    for name, fs in (("ours", fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        fs(model[0], mesh=cpu_mesh)
        fs(model, mesh=cpu_mesh)
        comms[name] = Kept(), Counted()
        model.set_custom_all_gather(comms[name][0])
        model.set_custom_reduce_scatter(comms[name][1])
        for step in range(2):
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
        grads[name] = {k: p.grad.full_tensor() for k, p in model.named_parameters()}
    for name, (ag, rs) in comms.items():
        assert (ag.calls, rs.calls) == (0, 0), name
    assert comms["ours"][1].allocations == comms["torch"][1].allocations > 0
    assert_bitwise(grads["ours"], grads["torch"], names=("fsdp2", "torch"))


def test_post_optim_event_is_waited_once_and_changes_no_bit(cpu_mesh, monkeypatch):
    """set_post_optim_event (Note [post-optimizer event]): the root's next forward makes a
    stream wait on the event and drops it, as torch's does (torch: its two all-gather streams;
    ours: the current one); ours and torch's train the same bits with an event each step (a
    world of one: the event orders streams, it carries no values)."""
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minifsdp import fsdp2
    from minifsdp.parity import assert_bitwise

    waited = []
    wait_event = torch.cpu.Stream.wait_event
    monkeypatch.setattr(torch.cpu.Stream, "wait_event",
                        lambda self, event: (waited.append(event), wait_event(self, event))[1])
    runs, models = {}, {}
    for name, fs in (("ours", fsdp2.fully_shard), ("torch", torch_fully_shard)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        fs(model[0], mesh=cpu_mesh)
        fs(model, mesh=cpu_mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses, events = [], []
        waited.clear()
        for step in range(4):
            if step < 3:  # step 3 sets none: the last event must not be waited on again
                events.append(torch.cpu.Event())
                events[-1].record()
                model.set_post_optim_event(events[-1])
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            loss = F.mse_loss(model(x), torch.zeros(4, 3))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        runs[name] = (losses, {k: v.full_tensor() for k, v in model.state_dict().items()})
        models[name] = model
        times = [sum(w is e for w in waited) for e in events]  # torch also waits on its own
        assert times == {"ours": [1, 1, 1], "torch": [2, 2, 2]}[name], name  # torch: 2 streams
    for ours, theirs in zip(runs["ours"], runs["torch"]):  # the losses, then the parameters
        assert_bitwise(ours, theirs, names=("fsdp2", "torch"))
    with pytest.raises(TypeError, match="set_post_optim_event: expected an event"):
        models["ours"].set_post_optim_event(object())  # torch takes anything


# ---- the built-in buffer settings (Note [comm buffers from the process group], Note [symmetric
# memory], Note [reduce-scatter inputs in flight] in minifsdp/fsdp2/comm_buffers.py) -------------

def knob_cases(worker) -> list[tuple[str, str, dict]]:
    cases = [(f"N = {n}, rank {r['rank']}", k, r[k]) for n, ranks in worker.items()
             for r in ranks for k in ("pg_alloc", "max_buffers") if k in r]
    if not cases:
        pytest.skip("this torch has no set_reduce_scatter_max_input_buffers (2.14 has)")
    return cases


def test_worker_buffer_settings_train_bitwise_like_torch_and_the_defaults(worker):
    """Buffers from the process group (gloo has no allocator: torch.empty's, as the
    defaults') and a cap of 2 reduce-scatter inputs: 3 Adam steps equal torch's with the same
    setting and ours without it, bit for bit, at N = 2 and 3."""
    for where, knob, case in knob_cases(worker):
        assert case["vs_torch"] is None, f"{where}, {knob}: {case['vs_torch']}"
        assert case["vs_default"] is None, f"{where}, {knob}: {case['vs_default']}"


def test_worker_buffer_settings_reach_every_group(worker):
    """Every group's comms are the process group's after the per-module calls; the cap,
    set on the root (recursive), is every group's; the other setting's groups keep the
    defaults."""
    for where, knob, case in knob_cases(worker):
        if knob == "pg_alloc":
            assert case["comms"] == ["ProcessGroupAllocAllGather ProcessGroupAllocReduceScatter"]
            assert case["caps"] == [1], where
        else:
            assert case["comms"] == ["DefaultAllGather DefaultReduceScatter"], where
            assert case["caps"] == [2], where


def test_worker_no_reduce_scatter_input_outlives_its_collective(worker):
    """Ours keeps no input in flight (the cap always holds): at every copy-in, each earlier
    input has already lost its bytes -- with the cap at 2, and with the process group's
    buffers, which gloo makes plain (so FSDP frees them at once, as the defaults'). 5 groups'
    reduce-scatters a step, 3 steps."""
    for where, knob, case in knob_cases(worker):
        assert case["alive_at_copy_in"] == [0] * 15, (where, knob, case["alive_at_copy_in"])


def test_process_group_buffers_switch_on_and_off_and_refuse_a_custom_comm(cpu_mesh):
    """This module's group only (as torch's); ``False`` restores the defaults; after a custom
    comm, ours refuses naming the group and the comm, as torch's refuses (an AssertionError
    there)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minifsdp.fsdp2.comm_buffers import (
        ProcessGroupAllocAllGather,
        ProcessGroupAllocReduceScatter,
    )

    model = model_of(cpu_mesh)
    group, child = model.fsdp_state.group, model[0].fsdp_state.group
    model.set_allocate_memory_from_process_group_for_comm(True)
    assert type(group.all_gather_comm) is ProcessGroupAllocAllGather
    assert type(group.reduce_scatter_comm) is ProcessGroupAllocReduceScatter
    assert type(child.all_gather_comm) is DefaultAllGather
    model(torch.randn(3, 4)).sum().backward()  # a world of one: plain buffers, freed by us
    assert group.all_gather_comm.plain_buffers and group.reduce_scatter_comm.plain_buffers
    model.set_allocate_memory_from_process_group_for_comm(False)
    assert type(group.all_gather_comm) is DefaultAllGather
    model.set_custom_all_gather(Kept())
    with pytest.raises(RuntimeError, match=r"^root\.set_allocate_memory_from_process_group_for_comm"
                       r": this group's all-gather is a custom comm, Kept"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    assert type(group.all_gather_comm) is Kept  # unchanged
    torch.manual_seed(0)
    theirs = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    torch_fully_shard(theirs, mesh=cpu_mesh)
    theirs.set_custom_all_gather(Kept())
    with pytest.raises(AssertionError, match="all gather comm is custom: Kept"):
        theirs.set_allocate_memory_from_process_group_for_comm(True)


def test_symmetric_memory_is_refused_off_cuda_by_name(cpu_mesh):
    """Symmetric memory needs CUDA and NCCL: on a gloo CPU mesh ours refuses at the call,
    naming the module (torch 2.14 accepts it and fails at the first forward with N > 1); so
    is a backend torch does not know. Nothing changed."""
    model = model_of(cpu_mesh)
    with pytest.raises(ValueError, match=r"^Sequential\.set_symm_mem_for_comm: symmetric "
                       r"memory is GPU memory .* on cpu and it communicates over gloo"):
        model.set_symm_mem_for_comm()
    with pytest.raises(ValueError, match=r"backend='NVSHMEM'; torch 2.14 supports only"):
        model.set_symm_mem_for_comm("NVSHMEM")
    assert type(model.fsdp_state.group.all_gather_comm) is DefaultAllGather


@pytest.mark.parametrize("bad", [True, 1.5, "2", 0, -1])
def test_max_input_buffers_refuses_what_torch_refuses(cpu_mesh, bad):
    """The same exception type and message as torch 2.14.1 (``True`` is not 1)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    torch_fully_shard(theirs, mesh=cpu_mesh)
    with pytest.raises(Exception) as want:
        theirs.set_reduce_scatter_max_input_buffers(bad)
    with pytest.raises(type(want.value)) as got:
        model_of(cpu_mesh).set_reduce_scatter_max_input_buffers(bad)
    assert str(got.value) == str(want.value)


def test_max_input_buffers_recurses_as_torchs(cpu_mesh):
    """``recurse=True`` sets every group below the module, ``False`` its own, as torch's
    (compared attribute for attribute on the same model)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    def caps(model, theirs):
        return [(m.fsdp_state.group if not theirs else m._get_fsdp_state()._fsdp_param_group
                 ).reduce_scatter_max_input_buffers for m in (model[0], model)]

    ours = model_of(cpu_mesh)
    theirs = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    torch_fully_shard(theirs[0], mesh=cpu_mesh)
    torch_fully_shard(theirs, mesh=cpu_mesh)
    for model, is_torch in ((ours, False), (theirs, True)):
        model.set_reduce_scatter_max_input_buffers(3, recurse=False)
        assert caps(model, is_torch) == [1, 3], is_torch
        model.set_reduce_scatter_max_input_buffers(2)
        assert caps(model, is_torch) == [2, 2], is_torch
