#!/usr/bin/env bash
# Device call (al) 6: wide N padding for forwards without aux. GPU-marked tests; row_padding GELU/ReLU
# forwards, old (c1a8d54, .old/lib via python -P) and new in alternating processes; the quick suite.
set -u
H=$1; LIMIT=${2:-585}
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
NEW=$PWD/.site:$PWD
OLD=$PWD/.old/lib:$PWD/.site:$PWD
S=$OUT/summary.md
echo "commit $H (new), c1a8d54 (old: .old/lib); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" > $S
PYTHONPATH=$OLD python3 -P -c "import jax_epilog._primitive as p; print('old imports', p.__file__, getattr(p, '_WIDE_ROW_BYTES', None))" >> $S 2>&1
PYTHONPATH=$NEW python3 -P -c "import jax_epilog._primitive as p; print('new imports', p.__file__, getattr(p, '_WIDE_ROW_BYTES', None))" >> $S 2>&1
PYTHONPATH=$NEW timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > $OUT/pytest-gpu.log 2>&1
echo "## pytest -m gpu tests/ exit $? ${SECONDS}s" >> $S; tail -n 3 $OUT/pytest-gpu.log >> $S
mkdir -p $OUT/rp
rp() { # name pythonpath args...
  local name=$1 pp=$2; shift 2
  if [ $SECONDS -gt $((LIMIT - 70)) ]; then echo "## $name skipped at ${SECONDS}s" >> $S; return; fi
  PYTHONPATH=$pp timeout $((LIMIT - SECONDS)) python3 -P -m benchmarks.probes.row_padding --out $OUT/rp/$name "$@" > $OUT/rp/$name.log 2>&1
  echo "## $name ($*) ${SECONDS}s" >> $S; grep -E "^\|" $OUT/rp/$name.log >> $S
}
C="--modes fwd --case 8192 1024 4097 gelu --case 8192 1024 8193 gelu --case 8192 4096 4100 gelu --case 8192 1024 2049 gelu --case 8192 1024 1025 gelu --case 8192 1024 4097 relu"
rp new1 "$NEW" $C
rp old1 "$OLD" $C
rp new2 "$NEW" $C
rp old2 "$OLD" $C
rp big "$NEW" --modes fwd --case 8192 4096 16385 gelu
tar -C $OUT -czf $OUT/rp.tgz rp && rm -rf $OUT/rp
if [ $SECONDS -lt $((LIMIT - 140)) ]; then
  mkdir -p /tmp/suite; PYTHONPATH=$NEW timeout $((LIMIT - SECONDS)) python3 -m benchmarks.run --quick --out /tmp/suite > /tmp/suite/run.log 2>&1
  echo "## suite exit $? (${SECONDS}s)" >> $S; tar -C /tmp -czf $OUT/suite.tgz suite
else echo "## suite skipped at ${SECONDS}s" >> $S; fi
tail -n 60 $S
