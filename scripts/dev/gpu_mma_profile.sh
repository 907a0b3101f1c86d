#!/usr/bin/env bash
# On a GPU machine: where the tensor-core forward's time goes. Decoding kernel by kernel
# (decode_profile.py), then ncu (--set full) on the decoding launch of the main kernel and on
# (4, 16, 4096, 64) float16; the key figures are printed, the full reports land in $OUT.
# RUNS="name:script args ..." replaces the three ncu runs (DECODE=0 skips decode_profile).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
KEYS="^    (Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Executed Ipc A|Executed Instructions  |Dynamic Shared|Static Shared|Block Limit (Reg|Shared)|Waves Per SM|Grid Size|L2 Hit Rate|L1/TEX Hit)"
if [[ "${DECODE:-1}" != 0 ]]; then
  timeout 120 python3 scripts/dev/decode_profile.py > "$OUT/decode_profile.txt" 2>&1
  echo "decode_profile rc=$?"; cat "$OUT/decode_profile.txt"
fi
RUNS=${RUNS:-"decode:scripts/dev/decode_profile.py --once|d64:scripts/dev/profile_one.py 64 4096 float16 mma|d128:scripts/dev/profile_one.py 128 8192 float16 mma"}
IFS='|' read -ra RUN_LIST <<< "$RUNS"
for run in "${RUN_LIST[@]}"; do
  name=${run%%:*}
  start=$(date +%s)
  timeout 150 ncu --clock-control none --set full -k regex:flash_mma --launch-skip 1 \
    --launch-count 1 python3 ${run#*:} > "$OUT/ncu_$name.txt" 2>&1
  echo "ncu $name rc=$? in $(( $(date +%s) - start )) s"
  grep -E "$KEYS" "$OUT/ncu_$name.txt" | head -24
done
