#!/usr/bin/env bash
# On a GPU machine: pytest conformance (gpu profile) against our kernel, timed, then against
# each PyTorch SDPA backend (profile SDPA_PROFILE, default ci: a report of what each does
# within the device time). Logs land in $OUT.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
timeout "${CONFORMANCE_TIMEOUT:-480}" python3 -m pytest conformance -p no:cacheprovider -q \
  -W ignore --durations=5 > "$OUT/conformance-numba.log" 2>&1
echo "pytest conformance (numba, gpu profile): rc=$? in $(( $(date +%s) - start )) s"
head -4 "$OUT/conformance-numba.log"; tail -12 "$OUT/conformance-numba.log"
for impl in torch-flash torch-efficient torch-cudnn torch-math; do
  start=$(date +%s)
  timeout "${SDPA_TIMEOUT:-60}" python3 -m pytest conformance -p no:cacheprovider -q -W ignore \
    --impl "$impl" --profile "${SDPA_PROFILE:-ci}" -rfs > "$OUT/conformance-$impl.log" 2>&1
  echo "pytest conformance --impl $impl: rc=$? in $(( $(date +%s) - start )) s:" \
    "$(tail -1 "$OUT/conformance-$impl.log")"
done
