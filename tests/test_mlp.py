"""fused_mlp: values and gradients against a float64 reference, the DGELU input-gradient
primitive, transformations, errors and the Flax layer.

On a CPU every primitive runs its reference math; on a GPU the same tests run cuBLASLt's
kernels (the forward epilogs and the DGELU input-gradient GEMM), so this file doubles as a
GPU test.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ON_GPU, act_fn, assert_near, assert_relatively_close, dot_shapes, np_dtype
from jax.test_util import check_grads

from jax_epilog import _mlp as mlp_module
from jax_epilog import _primitive as primitive_module
from jax_epilog import fused_dense, fused_mlp
from jax_epilog._epilogs import ComputeType, aux_padded_width
from jax_epilog._primitive import fused_gelu_input_grad

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
CT = ComputeType.COMPUTE_32F


def _gelu(z):
    return 0.5 * z * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def reference_mlp(x, layers, activations):
    """The stack in float64 (x64 arrays via NumPy-free jnp ops under enable_x64)."""
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
    """``(dtype, activations, (x shape, widths))`` parameters: every dtype with every pattern,
    each pair with one of SHAPES, rotating so that every pattern meets every shape (over the
    dtypes) and every dtype every shape, without multiplying the number of cases.

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
            params.append(pytest.param(dtype, acts, SHAPES[s], id=f"{dtype_id}-{label}-{SHAPE_IDS[s]}"))
    return params


def _as_jnp(x, layers):
    return jnp.asarray(x), [(jnp.asarray(w), None if b is None else jnp.asarray(b)) for w, b in layers]


# --------------------------------------------------------------------------------- values


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
# 1x6's width-1 middle layer is left to the 2-layer pattern: behind it, x moves the third
# layer's pre-activations along one line only, which may not clear ReLU's kink (draw fails).
@pytest.mark.parametrize("dtype, activations, shape", cases(DTYPES, deep_shapes=(0, 1)))
def test_forward_matches_float64_reference(rng, dtype, activations, shape, implementation):
    x_shape, widths = shape
    x, layers = draw(rng, x_shape, widths[: len(activations)], dtype, activations)
    y = jax.jit(functools.partial(fused_mlp, activations=activations, implementation=implementation))(
        *_as_jnp(x, layers)
    )
    assert y.shape == (*x_shape[:-1], widths[len(activations) - 1]) and y.dtype == x.dtype
    with jax.enable_x64():
        expected = reference_mlp(*_to64((x, layers)), activations)
    assert_near(y, expected, TOL[dtype], "y", scale=float(np.max(magnitude_mlp(x, layers))))


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_forward_is_the_stack_of_fused_dense_calls(rng, implementation):
    activations = ("gelu", "relu", "gelu", None)
    x, layers = draw(rng, (40, 24), (72, 16, 33, 8), "bfloat16", activations)
    x, layers = _as_jnp(x, layers)
    stacked = x
    for (w, b), act in zip(layers, activations):
        stacked = fused_dense(stacked, w, b, activation=act, implementation=implementation)
    np.testing.assert_array_equal(fused_mlp(x, layers, activations, implementation=implementation), stacked)


# ------------------------------------------------------------------------------ gradients


def _grads(f, x, layers, dy):
    _, vjp = jax.vjp(f, x, layers)
    return vjp(dy)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "dtypes, activations, shape",
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
    f = jax.jit(functools.partial(fused_mlp, activations=activations, implementation=implementation))
    _assert_grads_match_reference(f, x, layers, dy, activations, TOL[dtype])


def _assert_grads_match_reference(f, x, layers, dy, activations, tol):
    """f's VJP at (x, layers) for cotangent dy against the float64 reference's, dtypes included."""
    dx, dlayers = _grads(f, *_as_jnp(x, layers), jnp.asarray(dy))
    with jax.enable_x64():
        ref_dx, ref_dlayers = _grads(
            functools.partial(reference_mlp, activations=activations),
            *_to64((x, layers)),
            dy.astype(np.float64),
        )
    assert dx.dtype == x.dtype
    assert_near(dx, ref_dx, tol, "dx")
    for i, ((dw, db), (rw, rb), (w, b)) in enumerate(zip(dlayers, ref_dlayers, layers)):
        assert dw.dtype == w.dtype and db.dtype == b.dtype, (i, dw.dtype, db.dtype)
        assert_near(dw, rw, tol, f"dkernel {i}")
        assert_near(db, rb, tol, f"dbias {i}")


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_check_grads_reverse_mode(rng, dtype, implementation):
    activations = ("relu", "gelu", None)
    # Finite-difference steps of ~1e-2 (float32): keep ReLU's kink further away.
    x, layers = draw(rng, (5, 6), (9, 7, 4), dtype, activations, margin=0.1)
    f = functools.partial(fused_mlp, activations=activations, implementation=implementation)
    tol = 2e-2 if dtype == "float32" else 1e-5
    check_grads(f, _as_jnp(x, layers), order=1, modes=("rev",), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gradients_differentiate_again(rng, dtype):
    """A linked block's gradient (its DGELU input gradient among the fused primitives)
    differentiates again, as the plain stack's does: checked numerically, and the gradient
    of a gradient penalty against the float64 stack's. (Numerically in float64 only, where
    the block is the stack of fused_dense calls: float32's second-order finite differences
    are too coarse, see test_grad.py.)"""
    activations = ("relu", "gelu", None)
    x, layers = _as_jnp(*draw(rng, (5, 6), (9, 7, 4), dtype, activations, margin=0.1))
    loss = lambda mlp: lambda x, layers: jnp.sum(jnp.sin(mlp(x, layers, activations)))
    fused = loss(functools.partial(fused_mlp, implementation="cublaslt"))
    linked = "jax_epilog_fused_gelu_input_grad" in _ops(jax.grad(fused), x, layers)
    assert linked == (dtype == "float32")  # (float64 blocks are not linked)
    if dtype == "float64":  # (float32's second-order finite differences: see test_grad.py)
        check_grads(fused, (x, layers), order=2, modes=("rev",), atol=1e-4, rtol=1e-4)
    penalty = lambda f: lambda x, layers: jnp.sum(jax.grad(f)(x, layers) ** 2)
    got = jax.grad(penalty(fused), argnums=(0, 1))(x, layers)
    want = jax.grad(penalty(loss(reference_mlp)), argnums=(0, 1))(*_as_jnp(*_to64((x, layers))))
    # Measured against the whole gradient's largest entry: one leaf's entries can all be small
    # beside the rest (a bias at 0.16 among entries near 6), and float32's rounding of the
    # terms they share is not. Over 3000 draws: up to 1.3e-4 of a leaf's own largest entry
    # (3 draws above 1e-4), up to 3.0e-5 of the whole gradient's.
    scale = max(float(jnp.max(jnp.abs(r))) for r in jax.tree.leaves(want))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_relatively_close(g, r, 1e-4 if dtype == "float32" else 1e-12, "the penalty's gradient", scale)


def _ops(f, *args) -> str:
    return str(jax.make_jaxpr(f)(*args))


@pytest.mark.parametrize("rows", [16, 8191, 8192])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_gelu_feeding_a_layer_is_differentiated_in_that_layers_gemm(rng, implementation, rows):
    """With "cublaslt" always; with "auto" from 8192 rows (where it measured faster)."""
    x, layers = _as_jnp(*draw(rng, (rows, 8), (24, 8), "bfloat16", ("gelu", None)))
    grad = jax.grad(
        lambda x, layers: jnp.sum(fused_mlp(x, layers, ("gelu", None), implementation=implementation))
    )
    fused = "jax_epilog_fused_gelu_input_grad" in _ops(grad, x, layers)
    assert fused == (implementation == "cublaslt" or (implementation == "auto" and rows >= 8192))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_auto_link_on_many_rows_matches_float64_reference_vjp(rng, monkeypatch, dtype):
    """The linked path of "auto" (XLA forward saving z, ReLU's derivative from y > 0, DGELU
    link), which the small shapes above do not reach; leading dims fold to 8194 rows.
    Float32 blocks, slower linked on the H200, are the stack of fused_dense calls there.
    (Widths not a multiple of 8, which "auto" leaves to XLA in blocks too small to pad, are
    let through here.)"""
    monkeypatch.setattr(primitive_module, "_PAD_MIN_ROWS", 0)
    monkeypatch.setattr(primitive_module, "_PAD_MIN_WORK", 0)
    activations = ("gelu", "relu", None)
    x, layers = draw(rng, (2, 4097, 6), (9, 5, 3), dtype, activations)
    dy = rng.standard_normal((2, 4097, 3)).astype(np_dtype(dtype))
    f = jax.jit(functools.partial(fused_mlp, activations=activations))
    ops = _ops(jax.grad(lambda x, layers: jnp.sum(f(x, layers))), *_as_jnp(x, layers))
    assert ("jax_epilog_fused_gelu_input_grad" in ops) == (dtype != "float32")
    _assert_grads_match_reference(f, x, layers, dy, activations, TOL[dtype])


def _sds_block(rows, widths):
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    dims = [1024, *widths]
    return sds(rows, 1024), [(sds(k, n), sds(n)) for k, n in itertools.pairwise(dims)]


def test_auto_link_fuses_large_gelu_layers_and_relu_layers_feeding_a_layer():
    """In the linked path "auto" runs the fused kernel for large GELU layers and for large
    ReLU layers whose output the next layer's GEMM reads; a last ReLU layer, whose
    consumer is unknown, and a layer without activation run XLA's expression."""
    x, layers = _sds_block(8192, (4096, 1024, 1024, 1024))
    mlp = functools.partial(fused_mlp, activations=("gelu", "relu", None, "relu"))
    assert _ops(mlp, x, layers).count("jax_epilog_fused_matmul") == 2  # the GELU and first ReLU
    grad = jax.grad(lambda x, layers: jnp.sum(mlp(x, layers).astype(jnp.float32)), argnums=(0, 1))
    assert "jax_epilog_fused_gelu_input_grad" in _ops(grad, x, layers)
    alone = _ops(lambda x, w, b: fused_dense(x, w, b, activation="relu"), x, *layers[0])
    assert "jax_epilog_fused_matmul" in alone


@pytest.mark.parametrize(
    "rows,widths,activations,fused",
    [
        (8192, (4096, 1024), ("relu", None), 1),  # the measured block: its ReLU layer
        (8192, (4096, 1024, 1024), ("relu", "relu", None), 2),
        (2048, (4096, 1024), ("relu", None), 1),  # M*N*K = 2**33: large enough
        (8192, (1024, 4096), (None, "relu"), 0),  # a last ReLU layer: XLA's autodiff
        (256, (4096, 1024), ("relu", None), 0),  # too few rows for the fused forward
        (8192, (4096, 1024), ("gelu", None), None),  # GELU links instead (DGELU)
    ],
)
def test_auto_differentiates_large_relu_layers_feeding_a_layer_through_their_mask(
    rows, widths, activations, fused
):
    """Under jax.grad the "auto" stack of fused_dense calls keeps XLA's autodiff, except for
    a large ReLU layer whose output feeds the next layer: that one runs as "cublaslt" (fused
    forward, backward from its mask), measured faster in a block (benchmarks/README.md)."""
    x, layers = _sds_block(rows, widths)
    mlp = functools.partial(fused_mlp, activations=activations)
    grad = jax.grad(lambda x, layers: jnp.sum(mlp(x, layers).astype(jnp.float32)), argnums=(0, 1))
    ops = _ops(grad, x, layers)
    if fused is None:
        assert "jax_epilog_fused_gelu_input_grad" in ops
    else:
        # fused_dense's "auto" forward under jax.grad is XLA's expression: only a layer
        # differentiated as "cublaslt" leaves a fused_matmul in the gradient's program.
        assert ops.count("jax_epilog_fused_matmul") == fused


@pytest.mark.parametrize(
    "x_shape,activations",
    [((2, 9, 6), ("relu", "relu", None)), ((2, 4097, 6), ("gelu", "relu", None))],
    ids=["stacked", "linked"],
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_auto_relu_layers_feeding_a_layer_match_float64_reference_vjp(
    rng, monkeypatch, dtype, x_shape, activations
):
    """The numbers of that rule on small layers (the size threshold lowered), in the stack
    of fused_dense calls and in a linked block (8194 rows)."""
    monkeypatch.setattr(mlp_module, "_auto_fuses", lambda act, dtype, m, n, k: act is not None)
    monkeypatch.setattr(primitive_module, "_PAD_MIN_ROWS", 0)  # odd widths, as every rule's
    monkeypatch.setattr(primitive_module, "_PAD_MIN_WORK", 0)
    x, layers = draw(rng, x_shape, (9, 5, 3), dtype, activations)
    dy = rng.standard_normal((*x_shape[:-1], 3)).astype(np_dtype(dtype))
    f = jax.jit(functools.partial(fused_mlp, activations=activations))
    ops = _ops(jax.grad(lambda x, layers: jnp.sum(f(x, layers))), *_as_jnp(x, layers))
    assert ops.count("jax_epilog_fused_matmul") == 2  # both layers with an activation
    _assert_grads_match_reference(f, x, layers, dy, activations, TOL[dtype])


@pytest.mark.parametrize(
    "rows,d,dtype,activations,stacked",
    [
        (512, 1024, "bfloat16", ("relu", None), True),
        (1000, 768, "bfloat16", ("gelu", None), True),  # a GELU feeding a layer: no link here
        (1024, 1024, "bfloat16", ("gelu", "relu", None), True),
        (1281, 1024, "bfloat16", ("gelu", None), True),
        (1536, 768, "bfloat16", ("relu", None), True),
        (1000, 1024, "float16", ("relu", None), True),
        (1536, 1024, "float16", ("gelu", "relu", None), True),
        (511, 1024, "bfloat16", ("relu", None), False),
        (1537, 1024, "bfloat16", ("gelu", None), False),
        (1537, 1024, "float16", ("relu", None), False),
        (512, 512, "bfloat16", ("relu", None), False),  # M*N*K = 2**29: too small
        (1024, 512, "bfloat16", ("relu", None), False),  # 2**30
        (1024, 512, "float16", ("relu", None), False),
        (1000, 1024, "float32", ("gelu", None), False),  # not measured: fused_dense's rule
        (1000, 1024, "bfloat16", ("relu",), False),  # one layer is fused_dense's call
    ],
)
def test_auto_runs_every_layer_of_a_mid_size_half_precision_block_as_cublaslt(
    rows, d, dtype, activations, stacked
):
    """With "auto" a bfloat16 or float16 block on 512-1536 rows with a layer of M*N*K >=
    2**31 is the stack of "cublaslt" calls (measured faster than XLA there); elsewhere at
    these sizes it is XLA's autodiff."""
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
    dims = [d, *(4 * d if i % 2 == 0 else d for i in range(len(activations)))]
    x, layers = sds(rows, d), [(sds(k, n), sds(n)) for k, n in itertools.pairwise(dims)]
    mlp = functools.partial(fused_mlp, activations=activations)
    grad = jax.grad(lambda x, layers: jnp.sum(mlp(x, layers).astype(jnp.float32)), argnums=(0, 1))
    ops = _ops(grad, x, layers)
    assert ops.count("jax_epilog_fused_matmul") == (len(activations) if stacked else 0)
    assert "jax_epilog_fused_gelu_input_grad" not in ops
    # the stack's kernel and bias gradients are "cublaslt"'s: BGRADA except for ReLU layers
    bgrada = sum(act != "relu" for act in activations) if stacked else 0
    assert ops.count("jax_epilog_fused_weight_grad") == bgrada


@pytest.mark.parametrize(
    "rows,widths,activations,fused",
    [
        (8192, (4100, 1024), ("gelu", None), True),  # links (DGELU), every call padded
        (8192, (4096, 1020), ("relu", None), True),  # a large ReLU layer feeding a layer
        (8192, (4097, 1024, 1024), ("relu", "relu", None), True),
        (8192, (4097, 100), ("gelu", None), False),  # the DGELU link 8192x4097x100 < 2**32: not padded
        (1024, (4092, 1024), ("relu", None), False),  # a mid-size block, too small to pad
    ],
)
def test_auto_rules_need_rows_the_calls_can_pad(rows, widths, activations, fused):
    """Each of "auto"'s cuBLASLt rules needs every layer's K and N multiples of 8, or the
    layer large enough (1024 rows, M*N*K >= 2**32) for its calls to pad them; the same
    blocks with aligned widths always link, fuse or stack (the tests above)."""
    x, layers = _sds_block(rows, widths)
    mlp = functools.partial(fused_mlp, activations=activations)
    grad = jax.grad(lambda x, layers: jnp.sum(mlp(x, layers).astype(jnp.float32)), argnums=(0, 1))
    assert ("jax_epilog_" in _ops(grad, x, layers)) == fused
    aligned = _sds_block(rows, tuple(w + (-w) % 8 for w in widths))
    assert "jax_epilog_" in _ops(grad, *aligned)


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
    assert "jax_epilog_fused_gelu_input_grad" in _ops(grad, x, layers)
    forward = dot_shapes(mlp, x, layers)
    assert forward == ([(8192, 1024)] if implementation == "auto" else []), forward
    shapes = dot_shapes(grad, x, layers)
    assert len(shapes) > len(forward) and all(d % 8 == 0 for shape in shapes for d in shape[-2:]), shapes


def test_cublaslt_linked_backward_on_padded_rows_matches_float64_reference_vjp(rng, monkeypatch):
    """The padded linked backward's values, with padding at any size: bfloat16 widths
    6 -> 9 -> 5 -> 3 padded to 8 and 16 ("auto" links such blocks from 8192 rows:
    test_auto_link_on_many_rows_matches_float64_reference_vjp)."""
    monkeypatch.setattr(primitive_module, "_PAD_MIN_ROWS", 0)
    monkeypatch.setattr(primitive_module, "_PAD_MIN_WORK", 0)
    activations = ("gelu", "relu", None)
    x, layers = draw(rng, (37, 6), (9, 5, 3), "bfloat16", activations)
    dy = rng.standard_normal((37, 3)).astype(np_dtype("bfloat16"))
    f = jax.jit(functools.partial(fused_mlp, activations=activations, implementation="cublaslt"))
    _assert_grads_match_reference(f, x, layers, dy, activations, TOL["bfloat16"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("activations", [("gelu", "relu", None), ("relu", None)])
def test_auto_mid_size_block_is_the_stack_of_cublaslt_calls(rng, monkeypatch, activations, dtype):
    """Its values and gradients are those of fused_dense(implementation="cublaslt") calls,
    and match the float64 reference (600 rows: in the rule's range, no multiple of 16;
    small layers, with the rule's size floor lowered)."""
    monkeypatch.setattr(mlp_module, "_AUTO_STACK_MIN_MNK", 1)
    monkeypatch.setattr(primitive_module, "_PAD_MIN_ROWS", 0)
    monkeypatch.setattr(primitive_module, "_PAD_MIN_WORK", 0)
    x_np, layers_np = draw(rng, (2, 300, 12), (21, 6, 9)[-len(activations) :], dtype, activations)
    x, layers = _as_jnp(x_np, layers_np)
    mlp_ops = _ops(functools.partial(fused_mlp, activations=activations), x, layers)
    assert mlp_ops.count("jax_epilog_fused_matmul") == len(activations)

    def stacked(x, layers):
        for (w, b), act in zip(layers, activations):
            x = fused_dense(x, w, b, activation=act, implementation="cublaslt")
        return x

    mlp = jax.jit(functools.partial(fused_mlp, activations=activations))
    dy = rng.standard_normal((2, 300, layers[-1][0].shape[1])).astype(np_dtype(dtype))
    got_y, got_vjp = jax.vjp(mlp, x, layers)
    want_y, want_vjp = jax.vjp(jax.jit(stacked), x, layers)
    as32 = lambda tree: [np.asarray(a, np.float32) for a in jax.tree.leaves(tree)]
    np.testing.assert_array_equal(as32(got_y), as32(want_y))
    for got, want in zip(as32(got_vjp(jnp.asarray(dy))), as32(want_vjp(jnp.asarray(dy))), strict=True):
        np.testing.assert_array_equal(got, want)
    _assert_grads_match_reference(mlp, x_np, layers_np, dy, activations, TOL[dtype])


def test_without_a_gelu_feeding_a_layer_it_is_the_stack_of_fused_dense_calls(rng):
    activations = ("relu", None, "gelu")  # the GELU is last: nothing to fuse across layers
    x, layers = _as_jnp(*draw(rng, (12, 10), (14, 6, 9), "float32", activations))

    def loss(f, x, layers):
        return jnp.sum(jnp.sin(f(x, layers)))

    def stacked(x, layers):
        for (w, b), act in zip(layers, activations):
            x = fused_dense(x, w, b, activation=act)
        return x

    mlp = functools.partial(fused_mlp, activations=activations)
    assert "jax_epilog_fused_gelu_input_grad" not in _ops(jax.grad(functools.partial(loss, mlp)), x, layers)
    got = jax.grad(functools.partial(loss, mlp), argnums=(0, 1))(x, layers)
    want = jax.grad(functools.partial(loss, stacked), argnums=(0, 1))(x, layers)
    jax.tree.map(np.testing.assert_array_equal, got, want)
    # and forward mode works where fused_dense's does ("auto" runs XLA's expression here)
    jax.jvp(lambda x: mlp(x, layers), (x,), (x,))


def test_cublaslt_takes_relu_layers_weight_gradients_from_xla_as_fused_dense_does(rng):
    """With "cublaslt" every layer with a bias gets one BGRADA weight-gradient GEMM, except
    ReLU layers: XLA's GEMM and reduction, as in fused_dense's backward."""
    activations = ("relu", "gelu", None)
    x, layers = _as_jnp(*draw(rng, (12, 10), (14, 6, 9), "float32", activations))
    mlp = functools.partial(fused_mlp, activations=activations, implementation="cublaslt")
    ops = _ops(jax.grad(lambda x, layers: jnp.sum(jnp.sin(mlp(x, layers))), argnums=(0, 1)), x, layers)
    assert ops.count("jax_epilog_fused_weight_grad") == 2  # the GELU and the linear layer
    relu_only = functools.partial(fused_mlp, activations=("relu",), implementation="cublaslt")
    ops = _ops(jax.grad(lambda x, layers: jnp.sum(relu_only(x, layers)), argnums=(0, 1)), x, layers[:1])
    assert "jax_epilog_fused_weight_grad" not in ops


def test_forward_mode_with_a_fused_link_raises(rng):
    x, layers = _as_jnp(*draw(rng, (4, 3), (5, 2), "float32", ("gelu", None)))
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff"):
        jax.jvp(lambda x: fused_mlp(x, layers, ("gelu", None), implementation="cublaslt"), (x,), (x,))


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_no_bias_layers_get_no_bias_gradient(rng, implementation):
    activations = ("gelu", "gelu")
    x, layers = _as_jnp(*draw(rng, (7, 5), (6, 3), "float32", activations, bias=False))
    mlp = functools.partial(fused_mlp, activations=activations, implementation=implementation)
    dlayers = jax.grad(lambda layers: jnp.sum(mlp(x, layers)))(layers)
    assert all(db is None for _, db in dlayers)
    with jax.enable_x64():
        _, ref = _grads(
            functools.partial(reference_mlp, activations=activations), *_to64((x, layers)), np.ones((7, 3))
        )
    for (dw, _), (rw, _) in zip(dlayers, ref):
        assert_near(dw, rw, TOL["float32"], "dkernel")


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_zero_rows(rng, implementation):
    x, layers = _as_jnp(*draw(rng, (0, 5), (6, 3), "float32", ("gelu", None)))
    mlp = functools.partial(fused_mlp, activations=("gelu", None), implementation=implementation)
    assert mlp(x, layers).shape == (0, 3)
    dlayers = jax.grad(lambda layers: jnp.sum(mlp(x, layers)))(layers)
    for (dw, db), (w, b) in zip(dlayers, layers):
        np.testing.assert_array_equal(dw, np.zeros(w.shape))
        np.testing.assert_array_equal(db, np.zeros(b.shape))


# ---------------------------------------------------------------------- transformations


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_vmap_shared_and_batched_weights_and_vmap_of_grad(rng, implementation):
    activations = ("gelu", None)
    xs, layers = _as_jnp(*draw(rng, (3, 10, 6), (12, 5), "float32", activations))
    f = functools.partial(fused_mlp, activations=activations, implementation=implementation)
    loop = jnp.stack([f(x, layers) for x in xs])
    np.testing.assert_allclose(jax.vmap(f, in_axes=(0, None))(xs, layers), loop, rtol=1e-6, atol=1e-6)

    members = [_as_jnp(*draw(rng, (10, 6), (12, 5), "float32", activations))[1] for _ in range(3)]
    ensemble = jax.tree.map(lambda *a: jnp.stack(a), *members)
    got = jax.vmap(f)(xs, ensemble)
    want = jnp.stack([f(x, member) for x, member in zip(xs, members)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)

    loss = lambda x, layers: jnp.sum(jnp.sin(f(x, layers)))
    got = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(xs, layers)
    want = [jax.grad(loss, argnums=(0, 1))(x, layers) for x in xs]
    want = jax.tree.map(lambda *a: jnp.stack(a), *want)
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6), got, want)


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
    # elementwise math differently: a few ulps apart (1.4e-6 once on the H200, 2026-12-03 (r)).
    tol = 1e-5 if ON_GPU else 1e-6
    jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=tol, atol=tol), got, want)


# ------------------------------------------------------- the DGELU input-gradient primitive


@pytest.mark.parametrize(
    "dtype,aux_dtype",
    [("float16", "float16"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"), ("float32", "float32")],
)
@pytest.mark.parametrize("m,n,k", [(33, 65, 37), (8, 16, 24), (1, 3, 1), (5, 1, 9)], ids=str)
def test_gelu_input_grad_primitive(rng, dtype, aux_dtype, m, n, k):
    """(dz @ kernel.T) * gelu'(z) with z from a padded GELU aux whose padding is NaN (the
    kernel must read only the first k columns)."""
    dz = rng.standard_normal((m, n)).astype(np_dtype(dtype))
    w = (rng.standard_normal((k, n)) / np.sqrt(n)).astype(np_dtype(dtype))
    z = rng.standard_normal((m, k)).astype(np_dtype(aux_dtype))
    aux = np.full((m, aux_padded_width("gelu", k)), np.nan, np_dtype(aux_dtype))
    aux[:, :k] = z
    (got,) = jax.jit(functools.partial(fused_gelu_input_grad, compute_type=CT))(dz, w, aux)
    assert got.shape == (m, k) and got.dtype == np.dtype(np_dtype(aux_dtype))
    with jax.enable_x64():
        dz64, w64 = np.asarray(dz, np.float64), np.asarray(w, np.float64)
        expected = jax.vjp(_gelu, jnp.asarray(z, np.float64))[1](jnp.asarray(dz64 @ w64.T))[0]
    # Errors scale with the product's terms, not with the result: GELU's derivative is at
    # most 1.13 but is a difference of near-equal numbers far below zero (in float32 at
    # z = -3.65: 3e-4 of itself), and the product may cancel.
    tol = {"float16": 4e-3, "bfloat16": 2e-2, "float32": 5e-3 if ON_GPU else 1e-5}[aux_dtype]
    assert_near(got, expected, tol, scale=float((np.abs(dz64) @ np.abs(w64).T).max()))


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "layers_fn,activations,error,match",
    [
        (lambda w1, b1, w2, b2: [(w1, b1), (w2, b2)], "gelu", TypeError, "activations must be a sequence"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w2, b2)], ["gelu"], ValueError, "2 layers and 1 activations"),
        (lambda w1, b1, w2, b2: [], [], ValueError, "at least one layer"),
        (lambda w1, b1, w2, b2: [w1, w2], ["gelu", None], TypeError, r"\(kernel, bias\) pairs"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w1, b1)], ["gelu", None], ValueError,
         r"layer 1: layer 0's output's last dimension 7 .* must equal kernel's first dimension K=5"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w2, b1)], ["gelu", None], ValueError,
         r"layer 1: bias must have shape \(N,\) = \(3,\)"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w2, b2)], ["gelu", "swish"], ValueError,
         "layer 1: unknown activation 'swish'"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w2.astype(jnp.float16), b2)], ["gelu", None], TypeError,
         "layer 1: kernel dtype float16 differs from layer 0's output dtype float32"),
    ],
    ids=["activation-string", "lengths", "empty", "not-pairs", "k-mismatch", "bias-shape", "activation", "dtype"],
)  # fmt: skip
def test_bad_arguments_raise_naming_the_layer(rng, layers_fn, activations, error, match):
    x = jnp.asarray(rng.standard_normal((4, 5)), jnp.float32)
    w1, b1 = (
        jnp.asarray(rng.standard_normal((5, 7)), jnp.float32),
        jnp.asarray(rng.standard_normal(7), jnp.float32),
    )
    w2, b2 = (
        jnp.asarray(rng.standard_normal((7, 3)), jnp.float32),
        jnp.asarray(rng.standard_normal(3), jnp.float32),
    )
    with pytest.raises(error, match=match):
        fused_mlp(x, layers_fn(w1, b1, w2, b2), activations)


def test_bad_implementation_and_compute_type_raise(rng):
    x = jnp.asarray(rng.standard_normal((4, 5)), jnp.bfloat16)
    layers = [(jnp.asarray(rng.standard_normal((5, 3)), jnp.bfloat16), None)]
    with pytest.raises(ValueError, match="fused_mlp: layer 0: unknown implementation 'fast'"):
        fused_mlp(x, layers, ["gelu"], implementation="fast")
    with pytest.raises(
        ValueError, match="fused_mlp: layer 0: compute_type COMPUTE_32F_FAST_TF32 cannot run bfloat16"
    ):
        fused_mlp(x, layers, ["gelu"], compute_type="COMPUTE_32F_FAST_TF32")
    with pytest.raises(TypeError, match="fused_mlp: x must be a JAX or NumPy array"):
        fused_mlp([[1.0]], layers, ["gelu"])


# ------------------------------------------------------------------------------ Flax Linen


def test_linen_fused_mlp_is_two_fused_dense_layers_with_those_names(rng):
    nn = pytest.importorskip("flax.linen")
    from jax_epilog.linen import FusedDense, FusedMLP

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = FusedDense(40, activation="gelu", name="fc_in", dtype=jnp.bfloat16)(x)
            return FusedDense(12, name="fc_out", dtype=jnp.bfloat16)(x)

    mlp = FusedMLP((40, 12), ("gelu", None), layer_names=("fc_in", "fc_out"), dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 7, 16)), jnp.float32)
    key = jax.random.key(int(rng.integers(2**31)))
    params = Two().init(key, x)
    jax.tree.map(np.testing.assert_array_equal, mlp.init(key, x), params)
    params = jax.tree.map(lambda p: p + jnp.asarray(rng.standard_normal(p.shape), p.dtype), params)
    np.testing.assert_array_equal(mlp.apply(params, x), Two().apply(params, x))
    grads = jax.grad(lambda p: jnp.sum(mlp.apply(p, x).astype(jnp.float32) ** 2))(params)
    twin = jax.grad(lambda p: jnp.sum(Two().apply(p, x).astype(jnp.float32) ** 2))(params)
    jax.tree.map(lambda g, t: assert_near(g, t, 6e-2), grads, twin)
    assert set(FusedMLP((4, 2), ("gelu", None)).init(key, x)["params"]) == {"layers_0", "layers_1"}
    with pytest.raises(ValueError, match="FusedMLP: 1 layer_names for 2 layers"):
        FusedMLP((4, 2), ("gelu", None), layer_names=("a",)).init(key, x)


def test_nnx_fused_mlp_is_fused_linear_layers_built_in_turn(rng):
    pytest.importorskip("flax")
    from flax import nnx

    from jax_epilog.nnx import FusedLinear, FusedMLP

    seed = int(rng.integers(2**31))
    mlp = FusedMLP((16, 40, 12), ("gelu", None), dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
    rngs = nnx.Rngs(seed)
    first = FusedLinear(16, 40, activation="gelu", dtype=jnp.bfloat16, rngs=rngs)
    second = FusedLinear(40, 12, dtype=jnp.bfloat16, rngs=rngs)
    for layer, twin in zip(mlp.layers, (first, second)):
        np.testing.assert_array_equal(layer.kernel[...], twin.kernel[...])
        layer.bias[...] = twin.bias[...] = jnp.asarray(rng.standard_normal(twin.bias.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)
    np.testing.assert_array_equal(mlp(x), second(first(x)))
    grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2))(mlp)
    twin = nnx.grad(lambda a, b: jnp.sum(b(a(x)).astype(jnp.float32) ** 2), argnums=(0, 1))(first, second)
    grads = nnx.to_pure_dict(grads)["layers"]
    for i, t in enumerate(twin):
        t = nnx.to_pure_dict(t)
        assert_near(grads[i]["kernel"], t["kernel"], 6e-2)
        assert_near(grads[i]["bias"], t["bias"], 6e-2)
    with pytest.raises(ValueError, match=r"FusedMLP: features \(16, 4\) must hold the input width"):
        FusedMLP((16, 4), ("gelu", None), rngs=nnx.Rngs(0))


def test_act_fn_helper_agrees_with_reference_gelu():
    # the reference's GELU here is the tanh approximation, as cuBLASLt's and jax.nn.gelu's
    z = jnp.linspace(-4, 4, 17)
    np.testing.assert_allclose(_gelu(z), act_fn("gelu")(z), rtol=1e-6, atol=1e-7)
