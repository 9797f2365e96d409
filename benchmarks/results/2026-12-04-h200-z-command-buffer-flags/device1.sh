#!/bin/bash
# One device call: which command-buffer flags this jaxlib's XLA knows, then the chain
# probe (benchmarks.probes.chain_outputs) under each accepted setting, two processes each (one without flags).
# Usage: bash device1.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
dirs=$(python3 -c "import jax_plugins, jaxlib, os; print(*jax_plugins.__path__, os.path.dirname(jaxlib.__file__))")
for f in $(find $dirs -name '*.so*'); do
  grep -aoE 'xla_gpu_(command_buffer|graph|enable_command_buffer)[a-z_]*|(VMM_PERSISTENT_TEMP|SKIP_TEMP|DYNAMIC_ALLOCATE|ALWAYS_UPDATE|NEVER_UPDATE)' "$f"
done | sort | uniq -c > "$D/flags.txt"
cat "$D/flags.txt"
settings=(
  ""
  "--xla_gpu_command_buffer_update_mode=VMM_PERSISTENT_TEMP"
  "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
  "--xla_gpu_command_buffer_cache_size=8"
)
i=0
for s in "${settings[@]}"; do
  i=$((i+1))
  if ! XLA_FLAGS="$s" timeout 60 python3 -c "import jax, jax.numpy as jnp; print(jax.jit(lambda a: a*2)(jnp.ones(4)).sum())" > "$D/accept$i.log" 2>&1; then
    echo "setting $i '$s' refused: $(tail -c 300 "$D/accept$i.log")"; continue
  fi
  for p in $(seq 1 $([ -z "$s" ] && echo 1 || echo 2)); do
    echo "$(date +%T) setting $i '$s' process $p"
    XLA_FLAGS="$s" timeout 110 python3 -m benchmarks.probes.chain_outputs > "$D/s$i-p$p.txt" 2>&1
    echo "rc $?"; grep -E 'XLA/fused|µs, released' "$D/s$i-p$p.txt"
  done
done
echo "== summary (XLA µs / fused µs per pattern) =="
for f in "$D"/s*-p*.txt; do echo "$(basename $f): $(grep -h 'XLA/fused' "$f" | sed 's| *XLA/fused||; s/  */ /g' | tr '\n' ';')"; done
