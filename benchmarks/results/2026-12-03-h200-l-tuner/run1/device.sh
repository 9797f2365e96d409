#!/usr/bin/env bash
# One device call: the tuner experiment (baseline, then patched), backward variants, GPU tests.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv -lms 500 > "$OUT/smi.csv" &
smi=$!
step() { local t=$1; shift; echo "== $(date +%T) $*" >&2; timeout "$t" "$@"; echo "   rc=$? $(date +%T)" >&2; }
step 90 python3 -m benchmarks.probes.forced_algorithm > "$OUT/forced.txt" 2> "$OUT/forced.err"
patch -p1 < exp/tuner.patch >&2  # exp/tuner.patch: commit 799e365 (on main as 31c697c)
step 90 python3 -m benchmarks.probes.forced_algorithm >> "$OUT/forced.txt" 2>> "$OUT/forced.err"
step 90 python3 -m benchmarks.probes.forced_algorithm >> "$OUT/forced.txt" 2>> "$OUT/forced.err"
step 90 python3 -m benchmarks.algorithms --tuning 8192 4096 16384 RELU_BIAS > "$OUT/tuning.txt" 2>&1
step 170 python3 -m benchmarks.backward_variants --shape 8192 1024 4096 --shape 8192 4096 1024 --out "$OUT" > "$OUT/bv.log" 2>&1
SKIP_BENCH=1 OUT=$OUT/check step 120 bash scripts/gpu_check.sh > "$OUT/check.log" 2>&1
kill $smi
echo; cat "$OUT/forced.txt"; echo; tail -n 12 "$OUT/tuning.txt"; echo; grep -A12 "^| M×K" "$OUT/bv.log" | head -14; echo; tail -n 4 "$OUT/check.log"
