#!/bin/bash
# One device call at 8296fc4: the files this session changed, whole, on the GPU host
# (test_grad and test_mlp run the cuBLASLt path there; test_sharding runs on the host's
# four virtual CPU devices under jax 0.11.2), then the project's GPU check.
# Usage: bash device1.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_grad.py tests/test_sharding.py \
  tests/test_mlp.py::test_gradients_differentiate_again > "$D/tests.log" 2>&1; echo "rc $?"
grep -E "^(FAILED|ERROR)" "$D/tests.log" | head -20; tail -n 1 "$D/tests.log"
SKIP_BENCH=1 OUT="$D/check" timeout 200 bash scripts/gpu_check.sh > "$D/check.log" 2>&1; echo "rc $?"
tail -n 12 "$D/check.log"
