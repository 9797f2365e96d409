#!/bin/bash
# One device call: tests/test_mlp.py whole on the GPU (every fused_mlp test then runs the
# cuBLASLt path), then the GPU check without its training part. Usage: bash device1.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
python3 -m pytest -q -p no:cacheprovider tests/test_mlp.py > "$D/test_mlp.log" 2>&1
SKIP_TRAINING=1 OUT="$D/check" bash scripts/gpu_check.sh > "$D/check.log" 2>&1
echo "test_mlp.py: $(tail -n 1 "$D/test_mlp.log")"; cat "$D/check.log"
