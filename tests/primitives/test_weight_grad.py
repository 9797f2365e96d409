"""``jax_epilog.primitives.weight_grad``: a layer's kernel and bias gradients from one
GEMM (cuBLASLt's BGRADA epilog): its values, where the backward emits it (read from the
CUDA lowering, planning stubbed to accept: conftest.py), and on a GPU against nvmath's
own Matmul."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    GPU_TOL,
    assert_near,
    assert_scaled_close,
    cuda_text,
    custom_calls,
    device_array,
    np_dtype,
    problems,
)

import jax_epilog
from jax_epilog.cuda.ffi import TARGET_NAME
from jax_epilog.primitives import fused_weight_grad

op = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")


def _args(dtype, m=33, k=129, n=65):
    return jnp.ones((m, k), dtype), jnp.ones((k, n), dtype), jnp.ones((n,), dtype)


@pytest.mark.parametrize(
    "dtype, d_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32")]
)
def test_fused_weight_grad_sums_over_every_leading_dimension(rng, dtype, d_dtype):
    """x (2, 3, 5, K) and dz (2, 3, 5, N): x^T @ dz and dz's sum over the 30 rows, in
    ``d_dtype``, as in float64."""
    x = jnp.asarray(rng.standard_normal((2, 3, 5, 17)), dtype)
    dz = jnp.asarray(rng.standard_normal((2, 3, 5, 11)), dtype)
    dkernel, dbias = jax.jit(functools.partial(fused_weight_grad, compute_type=68, d_dtype=d_dtype))(x, dz)
    assert (dkernel.shape, dbias.shape) == ((17, 11), (11,)) and dkernel.dtype == dbias.dtype == np.dtype(
        d_dtype
    )
    x64, dz64 = (np.asarray(a, np.float64).reshape(30, -1) for a in (x, dz))
    tol = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 1e-6}[dtype]  # (float16 operands, float32 results)
    assert_near(dkernel, x64.T @ dz64, tol, "dkernel")
    assert_near(dbias, dz64.sum(0), tol, "dbias")


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_backward_adds_one_bgrada_call_only_with_a_bias_and_gelu(cublaslt_accepts, with_bias, activation):
    """ReLU's bias gradient is XLA's reduction (docs/decisions.md#relu-bgrad): no BGRADA
    call for it; without a bias none either."""
    x, w, b = _args(jnp.bfloat16)
    loss = lambda x, w, b: op(x, w, b if with_bias else None, activation=activation).astype(jnp.float32).sum()
    calls = custom_calls(cuda_text(jax.grad(loss, argnums=(0, 1, 2)), x, w, b))
    assert len(calls) == (2 if with_bias and activation == "gelu" else 1)
    assert 'problem = "forward"' in calls[0]
    if len(calls) == 2:
        wgrad = calls[1]
        assert 'epilog = "BGRADA"' in wgrad and 'problem = "wgrad"' in wgrad
        # (x, dz) -> (dkernel (k, n), dbias (n,))
        assert wgrad.endswith(
            "(tensor<33x129xbf16>, tensor<33x65xbf16>) -> (tensor<129x65xbf16>, tensor<65xbf16>)"
        )


def test_weight_gradient_with_k_1_stays_on_xla(cublaslt_accepts):
    """cuBLASLt plans a BGRADA GEMM with K = 1, then refuses it: that one is XLA's."""
    x, w, b = _args(jnp.bfloat16, k=1)
    grad = jax.grad(
        lambda x, w, b: op(x, w, b, activation="gelu").astype(jnp.float32).sum(), argnums=(0, 1, 2)
    )
    assert problems(cuda_text(grad, x, w, b)) == ["forward"]


# ------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gelus_backward_fuses_the_bias_gradient_into_the_kernel_gradient_gemm_relus_does_not(
    rng, with_bias, activation
):
    x = jnp.asarray(rng.standard_normal((33, 129)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((129, 65)) / np.sqrt(129), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(65), jnp.bfloat16)
    layer = functools.partial(op, activation=activation)
    loss = lambda x, w, b: layer(x, w, b).astype(jnp.float32).sum()
    text = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2) if with_bias else (0, 1)))
        .lower(x, w, b if with_bias else None)
        .as_text()
    )
    # The forward's custom call, plus with a bias and GELU one more: the wgrad GEMM with
    # BGRADA. ReLU's bias gradient is XLA's reduction.
    bgrada = with_bias and activation == "gelu"
    assert text.count(f"@{TARGET_NAME}(") == (2 if bgrada else 1), text
    assert ('"BGRADA"' in text) == bgrada


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,bias_dtype",
    [("bfloat16", "bfloat16"), ("float16", "float16"), ("float16", "float32"), ("float32", "float32")],
)
def test_weight_grad_matches_nvmath_bgrada_directly(rng, dtype, bias_dtype):
    """The backward's cuBLASLt GEMM (dkernel and dbias from one call) equals nvmath's own
    Matmul with the BGRADA epilog on the same inputs, and a float64 oracle."""
    import cupy as cp
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    m, k, n = 300, 133, 96 + 5
    d_dtype = "float32" if bias_dtype == "float32" else dtype
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    dz = jnp.asarray(rng.standard_normal((m, n)), dtype)
    f = jax.jit(functools.partial(fused_weight_grad, compute_type=68, d_dtype=d_dtype))  # COMPUTE_32F
    assert "BGRADA" in f.lower(x, dz).as_text()
    dkernel, dbias = f(x, dz)
    assert dkernel.dtype == d_dtype and dbias.dtype == d_dtype

    a = device_array(dz, dtype, (n, m), (1, n))  # column-major dz^T
    bm = device_array(x, dtype, (m, k), (k, 1))  # x as stored
    c = device_array(np.zeros((k, n)), d_dtype, (n, k), (1, n))
    with Matmul(a, bm, c=c, beta=0.0) as mm:
        mm.plan(epilog=MatmulEpilog.BGRADA)
        d_nv, aux = mm.execute()
    bits = np.uint32 if d_dtype == "float32" else np.uint16

    def as_f64(arr):
        return cp.asnumpy(arr.view(bits)).view(np_dtype(d_dtype)).astype(np.float64)

    want_dk = np.asarray(x, np.float64).T @ np.asarray(dz, np.float64)
    want_db = np.asarray(dz, np.float64).sum(axis=0)
    tol = GPU_TOL[dtype] * 2
    assert_scaled_close(dkernel, as_f64(d_nv).T, tol)
    assert_scaled_close(dbias, as_f64(aux["bgrada"]).reshape(n), tol)
    assert_scaled_close(dkernel, want_dk, tol)
    assert_scaled_close(dbias, want_db, tol)
