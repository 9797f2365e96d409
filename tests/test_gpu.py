"""GPU-only tests of the cuBLASLt fast path (skipped without a GPU; see conftest.py)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import ENSEMBLES, masked_relu, reference_relu_mask

import jax_epilog
from jax_epilog import FastPathWarning, aux_padded_width, unpack_relu_mask

# These tests are about the op itself (its cuBLASLt kernel on a GPU, its reference math
# on a CPU), not about implementation="auto"'s choice: see test_implementation.py.
fused_dense = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")

pytestmark = pytest.mark.gpu

jit_dense = jax.jit(fused_dense, static_argnames=("activation", "compute_type", "return_aux"))
DTYPES = ("float16", "bfloat16", "float32")
# Per-dtype tolerance, relative to the output's scale (inputs are O(1) after 1/sqrt(K)).
TOL = {"float16": 4e-3, "bfloat16": 3e-2, "float32": 2e-5, "tf32": 4e-3}
SHAPES = [(256, 784, 100), (1, 1, 1), (3, 5, 7), (33, 129, 65), (8192 // 8, 1024, 4096 // 8 + 3)]


def _inputs(rng, m, k, n, dtype, bias_dtype=None):
    x = rng.standard_normal((m, k))
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    b = rng.standard_normal(n)
    return (
        jnp.asarray(x, dtype),
        jnp.asarray(w, dtype),
        jnp.asarray(b, bias_dtype or dtype),
    )


def _oracle(x, w, b, activation):
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if b is not None:
        z = z + np.asarray(b, np.float64)
    if activation == "relu":
        return np.maximum(z, 0), z
    if activation == "gelu":
        return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3))), z
    return z, z


_NP_DT = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


def _device(a, dt, shape, strides):
    """A CuPy view of ``a``'s values in dtype ``dt`` with the given shape and element
    strides (built from raw bytes: CuPy cannot take bfloat16 through a typestr)."""
    import cupy as cp

    host = np.ascontiguousarray(np.asarray(a, _NP_DT[dt]))
    raw = cp.asarray(host.view(np.uint8))
    return cp.ndarray(shape, _NP_DT[dt], raw.data, tuple(s * _NP_DT[dt].itemsize for s in strides))


def _assert_close(y, expected, tol):
    y = np.asarray(y, np.float64)
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(y, expected, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_lowers_to_our_custom_call(rng, activation, with_bias):
    from jax_epilog._ffi import TARGET_NAME

    x, w, b = _inputs(rng, 33, 129, 65, "bfloat16")
    text = jit_dense.lower(x, w, b if with_bias else None, activation=activation).as_text()
    assert TARGET_NAME in text
    assert "stablehlo.dot" not in text and "dot_general" not in text


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_forward_matches_float64_oracle(rng, shape, dtype, activation, with_bias):
    m, k, n = shape
    x, w, b = _inputs(rng, m, k, n, dtype)
    b = b if with_bias else None
    y, aux = jit_dense(x, w, b, activation=activation, return_aux=True)
    expected, z = _oracle(x, w, b, activation)
    assert y.dtype == x.dtype and y.shape == (m, n)
    _assert_close(y, expected, TOL[dtype])
    if activation == "relu":
        assert aux.shape == (m, aux_padded_width("relu", n)) and aux.dtype == np.uint8
        bits = np.asarray(unpack_relu_mask(aux, n))
        clear = np.abs(z) > 20 * TOL[dtype]  # signs that rounding cannot flip
        np.testing.assert_array_equal(bits[clear], (z > 0)[clear])
    elif activation == "gelu":
        assert aux.shape == (m, aux_padded_width("gelu", n)) and aux.dtype == x.dtype
        _assert_close(aux[:, :n], z, TOL[dtype])
    else:
        assert aux is None


def test_tf32_compute_type(rng):
    x, w, b = _inputs(rng, 129, 257, 65, "float32")
    y = jit_dense(x, w, b, activation="gelu", compute_type="COMPUTE_32F_FAST_TF32")
    _assert_close(y, _oracle(x, w, b, "gelu")[0], TOL["tf32"])


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_seed_case_fp16_with_fp32_bias_is_fused_and_exact(rng, activation):
    from jax_epilog._ffi import TARGET_NAME

    x, w, b = _inputs(rng, 256, 784, 100, "float16", bias_dtype="float32")
    f = functools.partial(jit_dense, activation=activation, compute_type="COMPUTE_32F")
    assert TARGET_NAME in jit_dense.lower(x, w, b, activation=activation).as_text()
    y = f(x, w, b)
    assert y.dtype == jnp.float16
    # float32 bias semantics: one rounding of act(x @ w + b) computed in float32. Outputs
    # equal to that rounding, on the H200 (benchmarks/results/2026-12-04-h200-z-*): all but
    # 0.02% (ReLU) and 2.0-2.3% (GELU: cuBLASLt's fast tanh); with the bias rounded to
    # float16 before the add, 12-14% and 28-32% differ, which the fractions below refuse.
    ref = jax.nn.relu if activation == "relu" else functools.partial(jax.nn.gelu, approximate=True)
    exact = ref(jnp.dot(x, w, preferred_element_type=jnp.float32) + b).astype(jnp.float16)
    got, want = np.asarray(y, np.float32), np.asarray(exact, np.float32)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    assert np.mean(got != want) <= (0.01 if activation == "relu" else 0.08)
    _, aux = f(x, w, b, return_aux=True)
    if activation == "gelu":
        assert aux.dtype == jnp.float32


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_matches_nvmath_matmul_directly(rng, activation, dtype):
    import cupy as cp
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    m, k, n = 200, 333, 96 + 5
    x, w, b = _inputs(rng, m, k, n, dtype)
    y, aux = jit_dense(x, w, b, activation=activation, return_aux=True)

    np_dtype = _NP_DT[dtype]

    # The same column-major problem as the fast path: D[n, m] = W^T[n, k] @ X^T[k, m].
    a = _device(w, dtype, (n, k), (1, n))
    bm = _device(x, dtype, (k, m), (1, k))
    bias = _device(b, dtype, (n,), (1,))
    epilog = MatmulEpilog.RELU_AUX_BIAS if activation == "relu" else MatmulEpilog.GELU_AUX_BIAS
    with Matmul(a, bm) as mm:
        mm.plan(epilog=epilog, epilog_inputs={"bias": bias})
        d, aux_nv = mm.execute()
    d = cp.asnumpy(d.view(np.uint16)).view(np_dtype).astype(np.float32).T
    np.testing.assert_allclose(np.asarray(y, np.float32), d, rtol=TOL[dtype], atol=TOL[dtype])
    aux_nv = cp.asnumpy(next(iter(aux_nv.values())).view(np.uint8 if activation == "relu" else np.uint16))
    if activation == "relu":
        np.testing.assert_array_equal(
            np.asarray(unpack_relu_mask(aux, n)), np.asarray(unpack_relu_mask(aux_nv.T, n))
        )
    else:
        got = np.asarray(aux[:, :n], np.float32)
        np.testing.assert_allclose(got, aux_nv.view(np_dtype).astype(np.float32).T[:, :n], rtol=TOL[dtype], atol=TOL[dtype])


def test_leading_dims_fold_into_m(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, 40, 24)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((24, 40)) / 5, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(40), jnp.bfloat16)
    y, aux = jit_dense(x, w, b, activation="relu", return_aux=True)
    assert y.shape == (2, 3, 40, 40) and aux.shape == (2, 3, 40, 16)
    _assert_close(y, _oracle(x, w, b, "relu")[0], TOL["bfloat16"])


def test_vmap_shared_weights_is_one_custom_call(rng):
    from jax_epilog._ffi import TARGET_NAME

    x, w, b = _inputs(rng, 6 * 17, 48, 33, "bfloat16")
    xs = x.reshape(6, 17, 48)
    f = jax.jit(jax.vmap(lambda x: fused_dense(x, w, b, activation="gelu")))
    assert f.lower(xs).as_text().count(TARGET_NAME) == 1
    _assert_close(f(xs).reshape(-1, 33), _oracle(x, w, b, "gelu")[0], TOL["bfloat16"])


def test_refused_problem_falls_back_with_one_warning(rng, monkeypatch):
    from jax_epilog import _nvmath, _primitive

    def refuse(spec, device_id, alignment=256, autotune=False):
        raise _nvmath.PlanningError(f"test refusal of {spec}")

    monkeypatch.setattr(_nvmath, "get_plan", refuse)
    _primitive._warn_once.cache_clear()
    x, w, b = _inputs(rng, 37, 61, 19, "bfloat16")
    with pytest.warns(FastPathWarning, match="test refusal"):
        y = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="relu"))(x, w, b)
    _assert_close(y, _oracle(x, w, b, "relu")[0], TOL["bfloat16"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason is not repeated
        jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="relu") * 2)(x, w, b)


def test_runtime_failure_becomes_a_python_error_not_a_crash(rng, monkeypatch):
    from jax_epilog import _nvmath

    def broken_run(self, *args):
        raise RuntimeError("injected failure")

    x, w, b = _inputs(rng, 41, 67, 23, "float16")
    f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu"))
    f(x, w, b).block_until_ready()  # plans it
    monkeypatch.setattr(_nvmath.Plan, "run", broken_run)
    with pytest.raises(Exception, match="injected failure"):
        jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu") + 1)(x, w, b).block_until_ready()


def test_nvmath_internals_are_where_the_fast_path_expects(rng):
    from jax_epilog import _nvmath
    from jax_epilog._epilogs import EpilogSpec

    spec = EpilogSpec(64, 40, 24, "RELU_AUX_BIAS", "COMPUTE_32F", "bfloat16", "bfloat16", "bfloat16")
    plan = _nvmath.Plan(spec, _nvmath.current_device(), 256)  # raises if nvmath moved them
    assert all(hasattr(plan._mm, name) for name in _nvmath._MATMUL_INTERNALS)


def test_no_device_memory_leak_over_1000_jitted_calls(rng):
    import cupy as cp

    x, w, b = _inputs(rng, 512, 256, 384, "bfloat16")
    f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="relu", return_aux=True))
    jax.block_until_ready(f(x, w, b))
    device = jax.devices("gpu")[0]
    before_jax = device.memory_stats()["bytes_in_use"]
    before_free = cp.cuda.runtime.memGetInfo()[0]
    for _ in range(1000):
        out = f(x, w, b)
    jax.block_until_ready(out)
    del out
    after_jax = device.memory_stats()["bytes_in_use"]
    after_free = cp.cuda.runtime.memGetInfo()[0]
    assert after_jax <= before_jax
    assert before_free - after_free < 4 << 20  # no per-call allocations outside XLA either


def test_replayed_calls_read_their_inputs_and_write_their_outputs(rng):
    """Calls on buffers seen before launch a captured graph: it must still read this call's
    contents (x changes every step, at recurring addresses) and write this call's output."""
    from jax_epilog import _nvmath

    x, w, b = _inputs(rng, 96, 200, 200, "bfloat16")
    step = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu"), donate_argnums=0)
    graphs = lambda: sum(len(p._graphs) for p in _nvmath._plans.values())
    before = graphs()
    y = jnp.array(x, copy=True)
    for _ in range(10):
        previous = np.asarray(y)  # y's buffer is donated to the next call
        y = step(y, w, b)
        _assert_close(y, _oracle(previous, w, b, "gelu")[0], TOL["bfloat16"])
    assert graphs() > before  # the steps above did replay


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gelus_backward_fuses_the_bias_gradient_into_the_kernel_gradient_gemm_relus_does_not(rng, with_bias, activation):
    from jax_epilog._ffi import TARGET_NAME

    x, w, b = _inputs(rng, 33, 129, 65, "bfloat16")
    layer = functools.partial(fused_dense, activation=activation, implementation="cublaslt")
    loss = lambda x, w, b: layer(x, w, b).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2) if with_bias else (0, 1))).lower(
        x, w, b if with_bias else None
    ).as_text()
    # The forward's custom call, plus with a bias and GELU one more: the wgrad GEMM with
    # BGRADA. ReLU's bias gradient is XLA's reduction (benchmarks/README.md (u)).
    bgrada = with_bias and activation == "gelu"
    assert text.count(f'@{TARGET_NAME}(') == (2 if bgrada else 1), text
    assert ('"BGRADA"' in text) == bgrada


@pytest.mark.parametrize("dtype,bias_dtype", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                              ("float16", "float32"), ("float32", "float32")])
def test_weight_grad_matches_nvmath_bgrada_directly(rng, dtype, bias_dtype):
    """The backward's cuBLASLt GEMM (dkernel and dbias from one call) equals nvmath's own
    Matmul with the BGRADA epilog on the same inputs, and a float64 oracle."""
    import cupy as cp
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    from jax_epilog._primitive import fused_weight_grad

    m, k, n = 300, 133, 96 + 5
    d_dtype = "float32" if bias_dtype == "float32" else dtype
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    dz = jnp.asarray(rng.standard_normal((m, n)), dtype)
    f = jax.jit(functools.partial(fused_weight_grad, compute_type=68, d_dtype=d_dtype))  # COMPUTE_32F
    assert "BGRADA" in f.lower(x, dz).as_text()
    dkernel, dbias = f(x, dz)
    assert dkernel.dtype == d_dtype and dbias.dtype == d_dtype

    a = _device(dz, dtype, (n, m), (1, n))  # column-major dz^T
    bm = _device(x, dtype, (m, k), (k, 1))  # x as stored
    c = _device(np.zeros((k, n)), d_dtype, (n, k), (1, n))
    with Matmul(a, bm, c=c, beta=0.0) as mm:
        mm.plan(epilog=MatmulEpilog.BGRADA)
        d_nv, aux = mm.execute()
    bits = np.uint32 if d_dtype == "float32" else np.uint16

    def as_f64(arr):
        return cp.asnumpy(arr.view(bits)).view(_NP_DT[d_dtype]).astype(np.float64)

    want_dk = np.asarray(x, np.float64).T @ np.asarray(dz, np.float64)
    want_db = np.asarray(dz, np.float64).sum(axis=0)
    tol = TOL[dtype] * 2
    _assert_close(dkernel, as_f64(d_nv).T, tol)
    _assert_close(dbias, as_f64(aux["bgrada"]).reshape(n), tol)
    _assert_close(dkernel, want_dk, tol)
    _assert_close(dbias, want_db, tol)


def test_plans_made_at_lowering_are_autotuned(rng):
    from jax_epilog import _nvmath

    x, w, b = _inputs(rng, 520, 264, 392, "bfloat16")
    y = jit_dense(x, w, b, activation="gelu")
    tuned = [p for key, p in _nvmath._plans.items() if key[0].m == 520 and key[0].n == 392]
    assert tuned and all(p.tuning for p in tuned)
    assert all(np.isfinite(min(p.tuning)) for p in tuned)
    _assert_close(y, _oracle(x, w, b, "gelu")[0], TOL["bfloat16"])


def test_a_plan_made_without_tuning_runs_the_tuned_choice(rng, monkeypatch):
    """The FFI handler plans (untuned) for the other GPUs of a multi-GPU program: each takes
    the choice tuned at lowering for the same problem, alignment and GPU model."""
    from jax_epilog import _nvmath

    monkeypatch.setattr(_nvmath, "_plans", {})
    monkeypatch.setattr(_nvmath, "_tuned", {})
    x, w, b = _inputs(rng, 776, 264, 392, "bfloat16")
    f = lambda x, w, b: fused_dense(x, w, b, activation="gelu")
    jax.jit(f).lower(x, w, b)  # lowering plans and tunes; nothing runs
    ((key, tuned),) = _nvmath._plans.items()
    spec, device, alignment = key
    assert tuned.tuning is not None and len(tuned.tuning) > 1
    model_key = (spec, alignment, _nvmath._model(device))
    assert _nvmath._tuned == {model_key: tuned.choice}
    # As if another GPU of this model had tuned it and preferred the last candidate.
    last = len(tuned.tuning) - 1
    _nvmath._plans.clear()
    _nvmath._tuned[model_key] = last
    monkeypatch.setenv("JAX_EPILOG_AUTOTUNE", "0")  # should the jit lower again
    # The handler plans this device anew, untuned, when the program runs (with PjRt's
    # asynchronous dispatch, after the call returns).
    y = jax.block_until_ready(jax.jit(f)(x, w, b))
    plans = [p for k, p in _nvmath._plans.items() if k[0] == spec and k[2] == alignment]
    assert plans and all(p.tuning is None and p.choice == last for p in plans)
    _assert_close(y, _oracle(x, w, b, "gelu")[0], TOL["bfloat16"])


def test_a_gelu_link_in_fused_mlp_lowers_to_a_dgelu_input_gradient_gemm(rng):
    from jax_epilog._ffi import TARGET_NAME

    x, w1, b1 = _inputs(rng, 64, 40, 72, "bfloat16")
    _, w2, b2 = _inputs(rng, 64, 72, 24, "bfloat16")
    mlp = functools.partial(jax_epilog.fused_mlp, activations=("gelu", None), implementation="cublaslt")
    loss = lambda x, layers: mlp(x, layers).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, [(w1, b1), (w2, b2)]).as_text()
    assert f"@{TARGET_NAME}(" in text and 'problem = "dgrad"' in text and '"DGELU"' in text, text


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_the_cublaslt_gradient_on_leading_dimensions_matches_the_expressions(rng, activation):
    """"cublaslt"'s backward and fused_mlp's linked one on x of shape (3, 11, K): the
    forward, BGRADA and DGELU calls fold their rows in the lowering; the gradients are the
    plain expression's."""
    from jax_epilog._ffi import TARGET_NAME

    x, w, b = _inputs(rng, 33, 129, 65, "bfloat16")
    w2 = _inputs(rng, 1, 65, 17, "bfloat16")[1]
    act = functools.partial(jax.nn.gelu, approximate=True)
    if activation == "relu":
        # cuBLASLt's epilog may round x @ w to bfloat16 before adding the bias, so near the
        # kink its bit may differ from z > 0 and flip a whole row of dx (seen on the H100,
        # 2026-12-05 (ae); (ag)'s probe found this shape's kernel rounding first). Away
        # from it the folded mask must be z > 0; near it the expression takes the op's bit.
        mask = jnp.asarray(reference_relu_mask(x.reshape(3, 11, 129), w, b, "bfloat16"), jnp.float32)
        act = lambda z: masked_relu(z, mask)
    x = x.reshape(3, 11, 129)
    layers = {
        "dense": lambda x, w, b, w2: fused_dense(x, w, b, activation=activation, implementation="cublaslt"),
        "mlp": lambda x, w, b, w2: jax_epilog.fused_mlp(
            x, [(w, b), (w2, None)], [activation, None], implementation="cublaslt"
        ),
    }
    plain = {"dense": lambda x, w, b, w2: act(x @ w + b), "mlp": lambda x, w, b, w2: act(x @ w + b) @ w2}
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))
    f32 = [a.astype(jnp.float32) for a in (x, w, b, w2)]
    argnums = (0, 1, 2, 3)
    for name, layer in layers.items():
        grad = jax.jit(jax.grad(loss(layer), argnums=argnums))
        text = grad.lower(x, w, b, w2).as_text()
        assert text.count(f"@{TARGET_NAME}(") >= 1 and "bf16[33," not in str(jax.make_jaxpr(grad)(x, w, b, w2))
        for g, want in zip(grad(x, w, b, w2), jax.grad(loss(plain[name]), argnums=argnums)(*f32), strict=True):
            _assert_close(g, want, TOL["bfloat16"])


@pytest.mark.parametrize("dtype,aux_dtype", [("bfloat16", "bfloat16"), ("float16", "float16"),
                                             ("bfloat16", "float32"), ("float32", "float32")])
def test_gelu_input_grad_matches_nvmath_dgelu_directly(rng, dtype, aux_dtype):
    """The DGELU input-gradient GEMM equals nvmath's own Matmul with the DGELU epilog on
    the same inputs, and a float64 oracle."""
    import cupy as cp
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    from jax_epilog._primitive import fused_gelu_input_grad

    m, n, k = 300, 133, 96 + 5  # dz (m, n), kernel (k, n), result (m, k)
    width = aux_padded_width("gelu", k)
    dz = jnp.asarray(rng.standard_normal((m, n)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(n), dtype)
    aux = jnp.asarray(rng.standard_normal((m, width)), aux_dtype)
    f = jax.jit(functools.partial(fused_gelu_input_grad, compute_type=68))  # COMPUTE_32F
    assert '"DGELU"' in f.lower(dz, w, aux).as_text()
    (got,) = f(dz, w, aux)
    assert got.shape == (m, k) and got.dtype == aux_dtype

    a = _device(w, dtype, (k, n), (n, 1))  # the kernel as stored, read transposed
    bm = _device(dz, dtype, (n, m), (1, n))  # column-major dz^T
    c = _device(np.zeros((m, k)), aux_dtype, (k, m), (1, k))
    gelu_aux = _device(aux, aux_dtype, (width, m), (1, width))
    with Matmul(a, bm, c=c, beta=0.0) as mm:
        mm.plan(epilog=MatmulEpilog.DGELU, epilog_inputs={"gelu_aux": gelu_aux})
        d_nv = mm.execute()
    bits = np.uint32 if aux_dtype == "float32" else np.uint16
    nv = cp.asnumpy(d_nv.view(bits)).view(_NP_DT[aux_dtype]).astype(np.float64).T

    z = np.asarray(aux, np.float64)[:, :k]
    dh = np.asarray(dz, np.float64) @ np.asarray(w, np.float64).T
    t = np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)
    dgelu = 0.5 * (1 + np.tanh(t)) + 0.5 * z * (1 - np.tanh(t) ** 2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z**2)
    # Largest errors over five draws on the H200 (benchmarks/results/2026-12-04-h200-z-*),
    # against the oracle: 3.9e-3 (bfloat16), 5.7e-4 (float16), 5.7e-6 and 6.4e-6 (float32
    # aux); against nvmath 0 but for float16 (2.2e-4).
    tol = TOL[aux_dtype] * 2 if aux_dtype == "float32" else TOL[aux_dtype]
    _assert_close(got, nv, tol)
    _assert_close(got, dh * dgelu, tol)


def test_a_problem_cublaslt_plans_but_never_runs_is_refused_at_planning():
    """One row, half operands, float32 D (a float32 bias): planned by cuBLASLt 13.1, then
    every algorithm fails to launch (measured). The tuner's failures make it a PlanningError,
    so lowering falls back (the primitive also routes this case to XLA up front)."""
    from jax_epilog import _nvmath
    from jax_epilog._epilogs import EpilogSpec

    spec = EpilogSpec(1, 11, 6, "GELU_AUX_BIAS", "COMPUTE_32F", "bfloat16", "float32", "float32")
    with pytest.raises(_nvmath.PlanningError, match="refused to run each of its"):
        _nvmath.Plan(spec, _nvmath.current_device(), 256, autotune=True)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_explicit_sharding_on_the_gpu_runs_the_fused_path(rng, activation):
    """Under an explicit mesh (jax.make_mesh's default) the primitives' results are typed with
    the mesh's shardings and the cotangents are resharded to their primals' types
    (_sharding.typed / like): on one GPU the forward and its gradient still lower to our
    custom calls and give the oracle's numbers."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_epilog._ffi import TARGET_NAME

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    x, w, b = _inputs(rng, 96, 72, 40, "float32")
    dy = jnp.asarray(rng.standard_normal((96, 40)), jnp.float32)
    rows, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    x, dy = jax.device_put(x, rows), jax.device_put(dy, rows)
    w, b = jax.device_put(w, whole), jax.device_put(b, whole)

    loss = lambda x, w, b: jnp.sum(fused_dense(x, w, b, activation=activation) * dy)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    text = grad.lower(x, w, b).as_text()
    # the forward, and for GELU the BGRADA GEMM (ReLU's bias gradient is XLA's reduction)
    assert text.count(f"@{TARGET_NAME}(") == (2 if activation == "gelu" else 1), text
    value, grads = grad(x, w, b)

    x64, w64, b64, dy64 = (np.asarray(a, np.float64) for a in (x, w, b, dy))
    y, z = _oracle(x64, w64, b64, activation)
    _assert_close(value, np.sum(y * dy64), TOL["float32"] * 10)
    if activation == "relu":
        dz = dy64 * (z > 0)
    else:
        t = np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)
        dz = dy64 * (0.5 * (1 + np.tanh(t)) + 0.5 * z * (1 - np.tanh(t) ** 2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z**2))
    for g, want, primal in zip(grads, (dz @ w64.T, x64.T @ dz, dz.sum(0)), (x, w, b), strict=True):
        _assert_close(g, want, TOL["float32"] * 10)
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec


def test_explicit_sharding_ensemble_runs_one_batched_fused_call(rng):
    """vmap over the weights with the members split over an explicit mesh (of one GPU):
    members_p, typed by its layout, runs each device's members' forward as one batched
    custom call, with the oracle's numbers; the gradients keep the split."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_epilog._ffi import TARGET_NAME

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    members = [_inputs(rng, 40, 24, 72, "bfloat16") for _ in range(3)]
    x, w, b = (jax.device_put(jnp.stack(a), NamedSharding(mesh, P("data"))) for a in zip(*members))
    layer = jax.vmap(lambda x, w, b: fused_dense(x, w, b, activation="gelu"))
    grad = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    jaxpr = str(jax.make_jaxpr(layer)(x, w, b))
    assert "jax_epilog_members" in jaxpr and "shard_map" not in jaxpr
    text = grad.lower(x, w, b).as_text()
    assert text.count(f"@{TARGET_NAME}(") == 1 and "members = 3" in text, text  # the batched forward
    y = jax.jit(layer)(x, w, b)
    assert jax.typeof(y).sharding.spec == P("data", None, None)
    for i, (xi, wi, bi) in enumerate(members):
        _assert_close(y[i], _oracle(xi, wi, bi, "gelu")[0], TOL["bfloat16"])
    _, grads = grad(x, w, b)
    assert all(jax.typeof(g).sharding.spec[0] == "data" for g in grads)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_autos_fused_forward_on_leading_dimensions_matches_the_oracle(rng, monkeypatch, activation):
    """"auto"'s fused forward on x of shape (3, 11, K), whose rows the lowering folds around
    one custom call: y is the oracle's, and its gradients the plain expression's ("xla")."""
    from jax_epilog import _dense
    from jax_epilog._ffi import TARGET_NAME

    monkeypatch.setattr(_dense, "_auto_fuses_alone", lambda *args: True)
    x, w, b = _inputs(rng, 33, 129, 65, "bfloat16")
    x = x.reshape(3, 11, 129)
    layer = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation=activation))
    assert layer.lower(x, w, b).as_text().count(f"@{TARGET_NAME}(") == 1
    y = layer(x, w, b)
    assert y.shape == (3, 11, 65)
    _assert_close(y.reshape(33, 65), _oracle(x.reshape(33, 129), w, b, activation)[0], TOL["bfloat16"])
    # "auto" differentiates the plain expression at the layer's dtype: its gradients are
    # "xla"'s. (Against the float32 expression, a bfloat16 z within rounding of ReLU's kink
    # flipped whole rows of dx on the H100, 2026-12-05.)
    def grads(implementation):
        layer = functools.partial(fused_dense, activation=activation, implementation=implementation)
        loss = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)

    for g, want in zip(grads("auto"), grads("xla"), strict=True):
        _assert_close(g, np.asarray(want, np.float64), TOL["bfloat16"])


def test_inside_shard_map_the_fused_path_runs_and_differentiates(rng):
    """A shard_map over a mesh of one GPU: the primitives lower directly to our custom
    calls (the forward and BGRADA), typed as varying over the manual axis, and the weight
    gradients (summed over that axis) match the oracle's."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from jax_epilog._ffi import TARGET_NAME

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    x, w, b = _inputs(rng, 48, 40, 72, "bfloat16")
    layer = jax.shard_map(
        lambda x, w, b: fused_dense(x, w, b, activation="gelu"),
        mesh=mesh, in_specs=(P("data"), P(), P()), out_specs=P("data"),
    )  # fmt: skip
    loss = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert grad.lower(x, w, b).as_text().count(f"@{TARGET_NAME}(") == 2  # the forward and BGRADA
    _assert_close(jax.jit(layer)(x, w, b), _oracle(x, w, b, "gelu")[0], TOL["bfloat16"])
    plain = lambda x, w, b: jnp.sum(jax.nn.gelu(x @ w + b, approximate=True))
    f32 = [a.astype(jnp.float32) for a in (x, w, b)]
    for g, want in zip(grad(x, w, b), jax.grad(plain, argnums=(0, 1, 2))(*f32), strict=True):
        _assert_close(g, want, TOL["bfloat16"])


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ensemble_runs_the_fused_path_and_differentiates(rng, activation):
    """vmap over the weights without explicit sharding (members_p): the forward is one
    batched custom call, the kernel and bias gradients XLA's batched GEMM and reduction;
    the gradients (ReLU's from the members' bit-masks) are the oracle's."""
    from jax_epilog._ffi import TARGET_NAME

    members = [_inputs(rng, 40, 24, 72, "bfloat16") for _ in range(3)]
    x, w, b = (jnp.stack(a) for a in zip(*members))
    layer = jax.vmap(lambda x, w, b: fused_dense(x, w, b, activation=activation))
    assert "jax_epilog_members" in str(jax.make_jaxpr(layer)(x, w, b))
    loss = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grad.lower(x, w, b).as_text()
    assert text.count(f"@{TARGET_NAME}(") == 1 and "members = 3" in text  # the batched forward
    y = jax.jit(layer)(x, w, b)
    for i, (xi, wi, bi) in enumerate(members):
        _assert_close(y[i], _oracle(xi, wi, bi, activation)[0], TOL["bfloat16"])
    act = jax.nn.relu if activation == "relu" else functools.partial(jax.nn.gelu, approximate=True)
    plain = lambda x, w, b: jnp.sum(act(jnp.einsum("emk,ekn->emn", x, w) + b[:, None]))
    f32 = [a.astype(jnp.float32) for a in (x, w, b)]
    for g, want in zip(grad(x, w, b), jax.grad(plain, argnums=(0, 1, 2))(*f32), strict=True):
        _assert_close(g, want, TOL["bfloat16"])




@pytest.mark.parametrize("dtype, bias_dtype", [("bfloat16", None), ("float16", "float32"), ("float32", None)])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("ensemble", list(ENSEMBLES))
def test_an_ensembles_batched_forward_matches_the_oracle_member_by_member(rng, ensemble, activation, dtype, bias_dtype):
    """One strided-batched cuBLASLt call for 3 members; each member's y and aux are its
    own layer's (sizes not multiples of 8: rows, N, and the aux's padding)."""
    from jax_epilog._ffi import TARGET_NAME

    in_axes = ENSEMBLES[ensemble]
    m, k, n = 33, 129, 65
    draws = [_inputs(rng, m, k, n, dtype, bias_dtype) for _ in range(3)]
    args = [jnp.stack(parts) if ax == 0 else parts[0] for parts, ax in zip(zip(*draws), in_axes)]
    layer = jax.jit(jax.vmap(functools.partial(fused_dense, activation=activation, return_aux=True), in_axes=in_axes))
    text = layer.lower(*args).as_text()
    assert text.count(f"@{TARGET_NAME}(") == 1 and "members = 3" in text
    y, aux = layer(*args)
    for i in range(3):
        xi, wi, bi = (a[i] if ax == 0 else a for a, ax in zip(args, in_axes))
        expected, z = _oracle(xi, wi, bi, activation)
        _assert_close(y[i], expected, TOL[dtype])
        if activation == "relu":
            bits = np.asarray(unpack_relu_mask(aux[i], n))
            clear = np.abs(z) > 20 * TOL[dtype]  # signs that rounding cannot flip
            np.testing.assert_array_equal(bits[clear], (z > 0)[clear])
        elif activation == "gelu":
            _assert_close(aux[i][:, :n], z, TOL[dtype])
    if activation is None:
        assert aux is None


# Ensembles at the edges (cases from a review): (in_axes of each vmap, innermost first;
# members; (m, k, n); dtype; the bias's dtype, or None for no bias; activation).
_EDGE_ENSEMBLES = {
    "no bias": ([(0, 0, None)], 3, (33, 129, 65), "bfloat16", None, "relu"),
    "no bias, x shared": ([(None, 0, None)], 3, (33, 129, 65), "bfloat16", None, "gelu"),
    "x shared, two rows, float32 bias": ([(None, 0, 0)], 3, (2, 40, 24), "float16", "float32", "gelu"),
    "kernel shared, float32 bias": ([(0, None, 0)], 4, (17, 40, 24), "float16", "float32", "relu"),
    "n = 1": ([(0, 0, 0)], 3, (33, 16, 1), "bfloat16", "bfloat16", "relu"),
    "k = 1": ([(0, 0, 0)], 3, (33, 1, 16), "bfloat16", "bfloat16", "gelu"),
    "one row": ([(0, 0, 0)], 3, (1, 64, 64), "bfloat16", "bfloat16", "relu"),
    "one row, float32 bias": ([(0, 0, 0)], 3, (1, 64, 64), "float16", "float32", "relu"),
    "nested, mixed sharing": ([(0, None, 0), (None, 0, 0)], 3, (24, 40, 56), "bfloat16", "bfloat16", "gelu"),
    "nested, per-example inside": ([(0, None, None), (0, 0, 0)], 3, (24, 40, 56), "bfloat16", "bfloat16", "relu"),
    "large, bias shared": ([(0, 0, None)], 8, (1000, 257, 300), "bfloat16", "bfloat16", "relu"),
    "float32, x shared": ([(None, 0, 0)], 5, (8, 16, 24), "float32", "float32", "gelu"),
}  # fmt: skip


@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("case", list(_EDGE_ENSEMBLES))
def test_ensemble_edge_cases_match_the_float64_reference(rng, case, explicit):
    """Batched where cuBLASLt can, a loop (or XLA) where it cannot: y and the aux are each
    member's own, also with the members split over an explicit mesh of one GPU."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    levels, members, (m, k, n), dtype, bias_dtype, activation = _EDGE_ENSEMBLES[case]
    shapes = [(m, k), (k, n), (n,)]
    for axes in levels:  # each vmap level adds a leading member dimension
        shapes = [(members, *s) if ax == 0 else s for s, ax in zip(shapes, axes)]
    dtypes, scales = (dtype, dtype, bias_dtype or dtype), (1.0, k**-0.5, 1.0)
    x, w, b = (jnp.asarray(rng.standard_normal(s) * c, d) for s, c, d in zip(shapes, scales, dtypes))
    if explicit:
        mesh = jax.make_mesh((1,), ("e",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
        x, w, b = (jax.device_put(a, NamedSharding(mesh, P("e") if ax == 0 else P())) for a, ax in zip((x, w, b), levels[-1]))
    b = b if bias_dtype else None

    def layer(x, w, b):
        return fused_dense(x, w, b, activation=activation, return_aux=True)

    def reference(x, w, b):
        z = jnp.dot(x.astype(jnp.float64), w.astype(jnp.float64))
        z = z if b is None else z + b.astype(jnp.float64)
        return (jax.nn.relu(z) if activation == "relu" else jax.nn.gelu(z, approximate=True)), z

    f, g = layer, reference
    for axes in levels:
        f, g = jax.vmap(f, in_axes=axes), jax.vmap(g, in_axes=axes)
    (y, aux), (want, z) = jax.jit(f)(x, w, b), jax.jit(g)(x, w, b)
    _assert_close(y, np.asarray(want), TOL[dtype])
    z = np.asarray(z)
    if activation == "relu":
        bits = np.unpackbits(np.asarray(aux), axis=-1, bitorder="little")[..., :n].astype(bool)
        clear = np.abs(z) > 20 * TOL[dtype]  # signs that rounding cannot flip
        np.testing.assert_array_equal(bits[clear], (z > 0)[clear])
    else:
        _assert_close(np.asarray(aux, np.float64)[..., :n], z, TOL[dtype])


def test_nested_ensembles_run_one_batched_call(rng):
    draws = [[_inputs(rng, 24, 40, 56, "bfloat16") for _ in range(3)] for _ in range(2)]
    x, w, b = (jnp.stack([jnp.stack([member[p] for member in row]) for row in draws]) for p in range(3))
    layer = jax.jit(jax.vmap(jax.vmap(functools.partial(fused_dense, activation="relu"))))
    assert "members = 6" in layer.lower(x, w, b).as_text()
    y = layer(x, w, b)
    for i, row in enumerate(draws):
        for j, (xi, wi, bi) in enumerate(row):
            _assert_close(y[i, j], _oracle(xi, wi, bi, "relu")[0], TOL["bfloat16"])


_WORKER_THREAD_PLAN = """
import threading
import jax, jax.numpy as jnp, numpy as np
from jax_epilog import _nvmath, fused_dense

rng = np.random.default_rng({seed})
x = jnp.asarray(rng.standard_normal((72, 40)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((40, 56)) / np.sqrt(40), jnp.bfloat16)
b = jnp.asarray(rng.standard_normal(56), jnp.bfloat16)
f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu", implementation="cublaslt"))
f.lower(x, w, b)  # plans at lowering, on this thread
_nvmath._plans.clear()  # so that the handler plans anew when the program runs
threads, get_plan = [], _nvmath.get_plan
_nvmath.get_plan = lambda *a, **k: threads.append(threading.current_thread()) or get_plan(*a, **k)
y = np.asarray(f(x, w, b), np.float64)
z = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
want = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
assert threads and threading.main_thread() not in threads, threads
assert np.abs(y - want).max() <= 3e-2 * max(1.0, np.abs(want).max()), np.abs(y - want).max()
print("planned on", [t.name for t in threads])
"""


def test_the_handler_plans_on_a_pjrt_worker_thread(rng):
    """With PjRt's asynchronous dispatch (PJRT_GPU_ENABLE_ASYNC_DISPATCH=1, read when the
    client starts: hence a fresh process) the FFI handler runs on a worker thread of XLA's;
    a plan it makes there (none cached for the device and alignment) must run: it once
    failed with cuda.core's "Device 0 is not yet initialized" (_nvmath._set_current)."""
    code = _WORKER_THREAD_PLAN.format(seed=int(rng.integers(1 << 31)))
    env = {**os.environ, "PJRT_GPU_ENABLE_ASYNC_DISPATCH": "1"}
    command = [sys.executable, "-c", textwrap.dedent(code)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


_EXPORTED_CALL = """
import sys
import jax, jax.numpy as jnp, numpy as np
import jax_epilog

def arrays(name):
    with np.load(sys.argv[1] + "/" + name + ".npz") as f:
        return [f[f"arr_{{i}}"] for i in range(len(f.files))]

inputs = [jnp.asarray(a, jnp.bfloat16) for a in arrays("inputs")]  # (bfloat16 values, saved as float32)
for name in ("forward", "grad", "ensemble"):
    exported = jax.export.deserialize(open(sys.argv[1] + "/" + name + ".bin", "rb").read())
    got = [np.asarray(r, np.float32) for r in jax.tree.leaves(exported.call(*inputs))]
    for g, r in zip(got, arrays(name), strict=True):
        scale = max(1.0, float(np.abs(r).max()))
        assert np.abs(g - r).max() <= {tol} * scale, (name, float(np.abs(g - r).max()), scale)
calls, _, resolved = jax_epilog._ffi.handler_stats()
# the forward, the grad's forward and BGRADA, and the ensemble's batched forward
assert calls == 4 and resolved == 4, (calls, resolved)
assert not jax_epilog._nvmath._tuned, "a plan was tuned: something was lowered here"
print("handler calls", calls)
"""


def test_an_exported_program_runs_in_a_process_that_never_lowered_it(rng, tmp_path):
    """jax.export of a program holding the fused custom call (allowed by EXPORT_CHECKS),
    serialized, then deserialized and called in a fresh process that only imported
    jax_epilog: the handler, registered at import, decodes each problem from the call's
    attributes (an ensemble's members too) and plans it, and the results match this
    process's."""
    pytest.importorskip("flatbuffers", reason="jax.export's serialization needs flatbuffers")
    from jax_epilog._ffi import TARGET_NAME

    x, w, b = _inputs(rng, 40, 24, 72, "bfloat16")
    forward = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu"))
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    layer = functools.partial(fused_dense, activation="relu")
    members = lambda x, w, b: jax.vmap(layer, in_axes=(None, 0, 0))(x, jnp.stack([w, -w]), jnp.stack([b, b / 2]))
    ensemble = jax.jit(members)  # two members sharing x: one batched call
    with pytest.raises(ValueError, match=TARGET_NAME):
        jax.export.export(forward)(x, w, b)  # jax.export's safety check, unless told otherwise
    assert "members = 2" in ensemble.lower(x, w, b).as_text()
    for name, f in (("forward", forward), ("grad", grad), ("ensemble", ensemble)):
        exported = jax.export.export(f, disabled_checks=jax_epilog.EXPORT_CHECKS)(x, w, b)
        assert f"@{TARGET_NAME}(" in exported.mlir_module()
        (tmp_path / f"{name}.bin").write_bytes(exported.serialize())
        np.savez(tmp_path / f"{name}.npz", *(np.asarray(r, np.float32) for r in jax.tree.leaves(f(x, w, b))))
    np.savez(tmp_path / "inputs.npz", *(np.asarray(a, np.float32) for a in (x, w, b)))
    command = [sys.executable, "-c", _EXPORTED_CALL.format(tol=TOL["bfloat16"]), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
