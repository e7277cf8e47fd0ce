"""The CUDA/NCCL path on a real GPU: skipped, with the reason, on a machine without one.

Every test here is marked ``gpu`` and runs under the machine's own backend rule (Note [one
code path for CPU and GPU] in ``minifsdp.dist``): tests/conftest.py lifts the gloo pin the CPU
tests use for modules so marked.

1. world size 1 (one GPU): ``minifsdp.gpucheck``'s pairs, ours against torch's, on NCCL and
   ``cuda:0``, bitwise equal where ``Pair.bitwise`` says so (Note [FSDP1 on CUDA]); FSDP1,
   ours and torch's, each deterministic with itself; the memory rises over a step measured by
   both our tracker and the caching allocator; the bench in its tiny form;
2. world size 2 (two GPUs or more): NCCL parity, ours against torch's, as the CPU tests check
   it on gloo -- FSDP2 and bucketed DDP through ``minifsdp.train``.

Run them with ``python -m pytest tests/test_gpu.py -o addopts="" -rs`` on a machine whose
Python has no nbval (``benchmarks/gpu_check.sh`` does).
"""


import pytest
import torch

from minifsdp import parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU visible here"),
]

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2,
                              reason="NCCL at N = 2 needs two GPUs (one rank per GPU)")


@pytest.fixture(scope="module")
def check():
    from minifsdp.gpucheck import run_check

    res = run_check(steps=6).ranks[0]
    from minifsdp.gpucheck import report

    print(report(res))  # shown with -s, and in the failure output
    return res


def _pair(res, name):
    return next(p for p in res["pairs"] if p["name"] == name)


def _pair_names():
    from minifsdp.gpucheck import PAIRS

    return [p.name for p in PAIRS]


def test_the_check_ran_on_nccl_and_cuda(check):
    assert check["backend"] == "nccl" and check["device"] == "cuda:0"


@pytest.mark.parametrize("name", _pair_names())
def test_ours_against_torch_at_world_size_one(check, name):
    p = _pair(check, name)
    assert "error" not in p, f"{name}: {p.get('error')}"  # a cuda_only pair's exception
    if "skipped" in p:  # this torch has no such setter
        pytest.skip(f"{name}: {p['skipped']}")
    where = (f"max abs diff {p['max_abs_diff']:.2e}, {p['elements_differing']} of "
             f"{p['elements']} elements differ, the most in {p['worst_param']}; first loss "
             f"difference at step {p['first_loss_diff_step']}; foreach ours/torch {p['foreach']}")
    if p["bitwise_expected"]:
        assert p["losses_equal"] and p["params_equal"], f"{name}: not bitwise: {where}"
    else:  # Note [FSDP1 on CUDA]: close, not bitwise; the foreach=False pair says why
        assert p["max_abs_diff"] < 1e-3, f"{name}: far apart: {where}"


def test_fsdp1_is_deterministic_with_itself(check):
    runs = {r["name"].split()[0]: r for r in check["repeats"]}
    ours, theirs = runs["fsdp1"], runs["torch_fsdp1"]
    assert ours["params_equal"] and ours["losses_equal"], (
        f"our FSDP1 differs from itself on CUDA: max abs diff {ours['max_abs_diff']:.2e}")
    if not (theirs["params_equal"] and theirs["losses_equal"]):
        pytest.skip(f"torch's FSDP1 differs from itself on CUDA (max abs diff "
                    f"{theirs['max_abs_diff']:.2e}): ours cannot be bitwise to it")


@pytest.mark.parametrize("name", _pair_names())
def test_tracker_and_allocator_both_see_the_step(check, name):
    p = _pair(check, name)
    assert "error" not in p, f"{name}: {p.get('error')}"
    if "skipped" in p:
        pytest.skip(f"{name}: {p['skipped']}")
    for side, mem in zip(("ours", "torch"), p["memory"]):
        assert mem["tracker_delta"] > 0 and mem["allocator_delta"] > 0, (side, mem)


def test_the_bench_runs_in_its_tiny_form():
    from minifsdp.gpucheck import BENCH_PAIRS, run_bench

    res = run_bench(tiny=True, rounds=2, steps=2, warmup=1, timeout=300).ranks[0]
    assert res["backend"] == "nccl" and len(res["bench"]) == len(BENCH_PAIRS)
    for b in res["bench"]:
        assert b["step_ms"][0] > 0 and b["step_ms"][1] > 0 and b["peak_gb"] > 0, b


# ---- world size 2: NCCL parity (two GPUs or more) -----------------------------------------------

GPT = ("--model", "gpt", "--n-layer", 2, "--d-model", 128, "--n-head", 4, "--vocab-size", 256,
       "--seq-len", 64, "--global-batch", 8, "--optimizer", "adamw", "--steps", 4)


@TWO_GPUS
@pytest.mark.parametrize("ours, theirs", [("fsdp2", "torch_fsdp2"),
                                          ("bucketed_ddp", "torch_ddp")])
def test_nccl_parity_at_world_size_two(ours, theirs):
    from minifsdp.launch import torchrun

    runs = {s: torchrun("minifsdp.train", "--strategy", s, *GPT, "--save-params", nproc=2,
                        chapter="tests", name=f"gpu_n2_{s}", timeout=300)
            for s in (ours, theirs)}
    for run in runs.values():
        assert run.backend.backend == "nccl", run.backend.line
    a, b = (runs[s] for s in (ours, theirs))
    parity.assert_bitwise(a.ranks[0]["losses"], b.ranks[0]["losses"], names=(ours, theirs),
                          where="NCCL, N = 2")
    pa, pb = (torch.load(r.out_dir / "params.pt") for r in (a, b))
    assert pa.keys() == pb.keys()
    parity.assert_bitwise(pa, pb, names=(ours, theirs), where="NCCL, N = 2")
