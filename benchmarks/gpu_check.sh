#!/usr/bin/env bash
# What one GPU machine shows of minifsdp, in under 8 minutes, appended to benchmarks/RESULTS.md.
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine, from anywhere
#   PYTHON=/opt/py312/bin/python bash benchmarks/gpu_check.sh
#   GPU_CHECK_QUICK=1 bash benchmarks/gpu_check.sh   # a dry run: tiny sizes, 6 cells of one
#                                          # notebook, two test files (works on a CPU machine)
#
# Made for a machine whose Python has torch, numpy, matplotlib, pytest(-xdist) but no pip,
# nbval or jupyter; the package is used from this source tree. Four parts, each under a
# deadline (benchmarks/deadline.py: SIGINT, then everything it started is killed), so that
# whatever finished is written even when something hangs:
#   (a) python -m minifsdp.gpucheck          parity, determinism and memory at world size 1
#       python -m minifsdp.gpucheck --bench  step time ours / torch's, a 135M GPT in bf16
#   (b) every notebook's code cells as plain Python, in parallel (benchmarks/run_notebooks.py),
#       under the machine's own backend rule
#   (c) the test suite with CUDA visible: pytest -n 8 --dist loadfile, tests/test_gpu.py first;
#       -o addopts="" because the pyproject's addopts name nbval, absent there
# The section (device, torch, date, commit) is appended to $GPU_CHECK_OUT (default
# benchmarks/RESULTS.md); without CUDA the default is runs/gpu_check/RESULTS.md instead, so a
# CPU dry run never lands in benchmarks/RESULTS.md. Logs: runs/gpu_check/.
# Time limits (seconds, env): GPU_CHECK_TOTAL_S (480), GPU_CHECK_CHECK_S (150),
# GPU_CHECK_BENCH_S (120; 0 skips the bench; GPU_CHECK_CHECK_S=0 skips the check), GPU_CHECK_NOTEBOOKS_S (150); the tests get what
# is left. GPU_CHECK_NOTEBOOKS and GPU_CHECK_TESTS (space-separated paths) narrow parts (b), (c).

set -u
cd "$(dirname "$0")/.." || exit 1
PY=${PYTHON:-python3}
QUICK=${GPU_CHECK_QUICK:-0}
T0=$(date +%s)
TOTAL=${GPU_CHECK_TOTAL_S:-480}
WORK=runs/gpu_check
rm -rf "$WORK" && mkdir -p "$WORK"
SECTION=$WORK/section.md
: > "$SECTION"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg PYTHONUNBUFFERED=1

elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( TOTAL - $(elapsed) )); }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }
say() { echo "[gpu_check $(elapsed)s] $*"; }
deadline() { local s=$1; shift; "$PY" benchmarks/deadline.py "$s" --grace 15 -- "$@"; }
# a part's outcome line: "finished in N s" / "stopped at its N s deadline" / "failed (exit N)"
outcome() {
    case "$1" in
        0) echo "finished in $2 s" ;;
        124) echo "**stopped at its $3 s deadline** after $2 s" ;;
        *) echo "finished in $2 s with exit code $1" ;;
    esac
}
tail_block() { echo; echo '```'; tail -n "${2:-25}" "$1"; echo '```'; echo; }

read -r CUDA DEVICE NGPU TORCHV <<< "$("$PY" -c '
import torch
c = torch.cuda.is_available()
name = torch.cuda.get_device_name(0).replace(" ", "_") if c else "no_GPU"
print(int(c), name, torch.cuda.device_count() if c else 0, torch.__version__)' 2>/dev/null)"
if [ -z "${CUDA:-}" ]; then echo "cannot import torch with $PY" >&2; exit 1; fi
if [ -n "${GPU_CHECK_OUT:-}" ]; then OUT=$GPU_CHECK_OUT
elif [ "$CUDA" = 1 ]; then OUT=benchmarks/RESULTS.md
else OUT=$WORK/RESULTS.md; fi
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
DIRTY=$(git status --porcelain 2>/dev/null | grep -qv '^??' && echo " (with uncommitted changes)")

if [ "$QUICK" = 1 ]; then
    CHECK_ARGS=(--tiny --steps 2); BENCH_ARGS=(--tiny --rounds 2 --bench-steps 1 --warmup 1)
    NOTEBOOKS=(${GPU_CHECK_NOTEBOOKS:-notebooks/01_memory_anatomy.ipynb}); NB_JOBS=2
    NB_ARGS=(--cells 6)
    TESTS=(tests/test_gpu.py tests/test_data.py); XDIST=2
else
    CHECK_ARGS=(); BENCH_ARGS=()
    NOTEBOOKS=(${GPU_CHECK_NOTEBOOKS:-notebooks/*.ipynb}); NB_JOBS=16; NB_ARGS=()
    TESTS=(${GPU_CHECK_TESTS:-tests/test_gpu.py tests}); XDIST=8
fi

# whatever happens, what is in the section gets appended
write_out() {
    [ -s "$SECTION" ] || return
    { echo; cat "$SECTION"; echo; echo "Total wall time: $(elapsed) s."; } >> "$OUT"
    say "appended to $OUT"
    : > "$SECTION"
}
trap write_out EXIT
trap 'say interrupted; exit 130' INT TERM

{
    echo "## benchmarks/gpu_check.sh, $(date -u '+%Y-%m-%d %H:%M UTC'): ${DEVICE//_/ } x $NGPU, torch $TORCHV"
    echo
    echo "Commit $COMMIT${DIRTY}; $("$PY" --version 2>&1) at \`$(command -v "$PY")\`; $(nproc 2>/dev/null || echo '?') cores."
    [ "$QUICK" = 1 ] && echo "GPU_CHECK_QUICK=1: a dry run at tiny sizes, one notebook's first 6 code cells, two test files."
    [ "$CUDA" = 1 ] || echo "No CUDA device: everything ran on CPU/gloo (a dry run of this script)."
    echo
} >> "$SECTION"

# ---- (a) gpucheck: parity at world size 1, then the bench ---------------------------------------
if [ "${GPU_CHECK_CHECK_S:-150}" = 0 ]; then
    echo "### (a) python -m minifsdp.gpucheck: skipped (GPU_CHECK_CHECK_S=0)" >> "$SECTION"
else
S=$(min "${GPU_CHECK_CHECK_S:-150}" "$(left)"); t=$(date +%s)
say "(a) gpucheck ${CHECK_ARGS[*]} (deadline ${S}s)"
deadline "$S" "$PY" -m minifsdp.gpucheck ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"} --timeout $(( S - 5 )) --out "$WORK/check.md" \
    > "$WORK/gpucheck.log" 2>&1
rc=$?
{
    echo "### (a) python -m minifsdp.gpucheck ${CHECK_ARGS[*]}: $(outcome $rc $(( $(date +%s) - t )) "$S")"
    echo
    if [ -s "$WORK/check.md" ]; then sed 's/^## /#### /' "$WORK/check.md"
    else tail_block "$WORK/gpucheck.log" 30; fi
} >> "$SECTION"
fi

S=$(min "${GPU_CHECK_BENCH_S:-120}" "$(left)"); t=$(date +%s)
if [ "${GPU_CHECK_BENCH_S:-120}" = 0 ]; then
    echo "### (a) python -m minifsdp.gpucheck --bench: skipped (GPU_CHECK_BENCH_S=0)" >> "$SECTION"
else
say "(a) gpucheck --bench ${BENCH_ARGS[*]} (deadline ${S}s)"
deadline "$S" "$PY" -m minifsdp.gpucheck --bench ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} --timeout $(( S - 5 )) \
    --out "$WORK/bench.md" > "$WORK/bench.log" 2>&1
rc=$?
{
    echo "### (a) python -m minifsdp.gpucheck --bench ${BENCH_ARGS[*]}: $(outcome $rc $(( $(date +%s) - t )) "$S")"
    echo
    if [ -s "$WORK/bench.md" ]; then sed 's/^## /#### /' "$WORK/bench.md"
    else tail_block "$WORK/bench.log" 30; fi
} >> "$SECTION"
fi

# ---- (b) the notebooks' code cells, in parallel ------------------------------------------------
# the tests need at least a minute and a half after this
S=$(min "${GPU_CHECK_NOTEBOOKS_S:-150}" $(( $(left) - 90 ))); [ "$S" -lt 30 ] && S=30
t=$(date +%s)
say "(b) ${#NOTEBOOKS[@]} notebook(s), $NB_JOBS at a time (deadline ${S}s)"
deadline "$S" "$PY" benchmarks/run_notebooks.py "${NOTEBOOKS[@]}" ${NB_ARGS[@]+"${NB_ARGS[@]}"} --jobs "$NB_JOBS" \
    --timeout $(( S - 10 )) --json "$WORK/notebooks.json" --logs "$WORK/notebooks" \
    > "$WORK/notebooks.log" 2>&1
rc=$?
{
    echo "### (b) notebooks, code cells as plain Python: $(outcome $rc $(( $(date +%s) - t )) "$S")"
    echo
    echo "Each notebook in its own process under the machine's backend rule; a failure is the"
    echo "first cell (index among all cells) that raised (a ClaimError included). Logs:"
    echo "\`$WORK/notebooks/\`."
    echo
    if grep -q '^| notebook' "$WORK/notebooks.log"; then sed -n '/^| notebook/,$p' "$WORK/notebooks.log"
    else tail_block "$WORK/notebooks.log" 30; fi
} >> "$SECTION"

# ---- (c) the test suite with CUDA visible ------------------------------------------------------
S=$(( $(left) - 20 )); [ "$S" -lt 30 ] && S=30
t=$(date +%s)
say "(c) pytest ${TESTS[*]} -n $XDIST (deadline ${S}s)"
deadline "$S" "$PY" -m pytest "${TESTS[@]}" -o addopts="" -p no:cacheprovider -n "$XDIST" \
    --dist loadfile -v -rfEs > "$WORK/pytest.log" 2>&1
rc=$?
{
    echo "### (c) pytest ${TESTS[*]} -n $XDIST --dist loadfile: $(outcome $rc $(( $(date +%s) - t )) "$S")"
    echo
    "$PY" benchmarks/summarize_pytest.py "$WORK/pytest.log"
    echo
    if grep -q "^SKIPPED.*test_gpu" "$WORK/pytest.log"; then
        echo "tests/test_gpu.py skips:"; echo; grep "^SKIPPED.*test_gpu" "$WORK/pytest.log" | sed 's/^/- /'
    fi
} >> "$SECTION"
say "done"
