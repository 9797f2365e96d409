#!/bin/bash
# One device call: benchmarks.probes.mlp_layers on small ReLU blocks (where fused_mlp's
# "auto" has no rule yet) and benchmarks.probes.mixed_block (GELU and ReLU layers in one
# block), each in two processes, in turns. Usage: bash device1.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
SMALL="--shape 100 768 --shape 128 1024 --shape 256 1024 --shape 256 2048 --shape 512 1024 --shape 512 2048 --shape 1000 1024 --shape 1024 1024 --shape 4096 512"
for i in 1 2; do
  echo "$(date +%T) layers p$i"
  # shellcheck disable=SC2086
  timeout 200 python3 -m benchmarks.probes.mlp_layers --activation relu $SMALL --out "$D/layers$i" > "$D/layers$i.log" 2>&1
  echo "$(date +%T) mixed p$i"
  timeout 90 python3 -m benchmarks.probes.mixed_block --out "$D/mixed$i" > "$D/mixed$i.log" 2>&1
done
echo "$(date +%T) done"
for f in "$D"/layers1/mlp_layers.md "$D"/layers2/mlp_layers.md "$D"/mixed1/mixed_block.md "$D"/mixed2/mixed_block.md; do
  [ -f "$f" ] && cat "$f" || echo "missing $f"
done
