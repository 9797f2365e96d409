#!/bin/bash
# One device call: a CUPTI kernel profile of the mid-size block (XLA, "both", "second" at
# 1024x1024->4096->1024, ReLU and GELU), then the GPU check with its forward tables
# (command buffers off and on; no training part). Usage: bash device3.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
echo "$(date +%T) kernels"
cases=""
for a in relu gelu; do for c in xla both second; do cases="$cases --case layers-$a-1024-$c"; done; done
# shellcheck disable=SC2086
timeout 150 python3 -m benchmarks.probes.kernels "$D/kernels" $cases > "$D/kernels.log" 2>&1
echo "$(date +%T) gpu_check"
SKIP_TRAINING=1 OUT="$D/check" timeout 400 bash scripts/gpu_check.sh > "$D/check.log" 2>&1
echo "$(date +%T) done"
tail -n 40 "$D/check.log"
cat "$D/kernels/kernels.md" 2>/dev/null | head -80 || tail -n 20 "$D/kernels.log"
