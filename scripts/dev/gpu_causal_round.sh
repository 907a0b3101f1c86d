#!/usr/bin/env bash
# On a GPU machine: the tensor-core forward's causal speed-up, measured two ways, then its
# conformance suite. (1) host_overhead.py: each full and causal shape's whole call and its
# main kernel alone (launched back to back), bfloat16, D = 64 and 128, N = 4096 and 8192;
# (2) the benchmark beside PyTorch's flash and cuDNN backends (16-bit dtypes, the same N);
# (3) pytest conformance --impl numba-mma (gpu profile). Logs land in $OUT.
set -u
. "$(dirname "$0")/steps.sh"  # OUT (default out), made; unbuffered Python
start=$(date +%s)
timeout 150 python3 -W ignore scripts/dev/host_overhead.py --out "$OUT" --dtype bfloat16 \
  --n 4096,8192 --d 64,128 > "$OUT/host_overhead.log" 2>&1
echo "host_overhead rc=$? in $(( $(date +%s) - start )) s"; grep -v "Warn\|^ \|^---\|ncalls" "$OUT/host_overhead.log" | head -20
forward_benchmark
start=$(date +%s)
timeout -s INT -k 20 ${CONFORMANCE_TIMEOUT:-220} python3 -m pytest -p conformance.plugin conformance --impl numba-mma \
  -p no:cacheprovider -W ignore -rfs -q > "$OUT/conformance-numba-mma.log" 2>&1
echo "pytest conformance --impl numba-mma: rc=$? in $(( $(date +%s) - start )) s"
grep -E "passed|failed|FAILED|error" "$OUT/conformance-numba-mma.log" | tail -6
