"""How cuBLASLt (forward, wgrad) and XLA (the backward's dx) round float32 operands under
COMPUTE_32F_FAST_TF32 / _16F / _16BF, on the GPU: each result's largest error, relative
to the same product of absolute values, against float64 products of the operands rounded
to nearest (what jax_epilog's CPU path and tests now emulate), truncated, and unrounded.

    python benchmarks/results/2026-12-04-h200-aa-async-dispatch/fast_rounding.py
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jax_epilog

jax.config.update("jax_enable_x64", True)


def nearest(a, name):
    a = np.asarray(a, np.float32)
    if name.endswith("16F"):
        return a.astype(np.float16).astype(np.float64)
    if name.endswith("16BF"):
        return a.astype(ml_dtypes.bfloat16).astype(np.float64)
    bits = a.view(np.uint32).astype(np.uint64)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) >> 13 << 13
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def truncated(a, name):
    drop = {"16F": 13, "TF32": 13, "16BF": 16}[name.rsplit("_", 1)[1]]
    bits = np.asarray(a, np.float32).view(np.uint32) >> drop << drop
    return bits.view(np.float32).astype(np.float64)


def main():
    rng = np.random.default_rng(0)
    print("| compute type | M×K→N | result | vs nearest | vs truncated | vs unrounded |")
    print("|---|---|---|---|---|---|")
    for name in ("COMPUTE_32F_FAST_TF32", "COMPUTE_32F_FAST_16F", "COMPUTE_32F_FAST_16BF"):
        for m, k, n in ((33, 129, 65), (1000, 1024, 1000)):
            x = rng.standard_normal((m, k)).astype(np.float32)
            w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
            b = rng.standard_normal(n).astype(np.float32)
            dy = rng.standard_normal((m, n)).astype(np.float32)
            f = lambda x, w, b: jax_epilog.fused_dense(x, w, b, compute_type=name, implementation="cublaslt")
            y, vjp = jax.vjp(jax.jit(f), x, w, b)
            dx, dw, _ = vjp(jnp.asarray(dy))
            cases = (
                ("y = x @ w + b (cuBLASLt)", np.asarray(y), lambda r: r(x) @ r(w) + b, np.abs(x) @ np.abs(w)),
                ("dx = dy @ w.T (XLA)", np.asarray(dx), lambda r: r(dy) @ r(w).T, np.abs(dy) @ np.abs(w).T),
                ("dw = x.T @ dy (cuBLASLt wgrad)", np.asarray(dw), lambda r: r(x).T @ r(dy), np.abs(x).T @ np.abs(dy)),
            )
            for what, got, product, scale in cases:
                errs = []
                for r in (lambda a: nearest(a, name), lambda a: truncated(a, name), lambda a: np.asarray(a, np.float64)):
                    errs.append(np.max(np.abs(got.astype(np.float64) - product(r)) / scale))
                print(f"| {name} | {m}x{k}->{n} | {what} | " + " | ".join(f"{e:.2e}" for e in errs) + " |", flush=True)


if __name__ == "__main__":
    main()
