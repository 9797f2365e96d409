#!/bin/bash
# One device call: benchmarks.probes.mlp_layers with its "bgrada" contender (the second
# layer's kernel and bias gradients from one BGRADA GEMM, its forward XLA's), ReLU and GELU
# blocks from 100 to 8192 rows, in two processes. Usage: bash device2.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
SHAPES="--shape 100 768 --shape 128 1024 --shape 256 1024 --shape 512 1024 --shape 512 2048 --shape 1000 1024 --shape 1024 1024 --shape 4096 512 --shape 2048 1024 --shape 8192 1024"
for i in 1 2; do
  echo "$(date +%T) layers p$i"
  # shellcheck disable=SC2086
  timeout 280 python3 -m benchmarks.probes.mlp_layers --activation relu gelu $SHAPES --out "$D/layers$i" > "$D/layers$i.log" 2>&1
done
echo "$(date +%T) done"
for i in 1 2; do
  f="$D/layers$i/mlp_layers.md"; [ -f "$f" ] && cat "$f" || { echo "missing $f"; grep '^{' "$D/layers$i.log"; }
done
