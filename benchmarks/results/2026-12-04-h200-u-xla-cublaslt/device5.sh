#!/bin/bash
# One device call: benchmarks.backward_variants at 8192x1024->4096 (the K=1024 shape) with the
# three losses (sum, sq, next), in two fresh processes. Usage: bash device5.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
for i in 1 2; do
  python -m benchmarks.backward_variants --shape 8192 1024 4096 --out "$D/bv$i" > "$D/bv$i.log" 2>&1
done
for i in 1 2; do echo "== bv$i"; head -n 9 "$D/bv$i/backward_variants.md"; done
