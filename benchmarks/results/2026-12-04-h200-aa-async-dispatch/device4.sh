#!/bin/bash
# One device call: the GPU tests with PjRt's asynchronous dispatch (the FFI handler on a
# worker thread, planning there for the untuned-plan test) and without it.
# Usage: bash device4.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
PJRT_GPU_ENABLE_ASYNC_DISPATCH=1 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ \
  > "$D/tests-async.log" 2>&1; echo "rc $?"; grep -E "^(FAILED|ERROR)" "$D/tests-async.log" | head; tail -n 1 "$D/tests-async.log"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > "$D/tests.log" 2>&1; echo "rc $?"
grep -E "^(FAILED|ERROR)" "$D/tests.log" | head; tail -n 1 "$D/tests.log"
