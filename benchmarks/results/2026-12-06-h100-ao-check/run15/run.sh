python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
echo "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) at $(git rev-parse --short HEAD 2>/dev/null)" | tee $OUT/gpu.txt
# The quick suite at the current library, then, untuned, test files not run on a GPU since bcbf7f1.
timeout 200 python3 -m benchmarks.run --quick --out $OUT/suite > $OUT/suite.log 2>&1; echo "suite rc=$? ($SECONDS s)"
export JAX_EPILOG_AUTOTUNE=0
for f in tests/test_implementation.py tests/test_dense.py tests/test_linen.py tests/test_nnx.py tests/test_grad.py; do
  [ $SECONDS -ge 540 ] && break
  b=$(basename $f .py); timeout $(( 575 - SECONDS )) python3 -m pytest -q -p no:cacheprovider -rfE $f > $OUT/$b.log 2>&1
  echo "$f: $(tail -n 1 $OUT/$b.log) ($SECONDS s)"
done
cd $OUT && tar czf suite.tgz suite && rm -rf suite; cd - >/dev/null
tar xzf $OUT/suite.tgz -C /tmp; awk '/^## /{p=1} /^## Machine/{p=0} p' /tmp/suite/*.md | grep -v "^$" | head -80; true
