"""The course's index: for each chapter, its notebook, the package modules it builds, its lab,
its tests and its demos -- so a reader always knows which file to open, and a maintainer which
files a change to a chapter touches. ``tests/test_chapters.py`` holds the repository to it:
every module, test and worker file belongs to one chapter or to ``INFRASTRUCTURE``, every file
named here exists, the lab ids are the labs', and labs/README.md has a row for each.

    from minifsdp.chapters import CHAPTERS, chapter_of
    CHAPTERS["05"].modules          # ('minifsdp/fsdp2/api.py', ...)
    chapter_of("tests/test_zero.py")  # '03'
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chapter:
    """One chapter. Paths are relative to the repository root; ``lab`` is the lab's id (its
    skeleton, seams and hints: ``minifsdp.labs.seams``; its checker: ``minifsdp/labs/chNN.py``,
    which also holds the chapter's exercise checkers)."""

    id: str
    title: str
    notebook: str
    modules: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    workers: tuple[str, ...] = ()
    demos: tuple[str, ...] = ()
    lab: str | None = None


def _m(*names: str) -> tuple[str, ...]:
    return tuple(f"minifsdp/{n}.py" for n in names)


def _t(*names: str) -> tuple[str, ...]:
    return tuple(f"tests/{n}.py" for n in names)


def _w(*names: str) -> tuple[str, ...]:
    return tuple(f"tests/workers/{n}.py" for n in names)


CHAPTERS: dict[str, Chapter] = {c.id: c for c in [
    Chapter("00", "Collectives and torchrun", "notebooks/00_collectives_and_torchrun.ipynb",
            _m("ring", "comm"), _t("test_comm", "test_exercises_00"), _w("comm_worker"),
            _m("demos/collectives", "demos/comm_time"), lab="00"),
    Chapter("01", "Memory anatomy", "notebooks/01_memory_anatomy.ipynb",
            _m("memory", "analytic"), _t("test_memory", "test_exercises_01")),
    Chapter("02", "DDP", "notebooks/02_ddp.ipynb", _m("ddp", "evaluation"),
            _t("test_ddp", "test_exercises_02"), _w("ddp_worker"), lab="02"),
    Chapter("03", "ZeRO", "notebooks/03_zero.ipynb", _m("zero"),
            _t("test_zero", "test_exercises_03"), _w("zero_worker"), lab="03"),
    Chapter("04", "FSDP1: the FlatParameter", "notebooks/04_fsdp1_flat_parameter.ipynb",
            _m("fsdp1/__init__", "fsdp1/fully_sharded", "fsdp1/flat_param", "fsdp1/wrap",
               "fsdp1/options", "fsdp1/grads"),
            _t("test_fsdp1", "test_fsdp1_knobs", "test_exercises_04"),
            _w("fsdp1_worker", "fsdp1_knobs_worker"), _m("demos/fsdp1_knobs"), lab="04"),
    Chapter("05", "FSDP2: per-parameter sharding", "notebooks/05_fsdp2_per_param.ipynb",
            _m("fsdp2/__init__", "fsdp2/api", "fsdp2/fsdp_param", "fsdp2/fsdp_param_group",
               "fsdp2/fsdp_state", "fsdp2/reduce", "fsdp2/extensions",
               "fsdp2/shard_placement", "fsdp2/custom_comm", "fsdp2/comm_buffers",
               "fsdp2/spmd_mesh"),
            _t("test_fsdp2", "test_fsdp2_custom_comm", "test_activation_checkpointing",
               "test_exercises_05"),
            _w("fsdp2_worker", "fsdp2_multi_worker", "fsdp2_shard_dim_worker",
               "fsdp2_custom_comm_worker", "fsdp2_spmd_worker", "pair_model"),
            _m("demos/activation_checkpointing"),
            lab="05"),
    Chapter("06", "Prefetch and overlap", "notebooks/06_prefetch_and_overlap.ipynb",
            _m("fsdp2/prefetch", "simulated_link"), _t("test_fsdp2_prefetch",
                                                        "test_simulated_link",
                                                        "test_exercises_06"),
            _w("fsdp2_prefetch_worker"), _m("demos/backward_gathers"), lab="06"),
    Chapter("07", "Mixed precision", "notebooks/07_mixed_precision.ipynb",
            _m("fsdp2/mixed_precision", "fsdp2/float8", "numerics"),
            _t("test_fsdp2_mixed_precision", "test_fsdp2_float8", "test_numerics",
               "test_exercises_07"),
            _w("fsdp2_mp_worker", "fsdp2_float8_worker"), _m("demos/float8"), lab="07"),
    Chapter("08", "Checkpointing", "notebooks/08_checkpointing.ipynb",
            _m("checkpoint", "resume"), _t("test_checkpoint", "test_exercises_08"),
            _w("checkpoint_worker"), _m("demos/checkpoint_costs"), lab="08"),
    Chapter("09", "Capstone: scale and HSDP", "notebooks/09_capstone.ipynb",
            _m("scale", "scale_time", "fsdp2/hsdp"), _t("test_scale", "test_fsdp2_hsdp",
                                                         "test_multinode",
                                                         "test_exercises_09"),
            _w("fsdp2_hsdp_worker"), lab="09"),
    Chapter("10", "SimpleFSDP", "notebooks/10_simple_fsdp.ipynb",
            _m("simple_fsdp", "graph_passes", "serial_collectives"),
            _t("test_simple_fsdp", "test_exercises_10"),
            _w("simple_fsdp_worker", "gloo_in_flight_worker"), _m("demos/simple_fsdp"),
            lab="10"),
    Chapter("11", "FSDP2's pitfalls", "notebooks/11_pitfalls.ipynb",
            tests=_t("test_exercises_11", "test_pitfalls"),
            demos=_m("demos/pitfalls", "demos/accumulation"), lab="11"),
    Chapter("12", "ZeRO++", "notebooks/12_zero_plus_plus.ipynb", _m("zeropp"),
            _t("test_zeropp"), demos=_m("demos/zeropp")),
]}

# what every chapter uses and none teaches alone
INFRASTRUCTURE: tuple[str, ...] = (
    *_m("__init__", "chapters", "data", "dist", "launch", "sweep", "models", "notebook", "plot",
        "train", "strategies", "probes", "gpucheck", "torch_order", "parity",
        "demos/__init__"),
    *_t("test_data", "test_launch", "test_sweep", "test_notebook", "test_project", "test_train",
        "test_strategies", "test_gpu", "test_gpu_ready", "test_labs", "test_lab_bugs_00_05",
        "test_lab_bugs_06_11", "planted", "test_benchmarks", "test_chapters", "exercise_checks",
        "jobs", "test_torch_order", "test_parity"),
    *_w("faulty", "torch_order_worker"),
)


def chapter_of(path: str) -> str | None:
    """The id of the chapter that ``path`` (relative to the repository root) belongs to, or
    ``None`` for infrastructure and unknown files."""
    for c in CHAPTERS.values():
        if path in (c.notebook, *c.modules, *c.tests, *c.workers, *c.demos):
            return c.id
    return None
