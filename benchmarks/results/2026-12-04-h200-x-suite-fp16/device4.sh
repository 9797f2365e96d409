#!/bin/bash
# One device call at the widened mid-size rule: tests/test_mlp.py whole on the GPU;
# benchmarks.probes.mlp_layers with fused_mlp's "auto" beside the variants (bf16 and fp16,
# inside and just outside the rule's rows); the GPU check without benchmarks.
# Usage: bash device4.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
echo "$(date +%T) test_mlp"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_mlp.py > "$D/test_mlp.log" 2>&1
echo "$(date +%T) layers"
timeout 200 python3 -m benchmarks.probes.mlp_layers --dtype bfloat16 float16 --activation relu gelu \
  --shape 1000 1024 --shape 1280 1024 --shape 1536 1024 --shape 1536 768 --shape 2048 1024 \
  --out "$D/layers" > "$D/layers.log" 2>&1
echo "$(date +%T) check"
SKIP_BENCH=1 OUT="$D/check" timeout 150 bash scripts/gpu_check.sh > "$D/check.log" 2>&1
echo "$(date +%T) done"
tail -n 1 "$D/test_mlp.log"
tail -n 12 "$D/check.log"
[ -f "$D/layers/mlp_layers.md" ] && cut -d'|' -f2-4,11-17 "$D/layers/mlp_layers.md" || tail -n 5 "$D/layers.log"
