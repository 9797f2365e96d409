#!/usr/bin/env bash
# Device call (al) 5: the new "auto" rule (ReLU where N pads: XLA's expression on padded rows).
# GPU-marked tests; row_padding at ReLU N-padded shapes; the small padded layers (host-bound?) twice;
# the quick suite. Usage: bash .old/run4.sh COMMIT [LIMIT]
set -u
H=$1; LIMIT=${2:-585}
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
S=$OUT/summary.md
echo "commit $H; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" > $S
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > $OUT/pytest-gpu.log 2>&1
echo "## pytest -m gpu tests/ exit $? ${SECONDS}s" >> $S; tail -n 3 $OUT/pytest-gpu.log >> $S
mkdir -p $OUT/rp
rp() { # name args...
  local name=$1; shift
  if [ $SECONDS -gt $((LIMIT - 60)) ]; then echo "## $name skipped at ${SECONDS}s" >> $S; return; fi
  timeout $((LIMIT - SECONDS)) python3 -m benchmarks.probes.row_padding --out $OUT/rp/$name "$@" > $OUT/rp/$name.log 2>&1
  echo "## $name ($*) ${SECONDS}s" >> $S; grep -E "^\|" $OUT/rp/$name.log >> $S
}
rp relu --modes fwd fwd+bwd --case 8192 1024 4097 relu --case 8192 1024 8193 relu --case 8192 1020 4096 relu
SMALL="--modes fwd fwd+bwd --case 4096 1024 1025 gelu --case 1024 1024 4097 gelu --case 1024 1024 4097 relu"
rp small1 $SMALL
rp small2 $SMALL
tar -C $OUT -czf $OUT/rp.tgz rp && rm -rf $OUT/rp
if [ $SECONDS -lt $((LIMIT - 150)) ]; then
  mkdir -p /tmp/suite; timeout $((LIMIT - SECONDS)) python3 -m benchmarks.run --quick --out /tmp/suite > /tmp/suite/run.log 2>&1
  echo "## suite exit $? (${SECONDS}s)" >> $S; tar -C /tmp -czf $OUT/suite.tgz suite
else echo "## suite skipped at ${SECONDS}s" >> $S; fi
tail -n 45 $S
