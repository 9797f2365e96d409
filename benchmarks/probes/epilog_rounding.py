"""Probe: is ``x @ w`` rounded to bfloat16 before the bias is added, and by which programs?

    python -m benchmarks.probes.epilog_rounding [--out DIR] [--shape M K N ...]

One bfloat16 layer with a bias per shape, through ``fused_dense`` with ``"cublaslt"`` (one
layer, and a 3-member ensemble: vmap over the weights, one batched GEMM on a GPU) and with
``"xla"`` (XLA's program of the plain expression). With no activation D is z itself; each
entry is compared with the float64 product of the same inputs rounded two ways:

    once:   bf16(x @ w + b)          the bias added to the float32 accumulator
    twice:  bf16(bf16(x @ w) + b)    the accumulator rounded to bfloat16 first

An accumulator summed in another order moves a few entries off both, so the model that
matches nearly every entry is the program's. With ReLU, the bits (cuBLASLt's aux mask; for
XLA, y > 0) that differ from the float64 sign of z are counted, with the largest |z| among
them: a bit flipped at |z| well above bfloat16's rounding of ``|x @ w|`` would be a bug.
Twice-rounding flips ReLU bits within that rounding of the kink, which is why GPU tests
take the op's bit there (tests/helpers.reference_relu_mask) and why the autotuned kernel's
choice matters (benchmarks/README.md, 2026-12-05 (af), (ag)); the plans made are listed.
Results: DIR/epilog_rounding.{json,md}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from benchmarks.forward import main_over_shapes
from benchmarks.run import plan_states
from benchmarks.training import layer_inputs
from jax_epilog import fused_dense, unpack_relu_mask

SHAPES = [
    (33, 129, 65), (40, 24, 72), (256, 784, 100), (128, 8192, 256), (1024, 1024, 515), (8192, 1024, 4096)
]
MEMBERS = 3
BF16 = np.dtype(ml_dtypes.bfloat16)


def _bf16(a):
    return np.asarray(a, np.float64).astype(BF16).astype(np.float64)


def programs():
    """{name: (jitted layer(x, w, b, activation) -> (y, relu bits or None), members)}."""

    def cublaslt(x, w, b, activation):
        if activation is None:
            return fused_dense(x, w, b, implementation="cublaslt"), None
        y, aux = fused_dense(x, w, b, activation=activation, return_aux=True, implementation="cublaslt")
        return y, unpack_relu_mask(aux, w.shape[-1])

    def xla(x, w, b, activation):
        y = fused_dense(x, w, b, activation=activation, implementation="xla")
        return y, None if activation is None else y > 0

    ensemble = jax.vmap(cublaslt, in_axes=(0, 0, 0, None))
    return {
        "cublaslt": (jax.jit(cublaslt, static_argnums=3), 1),
        f"cublaslt, ensemble of {MEMBERS}": (jax.jit(ensemble, static_argnums=3), MEMBERS),
        "xla": (jax.jit(xla, static_argnums=3), 1),
    }


def compare(x, w, b, d, bits) -> dict:
    """How D (no activation) and the ReLU bits relate to the float64 z."""
    xw = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    bias = np.asarray(b, np.float64)
    z = xw + bias
    d = np.asarray(d, np.float64)
    row = {
        "entries": int(z.size),
        "once": float(np.mean(d == _bf16(z))),
        "twice": float(np.mean(d == _bf16(_bf16(xw) + bias))),
    }
    flipped = np.asarray(bits, bool) != (z > 0)
    row["bits_flipped"] = int(flipped.sum())
    # Rounding x @ w to bfloat16 moves z by at most 2**-8 |x @ w| (half an ulp, or less).
    row["flipped_max_abs_z"] = float(np.abs(z[flipped]).max(initial=0.0))
    row["flipped_max_rounding"] = float((np.abs(xw[flipped]) * 2.0**-8).max(initial=0.0))
    return row


def bench(shapes, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for m, k, n in shapes:
        for name, (layer, members) in programs().items():
            before = plan_states().get("tuned", {})
            # As the GPU tests draw them: a bias ~ N(0, 1), as large as x @ w.
            inputs = [layer_inputs(m, k, n, rng, bias_scale=1.0) for _ in range(members)]
            x, w, b = (jnp.stack(a) if members > 1 else a[0] for a in zip(*inputs))
            d, _ = layer(x, w, b, None)
            _, bits = layer(x, w, b, "relu")
            row = {"shape": f"{m}x{k}->{n}", "program": name}
            if members == 1:
                d, bits = d[None], bits[None]
            parts = [compare(*inputs[i], d[i], bits[i]) for i in range(members)]
            row["entries"] = sum(p["entries"] for p in parts)
            for key in ("once", "twice"):
                row[key] = sum(p[key] * p["entries"] for p in parts) / row["entries"]
            row["bits_flipped"] = sum(p["bits_flipped"] for p in parts)
            for key in ("flipped_max_abs_z", "flipped_max_rounding"):
                row[key] = max(p[key] for p in parts)
            tuned = plan_states().get("tuned", {})
            row["plans"] = {plan: choice for plan, choice in tuned.items() if plan not in before}
            rows.append(row)
            print(row, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        ("| M×K→N | program | D = once | D = twice | ReLU bits ≠ (z > 0) | max \\|z\\| there "
         "| max 2⁻⁸\\|x @ w\\| there | plans (tuned choice) |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plans = "; ".join(f"{k}: {v}" for k, v in r["plans"].items()) or "-"
        lines.append(
            f"| {r['shape']} | {r['program']} | {r['once']:.2%} | {r['twice']:.2%} "
            f"| {r['bits_flipped']} of {r['entries']} | {r['flipped_max_abs_z']:.2e} "
            f"| {r['flipped_max_rounding']:.2e} | {plans} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    main_over_shapes(argv, __doc__, "epilog_rounding", bench, table, SHAPES)


if __name__ == "__main__":
    main()
