"""Multi-GPU readiness without a GPU: the CUDA/NCCL path as far as a CPU machine can check it.

Nothing here needs CUDA (this machine has none). Three guards:

1. ``dist_setup`` gives every local rank its own device, ``cuda:LOCAL_RANK`` (never the global
   rank, never two ranks on one GPU), and refuses a rank without a GPU -- checked with CUDA
   and the process-group call faked.
2. No code path hard-codes a device or a backend: every literal ``"cpu"`` / ``"cuda..."`` used
   as a device, every ``.cuda()`` / ``.cpu()`` and every branch on ``"gloo"`` in the package
   is listed below with the reason it is right on GPUs too; a new one fails until it is
   reviewed and listed.
3. ``python -m minifsdp.gpucheck``, the check a reader with a GPU runs, works: on CPU it runs
   the same jobs on gloo, finds every pair bitwise equal and says the CUDA parts were skipped.
"""

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minifsdp import dist as mdist

PACKAGE = Path(__file__).resolve().parent.parent / "minifsdp"


# ---- 1. one GPU per local rank ------------------------------------------------------------------

@pytest.fixture
def fake_cuda(monkeypatch):
    """Two visible GPUs, and a process group that only records how it was created."""
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.update(backend=backend, **kw))
    monkeypatch.setattr(mdist, "_install_stack_dumps", lambda: None)
    monkeypatch.delenv("MINIFSDP_BACKEND", raising=False)
    monkeypatch.delenv("MINIFSDP_EXPECT_WORLD_SIZE", raising=False)
    return calls


def _as_rank(monkeypatch, rank, local_rank, world, local_world=None):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world or world))


@pytest.mark.parametrize("rank, local_rank", [(0, 0), (1, 1), (2, 0), (3, 1)])
def test_each_local_rank_gets_its_own_gpu(fake_cuda, monkeypatch, rank, local_rank):
    # 2 nodes x 2 GPUs: global ranks 2, 3 are local ranks 0, 1 of the second node
    _as_rank(monkeypatch, rank, local_rank, world=4, local_world=2)
    info = mdist.dist_setup()
    assert info.backend == "nccl" and fake_cuda["backend"] == "nccl"
    assert info.device == torch.device("cuda", local_rank)
    assert fake_cuda["set_device"] == info.device and fake_cuda["device_id"] == info.device


def test_more_ranks_than_gpus_run_on_cpu_with_gloo(fake_cuda, monkeypatch, capsys):
    # --nproc-per-node 3 on a 2-GPU node, run by hand: the rule picks gloo and rank 0 says so
    _as_rank(monkeypatch, 0, 0, world=3)
    monkeypatch.delenv("MINIFSDP_LAUNCHER", raising=False)
    info = mdist.dist_setup()
    assert (info.backend, info.device) == ("gloo", torch.device("cpu"))
    assert fake_cuda["backend"] == "gloo" and "device_id" not in fake_cuda
    assert "set_device" not in fake_cuda  # no rank touches a GPU
    assert capsys.readouterr().out == ("3 ranks, 2 GPUs: this job runs on CPU with gloo "
                                       "(NCCL needs a GPU per rank)\n")


def test_nccl_forced_without_a_gpu_per_rank_is_refused(fake_cuda, monkeypatch):
    _as_rank(monkeypatch, 2, 2, world=3)  # --nproc-per-node 3 on a 2-GPU node
    monkeypatch.setenv("MINIFSDP_BACKEND", "nccl")
    with pytest.raises(RuntimeError, match=r"MINIFSDP_BACKEND=nccl with 3 local ranks, but 2 "
                                           r"GPU\(s\) are visible"):
        mdist.dist_setup()
    assert "backend" not in fake_cuda  # refused before any process group exists


def test_a_local_rank_beyond_the_gpus_is_refused(fake_cuda, monkeypatch):
    # a launcher that lies about LOCAL_WORLD_SIZE still cannot put rank 2 on a missing GPU
    _as_rank(monkeypatch, 2, 2, world=3, local_world=2)
    with pytest.raises(RuntimeError, match=r"local rank 2 has no GPU: 2 visible"):
        mdist.dist_setup()
    assert "backend" not in fake_cuda


# (local ranks, visible GPUs, MINIFSDP_BACKEND) -> (backend, the job's line)
RULE = [
    (2, 0, "", "gloo", "2 ranks, no GPU: this job runs on CPU with gloo"),
    (1, 1, "", "nccl", "1 rank, 1 GPU: this job runs on NCCL on cuda:0"),
    (2, 1, "", "gloo", "2 ranks, 1 GPU: this job runs on CPU with gloo (NCCL needs a GPU per "
                       "rank)"),
    (4, 1, "", "gloo", "4 ranks, 1 GPU: this job runs on CPU with gloo (NCCL needs a GPU per "
                       "rank)"),
    (4, 4, "", "nccl", "4 ranks, 4 GPUs: this job runs on NCCL, rank r on cuda:r"),
    (2, 8, "", "nccl", "2 ranks, 8 GPUs: this job runs on NCCL, rank r on cuda:r"),
    (4, 4, "gloo", "gloo", "4 ranks, 4 GPUs: this job runs on CPU with gloo "
                           "(MINIFSDP_BACKEND=gloo)"),
]


@pytest.mark.parametrize("ranks, gpus, override, backend, line", RULE)
def test_the_backend_rule(ranks, gpus, override, backend, line):
    choice = mdist.choose_backend(ranks, gpus=gpus, override=override)
    assert (choice.backend, choice.line) == (backend, line)
    assert choice.device_type == ("cuda" if backend == "nccl" else "cpu")


@pytest.mark.parametrize("gpus, ranks, backend", [(1, 2, "gloo"), (4, 4, "nccl"), (0, 1, "gloo")])
def test_the_launcher_applies_the_rule_once_and_hands_it_to_the_workers(
        monkeypatch, tmp_path, gpus, ranks, backend):
    from minifsdp import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.delenv("MINIFSDP_BACKEND", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    choice = launch._choice(ranks, None)
    env = launch._worker_env(tmp_path, None, None, choice)
    assert choice.backend == env["MINIFSDP_BACKEND"] == backend
    # a CPU job's workers see no GPU (no CUDA context per rank on the one card); NCCL's do
    assert (env.get("CUDA_VISIBLE_DEVICES") == "") == (backend == "gloo")
    assert env["MINIFSDP_LAUNCHER"] == "1"  # progress as protocol lines, for the launcher
    # a job's own env wins over the machine's rule (tests and labs pin gloo this way)
    assert launch._choice(ranks, {"MINIFSDP_BACKEND": "gloo"}).backend == "gloo"


def test_simulated_nodes_get_gpus_of_their_own(monkeypatch):
    from minifsdp import launch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [launch._gpu_slice(i, 2) for i in range(2)] == ["0,1", "2,3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert [launch._gpu_slice(i, 1) for i in range(2)] == ["3", "5"]


@pytest.mark.parametrize("affinity, count, says", [({0, 1}, 64, "2 CPU cores"),
                                                    ({3}, 64, "1 CPU core,"),
                                                    (None, 8, "8 CPU cores"),
                                                    (None, None, "CPU cores unknown")])
def test_the_machine_line_counts_the_cores_this_process_may_use(monkeypatch, affinity, count,
                                                                 says):
    monkeypatch.setattr(mdist, "visible_gpus", lambda: 0)
    monkeypatch.delenv("MINIFSDP_BACKEND", raising=False)
    if affinity is None:  # as on macOS and Windows: no sched_getaffinity
        monkeypatch.delattr(mdist.os, "sched_getaffinity", raising=False)
    else:
        monkeypatch.setattr(mdist.os, "sched_getaffinity", lambda pid: affinity, raising=False)
    monkeypatch.setattr(mdist.os, "cpu_count", lambda: count)
    line = mdist.describe_machine()
    assert says in line and line.endswith("no GPU: every job runs on CPU with gloo"), line


def test_a_bad_backend_name_is_refused():
    with pytest.raises(ValueError, match=r"MINIFSDP_BACKEND='mpi': expected one of gloo, nccl"):
        mdist.choose_backend(2, gpus=0, override="mpi")


def test_progress_is_protocol_for_the_launcher_and_words_for_a_person(monkeypatch, capsys):
    monkeypatch.setenv("MINIFSDP_LAUNCHER", "1")
    mdist.report_progress(3, 20, loss=2.5)
    assert capsys.readouterr().out == '@minifsdp-progress {"step": 3, "total": 20, "loss": 2.5}\n'
    monkeypatch.delenv("MINIFSDP_LAUNCHER")
    for step in range(1, 21):
        mdist.report_progress(step, 20, loss=1 / step)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "step 1/20 (5%) loss=1" and out[-1] == "step 20/20 (100%) loss=0.05"
    assert len(out) == 11 and not any("@minifsdp" in line for line in out)  # about every 10%


def test_stack_dumps_are_skipped_where_the_os_has_no_sigusr1(monkeypatch):
    import signal

    monkeypatch.delattr(signal, "SIGUSR1")  # as on Windows
    monkeypatch.setattr(mdist.faulthandler, "register",
                        lambda *a, **k: pytest.fail("registered a signal Windows lacks"))
    mdist._install_stack_dumps()


def test_gloo_on_a_gpu_machine_keeps_tensors_on_the_cpu(fake_cuda, monkeypatch):
    _as_rank(monkeypatch, 1, 1, world=2)
    monkeypatch.setenv("MINIFSDP_BACKEND", "gloo")
    info = mdist.dist_setup()
    assert (info.backend, info.device) == ("gloo", torch.device("cpu"))


# ---- 2. no hard-coded device or backend --------------------------------------------------------

# (file, the line's code) -> why it is right on GPUs too
REVIEWED = {
    ("dist.py", 'device = torch.device("cuda", local_rank)'):
        "the one place a rank's device is chosen: LOCAL_RANK, after choose_backend said NCCL",
    ("dist.py", 'device = torch.device("cpu")'): "gloo means CPU tensors, whatever is visible",
    ("dist.py", 'elif self.backend == "gloo" and self.gpus:'):
        "the words of BackendChoice.line: why a job on a GPU machine runs on CPU",
    ("serial_collectives.py", 'if dist.get_backend(_resolve_process_group(name)) == "gloo":'):
        "the gloo-only serialization of compiled graphs (a torch 2.14 gloo bug); NCCL graphs "
        "run as planned",
    ("fsdp1/flat_param.py", 'shard = shard.to("cpu", copy=True) if offload else shard.clone() '
                            'if sharded else shard'): "CPUOffload: the shard lives in host memory",
    ("fsdp1/fully_sharded.py", 'return {_clean(k): v.detach().to("cpu", copy=True) '
                               'for k, v in sd.items()}'):
        "a full state dict is gathered to host memory, as torch's offload_to_cpu",
    ("fsdp2/fsdp_param.py", 'return torch.device("cpu")'):
        "mesh_device: a CPU mesh's device; a GPU mesh gets its current device (torch's "
        "_get_device_from_mesh)",
    ("fsdp2/fsdp_param.py", 'padded = padded.cpu()'):
        "CPUOffloadPolicy: the sharded parameter lives in host memory (Note [FSDP2 CPU offload])",
    ("fsdp2/fsdp_param.py", 'grad = grad.to(torch.device("cpu"), non_blocking=non_blocking)'):
        "CPUOffloadPolicy: the reduced gradient is copied back to host memory, as torch's "
        "foreach_reduce",
    ("fsdp2/mixed_precision.py", 'if device_type != "cpu" and backend != "gloo":  # NCCL (or '
                                 'another accelerator backend)'):
        "gloo's dtype limits are checked on gloo only; NCCL takes bf16/fp16/fp8",
    ("labs/report.py", 'g, e = got.detach().cpu(), expected.detach().cpu()'):
        "a lab compares bits in host memory, whatever device produced them",
    ("probes.py", 'return {k: v.detach().cpu() for k, v in sd.items()}'):
        "full parameters for parity checks: saved and compared on any machine",
}


def _device_literals(path: Path) -> list[str]:
    """Lines that use a device or backend literal: ``torch.device("cpu")``, ``.to("cuda")``,
    ``"cuda:0"``, ``.cuda()`` / ``.cpu()``, ``device="..."``, ``init_device_mesh("...")``, a
    comparison with ``"gloo"``. Type checks such as ``t.device.type == "cuda"`` are fine."""
    src = path.read_text()
    lines, hits = src.splitlines(), set()
    literal = lambda n: isinstance(n, ast.Constant) and isinstance(n.value, str) and (
        n.value in ("cpu", "cuda") or n.value.startswith("cuda:"))
    for node in ast.walk(ast.parse(src)):
        line = None
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
                node.func, "id", "")
            if name in ("cuda", "cpu") and not node.args:
                line = node.lineno
            if name in ("device", "to", "init_device_mesh") and node.args and literal(
                    node.args[0]):
                line = node.lineno
            if any(k.arg == "device" and literal(k.value) for k in node.keywords):
                line = node.lineno
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                node.value.startswith("cuda:"):
            line = node.lineno
        elif isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == "gloo" for c in node.comparators):
            line = node.lineno
        if line is not None:
            hits.add(lines[line - 1].strip())
    return sorted(hits)


def test_every_device_or_backend_literal_is_reviewed():
    found = {(str(f.relative_to(PACKAGE)), code) for f in sorted(PACKAGE.rglob("*.py"))
             for code in _device_literals(f)}
    new = sorted(found - REVIEWED.keys())
    assert not new, (
        "device or backend hard-coded (use info.device / the tensor's own device), or a "
        "gloo-only branch; if it is right on GPUs too, add it to REVIEWED with the reason:\n"
        + "\n".join(f"  minifsdp/{f}: {code}" for f, code in new))
    assert not REVIEWED.keys() - found, "REVIEWED lists code that is gone: remove it"


def test_the_scan_catches_what_it_should(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('import torch\nx = torch.zeros(3).cuda()\ny = torch.ones(2, device="cuda")\n'
                   'z = x.to("cuda:0")\nif backend == "gloo":\n    pass\n'
                   'ok = x.device.type == "cuda"\n')
    assert _device_literals(bad) == ['if backend == "gloo":', 'x = torch.zeros(3).cuda()',
                                     'y = torch.ones(2, device="cuda")', 'z = x.to("cuda:0")']


# ---- 3. the GPU check itself, dry run on CPU ---------------------------------------------------

def test_gpucheck_runs_on_cpu_and_finds_every_pair_bitwise_equal(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/test_gpu.py runs the check itself")
    from minifsdp.gpucheck import PAIRS, main

    assert main(["--steps", "2", "--tiny"]) == 0  # 0: every pair bitwise equal where expected
    out = capsys.readouterr().out
    assert "no CUDA device" in out and "skipped (no CUDA)" in out
    # on the CPU every pair is bitwise, FSDP1's too (Note [FSDP1 on CUDA] in minifsdp.gpucheck)
    assert out.count("| True | True | bitwise |") == len([p for p in PAIRS if not p.cuda_only])
    # the memory column compares rises over one step: the tracker's is measured here too
    rises = [line.split("|")[-2] for line in out.splitlines() if line.startswith("| fsdp")]
    assert rises and all(float(r.split("/")[0]) > 0 for r in rises)
    # under torch's own foreach rule, our FSDP1's FlatParameters would take the per-tensor
    # loop on CUDA and torch's original parameters the foreach kernels (the hypothesis)
    fsdp1 = next(line for line in out.splitlines()
                 if line.startswith("| fsdp1 full shard, a unit per block, torch's foreach"))
    assert "| False / True |" in fsdp1
    assert out.count("bitwise equal to itself") == 2  # FSDP1, ours and torch's, twice each
    # CPU offload: on a CPU mesh nothing crosses a host link, though the Note predicts bytes
    # for a device (what the GPU run checks exactly)
    link = next(line for line in out.splitlines() if "host link in step 2" in line)
    assert "H2D ours / torch / the Note's 0.00 / 0.00 / " in link, link
    assert "a CPU mesh copies nothing" in link and " / 0.00 MB" not in link, link


def test_host_device_copies_counts_only_what_crosses_devices():
    """The GPU check's counter of the host link, on the one other device a CPU has: meta."""
    from minifsdp.gpucheck import HostDeviceCopies

    with HostDeviceCopies() as c:
        torch.ones(4).to("meta")                                # 16 bytes across
        torch.empty(2, device="meta").copy_(torch.ones(2, dtype=torch.float64))  # 16 across
        torch.ones(3).to(torch.float64)                         # a cast on the host: none
        torch.zeros(5).copy_(torch.ones(5))                     # host to host: none
    assert (c.h2d, c.d2h) == (32, 0)


def test_gpucheck_bench_has_a_dry_run_on_cpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run `python -m minifsdp.gpucheck --bench` itself")
    from minifsdp.gpucheck import BENCH_PAIRS, main

    assert main(["--bench", "--tiny", "--rounds", "2", "--bench-steps", "1",
                 "--warmup", "1"]) == 0
    out = capsys.readouterr().out
    assert "## GPU bench" in out and "MINIFSDP_DETERMINISTIC=0" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "M |" in line]
    assert len(rows) == len(BENCH_PAIRS)


# ---- 4. one optimizer path (Note [one optimizer path] in minifsdp/train.py) --------------------

def test_ours_and_torchs_fsdp1_get_the_same_optimizer_kernels(monkeypatch):
    """On a device with multi-tensor kernels torch's default picks ``foreach`` by the
    parameters' exact type: a ``FlatParameter`` (ours) gets the per-tensor loop, a plain
    ``Parameter`` (torch's FSDP1, use_orig_params) the foreach kernels, which round
    differently on CUDA. Pretend the CPU is such a device: the default splits them,
    ``make_optimizer`` does not."""
    import torch.optim.optimizer as optimizer_module
    import torch.utils._foreach_utils as foreach_utils

    from minifsdp.fsdp1.flat_param import FlatParameter
    from minifsdp.train import make_optimizer, parse_args

    devices = lambda: ["cuda", "cpu"]
    monkeypatch.setattr(foreach_utils, "_get_foreach_kernels_supported_devices", devices)
    monkeypatch.setattr(optimizer_module, "_get_foreach_kernels_supported_devices", devices)
    flat, plain = FlatParameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    default = lambda p: optimizer_module._default_to_fused_or_foreach([p], False)[1]
    assert (default(flat), default(plain)) == (False, True)  # torch's rule, by type
    for name in ("adam", "adamw", "adadelta", "sgd"):
        args = parse_args(["--strategy", "fsdp1", "--optimizer", name])
        chosen = {make_optimizer([p], args).defaults["foreach"] for p in (flat, plain)}
        assert chosen == {True}, name
    monkeypatch.undo()  # the real CPU: no foreach kernels, for either
    args = parse_args(["--strategy", "fsdp1", "--optimizer", "adamw"])
    assert {make_optimizer([p], args).defaults["foreach"] for p in (flat, plain)} == {False}


def test_a_failed_cuda_only_pair_is_reported_and_fails_the_check():
    """A CUDA-only pair (symmetric memory) that raises on the GPU machine is a line in the
    report and a failed check, not a lost run: the other pairs' results still come back."""
    from minifsdp.gpucheck import passed, report

    res = {"backend": "nccl", "device_name": "H200", "torch": "2.11", "repeats": [],
           "pairs": [{"name": "fsdp2 fp32, symmetric memory", "error": "RuntimeError: boom"}]}
    assert not passed(res)
    assert "- fsdp2 fp32, symmetric memory: FAILED, RuntimeError: boom" in report(res)
    # a torch without the setter: said, not failed
    res["pairs"] = [{"name": "fsdp2 fp32, symmetric memory",
                     "skipped": "ValueError: ... this torch (2.11) has no FSDPModule.x"}]
    assert passed(res)
    assert "- fsdp2 fp32, symmetric memory: skipped, ValueError" in report(res)
