#!/bin/bash
# One device call after the FFI-frame tests share one API table (device2.sh's first
# pytest crashed in them: below): the same tests as device2.sh's first step.
# Usage: bash device3.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ffi_frame.py tests/test_lowering.py \
  "tests/test_gpu.py::test_an_exported_program_runs_in_a_process_that_never_lowered_it" -rs > "$D/tests.log" 2>&1; echo "rc $?"
grep -E "^(FAILED|ERROR|SKIPPED)" "$D/tests.log" | head -20; tail -n 1 "$D/tests.log"
