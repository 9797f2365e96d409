"""Probe: an MLP block's fwd+bwd (or forward) with cuBLASLt in both layers, one, or neither.

    python -m benchmarks.probes.mlp_layers [--out DIR] [--shape M D ...] [--activation relu gelu]
                                           [--forward] [--dtype bfloat16 float16 float32] [--tf32]
                                           [--policy FIELD=VALUE ...]

Backs ``fused_mlp``'s "auto" rules (docs/decisions.md: mlp-link, mlp-stack, mlp-relu).
Times the block ``act(x @ w1 + b1) @ w2 + b2`` (M×D → 4D → D; loss ``sum(y**2) / 2``,
``jax.jit(jax.grad)`` in all five arrays, medians of interleaved samples of back-to-back
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
  its rule picks, timed beside them;
- ``fused_mlp_cublaslt``: ``fused_mlp(implementation="cublaslt")``, every layer on
  cuBLASLt and a GELU layer's derivative taken inside the next GEMM (DGELU), whatever the
  rule would pick.

With ``--forward`` the same contenders time the block's forward alone (``jax.jit`` of it);
``--dtype`` lists the blocks' dtypes (inputs, weights and biases alike; bfloat16 by default).
Float32 blocks compute what ``fused_dense`` computes by default, full float32 products:
``xla`` asks for ``Precision.HIGHEST`` there. ``--tf32`` runs float32 blocks in TF32
instead (``COMPUTE_32F_FAST_TF32`` for the jax_epilog contenders; ``xla`` at
``Precision.DEFAULT``, which is TF32 on the GPU and what "auto" runs for that compute
type). Results: DIR/mlp_layers.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from benchmarks.common import (
    activation_fn,
    add_policy_option,
    policy,
    policy_changes,
    ratio_table,
    time_jax_interleaved,
    write_results,
)
from benchmarks.training import mlp_inputs
from jax_epilog import ComputeType, fused_dense, fused_mlp
from jax_epilog.primitives import fused_weight_grad

IMPLEMENTATIONS = {  # contender -> (first layer's, second layer's implementation)
    "auto": ("auto", "auto"),
    "both": ("cublaslt", "cublaslt"),
    "first": ("cublaslt", "auto"),
    "second": ("auto", "cublaslt"),
}
CONTENDERS = ("xla", *IMPLEMENTATIONS, "bgrada", "fused_mlp", "fused_mlp_cublaslt")
SHAPES = [(8192, 1024), (8192, 4096), (2048, 1024)]


class Arithmetic(NamedTuple):
    """How a block multiplies: the jax_epilog contenders' compute type, XLA's precision."""

    compute_type: ComputeType = ComputeType.COMPUTE_32F
    precision: jax.lax.Precision | None = None  # jnp.matmul's; float32: HIGHEST, or DEFAULT (TF32)

    @classmethod
    def of(cls, dtype: str, tf32: bool = False) -> Arithmetic:
        if dtype != "float32":
            return HALF
        if tf32:
            return cls(ComputeType.COMPUTE_32F_FAST_TF32, jax.lax.Precision.DEFAULT)
        return cls(ComputeType.COMPUTE_32F, jax.lax.Precision.HIGHEST)


HALF = Arithmetic()  # bfloat16 and float16: float32 accumulation, the expression as written


def block(contender: str, activation: str, arithmetic: Arithmetic = HALF):
    ct, precision = arithmetic
    if contender == "xla":
        act = activation_fn(activation)
        dot = partial(jnp.matmul, precision=precision)
        return lambda x, w1, b1, w2, b2: dot(act(dot(x, w1) + b1), w2) + b2
    if contender.startswith("fused_mlp"):
        impl = "cublaslt" if contender == "fused_mlp_cublaslt" else "auto"
        options = {"compute_type": ct, "implementation": impl}
        return lambda x, w1, b1, w2, b2: fused_mlp(x, [(w1, b1), (w2, b2)], [activation, None], **options)
    if contender == "bgrada":
        return lambda x, w1, b1, w2, b2: _bgrada_layer(
            fused_dense(x, w1, b1, activation=activation, compute_type=ct), w2, b2, arithmetic
        )
    first, second = IMPLEMENTATIONS[contender]

    def f(x, w1, b1, w2, b2):
        h = fused_dense(x, w1, b1, activation=activation, compute_type=ct, implementation=first)
        return fused_dense(h, w2, b2, compute_type=ct, implementation=second)

    return f


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _bgrada_layer(h, w, b, arithmetic: Arithmetic):
    """``h @ w + b`` by XLA; under grad, (dw, db) from one BGRADA GEMM (XLA's dh)."""
    return jnp.matmul(h, w, precision=arithmetic.precision) + b


def _bgrada_fwd(h, w, b, arithmetic: Arithmetic):
    return jnp.matmul(h, w, precision=arithmetic.precision) + b, (h, w)


def _bgrada_bwd(arithmetic: Arithmetic, residuals, dy):
    h, w = residuals
    dw, db = fused_weight_grad(h, dy, compute_type=arithmetic.compute_type, d_dtype=w.dtype)
    return jnp.matmul(dy, w.T, precision=arithmetic.precision), dw, db


_bgrada_layer.defvjp(_bgrada_fwd, _bgrada_bwd)


def grad_step(contender: str, activation: str, arithmetic: Arithmetic = HALF):
    f = block(contender, activation, arithmetic)
    loss = lambda *a: 0.5 * jnp.sum(jnp.square(f(*a).astype(jnp.float32)))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def forward_step(contender: str, activation: str, arithmetic: Arithmetic = HALF):
    return jax.jit(block(contender, activation, arithmetic))


def bench(shapes, activations, forward: bool = False, dtypes=("bfloat16",), tf32: bool = False) -> list[dict]:
    rows = []
    step = forward_step if forward else grad_step
    for dtype in dtypes:
        arithmetic = Arithmetic.of(dtype, tf32)
        for activation in activations:
            for m, d in shapes:
                args = mlp_inputs(m, d, jnp.dtype(dtype))
                times = time_jax_interleaved(*[(step(c, activation, arithmetic), args) for c in CONTENDERS])
                row = {"shape": f"{m}x{d}->{4 * d}->{d}", "activation": activation, "dtype": dtype}
                row["compute_type"] = arithmetic.compute_type.name
                row["mode"] = "forward" if forward else "fwd+bwd"
                row |= {f"{c}_us": t for c, t in zip(CONTENDERS, times)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def render(rows) -> str:
    columns = {
        "M×D→4D→D": lambda r: f"{r['shape']} ({r['mode']})",
        "dtype": lambda r: (
            r["dtype"] + (" (TF32)" if r.get("compute_type") == "COMPUTE_32F_FAST_TF32" else "")
        ),
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
    parser.add_argument(
        "--dtype", nargs="+", choices=("bfloat16", "float16", "float32"), default=["bfloat16"]
    )
    parser.add_argument("--tf32", action="store_true", help="float32 blocks in TF32 (default: full float32)")
    add_policy_option(parser)
    args = parser.parse_args(argv)
    shapes = [tuple(s) for s in args.shape] if args.shape else SHAPES
    with policy(policy_changes(args.policy)):
        rows = bench(shapes, args.activation, args.forward, args.dtype, args.tf32)
    table = render(rows)
    if args.out:
        write_results(args.out, "mlp_layers", rows, table)
    print(table)


if __name__ == "__main__":
    main()
