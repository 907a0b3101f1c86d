# Steps shared by the GPU round scripts (sourced): each logs to $OUT and prints its summary.
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

# The forward benchmark beside flash and cuDNN, N = 4096 and 8192, the 16-bit dtypes.
forward_benchmark() {
  local start=$(date +%s)
  timeout 200 python3 -W ignore benchmarks/attention_speed.py --out "$OUT" --n 4096,8192 \
    --dtypes float16,bfloat16 --impls numba-mma,flash,cudnn --budget-s ${BENCH_BUDGET:-120} \
    > "$OUT/attention_speed.log" 2>&1
  echo "attention_speed rc=$? in $(( $(date +%s) - start )) s"
  grep -v Warn "$OUT/attention_speed.log" | tail -30
}

# verify's standard suite for each argument (an implementation and its options, e.g.
# "numba-mma --backward"), all at once.
verify_side_by_side() {
  local start=$(date +%s) run name
  for run in "$@"; do
    name=$(echo $run | tr -d ' -')
    (timeout 200 python3 -W ignore -m verify $run --suite standard --timeout 60 \
       --json "$OUT/verify-$name.json" > "$OUT/verify-$name.log" 2>&1
     echo "rc=$?" >> "$OUT/verify-$name.log") &
  done
  wait
  echo "verify $*, side by side: $(( $(date +%s) - start )) s"
  grep -h "FAIL\|PASS\|rc=" "$OUT"/verify-*.log | tail -16
}
