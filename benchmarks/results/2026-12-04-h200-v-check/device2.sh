#!/bin/bash
# One device call: benchmarks.training (fwd+bwd rows, the MLP block with GELU and ReLU, the
# transformer example), then the suite --quick. Usage: bash device2.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
python3 -m benchmarks.training --out "$D/training" --mlp-activations gelu relu > "$D/training.log" 2>&1
python3 -m benchmarks.run --quick --out "$D/suite" > "$D/suite.log" 2>&1
cat "$D/training/training.md"; tail -n 5 "$D/suite.log"
