python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) at $(git rev-parse --short HEAD 2>/dev/null)" | tee $OUT/gpu.txt
# Untuned, the last test files not run on a GPU since bcbf7f1.
export JAX_EPILOG_AUTOTUNE=0
for f in tests/test_sharding.py tests/test_bench_suite.py; do
  b=$(basename $f .py); timeout $(( 440 - SECONDS )) python3 -m pytest -q -p no:cacheprovider -rfE $f > $OUT/$b.log 2>&1
  echo "$f: $(tail -n 1 $OUT/$b.log) ($SECONDS s)"
done; true
