#!/bin/bash
# One device call: does compile(compiler_options={"xla_gpu_enable_cublaslt": True}) give the
# program that XLA_FLAGS=--xla_gpu_enable_cublaslt=true gives (hlo_options.py, three
# processes: flag, options, default), then the suite (--quick) with "xla_cublaslt" compiled
# that way in the suite's own process. Usage: bash device3.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
H=benchmarks/results/2026-12-04-h200-u-xla-cublaslt/hlo_options.py
XLA_FLAGS=--xla_gpu_enable_cublaslt=true python "$H" flag > "$D/hlo-flag.txt" 2>> "$D/hlo.err"
python "$H" options > "$D/hlo-options.txt" 2>> "$D/hlo.err"
python "$H" default > "$D/hlo-default.txt" 2>> "$D/hlo.err"
paste <(cut -c10- "$D/hlo-flag.txt") <(cut -c10- "$D/hlo-options.txt") | awk -F'\t' '{print ($1==$2 ? "same" : "DIFFERENT"), $1, "|", $2}' > "$D/hlo-compare.txt"
python -m benchmarks.run --quick --out "$D/suite" > "$D/suite.log" 2>&1
cat "$D/hlo-compare.txt"; tail -n 40 "$D/suite"/*.md
