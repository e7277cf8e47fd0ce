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


def _as_rank(monkeypatch, rank, local_rank, world):
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))


@pytest.mark.parametrize("rank, local_rank", [(0, 0), (1, 1), (2, 0), (3, 1)])
def test_each_local_rank_gets_its_own_gpu(fake_cuda, monkeypatch, rank, local_rank):
    # 2 nodes x 2 GPUs: global ranks 2, 3 are local ranks 0, 1 of the second node
    _as_rank(monkeypatch, rank, local_rank, world=4)
    info = mdist.dist_setup()
    assert info.backend == "nccl" and fake_cuda["backend"] == "nccl"
    assert info.device == torch.device("cuda", local_rank)
    assert fake_cuda["set_device"] == info.device and fake_cuda["device_id"] == info.device


def test_a_rank_without_a_gpu_is_refused(fake_cuda, monkeypatch):
    _as_rank(monkeypatch, 2, 2, world=3)  # --nproc-per-node 3 on a 2-GPU node
    with pytest.raises(RuntimeError, match=r"local rank 2 has no GPU: 2 visible"):
        mdist.dist_setup()
    assert "backend" not in fake_cuda  # refused before any process group exists


def test_gloo_on_a_gpu_machine_keeps_tensors_on_the_cpu(fake_cuda, monkeypatch):
    _as_rank(monkeypatch, 1, 1, world=2)
    monkeypatch.setenv("MINIFSDP_BACKEND", "gloo")
    info = mdist.dist_setup()
    assert (info.backend, info.device) == ("gloo", torch.device("cpu"))


# ---- 2. no hard-coded device or backend --------------------------------------------------------

# (file, the line's code) -> why it is right on GPUs too
REVIEWED = {
    ("dist.py", 'if backend == "gloo":'): "gloo means CPU tensors, whatever is visible",
    ("dist.py", 'device = torch.device("cuda", local_rank) if device_type == "cuda" else '
                'torch.device("cpu")'): "the one place a rank's device is chosen: LOCAL_RANK",
    ("dist.py", 'device = torch.device("cuda", 0) if device_type == "cuda" else '
                'torch.device("cpu")'): "a world of one outside torchrun (a notebook cell)",
    ("flat_param.py", 'shard = shard.to("cpu", copy=True) if offload else shard.clone() if '
                      'sharded else shard'): "CPUOffload: the shard lives in host memory",
    ("fsdp1.py", 'return {_clean(k): v.detach().to("cpu", copy=True) for k, v in sd.items()}'):
        "a full state dict is gathered to host memory, as torch's offload_to_cpu",
    ("fsdp2/mixed_precision.py", 'if device_type != "cpu" and backend != "gloo":  # NCCL (or '
                                 'another accelerator backend)'):
        "gloo's dtype limits are checked on gloo only; NCCL takes bf16/fp16/fp8",
    ("labs/report.py", 'g, e = got.detach().cpu(), expected.detach().cpu()'):
        "a lab compares bits in host memory, whatever device produced them",
    ("train.py", 'return {k: v.detach().cpu() for k, v in sd.items()}'):
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
        pytest.skip("a GPU is here: run `python -m minifsdp.gpucheck` itself")
    from minifsdp.gpucheck import PAIRS, main

    assert main(["--steps", "2", "--tiny"]) == 0  # 0: every pair bitwise equal
    out = capsys.readouterr().out
    assert "no CUDA device" in out and "skipped (no CUDA)" in out
    assert out.count("| True | True |") == len(PAIRS)
