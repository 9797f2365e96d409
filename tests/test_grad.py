"""Gradients of fused_dense: against a float64 reference VJP, check_grads, transformations.

On the CPU the forward is the pure-JAX path; on a GPU the same tests run the cuBLASLt
forward (whose aux feeds the backward), so the whole file doubles as a GPU test.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ON_GPU,
    act_fn,
    assert_relatively_close,
    masked_relu,
    np_dtype,
    reference_relu_mask,
    round_operand,
)
from jax.test_util import check_grads

import jax_epilog
from jax_epilog import unpack_relu_mask

# These tests are about the op itself (its cuBLASLt kernel on a GPU, its reference math
# on a CPU), not about implementation="auto"'s choice: see test_implementation.py.
fused_dense = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")

ACTIVATIONS = [None, "relu", "gelu"]
DTYPES = ["float16", "bfloat16", "float32", "float64"]
# (x shape, N): M = 1, N = 1, K = 1, leading dims, sizes that are no multiple of 8.
SHAPES = [((1, 1), 1), ((1, 40), 1), ((17, 1), 9), ((3, 5), 7), ((33, 129), 65), ((2, 3, 5, 17), 37)]
SHAPE_IDS = ["1x1-N1", "1x40-N1", "17x1-N9", "3x5-N7", "33x129-N65", "2x3x5x17-N37"]
# Largest error relative to the gradient's largest entry. The half dtypes round dz to the
# operand dtype before the backward GEMMs (as XLA's own autodiff of a bf16 graph does).
GRAD_TOL = {"float16": 6e-3, "bfloat16": 5e-2, "float32": 2e-5, "float64": 1e-12}


def make_inputs(rng, x_shape, n, dtype, *, bias=True, bias_dtype=None, activation=None, margin=1e-4):
    """Random inputs cast to ``dtype``; for ReLU, resampled until no pre-activation lies
    within ``margin`` of the kink, where rounding could flip the derivative."""
    k = x_shape[-1]
    for _ in range(100):
        x = rng.standard_normal(x_shape).astype(np_dtype(dtype))
        w = (rng.standard_normal((k, n)) / np.sqrt(max(k, 1))).astype(np_dtype(dtype))
        b = rng.standard_normal(n).astype(np_dtype(bias_dtype or dtype)) if bias else None
        z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
        if b is not None:
            z = z + np.asarray(b, np.float64)
        if activation != "relu" or z.size == 0 or np.abs(z).min() > margin:
            return x, w, b
    raise AssertionError("could not draw inputs clear of the ReLU kink")


def reference_vjp(x, w, b, activation, dy, relu_mask=None):
    """Gradients of act(x @ w + b) in float64, from the *cast* inputs.

    ``relu_mask`` (from ``reference_relu_mask``) replaces ReLU's derivative (z > 0).
    """
    args = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, w) + (() if b is None else (b,))]

    def f(x, w, *b):
        z = x @ w + (b[0] if b else 0.0)
        if relu_mask is not None:
            return masked_relu(z, relu_mask)
        return act_fn(activation)(z)

    _, vjp = jax.vjp(f, *args)
    return vjp(jnp.asarray(np.asarray(dy, np.float64)))


def grad_scales(x, w, dy):
    """The natural size of each gradient's entries: the same products with every term made
    positive and act' taken as 1. Relative to these, rounding errors are bounded by the
    dtype's epsilon however much the true gradient cancels (GELU' crosses zero)."""
    x, w, dy = (np.abs(np.asarray(a, np.float64)) for a in (x, w, dy))
    x2, dy2 = x.reshape(-1, w.shape[0]), dy.reshape(-1, w.shape[1])
    return (dy2 @ w.T).max(initial=0), (x2.T @ dy2).max(initial=0), dy2.sum(axis=0).max(initial=0)


def assert_grad_close(got, want, dtype, what, scale=None):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    if want.size == 0:
        return
    scale = max(np.abs(want).max() if scale is None else scale, 1e-30)
    err = np.abs(got - want).max() / scale
    assert err <= GRAD_TOL[dtype], f"{what} ({dtype}): max error {err:.3g} of the scale {scale:.3g} > {GRAD_TOL[dtype]}"


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grads_match_float64_reference_vjp(rng, dtype, activation, with_bias, shape):
    x_shape, n = shape
    x, w, b = make_inputs(rng, x_shape, n, dtype, bias=with_bias, activation=activation)
    dy = rng.standard_normal((*x_shape[:-1], n)).astype(np_dtype(dtype))
    args = (x, w) if b is None else (x, w, b)

    def f(x, w, *b):
        return fused_dense(x, w, b[0] if b else None, activation=activation)

    _, vjp = jax.vjp(f, *map(jnp.asarray, args))
    grads = vjp(jnp.asarray(dy))
    mask = reference_relu_mask(x, w, b, dtype) if activation == "relu" else None
    want = reference_vjp(x, w, b, activation, dy, relu_mask=mask)
    for name, got, ref, primal, scale in zip(("dx", "dkernel", "dbias"), grads, want, args, grad_scales(x, w, dy)):
        assert got.dtype == primal.dtype, f"{name} dtype {got.dtype} != primal dtype {primal.dtype}"
        assert_grad_close(got, ref, dtype, name, scale)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_operands_with_float32_bias_give_float32_dbias(rng, dtype, activation):
    x, w, b = make_inputs(rng, (33, 129), 65, dtype, bias_dtype="float32", activation=activation)
    dy = rng.standard_normal((33, 65)).astype(np_dtype(dtype))
    _, vjp = jax.vjp(lambda x, w, b: fused_dense(x, w, b, activation=activation), x, w, b)
    dx, dw, db = vjp(jnp.asarray(dy))
    assert (dx.dtype, dw.dtype, db.dtype) == (np.dtype(np_dtype(dtype)),) * 2 + (np.dtype(np.float32),)
    # The epilog adds the float32 bias in float32 (test_dense.py's float32-bias tests).
    mask = reference_relu_mask(x, w, b, dtype, epilog_dtype="float32") if activation == "relu" else None
    want = reference_vjp(x, w, b, activation, dy, relu_mask=mask)
    for name, got, ref, scale in zip(("dx", "dkernel", "dbias"), (dx, dw, db), want, grad_scales(x, w, dy)):
        assert_grad_close(got, ref, dtype, name, scale)


@pytest.mark.parametrize("activation", [None, "relu"], ids=str)
@pytest.mark.parametrize("name", ["COMPUTE_32F_FAST_TF32", "COMPUTE_32F_FAST_16F", "COMPUTE_32F_FAST_16BF"])
def test_fast_compute_types_round_the_backward_gemms_operands_too(rng, name, activation):
    """Each backward GEMM may read its float32 operands (dz, the kernel, x) rounded as the
    compute type says, as the forward's may (test_dense.py): on the CPU exactly so; on a GPU
    within that rounding of the exact gradients. The bias gradient sums dz.

    With no activation or ReLU, dz is dy or 0, so the reference's rounding of dz is the
    op's exactly (GELU's dz, formed in float32 by the op and in float64 here, may round to
    the neighbouring half value: that is no test of the GEMMs)."""
    r = functools.partial(round_operand, compute_type=name)
    for _ in range(100):  # ReLU: no rounded pre-activation near the kink
        x, w, b = make_inputs(rng, (33, 129), 65, "float32")
        z = r(x) @ r(w) + b
        if np.abs(z).min() > 1e-4:
            break
    else:
        raise AssertionError("could not draw inputs clear of the ReLU kink")
    dz = rng.standard_normal((33, 65)).astype(np.float32)  # dy
    _, vjp = jax.vjp(lambda *a: fused_dense(*a, activation=activation, compute_type=name), x, w, b)
    got = vjp(jnp.asarray(dz))
    if activation == "relu":
        _, aux = fused_dense(x, w, b, activation="relu", compute_type=name, return_aux=True)
        mask = np.asarray(unpack_relu_mask(aux, 65))
        assert ON_GPU or (mask == (z > 0)).all()  # on a GPU cuBLASLt's own z decides
        dz = dz * mask
    scales = grad_scales(x, w, dz)
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


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_check_grads_reverse_mode(rng, dtype, activation, with_bias):
    # Finite differences step 1e-3 (float64) or ~1e-2 (float32): keep ReLU's kink further away.
    x, w, b = make_inputs(rng, (4, 9), 6, dtype, bias=with_bias, activation=activation, margin=0.05)
    args = (x, w) if b is None else (x, w, b)

    def f(x, w, *b):
        return fused_dense(x, w, b[0] if b else None, activation=activation)

    tol = 2e-2 if dtype == "float32" else 1e-5
    check_grads(f, tuple(map(jnp.asarray, args)), order=1, modes=("rev",), atol=tol, rtol=tol)


@pytest.mark.parametrize("return_aux", [False, True], ids=["y", "y-and-aux"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_differentiate_again(rng, dtype, activation, with_bias, return_aux):
    """Reverse over reverse (a gradient penalty, MAML, a Hessian): the fused primitives
    differentiate through their reference math, so a gradient of the op has the plain
    expression's derivatives: checked numerically (float64), and against the expression's
    gradient of a gradient penalty and its Hessian in the kernel (float64). With ``return_aux`` the
    aux is an output too (ReLU's integer bits), and the GELU aux (z) enters the loss."""
    x, w, b = make_inputs(rng, (5, 9), 6, dtype, bias=with_bias, activation=activation, margin=0.05)
    args = tuple(jnp.asarray(a) for a in ((x, w) if b is None else (x, w, b)))
    n, aux_in_loss = w.shape[1], return_aux and activation == "gelu"

    def fused(x, w, *b):
        if not return_aux:
            return jnp.sum(jnp.sin(fused_dense(x, w, b[0] if b else None, activation=activation)))
        y, aux = fused_dense(x, w, b[0] if b else None, activation=activation, return_aux=True)
        return jnp.sum(jnp.sin(y)) + (jnp.sum(jnp.cos(aux[..., :n])) if aux_in_loss else 0.0)

    def plain(x, w, *b):
        z = x @ w + (b[0] if b else 0.0)
        return jnp.sum(jnp.sin(act_fn(activation)(z))) + (jnp.sum(jnp.cos(z)) if aux_in_loss else 0.0)

    if dtype == "float64":  # (float32's second-order finite differences: off by up to 25%)
        check_grads(fused, args, order=2, modes=("rev",), atol=1e-4, rtol=1e-4)  # (seen: 1.8e-5)

    argnums = tuple(range(len(args)))
    penalty = lambda f: lambda *a: jnp.sum(jax.grad(f, argnums=1)(*a) ** 2)
    hessian = lambda f: jax.hessian(f, argnums=1)
    as64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
    tol = 1e-4 if dtype == "float32" else 1e-12
    got, want = jax.grad(penalty(fused), argnums)(*args), jax.grad(penalty(plain), argnums)(*as64)
    for name, g, r in zip(("x", "kernel", "bias"), got, want):
        assert_relatively_close(g, r, tol, f"penalty's gradient in {name}")
    assert_relatively_close(hessian(fused)(*args), hessian(plain)(*as64), tol, "Hessian in the kernel")


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_gradients_of_a_tf32_layer_differentiate_again(rng, activation):
    """A float32 layer with COMPUTE_32F_FAST_TF32 keeps TF32 in its second derivatives
    (tests/test_lowering.py; on a CPU the operands' rounding is emulated): its gradient
    penalty's gradient and Hessian are the plain expression's to TF32's precision."""
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (7, 19), 10, "float32", activation=activation, margin=0.05))
    tf32 = functools.partial(fused_dense, activation=activation, compute_type="COMPUTE_32F_FAST_TF32")
    fused = lambda x, w, b: jnp.sum(jnp.sin(tf32(x, w, b)))
    plain = lambda x, w, b: jnp.sum(jnp.sin(act_fn(activation)(x @ w + b)))
    penalty = lambda f: lambda *a: jnp.sum(jax.grad(f, argnums=1)(*a) ** 2)
    as64 = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, w, b)]
    tol = 1e-2  # (seen: up to 2.0e-3 over 120 draws; TF32 keeps 10 mantissa bits)
    got, want = jax.grad(penalty(fused), (0, 1, 2))(x, w, b), jax.grad(penalty(plain), (0, 1, 2))(*as64)
    for name, g, r in zip(("x", "kernel", "bias"), got, want):
        assert_relatively_close(g, r, tol, f"penalty's gradient in {name}")
    hessian = lambda f: jax.hessian(f, argnums=1)
    assert_relatively_close(hessian(fused)(x, w, b), hessian(plain)(*as64), tol, "Hessian in the kernel")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gelu_aux_is_differentiable_and_relu_mask_is_not(rng, dtype):
    x, w, b = make_inputs(rng, (2, 5, 13), 11, dtype)

    def with_aux(x, w, b):
        y, aux = fused_dense(x, w, b, activation="gelu", return_aux=True)
        return y.sum() + (aux[..., :11] ** 2).sum()

    def plain(x, w, b):
        z = x @ w + b
        return jax.nn.gelu(z, approximate=True).sum() + (z**2).sum()

    got = jax.grad(with_aux, argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(plain, argnums=(0, 1, 2))(*(jnp.asarray(np.asarray(a, np.float64)) for a in (x, w, b)))
    for name, g, r in zip(("dx", "dkernel", "dbias"), got, want):
        assert_grad_close(g, r, dtype, name)
    # The ReLU mask is integer data: gradients flow through y only.
    relu_loss = lambda x: fused_dense(x, w, b, activation="relu", return_aux=True)[0].sum()
    dx = jax.grad(relu_loss)(x)
    assert_grad_close(dx, reference_vjp(x, w, b, "relu", np.ones((2, 5, 11)))[0], dtype, "dx")


def test_transformations_agree(rng):
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (8, 12), 10, "float32", activation="relu"))

    def loss(x, w, b):
        return jnp.sum(fused_dense(x, w, b, activation="relu") ** 2)

    base = jax.grad(loss, argnums=(0, 1, 2))(x, w, b)
    variants = {
        "jit(grad)": jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
        "value_and_grad": lambda *a: jax.value_and_grad(loss, argnums=(0, 1, 2))(*a)[1],
        "nested jit": jax.jit(jax.grad(jax.jit(loss), argnums=(0, 1, 2))),
        "remat default": jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)),
        "remat nothing saveable": jax.grad(
            jax.checkpoint(loss, policy=jax.checkpoint_policies.nothing_saveable), argnums=(0, 1, 2)
        ),
        "remat everything saveable": jax.grad(
            jax.checkpoint(loss, policy=jax.checkpoint_policies.everything_saveable), argnums=(0, 1, 2)
        ),
    }
    for name, f in variants.items():
        for g, g0 in zip(f(x, w, b), base):
            np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=1e-6, atol=1e-6, err_msg=name)


def test_vmap_of_grad_gives_per_example_gradients(rng):
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (6, 12), 10, "float32", activation="gelu"))
    per_example = jax.vmap(jax.grad(lambda x, w, b: fused_dense(x, w, b, activation="gelu").sum(), argnums=1),
                           in_axes=(0, None, None))(x, w, b)
    for i in range(6):
        one = jax.grad(lambda w, xi=x[i]: fused_dense(xi, w, b, activation="gelu").sum())(w)
        # Batched and unbatched float32 arithmetic round differently: ~1e-6 apart.
        np.testing.assert_allclose(np.asarray(per_example[i]), np.asarray(one), rtol=1e-4, atol=1e-5)


def test_grad_of_vmapped_ensemble(rng):
    members = 3
    x = jnp.asarray(rng.standard_normal((5, 12)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((members, 12, 7)) / 4, jnp.float32)
    bs = jnp.asarray(rng.standard_normal((members, 7)), jnp.float32)

    def loss(ws, bs):
        return jnp.sum(jax.vmap(lambda w, b: fused_dense(x, w, b, activation="gelu"))(ws, bs) ** 2)

    def plain(ws, bs):
        z = jnp.einsum("mk,ekn->emn", x, ws, precision=jax.lax.Precision.HIGHEST)  # no TF32 on a GPU
        return jnp.sum(jax.nn.gelu(z + bs[:, None], approximate=True) ** 2)

    for g, r in zip(jax.grad(loss, argnums=(0, 1))(ws, bs), jax.grad(plain, argnums=(0, 1))(ws, bs)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("inner_axes", [(None, 0, 0), (0, 0, 0)], ids=["x-shared", "x-per-member"])
@pytest.mark.parametrize(
    "outer_axes", [(0, None, None), (None, 0, None), (None, None, 0), (0, 0, 0), (1, 1, None)], ids=str
)
def test_vmap_of_an_ensemble_over_any_operand_matches_plain_math(rng, outer_axes, inner_axes, activation):
    """A vmap around an ensemble (members_p), over any of its operands: the examples fold
    into the rows, or the new axis becomes an outer member dimension (broadcasting the
    operands it leaves out); values and gradients in float64, ReLU's and GELU's."""
    outer, members, m, k, n = 2, 3, 5, 7, 9
    inner_shapes = [(members,) * (a == 0) + s for a, s in zip(inner_axes, ((m, k), (k, n), (n,)))]
    shapes = [s if a is None else s[:a] + (outer,) + s[a:] for a, s in zip(outer_axes, inner_shapes)]
    x, w, b = (rng.standard_normal(s) for s in shapes)

    def nested(layer):
        return jax.vmap(jax.vmap(layer, in_axes=inner_axes), in_axes=outer_axes)

    loss = lambda layer: lambda *a: jnp.sum(jnp.sin(nested(layer)(*a)))
    fused = lambda x, w, b: fused_dense(x, w, b, activation=activation)
    plain = lambda x, w, b: act_fn(activation)(x @ w + b)
    np.testing.assert_allclose(nested(fused)(x, w, b), nested(plain)(x, w, b), rtol=1e-12, atol=1e-12)
    got = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2)))(x, w, b)
    for g, r in zip(got, jax.grad(loss(plain), argnums=(0, 1, 2))(x, w, b), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-12)
    assert "jax_epilog_members" in str(jax.make_jaxpr(nested(fused))(x, w, b))


def test_forward_mode_is_refused_clearly(rng):
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (3, 5), 7, "float32"))
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(lambda x: fused_dense(x, w, b, activation="relu"), (x,), (x,))


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_empty_dimensions_have_defined_gradients(rng, activation):
    w = jnp.asarray(rng.standard_normal((5, 7)), jnp.float32)
    b = jnp.asarray(rng.standard_normal(7), jnp.float32)
    dx, dw, db = jax.grad(lambda x, w, b: fused_dense(x, w, b, activation=activation).sum(), argnums=(0, 1, 2))(
        jnp.zeros((0, 5), jnp.float32), w, b
    )
    assert dx.shape == (0, 5)
    np.testing.assert_array_equal(np.asarray(dw), 0)
    np.testing.assert_array_equal(np.asarray(db), 0)
    # K = 0: y = act(bias) in every row, so dbias = m * act'(bias).
    xk = jnp.zeros((4, 0), jnp.float32)
    db = jax.grad(lambda b: fused_dense(xk, jnp.zeros((0, 7), jnp.float32), b, activation=activation).sum())(b)
    want = 4 * jax.vmap(jax.grad(act_fn(activation)))(b)
    np.testing.assert_allclose(np.asarray(db), np.asarray(want), rtol=1e-6)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # the CPU backend cannot donate
def test_training_step_with_donated_parameters(rng):
    x = jnp.asarray(rng.standard_normal((16, 12)), jnp.float32)
    params = {
        "w": jnp.asarray(rng.standard_normal((12, 8)) / 4, jnp.float32),
        "b": jnp.zeros(8, jnp.float32) + 0.1,
    }

    @functools.partial(jax.jit, donate_argnums=0)
    def step(params, x):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(fused_dense(x, p["w"], p["b"], activation="gelu") ** 2))(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    losses = []
    for _ in range(5):
        params, loss = step(params, x)
        losses.append(float(loss))
    assert losses[-1] < losses[0]


def test_mlp_training_curve_matches_plain_jnp(rng):
    """A 4-layer ReLU MLP trained 50 steps: the same loss curve as the same model in jnp."""
    sizes = [20, 33, 17, 9, 1]
    x = jnp.asarray(rng.standard_normal((64, 20)), jnp.float32)
    target = jnp.sin(x[:, :1] * 2) + 0.1 * x[:, 1:2]
    params = [
        (jnp.asarray(rng.standard_normal((i, o)) / np.sqrt(i), jnp.float32), jnp.full((o,), 0.05, jnp.float32))
        for i, o in itertools.pairwise(sizes)
    ]

    def mlp(params, x, dense):
        for i, (w, b) in enumerate(params):
            x = dense(x, w, b, None if i == len(params) - 1 else "relu")
        return x

    fused = lambda x, w, b, act: fused_dense(x, w, b, activation=act)
    plain = lambda x, w, b, act: (jax.nn.relu if act else (lambda z: z))(
        jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST) + b  # float32 like the op: no TF32 on a GPU
    )

    def train(dense):
        @jax.jit
        def step(params):
            loss, grads = jax.value_and_grad(lambda p: jnp.mean((mlp(p, x, dense) - target) ** 2))(params)
            return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

        p, losses = params, []
        for _ in range(50):
            p, loss = step(p)
            losses.append(float(loss))
        return np.array(losses)

    fused_losses, plain_losses = train(fused), train(plain)
    assert fused_losses[-1] < 0.9 * fused_losses[0]  # it learns; the curve check is the point
    np.testing.assert_allclose(fused_losses, plain_losses, rtol=2e-3)


@pytest.mark.parametrize("activation", ["gelu", None, "relu"])
def test_backward_computes_the_bias_gradient_only_with_a_bias(rng, activation):
    """With a bias, GELU and no activation take dkernel and dbias from one fused
    weight-gradient op (one cuBLASLt GEMM with the BGRADA epilog on a GPU), ReLU from XLA's
    GEMM and one more reduction; without a bias, a plain GEMM and no reduction."""
    jaxprs = {}
    layer = functools.partial(fused_dense, activation=activation, implementation="cublaslt")
    grad = jax.grad(lambda x, w, b: layer(x, w, b).sum(), argnums=(0, 1))
    for with_bias in (True, False):
        x, w, b = make_inputs(rng, (6, 12), 10, "float32", bias=with_bias)
        jaxprs[with_bias] = str(jax.make_jaxpr(grad)(x, w, b))
    fused = activation != "relu"
    assert jaxprs[True].count("jax_epilog_fused_weight_grad") == (1 if fused else 0)
    assert jaxprs[True].count("dot_general") == (1 if fused else 2)  # dx's GEMM [and dkernel's]
    assert jaxprs[False].count("jax_epilog_fused_weight_grad") == 0
    assert jaxprs[False].count("dot_general") == 2
    extra_sums = jaxprs[True].count("reduce_sum") - jaxprs[False].count("reduce_sum")
    assert extra_sums == (0 if fused else 1)
