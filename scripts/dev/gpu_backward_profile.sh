#!/usr/bin/env bash
# On a GPU machine: ncu (--set full) on the tuned backward's two kernels (dkdv, dq) at
# (2, 16, 8192, 128) in BWD_DTYPES (default float32 bfloat16), the key figures printed and the
# reports in $OUT; then the conformance gradient properties (gpu profile) for the plain and the
# tuned backward.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
KEYS="^    (Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Executed Ipc A|Executed Instructions  |Static Shared|Block Limit (Reg|Shared)|L1/TEX Hit|Shared Memory|Warp Cycles Per Issued)|(pipeline|Stall|stall)"
for dtype in ${BWD_DTYPES:-float32 bfloat16}; do
  start=$(date +%s)
  timeout 200 ncu --clock-control none --set full -k regex:'dkdv_kernel|dq_kernel' --launch-skip 2 \
    --launch-count 2 python3 scripts/dev/profile_backward.py 128 4096 $dtype \
    > "$OUT/ncu_bwd_$dtype.txt" 2>&1
  echo "ncu backward $dtype rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^  [a-z_]|$KEYS" "$OUT/ncu_bwd_$dtype.txt" | grep -v "^    -" | head -40
done
for impl in numba numba-tuned-backward; do
  start=$(date +%s)
  timeout -s INT -k 20 ${GRAD_TIMEOUT:-240} python3 -m pytest -p conformance.plugin conformance --impl $impl --backward \
    -k gradient -p no:cacheprovider -W ignore -rfs -q > "$OUT/conformance-grad-$impl.log" 2>&1
  echo "pytest conformance --backward -k gradient ($impl): rc=$? in $(( $(date +%s) - start )) s"
  tail -3 "$OUT/conformance-grad-$impl.log"
done
