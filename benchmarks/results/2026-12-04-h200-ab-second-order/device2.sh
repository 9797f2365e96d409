#!/bin/bash
# One device call at 154591a (jax.export; the handler registered at import): the new
# export, FFI-frame and lowering tests on the GPU host (flatbuffers carried as a wheel with
# nvmath), then the project's GPU check (all GPU tests, the new exported-program test among them).
# Usage: bash device2.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
python3 -c "import flatbuffers, jax; print('flatbuffers', flatbuffers.__version__ if hasattr(flatbuffers, '__version__') else '?', 'jax', jax.__version__)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_ffi_frame.py tests/test_lowering.py \
  "tests/test_gpu.py::test_an_exported_program_runs_in_a_process_that_never_lowered_it" -rs > "$D/tests.log" 2>&1; echo "rc $?"
grep -E "^(FAILED|ERROR|SKIPPED)" "$D/tests.log" | head -20; tail -n 1 "$D/tests.log"
SKIP_BENCH=1 OUT="$D/check" timeout 200 bash scripts/gpu_check.sh > "$D/check.log" 2>&1; echo "rc $?"
tail -n 12 "$D/check.log"
