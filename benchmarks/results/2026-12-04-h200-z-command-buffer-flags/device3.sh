#!/bin/bash
# One device call: cb_options.py without options and with per-executable command-buffer
# options (VA remapping alone, and with update mode SKIP_TEMP), three processes each, in turns.
# Usage: bash device3.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"; here=$(dirname "$0")
settings=(
  '{}'
  '{"xla_gpu_enable_command_buffer_va_remapping": true}'
  '{"xla_gpu_enable_command_buffer_va_remapping": true, "xla_gpu_command_buffer_update_mode": "SKIP_TEMP"}'
)
for p in 1 2 3; do
  i=0
  for s in "${settings[@]}"; do
    i=$((i+1))
    echo "$(date +%T) setting $i $s process $p"
    timeout 100 python3 "$here/cb_options.py" "$s" > "$D/o$i-p$p.txt" 2>&1
    echo "rc $?"; tail -c 600 "$D/o$i-p$p.txt" | grep -iE 'error|fatal|unknown|invalid'
  done
done
echo "== summary (XLA µs / fused µs) =="
for f in "$D"/o*-p*.txt; do echo "$(basename $f): $(grep -h 'XLA/fused' "$f" | sed 's| *XLA/fused||; s/  */ /g' | tr '\n' ';')"; done
