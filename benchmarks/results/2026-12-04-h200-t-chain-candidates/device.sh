#!/bin/bash
# One device call: the 16-layer chain at 256x1024->1024 with each cuBLASLt candidate forced
# (ReLU and GELU, one process each), then the tuner's own pick in fresh processes, in turns,
# until about 500 s have passed. Usage: bash device.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$D/smi.csv"
probe() { echo "== $*" >> "$D/log.txt"; python -m benchmarks.probes.chain_candidates --out "$D" "$@" >> "$D/log.txt" 2>&1; }
for c in 0 1 2 3 4 5 6 7; do
  for a in relu gelu; do probe --activation $a --candidate $c; done
  [ $((c % 2)) = 1 ] && probe --activation relu
done
while [ $SECONDS -lt 500 ]; do probe --activation relu; probe --activation gelu; done
python -m benchmarks.probes.chain_candidates --summarize "$D" > /dev/null
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$D/smi.csv"
