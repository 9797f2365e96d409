"""Training benchmarks: fused_dense forward + backward vs XLA's autodiff, the same for a
two-layer MLP block through fused_mlp, and the transformer-MLP example's steps/s with
FusedMLP, FusedDense and nn.Dense.

    python -m benchmarks.training --out DIR [--part grad|mlp|example|all]
                                  [--mlp-activations gelu [relu]] [--policy FIELD=VALUE ...]

fwd+bwd rows time ``jax.jit(jax.grad(loss, argnums=(0, 1, 2)))`` with
``loss = sum(act(x @ w + b))`` (summed in float32; XLA then need not form the output at
all), and fwd+vjp rows the layer's output with its VJP for a given cotangent dy ~ N(0, 1),
``y, pullback = jax.vjp(layer, x, w, b); (y, *pullback(dy))``, as in a training step where
y feeds the next layer (benchmarks.run's modes); each through ``fused_dense`` with its cuBLASLt
backward (``implementation="cublaslt"``), through ``fused_dense`` as users call it ("auto":
XLA's autodiff under ``jax.grad``) and as the plain jnp expression, with the method of
benchmarks.forward (median of 7 interleaved samples of back-to-back calls). TF/s counts
three GEMMs: 6 * M * N * K flops per step.
MLP rows time the same for a transformer MLP block ``act(x @ w1 + b1) @ w2 + b2`` (M×D →
4D → D, bf16; ``act`` GELU, and ReLU with ``--mlp-activations gelu relu``) with
``loss = sum(y**2) / 2`` (so the output's cotangent is a real array, as in training):
XLA's jit of the plain expression, two ``fused_dense`` calls ("auto") and ``fused_mlp``
("auto" and "cublaslt"), interleaved; TF/s counts 12 * M * D * 4D flops.
The example rows run ``examples/train_transformer_mlp.py --size large`` in this process
(with its default ``--implementation auto``) and record its median step time (each step
synchronised) for every layer type; the example trains the models one after another, so
the same three train steps are also timed interleaved (back-to-back calls, samples in
turns), the figure to compare them by.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import warnings
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    activation_fn,
    add_policy_option,
    layer_inputs,
    output_and_vjp,
    policy,
    policy_changes,
    single_layers,
    time_jax_interleaved,
    write_results,
)
from jax_epilog import FastPathWarning, fused_dense, fused_mlp
from jax_epilog.cuda.ffi import recording

GRAD_SHAPES = [(8192, 1024, 4096), (8192, 4096, 16384), (8192, 4096, 1024)]
# (M, D): M×D -> 4D -> D; the transformer example's block, a large one, and fewer rows
# (1000: not a multiple of 8), which set fused_mlp's "auto" rule (link from 8192 rows).
MLP_SHAPES = [(8192, 1024), (8192, 4096), (2048, 1024), (1000, 1024), (512, 2048), (256, 1024), (128, 1024)]
MLP_CONTENDERS = ("xla", "fused_dense", "fused_mlp", "fused_mlp_cublaslt")
# fwd+bwd of one layer: fused_dense with the cuBLASLt backward ("fused"), fused_dense as
# users call it ("auto": XLA's autodiff under jax.grad), and XLA's jit of the expression.
GRAD_CONTENDERS = ("fused", "auto", "xla")


def grad_steps(activation: str, mode: str = "fwd+bwd"):
    """For each of GRAD_CONTENDERS, ``jax.jit(jax.grad(sum(layer(x, w, b))))`` (mode
    "fwd+bwd") or the jitted ``(x, w, b, dy) -> (y, dx, dw, db)`` ("fwd+vjp")."""
    layers = {**single_layers(activation), "auto": partial(fused_dense, activation=activation)}
    if mode == "fwd+vjp":
        return {c: jax.jit(output_and_vjp(layers[c])) for c in GRAD_CONTENDERS}
    summed = lambda f: lambda x, w, b: jnp.sum(f(x, w, b), dtype=jnp.float32)
    return {c: jax.jit(jax.grad(summed(layers[c]), argnums=(0, 1, 2))) for c in GRAD_CONTENDERS}


def bench_grad(rows, shapes=GRAD_SHAPES, modes=("fwd+bwd", "fwd+vjp")):
    for m, k, n in shapes:
        x, w, b = layer_inputs(m, k, n, np.random.default_rng(3))
        dy = jnp.asarray(np.random.default_rng(4).standard_normal((m, n), dtype=np.float32), x.dtype)
        for activation, mode in itertools.product(("relu", "gelu"), modes):
            steps = grad_steps(activation, mode)
            args = (x, w, b, dy) if mode == "fwd+vjp" else (x, w, b)
            with recording() as stats:
                times = dict(zip(steps, time_jax_interleaved(*[(s, args) for s in steps.values()])))
            flops = 6 * m * n * k
            row = dict(
                shape=f"{m}x{k}->{n}", dtype="bfloat16", activation=activation, mode=mode,
                **{f"{c}_us": t for c, t in times.items()},
                **{f"{c}_tflops": flops / t / 1e6 for c, t in times.items()},
                handler_calls=stats.calls, handler_host_us=stats.busy_ns / max(1, stats.calls) / 1e3,
            )  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)


def mlp_block(contender: str, activation: str = "gelu"):
    """The block's forward as each contender writes it."""
    act = activation_fn(activation)
    if contender == "xla":
        return lambda x, w1, b1, w2, b2: act(x @ w1 + b1) @ w2 + b2
    if contender == "fused_dense":
        return lambda x, w1, b1, w2, b2: fused_dense(fused_dense(x, w1, b1, activation=activation), w2, b2)
    impl = "cublaslt" if contender.endswith("cublaslt") else "auto"
    return lambda x, w1, b1, w2, b2: fused_mlp(
        x, [(w1, b1), (w2, b2)], [activation, None], implementation=impl
    )


def mlp_inputs(m: int, d: int, dtype=jnp.bfloat16):
    """(x, w1, b1, w2, b2) of an M×D -> 4D -> D block, as layer_inputs draws them."""
    rng = np.random.default_rng(4)
    x, w1, b1 = layer_inputs(m, d, 4 * d, rng, dtype)
    _, w2, b2 = layer_inputs(m, 4 * d, d, rng, dtype)
    return x, w1, b1, w2, b2


def mlp_grad_step(contender: str, activation: str = "gelu"):
    """jax.jit(jax.grad) in all five arrays of the block's loss sum(y**2) / 2."""
    block = mlp_block(contender, activation)
    loss = lambda *a: 0.5 * jnp.sum(jnp.square(block(*a).astype(jnp.float32)))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def bench_mlp(rows, activations=("gelu",), shapes=MLP_SHAPES):
    for activation in activations:
        for m, d in shapes:
            bench_mlp_shape(rows, activation, m, d)


def bench_mlp_shape(rows, activation: str, m: int, d: int):
    args = mlp_inputs(m, d)
    steps = [(mlp_grad_step(contender, activation), args) for contender in MLP_CONTENDERS]
    times = dict(zip(MLP_CONTENDERS, time_jax_interleaved(*steps)))
    flops = 12 * m * d * 4 * d
    row = dict(
        shape=f"{m}x{d}->{4 * d}->{d}", activation=activation, dtype="bfloat16", mode="mlp fwd+bwd",
        **{f"{c}_us": t for c, t in times.items()},
        **{f"{c}_tflops": flops / t / 1e6 for c, t in times.items()},
    )  # fmt: skip
    rows.append(row)
    print(json.dumps(row), flush=True)


def time_example_steps(prepared: dict) -> dict[str, float]:
    """µs per train step of each of the example's models (``prepared``: {layer key: its
    ``setup()``, a Run}), timed as the other rows are: the jitted steps called back to back,
    each training on from its state on batch 0, samples taken in turns. The example itself
    trains the models one after the other, so its step times also carry the GPU's drift
    between them."""
    steps = [(run.step, run.batch(0)) for run in prepared.values()]
    return dict(zip(prepared, time_jax_interleaved(*steps)))


def load_example():
    """``examples/train_transformer_mlp.py`` as a module."""
    path = Path(__file__).resolve().parent.parent / "examples" / "train_transformer_mlp.py"
    spec = importlib.util.spec_from_file_location("train_transformer_mlp", path)
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # flax's dataclasses look their module up
    spec.loader.exec_module(example)
    return example


def bench_example(rows, size="large", implementations=("auto",), options=()):
    """The example at ``--size size`` (plus ``options``, its other flags) with each
    ``--implementation``: its own step times and the interleaved ones, both from the same
    compiled train steps."""
    example = load_example()
    for implementation in implementations:
        with warnings.catch_warnings(), recording() as stats:
            warnings.simplefilter("error", FastPathWarning)  # the fused path, or no numbers
            argv = ["--size", size, *options, "--implementation", implementation]
            args = example.parse_args(argv)
            prepared = {key: example.setup(args, key) for key in example.LAYERS}
            result = example.main(argv, prepared)
            interleaved = time_example_steps(prepared)
        print(f"handler executions during the example: {stats.calls}")
        for key in example.LAYERS:
            r = result[key]
            rows.append({
                "example": " ".join(["train_transformer_mlp", *argv]),
                "layer": r["layer"], "step_ms": r["step_ms"], "steps_per_s": 1e3 / r["step_ms"],
                "tokens_per_s": r["tokens_per_s"], "first_loss": r["losses"][0],
                "final_loss": r["losses"][-1], "config": result["config"],
                "interleaved_step_ms": interleaved[key] / 1e3,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)


def render(rows) -> str:
    lines = []
    grad = [r for r in rows if r.get("mode") in ("fwd+bwd", "fwd+vjp")]
    if grad:
        lines += [("| M×K→N (bf16) | act | mode | fused_dense \"cublaslt\" µs (TF/s) | \"auto\" µs (TF/s) "
                  "| XLA jit µs (TF/s) | XLA/cublaslt | XLA/auto |"),
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in grad:
            cells = " | ".join(f"{r[c + '_us']:.1f} ({r[c + '_tflops']:.0f})" for c in GRAD_CONTENDERS)
            lines.append(f"| {r['shape']} | {r['activation']} | {r['mode']} | {cells} "
                         f"| {r['xla_us'] / r['fused_us']:.2f}× | {r['xla_us'] / r['auto_us']:.2f}× |")  # fmt: skip
        lines.append("")
    mlp = [r for r in rows if r.get("mode") == "mlp fwd+bwd"]
    if mlp:
        head = " | ".join(f"{c} µs (TF/s)" for c in MLP_CONTENDERS)
        lines += [
            f"| M×D→4D→D (bf16) | act | {head} | XLA/fused_dense | XLA/fused_mlp | XLA/fused_mlp cublaslt |",
            "|---|---|" + "---|" * (len(MLP_CONTENDERS) + 3),
        ]
        for r in mlp:
            cells = " | ".join(f"{r[c + '_us']:.1f} ({r[c + '_tflops']:.0f})" for c in MLP_CONTENDERS)
            ratios = " | ".join(f"{r['xla_us'] / r[c + '_us']:.2f}×" for c in MLP_CONTENDERS[1:])
            lines.append(f"| {r['shape']} | {r.get('activation', 'gelu')} | {cells} | {ratios} |")
        lines.append("")
    ex = [r for r in rows if "example" in r]
    if ex:
        lines += [("| example | layer | step ms (median) | steps/s | tokens/s | loss first → final "
                  "| step ms, interleaved | nn.Dense / layer, interleaved |"),
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        dense = {r["example"]: r["interleaved_step_ms"] for r in ex if r["layer"] == "nn.Dense"}
        for r in ex:
            lines.append(f"| {r['example']} | {r['layer']} | {r['step_ms']:.2f} | {r['steps_per_s']:.1f} "
                         f"| {r['tokens_per_s']:,.0f} | {r['first_loss']:.4f} → {r['final_loss']:.4f} "
                         f"| {r['interleaved_step_ms']:.2f} | {dense[r['example']] / r['interleaved_step_ms']:.2f}× |")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for training.json and training.md")
    parser.add_argument("--part", choices=("grad", "mlp", "example", "all"), default="all")
    parser.add_argument(
        "--mlp-activations",
        nargs="+",
        choices=("gelu", "relu"),
        default=["gelu"],
        help="the block's first activation(s) for the MLP rows (default: gelu)",
    )
    add_policy_option(parser)
    args = parser.parse_args(argv)
    rows: list[dict] = []
    with policy(policy_changes(args.policy)):
        if args.part in ("grad", "all"):
            bench_grad(rows)
        if args.part in ("mlp", "all"):
            bench_mlp(rows, args.mlp_activations)
        if args.part in ("example", "all"):
            bench_example(rows)
    table = render(rows)
    write_results(args.out, "training", rows, table)
    print(table)


if __name__ == "__main__":
    main()
