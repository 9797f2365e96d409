#!/bin/bash
# One device call: float32 MLP blocks, fwd+bwd then forward, every contender of
# benchmarks.probes.mlp_layers (fused_mlp "auto" runs XLA's program for float32 since
# e036d04; fused_mlp_cublaslt is the linked cuBLASLt block).
# Usage: bash device1.sh OUTDIR [--tf32]   (full float32 products, or TF32 with --tf32)
D=${1:?out dir}; tf=$2; mkdir -p "$D"
shapes="--shape 8192 1024 --shape 2048 1024 --shape 1024 1024"
for fw in "" "--forward"; do
  name="f32${tf:+-tf32}${fw:+-fwd}"
  echo "$(date +%T) $name"
  timeout 270 python3 -m benchmarks.probes.mlp_layers --dtype float32 $tf $fw --activation relu gelu \
    $shapes --out "$D/$name" > "$D/$name.log" 2>&1
  echo "$(date +%T) $name done (rc $?)"
done
for f in "$D"/f32*/mlp_layers.md; do cut -d'|' -f2-5,13-19 "$f" | tail -n +3; done
