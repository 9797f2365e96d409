#!/usr/bin/env bash
# Device call (al) 4: benchmarks.probes.pad_width on more N (and the 4224 aligned control), twice.
set -u
H=$1; LIMIT=${2:-585}
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
S=$OUT/summary.md
echo "commit $H (+ benchmarks/probes/pad_width.py); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" > $S
C="--case 8192 1024 4224 relu fwd --case 8192 1024 4224 gelu fwd --case 8192 1024 1025 relu fwd --case 8192 1024 1025 gelu fwd --case 8192 1024 2049 gelu fwd --case 8192 4096 4100 gelu fwd --case 8192 1024 8193 relu fwd --case 8192 1024 8193 gelu fwd --case 8192 4096 16385 gelu fwd --case 4096 1024 1025 gelu fwd --case 8192 1024 1025 gelu fwd+bwd"
for i in 3 4; do
  if [ $SECONDS -gt $((LIMIT - 200)) ]; then echo "## pw$i skipped at ${SECONDS}s" >> $S; continue; fi
  timeout $((LIMIT - SECONDS)) python3 -m benchmarks.probes.pad_width --out $OUT/pw$i $C > $OUT/pw$i.log 2>&1
  echo "## pw$i exit $? ${SECONDS}s" >> $S; grep -E "^\|" $OUT/pw$i.log >> $S
done
tail -n 40 $S
