"""The benchmark suite: every contender on every shape, in one command.

    python -m benchmarks.run [--quick | --full] [--dtype D ...] [--out DIR] [--dry-run] [--cpu-smoke]

Writes ``<out>/<UTC date>-<gpu slug>.json``, its Markdown rendering beside it (``.md``) and,
when matplotlib is importable, two plots (``benchmarks/plot.py``). Contenders: fused_dense
(forward, and forward+backward in two modes: ``MODES``), XLA's jit of ``act(x @ w + b)``
with default options and compiled with ``xla_gpu_enable_cublaslt`` on (``CUBLASLT_OPTIONS``: the
``--xla_gpu_enable_cublaslt=true`` flag for that program alone), PyTorch eager in three spellings,
nvmath-python's ``Matmul`` called from CuPy, plus the machine's matmul and copy ceilings and
the host cost per call. The method is in benchmarks/README.md.

``--dtype`` keeps the cases whose operands have one of the dtypes named (bfloat16, float16,
float32): ``--full`` outlasts a 10-minute session on the device, so it runs in parts.
``--dry-run`` lists the measurements and an H200 time estimate without timing anything;
``--cpu-smoke`` divides every dimension by 64 and takes two samples of two calls, so the
whole code path runs on a CPU (torch and nvmath rows then say why they were skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import warnings
from dataclasses import asdict
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import forward
from benchmarks.timing import EventClock, Settings, Timing, WallClock, measure, measure_interleaved
from jax_epilog import FastPathWarning, _ffi, fused_dense

# "xla_cublaslt": XLA's program compiled as with XLA_FLAGS=--xla_gpu_enable_cublaslt=true, but
# in this process, so that it is timed in turns with the others (until 2026-12-04 a second
# process timed it, before and apart from them, and read it 5-7% faster than in here).
CUBLASLT_OPTIONS = {"xla_gpu_enable_cublaslt": True}
TF32 = "COMPUTE_32F_FAST_TF32"
HAS_IMPLEMENTATION = "implementation" in inspect.signature(fused_dense).parameters

# ------------------------------------------------------------------------------- the plan


class Case(NamedTuple):
    """One problem and mode; every contender is timed on it."""

    m: int
    k: int
    n: int
    dtype: str
    bias_dtype: str
    activation: str  # "relu", "gelu" or "none"
    mode: str  # one of MODES
    compute_type: str | None = None  # fused_dense's default when None

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.k}->{self.n}"


# "fwd": the layer's output. "fwd+bwd": jax.grad of the output's float32 sum in x, kernel and
# bias; XLA may then skip forming the output itself (only act'(z) is needed) and fold the
# constant cotangent away. "fwd+vjp": the output and its VJP for a given cotangent dy (an
# input, N(0, 1)), what a layer does in a training step, where y feeds the next layer.
MODES = ("fwd", "fwd+bwd", "fwd+vjp")
KEY_FIELDS = ("shape", "dtype", "bias_dtype", "compute_type", "activation", "mode")


def row_key(row: dict) -> tuple:
    """What identifies a results row's case."""
    return tuple(row.get(field) for field in KEY_FIELDS)


TRANSFORMER = ((1024, 4096), (4096, 16384), (4096, 1024), (16384, 4096))  # (K, N) at M=8192
ALL_ACTS, RELU_GELU = ("relu", "gelu", "none"), ("relu", "gelu")
DTYPES = ("bfloat16", "float16", "float32")  # the operand dtypes plan() draws on


def plan(full: bool) -> list[Case]:
    """The cases of --quick (full=False) or --full, in the order they run."""
    cases: list[Case] = []

    def add(m, k, n, dtype, bias_dtype=None, acts=ALL_ACTS, backward=False, compute_type=None):
        for act in acts:
            for mode in MODES if backward else ("fwd",):
                cases.append(Case(m, k, n, dtype, bias_dtype or dtype, act, mode, compute_type))

    add(256, 784, 100, "float16", "float32", backward=full)  # the seed layer
    for k, n in TRANSFORMER if full else TRANSFORMER[:3]:
        for dtype in ("bfloat16", "float16") if full else ("bfloat16",):
            acts = ALL_ACTS if full or (k, n) == (1024, 4096) else RELU_GELU
            add(8192, k, n, dtype, acts=acts, backward=True)
    for m in (16, 64, 128) if full else (64,):  # small-batch inference
        add(m, 4096, 16384, "bfloat16", acts=ALL_ACTS if full else RELU_GELU)
    add(1000, 1000, 1003, "bfloat16", acts=ALL_ACTS if full else RELU_GELU, backward=full)
    # A large layer whose rows (N) are not 16-byte aligned: cuBLASLt's kernels for it are
    # far slower (2026-12-05 (ag)), so the op pads them ((ah)).
    add(8192, 1024, 4097, "bfloat16", acts=RELU_GELU, backward=full)
    if full:
        for compute_type in (None, TF32):
            add(8192, 1024, 4096, "float32", backward=True, compute_type=compute_type)
    return cases


def shrink(case: Case, factor: int) -> Case:
    """The same case with every dimension divided by factor (for --cpu-smoke)."""
    return case._replace(m=max(1, case.m // factor), k=max(1, case.k // factor), n=max(1, case.n // factor))


TORCH = ("torch_matmul_add", "torch_linear", "torch_addmm_act")


def contenders(mode: str, with_auto: bool = HAS_IMPLEMENTATION) -> list[str]:
    names = ["jax_epilog", *(["jax_epilog_auto"] if with_auto else []), "xla", "xla_cublaslt"]
    return names + ([*TORCH, "nvmath"] if mode == "fwd" else [])


def jobs(cases: list[Case], with_auto: bool = HAS_IMPLEMENTATION) -> list[tuple[Case, str]]:
    return [(case, name) for case in cases for name in contenders(case.mode, with_auto)]


def flops(case: Case) -> int:
    """2·M·N·K for the forward, three GEMMs' worth (6·M·N·K) with the backward."""
    return (2 if case.mode == "fwd" else 6) * case.m * case.n * case.k


def tflops(case: Case, us: float) -> float:
    return flops(case) / us / 1e6


ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def operand_bytes(case: Case) -> int:
    """x, kernel, bias and the output, in bytes."""
    item = ITEMSIZE[case.dtype]
    return item * (case.m * case.k + case.k * case.n + case.m * case.n) + ITEMSIZE[case.bias_dtype] * case.n


def input_copies(case: Case) -> int:
    """Distinct input sets to rotate through, so no call finds its operands warm in L2."""
    return 3 if operand_bytes(case) < 200e6 else 2


# --------------------------------------------------------------------------------- timing
# (the method is in benchmarks/timing.py)

QUICK, FULL = Settings(samples=5), Settings(samples=7)
SMOKE = Settings(samples=2, min_calls=2, sample_s=0.0, warmup=1)


# --------------------------------------------------------------------------------- inputs


def _np_dtype(name: str):
    import ml_dtypes

    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def host_operands(m: int, k: int, n: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """float32 x (m, k), kernel (k, n) scaled by 1/sqrt(k), bias (n,)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32) / np.float32(np.sqrt(k))
    return x, w, rng.standard_normal(n, dtype=np.float32)


class Inputs:
    """One problem's operands: float32 host arrays and, per framework (on first use), a
    list of distinct device copies holding the same values (``copies`` of them, by default
    ``input_copies(case)``): uploaded once, copied on the device."""

    def __init__(self, case: Case, host: tuple[np.ndarray, ...] | None = None, copies: int | None = None):
        self.problem = (case.m, case.k, case.n, case.dtype, case.bias_dtype)
        self.host = host_operands(case.m, case.k, case.n) if host is None else host
        self.dtype, self.bias_dtype = case.dtype, case.bias_dtype
        self.copies = input_copies(case) if copies is None else copies
        self._made: dict[str, list] = {}

    def _sets(self, framework: str, upload, clone, operands=None) -> list[tuple]:
        if framework not in self._made:
            left, right, bias = operands or self.host
            first = (upload(left, self.dtype), upload(right, self.dtype), upload(bias, self.bias_dtype))
            rest = [tuple(clone(array) for array in first) for _ in range(self.copies - 1)]
            self._made[framework] = [first, *rest]
        return self._made[framework]

    def jax(self) -> list[tuple]:
        return self._sets("jax", jnp.asarray, jnp.copy)

    def jax_cotangents(self) -> list[jax.Array]:
        """An output cotangent dy ~ N(0, 1) of shape (m, n) in the operands' dtype, one
        device copy per input set (mode "fwd+vjp")."""
        if "jax_dy" not in self._made:
            m, _, n = self.problem[:3]
            dy = jnp.asarray(np.random.default_rng(1).standard_normal((m, n), dtype=np.float32), self.dtype)
            self._made["jax_dy"] = [dy, *(jnp.copy(dy) for _ in range(self.copies - 1))]
        return self._made["jax_dy"]

    def torch(self, torch) -> list[tuple]:
        def upload(a, dtype):
            return torch.from_numpy(a).to("cuda", getattr(torch, dtype))

        return self._sets("torch", upload, lambda t: t.clone())

    def cupy_transposed(self, cp) -> list[tuple]:
        """(kernelᵀ, xᵀ, bias) as column-major CuPy views of the row-major data, so that
        cuBLASLt's (N×K)·(K×M) product is yᵀ and its per-row bias is our (N,) bias."""
        x, w, b = self.host
        upload = partial(_cupy_upload, cp)
        return self._sets("cupy", upload, partial(_cupy_clone, cp), operands=(w.T, x.T, b))


# CuPy arrays are built from raw bytes, as in forward.time_nvmath: CuPy has no bfloat16
# conversions or copy kernels of its own.
def _cupy_upload(cp, host: np.ndarray, dtype: str):
    """host (contiguous in either order) on the device with the same shape and strides."""
    data = host.astype(_np_dtype(dtype), order="K")
    raw = cp.asarray(np.ravel(data, order="K").view(np.uint8))
    return cp.ndarray(data.shape, data.dtype, raw.data, strides=data.strides)


def _cupy_clone(cp, a):
    raw = cp.empty(a.nbytes, cp.uint8)
    raw.data.copy_from_device(a.data, a.nbytes)
    return cp.ndarray(a.shape, a.dtype, raw.data, strides=a.strides)


# ----------------------------------------------------------------------------- contenders


class Skip(Exception):
    """A contender cannot run here; the message says why."""


def jax_program(case: Case, contender: str):
    """The un-jitted function a JAX contender times (``MODES``): forward, the gradient of
    a sum, or the output with its VJP (then called with the cotangent as a fourth input)."""
    if contender.startswith("jax_epilog"):
        options = {"activation": None if case.activation == "none" else case.activation}
        options["compute_type"] = case.compute_type
        if HAS_IMPLEMENTATION:  # "jax_epilog" is the fused kernel; "_auto" the measured rule
            options["implementation"] = "auto" if contender == "jax_epilog_auto" else "cublaslt"
        fwd = partial(fused_dense, **options)
    else:
        act = forward.activation_fn(case.activation)
        precision = None
        if case.dtype == "float32":  # the arithmetic fused_dense is asked for, not XLA's default
            tf32 = jax.lax.DotAlgorithmPreset.TF32_TF32_F32
            precision = tf32 if case.compute_type == TF32 else jax.lax.Precision.HIGHEST

        def fwd(x, w, b):
            return act(jnp.matmul(x, w, precision=precision) + b).astype(x.dtype)

    if case.mode == "fwd":
        return fwd
    if case.mode == "fwd+vjp":
        return forward.output_and_vjp(fwd)
    return jax.grad(lambda x, w, b: jnp.sum(fwd(x, w, b).astype(jnp.float32)), argnums=(0, 1, 2))


class HandlerCountingClock(WallClock):
    """The wall clock, also counting our FFI handler's runs between start and stop
    (stop waits for the outputs, so every run of the timed calls has happened)."""

    def __init__(self):
        self.runs = 0

    def start(self) -> None:
        self._runs0 = _ffi.handler_stats()[0]
        super().start()

    def stop(self, out) -> float:
        seconds = super().stop(out)
        self.runs += _ffi.handler_stats()[0] - self._runs0
        return seconds


def _jax_timed(case: Case, names: list[str], inputs: Inputs) -> list[tuple]:
    """(call, clock) for each JAX contender of a case; the clocks count handler runs."""
    sets = inputs.jax()
    if case.mode == "fwd+vjp":
        sets = [(*operands, dy) for operands, dy in zip(sets, inputs.jax_cotangents())]
    programs = [
        jax.jit(jax_program(case, name))
        .lower(*sets[0])
        .compile(compiler_options=CUBLASLT_OPTIONS if name == "xla_cublaslt" else None)
        for name in names
    ]
    return [(lambda i, p=p: p(*sets[i % len(sets)]), HandlerCountingClock()) for p in programs]


def _import_torch():
    try:
        import torch
    except ImportError as exc:
        raise Skip(f"torch is not importable ({exc})") from None
    if not torch.cuda.is_available():
        raise Skip("torch has no CUDA device")
    return torch


def torch_program(torch, contender: str, activation: str):
    F = torch.nn.functional
    act = {"relu": torch.relu, "gelu": partial(F.gelu, approximate="tanh"), "none": lambda z: z}[activation]
    if contender == "torch_matmul_add":  # three kernels (two without an activation)
        return lambda x, w, b: act(torch.matmul(x, w) + b).to(x.dtype)  # .to: a no-op unless b is wider
    if contender == "torch_linear":
        return lambda x, w, b: act(F.linear(x, w.t(), b))  # w.t() is a view: linear wants (N, K)
    if activation == "none":
        return lambda x, w, b: torch.addmm(b, x, w)  # _addmm_activation always applies one
    use_gelu = activation == "gelu"
    return lambda x, w, b: torch._addmm_activation(b, x, w, use_gelu=use_gelu)


@contextlib.contextmanager
def torch_timed(case: Case, contender: str, inputs: Inputs):
    """(call, clock) for a PyTorch contender: eager ops on torch's current stream."""
    torch = _import_torch()
    program = torch_program(torch, contender, case.activation)
    sets = inputs.torch(torch)
    clock = EventClock(partial(torch.cuda.Event, enable_timing=True), lambda a, b: a.elapsed_time(b))
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = case.compute_type == TF32
    try:
        with torch.no_grad():
            yield (lambda i: program(*sets[i % len(sets)])), clock
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before


NVMATH_EPILOG = {"relu": "RELU_BIAS", "gelu": "GELU_BIAS", "none": "BIAS"}


@contextlib.contextmanager
def nvmath_timed(case: Case, contender: str, inputs: Inputs):
    """(call, clock) for nvmath's stateful Matmul, planned once per input set and executed
    back to back: the forward benchmark's nvmath row (forward.time_nvmath) for every case."""
    try:
        import cupy as cp
        from nvmath.linalg.advanced import Matmul, MatmulComputeType, MatmulEpilog
    except ImportError as exc:
        raise Skip(f"nvmath-python or cupy is not importable ({exc})") from None
    options = {"compute_type": MatmulComputeType[case.compute_type]} if case.compute_type else None
    epilog = MatmulEpilog[NVMATH_EPILOG[case.activation]]
    plans = []
    try:
        for w_t, x_t, b in inputs.cupy_transposed(cp):
            plans.append(Matmul(w_t, x_t, options=options))
            plans[-1].plan(epilog=epilog, epilog_inputs={"bias": b})
        clock = EventClock(cp.cuda.Event, cp.cuda.get_elapsed_time)
        yield (lambda i: plans[i % len(plans)].execute()), clock
    finally:
        for mm in plans:
            mm.free()


BENCH = {"nvmath": nvmath_timed, **{name: torch_timed for name in TORCH}}  # not JAX: own timers


ROW_CASE_FIELDS = ("shape", "m", "k", "n", "dtype", "bias_dtype", "compute_type", "activation", "mode")


def make_row(case: Case, contender: str, timing: Timing | None = None, skipped: str | None = None, **extra):
    row = {field: getattr(case, field) for field in ROW_CASE_FIELDS}
    row.update(contender=contender, us=None, samples=0, tflops=None, skipped=skipped)
    if timing is not None:
        row.update(us=timing.us, samples=timing.samples, iters=timing.iters, tflops=tflops(case, timing.us))
    row.update(extra)
    return row


def failure_reason(exc: BaseException) -> str:
    """The last line of a traceback: the exception's type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def run_one(case: Case, contender: str, inputs: Inputs, settings: Settings) -> dict:
    """Time one contender on one case; any failure becomes a row with its reason."""
    return run_group(case, [contender], inputs, settings)[0]


def run_group(case: Case, names: list[str], inputs: Inputs, settings: Settings) -> list[dict]:
    """Time contenders on one case, all of them interleaved (benchmarks/timing.py): the GPU's
    clocks under sustained load then touch every contender alike. A contender that cannot
    start (not importable, refused) becomes a row with its reason; a group that fails while
    timing is retried one contender at a time, so one failure does not take the others'
    rows with it."""
    rows: dict[str, dict] = {}
    try:
        with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FastPathWarning)
            jax_names = [name for name in names if name not in BENCH]
            timed = dict(zip(jax_names, _jax_timed(case, jax_names, inputs) if jax_names else []))
            for name in names:
                if name in BENCH:
                    try:
                        timed[name] = stack.enter_context(BENCH[name](case, name, inputs))
                    except Exception as exc:  # noqa: BLE001 -- this contender's row says why
                        rows[name] = make_row(case, name, skipped=_reason(exc))
            running = [name for name in names if name in timed]
            timings = measure_interleaved([timed[name] for name in running], settings)
            fell_back = [str(w.message) for w in caught if issubclass(w.category, FastPathWarning)]
        for name, timing in zip(running, timings):
            extra = {}
            if name.startswith("jax_epilog"):
                extra["handler_runs"] = timed[name][1].runs
                if fell_back and name == "jax_epilog":  # the one that always asks for the fused path
                    extra["note"] = fell_back[0]
            rows[name] = make_row(case, name, timing, **extra)
    except Exception as exc:  # noqa: BLE001 -- one failing contender must not end the run
        if len(names) > 1:
            return [row for name in names for row in run_group(case, [name], inputs, settings)]
        return [make_row(case, names[0], skipped=_reason(exc))]
    return [rows[name] for name in names]


def _reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, Skip) else failure_reason(exc)


class Progress:
    def __init__(self, total: int, prefix: str = ""):
        self.total, self.done, self.prefix = total, 0, prefix

    def report(self, label: str, result: str) -> None:
        self.done += 1
        print(f"[{self.prefix}{self.done}/{self.total}] {label}: {result}", flush=True)


def _ct(case: Case) -> str:
    return f" {case.compute_type}" if case.compute_type else ""


def describe(row: dict) -> str:
    if row["skipped"]:
        return f"skipped: {row['skipped']}"
    return f"{row['us']:.1f} µs, {_tf(row['tflops'])} TF/s ({row['samples']} x {row['iters']} calls)"


def _case_group(todo: list[tuple[Case, str]], start: int) -> list[str]:
    """The contenders of todo[start]'s case that follow it: they are timed together."""
    case, names = todo[start][0], []
    for other, name in todo[start:]:
        if other != case:
            break
        names.append(name)
    return names


def run_jobs(todo: list[tuple[Case, str]], settings: Settings, progress: Progress, on_row=None) -> list[dict]:
    """Every job, in order; a case's consecutive contenders are timed interleaved."""
    rows, inputs, i = [], None, 0
    while i < len(todo):
        case = todo[i][0]
        problem = (case.m, case.k, case.n, case.dtype, case.bias_dtype)
        if inputs is None or inputs.problem != problem:
            # Host data is reused across dtypes; the last problem's device copies are
            # dropped before the next are made.
            same_shape = inputs is not None and inputs.problem[:3] == problem[:3]
            host = inputs.host if same_shape else None
            inputs = None
            inputs = Inputs(case, host)
        names = _case_group(todo, i)
        for row in run_group(case, names, inputs, settings):
            rows.append(row)
            progress.report(
                f"{case.shape} {case.dtype}{_ct(case)} {case.activation} {case.mode} {row['contender']}",
                describe(row),
            )
            if on_row is not None:
                on_row(rows)
        i += len(names)
    return rows


# ------------------------------------------------------------------- ceilings, host cost


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


def guarded(bench, *args) -> dict:
    """bench(*args), or {"skipped": reason} if it fails: the rest of the run goes on."""
    try:
        return bench(*args)
    except Exception as exc:  # noqa: BLE001
        print(f"{bench.__name__} failed: {failure_reason(exc)}", flush=True)
        return {"skipped": failure_reason(exc)}


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


def _handler_since(before: tuple[int, int, int]) -> tuple[int, float | None]:
    runs, ns, _ = _ffi.handler_stats()
    count = runs - before[0]
    return count, ((ns - before[1]) / count / 1e3 if count else None)


def _repeat(layer, steps: int):
    """One jitted call that applies the same layer ``steps`` times in a loop."""

    def f(x, w, b):
        return jax.lax.fori_loop(0, steps, lambda _, y: layer(y, w, b), x)

    return jax.jit(f)


HOST_STEPS, CHAIN_DEPTH = 64, 16
N_CEILING, N_HOST = 2, 4 + 2 * 4 * 2  # measurements, for the progress counter


def _chain_step(layer, weights: str, x, ws, bs):
    """One step of a CHAIN_DEPTH-layer chain as its variant calls it: ``x = chain(x, ...)``
    with x donated, ``chain(x, ...)`` with the previous result released first, or plain."""
    if weights.endswith("donated"):
        return forward.feedback(forward.chain(layer, CHAIN_DEPTH, donate=True), x, ws, bs)
    program = forward.chain(layer, CHAIN_DEPTH)
    if weights.endswith("released"):
        return forward.released(program, x, ws, bs)
    return partial(program, x, ws, bs)


def plan_states() -> dict:
    """The autotuner's choice and the replay state of every plan this process made (empty
    without nvmath-python): which algorithm each timing ran, for comparing runs."""
    try:
        from jax_epilog import _nvmath
    except ImportError:
        return {}
    return {"tuned": forward.tuning_choices(_nvmath._plans), "replay": forward.replay_states(_nvmath._plans)}


def bench_host(settings: Settings, scale: int, progress: Progress, on_gpu: bool) -> dict:
    m, k = 256 // scale, 1024 // scale
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32), jnp.bfloat16)
    ws = jnp.asarray(rng.standard_normal((CHAIN_DEPTH, k, k), dtype=np.float32) / np.sqrt(k), jnp.bfloat16)
    bs = jnp.asarray(rng.standard_normal((CHAIN_DEPTH, k), dtype=np.float32), jnp.bfloat16)
    # forward.single_layers' pair under the suite's contender names.
    layers = {
        name: lambda act, key=key: forward.single_layers(act)[key]
        for name, key in (("jax_epilog", "fused"), ("xla", "xla"))
    }
    w, b = ws[0], bs[0]  # sliced once: a slice inside the timed loop would be a dispatch of its own
    single = []
    for name, layer in layers.items():
        relu = layer("relu")
        for what, program, steps in (
            ("python loop of jitted calls", jax.jit(relu), 1),
            (f"lax.fori_loop({HOST_STEPS}) in one jit", _repeat(relu, HOST_STEPS), HOST_STEPS),
        ):
            before = _ffi.handler_stats()
            t = measure(lambda i, p=program: p(x, w, b), WallClock(), settings)
            runs, host_us = _handler_since(before)
            single.append(
                {"what": what, "contender": name, "us_per_call": t.us / steps, "calls": t.calls * steps}
                | {"handler_runs": runs, "handler_host_us": host_us}
            )
            progress.report(f"host: {m}x{k}->{k} relu {name}, {what}", f"{t.us / steps:.1f} µs per call")
    # Weights stacked in one array and sliced in the jit (XLA folds the slices into the
    # custom call), or one array per layer as Flax's layers hold them: XLA compiles its own
    # chain differently for the two (benchmarks/README.md, "Chains"). "result released":
    # the stacked chain with each step's result deleted before the next call; "x donated":
    # called as x = chain(x, ...), a training loop's pattern. In both every step runs on the
    # same buffers and XLA launches its recorded graph without updating it.
    layouts = {
        "stacked": (ws, bs), "per-layer": (tuple(ws), tuple(bs)),
        "stacked, result released": (ws, bs), "stacked, x donated": (ws, bs),
    }  # fmt: skip
    chains = []
    for act in RELU_GELU:
        for weights, (w_arg, b_arg) in layouts.items():
            entry = {"layers": CHAIN_DEPTH, "shape": f"{m}x{k}->{k}", "activation": act, "weights": weights}
            steps = [_chain_step(layers[name](act), weights, x, w_arg, b_arg) for name in layers]
            calls = [lambda i, s=s: s() for s in steps]
            clocks = [HandlerCountingClock() for _ in layers]
            before = _ffi.handler_stats()
            timings = measure_interleaved(list(zip(calls, clocks)), settings)
            _, host_us = _handler_since(before)
            for name, t, clock in zip(layers, timings, clocks):
                entry[f"{name}_us"] = t.us
                if name == "jax_epilog":
                    layer_runs = t.calls * CHAIN_DEPTH
                    verdict = command_buffer_verdict(clock.runs, layer_runs, on_gpu)
                    entry.update(
                        handler_runs=clock.runs, layer_runs=layer_runs, handler_host_us=host_us,
                        command_buffers=verdict,
                    )  # fmt: skip
                progress.report(
                    f"host: chain of {CHAIN_DEPTH} {m}x{k}->{k} {act}, {weights} weights, {name}",
                    f"{t.us:.1f} µs per step",
                )
            chains.append(entry)
    return {"single": single, "chain": chains}


# ------------------------------------------------------------------------- results files


def environment() -> dict:
    import jaxlib

    info = forward.versions()
    info.update(jaxlib=jaxlib.__version__, platform=platform.platform())
    info["driver"] = driver_version()
    try:
        import torch

        info["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except ImportError:
        info["torch"] = None
    info["jax_epilog_implementation_kw"] = HAS_IMPLEMENTATION
    return info


def driver_version() -> str | None:
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        smi = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = smi.stdout.split()
    return lines[0] if lines else None


def gpu_slug(device_kind: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    slug = re.sub(r"[^a-z0-9._]+", "-", device_kind.lower())  # spaces and anything odd
    return slug.strip("-") or "device"


def results_stem(out_dir: str, device_kind: str, today: datetime.date | None = None) -> str:
    today = today or datetime.datetime.now(datetime.UTC).date()
    return os.path.join(out_dir, f"{today.isoformat()}-{gpu_slug(device_kind)}")


def _f(value, digits=1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _tf(value: float) -> str:
    """TFLOP/s with about three significant digits."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def table_key(row: dict) -> tuple:
    return (row["dtype"], row["bias_dtype"], row.get("compute_type"), row["mode"])


def table_title(key: tuple) -> str:
    dtype, bias_dtype, compute_type, mode = key
    ct = f", {compute_type}" if compute_type else ""
    return f"{dtype} ({bias_dtype} bias{ct}), {mode}"


def group_rows(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows by table (dtype, bias dtype, compute type, mode), in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(table_key(row), []).append(row)
    return groups


def ordered_unique(values) -> list:
    return list(dict.fromkeys(values))


def speedup(by_contender: dict[str, dict], contender: str, baseline: str = "xla") -> float | None:
    """baseline µs / contender µs for one case (above 1: the contender is faster)."""
    a, b = by_contender.get(contender), by_contender.get(baseline)
    if not a or not b or a["us"] is None or b["us"] is None:
        return None
    return b["us"] / a["us"]


def _markdown_table(rows: list[dict]) -> list[str]:
    names = ordered_unique(r["contender"] for r in rows)
    lines = _md_header("M×K→N", "act", *(f"{n} µs (TF/s)" for n in names), "fused/XLA speed-up")
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["shape"], r["activation"]), {})[r["contender"]] = r
    for (shape, act), by in cases.items():
        cells = []
        for name in names:
            r = by.get(name)
            cells.append("—" if r is None or r["us"] is None else f"{r['us']:.1f} ({_tf(r['tflops'])})")
        ratio = speedup(by, "jax_epilog")
        lines.append(_md_row(shape, act, *cells, f"{_f(ratio, 2)}{'×' if ratio else ''}"))
    reasons = ordered_unique(f"{r['contender']}: {r['skipped']}" for r in rows if r["skipped"])
    if reasons:
        lines += ["", "Skipped (—): " + "; ".join(reasons)]
    notes = ordered_unique(
        f"{r['contender']} {r['shape']} {r['activation']}: {r['note']}" for r in rows if r.get("note")
    )
    if notes:
        lines += ["", "Notes: " + "; ".join(notes)]
    return lines


def _md_row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _md_header(*names) -> list[str]:
    return [_md_row(*names), "|" + "---|" * len(names)]


def _ceiling_lines(ceiling: dict) -> list[str]:
    lines = ["## Machine ceiling (measured in this run)", ""]
    if "skipped" in ceiling:
        return [*lines, f"Not measured: {ceiling['skipped']}"]
    mm, copy = ceiling["matmul"], ceiling["copy"]
    return [
        *lines,
        *_md_header("what", "µs", "rate"),
        _md_row(f"{mm['shape']} {mm['dtype']} matmul, jit", _f(mm["us"]), f"{_f(mm['tflops'])} TF/s"),
        _md_row(
            f"{copy['what']}, {copy['bytes'] >> 20} MiB",
            _f(copy["us"]),
            f"{_f(copy['gbps'], 0)} GB/s (read+write)",
        ),
    ]


def _host_lines(host: dict) -> list[str]:
    lines = ["## Host cost per call", ""]
    if "skipped" in host:
        return [*lines, f"Not measured: {host['skipped']}"]
    lines += _md_header("what", "contender", "µs per call", "handler runs / calls", "handler host µs per run")
    for h in host["single"]:
        runs = f"{h['handler_runs']} / {h['calls']}"
        lines.append(_md_row(h["what"], h["contender"], _f(h["us_per_call"]), runs, _f(h["handler_host_us"])))
    lines += [""] + _md_header(
        "chain", "act", "weights", "fused_dense µs/step", "XLA µs/step", "XLA/fused", "handler runs / layer runs",
        "handler host µs per run", "command buffers",
    )  # fmt: skip
    for c in host["chain"]:
        ratio = f"{_f(c['xla_us'] / c['jax_epilog_us'], 2)}×"
        runs = f"{c['handler_runs']} / {c['layer_runs']}"
        chain = f"{c['layers']}× {c['shape']}"
        times = (_f(c["jax_epilog_us"]), _f(c["xla_us"]), ratio)
        weights = c.get("weights", "stacked")
        lines.append(
            _md_row(
                chain, c["activation"], weights, *times, runs, _f(c["handler_host_us"]), c["command_buffers"]
            )
        )
    return lines


def auto_vs_xla(rows: list[dict]) -> dict | None:
    """How "auto" compares with XLA's jit, and the noise to read that against.

    Where "auto" ran XLA's own program (our handler never ran), its row and the "xla" row
    time the same executable, interleaved: their difference is the measurement's noise.
    Where it fused a forward pass, it ran the very program of "jax_epilog" (the same custom
    call and plan), listed just before it: that pair's difference is noise too, and at a
    power-limited size the contender listed first timed faster whichever it was
    (benchmarks/probes/round_order.py).
    """
    pairs = {}
    for r in rows:
        if r["contender"] in ("xla", "jax_epilog_auto", "jax_epilog") and r["us"] is not None:
            pairs.setdefault(row_key(r), {})[r["contender"]] = r
    ratios, same_program, fused_pair = [], [], []
    for by in pairs.values():
        auto = by.get("jax_epilog_auto")
        if auto is None:
            continue
        label = f"{auto['shape']} {auto['dtype']} {auto['activation']} {auto['mode']}"
        fused = by.get("jax_epilog")
        if fused and auto["mode"] == "fwd" and auto.get("handler_runs"):
            fused_pair.append((auto["us"] / fused["us"], label))
        if "xla" not in by:
            continue
        ratio = by["xla"]["us"] / auto["us"]
        ratios.append((ratio, label))
        if auto.get("handler_runs") == 0:
            same_program.append(abs(ratio - 1))
    if not ratios:
        return None
    worst = min(ratios)
    gaps = [abs(ratio - 1) for ratio, _ in fused_pair]
    return {
        "cases": len(ratios),
        "worst_ratio": worst[0],
        "worst_case": worst[1],
        "same_program_cases": len(same_program),
        "noise_median": statistics.median(same_program) if same_program else None,
        "noise_max": max(same_program) if same_program else None,
        "fused_pair_cases": len(fused_pair),
        "fused_pair_median": statistics.median(gaps) if gaps else None,
        "fused_pair_max": max(fused_pair, key=lambda p: abs(p[0] - 1)) if fused_pair else None,
        "fused_pair_first_faster": sum(ratio > 1 for ratio, _ in fused_pair),
    }


def _auto_lines(summary: dict | None) -> list[str]:
    if not summary:
        return []
    s = summary
    lines = [
        '## "auto" against XLA', "",
        (f'Slowest "auto" case against XLA\'s jit: {s["worst_ratio"]:.3f}× ({s["worst_case"]}), '
         f'over {s["cases"]} cases (XLA µs / auto µs; below 1: auto is slower).'),
    ]  # fmt: skip
    if s["same_program_cases"]:
        lines.append(
            f'Noise: in {s["same_program_cases"]} cases "auto" ran XLA\'s own program (the handler never ran), '
            f"so its row and the xla row time one executable; they differ by {s['noise_median'] * 100:.1f}% "
            f"(median), {s['noise_max'] * 100:.1f}% at most."
        )
    if s.get("fused_pair_cases"):
        ratio, case = s["fused_pair_max"]
        lines.append(
            f'In {s["fused_pair_cases"]} forward cases "auto" fused the layer and so ran the program of '
            f"jax_epilog, listed just before it: they differ by {s['fused_pair_median'] * 100:.1f}% (median), "
            f"{abs(ratio - 1) * 100:.1f}% at most ({case}: auto / jax_epilog µs {ratio:.3f}); "
            f"jax_epilog, listed first, was the faster in {s['fused_pair_first_faster']}. "
            "Read ratios of that size as noise."
        )
    return lines


def render_markdown(results: dict) -> str:
    v, st = results["versions"], results.get("settings", {})
    shown = ("jax", "jaxlib", "python", "driver", "cublasLt", "nvmath", "cupy", "torch")
    options = v.get("xla_cublaslt_options") or {}
    also = ", ".join(f"{k}={val}" for k, val in options.items())
    flags = f"XLA_FLAGS '{v.get('XLA_FLAGS', '')}'" + (
        f" (xla_cublaslt: compiled with {also})" if also else ""
    )
    method = (
        f"Each cell: median µs per call over {st.get('samples', '?')} samples (each at least "
        f"{st.get('min_calls', '?')} back-to-back calls and {st.get('sample_s', 0) * 1e3:.0f} ms), then "
        "TFLOP/s in brackets (2·M·N·K per forward, 6·M·N·K with the backward). "
        "Speed-up: XLA jit µs / fused_dense µs (above 1: fused_dense is faster)."
    )
    lines = [
        f"# jax_epilog benchmark suite: {v.get('gpu')}, {results.get('date')}",
        "",
        f"Command: `{shlex.join(results['command'])}`",
        "",
        "Versions: " + ", ".join(f"{name} {v.get(name)!s}" for name in shown if name in v) + f"; {flags}",
        "",
        method,
    ]
    for key, rows in group_rows(results["rows"]).items():
        lines += ["", f"## {table_title(key)}", "", *_markdown_table(rows)]
    lines += ["", *_auto_lines(auto_vs_xla(results["rows"]))]
    if results.get("ceiling"):
        lines += ["", *_ceiling_lines(results["ceiling"])]
    if results.get("host"):
        lines += ["", *_host_lines(results["host"])]
    return "\n".join(lines) + "\n"


def write_results(results: dict, stem: str) -> tuple[str, str]:
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    json_path, md_path = f"{stem}.json", f"{stem}.md"
    with open(json_path, "w") as fh:
        json.dump(results, fh, indent=1)
    with open(md_path, "w") as fh:
        fh.write(render_markdown(results))
    return json_path, md_path


# ------------------------------------------------------------------------------ the plan, told


SETUP_S = {"fwd": 0.3, "fwd+bwd": 0.8, "fwd+vjp": 0.8}  # compiling a JAX contender, by mode
PEAK = {"float32": 50e12, TF32: 400e12}  # what --dry-run assumes; half precision 600 TF/s


def estimate_s(case: Case, contender: str, settings: Settings) -> float:
    """A rough H200 wall time for one measurement: compile or plan, warm-up, batches."""
    peak = PEAK.get(case.compute_type or case.dtype, 600e12)
    per_call = max(flops(case) / peak, 60e-6 if contender == "nvmath" else 15e-6)
    batch = max(settings.sample_s, settings.min_calls * per_call)
    setup = SETUP_S[case.mode] if "jax" in contender or "xla" in contender else 0.1
    return setup + (settings.samples + 1) * batch + settings.warmup * per_call


def inputs_s(case: Case) -> float:
    """Making one problem's inputs: host random numbers, a cast and upload per framework."""
    return (case.m * case.k + case.k * case.n) * 3 / 40e6


def estimate_total_s(todo: list[tuple[Case, str]], settings: Settings) -> float:
    """The measurements, each problem's inputs, and the ceiling and host-cost sections."""
    problems = {(c.m, c.k, c.n, c.dtype, c.bias_dtype): inputs_s(c) for c, _ in todo}
    return sum(estimate_s(c, name, settings) for c, name in todo) + sum(problems.values()) + 30


def summary(todo: list[tuple[Case, str]], settings: Settings) -> str:
    return (
        f"{len(todo)} measurements + {N_CEILING} ceiling + {N_HOST} "
        f"host-cost; estimated H200 wall time ~{estimate_total_s(todo, settings) / 60:.1f} min (GEMMs at "
        f"600 TF/s in half precision, {PEAK[TF32] / 1e12:.0f} TF32, {PEAK['float32'] / 1e12:.0f} float32; "
        "at least 15 µs per call)"
    )


def print_plan(todo: list[tuple[Case, str]], settings: Settings) -> None:
    for i, (case, contender) in enumerate(todo, 1):
        what = f"{case.shape} {case.dtype}/{case.bias_dtype} bias{_ct(case)} {case.activation} {case.mode}"
        est = estimate_s(case, contender, settings)
        print(f"[{i}/{len(todo)}] {what} {contender} (~{est:.2f} s, {input_copies(case)} input sets)")
    print(summary(todo, settings))


# ---------------------------------------------------------------------------------- main


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the short plan (default; ~2 min on an H200)")
    size.add_argument(
        "--full", action="store_true", help="every shape, dtype and activation (~9 min in 2026-12-03's runs)"
    )
    parser.add_argument(
        "--out", default="benchmarks/results", help="folder for the results (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype", nargs="+", choices=DTYPES, default=DTYPES, help="only the cases of these operand dtypes"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="list the measurements and an estimate; time nothing"
    )
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="shapes / 64, 2 samples of 2 calls: runs on a CPU"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    settings = SMOKE if args.cpu_smoke else FULL if args.full else QUICK
    scale = 64 if args.cpu_smoke else 1
    todo = jobs([shrink(case, scale) for case in plan(args.full) if case.dtype in args.dtype])
    if args.dry_run:
        print_plan(todo, settings)
        return None
    print(summary(todo, settings), flush=True)
    progress = Progress(len(todo) + N_CEILING + N_HOST)
    on_gpu = jax.devices()[0].platform == "gpu"
    ceiling = guarded(bench_ceiling, settings, scale, progress)
    rows = run_jobs(todo, settings, progress)
    host = guarded(bench_host, settings, scale, progress, on_gpu)
    versions = environment()
    versions["xla_cublaslt_options"] = CUBLASLT_OPTIONS
    today = datetime.datetime.now(datetime.UTC).date()
    results = {
        "date": today.isoformat(),
        "versions": versions,
        "command": ["python", "-m", "benchmarks.run", *argv],
        "settings": asdict(settings),
        "rows": rows,
        "auto_vs_xla": auto_vs_xla(rows),
        "ceiling": ceiling,
        "host": host,
        "plans": plan_states(),
    }
    stem = results_stem(args.out, str(jax.devices()[0].device_kind), today)
    json_path, md_path = write_results(results, stem)
    print(f"wrote {json_path}\nwrote {md_path}", flush=True)
    try:
        from benchmarks import plot

        for path in plot.make_plots(json_path):
            print(f"wrote {path}", flush=True)
    except Exception as exc:  # noqa: BLE001 -- ImportError without matplotlib; the results are saved
        hint = "once matplotlib is installed" if isinstance(exc, ImportError) else "to retry"
        print(f"no plots ({failure_reason(exc)}); {hint}: python -m benchmarks.plot {json_path}", flush=True)
    return results


if __name__ == "__main__":
    main()
