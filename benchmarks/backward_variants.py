"""Which backward should fused_dense use? fwd+bwd variants timed side by side.

    python -m benchmarks.backward_variants [--out DIR] [--shape M K N ...]

For each M×K→N of benchmarks.training (bf16) and relu/gelu, this times
``jax.jit(jax.grad(loss, argnums=(0, 1, 2)))`` (median of 7 interleaved samples, as
benchmarks.forward) for six layers:

- ``xla``: the plain expression ``act(x @ w + b)``, differentiated by XLA;
- ``cublaslt``: ``fused_dense(..., implementation="cublaslt")``: the fused forward saves the
  aux; the backward's kernel and bias gradients come from one BGRADA GEMM for GELU (for
  ReLU, since 2026-12-04 (u), from XLA: the same program as ``aux+xla``);
- ``aux+xla``: the fused forward with its aux, then the backward from that aux with XLA's
  GEMMs and a separate reduction for the bias gradient (a custom_vjp written here);
- ``auto``: ``fused_dense``'s default;
- ``aux+ones`` and ``xla+ones``: as ``aux+xla``, and as XLA's own forward that keeps z, but
  the bias gradient comes out of the kernel-gradient GEMM: x gains a column of ones (and
  seven of zeros, to keep rows 16-byte aligned), so ``[x, 1, 0]^T @ dz`` holds ``x^T @ dz``
  in its first K rows and ``sum(dz, 0)`` in row K, with no separate reduction over dz.

and three losses: ``sum``, ``sum(act(z))`` as in the issue's anchor (XLA's program then never
computes act(z) itself: only its derivative is needed); ``sq``, ``sum(act(z)**2) / 2``, where
the output's cotangent is the output itself (XLA can still form it from z inside one
elementwise pass, never writing act(z)); and ``next``, ``sum((act(z) @ v)**2) / 2`` with a
fixed random v of shape (N, 128), where a GEMM reads the output as a next layer does. A
last row per shape times the kernel-gradient GEMM alone: BGRADA against XLA's ``x.T @ dz``
with and without ``dz.sum(0)``. Results: benchmarks/results/*/backward_variants.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import activation_fn, single_layers, time_jax_interleaved, write_results
from benchmarks.training import GRAD_SHAPES, layer_inputs
from jax_epilog import _reference, fused_dense
from jax_epilog._epilogs import Activation, ComputeType
from jax_epilog._primitive import fused_weight_grad

CT = ComputeType.COMPUTE_32F
NEXT_WIDTH = 128  # the "next" loss's second layer: y @ v with v of shape (N, NEXT_WIDTH)


def _next_layer(y):
    """``sum((y @ v)**2) / 2`` for a fixed random v: y is read by a GEMM, as by a next layer."""
    v = jax.random.normal(jax.random.key(0), (y.shape[-1], NEXT_WIDTH), y.dtype) / np.sqrt(y.shape[-1])
    return 0.5 * jnp.sum(jnp.square((y @ v).astype(jnp.float32)))


LOSSES = {
    "sum": lambda y: jnp.sum(y, dtype=jnp.float32),
    "sq": lambda y: 0.5 * jnp.sum(jnp.square(y.astype(jnp.float32))),
    "next": _next_layer,
}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def aux_then_xla(x, w, b, activation: str):
    """The fused forward; under grad, a backward from its aux with XLA's GEMMs."""
    return fused_dense(x, w, b, activation=activation, implementation="cublaslt")


def _aux_fwd(x, w, b, activation):
    y, aux = fused_dense(x, w, b, activation=activation, return_aux=True, implementation="cublaslt")
    return y, (x, w, aux)


def _aux_bwd(activation, residuals, dy):
    x, w, aux = residuals
    dz = _reference.output_grad(aux, dy, None, Activation(activation), CT, x.dtype)
    dw, db = _reference.weight_grad(x, dz, CT, w.dtype, with_bias=True)
    return _reference.input_grad(dz, w, CT), dw, db


aux_then_xla.defvjp(_aux_fwd, _aux_bwd)

ONES_PAD = 8  # x gains [1, 0 x 7]: rows of K + 8 bf16 stay 16-byte aligned


def _weight_and_bias_grad(x, dz):
    """(x^T @ dz, sum(dz, 0)) from ONE GEMM: ``[x, 1, 0...]^T @ dz``, row K being the sums."""
    m, k = x.shape
    ones = jnp.zeros((m, ONES_PAD), x.dtype).at[:, 0].set(1)
    both = _reference._matmul(jnp.concatenate([x, ones], axis=1), dz, ((0,), (0,)), CT)
    return both[:k].astype(x.dtype), both[k].astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ones_trick(x, w, b, activation: str, fused_forward: bool):
    """``act(x @ w + b)``; under grad, the bias gradient from the kernel-gradient GEMM."""
    if fused_forward:
        return fused_dense(x, w, b, activation=activation, implementation="cublaslt")
    return activation_fn(activation)(x @ w + b)


def _ones_fwd(x, w, b, activation, fused_forward):
    if fused_forward:  # residual: the epilog's aux (the ReLU bit-mask or GELU's z)
        y, aux = fused_dense(x, w, b, activation=activation, return_aux=True, implementation="cublaslt")
        return y, (x, w, aux)
    z = x @ w + b  # residual: z itself, as XLA's autodiff keeps it
    return activation_fn(activation)(z), (x, w, z)


def _ones_bwd(activation, fused_forward, residuals, dy):
    x, w, saved = residuals
    if fused_forward:
        dz = _reference.output_grad(saved, dy, None, Activation(activation), CT, x.dtype)
    else:
        dz = jax.vjp(activation_fn(activation), saved)[1](dy)[0]
    dw, db = _weight_and_bias_grad(x, dz)
    return _reference.input_grad(dz, w, CT), dw, db


ones_trick.defvjp(_ones_fwd, _ones_bwd)


def layers(activation):
    pair = single_layers(activation)
    return {
        "xla": pair["xla"],
        "cublaslt": pair["fused"],
        "aux+xla": lambda x, w, b: aux_then_xla(x, w, b, activation),
        "auto": lambda x, w, b: fused_dense(x, w, b, activation=activation),
        "aux+ones": lambda x, w, b: ones_trick(x, w, b, activation, True),
        "xla+ones": lambda x, w, b: ones_trick(x, w, b, activation, False),
    }


def bench(rows, shapes=GRAD_SHAPES):
    for m, k, n in shapes:
        rng = np.random.default_rng(3)
        x, w, b = layer_inputs(m, k, n, rng)
        for activation in ("relu", "gelu"):
            for loss_name, loss in LOSSES.items():
                grads = {
                    name: jax.jit(
                        jax.grad(lambda x, w, b, f=f, loss=loss: loss(f(x, w, b)), argnums=(0, 1, 2))
                    )
                    for name, f in layers(activation).items()
                }
                times = time_jax_interleaved(*((g, (x, w, b)) for g in grads.values()))
                row = dict(shape=f"{m}x{k}->{n}", activation=activation, loss=loss_name,
                           **{f"{name}_us": t for name, t in zip(grads, times)})  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        dz = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        parts = [
            jax.jit(lambda x, dz: fused_weight_grad(x, dz, compute_type=CT, d_dtype="bfloat16")),
            jax.jit(lambda x, dz: _reference.weight_grad(x, dz, CT, "bfloat16", with_bias=True)),
            jax.jit(lambda x, dz: _reference.weight_grad(x, dz, CT, "bfloat16", with_bias=False)[0]),
        ]
        times = time_jax_interleaved(*((p, (x, dz)) for p in parts))
        row = {"shape": f"{m}x{k}->{n}", "part": "kernel gradient", "bgrada_us": times[0],
              "xla_dot_sum_us": times[1], "xla_dot_us": times[2]}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)


def render(rows) -> str:
    names = ("xla", "cublaslt", "aux+xla", "auto", "aux+ones", "xla+ones")
    lines = [
        "| M×K→N (bf16) | act | loss | "
        + " | ".join(f"{n} µs" for n in names)
        + " | "
        + " | ".join(f"XLA/{n}" for n in names[1:])
        + " |",
        "|---|---|---|" + "---|" * (2 * len(names) - 1),
    ]
    for r in rows:
        if "loss" not in r:
            continue
        t = [r.get(f"{n}_us", float("nan")) for n in names]
        cells = [f"{v:.1f}" for v in t] + [f"{t[0] / v:.2f}×" for v in t[1:]]
        lines.append(f"| {r['shape']} | {r['activation']} | {r['loss']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| M×K→N (bf16) | BGRADA GEMM µs | XLA x.T @ dz + dz.sum(0) µs | XLA x.T @ dz µs |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if r.get("part") == "kernel gradient":
            lines.append(
                f"| {r['shape']} | {r['bgrada_us']:.1f} | {r['xla_dot_sum_us']:.1f} | {r['xla_dot_us']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="folder for backward_variants.{json,md}")
    parser.add_argument("--shape", type=int, nargs=3, action="append", metavar=("M", "K", "N"),
                        help="M K N instead of benchmarks.training's shapes (repeatable)")  # fmt: skip
    args = parser.parse_args(argv)
    rows: list[dict] = []
    bench(rows, [tuple(s) for s in args.shape] if args.shape else GRAD_SHAPES)
    table = render(rows)
    print(table)
    if args.out:
        write_results(args.out, "backward_variants", rows, table)


if __name__ == "__main__":
    main()
