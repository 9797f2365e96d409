python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
git rev-parse --short HEAD >> $OUT/gpu.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > $OUT/pytest-gpu.log 2>&1; tail -n 2 $OUT/pytest-gpu.log
timeout 200 python3 -m benchmarks.run --quick --out $OUT/suite1 > $OUT/suite1.log 2>&1
timeout 120 python3 -m benchmarks.training --out $OUT/t --part grad > $OUT/t.log 2>&1
timeout 200 python3 -m benchmarks.run --quick --out $OUT/suite2 > $OUT/suite2.log 2>&1
cd $OUT && tar czf suite1.tgz suite1 && tar czf suite2.tgz suite2 && tar czf t.tgz t && rm -rf suite1 suite2 t
cd - >/dev/null
echo; for s in suite1 suite2; do tar xzf $OUT/$s.tgz -C /tmp; awk '/^## .*fwd\+bwd/{p=1} /^## Machine/{p=0} p' /tmp/$s/*.md | grep -v "^$"; done
tar xzf $OUT/t.tgz -C /tmp; cat /tmp/t/training.md
