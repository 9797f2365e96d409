#!/bin/bash
# One device call at the session's final library: fast_rounding.py again (the CPU-only
# emulation leaves the GPU's programs as they were), the changed test files on the GPU,
# the re-ordered plan test under asynchronous dispatch, then the project's GPU check.
# Usage: bash device3.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
here=$(dirname "$0")
timeout 120 python3 "$here/fast_rounding.py" > "$D/fast_rounding.md" 2>&1; echo "rc $?"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_grad.py tests/test_sharding.py \
  tests/test_dense.py -k "not test_dense.py or fast or compute_type" > "$D/tests.log" 2>&1; echo "rc $?"
grep -E "^(FAILED|ERROR)" "$D/tests.log" | head -20; tail -n 1 "$D/tests.log"
PJRT_GPU_ENABLE_ASYNC_DISPATCH=1 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
  -k plan_made_without_tuning > "$D/tests-async.log" 2>&1; echo "rc $?"; tail -n 1 "$D/tests-async.log"
SKIP_BENCH=1 OUT="$D/check" timeout 200 bash scripts/gpu_check.sh > "$D/check.log" 2>&1; echo "rc $?"
tail -n 12 "$D/check.log"
cat "$D/fast_rounding.md"
