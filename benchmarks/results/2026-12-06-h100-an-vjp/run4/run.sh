python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt; git rev-parse --short HEAD >> $OUT/gpu.txt
# The whole test files on the GPU (every fused_dense test on the cuBLASLt path); plans untuned to fit the time
export JAX_EPILOG_AUTOTUNE=0
for f in tests/test_nnx.py tests/test_ffi_frame.py tests/test_reference.py tests/test_examples.py; do
  b=$(basename $f .py)
  timeout $(( 300 - SECONDS )) python3 -m pytest -q -p no:cacheprovider -rfE $f > $OUT/$b.log 2>&1
  echo "$f: $(tail -n 1 $OUT/$b.log) ($SECONDS s)"
  [ $SECONDS -ge 295 ] && break
done
true
