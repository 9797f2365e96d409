"""Probe: an ensemble's layer (``jax.vmap`` over stacked weights) against XLA's.

    python -m benchmarks.probes.ensemble [--out DIR] [--members E] [--shape M K N ...] [--policy FIELD=VALUE ...]

Backs the ensembles rule (docs/decisions.md, ensembles): batched weights bind the members'
primitive, whose forward on a GPU is one strided-batched cuBLASLt GEMM with the epilog;
with "cublaslt" an ensemble's kernel and bias gradients are XLA's batched GEMM and
reduction. XLA's ``vmap`` of the plain expression is one batched GEMM and its epilog.
Three programs, each jitted, for XLA's expression and ``fused_dense`` with ``"auto"`` and
with ``"cublaslt"``:

- forward: ``jax.vmap(layer)`` over E members, each with its own x;
- gradient: ``jax.grad`` of ``sum(jax.vmap(layer)(x, w, b))`` (in float32) in x, w and b;
- per-example gradient: one shared layer's kernel and bias gradients, ``jax.vmap``-ed
  over E examples of M rows each (as for per-example clipping).

bf16, each member's inputs as benchmarks.training's, medians of interleaved samples of
back-to-back calls. Results: DIR/ensemble.{json,md}.
"""

from __future__ import annotations

import json
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import layer_inputs, main_over_shapes, ratio_table, single_layers, time_jax_interleaved
from jax_epilog import fused_dense

SHAPES = [(256, 1024, 1024), (8192, 1024, 4096)]
CONTENDERS = ("xla", "auto", "cublaslt")
MEMBERS = 8


def members_inputs(members: int, m: int, k: int, n: int, rng: np.random.Generator, dtype=jnp.bfloat16):
    """Each member's (x, kernel, bias) as benchmarks.training draws them, stacked."""
    draws = (layer_inputs(m, k, n, rng, dtype) for _ in range(members))
    return tuple(jnp.stack(parts) for parts in zip(*draws))


def programs(activation: str) -> dict[str, dict]:
    """{"forward" | "gradient": {contender: jitted program over stacked members}}."""
    layers = single_layers(activation)
    layers = {
        "xla": layers["xla"],
        "auto": partial(fused_dense, activation=activation),
        "cublaslt": layers["fused"],
    }
    summed = lambda f: lambda x, w, b: jnp.sum(jax.vmap(f)(x, w, b), dtype=jnp.float32)

    def per_example(f):  # each member's x an example of one shared layer (the first member's)
        grad = jax.grad(lambda x, w, b: jnp.sum(f(x, w, b), dtype=jnp.float32), argnums=(1, 2))
        return lambda x, w, b: jax.vmap(grad, in_axes=(0, None, None))(x, w[0], b[0])

    return {
        "forward": {c: jax.jit(jax.vmap(layers[c])) for c in CONTENDERS},
        "gradient": {c: jax.jit(jax.grad(summed(layers[c]), argnums=(0, 1, 2))) for c in CONTENDERS},
        "per-example gradient": {c: jax.jit(per_example(layers[c])) for c in CONTENDERS},
    }


def bench(shapes, members: int = MEMBERS) -> list[dict]:
    rows = []
    for m, k, n in shapes:
        args = members_inputs(members, m, k, n, np.random.default_rng(3))
        for activation in ("relu", "gelu"):
            for pass_, progs in programs(activation).items():
                us = dict(zip(progs, time_jax_interleaved(*((f, args) for f in progs.values()))))
                rows.append(
                    dict(
                        shape=f"{members}x {m}x{k}->{n}",
                        activation=activation,
                        pass_=pass_,
                        **{f"{c}_us": us[c] for c in CONTENDERS},
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    columns = {
        "members × M×K→N (bf16)": lambda r: r["shape"], "act": lambda r: r["activation"], "pass": lambda r: r["pass_"],
    }  # fmt: skip
    return ratio_table(rows, CONTENDERS, columns)


def main(argv: list[str] | None = None) -> None:
    main_over_shapes(argv, __doc__, "ensemble", bench, table, SHAPES, members=MEMBERS)


if __name__ == "__main__":
    main()
