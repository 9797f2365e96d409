"""``jax_epilog.fused_mlp``: values and gradients against a float64 reference for every
implementation, the linked backward (a GELU layer's derivative in the next layer's GEMM),
"auto"'s paths on small layers through the policy, and transformations.

On a CPU every primitive runs its reference math; on a GPU the same tests run cuBLASLt's
kernels (the forward epilogs and the DGELU input-gradient GEMM), so this file doubles as a
GPU test. Which blocks "auto" links, fuses or stacks: test_dispatch.py; argument errors:
test_checks.py; the Flax layers: test_linen.py, test_nnx.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    FUSED,
    GELU_INPUT_GRAD,
    ON_GPU,
    WEIGHT_GRAD,
    assert_near,
    assert_relatively_close,
    dot_shapes,
    jaxpr_text,
    np_dtype,
)
from jax.test_util import check_grads

from jax_epilog import fused_dense, fused_mlp, override_policy

DTYPES = ["float16", "bfloat16", "float32", "float64"]
IMPLEMENTATIONS = ["auto", "cublaslt", "xla"]
# Activation patterns: a GELU feeding a layer (what fused_mlp fuses) in several places.
PATTERNS = [("gelu", None), ("gelu", "gelu", "relu"), ("relu", "gelu", None), (None, "gelu", "gelu")]
# (x shape, widths): sizes that are no multiple of 8, leading dims, M = 1, a width of 1.
SHAPES = [((33, 20), (45, 7, 13)), ((2, 3, 17), (9, 31, 5)), ((1, 6), (11, 1, 4))]
SHAPE_IDS = ["33x20", "2x3x17", "1x6"]
# Largest error relative to the reference's largest entry. Half dtypes round every layer's
# output (and each backward step) to the dtype; two or three layers compound that.
TOL = {"float16": 1e-2, "bfloat16": 6e-2, "float32": 5e-3 if ON_GPU else 3e-5, "float64": 1e-12}


def _gelu(z):
    return 0.5 * z * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def reference_mlp(x, layers, activations):
    """The stack in float64 (given float64 arrays)."""
    h = x
    for (w, b), act in zip(layers, activations):
        z = h @ w + (0.0 if b is None else b)
        h = z if act is None else (jnp.maximum(z, 0) if act == "relu" else _gelu(z))
    return h


def magnitude_mlp(x, layers):
    """How large the terms are that each output of the stack sums: ``|h| @ |w| + |b|``
    layer by layer (``|act(z)| <= |z|`` for ReLU and GELU). Rounding errors scale with it,
    not with the output, which cancellation can leave near zero (one output of a
    bfloat16 stack came out 0.0 against -0.0055 from terms of order one)."""
    h = np.abs(np.asarray(x, np.float64))
    for w, b in _to64(layers):
        h = h @ np.abs(w) + (0.0 if b is None else np.abs(b))
    return h


def _to64(tree):
    return jax.tree.map(lambda a: None if a is None else np.asarray(a, np.float64), tree)


def draw(rng, x_shape, widths, dtype, activations, *, bias=True, bias_dtype=None, margin=0.02):
    """Random x, kernels ~ N(0, 1/K) and biases in ``dtype``; rows of x are redrawn until
    no ReLU pre-activation (float64, from the cast values) lies within ``margin`` of the
    kink, where rounding could flip the derivative. Returns (x, [(w, b), ...])."""
    k, layers = x_shape[-1], []
    for n in widths:
        w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np_dtype(dtype))
        b = rng.standard_normal(n).astype(np_dtype(bias_dtype or dtype)) if bias else None
        layers.append((w, b))
        k = n
    x = rng.standard_normal(x_shape).astype(np_dtype(dtype)).reshape(-1, x_shape[-1])
    for _ in range(500):
        h, bad = np.asarray(x, np.float64), np.zeros(len(x), bool)
        for (w, b), act in zip(_to64(layers), activations):
            z = h @ w + (0.0 if b is None else b)
            if act == "relu":
                bad |= (np.abs(z) < margin).any(axis=-1)
            h = z if act is None else (np.maximum(z, 0) if act == "relu" else np.asarray(_gelu(z)))
        if not bad.any():
            return x.reshape(x_shape), layers
        x[bad] = rng.standard_normal((int(bad.sum()), x.shape[-1])).astype(x.dtype)
    raise AssertionError("could not draw inputs clear of the ReLU kink")


def cases(dtypes, dtype_ids=None, *, deep_shapes=None):
    """``(dtype, activations, (x shape, widths), implementation)`` parameters: every dtype
    with every pattern, each pair with one of SHAPES, rotating so that every pattern meets
    every shape (over the dtypes) and every dtype every shape; each pair runs "cublaslt"
    (the op and its linked backward) and, in turn, "auto" or "xla" (at these sizes both
    XLA's expression: test_dispatch.py).

    ``deep_shapes``: the indices into SHAPES left to the 3-layer patterns (the others move
    on to the next one in turn)."""
    dtype_ids = dtype_ids or dtypes
    params = []
    for i, (dtype, dtype_id) in enumerate(zip(dtypes, dtype_ids)):
        for j, acts in enumerate(PATTERNS):
            for s in ((i + j + t) % len(SHAPES) for t in range(len(SHAPES))):
                if len(acts) < 3 or deep_shapes is None or s in deep_shapes:
                    break
            label = "-".join(map(str, acts))
            for implementation in ("cublaslt", ("auto", "xla")[(i + j) % 2]):
                case_id = f"{dtype_id}-{label}-{SHAPE_IDS[s]}-{implementation}"
                params.append(pytest.param(dtype, acts, SHAPES[s], implementation, id=case_id))
    return params


def _as_jnp(x, layers):
    return jnp.asarray(x), [(jnp.asarray(w), None if b is None else jnp.asarray(b)) for w, b in layers]


# --------------------------------------------------------------------------------- values


# 1x6's width-1 middle layer is left to the 2-layer pattern: behind it, x moves the third
# layer's pre-activations along one line only, which may not clear ReLU's kink (draw fails).
@pytest.mark.parametrize("dtype, activations, shape, implementation", cases(DTYPES, deep_shapes=(0, 1)))
def test_forward_matches_float64_reference(rng, dtype, activations, shape, implementation):
    x_shape, widths = shape
    x, layers = draw(rng, x_shape, widths[: len(activations)], dtype, activations)
    y = jax.jit(functools.partial(fused_mlp, activations=activations, implementation=implementation))(
        *_as_jnp(x, layers)
    )
    assert y.shape == (*x_shape[:-1], widths[len(activations) - 1]) and y.dtype == x.dtype
    expected = _reference_forward(*_to64((x, layers)), activations=activations)
    assert_near(y, expected, TOL[dtype], "y", scale=float(np.max(magnitude_mlp(x, layers))))


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_forward_is_the_stack_of_fused_dense_calls(rng, implementation):
    activations = ("gelu", "relu", "gelu", None)
    x, layers = _as_jnp(*draw(rng, (40, 24), (72, 16, 33, 8), "bfloat16", activations))

    def stacked(x, layers):
        for (w, b), act in zip(layers, activations):
            x = fused_dense(x, w, b, activation=act, implementation=implementation)
        return x

    mlp = functools.partial(fused_mlp, activations=activations, implementation=implementation)
    np.testing.assert_array_equal(jax.jit(mlp)(x, layers), jax.jit(stacked)(x, layers))


# ------------------------------------------------------------------------------ gradients


def _vjp(f, x, layers, dy):
    return jax.jit(lambda x, layers, dy: jax.vjp(f, x, layers)[1](dy))(x, layers, dy)


@functools.partial(jax.jit, static_argnames="activations")
def _reference_vjp(x, layers, dy, activations):
    """The float64 reference's VJP, compiled once per shapes and activations (the cases of
    every dtype share it)."""
    return jax.vjp(functools.partial(reference_mlp, activations=activations), x, layers)[1](dy)


_reference_forward = jax.jit(reference_mlp, static_argnames="activations")


def _assert_grads_match_reference(f, x, layers, dy, activations, tol):
    """f's VJP at (x, layers) for cotangent dy against the float64 reference's, dtypes included."""
    dx, dlayers = _vjp(f, *_as_jnp(x, layers), jnp.asarray(dy))
    ref_dx, ref_dlayers = _reference_vjp(*_to64((x, layers)), dy.astype(np.float64), tuple(activations))
    assert dx.dtype == x.dtype
    assert_near(dx, ref_dx, tol, "dx")
    for i, ((dw, db), (rw, rb), (w, b)) in enumerate(zip(dlayers, ref_dlayers, layers)):
        assert dw.dtype == w.dtype and (b is None or db.dtype == b.dtype), (i, dw.dtype, db.dtype)
        assert_near(dw, rw, tol, f"dkernel {i}")
        if b is None:
            assert db is None
        else:
            assert_near(db, rb, tol, f"dbias {i}")


@pytest.mark.parametrize(
    "dtypes, activations, shape, implementation",
    cases(
        [
            ("float16", None),
            ("bfloat16", None),
            ("bfloat16", "float32"),
            ("float32", None),
            ("float64", None),
        ],
        ["float16", "bfloat16", "bfloat16-f32bias", "float32", "float64"],
        # Three rounded backward steps need the 33 rows' averaging to meet TOL at half
        # precision. Measured in bfloat16 (XLA's own autodiff, too): with 6 rows one dkernel
        # entry came out 7% of the largest off; through 1x6's width-1 middle layer, where
        # the whole gradient is proportional to one GELU'(z), dx came out 15% off.
        deep_shapes=(0,),
    ),
)
def test_gradients_match_float64_reference_vjp(rng, dtypes, activations, shape, implementation):
    (dtype, bias_dtype), (x_shape, widths) = dtypes, shape
    x, layers = draw(rng, x_shape, widths[: len(activations)], dtype, activations, bias_dtype=bias_dtype)
    out_shape = (*x_shape[:-1], widths[len(activations) - 1])
    dy = rng.standard_normal(out_shape).astype(np_dtype(dtype))
    f = functools.partial(fused_mlp, activations=activations, implementation=implementation)
    _assert_grads_match_reference(f, x, layers, dy, activations, TOL[dtype])


@pytest.mark.parametrize(
    "dtype, implementation", [("float64", "cublaslt"), ("float32", "cublaslt"), ("float64", "auto")]
)
def test_check_grads_reverse_mode(rng, dtype, implementation):
    activations = ("relu", "gelu", None)
    # Finite-difference steps of ~1e-2 (float32): keep ReLU's kink further away.
    x, layers = draw(rng, (5, 6), (9, 7, 4), dtype, activations, margin=0.1)
    f = jax.jit(functools.partial(fused_mlp, activations=activations, implementation=implementation))
    tol = 2e-2 if dtype == "float32" else 1e-5
    check_grads(f, _as_jnp(x, layers), order=1, modes=("rev",), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_differentiate_again(rng, dtype):
    """A linked block's gradient (its DGELU input gradient among the fused primitives)
    differentiates again, as the plain stack's does: checked numerically, and the gradient
    of a gradient penalty against the float64 stack's. (Numerically in float64 only, where
    the block is the stack of fused_dense calls: float32's second-order finite differences
    are too coarse.)"""
    activations = ("relu", "gelu", None)
    x, layers = _as_jnp(*draw(rng, (5, 6), (9, 7, 4), dtype, activations, margin=0.1))
    loss = lambda mlp: lambda x, layers: jnp.sum(jnp.sin(mlp(x, layers, activations)))
    fused = loss(functools.partial(fused_mlp, implementation="cublaslt"))
    linked = GELU_INPUT_GRAD in jaxpr_text(jax.grad(fused), x, layers)
    assert linked == (dtype == "float32")  # (float64 blocks are not linked)
    if dtype == "float64":
        check_grads(jax.jit(fused), (x, layers), order=2, modes=("rev",), atol=1e-4, rtol=1e-4)
    penalty = lambda f: lambda x, layers: jnp.sum(jax.grad(f)(x, layers) ** 2)
    got = jax.jit(jax.grad(penalty(fused), argnums=(0, 1)))(x, layers)
    want = jax.jit(jax.grad(penalty(loss(reference_mlp)), argnums=(0, 1)))(*_to64((x, layers)))
    # Measured against the whole gradient's largest entry: one leaf's entries can all be small
    # beside the rest (a bias at 0.16 among entries near 6), and float32's rounding of the
    # terms they share is not. Over 3000 draws: up to 1.3e-4 of a leaf's own largest entry
    # (3 draws above 1e-4), up to 3.0e-5 of the whole gradient's.
    scale = max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(want))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_relatively_close(g, r, 1e-4 if dtype == "float32" else 1e-12, "the penalty's gradient", scale)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_auto_link_on_many_rows_matches_float64_reference_vjp(rng, dtype):
    """The linked path of "auto" (XLA forward saving z, ReLU's derivative from y > 0, DGELU
    link), which the small shapes above do not reach; leading dims fold to 8194 rows.
    Float32 blocks are the stack of fused_dense calls there. (Widths not a multiple of 8,
    which "auto" leaves to XLA in blocks too small to pad, are let through by padding at
    any size.)"""
    activations = ("gelu", "relu", None)
    x, layers = draw(rng, (2, 4097, 6), (9, 5, 3), dtype, activations)
    dy = rng.standard_normal((2, 4097, 3)).astype(np_dtype(dtype))
    f = functools.partial(fused_mlp, activations=activations)
    with override_policy(pad_min_rows=0, pad_min_work=0):
        ops = jaxpr_text(jax.grad(lambda x, layers: jnp.sum(f(x, layers))), *_as_jnp(x, layers))
        assert (GELU_INPUT_GRAD in ops) == (dtype != "float32")
        _assert_grads_match_reference(f, x, layers, dy, activations, TOL[dtype])


@pytest.mark.parametrize(
    "x_shape,activations,dtype",
    [((2, 9, 6), ("relu", "relu", None), "bfloat16"), ((2, 4097, 6), ("gelu", "relu", None), "float16")],
    ids=["stacked", "linked"],
)
def test_auto_relu_layers_feeding_a_layer_match_float64_reference_vjp(rng, dtype, x_shape, activations):
    """The numbers of "auto"'s rule for a ReLU layer feeding a layer (the fused kernel's
    mask for its backward) on small layers (the size floors at 0, padding at any size):
    in the stack of fused_dense calls, and in a linked block (8194 rows)."""
    x, layers = draw(rng, x_shape, (9, 5, 3), dtype, activations)
    dy = rng.standard_normal((*x_shape[:-1], 3)).astype(np_dtype(dtype))
    f = functools.partial(fused_mlp, activations=activations)
    with override_policy(auto_min_rows=0, auto_min_work=0, pad_min_rows=0, pad_min_work=0):
        ops = jaxpr_text(jax.grad(lambda x, layers: jnp.sum(f(x, layers))), *_as_jnp(x, layers))
        assert ops.count(FUSED) == 2  # both layers with an activation
        _assert_grads_match_reference(f, x, layers, dy, activations, TOL[dtype])


@pytest.mark.parametrize(
    "dtype, activations", [("bfloat16", ("gelu", "relu", None)), ("float16", ("relu", None))]
)
def test_auto_mid_size_block_is_the_stack_of_cublaslt_calls(rng, activations, dtype):
    """Its values and gradients are those of fused_dense(implementation="cublaslt") calls,
    and match the float64 reference (600 rows: in the rule's range, no multiple of 16;
    small layers, with the rule's size floor lowered and padding at any size)."""
    x_np, layers_np = draw(rng, (2, 300, 12), (21, 6, 9)[-len(activations) :], dtype, activations)
    x, layers = _as_jnp(x_np, layers_np)

    def stacked(x, layers):
        for (w, b), act in zip(layers, activations):
            x = fused_dense(x, w, b, activation=act, implementation="cublaslt")
        return x

    mlp = functools.partial(fused_mlp, activations=activations)
    dy = jnp.asarray(rng.standard_normal((2, 300, layers[-1][0].shape[1])).astype(np_dtype(dtype)))
    with override_policy(stack_min_work=1, pad_min_rows=0, pad_min_work=0):
        assert jaxpr_text(mlp, x, layers).count(FUSED) == len(activations)
        got = jax.jit(lambda x, layers, dy: (mlp(x, layers), jax.vjp(mlp, x, layers)[1](dy)))(x, layers, dy)
        want = jax.jit(lambda x, layers, dy: (stacked(x, layers), jax.vjp(stacked, x, layers)[1](dy)))(
            x, layers, dy
        )
        as32 = lambda tree: [np.asarray(a, np.float32) for a in jax.tree.leaves(tree)]
        for g, w in zip(as32(got), as32(want), strict=True):
            np.testing.assert_array_equal(g, w)
        _assert_grads_match_reference(mlp, x_np, layers_np, np.asarray(dy), activations, TOL[dtype])


def test_without_a_gelu_feeding_a_layer_it_is_the_stack_of_fused_dense_calls(rng):
    activations = ("relu", None, "gelu")  # the GELU is last: nothing to fuse across layers
    x, layers = _as_jnp(*draw(rng, (12, 10), (14, 6, 9), "float32", activations))

    def stacked(x, layers):
        for (w, b), act in zip(layers, activations):
            x = fused_dense(x, w, b, activation=act)
        return x

    mlp = functools.partial(fused_mlp, activations=activations)
    loss = lambda f: lambda x, layers: jnp.sum(jnp.sin(f(x, layers)))
    assert GELU_INPUT_GRAD not in jaxpr_text(jax.grad(loss(mlp)), x, layers)
    got, want = (jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, layers) for f in (mlp, stacked))
    jax.tree.map(np.testing.assert_array_equal, got, want)
    # and forward mode works where fused_dense's does ("auto" runs XLA's expression here)
    jax.jvp(lambda x: mlp(x, layers), (x,), (x,))


def test_cublaslt_takes_relu_layers_weight_gradients_from_xla_as_fused_dense_does(rng):
    """With "cublaslt" every layer with a bias gets one BGRADA weight-gradient GEMM, except
    ReLU layers: XLA's GEMM and reduction, as in fused_dense's backward."""
    activations = ("relu", "gelu", None)
    x, layers = _as_jnp(*draw(rng, (12, 10), (14, 6, 9), "float32", activations))
    mlp = functools.partial(fused_mlp, activations=activations, implementation="cublaslt")
    ops = jaxpr_text(jax.grad(lambda x, layers: jnp.sum(jnp.sin(mlp(x, layers))), argnums=(0, 1)), x, layers)
    assert ops.count(WEIGHT_GRAD) == 2  # the GELU and the linear layer
    relu_only = functools.partial(fused_mlp, activations=("relu",), implementation="cublaslt")
    ops = jaxpr_text(jax.grad(lambda x, layers: jnp.sum(relu_only(x, layers)), argnums=(0, 1)), x, layers[:1])
    assert WEIGHT_GRAD not in ops


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_linked_block_runs_its_xla_gemms_on_padded_rows(implementation):
    """In a linked block whose layers are large enough for their calls to pad K and N
    (8192x1020->4100->1020), every XLA GEMM runs on the padded rows, as fused_dense's
    backward does: "auto"'s forward of the layer it does not fuse (the last, without an
    activation), and the backward's (dx; "auto"'s kernel gradients). Every GEMM's widths
    are multiples of 8."""
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    x, layers = sds(8192, 1020), [(sds(1020, 4100), sds(4100)), (sds(4100, 1020), sds(1020))]
    mlp = functools.partial(fused_mlp, activations=("gelu", None), implementation=implementation)
    grad = jax.grad(lambda x, layers: jnp.sum(mlp(x, layers).astype(jnp.float32)), argnums=(0, 1))
    assert GELU_INPUT_GRAD in jaxpr_text(grad, x, layers)
    forward = dot_shapes(mlp, x, layers)
    assert forward == ([(8192, 1024)] if implementation == "auto" else []), forward
    shapes = dot_shapes(grad, x, layers)
    assert len(shapes) > len(forward) and all(d % 8 == 0 for shape in shapes for d in shape[-2:]), shapes


def test_cublaslt_linked_backward_on_padded_rows_matches_float64_reference_vjp(rng):
    """The padded linked backward's values, with padding at any size: bfloat16 widths
    6 -> 9 -> 5 -> 3 padded to 8 and 16 ("auto" links such blocks from 8192 rows:
    test_auto_link_on_many_rows_matches_float64_reference_vjp)."""
    activations = ("gelu", "relu", None)
    x, layers = draw(rng, (37, 6), (9, 5, 3), "bfloat16", activations)
    dy = rng.standard_normal((37, 3)).astype(np_dtype("bfloat16"))
    f = functools.partial(fused_mlp, activations=activations, implementation="cublaslt")
    with override_policy(pad_min_rows=0, pad_min_work=0):
        assert "bf16[37,8]" in jaxpr_text(
            jax.grad(lambda x, layers: jnp.sum(f(x, layers))), *_as_jnp(x, layers)
        )
        _assert_grads_match_reference(f, x, layers, dy, activations, TOL["bfloat16"])


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_no_bias_layers_get_no_bias_gradient(rng, implementation):
    activations = ("gelu", "gelu")
    x, layers = draw(rng, (7, 5), (6, 3), "float32", activations, bias=False)
    mlp = functools.partial(fused_mlp, activations=activations, implementation=implementation)
    _assert_grads_match_reference(mlp, x, layers, np.ones((7, 3), np.float32), activations, TOL["float32"])


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_zero_rows(rng, implementation):
    x, layers = _as_jnp(*draw(rng, (0, 5), (6, 3), "float32", ("gelu", None)))
    mlp = functools.partial(fused_mlp, activations=("gelu", None), implementation=implementation)
    assert mlp(x, layers).shape == (0, 3)
    dlayers = jax.jit(jax.grad(lambda layers: jnp.sum(mlp(x, layers))))(layers)
    for (dw, db), (w, b) in zip(dlayers, layers):
        np.testing.assert_array_equal(dw, np.zeros(w.shape))
        np.testing.assert_array_equal(db, np.zeros(b.shape))


def test_one_dimensional_x(rng):
    """A single row (x of shape (K,)) through a linked block: the op takes it as (1, K)."""
    activations = ("gelu", None)
    x, layers = draw(rng, (6,), (9, 4), "float32", activations)
    f = functools.partial(fused_mlp, activations=activations, implementation="cublaslt")
    assert jax.jit(f)(*_as_jnp(x, layers)).shape == (4,)
    _assert_grads_match_reference(
        f, x, layers, rng.standard_normal(4).astype(np.float32), activations, TOL["float32"]
    )


# ---------------------------------------------------------------------- transformations


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_vmap_shared_and_batched_weights_and_vmap_of_grad(rng, implementation):
    activations = ("gelu", None)
    xs, layers = _as_jnp(*draw(rng, (3, 10, 6), (12, 5), "float32", activations))
    f = functools.partial(fused_mlp, activations=activations, implementation=implementation)
    one = jax.jit(f)
    loop = jnp.stack([one(x, layers) for x in xs])
    np.testing.assert_allclose(
        jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, layers), loop, rtol=1e-6, atol=1e-6
    )

    members = [_as_jnp(*draw(rng, (10, 6), (12, 5), "float32", activations))[1] for _ in range(3)]
    ensemble = jax.tree.map(lambda *a: jnp.stack(a), *members)
    got = jax.jit(jax.vmap(f))(xs, ensemble)
    want = jnp.stack([one(x, member) for x, member in zip(xs, members)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    loss = lambda x, layers: jnp.sum(jnp.sin(f(x, layers)))
    got = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(xs, layers)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    want = jax.tree.map(lambda *a: jnp.stack(a), *[grad(x, layers) for x in xs])
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5), got, want)


@pytest.mark.parametrize(
    "policy", [None, jax.checkpoint_policies.everything_saveable], ids=["recompute", "save"]
)
@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_remat_and_nested_jit(rng, policy, implementation):
    activations = ("gelu", "relu", None)
    x, layers = _as_jnp(*draw(rng, (9, 7), (13, 8, 3), "float32", activations))
    f = functools.partial(fused_mlp, activations=activations, implementation=implementation)
    loss = lambda x, layers: jnp.sum(jnp.sin(jax.jit(f)(x, layers)))
    want = jax.grad(loss, argnums=(0, 1))(x, layers)
    got = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1)))(x, layers)
    # On a GPU the eager reference and the jitted, rematerialised program fuse their float32
    # elementwise math differently: a few ulps apart (1.4e-6 once on the H200).
    tol = 1e-5 if ON_GPU else 1e-6
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=tol, atol=tol), got, want)
