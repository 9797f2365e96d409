"""The suite's two sections beside the cases: the machine's ceilings (an 8192³ bf16 matmul,
a 1 GiB read + write) and the host cost per call (one small layer in a Python loop of
jitted calls and in a ``lax.fori_loop``; 16-layer chains, with the FFI handler's runs
counted against the layers' to tell whether XLA captured the chain into a command buffer).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import forward
from benchmarks.common import HandlerClock, Progress, failure_reason, single_layers
from benchmarks.timing import Settings, WallClock, measure, measure_interleaved

HOST_STEPS, CHAIN_DEPTH = 64, 16
RELU_GELU = ("relu", "gelu")
# Weights stacked in one array and sliced in the jit, or one array per layer as Flax's
# layers hold them; "result released": the stacked chain with each result deleted before
# the next call; "x donated": x = chain(x, ...), a training loop's pattern. In the last two
# every step runs on the same buffers and XLA launches its recorded graph unchanged.
CHAIN_WEIGHTS = ("stacked", "per-layer", "stacked, result released", "stacked, x donated")
N_CEILING, N_HOST = 2, 4 + len(RELU_GELU) * len(CHAIN_WEIGHTS) * 2  # measurements, for the progress counter


def guarded(bench, *args) -> dict:
    """bench(*args), or {"skipped": reason} if it fails: the rest of the run goes on."""
    try:
        return bench(*args)
    except Exception as exc:  # noqa: BLE001
        print(f"{bench.__name__} failed: {failure_reason(exc)}", flush=True)
        return {"skipped": failure_reason(exc)}


def bench_ceiling(settings: Settings, scale: int, progress: Progress) -> dict:
    size = 8192 // scale
    a, b = (jax.random.normal(jax.random.key(i), (size, size), jnp.bfloat16) for i in range(2))
    matmul = jax.jit(jnp.matmul)
    t = measure(lambda i: matmul(a, b), WallClock(), settings)
    mm = {
        "shape": f"{size}x{size}x{size}",
        "dtype": "bfloat16",
        "us": t.us,
        "tflops": 2 * size**3 / t.us / 1e6,
    }
    progress.report(f"ceiling: {mm['shape']} bf16 matmul", f"{mm['us']:.1f} µs, {mm['tflops']:.1f} TF/s")
    nbytes = (1 << 30) // scale
    v = jnp.zeros(nbytes // 4, jnp.float32)
    add_one = jax.jit(lambda v: v + 1)  # reads and writes every byte once
    t = measure(lambda i: add_one(v), WallClock(), settings)
    copy = {"what": "jit(v + 1), float32", "bytes": nbytes, "us": t.us, "gbps": 2 * nbytes / t.us / 1e3}
    progress.report(
        f"ceiling: copy {nbytes >> 20} MiB", f"{copy['us']:.1f} µs, {copy['gbps']:.0f} GB/s (read+write)"
    )
    return {"matmul": mm, "copy": copy}


def command_buffer_verdict(handler_runs: int, layer_runs: int, on_gpu: bool) -> str:
    """Read handler executions against layer executions: XLA runs a captured command
    buffer (a CUDA graph) without calling our handler, so few runs means captured."""
    if not on_gpu:
        return "n/a (no GPU: the CPU path has no handler)"
    if handler_runs == 0:
        return "handler never ran (fused path not used?)"
    if handler_runs * 10 <= layer_runs:
        return "captured (handler ran only while XLA recorded the graph)"
    if handler_runs >= layer_runs:
        return "not captured (handler ran for every layer)"
    return "partly captured"


def _repeat(layer, steps: int):
    """One jitted call that applies the same layer ``steps`` times in a loop."""
    return jax.jit(lambda x, w, b: jax.lax.fori_loop(0, steps, lambda _, y: layer(y, w, b), x))


def _chain_step(layer, weights: str, x, ws, bs):
    """One step of a CHAIN_DEPTH-layer chain as its variant (CHAIN_WEIGHTS) calls it."""
    if weights.endswith("donated"):
        return forward.feedback(forward.chain(layer, CHAIN_DEPTH, donate=True), x, ws, bs)
    program = forward.chain(layer, CHAIN_DEPTH)
    if weights.endswith("released"):
        return forward.released(program, x, ws, bs)
    return partial(program, x, ws, bs)


def _layers(activation: str) -> dict:
    """The host section's pair under the suite's contender names."""
    pair = single_layers(activation)
    return {"jax_epilog": pair["fused"], "xla": pair["xla"]}


def _single(settings, progress, x, w, b, m, k) -> list[dict]:
    rows = []
    for name, relu in _layers("relu").items():
        for what, program, steps in (
            ("python loop of jitted calls", jax.jit(relu), 1),
            (f"lax.fori_loop({HOST_STEPS}) in one jit", _repeat(relu, HOST_STEPS), HOST_STEPS),
        ):
            clock = HandlerClock()
            t = measure(lambda i, p=program: p(x, w, b), clock, settings)
            rows.append(
                {"what": what, "contender": name, "us_per_call": t.us / steps, "calls": t.calls * steps}
                | {"handler_runs": clock.runs, "handler_host_us": clock.host_us}
            )
            progress.report(f"host: {m}x{k}->{k} relu {name}, {what}", f"{t.us / steps:.1f} µs per call")
    return rows


def bench_host(settings: Settings, scale: int, progress: Progress, on_gpu: bool) -> dict:
    m, k = 256 // scale, 1024 // scale
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32), jnp.bfloat16)
    ws = jnp.asarray(rng.standard_normal((CHAIN_DEPTH, k, k), dtype=np.float32) / np.sqrt(k), jnp.bfloat16)
    bs = jnp.asarray(rng.standard_normal((CHAIN_DEPTH, k), dtype=np.float32), jnp.bfloat16)
    # (sliced once: a slice inside the timed loop would be a dispatch of its own)
    single = _single(settings, progress, x, ws[0], bs[0], m, k)
    chains = []
    for act in RELU_GELU:
        layers = _layers(act)
        for weights in CHAIN_WEIGHTS:
            w_arg, b_arg = (tuple(ws), tuple(bs)) if weights == "per-layer" else (ws, bs)
            steps = [_chain_step(layer, weights, x, w_arg, b_arg) for layer in layers.values()]
            clocks = [HandlerClock() for _ in layers]
            timings = measure_interleaved([(lambda i, s=s: s(), c) for s, c in zip(steps, clocks)], settings)
            entry = {"layers": CHAIN_DEPTH, "shape": f"{m}x{k}->{k}", "activation": act, "weights": weights}
            for name, t, clock in zip(layers, timings, clocks):
                entry[f"{name}_us"] = t.us
                if name == "jax_epilog":
                    layer_runs = t.calls * CHAIN_DEPTH
                    entry |= {
                        "handler_runs": clock.runs, "layer_runs": layer_runs, "handler_host_us": clock.host_us,
                        "command_buffers": command_buffer_verdict(clock.runs, layer_runs, on_gpu),
                    }  # fmt: skip
                progress.report(
                    f"host: chain of {CHAIN_DEPTH} {m}x{k}->{k} {act}, {weights} weights, {name}",
                    f"{t.us:.1f} µs per step",
                )
            chains.append(entry)
    return {"single": single, "chain": chains}
