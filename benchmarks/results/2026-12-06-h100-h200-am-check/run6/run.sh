python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 230 python3 -m benchmarks.run --quick --out $OUT/suite > $OUT/suite.log 2>&1
mkdir -p $OUT/t; timeout 200 python3 -m benchmarks.training --out $OUT/t --part grad > $OUT/t/log.txt 2>&1
cd $OUT && tar czf res.tgz suite t && rm -rf suite t
tar xzf res.tgz -C /tmp && grep -B2 -A12 "fwd+bwd\|fwd+vjp" /tmp/suite/*.md | grep "^|" ; cat /tmp/t/training.md
