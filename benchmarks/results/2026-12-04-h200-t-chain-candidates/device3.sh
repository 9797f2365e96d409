#!/bin/bash
# Run 3: the tuner timing each run in a child graph of its own (graph_us(separate=True)):
# the GPU tests, the tuner's table at 256x1024->1024 (planning, child graphs, one flat graph),
# then the chain with the tuner's own pick in fresh processes until ~${SECONDS_MAX:-300} s,
# then the tuner's table at 8192x1024->4096. Usage: bash device3.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv > "$D/smi.csv"
timeout 170 python -m pytest -q -x tests/test_gpu.py > "$D/pytest.log" 2>&1; echo "pytest rc=$?" >> "$D/pytest.log"
timeout 60 python -m benchmarks.algorithms --tuning 256 1024 1024 RELU_BIAS GELU_BIAS > "$D/tuning-256.txt" 2>&1
probe() { echo "== $*" >> "$D/log.txt"; python -m benchmarks.probes.chain_candidates --out "$D" "$@" >> "$D/log.txt" 2>&1; }
while [ $SECONDS -lt ${SECONDS_MAX:-300} ]; do probe --activation relu; probe --activation gelu; done
python -m benchmarks.probes.chain_candidates --summarize "$D" > /dev/null
timeout 60 python -m benchmarks.algorithms --tuning 8192 1024 4096 RELU_BIAS GELU_BIAS > "$D/tuning-8192.txt" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv >> "$D/smi.csv"
