#!/usr/bin/env bash
# On a GPU machine: the tensor-core forward without its V pre-pass (a fast variant, then a
# careful one for the blocks it deferred). PART names the steps, in order (default "ab check"):
#   ab     the forward A/B against the copy in _ab_mma_old (ab_mma.py, alone on the GPU);
#   check  side by side: verify's standard suites (numba-mma forward and backward, numba),
#          and gpu_check.py's battery and compute-sanitizer racecheck and memcheck (a V tile
#          holding NaN, under a mask: the careful variant runs);
#   host   replayed calls against whole ones (replay_check.py), then each call beside its
#          kernel alone, against _ab_mma_old and against calls without the careful launch
#          (call_timeline.py);
#   split  careful_split_check.py, alone and under compute-sanitizer memcheck and racecheck;
#   bench  the forward benchmark beside flash, efficient and cuDNN, decoding first;
#   tf32   scripts/dev/tf32_probe.py (issue 16: float32 on tensor cores);
#   ncu    ncu --set full on the main kernel at (4, 16, 8192, 64) bfloat16, the working tree's
#          fast variant (a call launches flash_mma twice: skip the first call's two) and the
#          copy in _ab_mma_old (one launch a call);
#   conformance  pytest conformance --impl numba-mma (its default profile).
# Everything lands in $OUT.
set -u
. "$(dirname "$0")/steps.sh"  # OUT (default out), made; unbuffered Python
for PART in ${PART:-ab check}; do
  start=$(date +%s)
  if [[ "$PART" == ab ]]; then
    timeout ${AB_TIMEOUT:-200} python3 -W ignore scripts/dev/ab_mma.py > "$OUT/ab_mma.log" 2>&1
    echo "ab_mma rc=$? in $(( $(date +%s) - start )) s"; grep -v Warn "$OUT/ab_mma.log"
  elif [[ "$PART" == check ]]; then
    (timeout 300 python3 scripts/dev/gpu_check.py --quick --out "$OUT" > "$OUT/check.log" 2>&1
     echo "gpu_check rc=$?" >> "$OUT/check.log") &
    verify_side_by_side "numba-mma" "numba-mma --backward" "numba"
    wait
    tail -6 "$OUT/check.log"
  elif [[ "$PART" == host ]]; then
    timeout 150 python3 -W ignore scripts/dev/replay_check.py > "$OUT/replay_check.log" 2>&1
    echo "replay_check rc=$?"; tail -12 "$OUT/replay_check.log"
    timeout 200 python3 -W ignore scripts/dev/call_timeline.py \
      --packages numba_kernels,_ab_mma_old,numba_kernels:nocareful --n 4096,8192 \
      > "$OUT/call_timeline.log" 2>&1
    echo "call_timeline rc=$? in $(( $(date +%s) - start )) s"; grep -v Warn "$OUT/call_timeline.log"
  elif [[ "$PART" == split ]]; then
    timeout 200 python3 -W ignore scripts/dev/careful_split_check.py > "$OUT/split.log" 2>&1
    echo "careful_split_check rc=$?"; tail -8 "$OUT/split.log"
    for tool in memcheck racecheck; do
      timeout 200 compute-sanitizer --tool $tool --report-api-errors no python3 -W ignore \
        scripts/dev/careful_split_check.py > "$OUT/split_$tool.log" 2>&1
      echo "careful_split_check under $tool rc=$?"; tail -3 "$OUT/split_$tool.log"
    done
  elif [[ "$PART" == bench ]]; then
    timeout 300 python3 -W ignore benchmarks/attention_speed.py --out "$OUT" --n 4096,8192 \
      --dtypes float16,bfloat16 --impls numba-mma,flash,efficient,cudnn --decode-first \
      --budget-s ${BENCH_BUDGET:-150} > "$OUT/attention_speed.log" 2>&1
    echo "attention_speed rc=$? in $(( $(date +%s) - start )) s"
    grep -v "Warn\|^causal speed-up" "$OUT/attention_speed.log" | tail -45
    grep "^causal speed-up" "$OUT/attention_speed.log"
  elif [[ "$PART" == ncu ]]; then
    KEYS="^    (Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Executed Instructions  |Block Limit Reg|L2 Hit Rate)"
    for run in new:2:numba_kernels old:1:_ab_mma_old; do
      IFS=: read -r name skip package <<< "$run"
      timeout 150 ncu --clock-control none --set full -k regex:flash_mma --launch-skip $skip \
        --launch-count 1 python3 scripts/dev/profile_one.py 64 8192 bfloat16 mma False \
        $package > "$OUT/ncu_$name.txt" 2>&1
      echo "ncu $name rc=$?"; grep -E "$KEYS" "$OUT/ncu_$name.txt" | head -12
    done
  elif [[ "$PART" == conformance ]]; then
    timeout -s INT -k 20 ${CONFORMANCE_TIMEOUT:-240} python3 -m pytest -p conformance.plugin conformance \
      --impl numba-mma -p no:cacheprovider -W ignore -rfs -q > "$OUT/conformance.log" 2>&1
    echo "pytest conformance --impl numba-mma: rc=$? in $(( $(date +%s) - start )) s"
    grep -E "passed|failed|FAILED|error" "$OUT/conformance.log" | tail -6
  elif [[ "$PART" == tf32 ]]; then
    timeout 200 python3 -W ignore scripts/dev/tf32_probe.py > "$OUT/tf32_probe.log" 2>&1
    echo "tf32_probe rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/tf32_probe.log"
  fi
done
