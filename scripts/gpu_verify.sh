#!/usr/bin/env bash
# On a GPU machine: verify's suites against our kernel, every PyTorch SDPA backend and JAX,
# the kernel's A/B against an older revision (AB_OLD, scripts/ab.py), the GPU tests.
# STEPS picks the parts (default "ab check verify broken findings scale"; "backward" runs the
# standard backward suite on BACKWARD_IMPLS); logs and certificates go
# to $OUT. The A/B runs alone (timing); the correctness steps run side by side, each within
# JOB_TIMEOUT seconds (default 420).
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -u/p' "$0" | grep "^#" | sed 's/^# \{0,1\}//'; exit 0
fi
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX would take 75% of the GPU's memory at start
# The logs and certificates are packed into $OUT/results.tgz at the end, also when the run is
# stopped (SIGTERM, SIGINT): a machine that returns a limited number of files gets them all.
pack() {
  tar czf /tmp/results.tgz -C "$OUT" . && mv /tmp/results.tgz "$OUT/" \
    && find "$OUT" -type f ! -name results.tgz -delete
}
trap pack EXIT
trap 'exit 143' TERM INT
STEPS=${STEPS:-ab check verify broken findings scale}
IMPLS=${IMPLS:-numba numba-mma numba-wgmma numba-mma-highest torch-math torch-efficient torch-flash torch-cudnn jax-xla jax-cudnn}
SCALE_IMPLS=${SCALE_IMPLS:-numba torch-efficient}
BACKWARD_IMPLS=${BACKWARD_IMPLS:-numba numba-mma-highest torch-math torch-efficient torch-flash torch-cudnn jax-xla jax-cudnn}
step() { [[ " $STEPS " == *" $1 "* ]]; }
summary() {  # the failure map and the verdict line of a verify log
  grep -E "^(failure map|  |fully masked|VERIFY BUG|.* passed, .* failed)" "$1" | head -8
}
if step ab && [[ -n "${AB_OLD:-}" ]]; then  # AB_OLD: the older git revision (scripts/ab.py)
  start=$(date +%s)
  timeout 400 python3 scripts/ab.py --old "$AB_OLD" > "$OUT/ab.log" 2>&1
  echo "ab rc=$? in $(( $(date +%s) - start )) s"; tail -7 "$OUT/ab.log"
fi
pids=()
if step check; then
  (timeout "${JOB_TIMEOUT:-420}" python3 -m pytest -q -m gpu tests/ > "$OUT/check.log" 2>&1;
   echo "pytest -m gpu rc=$?" >> "$OUT/check.log") &
  pids+=($!)
fi
if step verify; then
  for impl in $IMPLS; do
    (start=$(date +%s)
     timeout "${JOB_TIMEOUT:-420}" python3 -W ignore -m verify "$impl" --suite standard --timeout 60 \
       --json "$OUT/verify-$impl.json" > "$OUT/verify-$impl.log" 2>&1
     echo "rc=$? in $(( $(date +%s) - start )) s" >> "$OUT/verify-$impl.log") &
    pids+=($!)
  done
fi
if step backward; then
  for impl in $BACKWARD_IMPLS; do
    (start=$(date +%s)
     timeout "${JOB_TIMEOUT:-420}" python3 -W ignore -m verify "$impl" --suite standard --backward --timeout 60 \
       --json "$OUT/backward-$impl.json" > "$OUT/backward-$impl.log" 2>&1
     echo "rc=$? in $(( $(date +%s) - start )) s" >> "$OUT/backward-$impl.log") &
    pids+=($!)
  done
fi
if step broken; then
  (timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_verify.py \
     -k "default_stream" > "$OUT/broken.log" 2>&1; echo "rc=$?" >> "$OUT/broken.log") &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done
if step check; then tail -4 "$OUT/check.log"; fi
if step verify; then
  for impl in $IMPLS; do
    echo "== verify $impl (standard): $(tail -1 "$OUT/verify-$impl.log")"
    summary "$OUT/verify-$impl.log"
  done
fi
if step backward; then
  for impl in $BACKWARD_IMPLS; do
    echo "== verify $impl (standard backward): $(tail -1 "$OUT/backward-$impl.log")"
    summary "$OUT/backward-$impl.log"
  done
fi
if step broken; then echo "== broken default-stream kernel: $(tail -2 "$OUT/broken.log" | head -1)"; fi
if step findings; then
  timeout 120 python3 docs/findings/forward_repro.py > "$OUT/findings.log" 2>&1
  echo "== findings rc=$?"; cat "$OUT/findings.log" | grep -v Warning | head -40
fi
if step scale; then
  # SCALE_IMPLS run side by side: at most two or three, the cases fill much of the memory
  spids=()
  for impl in $SCALE_IMPLS; do
    (start=$(date +%s)
     timeout "${SCALE_TIMEOUT:-420}" python3 -W ignore -m verify "$impl" --suite scale \
       --timeout 120 --json "$OUT/scale-$impl.json" > "$OUT/scale-$impl.log" 2>&1
     echo "rc=$? in $(( $(date +%s) - start )) s" >> "$OUT/scale-$impl.log") &
    spids+=($!)
  done
  for p in "${spids[@]}"; do wait "$p"; done
  for impl in $SCALE_IMPLS; do
    echo "== scale $impl: $(tail -1 "$OUT/scale-$impl.log")"
    grep -E "^scale: |passed, " "$OUT/scale-$impl.log" | head -8
  done
fi
