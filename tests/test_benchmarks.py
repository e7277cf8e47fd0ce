"""The benchmarks' harness (benchmarks/harness.py), without launching anything."""

import argparse
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

_spec = importlib.util.spec_from_file_location(
    "harness", Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("harness", harness)  # its dataclass looks its module up by name
_spec.loader.exec_module(harness)


def test_each_round_runs_every_strategy_once_and_the_order_rotates():
    names = ["ours", "torch", "ours_bf16"]
    orders = [harness.rotated(names, r) for r in range(6)]
    assert all(sorted(o) == sorted(names) for o in orders)
    # over len(names) rounds each strategy runs first once; then the cycle repeats
    assert sorted(o[0] for o in orders[:3]) == sorted(names)
    assert orders[3:] == orders[:3]


def test_launch_pools_the_jobs_rounds_and_gives_each_job_its_ratio(monkeypatch):
    # two fake jobs: ours is 1.1x torch in the first and 0.9x in the second
    jobs = iter([{"ours": [[1.1, 1.1], [2.2]], "torch": [[1.0, 1.0], [2.0]]},
                 {"ours": [[0.9]], "torch": [[1.0]]}])
    calls = []

    def fake_torchrun(script, *argv, nproc, name, **kwargs):
        calls.append((nproc, name))
        return SimpleNamespace(ranks=[{"times": next(jobs)}])

    monkeypatch.setattr("minifsdp.launch.torchrun", fake_torchrun)
    args = argparse.Namespace(world_sizes=[2], jobs=2, **{
        flag[2:].replace("-", "_"): default for flag, _, default, _ in harness.COMMON})
    [row] = harness.launch("bench.py", args, "x", "torch")
    assert calls == [(2, "x_2_job0"), (2, "x_2_job1")]
    assert row.times["ours"] == [[1.1, 1.1], [2.2], [0.9]]  # every round of both jobs
    assert row.med == {"ours": 1.1, "torch": 1.0}
    assert [round(r, 9) for r in row.per_round["ours"]] == [1.1, 1.1, 0.9]
    assert [round(r, 9) for r in row.per_job["ours"]] == [1.1, 0.9]
    assert row.per_job["torch"] == [1.0, 1.0]


_spec2 = importlib.util.spec_from_file_location(
    "run_all_twice", Path(__file__).resolve().parents[1] / "benchmarks" / "run_all_twice.py")
run_all_twice = importlib.util.module_from_spec(_spec2)
_spec2.loader.exec_module(run_all_twice)


def _stream(text, name="stdout"):
    return {"output_type": "stream", "name": name, "text": text}


def test_run_all_twice_compares_as_nbval_does():
    """Split streams coalesce, what nbval sanitizes (times, a claim's measured digits) and what
    it skips (images, execution counts) does not count; any other character does."""
    pat = run_all_twice.load_patterns()
    first = [_stream("loss 0.5 in 3.2 s\n"), _stream("✓ fits · measured: 0.123\n"),
             {"output_type": "display_data", "metadata": {},
              "data": {"image/png": "AAAA", "text/plain": "<Figure>"}}]
    second = [_stream("loss 0.5 in 41 s\n✓ fits · measured: 0.987\n"),
              {"output_type": "display_data", "metadata": {},
               "data": {"image/png": "BBBB", "text/plain": "<Figure>"}}]
    same = run_all_twice.comparable(first, pat)
    assert same == run_all_twice.comparable(second, pat)
    assert run_all_twice.diff(same, run_all_twice.comparable(second, pat)) == ""
    changed = run_all_twice.comparable([_stream("loss 0.6 in 3.2 s\n")] + first[1:], pat)
    d = run_all_twice.diff(same, changed)
    assert "-[stdout] loss 0.5 in <T> s" in d and "+[stdout] loss 0.6 in <T> s" in d
    # an output the first run did not have (a warning on stderr) is a difference too
    assert run_all_twice.diff(same, run_all_twice.comparable(first + [_stream("!\n", "stderr")],
                                                             pat))


def test_run_all_twice_finds_a_cell_that_changes_on_the_second_run(tmp_path):
    """A tiny notebook in a real kernel: a counter that only the first run initializes, and a
    cell that fails once something exists, differ on the second run; a plain cell does not."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (
        "x = 1\nprint('x', x)",
        "n = globals().get('n', 0) + 1\nprint('run', n)",
        "assert 'done' not in globals(), 'ran before'\ndone = True")]
    nb.cells.insert(1, nbformat.v4.new_markdown_cell("text"))
    path = tmp_path / "t.ipynb"
    nbformat.write(nb, path)
    res = run_all_twice.run_twice(path, timeout=60)
    assert res["cells"] == 3
    assert [i for i, _ in res["differ"]] == [2, 3]  # indices among all cells, as the .ipynb
    assert "-[stdout] run 1" in res["differ"][0][1] and "+[stdout] run 2" in res["differ"][0][1]
    assert res["errors"] == ["cell 3 (second run): AssertionError: ran before"]
    assert "cell 2 differs" in run_all_twice.report(res)


_spec3 = importlib.util.spec_from_file_location(
    "scaling", Path(__file__).resolve().parents[1] / "benchmarks" / "scaling.py")
scaling = importlib.util.module_from_spec(_spec3)
_spec3.loader.exec_module(scaling)


def test_scaling_refuses_what_strong_scaling_cannot_run(capsys):
    import pytest

    for argv, what in ((["--world-sizes", "2", "4"], "must include 1"),
                       (["--global-batch", "6", "--world-sizes", "1", "4"],
                        "--global-batch 6 is not divisible by world sizes [4]"),
                       (["--strategies", "fsdp3"], "unknown ['fsdp3']")):
        with pytest.raises(SystemExit):
            scaling.parse_args(argv)
        assert what in capsys.readouterr().err, argv


def test_scaling_reports_a_strategy_that_cannot_run_at_one_rank():
    """summarize/table on made-up rank results: a strategy whose N = 1 build failed gets no
    ratios, is listed as unavailable and printed as such, and the others are unaffected."""
    args = scaling.parse_args(["--world-sizes", "1", "2", "--strategies", "fsdp2", "zero1",
                               "--rounds", "1", "--steps", "2"])
    ok = lambda t, p: {"times": {"fsdp2": [[t, t]]},
                       "peaks": {"fsdp2": {"attributed": p, "total": p + 1, "by_category": {}}},
                       "errors": {"zero1": "ValueError: no"}, "num_params": 10,
                       "world_size": 1, "local_batch": 8, "device": "cpu", "backend": "gloo"}
    ranks = {1: [ok(0.2, 1000)], 2: [ok(0.1, 600), ok(0.1, 500)]}
    res = scaling.summarize(args, ranks, {1: "one", 2: "two"})
    assert res["ratios"]["fsdp2"]["2"] == {"time": 0.5, "peak": 0.6}  # the larger rank's peak
    assert res["ratios"]["zero1"] == {"1": None, "2": None}
    assert res["unavailable"] == {"zero1": {"1": "ValueError: no", "2": "ValueError: no"}}
    assert "zero1         cannot run at N = 1: ValueError: no" in scaling.table(res)


def test_scaling_runs_every_strategy_at_one_and_two_ranks(tmp_path):
    """The benchmark itself, tiny (N = 1, 2; one timed step): the JSON's structure and what
    is exact -- peaks are tensor bytes (every category but other), the same in every run --
    never a time."""
    import json

    out = tmp_path / "scaling.json"
    args = scaling.parse_args(["--world-sizes", "1", "2", "--rounds", "1", "--steps", "1",
                               "--warmup", "0", "--global-batch", "2", "--n-layer", "1",
                               "--d-model", "64", "--seq-len", "16", "--out", str(out)])
    scaling.driver(args)
    res = json.loads(out.read_text())
    names = list(scaling.STRATEGIES)
    assert len(names) == 9 and res["config"]["strategies"] == names
    assert res["unavailable"] == {}
    assert res["local_batch"] == {"1": 2, "2": 1} and res["scaling"].startswith("strong")
    for s in names:
        assert set(res["results"][s]) == {"1", "2"}
        for n in ("1", "2"):
            cell = res["results"][s][n]
            assert cell["error"] is None and cell["time_s"] > 0
            assert len(cell["round_medians_s"]) == 1 and len(cell["peak_by_rank"]) == int(n)
            assert cell["peak_bytes"] == max(cell["peak_by_rank"])
        r, two, one = res["ratios"][s]["2"], res["results"][s]["2"], res["results"][s]["1"]
        assert r == {"time": two["time_s"] / one["time_s"],
                     "peak": two["peak_bytes"] / one["peak_bytes"]}
    peak = {s: {n: res["results"][s][n]["peak_bytes"] for n in ("1", "2")} for s in names}
    # half the batch per rank and, for every sharding strategy, half the sharded states
    assert all(peak[s]["2"] < peak[s]["1"] for s in names), peak
    # DDP replicates: at its peak every rank holds all 4 Psi bytes of fp32 parameters, at any N
    assert all(res["results"][s][n]["peak_by_category_rank0"]["params"] == 4 * res["num_params"]
               for s in ("ddp", "torch_ddp") for n in ("1", "2"))
    assert (tmp_path / "scaling.png").stat().st_size > 0
