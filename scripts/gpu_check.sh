#!/usr/bin/env bash
# The project's GPU check, run on the device in one call:
#   GPU tests (the whole suite: on a GPU every fused_dense test runs the cuBLASLt path),
#   then the forward benchmark with XLA command buffers off and on, then a short table.
# Logs and JSON go to $OUT (default: /tmp/jax_epilog_gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_epilog_gpu_check}
mkdir -p "$OUT"
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/ >"$OUT/pytest.log" 2>&1 || status=1
tail -n 25 "$OUT/pytest.log"

python3 examples/quickstart.py 2>&1 | tee "$OUT/quickstart.txt" || status=1
python3 -m benchmarks.host_overhead 2>&1 | tee "$OUT/host_overhead.txt" || status=1

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  XLA_FLAGS="--xla_gpu_enable_command_buffer=" python3 -m benchmarks.forward --out "$OUT" --part all \
    --label cmdbuf-off >"$OUT/bench-cmdbuf-off.log" 2>&1 || status=1
  python3 -m benchmarks.forward --out "$OUT" --part all --label cmdbuf-on \
    >"$OUT/bench-cmdbuf-on.log" 2>&1 || status=1
  tail -n 3 "$OUT"/bench-*.log
  python3 -m benchmarks.report "$OUT"/forward-cmdbuf-on.json "$OUT"/forward-cmdbuf-off.json | tee "$OUT/forward.md"
fi
grep -E "passed|failed" "$OUT/pytest.log" | tail -n 1
exit $status
