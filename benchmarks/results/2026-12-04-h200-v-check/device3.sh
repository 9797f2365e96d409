#!/bin/bash
# One device call: benchmarks.probes.mlp_layers (which layer's "cublaslt" backward gains in
# an MLP block), ReLU and GELU, in two processes. Usage: bash device3.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
for i in 1 2; do
  python3 -m benchmarks.probes.mlp_layers --activation relu gelu --out "$D/p$i" > "$D/p$i.log" 2>&1
done
cat "$D"/p1/mlp_layers.md "$D"/p2/mlp_layers.md
