"""What one layer costs inside XLA's command buffers: chains of 16 and 64 layers.

    python -m benchmarks.probes.chain_depth [OUT_DIR]

Jitted chains of ``fused_dense`` (``implementation="cublaslt"``) and of XLA's plain
``act(x @ w + b)`` at 256x1024->1024 bf16 (weights stacked, sliced in the jit), 16 and 64
layers deep, timed interleaved (benchmarks.forward's method) with command buffers on. The
slope ``(t64 - t16) / 48`` is the time one more layer adds inside the graph; the rest is
the step's fixed cost (dispatch, graph launch). Writes chain_depth.json and XLA's optimized
HLO of its 16-layer ReLU chain (which kernels XLA runs per layer) into OUT_DIR.
Results: benchmarks/results/2026-12-02-h200-e-graph-tuning/probes/.
"""

from __future__ import annotations

import json
import os
import sys

import jax

from benchmarks.forward import chain, chain_operands, single_layers, time_jax_interleaved

M, K = 256, 1024
DEPTHS = (16, 64)


def main(out: str) -> list[dict]:
    x, ws, bs = chain_operands(M, K, max(DEPTHS), seed=0)
    rows = []
    for activation in ("relu", "gelu"):
        layers = single_layers(activation)
        programs = {(name, d): chain(layer, d) for name, layer in layers.items() for d in DEPTHS}
        for program in programs.values():
            jax.block_until_ready(program(x, ws, bs))  # compiled and planned before timing
        if activation == "relu":
            with open(os.path.join(out, "chain-xla-relu16.hlo.txt"), "w") as fh:
                fh.write(programs[("xla", 16)].lower(x, ws, bs).compile().as_text())
        times = dict(zip(programs, time_jax_interleaved(*((p, (x, ws, bs)) for p in programs.values()))))
        row = {"act": activation} | {f"{name}{d}": round(t, 1) for (name, d), t in times.items()}
        lo, hi = DEPTHS
        for name in layers:
            row[f"{name}_slope"] = round((times[(name, hi)] - times[(name, lo)]) / (hi - lo), 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(out, "chain_depth.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
