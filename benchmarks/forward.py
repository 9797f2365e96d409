"""Forward benchmark: fused_dense vs XLA's jit of the same expression vs nvmath direct.

Run on a GPU (scripts/gpu_check.sh runs it twice, with XLA command buffers on and off):

    python -m benchmarks.forward --out DIR [--part single|chain|all] [--label NAME]

Method: every contender runs in this one process on the same inputs. JAX rows are
jitted calls dispatched back to back (so small shapes include JAX's dispatch cost, as a
user sees it), timed with the wall clock after block_until_ready: median over 7 samples,
each at least 30 calls and 20 ms, the contenders' samples interleaved. The "in 4" rows
jit four independent layers into one call and divide by four, which amortises dispatch
and shows the time each layer takes on the GPU. nvmath rows time ``Matmul.execute()``
with CUDA events (median of 7 x 30), with the host µs per execute() call beside them.
Host cost of our FFI handler is measured inside the handler
(jax_epilog._ffi.handler_stats) and by the 16-layer chain comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import Settings, WallClock, measure_interleaved
from jax_epilog import _ffi, fused_dense

REPEATS, ITERS = 7, 30  # ITERS: the fewest back-to-back calls in one sample
SAMPLE_S = 0.02  # each sample runs at least this long


def activation_fn(name: str | None):
    """The activation a benchmark's plain-JAX contender applies: None or "none", "relu", or
    "gelu" (tanh approximation, as cuBLASLt's epilog)."""
    if name in (None, "none"):
        return lambda z: z
    return jax.nn.relu if name == "relu" else partial(jax.nn.gelu, approximate=True)


def output_and_vjp(layer):
    """``(x, w, b, dy) -> (y, dx, dw, db)``: the layer's output and its VJP for the output
    cotangent ``dy``, as a training step computes both (mode "fwd+vjp" of benchmarks.run
    and benchmarks.training)."""

    def step(x, w, b, dy):
        y, pullback = jax.vjp(layer, x, w, b)
        return (y, *pullback(dy))

    return step


# Samples as the suite takes them (benchmarks/timing.py), with this benchmark's counts.
SETTINGS = Settings(samples=REPEATS, min_calls=ITERS, sample_s=SAMPLE_S, max_calls=2000)


def time_jax_interleaved(*cases) -> list[float]:
    """Median µs per call for each ``(f, args)``, their samples taken in turn (A B A B ...)
    so that clock or thermal drift during the run affects every contender alike."""
    calls = [(lambda i, f=f, args=args: f(*args), WallClock()) for f, args in cases]
    return [t.us for t in measure_interleaved(calls, SETTINGS)]


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

    a = dev((n, k), (1, n), np_dt)
    b = dev((k, m), (1, k), np_dt)
    bias = dev((n,), (1,), np.float32 if bias_dtype == "float32" else np_dt)
    epilog = MatmulEpilog.RELU_BIAS if activation == "relu" else MatmulEpilog.GELU_BIAS
    try:
        mm = Matmul(a, b)
        mm.plan(epilog=epilog, epilog_inputs={"bias": bias})
        mm.execute()
    except Exception as exc:  # noqa: BLE001 -- any refusal (e.g. fp16 with an fp32 bias) skips the row
        print(f"  nvmath direct refused {m}x{k}->{n} {dtype}/{bias_dtype}: {type(exc).__name__}", file=sys.stderr)
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
    (256, 784, 100, "float16", "float32"),  # the seed layer
    (8192, 1024, 4096, "bfloat16", "bfloat16"),
    (8192, 4096, 16384, "bfloat16", "bfloat16"),
]


def layer_operands(m, k, n, dtype="bfloat16", bias_dtype="bfloat16", seed=1):
    """A single-layer row's inputs: x ~ N(0, 1) (m, k), kernel ~ N(0, 1/k) (k, n), bias
    ~ N(0, 1) (n,), as JAX arrays."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    return x, w, jnp.asarray(rng.standard_normal(n), bias_dtype)


def single_layers(activation):
    """The two layers the benchmarks compare, not jitted: {"fused": fused_dense (cuBLASLt
    path), "xla": XLA's ``act(x @ w + b)`` in x's dtype} (single layers, chains, fwd+bwd)."""
    act = activation_fn(activation)
    return {
        "fused": partial(fused_dense, activation=activation, implementation="cublaslt"),
        "xla": lambda x, w, b: act(x @ w + b).astype(x.dtype),
    }


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
            calls0, ns0, res0 = _ffi.handler_stats()
            t_fused, t_xla = time_jax_interleaved((fused, (x, w, b)), (xla, (x, w, b)))
            calls1, ns1, res1 = _ffi.handler_stats()
            nv = time_nvmath(m, k, n, dtype, bias_dtype, activation)
            handler_us = (ns1 - ns0) / max(1, calls1 - calls0) / 1e3
            # Four independent layers per jitted call: dispatch is amortised, so these
            # rows show the GPU's time per layer rather than the host's per call.
            four = [in_four(g, x) for g in (fused, xla)]
            t_fused4, t_xla4 = (t / 4 for t in time_jax_interleaved(*((g, (xs, w, b)) for g, xs in four)))
            row = {
                "shape": f"{m}x{k}->{n}", "dtype": f"{dtype}/{bias_dtype} bias", "activation": activation,
                "fused_us": t_fused, "xla_us": t_xla, "fused_in4_us": t_fused4, "xla_in4_us": t_xla4,
                "nvmath_us": nv[0] if nv else None,
                "nvmath_host_us": nv[1] if nv else None, "handler_host_us": handler_us,
                "handler_calls": calls1 - calls0, "handler_resolved": res1 - res0,
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


_RUNS = [0]  # calls of _counted functions


def _counted(f):
    def g(*args):
        _RUNS[0] += 1
        return f(*args)

    return g


def feedback(program, x, ws, bs):
    """``program`` (a chain jitted with x donated) called as ``x = program(x, ws, bs)``: each
    result is the next input, so its buffer is reused and XLA's command buffer sees the same
    addresses every step (a fresh output buffer per call makes XLA update the recorded graph
    before each launch; the host profile in benchmarks/probes/kernels.py shows it)."""
    state = [jnp.array(x, copy=True)]

    def step():
        state[0] = program(state[0], ws, bs)
        return state[0]

    return step


def released(program, *args):
    """``program(*args)`` called with the previous result deleted first, so that each call
    may get the same output buffer back and XLA launches its recorded command buffer
    unchanged. With the previous result alive while the next call is dispatched, the fused
    16-layer chain at 256 rows read 0.91-1.36x XLA's time over eight processes; released,
    or with x donated, 1.26-1.52x (benchmarks/probes/chain_outputs.py, 2026-12-03 (q))."""
    held = []

    def step():
        if held:
            held.pop().delete()
        held.append(program(*args))
        return held[-1]

    return step


def bench_chain(rows, depth=16, sizes=((256, 1024), (2048, 1024))):
    for m, k in sizes:
        x, ws, bs = chain_operands(m, k, depth)
        for activation in ("relu", "gelu"):
            fused_layer, xla_layer = single_layers(activation).values()
            fused, xla = chain(fused_layer, depth), chain(xla_layer, depth)
            jax.block_until_ready(xla(x, ws, bs))
            calls0, ns0, res0 = _ffi.handler_stats()
            runs0 = _RUNS[0]
            t_fused, t_xla, t_fused_r, t_xla_r, t_fused_d, t_xla_d = time_jax_interleaved(
                (_counted(fused), (x, ws, bs)),
                (xla, (x, ws, bs)),
                (_counted(released(fused, x, ws, bs)), ()),
                (released(xla, x, ws, bs), ()),
                (_counted(feedback(chain(fused_layer, depth, donate=True), x, ws, bs)), ()),
                (feedback(chain(xla_layer, depth, donate=True), x, ws, bs), ()),
            )
            calls1, ns1, res1 = _ffi.handler_stats()
            launched = (_RUNS[0] - runs0) * depth  # layer executions of the fused chains
            row = {
                "chain": f"{depth}x {m}x{k}->{k}", "activation": activation, "fused_us": t_fused,
                "xla_us": t_xla, "fused_released_us": t_fused_r, "xla_released_us": t_xla_r,
                "fused_donated_us": t_fused_d, "xla_donated_us": t_xla_d,
                "handler_calls": calls1 - calls0, "layer_runs": launched,
                "handler_host_us": (ns1 - ns0) / max(1, calls1 - calls0) / 1e3,
                "handler_resolved": res1 - res0,
            }  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)


def tuning_choices(plans: dict) -> dict[str, str]:
    """The autotuner's choice per tuned plan, e.g. {"RELU_BIAS 256x1024->1024 bfloat16
    (align 256)": "candidate 0 of 8 at 4.02 µs; next best 4.19 µs"}: whether two processes
    chose alike (chain timings differed between runs of the same code)."""
    choices = {}
    for (spec, _device, alignment), plan in plans.items():
        if not plan.tuning:
            continue
        order = sorted(range(len(plan.tuning)), key=plan.tuning.__getitem__)
        best, runner_up = order[0], plan.tuning[order[1]] if len(order) > 1 else float("nan")
        name = f"{spec.epilog} {spec.m}x{spec.k}->{spec.n} {spec.ab_dtype} (align {alignment})"
        found = f"candidate {best} of {len(plan.tuning)} at {plan.tuning[best]:.2f} µs"
        choices[name] = f"{found}; next best {runner_up:.2f} µs"
    return choices


def replay_states(plans: dict) -> dict[str, str]:
    """Each plan's one-GEMM graphs for calls outside command buffers, e.g. {"RELU_BIAS
    256x1024->1024 bfloat16 (align 256)": "48 graphs kept, 0 dropped, replaying"}."""
    states = {}
    for (spec, _device, alignment), plan in plans.items():
        kept, dropped, replaying = plan.replay_stats
        name = f"{spec.epilog} {spec.m}x{spec.k}->{spec.n} {spec.ab_dtype} (align {alignment})"
        states[name] = f"{kept} graphs kept, {dropped} dropped, {'replaying' if replaying else 'replay off'}"
    return states


def force_candidate(index: int) -> None:
    """Make every plan this process tunes from now on pick cuBLASLt heuristic candidate
    ``index`` (the "timings" put it first; ``Plan.tuning`` then holds them, not µs).
    Nothing to force without nvmath-python: the CPU path makes no plans."""
    try:
        from jax_epilog import _nvmath
    except ImportError:
        return
    _nvmath.Plan._time_candidates = lambda self, h: [0.0 if i == index else 1.0 for i in range(len(h))]


def versions() -> dict:
    info = {
        "jax": jax.__version__, "python": platform.python_version(), "gpu": str(jax.devices()[0].device_kind)
    }
    for name in ("nvmath", "cupy"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    try:
        from nvmath.bindings import cublasLt

        info["cublasLt"] = cublasLt.get_version()
    except ImportError:
        pass
    info["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    return info


def ratio_table(rows: list[dict], contenders, columns: dict) -> str:
    """A Markdown table: the leading ``columns`` ({header: row -> cell}), each contender's
    µs (``row[c + "_us"]``), then the first contender's time over each other's (XLA / c)."""
    first = contenders[0]
    head = [*columns, *(f"{c} µs" for c in contenders), *(f"XLA/{c}" for c in contenders[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [cell(r) for cell in columns.values()] + [f"{r[c + '_us']:.1f}" for c in contenders]
        cells += [f"{r[first + '_us'] / r[c + '_us']:.2f}×" for c in contenders[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(out: str, stem: str, rows: list[dict], table: str) -> None:
    """OUT/STEM.json (``versions()`` and ``rows``) and OUT/STEM.md (``table``)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as fh:
        json.dump({"versions": versions(), "rows": rows}, fh, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as fh:
        fh.write(table)


def xla_ratio_table(rows: list[dict], keys: dict[str, str], contenders) -> str:
    """A Markdown table of ``rows``: the ``keys`` columns ({heading: row key}), each
    contender's µs (row key ``{contender}_us``), then XLA's time over each other's."""
    others = [c for c in contenders if c != "xla"]
    lines = [
        "| " + " | ".join([*keys, *(f"{c} µs" for c in contenders), *(f"XLA / {c}" for c in others)]) + " |",
        "|" + "---|" * (len(keys) + len(contenders) + len(others)),
    ]
    for r in rows:
        cells = [str(r[k]) for k in keys.values()] + [f"{r[f'{c}_us']:.1f}" for c in contenders]
        lines.append("| " + " | ".join(cells + [f"{r['xla_us'] / r[f'{c}_us']:.2f}×" for c in others]) + " |")
    return "\n".join(lines) + "\n"


def main_over_shapes(argv, doc: str, stem: str, bench, table, shapes, **options) -> None:
    """A probe's command line: ``--shape M K N`` (repeatable; ``shapes`` without it),
    ``--out DIR`` and ``--NAME VALUE`` for each of ``options`` (NAME: its default), which
    ``bench`` takes as keywords. Prints ``table(bench(shapes))``; with ``--out`` writes
    DIR/STEM.{json,md}."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--shape", nargs=3, type=int, action="append", metavar=("M", "K", "N"))
    for name, default in options.items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    args = parser.parse_args(argv)
    rows = bench([tuple(s) for s in args.shape] if args.shape else shapes, **{n: getattr(args, n) for n in options})
    text = table(rows)
    print(text)
    if args.out:
        write_results(args.out, stem, rows, text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the JSON results")
    parser.add_argument("--part", choices=("single", "chain", "all"), default="all")
    parser.add_argument("--label", default="default", help="a name for this run's settings")
    args = parser.parse_args(argv)
    rows: list[dict] = []
    if args.part in ("single", "all"):
        bench_single(rows)
    if args.part in ("chain", "all"):
        bench_chain(rows)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"forward-{args.label}.json")
    with open(path, "w") as fh:
        from collections import Counter

        from jax_epilog import _nvmath

        plans = Counter(f"alignment {key[2]}" for key in _nvmath._plans)
        tuned = tuning_choices(_nvmath._plans)
        replay = replay_states(_nvmath._plans)
        result = {
            "label": args.label, "versions": versions(), "rows": rows,
            "plans": plans, "tuned": tuned, "replay": replay,
        }
        json.dump(result, fh, indent=1)
    print(f"plans made: {dict(plans)}")
    for problem, choice in tuned.items():
        print(f"tuned {problem}: {choice}")
    for problem, state in replay.items():
        print(f"replay {problem}: {state}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
