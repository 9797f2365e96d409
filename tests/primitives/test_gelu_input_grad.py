"""``jax_epilog.primitives.gelu_input_grad``: an input-gradient GEMM times the previous
GELU layer's derivative (cuBLASLt's DGELU epilog): its values against float64, its
batching rule, where fused_mlp's linked backward emits it (read from the CUDA lowering,
planning stubbed to accept: conftest.py), and on a GPU against nvmath's own Matmul."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    GPU_TOL,
    ON_GPU,
    assert_near,
    assert_scaled_close,
    cuda_text,
    custom_calls,
    device_array,
    jaxpr_text,
    np_dtype,
    problems,
)

from jax_epilog import aux_padded_width, fused_mlp
from jax_epilog.cuda.ffi import TARGET_NAME
from jax_epilog.primitives import fused_gelu_input_grad

CT = 68  # COMPUTE_32F


def _gelu(z):
    return 0.5 * z * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def _draw(rng, m, n, k, dtype, aux_dtype, lead=()):
    """dz, the kernel and a GELU aux whose padding is NaN (the op must read only the first
    k columns)."""
    dz = rng.standard_normal((*lead, m, n)).astype(np_dtype(dtype))
    w = (rng.standard_normal((k, n)) / np.sqrt(n)).astype(np_dtype(dtype))
    aux = np.full((*lead, m, aux_padded_width("gelu", k)), np.nan, np_dtype(aux_dtype))
    aux[..., :k] = rng.standard_normal((*lead, m, k)).astype(np_dtype(aux_dtype))
    return dz, w, aux


def _expected(dz, w, aux):
    """(dz @ w.T) * gelu'(z) in float64, and the size of the product's terms."""
    k = w.shape[0]
    dz64, w64 = np.asarray(dz, np.float64), np.asarray(w, np.float64)
    z = jnp.asarray(np.asarray(aux[..., :k], np.float64))
    expected = jax.vjp(_gelu, z)[1](jnp.asarray(dz64 @ w64.T))[0]
    return np.asarray(expected), float((np.abs(dz64) @ np.abs(w64).T).max())


# Errors scale with the product's terms, not with the result: GELU's derivative is at
# most 1.13 but is a difference of near-equal numbers far below zero (in float32 at
# z = -3.65: 3e-4 of itself), and the product may cancel.
_TOL = {"float16": 4e-3, "bfloat16": 2e-2, "float32": 5e-3 if ON_GPU else 1e-5}


@pytest.mark.parametrize(
    "dtype, aux_dtype, m, n, k",
    [
        ("float16", "float16", 33, 65, 37),
        ("bfloat16", "bfloat16", 1, 3, 1),
        ("bfloat16", "float32", 5, 1, 9),
        ("float32", "float32", 8, 16, 24),
        ("float16", "float16", 5, 1, 9),
        ("bfloat16", "bfloat16", 33, 65, 37),
        ("bfloat16", "float32", 8, 16, 24),
        ("float32", "float32", 1, 3, 1),
    ],
    ids=str,
)
def test_gelu_input_grad_matches_float64(rng, dtype, aux_dtype, m, n, k):
    dz, w, aux = _draw(rng, m, n, k, dtype, aux_dtype)
    (got,) = jax.jit(functools.partial(fused_gelu_input_grad, compute_type=CT))(dz, w, aux)
    assert got.shape == (m, k) and got.dtype == np.dtype(np_dtype(aux_dtype))
    expected, scale = _expected(dz, w, aux)
    assert_near(got, expected, _TOL[aux_dtype], scale=scale)


def test_batching_shares_the_kernel_as_rows_or_batches_it(rng):
    """vmap with a shared kernel is one call on more rows (dz or the aux broadcast where
    only the other is batched); with batched kernels, XLA's batched GEMM. Both as each
    member's call."""
    dz, w, aux = _draw(rng, 6, 11, 9, "float32", "float32", lead=(3,))
    ws = np.stack([w, 2 * w, -w])
    one = functools.partial(fused_gelu_input_grad, compute_type=CT)
    shared = jax.vmap(one, in_axes=(0, None, 0))
    assert jaxpr_text(shared, dz, w, aux).count("jax_epilog_fused_gelu_input_grad") == 1
    for f, args, axes in (
        (shared, (dz, w, aux), (0, None, 0)),
        (jax.vmap(one, in_axes=(None, None, 0)), (dz[0], w, aux), (None, None, 0)),
        (jax.vmap(one, in_axes=(0, None, None)), (dz, w, aux[0]), (0, None, None)),
        (jax.vmap(one, in_axes=(0, 0, 0)), (dz, ws, aux), (0, 0, 0)),
    ):
        (got,) = jax.jit(f)(*args)
        for i in range(3):
            member = [a if ax is None else a[i] for a, ax in zip(args, axes)]
            expected, scale = _expected(*member)
            assert_near(got[i], expected, _TOL["float32"], f"member {i}", scale=scale)


def test_a_linked_block_emits_one_dgelu_call_unless_cublaslt_would_refuse_it(cublaslt_accepts):
    """fused_mlp's linked backward: the DGELU call reads the GELU layer's aux (its rows
    padded to round_up(K, 8)); with N = 1 (nvmath refuses DGELU with an inner dimension
    of 1) or one row (cuBLASLt plans it, then refuses every launch) it is XLA's math."""
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)

    def grad_text(m, widths):
        x, layers = sds(m, 16), [(sds(k, n), None) for k, n in zip((16, *widths), widths)]
        mlp = lambda x, layers: fused_mlp(x, layers, ("gelu", None), implementation="cublaslt")
        return cuda_text(
            jax.grad(lambda x, layers: jnp.sum(jnp.square(mlp(x, layers).astype(jnp.float32)))), x, layers
        )

    text = grad_text(33, (37, 24))
    assert sorted(problems(text)) == ["dgrad", "forward", "forward"]
    (dgrad,) = [call for call in custom_calls(text) if 'problem = "dgrad"' in call]
    # (dz (33, 24), the kernel (37, 24), the aux (33, 40)) -> the GELU layer's dz (33, 37)
    assert 'epilog = "DGELU"' in dgrad and dgrad.endswith("tensor<33x40xbf16>) -> tensor<33x37xbf16>"), dgrad
    assert "dgrad" not in problems(grad_text(33, (40, 1)))
    assert "dgrad" not in problems(grad_text(1, (40, 24)))


# ------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
def test_a_gelu_link_in_fused_mlp_lowers_to_a_dgelu_input_gradient_gemm(rng):
    x, w1, b1, w2, b2 = (
        jnp.asarray(rng.standard_normal(s) / 4, jnp.bfloat16)
        for s in ((64, 40), (40, 72), (72,), (72, 24), (24,))
    )
    mlp = functools.partial(fused_mlp, activations=("gelu", None), implementation="cublaslt")
    loss = lambda x, layers: mlp(x, layers).astype(jnp.float32).sum()
    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, [(w1, b1), (w2, b2)]).as_text()
    assert f"@{TARGET_NAME}(" in text and 'problem = "dgrad"' in text and '"DGELU"' in text, text


@pytest.mark.gpu
@pytest.mark.parametrize(
    "dtype,aux_dtype",
    [("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float32"), ("float32", "float32")],
)
def test_gelu_input_grad_matches_nvmath_dgelu_directly(rng, dtype, aux_dtype):
    """The DGELU input-gradient GEMM equals nvmath's own Matmul with the DGELU epilog on
    the same inputs, and a float64 oracle."""
    import cupy as cp
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    m, n, k = 300, 133, 96 + 5  # dz (m, n), kernel (k, n), result (m, k)
    width = aux_padded_width("gelu", k)
    dz = jnp.asarray(rng.standard_normal((m, n)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(n), dtype)
    aux = jnp.asarray(rng.standard_normal((m, width)), aux_dtype)
    f = jax.jit(functools.partial(fused_gelu_input_grad, compute_type=CT))
    assert '"DGELU"' in f.lower(dz, w, aux).as_text()
    (got,) = f(dz, w, aux)
    assert got.shape == (m, k) and got.dtype == aux_dtype

    a = device_array(w, dtype, (k, n), (n, 1))  # the kernel as stored, read transposed
    bm = device_array(dz, dtype, (n, m), (1, n))  # column-major dz^T
    c = device_array(np.zeros((m, k)), aux_dtype, (k, m), (1, k))
    gelu_aux = device_array(aux, aux_dtype, (width, m), (1, width))
    with Matmul(a, bm, c=c, beta=0.0) as mm:
        mm.plan(epilog=MatmulEpilog.DGELU, epilog_inputs={"gelu_aux": gelu_aux})
        d_nv = mm.execute()
    bits = np.uint32 if aux_dtype == "float32" else np.uint16
    nv = cp.asnumpy(d_nv.view(bits)).view(np_dtype(aux_dtype)).astype(np.float64).T

    z = np.asarray(aux, np.float64)[:, :k]
    dh = np.asarray(dz, np.float64) @ np.asarray(w, np.float64).T
    t = np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)
    dgelu = 0.5 * (1 + np.tanh(t)) + 0.5 * z * (1 - np.tanh(t) ** 2) * np.sqrt(2 / np.pi) * (
        1 + 3 * 0.044715 * z**2
    )
    # Largest errors over five draws on the H200, against the oracle: 3.9e-3 (bfloat16),
    # 5.7e-4 (float16), 5.7e-6 and 6.4e-6 (float32 aux); against nvmath 0 but for float16
    # (2.2e-4).
    tol = GPU_TOL[aux_dtype] * 2 if aux_dtype == "float32" else GPU_TOL[aux_dtype]
    assert_scaled_close(got, nv, tol)
    assert_scaled_close(got, dh * dgelu, tol)
