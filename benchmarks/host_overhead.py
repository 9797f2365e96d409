"""Where the fused call's host time goes: Plan.run alone, cublasLtMatmul alone, the handler.

    python -m benchmarks.host_overhead
"""

from __future__ import annotations

import statistics
import time

import cupy as cp
import jax
import jax.numpy as jnp
import numpy as np
from nvmath.bindings import cublasLt

from jax_epilog import _ffi, _nvmath, fused_dense
from jax_epilog._epilogs import EpilogSpec


def per_call_us(fn, n=2000):
    fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    cp.cuda.runtime.deviceSynchronize()
    return statistics.median(samples)


def main():
    m = k = n = 256
    spec = EpilogSpec(m, n, k, "RELU_AUX_BIAS", "COMPUTE_32F", "bfloat16", "bfloat16", "bfloat16")
    plan = _nvmath.get_plan(spec, 0)
    bufs = [cp.zeros(1 << 20, cp.uint8) for _ in range(6)]
    a, b, bias, bias2, d, aux = (x.data.ptr for x in bufs)
    stream = cp.cuda.Stream(non_blocking=True)
    s = stream.ptr
    print(f"Plan.run same pointers      {per_call_us(lambda: plan.run(s, a, b, bias, d, aux)):6.2f} µs"
          f"  (replays a CUDA graph: {len(plan._graphs)} made)")
    print(f"Plan._matmul same pointers  {per_call_us(lambda: plan._matmul(s, a, b, bias, d, aux)):6.2f} µs")
    flip = [bias, bias2]
    i = [0]

    def alternating():  # as when call sites of one problem alternate: one attribute set each
        i[0] ^= 1
        plan.run(s, a, b, flip[i[0]], d, aux)

    print(f"Plan.run alternating bias   {per_call_us(alternating):6.2f} µs")
    # As when XLA hands each call other operand and output addresses: does cuBLASLt's own
    # per-call cost depend on the pointers it saw last? (bias and aux stay, so our code
    # sets no descriptor attribute here.)
    arrays = [cp.zeros(1 << 20, cp.uint8) for _ in range(24)]
    sets = [tuple(x.data.ptr for x in arrays[j : j + 3]) for j in range(0, 24, 3)]

    def rotating():
        i[0] = (i[0] + 1) % len(sets)
        a_, b_, d_ = sets[i[0]]
        plan.run(s, a_, b_, bias, d_, aux)

    print(f"Plan.run A, B, D rotating over 8 sets {per_call_us(rotating):6.2f} µs")
    lay = plan._layouts

    def raw():
        cublasLt.matmul(plan._handle, plan._desc, plan._alpha, a, lay[0], b, lay[1], plan._beta,
                        d, lay[2], d, lay[3], plan._algo, plan._ws_ptr, plan._ws_size, s)

    print(f"cublasLt.matmul alone       {per_call_us(raw):6.2f} µs")
    print(f"alignment_of                {per_call_us(lambda: _nvmath.alignment_of(a, b, d, bias, aux)):6.2f} µs")

    x = jnp.ones((m, k), jnp.bfloat16)
    w = jnp.ones((k, n), jnp.bfloat16)
    bb = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="relu", implementation="cublaslt"))
    g = jax.jit(lambda x, w, b: jax.nn.relu(x @ w + b))
    f(x, w, bb).block_until_ready()
    loops = [("sync each call", lambda: f(x, w, bb).block_until_ready()), ("back to back", lambda: f(x, w, bb))]
    for label, call in loops:
        c0, ns0, _ = _ffi.handler_stats()
        _ffi.trace_handler(True)
        tf = per_call_us(call, 500)
        trace = np.diff(np.asarray(_ffi.trace_handler(False), dtype=np.int64), axis=1) / 1e3
        c1, ns1, _ = _ffi.handler_stats()
        tg = per_call_us(lambda: g(x, w, bb).block_until_ready(), 500)
        steps = ("decode", "stream", "lookup", "cuBLASLt")
        parts = ", ".join(f"{name} {v:.2f}" for name, v in zip(steps, np.median(trace, axis=0)))
        print(f"jit fused ({label}) {tf:6.2f} µs; XLA {tg:6.2f} µs; handler "
              f"{(ns1 - ns0) / (c1 - c0) / 1e3:6.2f} µs/call (medians: {parts} µs)")


if __name__ == "__main__":
    main()
