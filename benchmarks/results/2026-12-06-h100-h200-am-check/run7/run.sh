python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null; export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
mkdir -p $OUT/t; timeout 170 python3 -m benchmarks.training --out $OUT/t --part grad > $OUT/t/log.txt 2>&1
cat $OUT/t/training.md
