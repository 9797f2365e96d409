"""Why the non-donated 16-layer chain scatters: how long the caller keeps each result.

    python -m benchmarks.probes.chain_outputs [OUT_DIR]

The chain of benchmarks.forward (16 layers at 256x1024->1024 bf16, weights stacked, command
buffers on) read 1.00-1.17x XLA's time from run to run when each call's result replaced the
previous one, and 1.25-1.31x (ReLU) when x was donated. XLA updates a recorded command
buffer when a buffer it uses has moved; this probe varies only when the caller lets go of
each result, with the same two jitted programs (fused and XLA) throughout:

- "replace": ``out = f(x)``, the previous result alive while the next call is dispatched
  (the benchmark's pattern);
- "released": the previous result deleted before the next call, so its memory is free
  (benchmarks.forward.released; the runs in results/2026-12-03-h200-q-chain-outputs/ print
  this pattern as "free first");
- "keep 8": the last eight results kept alive;
- "donated": x donated and each result fed back (benchmarks.forward's "x donated").

For each it reports µs per call (the suite's interleaved method), how often our FFI handler
ran, and how many distinct result addresses 40 untimed calls produced. Run it in several
processes: the question is which pattern is stable from process to process.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import activation_fn, chain, feedback, released, time_jax_interleaved
from jax_epilog import _ffi, fused_dense

M, K, DEPTH = 256, 1024, 16


def replace(program, *args):
    return lambda: program(*args)


def keep(program, *args, count=8):
    held = collections.deque(maxlen=count)

    def step():
        held.append(program(*args))
        return held[-1]

    return step


def addresses(step, calls=40) -> int:
    seen = set()
    for _ in range(calls):
        seen.add(step().unsafe_buffer_pointer())
    jax.block_until_ready(step())
    return len(seen)


def main(out: str | None = None) -> list[dict]:
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    ws = jnp.asarray(rng.standard_normal((DEPTH, K, K)) / np.sqrt(K), jnp.bfloat16)
    bs = jnp.asarray(rng.standard_normal((DEPTH, K)) * 0.1, jnp.bfloat16)
    rows = []
    for activation in ("relu", "gelu"):
        act = activation_fn(activation)
        layers = {
            "fused": partial(fused_dense, activation=activation, implementation="cublaslt"),
            "xla": lambda x, w, b, act=act: act(x @ w + b),
        }
        steps = {}
        for name, layer in layers.items():
            program = chain(layer, DEPTH)
            jax.block_until_ready(program(x, ws, bs))
            steps[(name, "replace")] = replace(program, x, ws, bs)
            steps[(name, "released")] = released(program, x, ws, bs)
            steps[(name, "keep 8")] = keep(program, x, ws, bs)
            steps[(name, "donated")] = feedback(chain(layer, DEPTH, donate=True), x, ws, bs)
        # The fused chain with one small XLA op after its last layer (the result is then
        # written by an XLA kernel, not by our custom call), and one XLA op alone (host-bound:
        # what the calling pattern costs any program).
        tail = jax.jit(lambda x, ws, bs: chain(layers["fused"], DEPTH)(x, ws, bs) + bs[0] * 0)
        small = jax.jit(lambda x, ws, bs: x * 2 + 1)
        for name, program in (("fused + XLA op", tail), ("one XLA op", small)):
            jax.block_until_ready(program(x, ws, bs))
            steps[(name, "replace")] = replace(program, x, ws, bs)
            steps[(name, "released")] = released(program, x, ws, bs)
        distinct = {key: addresses(step) for key, step in steps.items()}
        runs = {}

        def counted(key, step):
            def call():
                before = _ffi.handler_stats()[0]
                result = step()
                runs[key] = runs.get(key, 0) + _ffi.handler_stats()[0] - before
                return result

            return call

        times = time_jax_interleaved(*((counted(k, s), ()) for k, s in steps.items()))
        for (key, step), us in zip(steps.items(), times):
            row = dict(act=activation, program=key[0], pattern=key[1], us=round(us, 1),
                       handler_runs=runs.get(key, 0), addresses=distinct[key])  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        us = {key: t for key, t in zip(steps, times)}
        for pattern in ("replace", "released", "keep 8", "donated"):
            ratio = us[("xla", pattern)] / us[("fused", pattern)]
            print(f"{activation:4s} {pattern:10s} XLA/fused {ratio:.2f}x", flush=True)
        for name in ("fused + XLA op", "one XLA op"):
            print(f"{activation:4s} {name:14s} replace {us[(name, 'replace')]:.1f} µs, "
                  f"released {us[(name, 'released')]:.1f} µs", flush=True)
    if out:
        with open(os.path.join(out, f"chain_outputs-{os.getpid()}.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
