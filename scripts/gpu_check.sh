#!/usr/bin/env bash
# The project's GPU check, in one call on a machine with an NVIDIA GPU. Writes to $OUT:
#   checks.txt   the GPU, the quickstart, the host-overhead probe, the digits example
#                (a fallback to XLA's path is an error there)
#   pytest.log   the tests (by default the GPU-marked ones)
#   forward-cmdbuf-{off,on}.json, forward.md   the forward benchmark, XLA's command buffers off and on
#   training.{json,md}, bench.log              the training benchmark
#   <probe>/, probes.log                       the probes named in PROBES
#   fp8/          with FP8=1: cuBLASLt's FP8 acceptance (fp8_epilogs.md), the FP8 benchmark
#                 (fp8.json), the FP8 training example (example.log, train_fp8.png), the
#                 kernel times of the mid-size block and the example's step (kernels.txt)
#   loop.txt      with LOOP=1 or LOOP_VARIANTS: the FP8 example's steps timed as loops run
#                 them, with the host's share (dispatch, the FFI handler's runs and time)
# Knobs: OUT (default /tmp/jax_epilog_gpu_check), TESTS (pytest arguments, default
# "-m gpu tests/"), PROBES (benchmarks.probes modules, e.g. "ensemble refusals"),
# SKIP_BENCH=1, FORWARD_LABELS (default "cmdbuf-off cmdbuf-on"), SKIP_TRAINING=1, FP8=1
# (FP8 only: TESTS="-m gpu tests/fp8 tests/primitives/test_fp8_gemm.py" SKIP_BENCH=1 FP8=1),
# LOOP=1, LOOP_VARIANTS (benchmarks.train_loop --fp8's --variant entries, e.g.
# "mlp_fp8:fp8_command_buffers=True mlp_fp8:xla_gpu_enable_command_buffer="; its table in
# loop.txt).
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

if [ "${FP8:-0}" = 1 ]; then
  mkdir -p "$OUT/fp8"
  python3 -m benchmarks.probes.fp8_epilogs --out "$OUT/fp8" >"$OUT/fp8/probe.log" 2>&1 || status=1
  cat "$OUT/fp8/fp8_epilogs.md" 2>/dev/null
  python3 -m benchmarks.fp8 --quick --out "$OUT/fp8" >"$OUT/fp8/bench.log" 2>&1 || status=1
  grep -A12 "^FP8 rows" "$OUT/fp8/bench.log"
  python3 examples/train_transformer_mlp.py --size large --fp8 --plot "$OUT/fp8/train_fp8.png" \
    >"$OUT/fp8/example.log" 2>&1 || status=1
  grep -v "training in turn" "$OUT/fp8/example.log" | tail -n 9
  for row in "mlp fwd+bwd 8192x1024" train; do
    # (traces and HLO in a temporary folder: $OUT keeps few files)
    python3 -m benchmarks.kernel_times "$row" 2>&1 | grep -E "µs" >>"$OUT/fp8/kernels.txt"
  done
  grep "µs of kernels" "$OUT/fp8/kernels.txt"
fi

if [ "${LOOP:-0}" = 1 ] || [ -n "${LOOP_VARIANTS:-}" ]; then
  # shellcheck disable=SC2086
  python3 -m benchmarks.train_loop --fp8 ${LOOP_VARIANTS:+--variant $LOOP_VARIANTS} >"$OUT/loop.txt" 2>&1 || status=1
  grep -A20 "^train_transformer_mlp" "$OUT/loop.txt"
fi

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
