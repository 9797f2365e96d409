python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
timeout 280 python3 -m benchmarks.probes.per_program --shape 8192 1024 4096 --shape 8192 4096 1024 --reps 4 --out $OUT/pp > $OUT/pp.log 2>&1
timeout 280 python3 -m benchmarks.run --quick --out $OUT/suite > $OUT/suite.log 2>&1
cd $OUT && tar czf suite.tgz suite && rm -rf suite
cat $OUT/pp/per_program.md
