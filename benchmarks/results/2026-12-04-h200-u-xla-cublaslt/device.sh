#!/bin/bash
# One device call: at 8192x4096->1024 and 8192x1024->4096 (bf16 ReLU), the fused call beside
# XLA with cuBLASLt enabled, nvmath and torch in ONE process (the suite runs XLA+cuBLASLt in a
# process of its own), and the default XLA as a control, in turns; then CUPTI's kernel names
# and XLA's chosen algorithm (HLO) for the XLA+cuBLASLt peer. Usage: bash device.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$D/smi.csv"
CL=--xla_gpu_enable_cublaslt=true
forced() { echo "== XLA_FLAGS=$1 forced_algorithm ${*:2}" >> "$D/forced.txt"
  XLA_FLAGS=$1 python -m benchmarks.probes.forced_algorithm "${@:2}" >> "$D/forced.txt" 2>> "$D/forced.err"; }
for round in 1 2; do
  for shape in "8192 4096 1024" "8192 1024 4096"; do
    # shellcheck disable=SC2086
    forced "$CL" --shape $shape --activation relu
    # shellcheck disable=SC2086
    forced "" --shape $shape --activation relu
  done
done
XLA_FLAGS=$CL python -m benchmarks.probes.kernels "$D/kernels-cublaslt" --case peer-relu-xla \
  --case peer-relu-jax_epilog --case peer-relu-nvmath > "$D/kernels-cublaslt.log" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$D/smi.csv"
grep -v "^  tuner" "$D/forced.txt"
