"""The benchmarks' harness (benchmarks/harness.py), without launching anything."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "harness", Path(__file__).resolve().parents[1] / "benchmarks" / "harness.py")
harness = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(harness)


def test_each_round_runs_every_strategy_once_and_the_order_rotates():
    names = ["ours", "torch", "ours_bf16"]
    orders = [harness.rotated(names, r) for r in range(6)]
    assert all(sorted(o) == sorted(names) for o in orders)
    # over len(names) rounds each strategy runs first once; then the cycle repeats
    assert sorted(o[0] for o in orders[:3]) == sorted(names)
    assert orders[3:] == orders[:3]


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
