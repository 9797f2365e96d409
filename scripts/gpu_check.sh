#!/usr/bin/env bash
# The project's GPU check, run on the device in one call:
#   the test suite (on a GPU every fused_dense test runs the cuBLASLt path), the quickstart,
#   the host-overhead probe, the forward benchmark with XLA command buffers off and on, the
#   training benchmark (fwd+bwd rows, transformer example), then the short tables.
#   Everything is written to $OUT (8 files).
# Knobs: TESTS (pytest arguments, default "-m gpu tests/": the GPU-marked tests),
# SKIP_BENCH=1, FORWARD_LABELS (default "cmdbuf-off cmdbuf-on"), SKIP_TRAINING=1,
# PROBES (benchmarks.probes modules run after the tests, each with --out $OUT/<probe>;
# e.g. PROBES="ensemble second_order"; their logs in $OUT/probes.log).
# Time on the H200: the GPU-marked tests take ~35 s; the whole suite on the GPU (where every
# fused_dense test runs the cuBLASLt path) took over 7 minutes (1244 tests: 98% in 420 s,
# 2026-12-03 (o)), so under a 10-minute limit per call run it on its own: TESTS=tests/ SKIP_BENCH=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_epilog_gpu_check}
mkdir -p "$OUT"
status=0

{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 examples/quickstart.py && python3 -m benchmarks.host_overhead
  # The digits example on the GPU; a fallback to XLA's path would be an error here.
  python3 -c "import runpy, sys, warnings, jax_epilog
warnings.simplefilter('error', jax_epilog.FastPathWarning)
sys.argv = ['examples/train_digits_mlp.py']
runpy.run_path(sys.argv[0], run_name='__main__')" 2>&1 | tr '\r' '\n' | tail -n 4
} >"$OUT/checks.txt" 2>&1 || status=1
cat "$OUT/checks.txt"
# shellcheck disable=SC2086
python3 -m pytest -q -p no:cacheprovider ${TESTS:--m gpu tests/} >"$OUT/pytest.log" 2>&1 || status=1
tail -n 15 "$OUT/pytest.log"

for probe in ${PROBES:-}; do
  python3 -m "benchmarks.probes.$probe" --out "$OUT/$probe" >>"$OUT/probes.log" 2>&1 || status=1
  cat "$OUT/$probe"/*.md 2>/dev/null
done

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  : >"$OUT/bench.log"
  for label in ${FORWARD_LABELS:-cmdbuf-off cmdbuf-on}; do
    flags=""
    [ "$label" = cmdbuf-off ] && flags="--xla_gpu_enable_command_buffer="
    XLA_FLAGS="$flags" python3 -m benchmarks.forward --out "$OUT" --part all --label "$label" \
      >>"$OUT/bench.log" 2>&1 || status=1
  done
  if [ "${SKIP_TRAINING:-0}" != 1 ]; then
    python3 -m benchmarks.training --out "$OUT" >>"$OUT/bench.log" 2>&1 || status=1
  fi
  grep -E "plans made|Error|Warning" "$OUT/bench.log" | sort | uniq -c | head -20
  python3 -m benchmarks.report "$OUT"/forward-*.json | tee "$OUT/forward.md"
  [ -f "$OUT/training.md" ] && cat "$OUT/training.md"
fi
grep -E "passed|failed" "$OUT/pytest.log" | tail -n 1
exit $status
