#!/usr/bin/env bash
# On a GPU machine: where the causal tensor-core forward's time goes at N = 4096, beside the
# full one. PART names the steps, in order (default "spread ncu"):
#   spread  per_call_spread.py: calls timed one by one (after a synchronize) and behind a busy
#           GPU, float16 at (4,16,4096,64) and (2,16,4096,128), bfloat16 at the first;
#   ncu     ncu --set full on the fast variant at (4,16,4096,64) float16, full and causal
#           (a call launches flash_mma twice: the first call's two are skipped);
#   blocks  the same kernel's executed instructions and duration, full, at N = 1024, 2048
#           and 4096 (B = 4, H = 16, D = 64): a block's fixed instructions against a key
#           tile's, by a straight line through them;
#   sass    ncu's source counters on the same kernel at (4,16,4096,64) float16, full and causal:
#           the SASS with each instruction's executions, as CSV, and sass_regions.py's
#           reading of it (what a block executes outside the key loop).
set -u
. "$(dirname "$0")/steps.sh"  # OUT (default out), made; unbuffered Python
for PART in ${PART:-spread ncu}; do
  start=$(date +%s)
  if [[ "$PART" == spread ]]; then
    timeout 250 python3 -W ignore scripts/dev/per_call_spread.py > "$OUT/spread.log" 2>&1
    timeout 150 python3 -W ignore scripts/dev/per_call_spread.py --dtype bfloat16 \
      --shapes 4x16x4096x64 >> "$OUT/spread.log" 2>&1
    echo "per_call_spread rc=$? in $(( $(date +%s) - start )) s"; grep -v Warn "$OUT/spread.log"
  elif [[ "$PART" == ncu ]]; then
    KEYS="^    (Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Executed Instructions  |L2 Hit Rate|Block Limit Reg|Waves Per SM)"
    for causal in False top_left; do
      timeout 150 ncu --clock-control none --set full -k regex:flash_mma --launch-skip 2 \
        --launch-count 1 python3 scripts/dev/profile_one.py 64 4096 float16 mma $causal \
        > "$OUT/ncu_$causal.txt" 2>&1
      echo "ncu causal=$causal rc=$?"; grep -E "$KEYS" "$OUT/ncu_$causal.txt" | head -12
    done
  elif [[ "$PART" == blocks ]]; then
    for n in 1024 2048 4096; do
      timeout 150 ncu --clock-control none --metrics \
        smsp__inst_executed.sum,gpu__time_duration.sum,launch__grid_size \
        -k regex:flash_mma --launch-skip 2 --launch-count 1 python3 \
        scripts/dev/profile_one.py 64 $n float16 mma False > "$OUT/ncu_blocks_$n.txt" 2>&1
      echo "N=$n rc=$?"; grep -E "smsp__inst_executed.sum|gpu__time_duration.sum|launch__grid_size" \
        "$OUT/ncu_blocks_$n.txt"
    done
  elif [[ "$PART" == sass ]]; then
    for causal in False top_left; do
      timeout 200 ncu --clock-control none --section SourceCounters -k regex:flash_mma \
        --launch-skip 2 --launch-count 1 -o "$OUT/src_$causal" python3 \
        scripts/dev/profile_one.py 64 4096 float16 mma $causal > "$OUT/src_$causal.log" 2>&1
      ncu -i "$OUT/src_$causal.ncu-rep" --page source --csv --print-source sass \
        > "$OUT/sass_$causal.csv" && rm -f "$OUT/src_$causal.ncu-rep"
      echo "causal=$causal:"; python3 scripts/dev/sass_regions.py "$OUT/sass_$causal.csv" --warps 16384
    done
  fi
  echo "== $PART: $(( $(date +%s) - start )) s"
done
