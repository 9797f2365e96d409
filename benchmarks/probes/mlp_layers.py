"""Probe: in an MLP block's fwd+bwd, which layer's cuBLASLt backward gains over XLA?

    python -m benchmarks.probes.mlp_layers [--out DIR] [--shape M D ...] [--activation relu gelu]
                                           [--forward] [--dtype bfloat16 float16]

benchmarks.training's MLP rows (2026-12-04 (v)) read ``fused_mlp(implementation="cublaslt")``
ahead of XLA on ReLU blocks (1.01-1.16x) where "auto", XLA's autodiff, reads 1.00x. With
ReLU first, ``fused_mlp`` is the stack of two ``fused_dense`` calls: a ReLU layer (mask in
the forward; dz from it, XLA's GEMMs) and a layer without activation (BGRADA). This probe
times the block ``act(x @ w1 + b1) @ w2 + b2`` (the rows' inputs and loss ``sum(y**2) / 2``,
``jax.jit(jax.grad)`` in all five arrays, median of interleaved samples of back-to-back
calls) as:

- ``xla``: the plain expression;
- ``auto``: two ``fused_dense`` calls as users write them (XLA's autodiff);
- ``both``: both calls with ``implementation="cublaslt"``;
- ``first``: the activation layer "cublaslt", the other "auto";
- ``second``: the activation layer "auto", the other "cublaslt";
- ``bgrada``: as ``auto``, but the second layer's kernel and bias gradients come from one
  cuBLASLt GEMM with the BGRADA epilog (its forward and input gradient stay XLA's): does
  ``second``'s gain come from that GEMM or from the fused forward?
- ``fused_mlp``: the block as ``fused_mlp`` with its default "auto": which of the above
  its rule picks, timed beside them.

With ``--forward`` the same contenders time the block's forward alone (``jax.jit`` of it);
``--dtype`` lists the blocks' dtypes (inputs, weights and biases alike; bfloat16 by default).
Results: DIR/mlp_layers.{json,md}.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from benchmarks.forward import activation_fn, ratio_table, time_jax_interleaved, write_results
from benchmarks.training import mlp_inputs
from jax_epilog import fused_dense, fused_mlp
from jax_epilog._epilogs import ComputeType
from jax_epilog._primitive import fused_weight_grad

IMPLEMENTATIONS = {  # contender -> (first layer's, second layer's implementation)
    "auto": ("auto", "auto"),
    "both": ("cublaslt", "cublaslt"),
    "first": ("cublaslt", "auto"),
    "second": ("auto", "cublaslt"),
}
CONTENDERS = ("xla", *IMPLEMENTATIONS, "bgrada", "fused_mlp")
SHAPES = [(8192, 1024), (8192, 4096), (2048, 1024)]


def block(contender: str, activation: str):
    if contender == "xla":
        act = activation_fn(activation)
        return lambda x, w1, b1, w2, b2: act(x @ w1 + b1) @ w2 + b2
    if contender == "fused_mlp":
        return lambda x, w1, b1, w2, b2: fused_mlp(x, [(w1, b1), (w2, b2)], [activation, None])
    if contender == "bgrada":
        return lambda x, w1, b1, w2, b2: _bgrada_layer(fused_dense(x, w1, b1, activation=activation), w2, b2)
    first, second = IMPLEMENTATIONS[contender]

    def f(x, w1, b1, w2, b2):
        h = fused_dense(x, w1, b1, activation=activation, implementation=first)
        return fused_dense(h, w2, b2, implementation=second)

    return f


@jax.custom_vjp
def _bgrada_layer(h, w, b):
    """``h @ w + b`` by XLA; under grad, (dw, db) from one BGRADA GEMM (XLA's dh)."""
    return h @ w + b


def _bgrada_fwd(h, w, b):
    return h @ w + b, (h, w)


def _bgrada_bwd(residuals, dy):
    h, w = residuals
    dw, db = fused_weight_grad(h, dy, compute_type=ComputeType.COMPUTE_32F, d_dtype=w.dtype)
    return dy @ w.T, dw, db


_bgrada_layer.defvjp(_bgrada_fwd, _bgrada_bwd)


def grad_step(contender: str, activation: str):
    f = block(contender, activation)
    loss = lambda *a: 0.5 * jnp.sum(jnp.square(f(*a).astype(jnp.float32)))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def bench(shapes, activations, forward: bool = False, dtypes=("bfloat16",)) -> list[dict]:
    rows = []
    step = (lambda c, a: jax.jit(block(c, a))) if forward else grad_step
    for dtype in dtypes:
        for activation in activations:
            for m, d in shapes:
                args = mlp_inputs(m, d, jnp.dtype(dtype))
                times = time_jax_interleaved(*[(step(c, activation), args) for c in CONTENDERS])
                row = {"shape": f"{m}x{d}->{4 * d}->{d}", "activation": activation, "dtype": dtype}
                row["mode"] = "forward" if forward else "fwd+bwd"
                row |= {f"{c}_us": t for c, t in zip(CONTENDERS, times)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def render(rows) -> str:
    columns = {
        "M×D→4D→D": lambda r: f"{r['shape']} ({r['mode']})",
        "dtype": lambda r: r["dtype"],
        "act": lambda r: r["activation"],
    }
    return ratio_table(rows, CONTENDERS, columns)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", help="folder for mlp_layers.json and mlp_layers.md")
    parser.add_argument("--shape", nargs=2, type=int, action="append", metavar=("M", "D"))
    parser.add_argument("--activation", nargs="+", choices=("relu", "gelu"), default=["relu"])
    parser.add_argument("--forward", action="store_true", help="time the block's forward alone")
    parser.add_argument("--dtype", nargs="+", choices=("bfloat16", "float16"), default=["bfloat16"])
    args = parser.parse_args(argv)
    shapes = [tuple(s) for s in args.shape] if args.shape else SHAPES
    rows = bench(shapes, args.activation, args.forward, args.dtype)
    table = render(rows)
    if args.out:
        write_results(args.out, "mlp_layers", rows, table)
    print(table)


if __name__ == "__main__":
    main()
