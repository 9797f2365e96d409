python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > $OUT/gpu.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > $OUT/pytest-gpu.log 2>&1
mkdir -p $OUT/b
for i in 1 2; do timeout 120 python3 -m benchmarks.forward --out $OUT/b --part chain --label chain$i >> $OUT/b/bench.log 2>&1; done
timeout 150 python3 -m benchmarks.training --out $OUT/b --part grad >> $OUT/b/bench.log 2>&1
python3 -m benchmarks.report $OUT/b/forward-*.json > $OUT/b/forward.md 2>&1
cd $OUT && tar czf b.tgz b && rm -rf b
tail -n 2 $OUT/pytest-gpu.log; cat $OUT/gpu.txt
