#!/usr/bin/env bash
# On a GPU machine: the kernel's correctness battery and sanitizers (gpu_check --quick), an
# A/B timing against an older kernel when numba_kernels/_ab_old_flash_fwd.py exists (see
# scripts/dev/ab_kernel.py), where the time of a small call goes (scripts/dev/host_overhead.py), an
# ncu profile of the kernels for NCU_DIMS, then the benchmark (tile sweep, decoding with and
# without split-KV, every shape within BENCH_BUDGET seconds).
# STEPS picks the parts (default "check ab host ncu bench"). Everything lands in $OUT.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${STEPS:-check ab host ncu bench}
step() { [[ " $STEPS " == *" $1 "* ]]; }
if step check; then
  start=$(date +%s)
  timeout "${CHECK_TIMEOUT:-300}" python3 scripts/dev/gpu_check.py --quick --out "$OUT" \
    > "$OUT/check.log" 2>&1
  echo "gpu_check rc=$? in $(( $(date +%s) - start )) s"; tail -4 "$OUT/check.log"
fi
if step ab && [[ -f numba_kernels/_ab_old_flash_fwd.py ]]; then
  start=$(date +%s)
  timeout 150 python3 scripts/dev/ab_kernel.py > "$OUT/ab.log" 2>&1
  echo "ab rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/ab.log" | tail -5
fi
if step host; then
  timeout 150 python3 scripts/dev/host_overhead.py --out "$OUT" > "$OUT/host.log" 2>&1
  echo "host_overhead rc=$?"; grep -v Warning "$OUT/host.log" | head -12
fi
if step ncu; then
  for D in ${NCU_DIMS:-64 128}; do
    start=$(date +%s)
    timeout 120 ncu --clock-control none --set full -k regex:flash_fwd --launch-skip 1 \
      --launch-count 1 python3 scripts/dev/profile_one.py $D > "$OUT/ncu_D$D.txt" 2>&1
    echo "ncu D=$D rc=$? in $(( $(date +%s) - start )) s"
    grep -E "^    (Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Issue Slots Busy|No Eligible|Executed Ipc A|Executed Instructions  |Shared Memory|Block Limit Reg)" \
      "$OUT/ncu_D$D.txt" | head -16
  done
fi
if step bench; then
  python3 benchmarks/attention_speed.py ${BENCH_ARGS:---sweep --decode-first} \
    --budget-s "${BENCH_BUDGET:-240}" --out "$OUT" > "$OUT/bench.log" 2>&1
  echo "bench rc=$?"
  grep -E "sweep|numba|ceiling" "$OUT/bench.log" | head -70
fi
