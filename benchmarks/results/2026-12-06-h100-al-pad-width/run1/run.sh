#!/usr/bin/env bash
# Device call (al) 1: the GPU check without benchmarks, the quick suite, then the row_padding probe above
# the fused floor (padded fused vs XLA padded) in two processes. Usage: bash .old/run.sh COMMIT [LIMIT]
set -u
H=$1; LIMIT=${2:-590}
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
S=$OUT/summary.md
echo "commit $H; $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" > $S
mkdir -p /tmp/check $OUT/rp
OUT=/tmp/check SKIP_BENCH=1 timeout 200 bash scripts/gpu_check.sh > /tmp/check/gpu_check.out 2>&1
echo "## gpu_check SKIP_BENCH=1 (exit $?, ${SECONDS}s)" >> $S; cat /tmp/check/gpu_check.out >> $S
tar -C /tmp -czf $OUT/check.tgz check
mkdir -p /tmp/suite; timeout $((LIMIT - SECONDS - 150)) python3 -m benchmarks.run --quick --out /tmp/suite > /tmp/suite/run.log 2>&1 || true
echo "## suite (${SECONDS}s)" >> $S; tail -n 3 /tmp/suite/run.log >> $S
tar -C /tmp -czf $OUT/suite.tgz suite
rp() { # name args...
  local name=$1; shift
  if [ $SECONDS -gt $((LIMIT - 60)) ]; then echo "## $name skipped at ${SECONDS}s" >> $S; return; fi
  timeout $((LIMIT - SECONDS)) python3 -m benchmarks.probes.row_padding --out $OUT/rp/$name "$@" > $OUT/rp/$name.log 2>&1
  echo "## $name ($*) ${SECONDS}s" >> $S; grep -E "^\||^\{" $OUT/rp/$name.log >> $S
}
C="--modes fwd fwd+bwd --case 8192 1024 4097 relu --case 8192 1020 4096 relu --case 8192 1024 4097 gelu --case 8192 1020 4096 gelu"
rp floor1 $C
rp floor2 $C
tar -C $OUT -czf $OUT/rp.tgz rp && rm -rf $OUT/rp
tail -n 60 $S
