#!/usr/bin/env bash
# On a GPU machine: float32 on tensor cores (float16 halves, halves.py), forward and backward.
# PART names the steps, in order (default "check bench"):
#   probe  mma_rounding_probe.py: how mma.sync rounds its float32 sums;
#   long   halves_check.py --long: gradients summed over thousands of rows or keys, the
#          halves beside the SIMT pair;
#   keys   halves_check.py --long-keys: out, lse and gradients over 16k-32k keys;
#   consistency  halves_check.py --consistency: scores in the thousands, the backward's
#          scores against the forward's;
#   check  verify's standard suite, forward and backward, float32, numba-mma-backward; beside
#          it numba-mma --backward (the 16-bit kernels, whose source changed too);
#   fwdbench  benchmarks/attention_speed.py float32: the halves (numba-mma), the SIMT kernel
#          (numba) and torch's efficient and math backends, N = 2048, 4096, 8192;
#   bench  benchmarks/backward_speed.py float32: the halves (numba-mma), the SIMT backward
#          (numba-tuned) and torch's math and efficient backends, N = 2048, 4096, 8192;
#   sanitize  compute-sanitizer memcheck and racecheck on one float32 call, causal, with a
#          NaN in q (the nonfinite variants run);
#   ab     the 16-bit forward and backward against the copy in _ab_mma_old (ab_mma.py);
#   abf32  the float32 backward against the copy in _ab_mma_old (ab_mma.py --backward
#          --float32);
#   ncu    ncu --set full on the six kernels of one float32 call at (2, 16, 4096, 128):
#          dk, dv (flash_mma_bwd.kv_parts) and dq, each with its nonfinite variant (every
#          block returns at once);
#   conformance  pytest conformance --impl numba-mma-backward --backward.
set -u
. "$(dirname "$0")/steps.sh"
for PART in ${PART:-check bench}; do
  start=$(date +%s)
  if [[ "$PART" == probe ]]; then
    timeout 120 python3 -W ignore scripts/dev/mma_rounding_probe.py > "$OUT/probe.log" 2>&1
    echo "probe rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/probe.log"
  elif [[ "$PART" == long ]]; then
    timeout ${LONG_TIMEOUT:-300} python3 -W ignore scripts/dev/halves_check.py --long \
      > "$OUT/long.log" 2>&1
    echo "long rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/long.log"
  elif [[ "$PART" == keys ]]; then
    timeout ${LONG_TIMEOUT:-300} python3 -W ignore scripts/dev/halves_check.py --long-keys \
      > "$OUT/keys.log" 2>&1
    echo "keys rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/keys.log"
  elif [[ "$PART" == abf32 ]]; then
    timeout ${AB_TIMEOUT:-200} python3 -W ignore scripts/dev/ab_mma.py --backward --float32 \
      > "$OUT/ab_mma_float32.log" 2>&1
    echo "ab_mma --backward --float32 rc=$? in $(( $(date +%s) - start )) s"
    grep -v Warn "$OUT/ab_mma_float32.log"
  elif [[ "$PART" == consistency ]]; then
    timeout 200 python3 -W ignore scripts/dev/halves_check.py --consistency \
      > "$OUT/consistency.log" 2>&1
    echo "consistency rc=$? in $(( $(date +%s) - start )) s"; tail -8 "$OUT/consistency.log"
  elif [[ "$PART" == fwdbench ]]; then
    timeout ${BENCH_TIMEOUT:-300} python3 -W ignore benchmarks/attention_speed.py --out "$OUT" \
      --n ${BENCH_N:-2048,4096,8192} --dtypes float32 \
      --impls ${FWD_IMPLS:-numba-mma,numba,efficient,math} --budget-s ${BENCH_BUDGET:-200} \
      > "$OUT/attention_speed.log" 2>&1
    echo "attention_speed rc=$? in $(( $(date +%s) - start )) s"
    grep -v Warn "$OUT/attention_speed.log" | tail -40
  elif [[ "$PART" == check ]]; then
    verify_side_by_side "numba-mma-backward --backward --dtype float32" "numba-mma --backward"
  elif [[ "$PART" == bench ]]; then
    timeout ${BENCH_TIMEOUT:-300} python3 -W ignore benchmarks/backward_speed.py --out "$OUT" \
      --n ${BENCH_N:-2048,4096,8192} --dtypes float32 \
      --impls ${BENCH_IMPLS:-numba-mma,numba-tuned,math,efficient} \
      --budget-s ${BENCH_BUDGET:-200} > "$OUT/backward_speed.log" 2>&1
    echo "backward_speed rc=$? in $(( $(date +%s) - start )) s"
    grep -v Warn "$OUT/backward_speed.log" | tail -60
  elif [[ "$PART" == sanitize ]]; then
    for tool in memcheck racecheck; do
      timeout 200 compute-sanitizer --tool $tool --report-api-errors no --print-limit 5 \
        python3 -W ignore \
        scripts/dev/halves_check.py > "$OUT/sanitize_$tool.log" 2>&1
      echo "$tool rc=$?"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|max error|nan" \
        "$OUT/sanitize_$tool.log" | head -8
    done
  elif [[ "$PART" == ncu ]]; then
    KEYS="^    (Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy"
    KEYS="$KEYS|No Eligible|Executed Instructions  |Dynamic Shared|Block Limit (Reg|Shared))"
    timeout 200 ncu --clock-control none --set full -k regex:'mma_dkdv|mma_dq' --launch-skip 6 \
      --launch-count 6 python3 scripts/dev/profile_backward.py 128 4096 float32 mma \
      > "$OUT/ncu_halves.txt" 2>&1
    echo "ncu rc=$? in $(( $(date +%s) - start )) s"
    grep -E "^  [a-z_]|$KEYS|pipe" "$OUT/ncu_halves.txt" | grep -v "^    -" | head -60
  elif [[ "$PART" == conformance ]]; then
    timeout -s INT -k 20 ${GRAD_TIMEOUT:-240} python3 -m pytest -p conformance.plugin conformance \
      --impl numba-mma-backward --backward -p no:cacheprovider -W ignore -rfs -q \
      > "$OUT/conformance-grad.log" 2>&1
    echo "conformance --impl numba-mma-backward --backward: rc=$?" \
      "in $(( $(date +%s) - start )) s"
    tail -3 "$OUT/conformance-grad.log"
  elif [[ "$PART" == ab ]]; then
    for flag in "" --backward; do
      timeout ${AB_TIMEOUT:-200} python3 -W ignore scripts/dev/ab_mma.py $flag \
        > "$OUT/ab_mma$flag.log" 2>&1
      echo "ab_mma $flag rc=$? in $(( $(date +%s) - start )) s"; grep -v Warn "$OUT/ab_mma$flag.log"
    done
  fi
done
