#!/usr/bin/env bash
# On a GPU machine: the forward call's host path (replay.py, the packed launch). Replayed
# calls against whole ones (replay_check.py); each call's time beside its kernel alone, the
# working tree against the copy in _ab_mma_old (call_timeline.py); the benchmark beside
# flash and cuDNN; verify's standard suite for numba-mma and numba (the SIMT kernel), side
# by side. Logs land in $OUT.
set -u
. "$(dirname "$0")/steps.sh"  # OUT (default out), made; unbuffered Python
start=$(date +%s)
timeout 200 python3 -W ignore scripts/dev/replay_check.py > "$OUT/replay_check.log" 2>&1
echo "replay_check rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/replay_check.log" | tail -12
start=$(date +%s)
timeout 200 python3 -W ignore scripts/dev/call_timeline.py --packages numba_kernels,_ab_mma_old \
  --n ${TIMELINE_N:-4096,8192} > "$OUT/call_timeline.log" 2>&1
echo "call_timeline rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/call_timeline.log" | grep -v Warn
if [[ "${BENCH:-1}" != 0 ]]; then
  forward_benchmark
fi
verify_side_by_side ${VERIFY:-numba-mma numba}
