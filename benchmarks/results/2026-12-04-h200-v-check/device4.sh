#!/bin/bash
# One device call after fused_mlp's ReLU rule (014bd79): tests/test_mlp.py whole and the
# GPU-marked tests on the GPU, then the MLP rows for ReLU blocks. Usage: bash device4.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
python3 -m pytest -q -p no:cacheprovider tests/test_mlp.py > "$D/test_mlp.log" 2>&1
python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > "$D/pytest.log" 2>&1
python3 -m benchmarks.training --part mlp --mlp-activations relu --out "$D/training" > "$D/training.log" 2>&1
echo "test_mlp.py: $(tail -n 1 "$D/test_mlp.log")"; echo "gpu: $(tail -n 1 "$D/pytest.log")"
cat "$D/training/training.md"
