#!/usr/bin/env bash
# The project's GPU check, run on the device in one call:
#   the whole test suite (on a GPU every fused_dense test runs the cuBLASLt path),
#   the quickstart, the host-overhead probe, the forward benchmark with XLA command buffers
#   off and on, then the short tables. Everything is written to $OUT (6 files).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_epilog_gpu_check}
mkdir -p "$OUT"
status=0

{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
  python3 examples/quickstart.py && python3 -m benchmarks.host_overhead
} >"$OUT/checks.txt" 2>&1 || status=1
cat "$OUT/checks.txt"
python3 -m pytest -q -p no:cacheprovider tests/ >"$OUT/pytest.log" 2>&1 || status=1
tail -n 15 "$OUT/pytest.log"

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" python3 -m benchmarks.forward --out "$OUT" --part all \
    --label cmdbuf-off >"$OUT/bench.log" 2>&1 || status=1
  python3 -m benchmarks.forward --out "$OUT" --part all --label cmdbuf-on >>"$OUT/bench.log" 2>&1 || status=1
  grep -E "plans made|Error" "$OUT/bench.log"
  python3 -m benchmarks.report "$OUT"/forward-cmdbuf-on.json "$OUT"/forward-cmdbuf-off.json | tee "$OUT/forward.md"
fi
grep -E "passed|failed" "$OUT/pytest.log" | tail -n 1
exit $status
