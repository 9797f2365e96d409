#!/usr/bin/env bash
# One device call: probes for (aj), then the GPU-marked tests. Tables go to $OUT/summary.md as they finish.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1
T=/tmp/r; mkdir -p $T; S=$OUT/summary.md; L=$OUT/probes.log
{ echo "commit $1"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } | tee $S
P="python3 -m benchmarks.probes.row_padding"
step() { name=$1; shift; echo "== $name" >> $S; "$@" >> $L 2>&1; cat $T/$name/*.md >> $S 2>/dev/null; }
M="--modes mlp --case 8192 1024 4097 gelu --case 8192 1020 4100 gelu"
step mlp_new timeout 60 $P --out $T/mlp_new $M
PYTHONPATH=$PWD/.site:$PWD/.old:$PWD step mlp_old timeout 60 $P --out $T/mlp_old $M
step mid timeout 80 $P --out $T/mid --case 2048 1024 4097 gelu --case 2048 1024 4104 gelu --case 2048 1024 4096 gelu --case 2048 1024 4097 relu
step none timeout 90 $P --out $T/none --modes fwd fwd+bwd --case 8192 1024 4097 none --case 8192 4097 1024 none --case 2048 1024 4097 none
echo "== forced" >> $S
for s in "2048 1024 4104"; do
  timeout 50 python3 -m benchmarks.probes.forced_algorithm --shape $s --activation gelu 2>&1 | grep -v Warn | tail -2 >> $S
done
timeout 130 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > $OUT/pytest.log 2>&1
tail -n 2 $OUT/pytest.log >> $S
tar czf $OUT/r.tgz -C /tmp r
cat $S
