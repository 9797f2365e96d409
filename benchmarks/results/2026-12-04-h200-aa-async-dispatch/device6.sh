#!/bin/bash
# One device call at the final library (after the review fixes): the changed CPU-path
# and sharding tests on the GPU host, the GPU tests under asynchronous dispatch, then
# the project's GPU check (which runs the GPU tests without it).
# Usage: bash device6.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_dense.py tests/test_grad.py tests/test_sharding.py \
  -k "fast or ensemble" > "$D/tests.log" 2>&1; echo "rc $?"
grep -E "^(FAILED|ERROR)" "$D/tests.log" | head; tail -n 1 "$D/tests.log"
PJRT_GPU_ENABLE_ASYNC_DISPATCH=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ \
  > "$D/tests-async.log" 2>&1; echo "rc $?"; grep -E "^(FAILED|ERROR)" "$D/tests-async.log" | head; tail -n 1 "$D/tests-async.log"
SKIP_BENCH=1 OUT="$D/check" timeout 200 bash scripts/gpu_check.sh > "$D/check.log" 2>&1; echo "rc $?"
tail -n 12 "$D/check.log"
