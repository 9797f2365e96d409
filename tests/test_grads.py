"""``jax_epilog._grads``: one layer's backward GEMMs. dx is XLA's GEMM; the kernel and bias
gradients come from one fused weight-gradient op (BGRADA on a GPU) or, for ReLU (unless
``Policy.relu_bgrad_epilog``) and without a bias, from XLA's GEMM and reduction; on a
large layer every GEMM runs on the rows a fused forward pads."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ON_GPU, WEIGHT_GRAD, jaxpr_text, layer_inputs, round_operand

import jax_epilog
from jax_epilog import override_policy, unpack_relu_mask

fused_dense = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")


def _inputs(rng, m, k, n, dtype="float32", bias=True):
    x, w, b = layer_inputs(rng, m, k, n, dtype)
    return x, w, b if bias else None


@pytest.mark.parametrize("activation", ["gelu", None, "relu"])
def test_backward_computes_the_bias_gradient_only_with_a_bias(rng, activation):
    """With a bias, GELU and no activation take dkernel and dbias from one fused
    weight-gradient op, ReLU from XLA's GEMM and one more reduction; without a bias, a
    plain GEMM and no reduction."""
    jaxprs = {}
    layer = functools.partial(fused_dense, activation=activation)
    grad = jax.grad(lambda x, w, b: layer(x, w, b).sum(), argnums=(0, 1))
    for with_bias in (True, False):
        jaxprs[with_bias] = jaxpr_text(grad, *_inputs(rng, 6, 12, 10, bias=with_bias))
    fused = activation != "relu"
    assert jaxprs[True].count(WEIGHT_GRAD) == (1 if fused else 0)
    assert jaxprs[True].count("dot_general") == (1 if fused else 2)  # dx's GEMM [and dkernel's]
    assert jaxprs[False].count(WEIGHT_GRAD) == 0
    assert jaxprs[False].count("dot_general") == 2
    extra_sums = jaxprs[True].count("reduce_sum") - jaxprs[False].count("reduce_sum")
    assert extra_sums == (0 if fused else 1)


def test_relu_bgrad_epilog_takes_relus_weight_gradients_from_the_fused_op(rng):
    """``relu_bgrad_epilog``: ReLU's kernel and bias gradients from the fused op too, with
    the same values as XLA's GEMM and reduction give."""
    x, w, b = _inputs(rng, 37, 19, 11)
    loss = lambda x, w, b: jnp.sum(jnp.sin(fused_dense(x, w, b, activation="relu")))
    grad = lambda: jax.jit(jax.grad(lambda *a: loss(*a), argnums=(0, 1, 2)))  # traced afresh
    assert WEIGHT_GRAD not in jaxpr_text(grad(), x, w, b)
    xla = grad()(x, w, b)
    with override_policy(relu_bgrad_epilog=True):
        assert WEIGHT_GRAD in jaxpr_text(grad(), x, w, b)
        fused = grad()(x, w, b)
    for got, want in zip(fused, xla, strict=True):
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(np.abs(want).max())
        )


@pytest.mark.parametrize("activation", [None, "relu"], ids=str)
@pytest.mark.parametrize("name", ["COMPUTE_32F_FAST_TF32", "COMPUTE_32F_FAST_16F", "COMPUTE_32F_FAST_16BF"])
def test_fast_compute_types_round_the_backward_gemms_operands_too(rng, name, activation):
    """Each backward GEMM may read its float32 operands (dz, the kernel, x) rounded as the
    compute type says, as the forward's may (test_dense.py): on the CPU exactly so; on a
    GPU within that rounding of the exact gradients. The bias gradient sums dz.

    With no activation or ReLU, dz is dy or 0, so the reference's rounding of dz is the
    op's exactly (GELU's dz, formed in float32 by the op and in float64 here, may round to
    the neighbouring half value: that is no test of the GEMMs)."""
    r = functools.partial(round_operand, compute_type=name)
    for _ in range(100):  # ReLU: no rounded pre-activation near the kink
        x, w, b = (np.asarray(a) for a in _inputs(rng, 33, 129, 65))
        z = r(x) @ r(w) + b
        if np.abs(z).min() > 1e-4:
            break
    else:
        raise AssertionError("could not draw inputs clear of the ReLU kink")
    dz = rng.standard_normal((33, 65)).astype(np.float32)  # dy
    layer = lambda *a: fused_dense(*a, activation=activation, compute_type=name)
    got = jax.jit(lambda dy, *a: jax.vjp(layer, *a)[1](dy))(dz, x, w, b)
    if activation == "relu":
        _, aux = jax.jit(lambda *a: fused_dense(*a, activation="relu", compute_type=name, return_aux=True))(
            x, w, b
        )
        mask = np.asarray(unpack_relu_mask(aux, 65))
        assert ON_GPU or (mask == (z > 0)).all()  # on a GPU cuBLASLt's own z decides
        dz = dz * mask
    x64, w64, dz64 = (np.abs(np.asarray(a, np.float64)) for a in (x, w, dz))
    scales = ((dz64 @ w64.T).max(), (x64.T @ dz64).max(), dz64.sum(0).max())
    exact = (dz @ np.asarray(w, np.float64).T, np.asarray(x, np.float64).T @ dz, dz.sum(0, dtype=np.float64))
    if ON_GPU:
        tol = 2 * (2.0**-7 if name.endswith("16BF") else 2.0**-10)  # both operands rounded
        want = exact
    else:
        tol = 2e-6  # float32 accumulation only
        want = (r(dz) @ r(w).T, r(x).T @ r(dz), exact[2])
        for what, ex, ref, scale in zip(("dx", "dkernel"), exact, want, scales):
            assert np.abs(ex - ref).max() > 20 * tol * scale, what  # rounding the tolerance cannot hide
    for what, g, ref, scale in zip(("dx", "dkernel", "dbias"), got, want, scales):
        err = np.abs(np.asarray(g, np.float64) - ref).max() / scale
        assert err <= tol, f"{what}: max error {err:.3g} of the scale {scale:.3g} > {tol}"


@pytest.mark.parametrize(
    "activation, shape, padded",
    [
        ("relu", (8192, 1020, 4097), (1024, 4104)),
        ("gelu", (1024, 1024, 4097), (1024, 4104)),
        ("gelu", (1024, 1020, 4097), None),
    ],
)
def test_gradient_of_an_unaligned_large_layer_runs_on_padded_rows(shape, padded, activation):
    """Under jax.grad, "auto"'s large unaligned layer is XLA's program on the operands
    padded as the fused call pads them (8192x1020->4097 as 8192x1024->4104), where XLA's
    GEMMs run on aligned rows, and "cublaslt"'s backward runs its GEMMs on those padded
    rows too; a layer too small to pad (M*N*K < 2**32) keeps the user's shapes."""
    m, k, n = shape
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (n,))]
    for implementation in ("auto", "cublaslt"):
        f = functools.partial(jax_epilog.fused_dense, activation=activation, implementation=implementation)
        loss = lambda x, w, b, f=f: jnp.sum(f(x, w, b).astype(jnp.float32))
        text = jaxpr_text(jax.grad(loss, argnums=(0, 1, 2)), *args)
        assert ("jax_epilog_fused_matmul" in text) == (implementation == "cublaslt")
        if padded:
            assert f"bf16[{m},{padded[0]}]" in text and f"bf16[{padded[0]},{padded[1]}]" in text
        else:
            assert " pad[" not in text


def test_padded_backward_gemms_give_the_unpadded_gradients(rng):
    """With padding at any size (bfloat16 K = 17, N = 9 pad to 24 and 16) the backward's
    GEMMs run on the padded rows and the gradients, cut back, are those of the unpadded
    program (``row_bytes=1``), to bfloat16's rounding (XLA may sum in another order)."""
    x, w, b = _inputs(rng, 33, 17, 9, "bfloat16")
    loss = lambda x, w, b: jnp.sum(jnp.sin(fused_dense(x, w, b, activation="gelu").astype(jnp.float32)))
    grad = lambda: jax.grad(lambda *a: loss(*a), argnums=(0, 1, 2))  # traced afresh
    with override_policy(pad_min_rows=0, pad_min_work=0):
        assert "bf16[24,16]" in jaxpr_text(grad(), x, w, b)
        padded = jax.jit(grad())(x, w, b)
    with override_policy(pad_min_rows=0, pad_min_work=0, row_bytes=1):
        assert " pad[" not in jaxpr_text(grad(), x, w, b)
        unpadded = jax.jit(grad())(x, w, b)
    for got, want, primal in zip(padded, unpadded, (x, w, b), strict=True):
        assert got.shape == primal.shape and got.dtype == primal.dtype
        want = np.asarray(want, np.float32)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * float(np.abs(want).max())
        )
