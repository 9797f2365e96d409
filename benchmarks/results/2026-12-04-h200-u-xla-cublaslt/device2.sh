#!/bin/bash
# One device call: benchmarks.probes.grad_floor (one layer's fwd+bwd beside its three GEMMs
# alone) at benchmarks.training's shapes, in fresh processes until about SECONDS_MAX (default
# 400) seconds have passed, at most three. Usage: bash device2.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$D/smi.csv"
for i in 1 2 3; do
  [ $SECONDS -lt "${SECONDS_MAX:-400}" ] || break
  python -m benchmarks.probes.grad_floor --out "$D/gf$i" > "$D/gf$i.log" 2>&1
done
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$D/smi.csv"
for f in "$D"/gf*/grad_floor.md; do echo "== $f"; cat "$f"; done
