#!/usr/bin/env bash
# On a GPU machine: the forward call's host path (replay.py, the packed launch). Replayed
# calls against whole ones (replay_check.py); each call's time beside its kernel alone, the
# working tree against the copy in _ab_mma_old (call_timeline.py); the benchmark beside
# flash and cuDNN; verify's standard suite for numba-mma and numba (the SIMT kernel), side
# by side. Logs land in $OUT.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
timeout 200 python3 -W ignore scripts/dev/replay_check.py > "$OUT/replay_check.log" 2>&1
echo "replay_check rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/replay_check.log" | tail -12
start=$(date +%s)
timeout 200 python3 -W ignore scripts/dev/call_timeline.py --packages numba_kernels,_ab_mma_old \
  --n ${TIMELINE_N:-4096,8192} > "$OUT/call_timeline.log" 2>&1
echo "call_timeline rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/call_timeline.log" | grep -v Warn
if [[ "${BENCH:-1}" != 0 ]]; then
  start=$(date +%s)
  timeout 200 python3 -W ignore benchmarks/attention_speed.py --out "$OUT" --n 4096,8192 \
    --dtypes float16,bfloat16 --impls numba-mma,flash,cudnn --budget-s ${BENCH_BUDGET:-120} \
    > "$OUT/attention_speed.log" 2>&1
  echo "attention_speed rc=$? in $(( $(date +%s) - start )) s"; grep -v Warn "$OUT/attention_speed.log" | tail -30
fi
start=$(date +%s)
for run in ${VERIFY:-"numba-mma" "numba"}; do
  (timeout 200 python3 -W ignore -m verify $run --suite standard --timeout 60 \
     --json "$OUT/verify-$run.json" > "$OUT/verify-$run.log" 2>&1
   echo "rc=$?" >> "$OUT/verify-$run.log") &
done
wait
echo "verify numba-mma and numba forward, side by side: $(( $(date +%s) - start )) s"
grep -h "FAIL\|PASS\|rc=" "$OUT"/verify-*.log | tail -12
