python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) at $(git rev-parse --short HEAD 2>/dev/null)" | tee $OUT/gpu.txt
# The project's whole GPU check at the current library (544a6bf), then, untuned, test files that
# have not run on a GPU since bcbf7f1 while time is left.
mkdir -p $OUT/gc; OUT=$OUT/gc timeout 470 bash scripts/gpu_check.sh > $OUT/gpu_check.txt 2>&1; echo "gpu_check rc=$? ($SECONDS s)" >> $OUT/gpu_check.txt
export JAX_EPILOG_AUTOTUNE=0
for f in tests/test_ffi_frame.py tests/test_reference.py tests/test_examples.py; do
  [ $SECONDS -ge 520 ] && break
  b=$(basename $f .py); timeout $(( 570 - SECONDS )) python3 -m pytest -q -p no:cacheprovider -rfE $f > $OUT/$b.log 2>&1
  echo "$f: $(tail -n 1 $OUT/$b.log) ($SECONDS s)"
done
cd $OUT && tar czf gc.tgz gc && rm -rf gc; cd - >/dev/null
tail -n 45 $OUT/gpu_check.txt; true
