"""``implementation=``: "cublaslt" (the op), "xla" (the plain expression) and "auto"."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_epilog import _dense, _primitive, fused_dense

FUSED = "jax_epilog_fused_matmul"


def _inputs(rng, m, k, n, dtype="float32"):
    return (
        jnp.asarray(rng.standard_normal((m, k)), dtype),
        jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype),
        jnp.asarray(rng.standard_normal(n), dtype),
    )


def _plain(x, w, b, activation):
    z = jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST) + b
    return {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=True)}[activation](z)


def _jaxpr(f, *args) -> str:
    return str(jax.make_jaxpr(f)(*args))


@pytest.mark.parametrize("bad", ["cuda", "XLA", None, 1])
def test_unknown_implementation_names_the_allowed_ones(rng, bad):
    x, w, b = _inputs(rng, 3, 5, 7)
    with pytest.raises(ValueError, match=r"unknown implementation .*allowed: \('auto', 'cublaslt', 'xla'\)"):
        fused_dense(x, w, b, implementation=bad)


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_return_aux_must_be_a_bool(rng, bad):
    x, w, b = _inputs(rng, 3, 5, 7)
    with pytest.raises(TypeError, match=rf"return_aux must be True or False, got {bad!r}"):
        fused_dense(x, w, b, activation="relu", return_aux=bad)


def test_xla_cannot_return_the_aux(rng):
    x, w, b = _inputs(rng, 3, 5, 7)
    with pytest.raises(ValueError, match=r"return_aux=True .*allowed with return_aux: \('auto', 'cublaslt'\)"):
        fused_dense(x, w, b, activation="relu", return_aux=True, implementation="xla")


def test_xla_refuses_a_compute_type_it_cannot_reproduce(rng):
    x, w, b = _inputs(rng, 3, 5, 7, "float16")
    with pytest.raises(ValueError, match="implementation='xla' cannot accumulate as compute_type COMPUTE_16F"):
        fused_dense(x, w, b, compute_type="COMPUTE_16F", implementation="xla")


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("implementation", ["xla", "auto"])
def test_plain_expression_values_grads_and_forward_mode(rng, activation, implementation):
    """Below the "auto" threshold, and always with "xla": exactly the user's expression,
    differentiated by JAX (forward mode included)."""
    x, w, b = _inputs(rng, 33, 17, 9)
    f = functools.partial(fused_dense, activation=activation, implementation=implementation)
    assert FUSED not in _jaxpr(f, x, w, b)
    np.testing.assert_array_equal(np.asarray(f(x, w, b)), np.asarray(_plain(x, w, b, activation)))
    loss = lambda g: lambda x, w, b: jnp.sum(g(x, w, b) ** 2)
    grads = jax.grad(loss(f), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(loss(functools.partial(_plain, activation=activation)), argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)
    jax.jvp(lambda x: f(x, w, b), (x,), (x,))  # forward mode works here


@pytest.mark.parametrize("x_shape", [(37, 19), (3, 5, 19)], ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("activation", ["relu", "gelu", None])
@pytest.mark.parametrize("implementation", ["xla", "auto"])
def test_half_precision_plain_path_is_the_users_program(dtype, activation, implementation, x_shape):
    """Where "auto" or "xla" run XLA's expression, XLA compiles the very program users
    write (default precision and leading dimensions included), so the benchmarks' "auto"
    and "xla" rows time one executable and "auto" inherits every choice XLA makes for it."""
    act = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=True), None: lambda z: z}
    args = [jax.ShapeDtypeStruct(s, dtype) for s in (x_shape, (19, 11), (11,))]
    ours = lambda x, w, b: fused_dense(x, w, b, activation=activation, implementation=implementation)
    users = lambda x, w, b: act[activation](x @ w + b)
    text = [jax.jit(f).lower(*args).as_text(debug_info=False) for f in (ours, users)]  # both "jit__lambda"
    assert text[0] == text[1]


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_auto_fuses_large_forward_passes_only(activation):
    big = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((1024, 4096), jnp.bfloat16)
    bias = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    f = functools.partial(fused_dense, activation=activation)
    assert FUSED in _jaxpr(f, *big, bias)
    # Under reverse-mode differentiation "auto" is XLA's own expression and autodiff.
    grad = jax.grad(lambda x, w, b: jnp.sum(f(x, w, b), dtype=jnp.float32), argnums=(0, 1, 2))
    assert FUSED not in _jaxpr(grad, *big, bias) and "weight_grad" not in _jaxpr(grad, *big, bias)
    # No activation (XLA fuses the bias into its own GEMM), few rows, a small layer: XLA.
    assert FUSED not in _jaxpr(functools.partial(fused_dense, activation=None), *big, bias)
    assert FUSED not in _jaxpr(f, jax.ShapeDtypeStruct((512, 8192), jnp.bfloat16),
                               jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16), bias)
    assert FUSED not in _jaxpr(f, jax.ShapeDtypeStruct((2048, 256), jnp.bfloat16),
                               jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16), bias)
    # Float16 as bfloat16; float32 (full or TF32: a tie and a loss for GELU) stays XLA's.
    as_dtype = lambda dtype: [jax.ShapeDtypeStruct(a.shape, dtype) for a in (*big, bias)]
    assert FUSED in _jaxpr(f, *as_dtype(jnp.float16))
    assert FUSED not in _jaxpr(f, *as_dtype(jnp.float32))
    tf32 = functools.partial(f, compute_type="COMPUTE_32F_FAST_TF32")
    assert FUSED not in _jaxpr(tf32, *as_dtype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize(
    "m,k,n,fused",
    [
        (8192, 1024, 4096, True),
        (8191, 1024, 4096, True),  # M does not matter: no operand's rows are M wide
        (8192, 1032, 4104, True),  # multiples of 8 that are not of 16 or 128
        # Rows the call pads: 1.38-2.43x XLA (H100), unpadded 0.08-0.87x. Where N pads, only
        # GELU fuses ("gelu"): ReLU runs XLA's expression on the padded rows.
        (8192, 1024, 4097, "gelu"),
        (8192, 1020, 4096, True),
        (8192, 1023, 4097, "gelu"),
        (8192, 1024, 8193, "gelu"),
        (8192, 1024, 1025, "gelu"),
        (1023, 1024, 8200, False),  # fewer than 1024 rows
        (1024, 1024, 4096, False),  # M*N*K = 2**32 < 2**33, aligned
        # Below 2**33 "auto" runs XLA's expression on the rows a fused call would pad
        (1024, 1024, 4097, "padded"),
        (4096, 1024, 1025, "padded"),
        (8192, 1020, 1020, "padded"),
        (2048, 1020, 4100, "padded"),
        (1023, 1024, 4097, False),  # fewer than 1024 rows: not padded
        (1024, 1024, 1025, False),  # M*N*K < 2**32: not padded
    ],
)
def test_auto_fuses_large_layers_whatever_their_row_widths(m, k, n, fused, activation, dtype):
    """K and N need not be multiples of 8 for "auto" to fuse a large layer: the call pads
    them (test_lowering.py); below the fused size floor "auto"'s forward and gradient are
    the user's program on rows padded likewise (and without padding, the user's program);
    "cublaslt" runs the fused kernel at every size. A ReLU layer whose N pads ("gelu":
    only GELU fuses) runs XLA's expression on the padded rows too."""
    if fused == "gelu":
        fused = True if activation == "gelu" else "padded"
    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (n,))]
    f = functools.partial(fused_dense, activation=activation)
    assert (FUSED in _jaxpr(f, *args)) == (fused is True)
    rows = -(-k // 8) * 8, -(-n // 8) * 8
    if fused == "padded":
        assert f"[{rows[0]},{rows[1]}]" in _jaxpr(f, *args)
        grad = _jaxpr(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)), *args)
        assert f"[{rows[0]},{rows[1]}]" in grad
    elif fused is False:
        lowered = [jax.jit(g).lower(*args).as_text() for g in (f, functools.partial(f, implementation="xla"))]
        assert lowered[0] == lowered[1]
    assert FUSED in _jaxpr(functools.partial(f, implementation="cublaslt"), *args)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize(
    "m,k,n,padded",
    [
        (8192, 1024, 4097, True),  # padded: fwd 1.31-2.08x XLA, fwd+bwd 1.30-2.68x (H100, (ak))
        (8192, 4097, 1024, True),
        (2048, 1024, 4097, True),
        (4096, 1024, 1025, True),
        (8192, 1024, 4096, False),  # aligned: XLA fuses the bias into its GEMM; a tie
        (1023, 1024, 4097, False),  # too small to pad
    ],
)
def test_auto_runs_an_unaligned_layer_without_activation_on_padded_rows(m, k, n, padded, dtype):
    """Without an activation "auto" never fuses; a half-precision layer large enough for
    a fused call to pad its rows runs XLA's expression on the padded operands, forward and
    gradient; any other layer (float32 too, not measured) is the user's program."""
    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((m, k), (k, n), (n,))]
    f = functools.partial(fused_dense, activation=None)
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    assert FUSED not in _jaxpr(f, *args) and FUSED not in _jaxpr(grad, *args)
    padded = padded and dtype != jnp.float32
    if padded:
        rows = f"[{-(-k // 8) * 8},{-(-n // 8) * 8}]"
        assert rows in _jaxpr(f, *args) and rows in _jaxpr(grad, *args)
    else:
        lowered = [jax.jit(g).lower(*args).as_text() for g in (f, functools.partial(f, implementation="xla"))]
        assert lowered[0] == lowered[1]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize(
    "shape,padded",
    [((8192, 1020, 4097), (1024, 4104)), ((1024, 1024, 4097), (1024, 4104)), ((1024, 1020, 4097), None)],
)
def test_gradient_of_an_unaligned_large_layer_runs_on_padded_rows(shape, padded, activation):
    """Under jax.grad, "auto"'s large unaligned layer is XLA's program on the operands
    padded as the fused call pads them (8192x1020->4097 as 8192x1024->4104), where XLA's
    GEMMs run on aligned rows, and "cublaslt"'s backward runs its GEMMs on those padded
    rows too; a layer too small to pad keeps the user's shapes."""
    m, k, n = shape
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, k), (k, n), (n,))]
    for implementation in ("auto", "cublaslt"):
        f = functools.partial(fused_dense, activation=activation, implementation=implementation)
        loss = lambda x, w, b, f=f: jnp.sum(f(x, w, b).astype(jnp.float32))
        text = _jaxpr(jax.grad(loss, argnums=(0, 1, 2)), *args)
        assert (FUSED in text) == (implementation == "cublaslt")
        if padded:
            assert f"bf16[{m},{padded[0]}]" in text and f"bf16[{padded[0]},{padded[1]}]" in text
        else:
            assert " pad[" not in text


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("argnums", [(0, 1, 2), (1, 2), (0,), (1,)])
def test_auto_gradient_of_a_fused_layer_is_the_users_program(activation, argnums):
    """Where "auto" fuses the forward, jax.grad lowers to exactly the program of the user's
    expression, whichever arguments are differentiated (a constant one adds no work)."""
    big = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((4096, 1024), (1024, 4096), (4096,))]
    act = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=True)}[activation]
    ours = lambda x, w, b: jnp.sum(fused_dense(x, w, b, activation=activation) ** 2)
    users = lambda x, w, b: jnp.sum(act(x @ w + b) ** 2)
    assert FUSED in _jaxpr(functools.partial(fused_dense, activation=activation), *big)
    text = [jax.jit(jax.grad(f, argnums=argnums)).lower(*big).as_text(debug_info=False) for f in (ours, users)]
    assert text[0] == text[1]


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_auto_fused_forward_with_xla_derivatives(rng, activation, monkeypatch, padded):
    """The large-layer "auto" path on a small problem: the op's value, the plain gradients,
    and forward mode (jvp, jacfwd, hessian) as the plain expression has it; ``padded``:
    with the size floor of padding lowered, so that the derivatives' expression runs on
    rows padded from K = 17, N = 9 to 20 and 12 (float32), with the same values."""
    monkeypatch.setattr(_dense, "_auto_fuses_alone", lambda activation, dtype, m, n, k: True)
    if padded:
        monkeypatch.setattr(_primitive, "_PAD_MIN_ROWS", 0)
        monkeypatch.setattr(_primitive, "_PAD_MIN_WORK", 0)
    x, w, b = _inputs(rng, 33, 17, 9)
    f = functools.partial(fused_dense, activation=activation)
    assert FUSED in _jaxpr(f, x, w, b)
    grad_jaxpr = _jaxpr(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)), x, w, b)
    assert ("f32[20,12]" in grad_jaxpr) == padded and ("f32[17,9]" in grad_jaxpr)

    def near(got, want, tol, padded_tol=1e-5):
        """Padded: float32 sums in another order, so up to padded_tol of the largest entry (or of 1)."""
        want = np.asarray(want)
        atol = padded_tol * max(1.0, float(np.abs(want).max())) if padded else tol
        np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=atol)

    op = fused_dense(x, w, b, activation=activation, implementation="cublaslt")
    np.testing.assert_array_equal(np.asarray(f(x, w, b)), np.asarray(op))
    grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(lambda *a: jnp.sum(_plain(*a, activation) ** 2), argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(grads, want):
        near(g, r, 1e-5)
    # No bias, and leading dimensions.
    xs = x.reshape(3, 11, 17)
    g = jax.grad(lambda x: jnp.sum(f(x, w) ** 2))(xs)
    act = jax.nn.relu if activation == "relu" else functools.partial(jax.nn.gelu, approximate=True)
    r = jax.grad(lambda x: jnp.sum(act(jnp.matmul(x, w, precision="highest")) ** 2))(xs)  # no TF32
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
    # Forward mode: the plain expression's derivatives, in every argument or some of them.
    plain = functools.partial(_plain, activation=activation)
    tangents = tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (x, w, b))
    (y, dy), (y_ref, dy_ref) = (jax.jvp(g, (x, w, b), tangents) for g in (f, plain))
    near(y, y_ref, 0)
    near(dy, dy_ref, 1e-6)
    for got, want in zip(jax.jacfwd(f, argnums=(1, 2))(x, w, b), jax.jacfwd(plain, argnums=(1, 2))(x, w, b)):
        near(got, want, 1e-6)
    hessian = lambda g: jax.hessian(lambda x: jnp.sum(g(x, w, b) ** 2))(x)
    # GELU's padded Hessian against the unpadded one: up to 2.2e-5 of the largest entry over
    # 200 draws (5 above 1e-5); each is up to 4.4e-5 from the float64 Hessian.
    near(hessian(f), hessian(plain), 1e-5, padded_tol=1e-4)


@pytest.mark.parametrize("activation", ["relu", "gelu", None])
def test_auto_on_padded_rows_gives_the_plain_values_and_gradients(rng, activation, monkeypatch):
    """"auto"'s forward and derivatives on padded rows (the padding's size floor lowered,
    so that bfloat16 K = 17, N = 9 pad to 24 and 16): the values and gradients of
    implementation="xla", whose program keeps the user's shapes."""
    monkeypatch.setattr(_primitive, "_PAD_MIN_ROWS", 0)
    monkeypatch.setattr(_primitive, "_PAD_MIN_WORK", 0)
    x, w, b = _inputs(rng, 33, 17, 9, "bfloat16")
    f = functools.partial(fused_dense, activation=activation)
    xla = functools.partial(f, implementation="xla")
    loss = lambda g: jax.grad(lambda *a: jnp.sum(g(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    assert "bf16[24,16]" in _jaxpr(f, x, w, b) and FUSED not in _jaxpr(f, x, w, b)
    assert "bf16[24,16]" in _jaxpr(loss(f), x, w, b) and "bf16[24,16]" not in _jaxpr(loss(xla), x, w, b)
    assert "bf16[24,16]" not in _jaxpr(xla, x, w, b)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    np.testing.assert_allclose(*(np.asarray(g(x, w, b), np.float32) for g in (f, xla)), **tol)
    tangents = tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (x, w, b))
    forward_mode = [jax.jvp(g, (x, w, b), tangents)[1] for g in (f, xla)]
    for got, want in zip((*loss(f)(x, w, b), forward_mode[0]), (*loss(xla)(x, w, b), forward_mode[1])):
        assert got.shape == want.shape
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


def test_auto_keeps_the_op_where_xla_cannot_reproduce_it(rng):
    x, w, b = _inputs(rng, 3, 5, 7, "float16")
    assert FUSED in _jaxpr(functools.partial(fused_dense, activation="relu", return_aux=True), x, w, b)
    assert FUSED in _jaxpr(functools.partial(fused_dense, compute_type="COMPUTE_16F"), x, w, b)


def test_layers_pass_the_implementation_on(rng):
    pytest.importorskip("flax.linen")
    nnx = pytest.importorskip("flax.nnx")
    from jax_epilog.linen import FusedDense
    from jax_epilog.nnx import FusedLinear

    x = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
    for impl, fused in (("cublaslt", True), ("xla", False), ("auto", False)):
        layer = FusedDense(5, activation="relu", implementation=impl)
        params = layer.init(jax.random.key(0), x)
        assert (FUSED in _jaxpr(layer.apply, params, x)) == fused
        lin = FusedLinear(6, 5, activation="relu", implementation=impl, rngs=nnx.Rngs(0))
        assert (FUSED in _jaxpr(lin, x)) == fused
