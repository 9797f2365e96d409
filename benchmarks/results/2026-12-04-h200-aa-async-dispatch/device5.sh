#!/bin/bash
# One device call at the final library: the new worker-thread planning test (fails
# without _nvmath._set_current), then the project's GPU check.
# Usage: bash device5.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k worker_thread > "$D/worker.log" 2>&1
echo "rc $?"; tail -n 1 "$D/worker.log"
SKIP_BENCH=1 OUT="$D/check" timeout 240 bash scripts/gpu_check.sh > "$D/check.log" 2>&1; echo "rc $?"
tail -n 12 "$D/check.log"
