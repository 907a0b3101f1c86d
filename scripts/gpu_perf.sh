#!/usr/bin/env bash
# On a GPU machine: the kernel's correctness battery and sanitizers (gpu_check --quick), an
# ncu profile of the D = 64 and D = 128 kernels, then the benchmark (tile sweep, decoding with
# and without split-KV, every shape within BENCH_BUDGET seconds). Everything lands in $OUT.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
python3 scripts/gpu_check.py --quick --out "$OUT" > "$OUT/check.log" 2>&1
echo "gpu_check rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/check.log"
for D in ${NCU_DIMS:-64 128}; do
  start=$(date +%s)
  timeout 120 ncu --clock-control none --set full -k regex:flash_fwd --launch-skip 1 \
    --launch-count 1 python3 scripts/profile_one.py $D > "$OUT/ncu_D$D.txt" 2>&1
  echo "ncu D=$D rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^    (Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Executed Ipc A|Shared Memory|Block Limit Reg)" \
    "$OUT/ncu_D$D.txt" | head -14
done
python3 benchmarks/attention_speed.py --sweep --decode-first --budget-s "${BENCH_BUDGET:-240}" \
  --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
grep -E "sweep|numba|ceiling" "$OUT/bench.log" | head -70
