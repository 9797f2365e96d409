# Two calls on the H100. The first ran both commands, but the kernels probe then had a
# syntax error (fixed before the second call, which ran the probe alone).
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
mkdir -p $OUT/k
C=""; for a in relu gelu; do for c in jax_epilog nvmath torch_addmm_act xla; do C="$C --case peer-$a-$c"; done; done
timeout 300 python3 -m benchmarks.probes.kernels $OUT/k $C --peer-shape 8192 1024 4096 > $OUT/k/log.txt 2>&1
timeout 200 python3 -m benchmarks.algorithms --tuning 8192 1024 4096 RELU_BIAS GELU_BIAS > $OUT/algorithms.txt 2>&1  # first call only
rm -rf $OUT/k/traces; cd $OUT && tar czf k.tgz k && rm -rf k
