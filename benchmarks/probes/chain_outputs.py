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

import jax

from benchmarks.forward import chain, chain_operands, feedback, released, single_layers, time_jax_interleaved
from jax_epilog import _ffi

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
    """How many distinct result buffers ``calls`` untimed calls produce, each result held
    until the next call returns, as in the timed batches (the runs of 2026-12-03 (q) dropped
    each result at once, so their "replace" rows read 1)."""
    seen, result = set(), None
    for _ in range(calls):
        result = step()
        seen.add(result.unsafe_buffer_pointer())
    jax.block_until_ready(result)
    return len(seen)


def with_xla_op_last(program):
    """``program`` followed by a small XLA op (``+ bs[0] * 0``, which XLA does not fold for
    floats), so that an XLA kernel, not the last custom call, writes the result."""
    return jax.jit(lambda x, ws, bs: program(x, ws, bs) + bs[0] * 0)


def counted(step, runs: dict, key):
    """``step`` that adds the FFI handler's runs during each call to ``runs[key]``."""

    def call():
        before = _ffi.handler_stats()[0]
        result = step()
        runs[key] += _ffi.handler_stats()[0] - before
        return result

    return call


def main(out: str | None = None) -> list[dict]:
    x, ws, bs = chain_operands(M, K, DEPTH)
    rows = []
    for activation in ("relu", "gelu"):
        layers = single_layers(activation)
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
        tail = with_xla_op_last(chain(layers["fused"], DEPTH))
        small = jax.jit(lambda x, ws, bs: x * 2 + 1)
        for name, program in (("fused + XLA op", tail), ("one XLA op", small)):
            jax.block_until_ready(program(x, ws, bs))
            steps[(name, "replace")] = replace(program, x, ws, bs)
            steps[(name, "released")] = released(program, x, ws, bs)
        distinct = {key: addresses(step) for key, step in steps.items()}
        runs = dict.fromkeys(steps, 0)
        times = time_jax_interleaved(*((counted(step, runs, key), ()) for key, step in steps.items()))
        for (key, step), us in zip(steps.items(), times):
            row = {"act": activation, "program": key[0], "pattern": key[1], "us": round(us, 1),
                   "handler_runs": runs[key], "addresses": distinct[key]}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
        us = {key: t for key, t in zip(steps, times)}
        for pattern in ("replace", "released", "keep 8", "donated"):
            ratio = us[("xla", pattern)] / us[("fused", pattern)]
            print(f"{activation:4s} {pattern:10s} XLA/fused {ratio:.2f}x", flush=True)
        for name in ("fused + XLA op", "one XLA op"):
            print(
                f"{activation:4s} {name:14s} replace {us[(name, 'replace')]:.1f} µs, "
                f"released {us[(name, 'released')]:.1f} µs",
                flush=True,
            )
    if out:
        with open(os.path.join(out, f"chain_outputs-{os.getpid()}.json"), "w") as fh:
            json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
