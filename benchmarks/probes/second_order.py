"""Probe: what a derivative of a gradient costs through the fused primitives.

    python -m benchmarks.probes.second_order [--out DIR] [--shape M K N ...]

A gradient made of the fused primitives differentiates again through each primitive's
reference math in XLA's ops (``_primitive._jvp_of_reference``), which recomputes the
pre-activation z for the activation's derivative. This probe times the gradient of a
gradient penalty, ``jax.jit(jax.grad(lambda x, w, b: sum(grad_w(loss)(x, w, b) ** 2),
argnums=(0, 1, 2)))`` with ``loss = sum(act(x @ w + b)**2) / 2`` (summed in float32),
for one layer through ``fused_dense`` with ``"cublaslt"`` and ``"auto"`` (XLA's
derivatives under ``jax.grad``) and XLA's jit of the plain expression (bf16, the inputs
of benchmarks.training, median of interleaved samples of back-to-back calls as
benchmarks.forward). Results: DIR/second_order.{json,md}.
"""

from __future__ import annotations

import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import main_over_shapes, single_layers, time_jax_interleaved, xla_ratio_table
from benchmarks.training import layer_inputs
from jax_epilog import fused_dense

SHAPES = [(8192, 1024, 4096), (256, 1024, 1024)]
CONTENDERS = ("xla", "auto", "cublaslt")


def penalty_grad(layer):
    """The jitted gradient, in x, w and b, of the squared norm of ``loss``'s kernel gradient."""

    def loss(x, w, b):
        return 0.5 * jnp.sum(jnp.square(layer(x, w, b).astype(jnp.float32)))

    def penalty(x, w, b):
        return jnp.sum(jnp.square(jax.grad(loss, argnums=1)(x, w, b).astype(jnp.float32)))

    return jax.jit(jax.grad(penalty, argnums=(0, 1, 2)))


def programs(activation: str) -> dict:
    layers = single_layers(activation)
    return {
        "xla": penalty_grad(layers["xla"]),
        "auto": penalty_grad(partial(fused_dense, activation=activation)),
        "cublaslt": penalty_grad(layers["fused"]),
    }


def bench(shapes) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        args = layer_inputs(m, k, n, np.random.default_rng(3))
        for activation in ("relu", "gelu"):
            progs = programs(activation)
            us = dict(zip(progs, time_jax_interleaved(*((f, args) for f in progs.values()))))
            rows.append(
                dict(shape=f"{m}x{k}->{n}", activation=activation, **{f"{c}_us": us[c] for c in CONTENDERS})
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    return xla_ratio_table(rows, {"M×K→N (bf16)": "shape", "act": "activation"}, CONTENDERS)


def main(argv: list[str] | None = None) -> None:
    main_over_shapes(argv, __doc__, "second_order", bench, table, SHAPES)


if __name__ == "__main__":
    main()
