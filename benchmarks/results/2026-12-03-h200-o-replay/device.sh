#!/usr/bin/env bash
# One device call of the 2026-12-03 (o) runs; everything goes into $OUT/x.tgz. Parts:
# "replay" (the fused forward with graph replay on and off, JAX_EPILOG_REPLAY=1/0, one
# process each, in turns, beside its peers: benchmarks.probes.forced_algorithm), "kernels"
# (CUPTI: the fused call at 8192x4096->1024 with replay on and off), "tests" (the whole
# test suite on the GPU, where every fused_dense test runs the cuBLASLt path), "check"
# (scripts/gpu_check.sh without its training tables; CHECK_TESTS: its pytest arguments),
# "suite" (benchmarks.run --quick), "ab" (command buffers off: the 16-layer chains with
# this library and with the primitives lowered directly as before aa56a93,
# direct_lowering.py; two processes each, in turns), "benchsuite" (tests/test_bench_suite.py).
# REPLAY_SHAPES: "M K N act" entries separated by commas; REPLAY_ROUNDS: rounds of on/off.
set -u
python3 -m pip install -q --no-index --no-deps --target .site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD/.site:$PWD
W=/tmp/w; mkdir -p $W
nvidia-smi --query-gpu=timestamp,power.draw,clocks.sm,temperature.gpu --format=csv -lms 1000 > $W/smi-$(date +%H%M%S).csv &
smi=$!
step() { local t=$1; shift; echo "== $(date +%T) $*" >&2; timeout "$t" "$@"; echo "   rc=$? $(date +%T)" >&2; }
for part in "$@"; do
  case $part in
    replay)
      IFS=, read -ra shapes <<< "${REPLAY_SHAPES:-8192 4096 1024 relu,8192 4096 1024 gelu,8192 1024 4096 relu}"
      for round in $(seq ${REPLAY_ROUNDS:-2}); do
        for s in "${shapes[@]}"; do
          set -- $s
          for replay in 1 0; do
            echo -n "replay=$replay round=$round: "
            JAX_EPILOG_REPLAY=$replay step 60 python3 -m benchmarks.probes.forced_algorithm --shape $1 $2 $3 --activation $4 | head -n 1
          done
        done
      done > $W/replay.txt 2> $W/replay.log ;;
    kernels)
      for replay in 1 0; do
        JAX_EPILOG_REPLAY=$replay step 90 python3 -m benchmarks.probes.kernels $W/kernels-replay$replay \
          --case peer-relu-jax_epilog --case peer-relu-nvmath > $W/kernels-replay$replay.log 2>&1
      done ;;
    ab)
      for round in 1 2; do
        XLA_FLAGS=--xla_gpu_enable_command_buffer= step 150 python3 -m benchmarks.forward --out $W/ab \
          --part chain --label new-$round >> $W/ab.log 2>&1
        XLA_FLAGS=--xla_gpu_enable_command_buffer= step 150 python3 \
          benchmarks/results/2026-12-03-h200-o-replay/direct_lowering.py --out $W/ab --part chain \
          --label old-$round >> $W/ab.log 2>&1
      done ;;
    benchsuite)
      step 200 python3 -m pytest -q -rf -p no:cacheprovider tests/test_bench_suite.py > $W/benchsuite.log 2>&1 ;;
    tests)
      step ${TESTS_TIMEOUT:-360} python3 -m pytest -q -p no:cacheprovider tests/ > $W/tests.log 2>&1 ;;
    check)
      mkdir -p $W/check; TESTS="${CHECK_TESTS:--m gpu tests/}" SKIP_TRAINING=1 OUT=$W/check \
        step ${CHECK_TIMEOUT:-290} bash scripts/gpu_check.sh > $W/check/check.log 2>&1 ;;
    suite)
      mkdir -p $W/suite; step 190 python3 -m benchmarks.run --quick --out $W/suite > $W/suite/suite.log 2>&1 ;;
  esac
done
kill $smi
tar czf $OUT/x.tgz -C $W .
[ -f $W/replay.txt ] && cut -c1-330 $W/replay.txt && grep -c "rc=0" $W/replay.log
for r in 1 0; do [ -f $W/kernels-replay$r/kernels.json ] && python3 -c "
import json
for r in json.load(open('$W/kernels-replay$r/kernels.json'))['rows']:
    if 'error' in r: print(r['case'], r['error']); continue
    top = '; '.join(f\"{k['kernel'][:60]} {k['us_per_step']:.1f}\" for k in r['kernels'][:2])
    print(f\"replay=$r {r['case']:24} wall {r['wall_us']:6.1f} enq {r['enqueue_us']:6.1f} busy {r['busy_us_per_step']:6.1f} span {r['span_us_per_step']:6.1f} | {top}\")
"; done
[ -d $W/ab ] && python3 -m benchmarks.report $W/ab/forward-*.json | grep -E "^###|^\| 16x"
[ -f $W/benchsuite.log ] && tail -n 3 $W/benchsuite.log
[ -f $W/tests.log ] && grep -E "^(FAILED|ERROR)" $W/tests.log | cut -c1-200 | head -20 && tail -n 2 $W/tests.log
[ -d $W/suite ] && grep -A8 "bfloat16 (bfloat16 bias), fwd" $W/suite/*.md | grep 8192 | cut -c1-220
[ -d $W/check ] && tail -n 45 $W/check/check.log | cut -c1-230
exit 0
