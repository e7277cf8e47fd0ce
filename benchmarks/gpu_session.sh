#!/usr/bin/env bash
# One GPU session's prepared check (run by the device tool from the repository root; $OUT comes
# back): first the torch-2.11 FSDP1-on-gloo SIGSEGV with faulthandler (and gdb if present), then
# benchmarks/gpu_check.sh narrowed to fit the session's budget. Everything lands under $OUT.
set -u
OUT=${OUT:-runs/gpu_session}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD" MPLBACKEND=Agg PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/segv.log" 2>&1
SEGV=(--strategy torch_fsdp1 --model cnn --optimizer adam --steps 3)
{ echo "== torchrun, faulthandler on"; MINIFSDP_BACKEND=gloo PYTHONFAULTHANDLER=1 timeout 45 \
    "$PY" -X faulthandler -m torch.distributed.run --nproc-per-node 2 -m minifsdp.train "${SEGV[@]}"
  echo "rc=$?"; } >> "$OUT/segv.log" 2>&1
if command -v gdb > /dev/null; then
    { echo "== rank 0 under gdb, rank 1 plain"
      common="MINIFSDP_BACKEND=gloo MASTER_ADDR=127.0.0.1 MASTER_PORT=29631 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2"
      env $common RANK=1 LOCAL_RANK=1 timeout 60 "$PY" -m minifsdp.train "${SEGV[@]}" > "$OUT/segv_rank1.log" 2>&1 &
      env $common RANK=0 LOCAL_RANK=0 timeout 60 gdb -batch -ex run -ex bt --args "$PY" -m minifsdp.train "${SEGV[@]}"
      echo "rc=$?"; wait; } >> "$OUT/segv.log" 2>&1
else echo "no gdb on this machine" >> "$OUT/segv.log"; fi
bash benchmarks/gpu_check.sh > "$OUT/gpu_check.log" 2>&1
cp benchmarks/RESULTS.md "$OUT/RESULTS.md"
tar czf "$OUT/gpu_check_runs.tgz" runs/gpu_check 2>/dev/null
tail -n 80 "$OUT/segv.log"
