python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
# The aux-layout fix and the lowering's buffer check on the GPU: the GPU-marked tests (tuned plans),
# the probe test that failed in run 5, then whole test files (untuned plans) while time is left
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > $OUT/gpu-tests.log 2>&1; echo "gpu: $(tail -n 1 $OUT/gpu-tests.log) ($SECONDS s)"
export JAX_EPILOG_AUTOTUNE=0
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_bench_suite.py -k pad_width > $OUT/pad-width.log 2>&1; echo "pad_width: $(tail -n 1 $OUT/pad-width.log) ($SECONDS s)"
for f in tests/test_lowering.py tests/test_mlp.py; do
  b=$(basename $f .py); timeout $(( 330 - SECONDS )) python3 -m pytest -q -p no:cacheprovider -rfE $f > $OUT/$b.log 2>&1
  echo "$f: $(tail -n 1 $OUT/$b.log) ($SECONDS s)"; [ $SECONDS -ge 325 ] && break
done; true
