"""Shared test helpers: activations and dtypes by name, ReLU's derivative from the op's own
mask near the kink (test_dense.py and the GPU tests), comparing a fused layer with its
Flax twin (test_linen.py, test_nnx.py), the GEMMs and primitives in a jaxpr, and the
custom calls of a program lowered for "cuda" (tests/primitives/, test_padding.py). No
Flax import here."""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from tolerances import epilog_slack, tolerance

import jax_epilog
from jax_epilog.cuda.ffi import EAGER_TARGET_NAME, TARGET_NAME

# Each activation's twin: what a plain JAX layer applies after its matmul. A new activation
# of the epilog table needs its twin here; the parametrized tests then cover it.
TWINS = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=True)}
ACTIVATIONS = [None, *(a.value for a in jax_epilog.Activation)]
# An ensemble: vmap over stacked weights. Which of (x, kernel, bias) are per member (0) or
# shared (None) (tests/primitives/test_members.py).
ENSEMBLES = {"all per member": (0, 0, 0), "x shared": (None, 0, 0), "kernel shared": (0, None, 0), "bias shared": (0, 0, None)}  # fmt: skip
ON_GPU = jax.default_backend() == "gpu"
# The primitives' names in a jaxpr.
FUSED = "jax_epilog_fused_matmul"
WEIGHT_GRAD = "jax_epilog_fused_weight_grad"
GELU_INPUT_GRAD = "jax_epilog_fused_gelu_input_grad"
MEMBERS = "jax_epilog_members"
# Largest error allowed, relative to the reference's largest entry (and elementwise rtol).
# On a GPU the twin's float32 matmuls may run in TF32 (XLA's DEFAULT precision) and
# cuBLASLt's GELU epilog uses a fast tanh (~2**-11 relative, tolerances.epilog_slack).
TOL = {"float64": 1e-12, "float32": 5e-3 if ON_GPU else 1e-5, "float16": 4e-3, "bfloat16": 2e-2}
# Gradients of the half dtypes: the twin rounds dz and the backward GEMMs' results to the
# operand dtype; fused_dense accumulates in float32 and rounds once.
GRAD_TOL = {"float64": 1e-12, "float32": 5e-3 if ON_GPU else 2e-5, "float16": 8e-3, "bfloat16": 5e-2}


def act_fn(name):
    """The activation a fused layer applies, as the twin applies it after the matmul."""
    return (lambda z: z) if name is None else TWINS[name]


def masked_relu(z, mask):
    """ReLU's value, with ``mask`` (from ``reference_relu_mask``) as its derivative."""
    return z * mask + jax.lax.stop_gradient(jax.nn.relu(z) - z * mask)


def relu_clear(z, dtype, k, *, acc_eps=None, factor=10.0, slack=0.0):
    """Positions whose sign the op's rounding cannot flip: |z| > factor * atol of the dtype
    (plus twice the GPU epilog's slack, see tolerances.epilog_slack)."""
    _, atol = tolerance(dtype, k, acc_eps=acc_eps)
    return np.abs(z) > factor * atol + 2 * slack


def reference_relu_mask(x, w, b, dtype, epilog_dtype=None):
    """ReLU's derivative for a reference VJP: z > 0 from the float64 z of the cast inputs.

    Within rounding of the kink (``relu_clear``: |z| up to 10 atol of the dtype plus twice
    the GPU epilog's slack) a GPU epilog that rounds z before taking its sign may
    legitimately disagree, so there (a few % of the entries for bfloat16 on a GPU,
    almost none on the CPU) the op's own bit is taken. Everywhere else the op's saved mask
    must equal z > 0, and those entries must be the large majority.
    """
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if b is not None:
        z = z + np.asarray(b, np.float64)
    clear = relu_clear(z, dtype, w.shape[0], slack=epilog_slack(epilog_dtype or dtype, z, b))
    if z.size >= 64:  # the check must not pass vacuously
        assert clear.mean() > 0.9, f"only {clear.mean():.2%} of signs are clear of rounding"
    layer = functools.partial(
        jax_epilog.fused_dense, activation="relu", return_aux=True, implementation="cublaslt"
    )
    _, aux = jax.jit(layer)(x, w, b)
    op_mask = np.asarray(jax_epilog.unpack_relu_mask(aux, w.shape[1]), bool)
    mismatch = (op_mask != (z > 0)) & clear
    assert not mismatch.any(), (
        f"the op's ReLU mask differs from z > 0 at {int(mismatch.sum())} of {z.size} entries"
    )
    return np.where(clear, z > 0, op_mask).astype(np.float64)


def np_dtype(dtype) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dtype in ("bfloat16", jnp.bfloat16) else np.dtype(dtype)


def round_operand(a, compute_type: str):
    """A float32 operand as a COMPUTE_32F_FAST_* GEMM reads it: rounded (to nearest even)
    to float16, bfloat16 or TF32 (float32's exponent, 10 mantissa bits), as float64."""
    a = np.asarray(a, np.float32)
    if compute_type.endswith("16F"):
        return a.astype(np.float16).astype(np.float64)
    if compute_type.endswith("16BF"):
        return a.astype(ml_dtypes.bfloat16).astype(np.float64)
    bits = a.view(np.uint32).astype(np.uint64)
    bits = (bits + 0xFFF + ((bits >> 13) & 1)) >> 13 << 13
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def assert_near(actual, expected, tol, what="", scale=None):
    """``|actual - expected| <= tol * (scale + |expected|)`` elementwise; ``scale`` defaults
    to ``max|expected|``."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: {actual.shape} != {expected.shape}"
    if scale is None:
        scale = float(np.max(np.abs(expected), initial=0.0))
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol * max(scale, 1e-30), err_msg=what)


def grad_tol(compute_dtype, grad) -> float:
    """A gradient is computed at the compute dtype, then rounded to its own dtype."""
    return max(GRAD_TOL[np.dtype(compute_dtype).name], GRAD_TOL[np.dtype(grad.dtype).name])


def assert_same_tree(a, b, *, values=True):
    """Same structure (names), shapes and dtypes; with ``values``, bit-identical leaves."""
    assert jax.tree.structure(a) == jax.tree.structure(b), (jax.tree.structure(a), jax.tree.structure(b))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        name = jax.tree_util.keystr(path)
        assert x.shape == y.shape, name
        assert x.dtype == y.dtype, name
        if values:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)


def draw_x(rng, shape, kernel, bias, dtype, compute_dtype=None, margin=0.05):
    """Standard-normal inputs in ``dtype``, rows redrawn until no pre-activation (in float64
    from the operands cast to ``compute_dtype``) lies within ``margin`` of ReLU's kink, where
    either layer's rounding could flip the derivative."""
    compute_dtype = compute_dtype or dtype
    w = np.asarray(jnp.asarray(kernel, compute_dtype), np.float64)
    b = 0.0 if bias is None else np.asarray(jnp.asarray(bias, compute_dtype), np.float64)
    x = rng.standard_normal(shape).astype(np_dtype(dtype)).reshape(-1, shape[-1])
    for _ in range(200):
        z = np.asarray(jnp.asarray(x, compute_dtype), np.float64) @ w + b
        bad = (np.abs(z) < margin).any(axis=-1)
        if not bad.any():
            return x.reshape(shape)
        x[bad] = rng.standard_normal((int(bad.sum()), shape[-1])).astype(x.dtype)
    raise AssertionError("could not draw inputs clear of the ReLU kink")


def perturb(rng, tree):
    """Add standard-normal noise to every leaf (so that e.g. a zero-initialized bias matters)."""
    return jax.tree.map(lambda p: p + jnp.asarray(rng.standard_normal(p.shape), p.dtype), tree)


def assert_relatively_close(got, want, tol: float, what: str, scale: float | None = None) -> None:
    """The largest error at most ``tol`` of ``scale``: by default ``want``'s largest entry
    (``want`` in float64)."""
    want = np.asarray(want, np.float64)
    if scale is None:
        scale = np.abs(want).max()
    err = np.abs(np.asarray(got, np.float64) - want).max() / scale
    assert err <= tol, f"{what}: largest error {err:.3g} of {scale:.3g} > {tol}"


def np_gelu(z):
    """cuBLASLt's GELU (the tanh approximation) in NumPy."""
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


def oracle(x, w, b, activation):
    """``(act(z), z)`` in float64 from the *cast* inputs, z = x @ w + b."""
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if b is not None:
        z = z + np.asarray(b, np.float64)
    if activation is None:
        return z, z
    if activation == "relu":
        return np.maximum(z, 0.0), z
    return np_gelu(z), z


# The GPU tests' tolerances, relative to the output's scale (their inputs are O(1), the
# kernels scaled by 1/sqrt(K)).
GPU_TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5, "tf32": 4e-3}


def assert_scaled_close(y, expected, tol):
    """``|y - expected| <= tol * (max(1, max|expected|) + |expected|)`` elementwise."""
    y, expected = np.asarray(y, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(y, expected, rtol=tol, atol=tol * scale)


def device_array(a, dtype: str, shape, strides):
    """A CuPy view (GPU tests) of ``a``'s values in ``dtype`` with the given shape and
    element strides, built from raw bytes (CuPy cannot take bfloat16 through a typestr)."""
    import cupy as cp

    dt = np_dtype(dtype)
    host = np.ascontiguousarray(np.asarray(a, dt))
    raw = cp.asarray(host.view(np.uint8))
    return cp.ndarray(shape, dt, raw.data, tuple(s * dt.itemsize for s in strides))


def jaxpr_text(f, *args) -> str:
    """f's jaxpr as text, traced now (a new function each time: JAX caches a function's
    trace by its identity, so a function traced before an ``override_policy`` block would
    keep the program of the policy it was traced with)."""
    return str(jax.make_jaxpr(lambda *a: f(*a))(*args))


def dot_shapes(f, *args) -> list[tuple[int, ...]]:
    """The result shapes of f's dot_general ops (XLA's GEMMs) in its jaxpr, in order."""
    found = re.findall(r"\w+\[([\d,]+)\] = dot_general", jaxpr_text(f, *args))
    return [tuple(map(int, shape.split(","))) for shape in found]


def cuda_text(f, *args) -> str:
    """f lowered for platform "cuda" (on any machine), as StableHLO text; traced now."""
    return jax.jit(lambda *a: f(*a)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def custom_calls(text: str) -> list[str]:
    """The lines of ``text`` (``cuda_text``) that call jax_epilog's custom call (either target)."""
    return re.findall(rf"stablehlo.custom_call @(?:{TARGET_NAME}|{EAGER_TARGET_NAME})\(.*", text)


def problems(text: str) -> list[str]:
    """The problem ("forward", "wgrad", "dgrad") of each custom call in ``text``."""
    return [re.search(r'problem = "(\w+)"', call)[1] for call in custom_calls(text)]


def layer_inputs(rng, m, k, n, dtype, bias_dtype=None):
    """x (m, k), kernel (k, n) ~ N(0, 1/k) of ``dtype`` and bias (n,) of ``bias_dtype`` (or
    ``dtype``), drawn from ``rng``."""
    x = rng.standard_normal((m, k))
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    b = rng.standard_normal(n)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(b, bias_dtype or dtype)


def ones_layer(dtype, bias_dtype=None, m=33, k=129, n=65):
    """A layer's (x, kernel, bias) of ones: for what tracing and lowering produce, not values."""
    return jnp.ones((m, k), dtype), jnp.ones((k, n), dtype), jnp.ones((n,), bias_dtype or dtype)


# The Flax layers' dtype promotion: every (x dtype, dtype, param_dtype) once, the activation
# in turn (the promotion rules do not depend on it).
LAYER_DTYPE_CASES = [
    (x_dtype, dtype, param_dtype, ACTIVATIONS[i % len(ACTIVATIONS)])
    for i, (x_dtype, dtype, param_dtype) in enumerate(
        (x, d, p)
        for x in ("float32", "bfloat16")
        for d in (None, "float32", "bfloat16", "float16")
        for p in ("float32", "bfloat16")
    )
]


def run_python(code: str, *args: str, env=None, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python -c code args...`` in a fresh interpreter (this one's executable), for what
    must start clean: imports, environment variables read at start, device counts."""
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def explicit_mesh_2x2() -> jax.sharding.Mesh:
    """A ("data", "model") = (2, 2) mesh of explicit axis types on the first four devices
    (the test skips with fewer)."""
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=explicit, devices=jax.devices()[:4])


def assert_gradients_like_primals(got, want, primals) -> None:
    """Each gradient in ``got`` has its primal's sharding spec, and its values are within 5 %
    (plus 2 % of the largest) of ``want``'s, the same gradients on one device."""
    for g, r, primal in zip(
        jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(primals), strict=True
    ):
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec
        r = np.asarray(r, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), r, rtol=0.05, atol=0.02 * np.abs(r).max())
