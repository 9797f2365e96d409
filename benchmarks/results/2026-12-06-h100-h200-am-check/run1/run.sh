python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
git log --oneline -1 > $OUT/head.txt 2>/dev/null || true
OUT=$OUT/check bash scripts/gpu_check.sh 2>&1 | tail -n 60
cd $OUT && tar czf check.tgz check && rm -rf check
