"""Quickstart: one fused layer, relu(x @ W + b) with 784 -> 100 features on 256 inputs.

float16 inputs and weights, a float32 bias, float32 accumulation (COMPUTE_32F). Prints the
largest error against a float64 reference and, on a GPU, the fused and unfused times.

    python examples/quickstart.py [--activation relu|gelu] [--batch 256]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog import fused_dense


def median_us(functions, *args, repeats=7, iters=50, warmup=200) -> list[float]:
    """Median µs per jitted call for each function, their samples taken in turns (A B A B
    ...) after a warm-up, so that neither meets the GPU still clocking up from idle."""
    for f in functions:
        for _ in range(warmup):
            out = f(*args)
        jax.block_until_ready(out)
    samples = [[] for _ in functions]
    for _ in range(repeats):
        for f, times in zip(functions, samples):
            start = time.perf_counter()
            for _ in range(iters):
                out = f(*args)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) / iters * 1e6)
    return [statistics.median(times) for times in samples]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--activation", choices=("relu", "gelu"), default="relu")
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args(argv)

    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((args.batch, 784)), jnp.float16)
    w = jnp.asarray(rng.standard_normal((784, 100)) / 28, jnp.float16)
    b = jnp.asarray(rng.standard_normal(100), jnp.float32)

    fused = jax.jit(
        partial(
            fused_dense, activation=args.activation, compute_type="COMPUTE_32F", implementation="cublaslt"
        )
    )
    act = jax.nn.relu if args.activation == "relu" else partial(jax.nn.gelu, approximate=True)
    unfused = jax.jit(
        lambda x, w, b: act(jnp.dot(x, w, preferred_element_type=jnp.float32) + b).astype(x.dtype)
    )

    y = fused(x, w, b)
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    ref = np.maximum(z, 0) if args.activation == "relu" else np.asarray(act(z))
    err = float(np.max(np.abs(np.asarray(y, np.float64) - ref)))
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform})")
    print(
        f"y = {args.activation}(x @ W + b): x {x.shape} {x.dtype}, W {w.shape}, b {b.dtype} -> y {y.shape} {y.dtype}"
    )
    print(
        f"max |y - float64 reference| = {err:.2e} (float16 output, ulp at 1.0 = {np.finfo(np.float16).eps:.1e})"
    )
    if device.platform == "gpu":
        t_fused, t_unfused = median_us([fused, unfused], x, w, b)
        print(
            f"fused_dense {t_fused:.1f} µs/call, XLA unfused {t_unfused:.1f} µs/call (jitted calls, median, timed in turns)"
        )
        print("(a call this small is bound by the host's dispatch either way; fusion pays on large GELU")
        print(" layers and in multi-layer jits: README.md, 'Performance')")


if __name__ == "__main__":
    main()
