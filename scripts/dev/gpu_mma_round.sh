#!/usr/bin/env bash
# On a GPU machine, one round of work on the tensor-core forward: the A/B against the copy in
# _ab_mma_old (scripts/dev/ab_mma.py, alone on the GPU), the benchmark beside PyTorch's
# backends (16-bit dtypes, N = 4096 and 8192, decoding first), then side by side: the
# battery, sanitizers and verify's standard suite for numba and numba-mma
# (scripts/gpu_verify.sh), and the conformance gradient properties of the tuned backward.
# Everything lands in $OUT.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [[ -d _ab_mma_old ]]; then
  start=$(date +%s)
  timeout 200 python3 -W ignore scripts/dev/ab_mma.py > "$OUT/ab_mma.log" 2>&1
  echo "ab_mma rc=$? in $(( $(date +%s) - start )) s"; grep -v Warn "$OUT/ab_mma.log"
fi
start=$(date +%s)
timeout 240 python3 -W ignore benchmarks/attention_speed.py --out "$OUT" --n 4096,8192 \
  --dtypes float16,bfloat16 --impls numba-mma,flash,efficient,cudnn --decode-first \
  --budget-s ${BENCH_BUDGET:-120} > "$OUT/attention_speed.log" 2>&1
echo "attention_speed rc=$? in $(( $(date +%s) - start )) s"; tail -40 "$OUT/attention_speed.log"
(start=$(date +%s)
 timeout -s INT -k 20 ${GRAD_TIMEOUT:-200} python3 -m pytest -p conformance.plugin conformance \
   --impl numba-tuned-backward --backward -k gradient -p no:cacheprovider -W ignore -rfs -q \
   > "$OUT/conformance-grad-tuned.log" 2>&1
 echo "conformance gradients (tuned): rc=$? in $(( $(date +%s) - start )) s" \
   >> "$OUT/conformance-grad-tuned.log") &
STEPS="check verify" IMPLS="numba numba-mma" JOB_TIMEOUT=200 OUT=$OUT/v bash scripts/gpu_verify.sh
wait
tail -4 "$OUT/conformance-grad-tuned.log"
