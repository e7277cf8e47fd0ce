#!/usr/bin/env bash
# One GPU session's prepared check (run by the device tool from the repository root; $OUT comes
# back). Two phases, so that the timings are taken on a quiet machine and the rest shares it:
#   A (alone)   python -m minifsdp.gpucheck --bench (ours / torch's / compute-only step time), then
#               benchmarks/profile_step.py for each strategy in $GPU_SESSION_PROFILE;
#   B (at once) python -m minifsdp.gpucheck (parity at world size 1, on the GPU) beside
#               benchmarks/gpu_check.sh narrowed to notebooks and tests (its own check and bench
#               skipped: phase A and the line above ran them).
# Knobs (env): GPU_SESSION_BENCH_S (130; 0 skips), GPU_SESSION_PROFILE ("fsdp2 fsdp2:bf16
# torch_fsdp2"; "" skips), GPU_SESSION_PROFILE_S (90 in all), GPU_SESSION_CHECK_S (200; 0 skips),
# GPU_SESSION_SEGV=1 reruns the old torch-2.11 FSDP1 SIGSEGV repro first (fixed; off by default);
# the GPU_CHECK_* knobs of gpu_check.sh for phase B's notebooks and tests.
set -u
OUT=${OUT:-runs/gpu_session}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD" MPLBACKEND=Agg PYTHONUNBUFFERED=1
deadline() { local s=$1; shift; "$PY" benchmarks/deadline.py "$s" --grace 10 -- "$@"; }
T0=$(date +%s); say() { echo "[gpu_session $(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi -L > "$OUT/session.log" 2>&1

if [ "${GPU_SESSION_SEGV:-0}" = 1 ]; then
    SEGV=(--strategy torch_fsdp1 --model cnn --optimizer adam --steps 3)
    { echo "== torchrun, faulthandler on"; MINIFSDP_BACKEND=gloo PYTHONFAULTHANDLER=1 timeout 45 \
        "$PY" -X faulthandler -m torch.distributed.run --nproc-per-node 2 -m minifsdp.train "${SEGV[@]}"
      echo "rc=$?"; } > "$OUT/segv.log" 2>&1
fi

# ---- phase A: timings on a quiet machine ---------------------------------------------------------
if [ "${GPU_SESSION_BENCH_S:-130}" != 0 ]; then
    say "bench"
    deadline "${GPU_SESSION_BENCH_S:-130}" "$PY" -m minifsdp.gpucheck --bench \
        --timeout $(( ${GPU_SESSION_BENCH_S:-130} - 5 )) --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1
    say "bench rc=$?"
fi
PROFILE_END=$(( $(date +%s) + ${GPU_SESSION_PROFILE_S:-90} ))
for spec in ${GPU_SESSION_PROFILE-fsdp2 fsdp2:bf16 torch_fsdp2}; do
    left=$(( PROFILE_END - $(date +%s) )); [ "$left" -lt 15 ] && break
    name=${spec%%:*}; flag=(); [ "$spec" != "$name" ] && flag=(--bf16)
    say "profile $spec (${left}s left)"
    deadline "$left" "$PY" benchmarks/profile_step.py --strategy "$name" ${flag[@]+"${flag[@]}"} \
        > "$OUT/profile_${spec/:/_}.txt" 2>&1
done

# ---- phase B: parity on the GPU beside the notebooks and tests -----------------------------------
if [ "${GPU_SESSION_CHECK_S:-200}" != 0 ]; then
    say "check (background)"
    deadline "${GPU_SESSION_CHECK_S:-200}" "$PY" -m minifsdp.gpucheck \
        --timeout $(( ${GPU_SESSION_CHECK_S:-200} - 5 )) --out "$OUT/check.md" > "$OUT/check.log" 2>&1 &
    CHECK_PID=$!
fi
say "gpu_check.sh: notebooks and tests"
GPU_CHECK_CHECK_S=0 GPU_CHECK_BENCH_S=0 GPU_CHECK_OUT="$OUT/gpu_check_section.md" \
    bash benchmarks/gpu_check.sh > "$OUT/gpu_check.log" 2>&1
[ -n "${CHECK_PID:-}" ] && wait "$CHECK_PID"
say "done"
# few files come back from the device: the runs and the profiles travel as one archive each
tar czf "$OUT/gpu_check_runs.tgz" runs/gpu_check 2>/dev/null
(cd "$OUT" && ls profile_*.txt > /dev/null 2>&1 && tar czf profiles.tgz profile_*.txt && rm profile_*.txt)
for f in bench.md check.md gpu_check_section.md; do
    [ -s "$OUT/$f" ] && { echo "==== $f"; cat "$OUT/$f"; }
done
