"""The suite's contenders on one case: their inputs, and a (call, clock) pair for each.

JAX contenders: ``fused_dense`` with ``implementation="cublaslt"`` ("jax_epilog") and its
default "auto" ("jax_epilog_auto"); XLA's jit of ``act(x @ w + b)`` with default options
("xla") and compiled with ``xla_gpu_enable_cublaslt`` on ("xla_cublaslt": what
``XLA_FLAGS=--xla_gpu_enable_cublaslt=true`` sets for a whole process, for this program
alone, so it is timed in turns with the others). Forward only: PyTorch eager in three
spellings and nvmath-python's ``Matmul`` from CuPy with the same epilog. A contender that
cannot start raises ``Skip`` with the reason.
"""

from __future__ import annotations

import contextlib
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.cases import TF32, Case, input_copies
from benchmarks.common import HandlerClock, activation_fn, output_and_vjp
from benchmarks.timing import EventClock
from jax_epilog import fused_dense

CUBLASLT_OPTIONS = {"xla_gpu_enable_cublaslt": True}
TORCH = ("torch_matmul_add", "torch_linear", "torch_addmm_act")


def contenders(mode: str) -> list[str]:
    """Every contender of a case in ``mode``, in the order they are listed (and timed)."""
    names = ["jax_epilog", "jax_epilog_auto", "xla", "xla_cublaslt"]
    return names + ([*TORCH, "nvmath"] if mode == "fwd" else [])


def jobs(cases: list[Case]) -> list[tuple[Case, str]]:
    return [(case, name) for case in cases for name in contenders(case.mode)]


class Skip(Exception):
    """A contender cannot run here; the message says why."""


# ---------------------------------------------------------------------------------- inputs


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
    list of ``copies`` distinct device copies of the same values (by default
    ``input_copies(case)``), uploaded once and copied on the device."""

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
        """dy ~ N(0, 1) of shape (m, n) in the operands' dtype, a copy per input set."""
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
        return self._sets("cupy", partial(_cupy_upload, cp), partial(_cupy_clone, cp), operands=(w.T, x.T, b))


# CuPy arrays are built from raw bytes: CuPy has no bfloat16 conversions or copy kernels.
def _cupy_upload(cp, host: np.ndarray, dtype: str):
    """host (contiguous in either order) on the device with the same shape and strides."""
    data = host.astype(_np_dtype(dtype), order="K")
    raw = cp.asarray(np.ravel(data, order="K").view(np.uint8))
    return cp.ndarray(data.shape, data.dtype, raw.data, strides=data.strides)


def _cupy_clone(cp, a):
    raw = cp.empty(a.nbytes, cp.uint8)
    raw.data.copy_from_device(a.data, a.nbytes)
    return cp.ndarray(a.shape, a.dtype, raw.data, strides=a.strides)


# ------------------------------------------------------------------------------------ JAX


def jax_program(case: Case, contender: str):
    """The un-jitted function a JAX contender times: the forward, the gradient of a sum,
    or the output with its VJP (then called with the cotangent as a fourth input)."""
    if contender.startswith("jax_epilog"):
        implementation = "auto" if contender == "jax_epilog_auto" else "cublaslt"
        activation = None if case.activation == "none" else case.activation
        fwd = partial(
            fused_dense, activation=activation, compute_type=case.compute_type, implementation=implementation
        )
    else:
        act = activation_fn(case.activation)
        precision = None
        if case.dtype == "float32":  # the arithmetic fused_dense is asked for, not XLA's default
            precision = (
                jax.lax.DotAlgorithmPreset.TF32_TF32_F32
                if case.compute_type == TF32
                else jax.lax.Precision.HIGHEST
            )

        def fwd(x, w, b):
            return act(jnp.matmul(x, w, precision=precision) + b).astype(x.dtype)

    if case.mode == "fwd":
        return fwd
    if case.mode == "fwd+vjp":
        return output_and_vjp(fwd)
    return jax.grad(lambda x, w, b: jnp.sum(fwd(x, w, b).astype(jnp.float32)), argnums=(0, 1, 2))


def jax_timed(case: Case, names: list[str], inputs: Inputs) -> list[tuple]:
    """(call, clock) for each JAX contender of a case, compiled now; the clocks count the
    FFI handler's runs."""
    sets = inputs.jax()
    if case.mode == "fwd+vjp":
        sets = [(*operands, dy) for operands, dy in zip(sets, inputs.jax_cotangents())]
    programs = [
        jax.jit(jax_program(case, name))
        .lower(*sets[0])
        .compile(compiler_options=CUBLASLT_OPTIONS if name == "xla_cublaslt" else None)
        for name in names
    ]
    return [(lambda i, p=p: p(*sets[i % len(sets)]), HandlerClock()) for p in programs]


# ------------------------------------------------------------------------ PyTorch, nvmath


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
    """(call, clock) for nvmath's stateful Matmul, planned once per input set (its own
    first heuristic choice) and executed back to back."""
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
