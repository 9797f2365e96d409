"""Probe: the bias gradient as one more row of the kernel-gradient GEMM.

    python -m benchmarks.probes.bias_row [--out DIR] [--shape M K N ...] [--loss sum|sq]

In XLA's own fwd+bwd of ``act(x @ w + b)`` the bias gradient ``db = dz.sum(0)`` is a
separate column reduction over (M, N): 27.8 + 2.3 µs of 297.7 for ReLU at 8192x1024->4096
(results/2026-12-02-h200-f-profile/), and cuBLASLt's BGRADA / BGRADB epilogs launch a
reduction kernel of their own that takes as long ((m): +32 µs). The kernel-gradient GEMM
already reads dz and sums over M, so a column of ones appended to x makes its result one
row longer, and that row is ``1ᵀ dz = db``:

    [x | 1 | 0 ... 0]ᵀ @ dz = [[xᵀ dz], [db], [0], ...]          ((K + pad) x N)

The cost moves to copying x into the wider array (M x (K + pad)) and to the GEMM's extra
output rows (a tile row more where K is a multiple of the tile). This probe measures
whether that is cheaper than the reduction, per shape and activation, bf16, ``jax.jit(
jax.grad(loss, argnums=(0, 1, 2)))`` with ``loss = sum(act(x @ w + b))`` (the issue's
anchor; ``--loss sq``: ``sum(act(.)**2) / 2``), the method of benchmarks.training (median of
7 interleaved samples of back-to-back calls), µs per step:

- ``xla``: XLA's autodiff of the plain expression (what "auto" runs);
- ``row1`` / ``row8``: a pure-JAX custom_vjp, XLA's forward saving z, whose backward forms
  ``dz = dy * act'(z)``, ``dx = dz @ wᵀ`` and ``[x | 1 | 0..]ᵀ @ dz`` with pad 1 or 8
  (8 keeps each row of the copy 16-byte aligned);
- ``row8_f32``: ``row8`` with the long GEMM written in float32 (as a float32 bias would need
  its gradient), the kernel gradient cast to bf16 after;
- ``fused_row8``: jax_epilog's fused forward with its aux (``fused_matmul``) and the
  ``row8`` backward from that aux;
- ``cublaslt``: ``fused_dense(..., implementation="cublaslt")`` (the BGRADA backward).

Each variant's gradients are checked against the float32 reference VJP (max |diff| over
max |ref|, per gradient). ``--out`` also gets the optimised HLO of every variant at the
first shape (``hlo.txt``), to see whether XLA fused the copy into the GEMM.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import activation_fn, time_jax_interleaved, write_results
from benchmarks.training import GRAD_SHAPES, layer_inputs
from jax_epilog import fused_dense
from jax_epilog._epilogs import Activation, ComputeType
from jax_epilog._primitive import fused_matmul
from jax_epilog._reference import output_grad

VARIANTS = ("xla", "row1", "row8", "row8_f32", "fused_row8", "cublaslt")


def _row_weight_grad(x, dz, pad: int, acc):
    """(xᵀ dz, dz.sum(0)) from one GEMM over [x | 1 | 0 ...] (pad columns), in ``acc``."""
    m = x.shape[0]
    extra = jnp.zeros((m, pad), x.dtype).at[:, 0].set(1)
    g = jax.lax.dot_general(
        jnp.concatenate([x, extra], axis=1), dz, (((0,), (0,)), ((), ())), preferred_element_type=acc
    )
    k = x.shape[1]
    return g[:k].astype(x.dtype), g[k]


def row_dense(activation: str, pad: int, acc=jnp.bfloat16, fused: bool = False):
    """act(x @ w + b) with the bias gradient as a row of the kernel-gradient GEMM."""
    act = activation_fn(activation)
    epilog = Activation(activation)

    @jax.custom_vjp
    def layer(x, w, b):
        return act(x @ w + b)

    def fwd(x, w, b):
        if fused:
            y, aux = fused_matmul(
                x, w, b, activation=epilog, with_aux=True, compute_type=ComputeType.COMPUTE_32F,
                d_dtype=x.dtype, out_dtype=x.dtype,
            )  # fmt: skip
            return y, (x, w, aux)
        z = x @ w + b
        return act(z), (x, w, z)

    def bwd(res, dy):
        x, w, aux = res
        if fused:
            dz = output_grad(aux, dy, None, epilog, ComputeType.COMPUTE_32F, x.dtype)
        else:
            dz = jax.vjp(act, aux)[1](dy)[0]
        dx = dz @ w.T
        dw, db = _row_weight_grad(x, dz, pad, acc)
        return dx, dw.astype(w.dtype), db.astype(dy.dtype)

    layer.defvjp(fwd, bwd)
    return layer


def layer_fn(variant: str, activation: str):
    if variant == "xla":
        act = activation_fn(activation)
        return lambda x, w, b: act(x @ w + b)
    if variant == "cublaslt":
        return functools.partial(fused_dense, activation=activation, implementation="cublaslt")
    pad = 1 if variant == "row1" else 8
    acc = jnp.float32 if variant.endswith("f32") else jnp.bfloat16
    return row_dense(activation, pad, acc, fused=variant.startswith("fused"))


def grad_step(layer, loss: str):
    if loss == "sum":
        f = lambda x, w, b: jnp.sum(layer(x, w, b), dtype=jnp.float32)
    else:
        f = lambda x, w, b: 0.5 * jnp.sum(jnp.square(layer(x, w, b).astype(jnp.float32)))
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))


def errors(step, ref_step, args):
    got, want = step(*args), ref_step(*(a.astype(jnp.float32) for a in args))
    return [float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r))) for g, r in zip(got, want)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None)
    parser.add_argument("--shape", type=int, nargs=3, action="append", metavar=("M", "K", "N"))
    parser.add_argument("--loss", choices=("sum", "sq"), default="sum")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    shapes = [tuple(s) for s in args.shape] if args.shape else GRAD_SHAPES
    on_gpu = jax.default_backend() == "gpu"
    variants = [v for v in args.variants if on_gpu or v not in ("fused_row8", "cublaslt")]
    rows, hlo = [], []
    for i, (m, k, n) in enumerate(shapes):
        inputs = layer_inputs(m, k, n, np.random.default_rng(5))
        for activation in ("relu", "gelu"):
            steps = {v: grad_step(layer_fn(v, activation), args.loss) for v in variants}
            ref = grad_step(layer_fn("xla", activation), args.loss)
            errs = {v: errors(s, ref, inputs) for v, s in steps.items()}
            if i == 0 and args.out:
                for v, s in steps.items():
                    hlo.append(f"===== {m}x{k}->{n} {activation} {v}\n{s.lower(*inputs).compile().as_text()}")
            times = time_jax_interleaved(*[(s, inputs) for s in steps.values()])
            row = dict(shape=f"{m}x{k}->{n}", activation=activation, loss=args.loss,
                       **{f"{v}_us": t for v, t in zip(steps, times)},
                       **{f"{v}_err": e for v, e in errs.items()})  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    head = ", ".join(variants)
    lines = [f"| M×K→N | act | µs ({head}), XLA / each | worst rel. error of (dx, dw, db) |",
             "|---|---|---|---|"]  # fmt: skip
    for r in rows:
        cells = ", ".join(f"{r[v + '_us']:.1f} ({r['xla_us'] / r[v + '_us']:.3f}×)" for v in variants)
        worst = {v: max(r[v + "_err"]) for v in variants}
        lines.append(f"| {r['shape']} | {r['activation']} | {cells} | "
                     + ", ".join(f"{v} {e:.1e}" for v, e in worst.items()) + " |")  # fmt: skip
    table = "\n".join(lines) + "\n"
    if args.out:
        write_results(args.out, f"bias_row-{args.loss}", rows, table)
        with open(os.path.join(args.out, "hlo.txt"), "w") as fh:
            fh.write("\n".join(hlo))
    print(table)


if __name__ == "__main__":
    main()
