"""Re-execute every notebook as *another CPU* than the one that stored its outputs.

PyTorch picks its kernels by CPU: ``ATEN_CPU_CAPABILITY`` (elementwise, softmax), MKL's code
path (``MKL_CBWR``, matmul) and oneDNN's ISA (``DNNL_MAX_CPU_ISA``, convolutions) each change
the last bits of the same computation. The stored outputs are made on the author's CPU at its
native capability; nbval re-runs each notebook's kernel (and so every torchrun job it
launches, which inherit the kernel's environment) with the capabilities below, so a passing
suite proves that what a notebook prints does not depend on the CPU's kernels (Note [what a
notebook prints] in minifsdp/notebook.py) -- in the same single pass, at no extra cost.

``MINIFSDP_NOTEBOOK_CPU`` picks the profile: ``default`` (the CI's choice: no SIMD in ATen,
MKL's compatible path, SSE4.1 oneDNN -- the farthest from any native CPU), ``avx2``, or
``native`` (run as this machine, e.g. to reproduce the stored outputs).
"""

import os

import pytest

PROFILES = {
    "default": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE",
                "DNNL_MAX_CPU_ISA": "SSE41"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2"},
    "native": {},
}


def _profile() -> dict[str, str]:
    name = os.environ.get("MINIFSDP_NOTEBOOK_CPU", "default")
    if name not in PROFILES:
        raise pytest.UsageError(f"MINIFSDP_NOTEBOOK_CPU={name!r}: expected one of "
                                f"{', '.join(PROFILES)}")
    return PROFILES[name]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """The notebook's kernel starts in the setup of its first cell: start it with the profile.

    Only the kernel's start sees it (the environment is restored after), so tests run in this
    pytest process, and other files' torchrun jobs, keep the machine's own kernels."""
    saved = {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR",
                                            "DNNL_MAX_CPU_ISA")}
    os.environ.update(_profile())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
