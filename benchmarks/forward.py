"""Forward benchmark: fused_dense against XLA's jit of the same expression and nvmath direct,
single layers and 16-layer chains.

    python -m benchmarks.forward --out DIR [--part single|chain|all] [--label NAME] [--policy FIELD=VALUE ...]

scripts/gpu_check.sh runs it twice, with XLA's command buffers off and on. Every contender
runs in this one process on the same inputs. JAX rows: jitted calls dispatched back to back
(small shapes include JAX's dispatch cost, as a user sees it), the host clock after
block_until_ready, median of 7 interleaved samples, each at least 30 calls and 20 ms. The
"in 4" rows jit four independent layers into one call and divide by four: dispatch is
amortised and the rows show each layer's time on the GPU. nvmath rows time
``Matmul.execute()`` with CUDA events (median of 7 x 30), the host µs per execute() beside
them. Chains: 16 layers ``x = act(x @ w_i + b_i)`` in one jit, called three ways (``y =
chain(x)`` with the previous result alive, the previous result released, x donated); the
FFI handler's runs against the layers' tell whether XLA ran them in a command buffer. The
JSON also records each plan's tuned choice and its replay graphs (kept, dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import (
    add_policy_option,
    current_plans,
    policy,
    policy_changes,
    replay_states,
    single_layers,
    time_jax_interleaved,
    tuning_choices,
    versions,
)
from jax_epilog.cuda.ffi import recording

REPEATS, ITERS = 7, 30  # nvmath rows: samples, back-to-back executes in each


def time_nvmath(m, k, n, dtype, bias_dtype, activation) -> tuple[float, float] | None:
    """(GPU µs, host µs) per nvmath Matmul.execute() of the same column-major problem."""
    import cupy as cp
    import ml_dtypes
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    np_dt = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    rng = np.random.default_rng(0)

    def dev(shape, strides, dt):
        host = rng.standard_normal(int(np.prod(shape))).astype(np.float32) * 0.05
        raw = cp.asarray(host.astype(dt).view(np.uint8))
        item = np.dtype(dt).itemsize
        return cp.ndarray(shape, dt, raw.data, tuple(s * item for s in strides))

    a, b = dev((n, k), (1, n), np_dt), dev((k, m), (1, k), np_dt)
    bias = dev((n,), (1,), np.float32 if bias_dtype == "float32" else np_dt)
    epilog = MatmulEpilog.RELU_BIAS if activation == "relu" else MatmulEpilog.GELU_BIAS
    try:
        mm = Matmul(a, b)
        mm.plan(epilog=epilog, epilog_inputs={"bias": bias})
        mm.execute()
    except Exception as exc:  # noqa: BLE001 -- any refusal (e.g. fp16 with an fp32 bias) skips the row
        print(
            f"  nvmath direct refused {m}x{k}->{n} {dtype}/{bias_dtype}: {type(exc).__name__}",
            file=sys.stderr,
        )
        return None
    stream = cp.cuda.get_current_stream()
    gpu, host = [], []
    for _ in range(REPEATS):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        t0 = time.perf_counter()
        for _ in range(ITERS):
            mm.execute()
        host.append((time.perf_counter() - t0) / ITERS * 1e6)
        end.record(stream)
        end.synchronize()
        gpu.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / ITERS)
    mm.free()
    return statistics.median(gpu), statistics.median(host)


SINGLE = [  # (m, k, n, dtype, bias dtype)
    (256, 784, 100, "float16", "float32"),  # the quickstart layer
    (8192, 1024, 4096, "bfloat16", "bfloat16"),
    (8192, 4096, 16384, "bfloat16", "bfloat16"),
]


def layer_operands(m, k, n, dtype="bfloat16", bias_dtype="bfloat16", seed=1):
    """x ~ N(0, 1) (m, k), kernel ~ N(0, 1/k) (k, n), bias ~ N(0, 1) (n,), as JAX arrays."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    return x, w, jnp.asarray(rng.standard_normal(n), bias_dtype)


def in_four(layer, x):
    """The "in 4" rows: four independent layers (inputs x scaled by 1 + i/8) in one jitted
    call, as (program, stacked inputs)."""
    xs = jnp.stack([x * (1 + i / 8) for i in range(4)])
    return jax.jit(lambda xs, w, b: [layer(xs[i], w, b) for i in range(4)]), xs


def bench_single(rows):
    for m, k, n, dtype, bias_dtype in SINGLE:
        x, w, b = layer_operands(m, k, n, dtype, bias_dtype)
        for activation in ("relu", "gelu"):
            layers = single_layers(activation)
            fused, xla = jax.jit(layers["fused"]), jax.jit(layers["xla"])
            jax.block_until_ready(xla(x, w, b))  # compiled outside the handler's count
            with recording() as stats:
                t_fused, t_xla = time_jax_interleaved((fused, (x, w, b)), (xla, (x, w, b)))
            nv = time_nvmath(m, k, n, dtype, bias_dtype, activation)
            four = [in_four(g, x) for g in (fused, xla)]
            t_fused4, t_xla4 = (t / 4 for t in time_jax_interleaved(*((g, (xs, w, b)) for g, xs in four)))
            row = {
                "shape": f"{m}x{k}->{n}", "dtype": f"{dtype}/{bias_dtype} bias", "activation": activation,
                "fused_us": t_fused, "xla_us": t_xla, "fused_in4_us": t_fused4, "xla_in4_us": t_xla4,
                "nvmath_us": nv[0] if nv else None, "nvmath_host_us": nv[1] if nv else None,
                "handler_host_us": stats.busy_ns / max(1, stats.calls) / 1e3,
                "handler_calls": stats.calls, "handler_resolved": stats.plans_resolved,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)


def chain_operands(m: int, k: int, depth: int, seed: int = 2):
    """x (m, k) and ``depth`` stacked square layers' weights (depth, k, k) and biases
    (depth, k), bf16, scaled so that activations stay O(1) along the chain."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    ws = jnp.asarray(rng.standard_normal((depth, k, k)) / np.sqrt(k), jnp.bfloat16)
    bs = jnp.asarray(rng.standard_normal((depth, k)) * 0.1, jnp.bfloat16)
    return x, ws, bs


def chain(layer, depth=16, donate=False):
    """A jitted ``depth``-layer chain ``x = layer(x, ws[i], bs[i])`` (weights sliced from
    stacked arrays, or taken from tuples of per-layer arrays); ``donate``: x's buffer is
    donated (the result may take its place)."""

    def f(x, ws, bs):
        for i in range(depth):
            x = layer(x, ws[i], bs[i])
        return x

    return jax.jit(f, donate_argnums=(0,) if donate else ())


def feedback(program, x, ws, bs):
    """``program`` (a chain jitted with x donated) called as ``x = program(x, ws, bs)``: each
    result is the next input, so XLA's command buffer sees the same addresses every step."""
    state = [jnp.array(x, copy=True)]

    def step():
        state[0] = program(state[0], ws, bs)
        return state[0]

    return step


def released(program, *args):
    """``program(*args)`` called with the previous result deleted first, so that each call
    may get the same output buffer back and XLA launches its recorded command buffer
    unchanged (with the previous result alive, XLA updates the graph before each launch)."""
    held = []

    def step():
        if held:
            held.pop().delete()
        held.append(program(*args))
        return held[-1]

    return step


class _Counted:
    """A step that counts its calls (layer executions = calls x depth)."""

    def __init__(self, f):
        self.f, self.calls = f, 0

    def __call__(self, *args):
        self.calls += 1
        return self.f(*args)


def bench_chain(rows, depth=16, sizes=((256, 1024), (2048, 1024))):
    for m, k in sizes:
        x, ws, bs = chain_operands(m, k, depth)
        for activation in ("relu", "gelu"):
            fused_layer, xla_layer = single_layers(activation).values()
            fused, xla = chain(fused_layer, depth), chain(xla_layer, depth)
            jax.block_until_ready(xla(x, ws, bs))
            counted = [
                _Counted(fused), _Counted(released(fused, x, ws, bs)),
                _Counted(feedback(chain(fused_layer, depth, donate=True), x, ws, bs)),
            ]  # fmt: skip
            with recording() as stats:
                t_fused, t_xla, t_fused_r, t_xla_r, t_fused_d, t_xla_d = time_jax_interleaved(
                    (counted[0], (x, ws, bs)), (xla, (x, ws, bs)),
                    (counted[1], ()), (released(xla, x, ws, bs), ()),
                    (counted[2], ()), (feedback(chain(xla_layer, depth, donate=True), x, ws, bs), ()),
                )  # fmt: skip
            row = {
                "chain": f"{depth}x {m}x{k}->{k}", "activation": activation, "fused_us": t_fused,
                "xla_us": t_xla, "fused_released_us": t_fused_r, "xla_released_us": t_xla_r,
                "fused_donated_us": t_fused_d, "xla_donated_us": t_xla_d,
                "handler_calls": stats.calls, "layer_runs": sum(c.calls for c in counted) * depth,
                "handler_host_us": stats.busy_ns / max(1, stats.calls) / 1e3,
                "handler_resolved": stats.plans_resolved,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for the JSON results")
    parser.add_argument("--part", choices=("single", "chain", "all"), default="all")
    parser.add_argument("--label", default="default", help="a name for this run's settings")
    add_policy_option(parser)
    args = parser.parse_args(argv)
    changes = policy_changes(args.policy)
    rows: list[dict] = []
    with policy(changes):
        if args.part in ("single", "all"):
            bench_single(rows)
        if args.part in ("chain", "all"):
            bench_chain(rows)
    plans = current_plans()
    made = Counter(f"alignment {getattr(p, 'alignment', '?')}" for p in plans)
    tuned, replay = tuning_choices(plans), replay_states(plans)
    result = {
        "label": args.label, "versions": versions(), "policy": {k: repr(v) for k, v in changes.items()},
        "rows": rows, "plans": made, "tuned": tuned, "replay": replay,
    }  # fmt: skip
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"forward-{args.label}.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"plans made: {dict(made)}")
    for problem, choice in tuned.items():
        print(f"tuned {problem}: {choice}")
    for problem, state in replay.items():
        print(f"replay {problem}: {state}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
