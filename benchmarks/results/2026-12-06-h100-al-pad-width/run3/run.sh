#!/usr/bin/env bash
# Device call (al) 3: benchmarks.probes.pad_width, twice (two processes), as time allows.
set -u
H=$1; LIMIT=${2:-585}
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
S=$OUT/summary.md
echo "commit $H (+ benchmarks/probes/pad_width.py); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" > $S
for i in 1 2; do
  if [ $SECONDS -gt $((LIMIT - 200)) ]; then echo "## pw$i skipped at ${SECONDS}s" >> $S; continue; fi
  timeout $((LIMIT - SECONDS)) python3 -m benchmarks.probes.pad_width --out $OUT/pw$i > $OUT/pw$i.log 2>&1
  echo "## pw$i exit $? ${SECONDS}s" >> $S; grep -E "^\|" $OUT/pw$i.log >> $S
done
tail -n 40 $S
