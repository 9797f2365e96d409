"""Probe: which backward should a lone fused_dense layer use? fwd+bwd variants side by side.

    python -m benchmarks.probes.backward_variants [--out DIR] [--shape M K N ...] [--policy FIELD=VALUE ...]

Backs ``Policy.relu_bgrad_epilog`` and "auto"'s derivatives (docs/decisions.md:
relu-bgrad, auto-backward). For each M×K→N (bf16; benchmarks.training's shapes by
default), relu and gelu, this times ``jax.jit(jax.grad(loss, argnums=(0, 1, 2)))``
(median of 7 interleaved samples) for five layers:

- ``xla``: the plain expression ``act(x @ w + b)``, differentiated by XLA;
- ``cublaslt``: ``fused_dense(..., implementation="cublaslt")``: the fused forward saves
  the aux; the kernel and bias gradients come from one BGRADA GEMM for GELU and from XLA's
  GEMM and reduction for ReLU (the library's default);
- ``cublaslt_bgrada``: the same with ``relu_bgrad_epilog=True``: ReLU's kernel and bias
  gradients from BGRADA too (for GELU the same program as ``cublaslt``);
- ``aux+xla``: the fused forward with its aux, then a backward from that aux with XLA's
  GEMMs and a separate reduction for the bias gradient (a custom_vjp written here);
- ``auto``: ``fused_dense``'s default (XLA's own autodiff);

and three losses: ``sum``, ``sum(act(z))`` (XLA's program then never forms act(z): only
its derivative is needed); ``sq``, ``sum(act(z)**2) / 2``; and ``next``,
``sum((act(z) @ v)**2) / 2`` with a fixed random v of shape (N, 128), where a GEMM reads
the output as a next layer does. A last row per shape times the kernel-gradient GEMM
alone: BGRADA against XLA's ``x.T @ dz`` with and without ``dz.sum(0)``.
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    add_policy_option,
    layer_inputs,
    policy,
    policy_changes,
    single_layers,
    time_jax_interleaved,
    write_results,
)
from benchmarks.training import GRAD_SHAPES
from jax_epilog import Activation, ComputeType, _reference, fused_dense, override_policy
from jax_epilog.primitives import fused_weight_grad

CT = ComputeType.COMPUTE_32F
NEXT_WIDTH = 128  # the "next" loss's second layer: y @ v with v of shape (N, NEXT_WIDTH)
NAMES = ("xla", "cublaslt", "cublaslt_bgrada", "aux+xla", "auto")
POLICY = {"cublaslt_bgrada": {"relu_bgrad_epilog": True}}  # each variant's policy while it lowers


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


def layers(activation: str) -> dict:
    pair = single_layers(activation)
    return {
        "xla": pair["xla"],
        "cublaslt": pair["fused"],
        "cublaslt_bgrada": pair["fused"],
        "aux+xla": lambda x, w, b: aux_then_xla(x, w, b, activation),
        "auto": lambda x, w, b: fused_dense(x, w, b, activation=activation),
    }


def gradient(f, loss):
    return jax.grad(lambda x, w, b: loss(f(x, w, b)), argnums=(0, 1, 2))


def compiled_gradients(activation: str, loss, args) -> dict:
    """Each variant's gradient program, lowered and compiled under its policy."""
    programs = {}
    for name, f in layers(activation).items():
        with override_policy(**POLICY.get(name, {})):
            programs[name] = jax.jit(gradient(f, loss)).lower(*args).compile()
    return programs


def bench_shape(rows, m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(3)
    x, w, b = layer_inputs(m, k, n, rng)
    for activation in ("relu", "gelu"):
        for loss_name, loss in LOSSES.items():
            grads = compiled_gradients(activation, loss, (x, w, b))
            times = time_jax_interleaved(*((g, (x, w, b)) for g in grads.values()))
            row = {"shape": f"{m}x{k}->{n}", "activation": activation, "loss": loss_name}
            rows.append(row | {f"{name}_us": t for name, t in zip(grads, times)})
            print(json.dumps(rows[-1]), flush=True)
    dz = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    parts = [
        jax.jit(lambda x, dz: fused_weight_grad(x, dz, compute_type=CT, d_dtype="bfloat16")),
        jax.jit(lambda x, dz: _reference.weight_grad(x, dz, CT, "bfloat16", with_bias=True)),
        jax.jit(lambda x, dz: _reference.weight_grad(x, dz, CT, "bfloat16", with_bias=False)[0]),
    ]
    times = time_jax_interleaved(*((p, (x, dz)) for p in parts))
    row = {"shape": f"{m}x{k}->{n}", "part": "kernel gradient"}
    rows.append(row | {"bgrada_us": times[0], "xla_dot_sum_us": times[1], "xla_dot_us": times[2]})
    print(json.dumps(rows[-1]), flush=True)


def render(rows) -> str:
    head = " | ".join(f"{n} µs" for n in NAMES) + " | " + " | ".join(f"XLA/{n}" for n in NAMES[1:])
    lines = [f"| M×K→N (bf16) | act | loss | {head} |", "|---|---|---|" + "---|" * (2 * len(NAMES) - 1)]
    for r in rows:
        if "loss" not in r:
            continue
        t = [r.get(f"{n}_us", float("nan")) for n in NAMES]
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
    parser.add_argument(
        "--shape", type=int, nargs=3, action="append", metavar=("M", "K", "N"),
        help="M K N instead of benchmarks.training's shapes (repeatable)",
    )  # fmt: skip
    add_policy_option(parser)
    args = parser.parse_args(argv)
    rows: list[dict] = []
    with policy(policy_changes(args.policy)):
        for m, k, n in [tuple(s) for s in args.shape] if args.shape else GRAD_SHAPES:
            bench_shape(rows, m, k, n)
    table = render(rows)
    print(table)
    if args.out:
        write_results(args.out, "backward_variants", rows, table)


if __name__ == "__main__":
    main()
