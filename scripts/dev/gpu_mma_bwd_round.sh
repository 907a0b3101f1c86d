#!/usr/bin/env bash
# On a GPU machine, one round of work on the tensor-core backward (flash_mma_bwd.py). PART
# names the steps, in order (default "verify"):
#   verify       verify's standard backward suite for numba-mma, then the backward benchmark
#                beside PyTorch's backends (BWD_DTYPES, default the 16-bit ones), one after
#                the other (nothing else on the GPU while it times);
#   ab           the A/B of the forward and of the backward against the copy in
#                _ab_mma_old (scripts/dev/ab_mma.py; AB_TIMEOUT seconds each, default 150);
#   ab-verify    verify's forward and backward suites for numba-mma, and the forward suite
#                for numba (the SIMT kernel), side by side;
#   conformance  the conformance gradient properties of numba-mma, its warm-up timed, and an
#                ncu profile of the two kernels.
# Everything lands in $OUT.
set -u
. "$(dirname "$0")/steps.sh"  # OUT (default out), made; unbuffered Python
for PART in ${PART:-verify}; do
if [[ "$PART" == ab ]]; then
  for mode in "" --backward; do
    start=$(date +%s)
    timeout ${AB_TIMEOUT:-150} python3 -W ignore scripts/dev/ab_mma.py $mode > "$OUT/ab_mma$mode.log" 2>&1
    echo "ab_mma $mode rc=$? in $(( $(date +%s) - start )) s"; grep -v Warn "$OUT/ab_mma$mode.log"
  done
elif [[ "$PART" == ab-verify ]]; then
  verify_side_by_side "numba-mma" "numba-mma --backward" "numba"
elif [[ "$PART" == verify ]]; then
  start=$(date +%s)
  timeout 240 python3 -W ignore -m verify numba-mma --suite standard --backward --timeout 60 \
    --json "$OUT/backward-numba-mma.json" > "$OUT/backward-numba-mma.log" 2>&1
  echo "verify numba-mma --backward: rc=$? in $(( $(date +%s) - start )) s"
  grep -v "^  *ok\|Warn" "$OUT/backward-numba-mma.log" | tail -25
  start=$(date +%s)
  timeout 330 python3 -W ignore benchmarks/backward_speed.py --out "$OUT" \
    --n ${BWD_N:-1024,2048,4096,8192} --dtypes ${BWD_DTYPES:-bfloat16,float16} \
    --impls ${BWD_IMPLS:-numba-mma,numba-tuned,flash,efficient,cudnn,math} \
    --budget-s ${BENCH_BUDGET:-240} > "$OUT/backward_speed.log" 2>&1
  echo "backward_speed rc=$? in $(( $(date +%s) - start )) s"; grep -v Warn "$OUT/backward_speed.log"
elif [[ "$PART" == conformance ]]; then
  start=$(date +%s)
  timeout -s INT -k 20 ${GRAD_TIMEOUT:-300} python3 -m pytest -p conformance.plugin conformance --impl numba-mma \
    --backward -k gradient -p no:cacheprovider -W ignore -rfs -q --durations=5 \
    > "$OUT/conformance-grad-mma.log" 2>&1
  echo "pytest conformance --impl numba-mma --backward -k gradient: rc=$? in $(( $(date +%s) - start )) s"
  grep -i "warm\|compil\|passed\|failed\|slowest\|[0-9]s call" "$OUT/conformance-grad-mma.log" | tail -15
  KEYS="^    (Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Instructions  |Block Limit (Reg|Shared)|Warp Cycles Per Issued)|(Stall|stall)"
  for dtype in bfloat16; do
    timeout 150 ncu --clock-control none --set full -k regex:'mma_dkdv|mma_dq' --launch-skip 2 \
      --launch-count 2 python3 scripts/dev/profile_backward.py 128 4096 $dtype mma \
      > "$OUT/ncu_mma_bwd_$dtype.txt" 2>&1
    echo "ncu mma backward $dtype rc=$?"
    grep -E "^  [a-z_]|$KEYS" "$OUT/ncu_mma_bwd_$dtype.txt" | grep -v "^    -" | head -40
  done
else
  echo "PART: unknown step $PART (ab, ab-verify, verify, conformance)"; exit 2
fi
done
