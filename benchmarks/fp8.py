"""FP8 against bfloat16 XLA, Flax's FP8 pattern (XLA's rewrite) and nvmath-python.

    python -m benchmarks.fp8 [--quick] [--out DIR] [--only ROWS] [--policy FIELD=VALUE ...]

Rows (medians of interleaved samples in one process; every FP8 time includes quantizing x
and the kernel and updating the scaling state):

* ``forward``: y = gelu(x @ w + b), 8192x4096->16384.
* ``dense`` and ``mlp``: a GELU layer's (block's) output and its VJP for a given dy (every
  gradient, the FP8 state's included): 8192x4096->16384, 8192x4096->16384->4096 and the
  mid-size 8192x1024->4096->1024.
* In every row, ``fp8 gemms only``: the same FP8 GEMMs alone through our custom call, on
  operands already quantized and laid out (the ceiling of the FP8 rows).
* ``gemm``: 8192^3 E4M3 x E4M3 -> bfloat16 through our custom call (operands already FP8
  and K-contiguous) against nvmath-python's own FP8 ``Matmul`` (planned, and autotuned).

Flax's FP8 is ``nn.Dense(dot_general_cls=...)`` with ``flax.linen.fp8_ops``'
``Fp8DotGeneralOp`` (the quantize-dequantize pattern that XLA rewrites) and
``Fp8DirectDotGeneralOp`` (FP8 operands handed to XLA's dot); the table says whether each
compiled program called an FP8 GEMM (``__cublas$lt$matmul$f8``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import add_policy_option, policy, policy_changes
from benchmarks.timing import FULL, QUICK, EventClock, WallClock, measure_interleaved

BF16 = jnp.bfloat16


def _layer(key, k, n):
    kw, kb = jax.random.split(key)
    return (jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)).astype(BF16), (
        0.1 * jax.random.normal(kb, (n,), jnp.float32)
    ).astype(BF16)


def _flax_fp8(widths, activations, op: str):
    import flax.linen as nn
    from flax.linen import fp8_ops

    dot = getattr(fp8_ops, op)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width, act in zip(widths, activations):
                x = nn.Dense(width, dtype=BF16, param_dtype=BF16, dot_general_cls=dot)(x)
                x = jax.nn.gelu(x, approximate=True) if act == "gelu" else x
            return x

    return Block()


def _plain(x, layers, activations):
    for (w, b), act in zip(layers, activations):
        x = x @ w + b
        x = jax.nn.gelu(x, approximate=True) if act == "gelu" else x
    return x


def _ours(recipe):
    import jax_epilog as je
    from jax_epilog import fp8

    def run(x, layers, states, activations):
        if len(layers) == 1:
            (w, b), (s,) = layers[0], states
            y, s = je.fused_dense(x, w, b, activation=activations[0], fp8=s)
            return y, (s,)
        return je.fused_mlp(x, list(layers), list(activations), fp8=states)

    return run, lambda n: tuple(fp8.init(recipe) for _ in range(n))


def _quietly(fn):
    """``fn``, traced without Flax's DeprecationWarning for ``Fp8DotGeneralOp`` (the pattern
    XLA rewrites is the point of that contender)."""

    def quiet(*args):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return fn(*args)

    return quiet


def _calls_fp8_gemm(fn, *args) -> bool:
    return "__cublas$lt$matmul$f8" in jax.jit(fn).lower(*args).compile().as_text()


def block_contenders(m, widths, activations, backward: bool):
    """{name: (jitted fn, args)} for one block; y (and its VJP for a fixed dy)."""
    from jax_epilog import fp8

    keys = jax.random.split(jax.random.PRNGKey(0), len(widths) + 2)
    x = jax.random.normal(keys[0], (m, widths[0]), BF16)
    layers = tuple(_layer(keys[i + 1], widths[i], widths[i + 1]) for i in range(len(widths) - 1))
    dy = jax.random.normal(keys[-1], (m, widths[-1]), BF16)
    out = {}

    # dy is an argument, not a constant of the program: XLA would fold the FP8 contenders'
    # amax of a constant dy at compile time (minutes at these sizes).
    def with_vjp(f):  # f(x, params) -> y: returns y, or every gradient for dy
        if not backward:
            return lambda x, p, dy: f(x, p)
        return lambda x, p, dy: jax.vjp(f, x, p)[1](dy)

    out["xla bf16"] = (jax.jit(with_vjp(lambda x, p: _plain(x, p, activations))), (x, layers, dy))
    # (every contender takes (x, something, dy): the GEMMs-only one its own operands)
    for label, recipe in (
        ("ours fp8 delayed", fp8.DelayedScaling()),
        ("ours fp8 current", fp8.CurrentScaling()),
    ):
        run, init = _ours(recipe)
        block = lambda x, p, run=run: run(x, p[0], p[1], activations)
        # forward: y and the updated state; backward: every gradient (the state's included)
        f = with_vjp(lambda x, p, block=block: block(x, p)[0]) if backward else with_vjp(block)
        out[label] = (jax.jit(f), (x, (layers, init(len(layers))), dy))
    out["fp8 gemms only"] = _gemms_only(m, widths, backward)
    calls_fp8 = {}
    for label, op in (
        ("flax fp8 qdq (xla)", "Fp8DotGeneralOp"),
        ("flax fp8 direct (xla)", "Fp8DirectDotGeneralOp"),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (Fp8DotGeneralOp: the pattern)
            model = _flax_fp8(widths[1:], activations, op)
            variables = dict(model.init(keys[-2], x))
        # The same weights as the other contenders.
        variables["params"] = {f"Dense_{i}": {"kernel": w, "bias": b} for i, (w, b) in enumerate(layers)}
        flax_f = _quietly(lambda x, v, model=model: model.apply(v, x))
        out[label] = (jax.jit(with_vjp(flax_f)), (x, variables, dy))
        calls_fp8[label] = _calls_fp8_gemm(flax_f, x, variables)
    return out, calls_fp8


def _gemms_only(m, widths, backward):
    """The block's FP8 GEMMs alone, through our custom call on operands already quantized
    and laid out K-contiguous (no quantizing, no transposes, no epilog): the ceiling the
    FP8 block approaches. Per layer: the forward GEMM, and with ``backward`` the input- and
    kernel-gradient GEMMs."""
    from jax_epilog.primitives.fp8_gemm import fp8_matmul

    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    key = jax.random.PRNGKey(7)
    draw = lambda shape, dtype: jax.random.normal(jax.random.fold_in(key, sum(shape)), shape).astype(dtype)
    one = jnp.ones((), jnp.float32)
    gemm = lambda p, q, d: fp8_matmul(
        p, q, one, one, problem="dgrad", epilog="DEFAULT", d_dtype=d, amax=False
    )[0]
    layers = []
    for k, n in itertools.pairwise(widths):
        ops = {"x": draw((m, k), e4), "w_t": draw((n, k), e4)}
        if backward:
            ops |= {
                "dz": draw((m, n), e5),
                "w": draw((k, n), e4),
                "x_t": draw((k, m), e4),
                "dz_t": draw((n, m), e5),
            }
        layers.append(ops)

    def run(layers):
        outs = []
        for ops in layers:
            outs.append(gemm(ops["x"], ops["w_t"], BF16))  # y = x @ w
            if backward:
                outs.append(gemm(ops["dz"], ops["w"], BF16))  # dx = dz @ w^T
                outs.append(gemm(ops["x_t"], ops["dz_t"], jnp.float32))  # dw = x^T @ dz
        return outs

    return jax.jit(lambda layers, _, __: run(layers)), (layers, None, None)


def time_block(name, m, widths, activations, backward, settings):
    contenders, flax_fp8_gemm = block_contenders(m, widths, activations, backward)
    names = list(contenders)
    calls = [(lambda i, f=f, a=a: f(*a), WallClock()) for f, a in (contenders[n] for n in names)]
    timings = measure_interleaved(calls, settings)
    us = {n: t.us for n, t in zip(names, timings)}
    return {"row": name, "us": us, "flax_calls_fp8_gemm": flax_fp8_gemm}


def time_gemm(settings, size=8192):
    """Our custom call on FP8 operands vs nvmath-python's FP8 Matmul (torch tensors)."""
    import nvmath
    import torch

    from jax_epilog.primitives.fp8_gemm import fp8_matmul

    e4 = jnp.float8_e4m3fn
    kp, kq = jax.random.split(jax.random.PRNGKey(3))
    p = jax.random.normal(kp, (size, size), jnp.float32).astype(e4)
    q = jax.random.normal(kq, (size, size), jnp.float32).astype(e4)
    one = jnp.ones((), jnp.float32)
    ours = jax.jit(
        lambda p, q, s: fp8_matmul(p, q, s, s, problem="dgrad", epilog="DEFAULT", d_dtype=BF16, amax=False)[0]
    )
    a = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device="cuda").to(torch.float8_e4m3fn).T
    options = {"result_type": nvmath.CudaDataType.CUDA_R_16BF}
    planned = nvmath.linalg.advanced.Matmul(a, b, quantization_scales={"a": 1.0, "b": 1.0}, options=options)
    planned.plan()
    tuned = nvmath.linalg.advanced.Matmul(a, b, quantization_scales={"a": 1.0, "b": 1.0}, options=options)
    tuned.plan()
    tuned.autotune(iterations=5)
    torch_clock = lambda: EventClock(
        lambda: torch.cuda.Event(enable_timing=True), lambda s, e: s.elapsed_time(e)
    )
    calls = [
        (lambda i: ours(p, q, one), WallClock()),
        (lambda i: planned.execute(), torch_clock()),
        (lambda i: tuned.execute(), torch_clock()),
    ]
    t = measure_interleaved(calls, settings)
    names = ("ours fp8 gemm", "nvmath fp8 planned", "nvmath fp8 autotuned")
    return {"row": f"gemm {size}^3", "us": {n: x.us for n, x in zip(names, t)}}


ROWS = (  # (kind, rows, widths, activations, backward)
    ("forward", 8192, (4096, 16384), ("gelu",), False),
    ("dense fwd+bwd", 8192, (4096, 16384), ("gelu",), True),
    ("mlp fwd+bwd", 8192, (4096, 16384, 4096), ("gelu", None), True),
    ("mlp fwd+bwd", 8192, (1024, 4096, 1024), ("gelu", None), True),
)


def row_name(kind, m, widths, *_) -> str:
    return f"{kind} {m}x{'->'.join(map(str, widths))} gelu"


def measure(settings, scale: int = 1, only=None) -> list[dict]:
    """Every FP8 row (sizes divided by ``scale``; ``only``: row names containing one of
    these), printed as each is measured."""
    rows = []
    for kind, m, widths, acts, backward in ROWS:
        m, widths = m // scale, tuple(w // scale for w in widths)
        name = row_name(kind, m, widths)
        if only and not any(o in name for o in only):
            continue
        start = time.time()
        rows.append(time_block(name, m, widths, acts, backward, settings))
        print(_line(rows[-1]), f"({time.time() - start:.0f} s)", flush=True)
    if (not only or "gemm" in only) and jax.devices()[0].platform == "gpu":
        rows.append(time_gemm(settings, 8192 // scale))
        print(_line(rows[-1]), flush=True)
    return rows


def _baseline(row: dict) -> float:
    """µs of the row's baseline: XLA's bfloat16 program, or nvmath's GEMM for the GEMM row."""
    return row["us"].get("xla bf16") or row["us"]["nvmath fp8 autotuned"]


def render(rows: list[dict]) -> str:
    """The rows as a markdown table: µs and the ratio over XLA's bfloat16 program."""
    lines = ["| row | contender | µs | XLA bf16 µs / µs |", "|---|---|---|---|"]
    for row in rows:
        base = _baseline(row)
        for name, us in row["us"].items():
            lines.append(f"| {row['row']} | {name} | {us:.1f} | {base / us:.2f}× |")
        flags = row.get("flax_calls_fp8_gemm")
        if flags:
            called = ", ".join(f"{name}: {'yes' if flag else 'no'}" for name, flag in flags.items())
            lines.append(f"| {row['row']} | XLA called an FP8 GEMM | {called} | |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> str:
    """One bar chart: each row's contenders, as the ratio over the row's baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for row in rows for name in row["us"]))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ratios = []
        for row in rows:
            base = _baseline(row)
            ratios.append(base / row["us"][name] if name in row["us"] else 0.0)
        ax.bar([i + j * width for i in range(len(rows))], ratios, width, label=name)
    ax.axhline(1.0, color="black", linewidth=0.8)
    labels = [re.sub(r" (\d+x)", r"\n\1", r["row"].removesuffix(" gelu"), count=1) for r in rows]
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], labels, fontsize=7)
    ax.set_ylabel("baseline µs / µs (XLA bf16; nvmath for the GEMM)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="folder for fp8.json, fp8.md and fp8.png")
    parser.add_argument("--only", default=None, help="comma-separated parts of row names")
    add_policy_option(parser)
    args = parser.parse_args(argv)
    only = None if args.only is None else args.only.split(",")
    with policy(policy_changes(args.policy)):
        rows = measure(QUICK if args.quick else FULL, only=only)
    device = jax.devices()[0].device_kind
    print(f"\nFP8 rows on {device}, jax {jax.__version__} (median µs; ratio = baseline / contender):")
    for row in rows:
        print(_line(row))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fp8.json"), "w") as f:
            record = {"device": device, "jax": jax.__version__, "policy": args.policy, "rows": rows}
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "fp8.md"), "w") as f:
            f.write(f"FP8 rows on {device}, jax {jax.__version__}\n\n{render(rows)}\n")
        plot(rows, os.path.join(args.out, "fp8.png"))


def _line(row) -> str:
    us, base = row["us"], _baseline(row)
    parts = [f"{n} {t:.0f}us ({base / t:.2f}x)" for n, t in us.items()]
    flag = row.get("flax_calls_fp8_gemm")
    extra = "" if flag is None else f" [XLA program calls an FP8 GEMM: {flag}]"
    return f"{row['row']}: " + ", ".join(parts) + extra


if __name__ == "__main__":
    main()
