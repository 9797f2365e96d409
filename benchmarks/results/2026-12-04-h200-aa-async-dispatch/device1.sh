#!/bin/bash
# One device call: does PjRt's asynchronous dispatch (PJRT_GPU_ENABLE_ASYNC_DISPATCH=1, or
# the client option use_tfrt_gpu_client) remove the cost per JAX execution that keeps the
# fused layer under nvmath at 8192x4096->1024? The plugin's strings, then
# benchmarks.probes.per_program in one process per setting, then the GPU tests under it.
# Usage: bash device1.sh OUTDIR
D=${1:?out dir}; mkdir -p "$D"
dirs=$(python3 -c "import jax_plugins, jaxlib, os; print(*jax_plugins.__path__, os.path.dirname(jaxlib.__file__))")
for f in $(find $dirs -name '*.so*'); do
  grep -aoE 'PJRT_GPU_ENABLE_ASYNC_DISPATCH|use_tfrt_gpu_client|TfrtGpuClient|use_async_dispatch' "$f"
done | sort | uniq -c > "$D/strings.txt"
cat "$D/strings.txt"
probe() {  # label, env assignments..., then python3 -c prefix handled inside
  local label=$1; shift
  echo "$(date +%T) $label"
  env "$@" timeout 140 python3 -c "
import sys, jax
if '$label' == 'tfrt-option':
    jax.config.update('jax_pjrt_client_create_options', {'use_tfrt_gpu_client': True})
print(jax.devices(), jax.devices()[0].client.platform_version, flush=True)
from benchmarks.probes import per_program
per_program.main(['--shape', '8192', '4096', '1024', '--reps', '4', '--out', '$D/$label'])
" > "$D/$label.txt" 2>&1
  echo "rc $?"; tail -n 3 "$D/$label.txt"
}
probe default
probe async-env PJRT_GPU_ENABLE_ASYNC_DISPATCH=1
probe tfrt-option
echo "$(date +%T) GPU tests with async dispatch"
PJRT_GPU_ENABLE_ASYNC_DISPATCH=1 timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/ > "$D/tests-async.log" 2>&1
echo "rc $?"; tail -n 3 "$D/tests-async.log"
echo "== summary =="
for l in default async-env tfrt-option; do echo "$l: $(grep -h 'median' "$D/$l.txt" | tr '\n' ';')"; done
