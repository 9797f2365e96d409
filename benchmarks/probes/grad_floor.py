"""Probe: how far below XLA's fwd+bwd of one layer can any implementation go? Its GEMMs, timed alone.

    python -m benchmarks.probes.grad_floor [--out DIR] [--shape M K N ...]

Issue 5 asks for fwd+bwd at >= 1.05x XLA (ReLU) and >= 1.15x (GELU) at K=1024, where
benchmarks.training measures ``jax.jit(jax.grad(sum(act(x @ w + b))))``. Whatever fuses
the bias, the activation, its derivative and the bias gradient, three GEMMs of the layer's
size remain: ``x @ w``, ``dz @ w.T`` and ``x.T @ dz``. This probe times, per shape and
activation (bf16, the inputs of benchmarks.training, median of interleaved samples of
back-to-back calls as benchmarks.forward):

- ``xla``: XLA's jit of the gradient, the bars' reference;
- ``cublaslt``: the same through ``fused_dense(implementation="cublaslt")``;
- ``gemms``: the three products alone in one jit (XLA's kernels, float32 accumulation,
  bf16 results, as in its autodiff);
- ``gemms_cublaslt``: the three products as ``fused_dense`` calls without bias or
  activation (cuBLASLt, autotuned), from operands laid out beforehand (``w.T``, ``x.T``);
- ``gemms_pass``: ``gemms`` with ``dz`` first formed by one elementwise pass over an
  (M, N) array (``dy * s``, kept in memory by an optimization barrier): the least that a
  backward which writes dz to memory adds (cuBLASLt's GEMMs have no prologue; XLA's ReLU
  backward folds ``z > 0`` into its own GEMMs instead).

It prints, per row, XLA / the faster GEMM set: the most any implementation running these
GEMMs could gain over XLA if everything else were free, beside the issue's bar; and XLA /
(GEMMs + that pass). Results: DIR/grad_floor.{json,md}.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import main_over_shapes, time_jax_interleaved
from benchmarks.training import GRAD_SHAPES, grad_steps, layer_inputs
from jax_epilog import fused_dense

BARS = {"relu": 1.05, "gelu": 1.15}  # issue 5, fwd+bwd at K=1024
CONTENDERS = ("xla", "cublaslt", "gemms", "gemms_cublaslt", "gemms_pass")


@jax.jit
def gemms(x, w, dz):
    return x @ w, dz @ w.T, x.T @ dz


@jax.jit
def gemms_pass(x, w, dy, s):
    dz = jax.lax.optimization_barrier(dy * s)
    return x @ w, dz @ w.T, x.T @ dz


@jax.jit
def gemms_cublaslt(x, w, wt, xt, dz):
    def mm(a, b):
        return fused_dense(a, b, implementation="cublaslt")

    return mm(x, w), mm(dz, wt), mm(xt, dz)


def programs(activation: str, x, w, b, dz):
    """``{contender: (jitted function, args)}`` for one shape and activation."""
    steps = grad_steps(activation)
    wt, xt = jnp.asarray(w.T), jnp.asarray(x.T)  # laid out once, outside the timed calls
    return {
        "xla": (steps["xla"], (x, w, b)),
        "cublaslt": (steps["fused"], (x, w, b)),
        "gemms": (gemms, (x, w, dz)),
        "gemms_cublaslt": (gemms_cublaslt, (x, w, wt, xt, dz)),
        "gemms_pass": (gemms_pass, (x, w, dz, jnp.asarray(0.5, dz.dtype))),
    }


def row(shape, activation: str, us: dict) -> dict:
    floor = min(us["gemms"], us["gemms_cublaslt"])
    one_pass = floor + max(0.0, us["gemms_pass"] - us["gemms"])
    return dict(
        shape="{}x{}->{}".format(*shape), activation=activation, **{f"{c}_us": us[c] for c in CONTENDERS},
        xla_over_gemms=us["xla"] / floor, xla_over_gemms_pass=us["xla"] / one_pass,
        xla_over_cublaslt=us["xla"] / us["cublaslt"], bar=BARS[activation] if shape[1] == 1024 else None,
    )  # fmt: skip


def bench(shapes) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        rng = np.random.default_rng(3)
        x, w, b = layer_inputs(m, k, n, rng)
        dz = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        for activation in ("relu", "gelu"):
            progs = programs(activation, x, w, b, dz)
            us = dict(zip(progs, time_jax_interleaved(*progs.values())))
            rows.append(row((m, k, n), activation, us))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = (
        "| M×K→N (bf16) | act | " + " | ".join(f"{c} µs" for c in CONTENDERS)
        + " | XLA / cublaslt | XLA / GEMMs (most gain) | XLA / (GEMMs + pass) | bar |"
    )  # fmt: skip
    lines = [head, "|" + "---|" * (len(CONTENDERS) + 6)]
    for r in rows:
        times = " | ".join(f"{r[f'{c}_us']:.1f}" for c in CONTENDERS)
        bar = f"{r['bar']:.2f}×" if r["bar"] else "—"
        lines.append(
            f"| {r['shape']} | {r['activation']} | {times} | {r['xla_over_cublaslt']:.2f}× | "
            f"{r['xla_over_gemms']:.2f}× | {r['xla_over_gemms_pass']:.2f}× | {bar} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    main_over_shapes(argv, __doc__, "grad_floor", bench, table, GRAD_SHAPES)


if __name__ == "__main__":
    main()
