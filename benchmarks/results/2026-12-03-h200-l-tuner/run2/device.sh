#!/usr/bin/env bash
# Suite, GPU check (tests, examples, forward tables), suite again: the new autotuner.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv -lms 1000 > "$OUT/smi.csv" &
smi=$!
step() { local t=$1; shift; echo "== $(date +%T) $*" >&2; timeout "$t" "$@"; echo "   rc=$? $(date +%T)" >&2; }
mkdir -p "$OUT/run1" "$OUT/run2" "$OUT/check"
step 150 python3 -m benchmarks.run --quick --out "$OUT/run1" > "$OUT/run1/suite.log" 2>&1
SKIP_TRAINING=1 OUT=$OUT/check step 300 bash scripts/gpu_check.sh > "$OUT/check/check.log" 2>&1
step 130 python3 -m benchmarks.run --quick --out "$OUT/run2" > "$OUT/run2/suite.log" 2>&1
kill $smi
for r in run1 run2; do grep -A8 "bfloat16 (bfloat16 bias), fwd$" "$OUT"/$r/*.md | grep 8192 | cut -c1-200; done
tail -n 25 "$OUT/check/check.log" | cut -c1-220
