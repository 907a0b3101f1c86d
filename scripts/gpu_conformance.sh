#!/usr/bin/env bash
# On a GPU machine, the stages named as arguments (default: kernel numba sdpa), logs in $OUT:
#   kernel      the GPU tests (pytest -m gpu: the battery on poisoned outputs, replay,
#               strided inputs, mma.sync's rounding, sanitizers)
#   numba       pytest conformance against our kernel, gpu profile, timed
#   sdpa        pytest conformance against each PyTorch SDPA backend: gpu profile,
#               SDPA_EXAMPLES examples a property, no shrinking (a survey of what each does)
#   numba+sdpa  both at once, the survey in the background (the GPU has room for both; the
#               numba time is then an upper bound)
#   cache       the numba stage twice on an empty kernel cache (numba_kernels/compile_cache.py):
#               the first run compiles every variant on every core, the second compiles none
# CONFORMANCE_ARGS: more pytest options for the numba stage (e.g. --no-shrink).
# SDPA_IMPLS: the backends to survey (default all four).
# Time limits: CONFORMANCE_TIMEOUT (numba), SDPA_TIMEOUT (each backend), in seconds. A suite
# that runs out of time is interrupted (SIGINT), so pytest still prints the failures so far.
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -u/p' "$0" | grep "^#" | sed 's/^# \{0,1\}//'; exit 0
fi
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
summary() { grep -E "^(conformance:|FAILED|=+ .*(passed|failed|error).* =+$)" "$1" | tail -${2:-4}; }

run_numba() {
  local start=$(date +%s)
  timeout -s INT -k 30 "${CONFORMANCE_TIMEOUT:-540}" python3 -m pytest conformance \
    -p no:cacheprovider -W ignore -rfs --durations=15 ${CONFORMANCE_ARGS:-} \
    > "$OUT/conformance-numba.log" 2>&1
  echo "pytest conformance (numba): rc=$? in $(( $(date +%s) - start )) s"
  head -5 "$OUT/conformance-numba.log" | grep conformance:
  summary "$OUT/conformance-numba.log" 8
}

run_sdpa() {
  for impl in ${SDPA_IMPLS:-torch-flash torch-efficient torch-cudnn torch-math}; do
    local start=$(date +%s)
    timeout -s INT -k 30 "${SDPA_TIMEOUT:-120}" python3 -m pytest conformance -p no:cacheprovider \
      -W ignore -rfs --tb=no -vv --impl "$impl" --max-examples "${SDPA_EXAMPLES:-10}" \
      --no-shrink > "$OUT/conformance-$impl.log" 2>&1
    echo "pytest conformance --impl $impl: rc=$? in $(( $(date +%s) - start )) s:" \
      "$(summary "$OUT/conformance-$impl.log" 1)"
  done
}

stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(kernel numba sdpa)
for stage in "${stages[@]}"; do
  start=$(date +%s)
  case $stage in
    kernel)
      python3 -m pytest -q -m gpu tests/test_gpu.py > "$OUT/check.log" 2>&1
      echo "pytest -m gpu: rc=$? in $(( $(date +%s) - start )) s"; tail -3 "$OUT/check.log" ;;
    numba) run_numba ;;
    cache)
      export FLASH_KERNEL_CACHE=$(mktemp -d)
      for run in first second; do
        echo "== $run run on the kernel cache $FLASH_KERNEL_CACHE"
        run_numba; cp "$OUT/conformance-numba.log" "$OUT/conformance-numba-$run.log"
        grep -E "conformance: (compiling|numba:)" "$OUT/conformance-numba-$run.log"
      done ;;
    sdpa) run_sdpa ;;
    numba+sdpa)
      run_sdpa > "$OUT/sdpa-summary.log" 2>&1 &
      run_numba
      wait
      cat "$OUT/sdpa-summary.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
