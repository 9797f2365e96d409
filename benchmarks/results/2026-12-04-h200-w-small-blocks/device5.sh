#!/bin/bash
# One device call: the mid-size rule's widths beyond D = 1024, 2048 (mlp_layers, ReLU and
# GELU, one process). Usage: bash device5.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
echo "$(date +%T) layers"
timeout 200 python3 -m benchmarks.probes.mlp_layers --activation relu gelu --shape 512 512 --shape 1024 512 \
  --shape 1000 768 --shape 512 4096 --shape 1024 4096 --out "$D/layers" > "$D/layers.log" 2>&1
echo "$(date +%T) done"
cat "$D/layers/mlp_layers.md" 2>/dev/null || grep '^{' "$D/layers.log"
