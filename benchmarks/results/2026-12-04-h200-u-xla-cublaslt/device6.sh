#!/bin/bash
# One device call: the GPU-marked tests, then benchmarks.training --part grad (fwd+bwd,
# "cublaslt" / "auto" / XLA at its three shapes) with ReLU's new backward. Usage: bash device6.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > "$D/pytest.log" 2>&1
python3 -m benchmarks.training --part grad --out "$D/training" > "$D/training.log" 2>&1
tail -n 2 "$D/pytest.log"; cat "$D/training/training.md"
