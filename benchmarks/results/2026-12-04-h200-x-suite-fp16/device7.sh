#!/bin/bash
# One device call after "auto" left float32 to XLA: the float32 part of the full suite
# (a second TF32 reading; "auto" should now time XLA's program), tests/test_implementation.py
# whole on the GPU, and the GPU check without benchmarks. Usage: bash device7.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
echo "$(date +%T) float32 suite"
timeout 300 python3 -m benchmarks.run --full --dtype float32 --out "$D/full" > "$D/full.log" 2>&1
echo "$(date +%T) test_implementation"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_implementation.py > "$D/test_implementation.log" 2>&1
echo "$(date +%T) check"
SKIP_BENCH=1 OUT="$D/check" timeout 150 bash scripts/gpu_check.sh > "$D/check.log" 2>&1
echo "$(date +%T) done"
tail -n 1 "$D/test_implementation.log"
tail -n 4 "$D/check.log"
f=$(ls "$D"/full/*.md 2>/dev/null | head -1)
[ -n "$f" ] && grep -E "^\| [0-9]+x|^## |Slowest|Noise|In [0-9]+ forward" "$f" | cut -c1-220 | grep -v "Host\|ceiling"
