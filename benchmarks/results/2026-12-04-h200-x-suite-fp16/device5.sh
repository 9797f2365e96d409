#!/bin/bash
# One device call: one part of the full suite (python -m benchmarks.run --full --dtype ...),
# which as a whole outlasts a 10-minute call. Usage: bash device5.sh OUTDIR DTYPE...
D=${1:?out dir}; shift; mkdir -p "$D"
echo "$(date +%T) full suite, $*"
timeout 560 python3 -m benchmarks.run --full --dtype "$@" --out "$D/full" > "$D/full.log" 2>&1
echo "$(date +%T) done (rc $?)"
tail -n 4 "$D/full.log"
f=$(ls "$D"/full/*.md 2>/dev/null | head -1)
[ -n "$f" ] && grep -E "^\| [0-9]+x|^## |Slowest|Noise" "$f" | cut -c1-200 | grep -v "fwd+bwd\b" | tail -n 60
