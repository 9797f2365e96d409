#!/bin/bash
# Run 2: candidates 0 and 1 forced, in turns (ReLU, GELU), one process each, until about
# ${SECONDS_MAX:-330} s have passed; every batch's length is kept. Usage: bash device2.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$D/smi.csv"
probe() { echo "== $*" >> "$D/log.txt"; python -m benchmarks.probes.chain_candidates --out "$D" "$@" >> "$D/log.txt" 2>&1; }
while [ $SECONDS -lt ${SECONDS_MAX:-330} ]; do
  for c in 0 1; do for a in relu gelu; do probe --activation $a --candidate $c; done; done
done
python -m benchmarks.probes.chain_candidates --summarize "$D" > /dev/null
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$D/smi.csv"
