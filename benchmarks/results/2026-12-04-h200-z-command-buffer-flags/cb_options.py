"""The 16-layer chain (256x1024->1024 bf16, benchmarks.forward.chain) compiled with XLA
command-buffer options passed per executable (``compile(compiler_options=...)``, which sets
debug options by name, flags or not), timed as ``y = step(x)`` (previous result alive) and
released, fused and XLA in turns (benchmarks.forward's method).

    python cb_options.py '{"xla_gpu_enable_command_buffer_va_remapping": true}'
"""

import json
import sys

import jax

from benchmarks.forward import chain, chain_operands, released, single_layers, time_jax_interleaved
from benchmarks.probes.chain_outputs import addresses, replace

options = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
x, ws, bs = chain_operands(256, 1024, 16)
for activation in ("relu", "gelu"):
    steps = {}
    for name, layer in single_layers(activation).items():
        program = chain(layer, 16).lower(x, ws, bs).compile(compiler_options=options or None)
        jax.block_until_ready(program(x, ws, bs))
        steps[(name, "replace")] = replace(program, x, ws, bs)
        steps[(name, "released")] = released(program, x, ws, bs)
    distinct = {key: addresses(step) for key, step in steps.items()}
    times = dict(zip(steps, time_jax_interleaved(*((step, ()) for step in steps.values()))))
    for key, us in times.items():
        print(activation, *key, f"{us:.1f} µs", f"{distinct[key]} addresses", flush=True)
    for pattern in ("replace", "released"):
        print(f"{activation} {pattern} XLA/fused {times[('xla', pattern)] / times[('fused', pattern)]:.2f}x", flush=True)
