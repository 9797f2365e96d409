#!/bin/bash
# One device call: the chain probe (benchmarks.probes.chain_outputs) without flags and with
# XLA's command-buffer VA remapping (alone, and with update mode SKIP_TEMP, which the
# remapping allocator requires in XLA's source), three processes each, in turns.
# Usage: bash device2.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
settings=(
  ""
  "--xla_gpu_enable_command_buffer_va_remapping=true"
  "--xla_gpu_enable_command_buffer_va_remapping=true --xla_gpu_command_buffer_update_mode=SKIP_TEMP"
)
for p in 1 2 3; do
  i=0
  for s in "${settings[@]}"; do
    i=$((i+1))
    echo "$(date +%T) setting $i '$s' process $p"
    XLA_FLAGS="$s" timeout 110 python3 -m benchmarks.probes.chain_outputs > "$D/s$i-p$p.txt" 2>&1
    echo "rc $?"; tail -c 400 "$D/s$i-p$p.txt" | grep -iE 'error|fatal|unknown' 
  done
done
echo "== summary (XLA µs / fused µs per pattern) =="
for f in "$D"/s*-p*.txt; do echo "$(basename $f): $(grep -h 'XLA/fused' "$f" | sed 's| *XLA/fused||; s/  */ /g' | tr '\n' ';')"; done
