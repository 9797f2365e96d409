set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
for v in old new old new; do
  if [ $v = old ]; then PP=$PWD/.old/lib:$PWD/.site:$PWD; else PP=$PWD/.site:$PWD; fi
  [ $SECONDS -gt 120 ] && break
  PYTHONPATH=$PP timeout $((170 - SECONDS)) python3 -P -m benchmarks.probes.row_padding --modes mlp --case 8192 1024 4097 gelu 2>&1 | grep "^{" | sed "s/^/$v /" | tee -a $OUT/mlp_sq.txt
done
