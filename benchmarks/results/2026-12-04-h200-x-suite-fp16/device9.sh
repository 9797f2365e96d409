#!/bin/bash
# One device call: MLP blocks on 8192 rows in bfloat16 and float16, where fused_mlp's "auto"
# links a GELU layer to the next GEMM (DGELU) and fuses large ReLU layers feeding a layer;
# the link was measured in bfloat16 only. Usage: bash device9.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
echo "$(date +%T) layers"
timeout 450 python3 -m benchmarks.probes.mlp_layers --dtype bfloat16 float16 --activation relu gelu \
  --shape 8192 1024 --shape 8192 4096 --out "$D/layers" > "$D/layers.log" 2>&1
echo "$(date +%T) done (rc $?)"
[ -f "$D/layers/mlp_layers.md" ] && cut -d'|' -f2-4,11-17 "$D/layers/mlp_layers.md" || tail -n 5 "$D/layers.log"
