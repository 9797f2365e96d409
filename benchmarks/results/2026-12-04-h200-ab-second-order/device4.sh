#!/bin/bash
# One device call (run 4 at 0fd1a37, run 5 at the next commit): what the gradient of a gradient penalty costs, fused_dense ("cublaslt",
# "auto") against XLA's plain expression, then the probe's and FFI-frame tests on the GPU host.
# Usage: bash device4.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
timeout 300 python3 -m benchmarks.probes.second_order --out "$D" > "$D/second_order.log" 2>&1; echo "rc $?"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_ffi_frame.py \
  tests/test_bench_suite.py::test_second_order_probe_times_one_gradient_of_a_penalty_three_ways_on_cpu > "$D/tests.log" 2>&1
echo "rc $?"; tail -n 1 "$D/tests.log"
cat "$D/second_order.md"
