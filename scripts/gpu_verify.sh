#!/usr/bin/env bash
# On a GPU machine: the kernel's battery and sanitizers, then verify's standard suite against
# our kernel, every PyTorch SDPA backend and JAX. Logs and certificates go to $OUT/results.tgz.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT/v"
export PYTHONUNBUFFERED=1
python3 scripts/gpu_check.py --quick --out "$OUT/v" > "$OUT/v/check.log" 2>&1
echo "gpu_check rc=$?"; tail -3 "$OUT/v/check.log"
for impl in numba torch-math torch-efficient torch-flash torch-cudnn jax-xla jax-cudnn; do
  start=$(date +%s)
  timeout 200 python3 -W ignore -m verify "$impl" --suite standard \
    --json "$OUT/v/verify-$impl.json" > "$OUT/v/verify-$impl.log" 2>&1
  rc=$?
  echo "verify $impl: rc=$rc $(( $(date +%s) - start )) s: $(grep -E ' passed, ' "$OUT/v/verify-$impl.log" | tail -1)"
done
tar czf "$OUT/results.tgz" -C "$OUT" v && rm -r "$OUT/v"
