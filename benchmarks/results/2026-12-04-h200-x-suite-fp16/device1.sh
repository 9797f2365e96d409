#!/bin/bash
# One device call: the suite's short plan at the current library, then float16 MLP blocks
# (benchmarks.probes.mlp_layers --dtype float16) at the sizes where fused_mlp's "auto" runs
# bfloat16 blocks on cuBLASLt. Usage: bash device1.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
echo "$(date +%T) suite"
timeout 400 python3 -m benchmarks.run --quick --out "$D/suite" > "$D/suite.log" 2>&1
echo "$(date +%T) fp16 layers"
timeout 150 python3 -m benchmarks.probes.mlp_layers --dtype float16 --activation relu gelu \
  --shape 512 2048 --shape 1000 1024 --shape 1024 1024 --shape 2048 1024 --out "$D/fp16" > "$D/fp16.log" 2>&1
echo "$(date +%T) done"
tail -n 3 "$D/suite.log"
[ -f "$D/fp16/mlp_layers.md" ] && cat "$D/fp16/mlp_layers.md" || tail -n 5 "$D/fp16.log"
