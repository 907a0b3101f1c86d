#!/usr/bin/env bash
# On a GPU machine: the tuned (SIMT) backward's tiles. The shipped tiles against the 48 KB
# static ones, side by side (backward_tiles.py); compute-sanitizer racecheck and memcheck on
# small calls of every width (sanitize_backward.py); verify's standard backward suite of
# numba-tuned-backward; the backward benchmark beside PyTorch's backends (float32); the
# conformance gradient properties of numba-tuned-backward. Logs land in $OUT.
set -u
. "$(dirname "$0")/steps.sh"  # OUT (default out), made; unbuffered Python
start=$(date +%s)
timeout 240 python3 -W ignore scripts/dev/backward_tiles.py > "$OUT/backward_tiles.log" 2>&1
echo "backward_tiles rc=$? in $(( $(date +%s) - start )) s"
grep -v "Warn\|threads, " "$OUT/backward_tiles.log" | grep -v "^$" | tail -40
for tool in racecheck memcheck; do
  start=$(date +%s)
  timeout 200 compute-sanitizer --tool $tool --report-api-errors no \
    python3 scripts/dev/sanitize_backward.py > "$OUT/sanitize_bwd_$tool.log" 2>&1
  echo "compute-sanitizer $tool rc=$? in $(( $(date +%s) - start )) s: $(grep -E \
    'ERROR SUMMARY|RACECHECK SUMMARY|launches done' "$OUT/sanitize_bwd_$tool.log" | tr '\n' ' ')"
done
verify_side_by_side "numba-tuned-backward --backward"
start=$(date +%s)
timeout 200 python3 -W ignore benchmarks/backward_speed.py --out "$OUT" --n ${BENCH_N:-2048,8192} \
  --dtypes float32 --impls numba-tuned,efficient,math --budget-s 150 > "$OUT/backward_speed.log" 2>&1
echo "backward_speed rc=$? in $(( $(date +%s) - start )) s"
grep -v Warn "$OUT/backward_speed.log" | tail -16
start=$(date +%s)
timeout -s INT -k 20 ${GRAD_TIMEOUT:-150} python3 -m pytest conformance -p conformance.plugin \
  --impl numba-tuned-backward --backward -k gradient -p no:cacheprovider -W ignore -rfs -q \
  > "$OUT/conformance-grad.log" 2>&1
echo "pytest conformance --backward -k gradient: rc=$? in $(( $(date +%s) - start )) s"
tail -3 "$OUT/conformance-grad.log"
