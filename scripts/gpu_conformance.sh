#!/usr/bin/env bash
# On a GPU machine: pytest conformance (gpu profile) against our kernel, then the benchmark.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
timeout "${CONFORMANCE_TIMEOUT:-330}" python3 -m pytest conformance -p no:cacheprovider -q \
  -W ignore > "$OUT/conformance.log" 2>&1
echo "pytest conformance: rc=$? in $(( $(date +%s) - start )) s"; head -5 "$OUT/conformance.log"
tail -4 "$OUT/conformance.log"
python3 benchmarks/attention_speed.py --sweep --budget-s "${BENCH_BUDGET:-150}" --out "$OUT" \
  > "$OUT/bench.log" 2>&1
grep -E "sweep|numba|ceiling" "$OUT/bench.log" | head -60
