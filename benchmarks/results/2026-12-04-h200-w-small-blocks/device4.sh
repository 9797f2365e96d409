#!/bin/bash
# One device call after fused_mlp's mid-size rule: tests/test_mlp.py whole and the GPU-marked
# tests on the GPU; the MLP rows (GELU, ReLU); the block's forward alone at the rule's sizes
# (mlp_layers --forward); the mixed block at 1000 rows. Usage: bash device4.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
echo "$(date +%T) tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_mlp.py > "$D/test_mlp.log" 2>&1
timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > "$D/pytest.log" 2>&1
echo "$(date +%T) training mlp"
timeout 200 python3 -m benchmarks.training --part mlp --mlp-activations gelu relu --out "$D/training" > "$D/training.log" 2>&1
echo "$(date +%T) forward"
timeout 60 python3 -m benchmarks.probes.mlp_layers --forward --activation relu gelu --shape 512 1024 --shape 512 2048 \
  --shape 1000 1024 --shape 1024 1024 --out "$D/forward" > "$D/forward.log" 2>&1
echo "$(date +%T) mixed"
timeout 40 python3 -m benchmarks.probes.mixed_block --shape 1000 1024 --out "$D/mixed" > "$D/mixed.log" 2>&1
echo "$(date +%T) done"
echo "test_mlp.py: $(tail -n 1 "$D/test_mlp.log")"; echo "gpu: $(tail -n 1 "$D/pytest.log")"
cat "$D/training/training.md" 2>/dev/null || grep '^{' "$D/training.log"
cat "$D/forward/mlp_layers.md" 2>/dev/null || tail -n 5 "$D/forward.log"
cat "$D/mixed/mixed_block.md" 2>/dev/null || tail -n 5 "$D/mixed.log"
