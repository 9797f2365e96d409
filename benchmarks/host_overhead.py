"""Where the fused call's host time goes: one plan's run() with and without graph replay,
and the FFI handler inside jitted calls, step by step.

    python -m benchmarks.host_overhead

A 256x256->256 bfloat16 ReLU problem (a bit-mask aux), on scratch buffers:

- ``Plan.run`` with the same pointers, replaying the one-GEMM CUDA graph it captured
  (``Policy.replay``), and the same with replay off (``cublasLtMatmul`` at every call);
- ``Plan.run`` alternating two bias pointers (a descriptor attribute set at every call
  without replay), and rotating A, B, D over eight buffer sets;
- a jitted ``fused_dense`` called back to back and synchronised each call, beside XLA's
  program, with the handler's host µs per run (mean, and the median of its runs).
"""

from __future__ import annotations

import statistics
import time

import cupy as cp
import jax
import jax.numpy as jnp
import numpy as np

import jax_epilog
from jax_epilog import fused_dense
from jax_epilog._epilogs import EpilogSpec
from jax_epilog.cuda.ffi import recording
from jax_epilog.cuda.plan import Plan, alignment_of, current_device, get_plan


def per_call_us(fn, n=2000) -> float:
    """Median µs per call of ``fn`` over five loops of ``n`` calls (the host's time: the
    GPU work is queued, and waited for once at the end)."""
    fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    cp.cuda.runtime.deviceSynchronize()
    return statistics.median(samples)


def plan_rows(spec: EpilogSpec) -> None:
    device = current_device()
    plan = get_plan(spec, device)
    bufs = [cp.zeros(1 << 20, cp.uint8) for _ in range(6)]
    a, b, bias, bias2, d, aux = (x.data.ptr for x in bufs)
    stream = cp.cuda.Stream(non_blocking=True)
    s = stream.ptr
    replayed = per_call_us(lambda: plan.run(s, a, b, bias, d, aux))
    print(f"Plan.run same pointers, replayed       {replayed:6.2f} µs ({plan.replay_stats[0]} graphs kept)")
    with jax_epilog.override_policy(replay=False):
        direct = Plan(spec, device, 256)
        print(
            f"Plan.run same pointers, replay off     {per_call_us(lambda: direct.run(s, a, b, bias, d, aux)):6.2f} µs"
        )
        flip, i = [bias, bias2], [0]

        def alternating():  # call sites of one problem taking turns: one attribute set each
            i[0] ^= 1
            direct.run(s, a, b, flip[i[0]], d, aux)

        print(f"Plan.run alternating bias, replay off  {per_call_us(alternating):6.2f} µs")
    arrays = [cp.zeros(1 << 20, cp.uint8) for _ in range(24)]
    sets = [tuple(x.data.ptr for x in arrays[j : j + 3]) for j in range(0, 24, 3)]

    def rotating():  # as when XLA hands each call other operand and output addresses
        i[0] = (i[0] + 1) % len(sets)
        a_, b_, d_ = sets[i[0]]
        plan.run(s, a_, b_, bias, d_, aux)

    print(f"Plan.run A, B, D rotating over 8 sets  {per_call_us(rotating):6.2f} µs")
    print(
        f"alignment_of                           {per_call_us(lambda: alignment_of(a, b, d, bias, aux)):6.2f} µs"
    )


def jit_rows(m: int, k: int, n: int) -> None:
    x, w, b = jnp.ones((m, k), jnp.bfloat16), jnp.ones((k, n), jnp.bfloat16), jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="relu", implementation="cublaslt"))
    g = jax.jit(lambda x, w, b: jax.nn.relu(x @ w + b))
    f(x, w, b).block_until_ready()
    loops = [("sync each call", lambda: f(x, w, b).block_until_ready()), ("back to back", lambda: f(x, w, b))]
    for label, call in loops:
        with recording(trace=True) as stats:
            tf = per_call_us(call, 500)
        tg = per_call_us(lambda: g(x, w, b).block_until_ready(), 500)
        runs = np.diff(np.asarray(stats.trace, dtype=np.int64), axis=1) / 1e3 if stats.trace else np.zeros(1)
        print(
            f"jit fused ({label}) {tf:6.2f} µs; XLA {tg:6.2f} µs; handler "
            f"{stats.busy_ns / max(1, stats.calls) / 1e3:6.2f} µs/run (median {np.median(runs):.2f} µs)"
        )


def main():
    m = k = n = 256
    plan_rows(EpilogSpec(m, n, k, "RELU_AUX_BIAS", "COMPUTE_32F", "bfloat16", "bfloat16", "bfloat16"))
    jit_rows(m, k, n)


if __name__ == "__main__":
    main()
