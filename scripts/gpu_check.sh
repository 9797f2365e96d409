#!/usr/bin/env bash
# The project's GPU check, in one call on a machine with an NVIDIA GPU. Writes to $OUT:
#   checks.txt   the GPU, the quickstart, the host-overhead probe, the digits example
#                (a fallback to XLA's path is an error there)
#   pytest.log   the tests (by default the GPU-marked ones)
#   forward-cmdbuf-{off,on}.json, forward.md   the forward benchmark, XLA's command buffers off and on
#   training.{json,md}, bench.log              the training benchmark
#   <probe>/, probes.log                       the probes named in PROBES
# Knobs: OUT (default /tmp/jax_epilog_gpu_check), TESTS (pytest arguments, default
# "-m gpu tests/"), PROBES (benchmarks.probes modules, e.g. "ensemble refusals"),
# SKIP_BENCH=1, FORWARD_LABELS (default "cmdbuf-off cmdbuf-on"), SKIP_TRAINING=1.
# The whole test suite on a GPU takes several minutes: run it on its own
# (TESTS=tests/ SKIP_BENCH=1) where a call has a time limit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_epilog_gpu_check}
mkdir -p "$OUT"
status=0

{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 examples/quickstart.py && python3 -m benchmarks.host_overhead
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
