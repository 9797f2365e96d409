#!/bin/bash
# One device call: how the GPU rounds COMPUTE_32F_FAST_* operands (fast_rounding.py), then
# the test files that check the CPU path's new emulation of it, on the GPU.
# Usage: bash device2.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
here=$(dirname "$0")
timeout 120 python3 "$here/fast_rounding.py" > "$D/fast_rounding.md" 2>&1; echo "rc $?"
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_dense.py tests/test_grad.py tests/test_gpu.py \
  tests/test_reference.py > "$D/tests.log" 2>&1; echo "rc $?"
grep -E "^(FAILED|ERROR)" "$D/tests.log" | head -20; tail -n 2 "$D/tests.log"
cat "$D/fast_rounding.md"
