#!/bin/bash
# One device call: the GPU check at this session's library (GPU-marked tests, quickstart,
# digits example, no benchmarks), the new CPU-mesh and lowering tests on the device, and
# gpu_tolerances.py (how tight two GPU tests can be).
# Usage: bash device4.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"; here=$(dirname "$0")
SKIP_BENCH=1 OUT="$D/check" bash scripts/gpu_check.sh > "$D/check.log" 2>&1; echo "gpu_check rc $?"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_lowering.py tests/test_implementation.py \
  tests/test_sharding.py -k "symbolic or disabled or return_aux or sequence_axis or split_rows_with_shared or ensemble_split or auto" \
  > "$D/new-tests.log" 2>&1; echo "new tests rc $?"; tail -n 3 "$D/new-tests.log"
timeout 200 python3 "$here/gpu_tolerances.py" > "$D/tolerances.txt" 2>&1; echo "tolerances rc $?"
cat "$D/tolerances.txt" | grep -v Warning
echo "== GPU check =="; tail -n 12 "$D/check.log"
