"""Probe: a block that mixes GELU and ReLU layers, fwd+bwd, against XLA.

    python -m benchmarks.probes.mixed_block [--out DIR] [--shape M D ...]

``fused_mlp``'s "auto" links a large GELU layer into the next layer's input-gradient GEMM
(DGELU) and runs a large ReLU layer that feeds a layer as "cublaslt" (mask backward,
2026-12-04 (v)). A block holding both takes the linked path with a ReLU layer in it, which
benchmarks.training's two-layer rows never time. This probe times

    relu(gelu(x @ w1 + b1) @ w2 + b2) @ w3 + b3        (widths D -> 4D -> 4D -> D, bf16)

under ``jax.jit(jax.grad)`` in all seven arrays (loss ``sum(y**2) / 2``, as the MLP rows),
median of interleaved samples of back-to-back calls, as:

- ``xla``: the plain expression;
- ``fused_dense``: three ``fused_dense`` calls as users write them ("auto");
- ``fused_mlp``: ``fused_mlp`` with "auto" (linked from 8192 rows);
- ``fused_mlp_cublaslt``: ``fused_mlp`` with "cublaslt".

Results: DIR/mixed_block.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import activation_fn, ratio_table, time_jax_interleaved, write_results
from benchmarks.training import layer_inputs
from jax_epilog import fused_dense, fused_mlp

ACTIVATIONS = ("gelu", "relu", None)
CONTENDERS = ("xla", "fused_dense", "fused_mlp", "fused_mlp_cublaslt")
SHAPES = [(8192, 1024), (2048, 1024)]


def inputs(m: int, d: int) -> tuple[jax.Array, ...]:
    """(x, w1, b1, w2, b2, w3, b3) of the M×D -> 4D -> 4D -> D block."""
    rng = np.random.default_rng(5)
    widths = (d, 4 * d, 4 * d, d)
    x, *_ = layer_inputs(m, d, 4 * d, rng)
    params = []
    for k, n in itertools.pairwise(widths):
        _, w, b = layer_inputs(1, k, n, rng)
        params += [w, b]
    return x, *params


def _pairs(params) -> list[tuple[jax.Array, jax.Array]]:
    return list(zip(params[::2], params[1::2]))


def block(contender: str):
    """The block's forward as each contender writes it."""
    if contender in ("xla", "fused_dense"):
        layer = {
            "xla": lambda x, w, b, act: activation_fn(act)(x @ w + b),
            "fused_dense": lambda x, w, b, act: fused_dense(x, w, b, activation=act),
        }[contender]

        def f(x, *params):
            for (w, b), act in zip(_pairs(params), ACTIVATIONS):
                x = layer(x, w, b, act)
            return x

        return f
    impl = "cublaslt" if contender.endswith("cublaslt") else "auto"
    return lambda x, *params: fused_mlp(x, _pairs(params), ACTIVATIONS, implementation=impl)


def grad_step(contender: str):
    f = block(contender)
    loss = lambda *a: 0.5 * jnp.sum(jnp.square(f(*a).astype(jnp.float32)))
    return jax.jit(jax.grad(loss, argnums=tuple(range(7))))


def bench(shapes) -> list[dict]:
    rows = []
    for m, d in shapes:
        args = inputs(m, d)
        times = time_jax_interleaved(*[(grad_step(c), args) for c in CONTENDERS])
        row = {"shape": f"{m}x{d}->{4 * d}->{4 * d}->{d}", "activations": "gelu, relu, none"}
        row |= {"dtype": "bfloat16"} | {f"{c}_us": t for c, t in zip(CONTENDERS, times)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def render(rows) -> str:
    return ratio_table(rows, CONTENDERS, {"M×D→4D→4D→D (bf16; gelu, relu, none)": lambda r: r["shape"]})


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="folder for mixed_block.json and mixed_block.md")
    parser.add_argument("--shape", nargs=2, type=int, action="append", metavar=("M", "D"))
    args = parser.parse_args(argv)
    rows = bench([tuple(s) for s in args.shape] if args.shape else SHAPES)
    table = render(rows)
    if args.out:
        write_results(args.out, "mixed_block", rows, table)
    print(table)


if __name__ == "__main__":
    main()
