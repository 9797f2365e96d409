#!/usr/bin/env bash
# Device call (ak), one call: the GPU check without benchmarks (tests, examples, host overhead), then the
# row_padding probe: fused_mlp old (8e76685, .old/lib) against new, no-activation cases and auto_pads-range
# cases with the xla_padded contender. Steps are skipped past 500 s. Usage: bash .old/run.sh COMMIT
set -u
H=$1; LIMIT=${2:-590}
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
NEW=$PWD/.site:$PWD
OLD=$PWD/.old/lib:$PWD/.site:$PWD
S=$OUT/summary.md
echo "commit $H (new), 8e76685 (old: .old/lib); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)" > $S
PYTHONPATH=$OLD python3 -P -c "import jax_epilog; print('old imports', jax_epilog.__file__)" >> $S 2>&1
PYTHONPATH=$NEW python3 -P -c "import jax_epilog, jax; print('new imports', jax_epilog.__file__, jax.__version__)" >> $S 2>&1
mkdir -p /tmp/check $OUT/rp
PYTHONPATH=$NEW OUT=/tmp/check SKIP_BENCH=1 timeout 240 bash scripts/gpu_check.sh > /tmp/check/gpu_check.out 2>&1
echo "## gpu_check SKIP_BENCH=1 (exit $?, ${SECONDS}s)" >> $S; cat /tmp/check/gpu_check.out >> $S
tar -C /tmp -czf $OUT/check.tgz check
rp() { # name pythonpath args...
  local name=$1 pp=$2; shift 2
  if [ $SECONDS -gt $((LIMIT - 90)) ]; then echo "## $name skipped at ${SECONDS}s" >> $S; return; fi
  PYTHONPATH=$pp timeout $((LIMIT - SECONDS)) python3 -P -m benchmarks.probes.row_padding --out $OUT/rp/$name "$@" > $OUT/rp/$name.log 2>&1
  echo "## $name ($*) ${SECONDS}s" >> $S; grep -E "^\||^\{" $OUT/rp/$name.log >> $S
}
rp mlp_old1 "$OLD" --modes mlp --case 8192 1024 4097 gelu --case 8192 1020 4100 gelu
rp mlp_new1 "$NEW" --modes mlp --case 8192 1024 4097 gelu --case 8192 1020 4100 gelu
rp none "$NEW" --modes fwd fwd+bwd --case 8192 1024 4097 none --case 8192 4097 1024 none --case 8192 1020 4096 none --case 8192 1024 4096 none --case 2048 1024 4097 none --case 4096 1024 1025 none
rp pads "$NEW" --modes fwd --case 4096 1024 1025 gelu --case 1024 1024 4097 gelu --case 1024 1024 4097 relu
rp mlp_old2 "$OLD" --modes mlp --case 8192 1024 4097 gelu
rp mlp_new2 "$NEW" --modes mlp --case 8192 1024 4097 gelu
tar -C $OUT -czf $OUT/rp.tgz rp && rm -rf $OUT/rp
tail -n 45 $S
