"""CPU tests of ``jax_epilog.fused_dense`` (the pure-JAX path) against a float64 NumPy oracle."""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import relu_clear, round_operand
from tolerances import ON_GPU, assert_close, epilog_slack, tolerance

import jax_epilog
from jax_epilog import Activation, ComputeType, aux_padded_width

# These tests are about the op itself (its cuBLASLt kernel on a GPU, its reference math
# on a CPU), not about implementation="auto"'s choice: see test_implementation.py.
fused_dense = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")

jit_dense = jax.jit(fused_dense, static_argnames=("activation", "compute_type", "return_aux"))

DTYPES = ["float16", "bfloat16", "float32", "float64"]
HALF = ["float16", "bfloat16"]
ACTIVATIONS = [None, "relu", "gelu"]
# (x shape, N): N != K != M where possible, none a multiple of 8/16/128 but the seed's K and
# the 4-d case's N = 24, the one whose GELU aux needs no padding columns.
SHAPES = [
    ((256, 784), 100),
    ((1, 1), 1),
    ((3, 5), 7),
    ((33, 129), 65),
    ((2, 3, 40, 19), 24),
    ((2, 3, 5, 17), 37),
]
SHAPE_IDS = [f"{'x'.join(map(str, xs))}-N{n}" for xs, n in SHAPES]
SEED_SHAPE = ((256, 784), 100)


# --- helpers ----------------------------------------------------------------------------------


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def make_inputs(rng, x_shape, n, dtype, *, bias=True, bias_dtype=None):
    """Random O(1) inputs made in float64 and cast: x ~ N(0, 1), kernel ~ N(0, 1/K), bias ~ N(0, 1).

    Returns NumPy arrays in ``dtype`` (bias in ``bias_dtype``, or None)."""
    k = x_shape[-1]
    x = rng.standard_normal(x_shape).astype(dtype)
    w = (rng.standard_normal((k, n)) / np.sqrt(max(k, 1))).astype(dtype)
    b = rng.standard_normal(n).astype(bias_dtype or dtype) if bias else None
    return x, w, b


def np_gelu(z):
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


def oracle(x, w, b, activation):
    """``(act(z), z)`` in float64 from the *cast* inputs, z = x @ w + b."""
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    if b is not None:
        z = z + np.asarray(b, np.float64)
    if activation is None:
        return z, z
    if Activation(activation) is Activation.RELU:
        return np.maximum(z, 0.0), z
    return np_gelu(z), z


def first_bits(mask, n):
    """The first n bits of each row of a uint8 mask (bit j % 8 of byte j // 8), with NumPy."""
    return np.unpackbits(np.asarray(mask), axis=-1, bitorder="little")[..., :n].astype(bool)


def assert_relu_bits(aux, z, dtype, k, *, acc_eps=None, factor=10.0, min_coverage=0.9, bias=None, epilog_dtype=None):
    """The first N bits of each aux row are z > 0 wherever rounding cannot flip z's sign."""
    n = z.shape[-1]
    bits = first_bits(aux, n)
    assert bits.shape == z.shape, f"aux rows hold {bits.shape[-1]} bits, need {n}"
    slack = epilog_slack(epilog_dtype or dtype, z, bias)
    clear = relu_clear(z, dtype, k, acc_eps=acc_eps, factor=factor, slack=slack)
    if z.size >= 64:  # the check must not pass vacuously
        assert clear.mean() > min_coverage, f"only {clear.mean():.2%} of signs are clear of rounding"
    mismatch = (bits != (z > 0)) & clear
    assert not mismatch.any(), (
        f"ReLU aux bits differ from z > 0 at {int(mismatch.sum())} positions, first at "
        f"{tuple(map(int, np.argwhere(mismatch)[0]))}"
    )


def count_backend_compiles():
    """A context manager counting XLA compilations (jax.monitoring events)."""
    import contextlib

    from jax import monitoring

    @contextlib.contextmanager
    def ctx():
        events = []

        def listener(event, duration, **kwargs):
            if event == "/jax/core/compile/backend_compile_duration":
                events.append(kwargs)

        monitoring.register_event_duration_secs_listener(listener)
        try:
            yield events
        finally:
            monitoring.unregister_event_duration_listener(listener)

    return ctx()


# --- forward vs the float64 oracle ------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_float64_oracle(rng, dtype, activation, with_bias, shape):
    x_shape, n = shape
    x, w, b = make_inputs(rng, x_shape, n, dtype, bias=with_bias)
    y = fused_dense(
        jnp.asarray(x), jnp.asarray(w), None if b is None else jnp.asarray(b), activation=activation
    )
    assert isinstance(y, jax.Array)
    assert y.dtype == np.dtype(dtype)
    assert y.shape == (*x_shape[:-1], n)
    expected, z = oracle(x, w, b, activation)
    assert_close(y, expected, dtype, k=x_shape[-1], slack=epilog_slack(dtype, z, b, activation))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_seed_case_float16_with_float32_bias(rng, activation):
    (m, k), n = SEED_SHAPE
    x, w, b = make_inputs(rng, (m, k), n, "float16", bias_dtype="float32")
    y, aux = fused_dense(
        jnp.asarray(x),
        jnp.asarray(w),
        jnp.asarray(b),
        activation=activation,
        compute_type="COMPUTE_32F",
        return_aux=True,
    )
    assert y.dtype == np.float16 and y.shape == (m, n)
    expected, z = oracle(x, w, b, activation)  # uses the float32 bias, not a float16 copy
    # The epilog runs in float32 (D is float32), then XLA rounds once to float16.
    assert_close(y, expected, "float16", k=k, slack=epilog_slack("float32", z, b, activation))
    if activation == "relu":
        assert aux.dtype == np.uint8 and aux.shape == (m, 16)
        assert_relu_bits(aux, z, "float16", k, bias=b, epilog_dtype="float32")
    else:
        # The epilog runs in float32, so z must be float32-accurate: a bias rounded to
        # float16 before the add would fail here.
        assert aux.dtype == np.float32 and aux.shape == (m, 104)
        assert_close(np.asarray(aux)[:, :n], z, "float32", k=k, slack=epilog_slack("float32", z, b))


@pytest.mark.parametrize("shape", [((33, 129), 65), ((2, 3, 5, 17), 37)], ids=["33x129-N65", "2x3x5x17-N37"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", HALF)
def test_half_with_float32_bias(rng, dtype, activation, shape):
    x_shape, n = shape
    x, w, b = make_inputs(rng, x_shape, n, dtype, bias_dtype="float32")
    y, aux = fused_dense(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), activation=activation, return_aux=True
    )
    expected, z = oracle(x, w, b, activation)
    assert y.dtype == np.dtype(dtype) and y.shape == (*x_shape[:-1], n)
    assert_close(y, expected, dtype, k=x_shape[-1], slack=epilog_slack("float32", z, b, activation))
    if activation is None:
        assert aux is None
    elif activation == "gelu":
        assert aux.dtype == np.float32 and aux.shape == (*x_shape[:-1], _round_up(n, 8))
        assert_close(np.asarray(aux)[..., :n], z, "float32", k=x_shape[-1], slack=epilog_slack("float32", z, b))
    else:
        assert aux.dtype == np.uint8
        assert_relu_bits(aux, z, dtype, x_shape[-1], bias=b, epilog_dtype="float32")


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_float16_compute_16f(rng, activation):
    # A 16-bit accumulator (and epilog): the error is absolute, O(eps16 * sqrt(K)).
    (x_shape, n), k = ((33, 129), 65), 129
    x, w, b = make_inputs(rng, x_shape, n, "float16")
    y, aux = fused_dense(
        jnp.asarray(x),
        jnp.asarray(w),
        jnp.asarray(b),
        activation=activation,
        compute_type="COMPUTE_16F",
        return_aux=True,
    )
    expected, z = oracle(x, w, b, activation)
    eps16 = float(np.finfo(np.float16).eps)
    assert y.dtype == np.float16
    assert_close(y, expected, "float16", k=k, acc_eps=eps16, slack=epilog_slack("float16", z, b, activation))
    if activation == "gelu":
        assert aux.dtype == np.float16 and aux.shape == (33, 72)
        assert_close(np.asarray(aux)[:, :n], z, "float16", k=k, acc_eps=eps16, slack=epilog_slack("float16", z, b))
    elif activation == "relu":
        assert aux.dtype == np.uint8 and aux.shape == (33, 16)
        assert_relu_bits(aux, z, "float16", k, acc_eps=eps16, factor=2.0, min_coverage=0.6, bias=b)


# --- the tolerance can fail -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_tolerance_catches_wrong_results(rng, dtype):
    # On the seed shape, whose N = 100 columns and 25600 outputs make each bug visible for
    # any seed. jit_dense: calls that differ only in values share one compilation.
    x_shape, n = SEED_SHAPE
    k = x_shape[-1]
    x, w, b = make_inputs(rng, x_shape, n, dtype)
    xj, wj, bj = jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)

    # On a GPU every comparison grants the epilog's slack for the *right* answer; the bugs
    # must still be rejected with it.
    def rejects(actual, expected, slack=0.0):
        with pytest.raises(AssertionError, match="not close"):
            assert_close(actual, expected, dtype, k=k, slack=slack)

    for act in ACTIVATIONS:
        expected, z = oracle(x, w, b, act)
        slack = epilog_slack(dtype, z, b, act)
        assert_close(jit_dense(xj, wj, bj, activation=act), expected, dtype, k=k, slack=slack)  # right: passes
        rejects(jit_dense(xj, wj, None, activation=act), expected, slack)  # bias forgotten
        rejects(jit_dense(xj, wj, jnp.asarray(-b), activation=act), expected, slack)  # bias of the wrong sign
    for act in ("relu", "gelu"):
        expected, z = oracle(x, w, b, act)
        slack = epilog_slack(dtype, z, b, act)
        rejects(jit_dense(xj, wj, bj), expected, slack)  # activation forgotten
        other = "gelu" if act == "relu" else "relu"
        rejects(jit_dense(xj, wj, bj, activation=other), expected, slack)  # the other activation
    expected, z = oracle(x, w, b, "gelu")
    if dtype in ("float32", "float64"):  # the exact erf GELU, where the output is precise enough
        erf_gelu = 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
        rejects(erf_gelu, expected)  # a statement about the tolerance itself: no epilog slack
    # A transposed kernel (a square K x K one, so that it still fits) and the rows reversed.
    xs, ws, bs = make_inputs(rng, x_shape, k, dtype)
    ys, zs = oracle(xs, ws, bs, "gelu")
    rejects(
        jit_dense(
            jnp.asarray(xs), jnp.asarray(np.ascontiguousarray(ws.T)), jnp.asarray(bs), activation="gelu"
        ),
        ys,
        epilog_slack(dtype, zs, bs, "gelu"),
    )
    y0, z0 = oracle(x, w, b, None)
    rejects(np.asarray(jit_dense(xj, wj, bj))[::-1], y0, epilog_slack(dtype, z0, b))
    # The GELU aux shifted by one column.
    _, aux = jit_dense(xj, wj, bj, activation="gelu", return_aux=True)
    aux_slack = epilog_slack(dtype, z, b)
    assert_close(np.asarray(aux)[:, :n], z, dtype, k=k, slack=aux_slack)
    rejects(np.asarray(aux)[:, 1 : n + 1], z, aux_slack)
    # The ReLU aux shifted by one bit.
    _, aux = jit_dense(xj, wj, bj, activation="relu", return_aux=True)
    assert_relu_bits(aux, z, dtype, k, bias=b)
    bits = np.unpackbits(np.asarray(aux), axis=-1, bitorder="little")
    shifted = np.packbits(np.roll(bits, 1, axis=-1), axis=-1, bitorder="little")
    with pytest.raises(AssertionError, match="bits differ"):
        assert_relu_bits(shifted, z, dtype, k, bias=b)


NARROWER = {
    "float64": np.float32,
    "float32": np.float16,
    "float16": ml_dtypes.bfloat16,
    "bfloat16": ml_dtypes.float8_e4m3fn,
}


@pytest.mark.parametrize("dtype", DTYPES)
def test_tolerance_catches_one_dtype_too_narrow(rng, dtype):
    # A result that is only as precise as the next narrower dtype fails; the dtype's own
    # correctly rounded result passes.
    x_shape, n = SEED_SHAPE
    x, w, b = make_inputs(rng, x_shape, n, dtype)
    expected, _ = oracle(x, w, b, "gelu")
    assert_close(expected.astype(dtype), expected, dtype, k=x_shape[-1])
    with pytest.raises(AssertionError, match="not close"):
        assert_close(expected.astype(NARROWER[dtype]), expected, dtype, k=x_shape[-1])


# --- return_aux -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_return_aux(rng, dtype, activation, with_bias, shape):
    x_shape, n = shape
    k, lead = x_shape[-1], x_shape[:-1]
    x, w, b = make_inputs(rng, x_shape, n, dtype, bias=with_bias)
    out = fused_dense(
        jnp.asarray(x),
        jnp.asarray(w),
        None if b is None else jnp.asarray(b),
        activation=activation,
        return_aux=True,
    )
    assert isinstance(out, tuple) and len(out) == 2
    y, aux = out
    expected, z = oracle(x, w, b, activation)
    assert y.dtype == np.dtype(dtype) and y.shape == (*lead, n)
    assert_close(y, expected, dtype, k=k, slack=epilog_slack(dtype, z, b, activation))
    if activation == "relu":
        width = _round_up(n, 128) // 8
        assert width == aux_padded_width(Activation.RELU, n)
        assert aux.dtype == np.uint8 and aux.shape == (*lead, width)
        assert_relu_bits(aux, z, dtype, k, bias=b)
    else:
        width = _round_up(n, 8)
        assert width == aux_padded_width(Activation.GELU, n)
        assert aux.dtype == np.dtype(dtype) and aux.shape == (*lead, width)
        assert_close(np.asarray(aux)[..., :n], z, dtype, k=k, slack=epilog_slack(dtype, z, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_return_aux_without_activation_is_none(rng, dtype):
    x, w, b = make_inputs(rng, (3, 5), 7, dtype)
    y, aux = fused_dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), return_aux=True)
    assert aux is None
    np.testing.assert_array_equal(
        np.asarray(y), np.asarray(fused_dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)))
    )


def test_activation_enum_members_and_numpy_inputs(rng):
    x, w, b = make_inputs(rng, (33, 129), 65, "float32")
    for name, member in (("relu", Activation.RELU), ("gelu", Activation.GELU)):
        by_name = fused_dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), activation=name)
        by_member = fused_dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), activation=member)
        from_numpy = fused_dense(x, w, b, activation=member)  # NumPy arrays are accepted as-is
        np.testing.assert_array_equal(np.asarray(by_name), np.asarray(by_member))
        np.testing.assert_array_equal(np.asarray(by_name), np.asarray(from_numpy))


def test_one_dimensional_x(rng):
    x, w, b = make_inputs(rng, (129,), 65, "float32")
    y, aux = fused_dense(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), activation="relu", return_aux=True)
    expected, z = oracle(x, w, b, "relu")
    assert y.shape == (65,) and aux.shape == (16,)
    assert_close(y, expected, "float32", k=129, slack=epilog_slack("float32", z, b, "relu"))
    assert_relu_bits(aux, z, "float32", 129, bias=b)


# --- jit and compute types --------------------------------------------------------------------


@pytest.mark.parametrize("return_aux", [False, True])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_jit_matches_eager(rng, dtype, activation, return_aux):
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (2, 3, 5, 17), 37, dtype))
    eager = fused_dense(x, w, b, activation=activation, return_aux=return_aux)
    jitted = jit_dense(x, w, b, activation=activation, return_aux=return_aux)
    eager, jitted = (o if isinstance(o, tuple) else (o,) for o in (eager, jitted))
    assert len(eager) == len(jitted)
    for e, j in zip(eager, jitted):
        if e is None:
            assert j is None
            continue
        assert e.dtype == j.dtype and e.shape == j.shape
        if e.dtype == np.uint8:  # compare the real bits only; the padding is unspecified
            np.testing.assert_array_equal(first_bits(e, 37), first_bits(j, 37))
        else:
            np.testing.assert_array_equal(np.asarray(e)[..., :37], np.asarray(j)[..., :37])


@pytest.mark.parametrize(
    "dtype, name",
    [
        ("float16", "COMPUTE_32F"),
        ("float16", "COMPUTE_32F_PEDANTIC"),
        ("bfloat16", "COMPUTE_32F"),
        ("float32", "COMPUTE_32F"),
        ("float32", "COMPUTE_32F_PEDANTIC"),
        ("float64", "COMPUTE_64F"),
        ("float64", "COMPUTE_64F_PEDANTIC"),
    ],
)
def test_compute_type_as_name_or_member(rng, dtype, name):
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (33, 129), 65, dtype))
    by_name = jit_dense(x, w, b, activation="gelu", compute_type=name)
    by_member = jit_dense(x, w, b, activation="gelu", compute_type=ComputeType[name])
    eager = fused_dense(x, w, b, activation="gelu", compute_type=ComputeType[name])
    np.testing.assert_array_equal(np.asarray(by_name), np.asarray(by_member))
    expected, z = oracle(x, w, b, "gelu")
    slack = epilog_slack(dtype, z, b, "gelu")
    # Eager runs in another executable, whose buffers may be aligned differently: on a GPU
    # that can select another cuBLASLt algorithm, so eager is compared to the oracle.
    assert_close(eager, expected, dtype, k=129, slack=slack)
    assert_close(by_name, expected, dtype, k=129, slack=slack)


def _compute_types(f, *args):
    """The compute type of every jax_epilog primitive in f's jaxpr (nested ones included)."""

    def eqns(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
                    if hasattr(sub, "eqns"):
                        yield from eqns(sub)

    found = [
        (eqn.primitive.name, ComputeType(int(eqn.params["compute_type"])).name)
        for eqn in eqns(jax.make_jaxpr(f)(*args).jaxpr)
        if eqn.primitive.name.startswith("jax_epilog_") and "compute_type" in eqn.params
    ]
    assert found, "no jax_epilog primitive with a compute type in the jaxpr"
    return found


@pytest.mark.parametrize(
    "dtype, bias_dtype, default",
    [
        ("float16", None, "COMPUTE_32F"),
        ("float16", "float32", "COMPUTE_32F"),
        ("bfloat16", None, "COMPUTE_32F"),
        ("float32", None, "COMPUTE_32F"),
        ("float64", None, "COMPUTE_64F"),
    ],
)
def test_default_compute_type_is_32f_or_64f(rng, dtype, bias_dtype, default):
    # On the CPU COMPUTE_32F and _PEDANTIC give the same numbers, so the resolved compute
    # type is read from the primitives (forward, and the backward's fused ops).
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (3, 5), 7, dtype, bias_dtype=bias_dtype))
    layer = lambda x, w, b: fused_dense(x, w, b, activation="gelu")
    forward = _compute_types(layer, x, w, b)
    assert [name for name, _ in forward] == ["jax_epilog_fused_matmul"], forward
    backward = _compute_types(jax.grad(lambda *a: layer(*a).sum(), argnums=(0, 1, 2)), x, w, b)
    assert {ct for _, ct in forward + backward} == {default}, (forward, backward)
    np.testing.assert_array_equal(
        np.asarray(jit_dense(x, w, b, activation="relu")),
        np.asarray(jit_dense(x, w, b, activation="relu", compute_type=default)),
    )


FAST_COMPUTE_TYPES = ["COMPUTE_32F_FAST_TF32", "COMPUTE_32F_FAST_16F", "COMPUTE_32F_FAST_16BF"]


@pytest.mark.parametrize("name", FAST_COMPUTE_TYPES)
def test_float32_fast_compute_types_round_the_operands(rng, name):
    """COMPUTE_32F_FAST_* allow the GEMM to round its float32 operands to float16, bfloat16
    or TF32 (accumulating in float32). The CPU path rounds them (to nearest); cuBLASLt may,
    or may keep more bits (the H200 did either, by problem: see _reference._FAST_FORMATS),
    so on a GPU the result need only lie within that rounding of the exact one."""
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (33, 129), 65, "float32"))
    rounded = [round_operand(a, name) for a in (x, w)]
    expected, z = oracle(*rounded, b, "gelu")
    exact, z_exact = oracle(x, w, b, "gelu")
    # The rounding is no detail the tolerance could hide: 2**-11 (2**-8) of each operand.
    assert np.abs(z - z_exact).max() > 50 * tolerance("float32", 129)[1]
    acc_eps = 2.0**-7 if name.endswith("16BF") else 2.0**-10
    for ct in (name, ComputeType[name]):
        y, aux = jit_dense(x, w, b, activation="gelu", compute_type=ct, return_aux=True)
        assert y.dtype == np.float32 and aux.dtype == np.float32
        if ON_GPU:
            slack = epilog_slack("float32", z_exact, b, "gelu")
            assert_close(y, exact, "float32", k=129, acc_eps=acc_eps, slack=slack)
            assert_close(np.asarray(aux)[:, :65], z_exact, "float32", k=129, acc_eps=acc_eps)
        else:
            assert_close(y, expected, "float32", k=129)
            assert_close(np.asarray(aux)[:, :65], z, "float32", k=129)


def test_float32_fast_16f_keeps_float16s_range_on_the_cpu(rng):
    """_16F rounds the operands to float16, not merely to 10 mantissa bits as _TF32 does: a
    float16 subnormal keeps fewer bits, and beyond 65504 an operand overflows. The CPU
    path's (on a GPU cuBLASLt may keep float32 products: the test above)."""
    x = rng.standard_normal((2, 4)).astype(np.float32)
    w = rng.standard_normal((4, 5)).astype(np.float32)
    b = rng.standard_normal(5).astype(np.float32)
    # A float16 subnormal 0.4 of its spacing (2**-24) off the grid, and an overflow.
    x[0, 0], x[1, 0], w[0] = (rng.integers(30, 60) + 0.4) * 2.0**-24, 7e4, 1e4
    names = ("COMPUTE_32F_FAST_16F", "COMPUTE_32F_FAST_TF32")
    with jax.default_device(jax.devices("cpu")[0]):
        y = {ct: np.asarray(jit_dense(x, w, b, activation=None, compute_type=ct)) for ct in names}
    for ct in names:
        want, _ = oracle(round_operand(x[:1], ct), round_operand(w, ct), b, None)
        assert_close(y[ct][:1], want, "float32", k=4, what=ct)
    assert np.abs(y[names[0]][0] - y[names[1]][0]).max() > 50 * tolerance("float32", 4)[1]
    assert np.isinf(y[names[0]][1]).all() and np.isfinite(y[names[1]][1]).all()


# Regression: _primitive._impl once wrapped a fresh partial in a fresh jax.jit on every eager call.
def test_eager_calls_do_not_recompile(rng):
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (3, 5), 7, "float32"))
    fused_dense(x, w, b, activation="relu").block_until_ready()  # warm up
    with count_backend_compiles() as compiles:
        for _ in range(3):
            fused_dense(x, w, b, activation="relu").block_until_ready()
    assert len(compiles) == 0, f"{len(compiles)} XLA compilations for 3 identical eager calls"


# --- vmap -------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "gelu", None], ids=str)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_vmap_over_x_shared_kernel(rng, dtype, activation):
    batch, m, k, n = 4, 6, 129, 65
    xs, w, b = make_inputs(rng, (batch, m, k), n, dtype)
    xs, w, b = jnp.asarray(xs), jnp.asarray(w), jnp.asarray(b)
    f = lambda x: fused_dense(x, w, b, activation=activation, return_aux=True)
    stacked = fused_dense(xs, w, b, activation=activation, return_aux=True)
    for in_axis in (0, 1):
        mapped = jax.vmap(f, in_axes=in_axis)(jnp.moveaxis(xs, 0, in_axis))
        _assert_same_outputs(mapped, stacked, n)
    _assert_same_outputs(jax.jit(jax.vmap(f))(xs), stacked, n)
    # and x batched as single rows: vmap of a 1-D x
    rows = jax.vmap(f)(xs.reshape(batch * m, k))
    _assert_same_outputs(rows, tuple(None if o is None else o.reshape(batch * m, -1) for o in stacked), n)


@pytest.mark.parametrize("activation", ["relu", "gelu", None], ids=str)
@pytest.mark.parametrize("in_axes", [(None, 0, 0), (0, 0, 0), (None, 0, None), (None, None, 0)], ids=str)
def test_vmap_ensemble_matches_python_loop(rng, activation, in_axes):
    members, m, k, n = 3, 6, 24, 37
    dtype = "float32"
    x = jnp.asarray(rng.standard_normal((members, m, k) if in_axes[0] == 0 else (m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((members, k, n) if in_axes[1] == 0 else (k, n)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal((members, n) if in_axes[2] == 0 else (n,)), dtype)
    f = lambda x, w, b: fused_dense(x, w, b, activation=activation, return_aux=True)
    y, aux = jax.vmap(f, in_axes=in_axes)(x, w, b)
    assert y.shape == (members, m, n)
    pick = lambda a, ax, i: a if ax is None else a[i]
    for i in range(members):
        xi, wi, bi = (pick(a, ax, i) for a, ax in zip((x, w, b), in_axes))
        yi, auxi = f(xi, wi, bi)
        expected, z = oracle(xi, wi, bi, activation)
        slack = epilog_slack(dtype, z, bi, activation)
        # Members run from slices of stacked buffers: on a GPU another cuBLASLt algorithm
        # may serve them, so the loop's result is compared with the epilog's slack too.
        assert_close(y[i], yi, dtype, k=k, slack=2 * slack)
        assert_close(y[i], expected, dtype, k=k, slack=slack)
        if activation is None:
            assert aux is None and auxi is None
        elif activation == "relu":
            assert aux.shape == (members, *auxi.shape)
            assert_relu_bits(aux[i], z, dtype, k, bias=bi)
            np.testing.assert_array_equal(first_bits(aux[i], n), first_bits(auxi, n))
        else:
            assert aux.shape == (members, *auxi.shape)
            aux_slack = 2 * epilog_slack(dtype, z, bi)
            assert_close(np.asarray(aux[i])[:, :n], np.asarray(auxi)[:, :n], dtype, k=k, slack=aux_slack)


def _assert_same_outputs(got, want, n):
    y, aux = got
    y0, aux0 = want
    assert y.shape == y0.shape and y.dtype == y0.dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y0))
    if aux0 is None:
        assert aux is None
    elif aux0.dtype == np.uint8:
        assert aux.shape == aux0.shape
        np.testing.assert_array_equal(first_bits(aux, n), first_bits(aux0, n))
    else:
        assert aux.shape == aux0.shape and aux.dtype == aux0.dtype
        np.testing.assert_array_equal(np.asarray(aux)[..., :n], np.asarray(aux0)[..., :n])


# --- empty dimensions -------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("x_shape", [(0, 24), (2, 0, 24)], ids=["0x24", "2x0x24"])
def test_empty_m(rng, dtype, activation, x_shape):
    n = 37
    x, w, b = make_inputs(rng, x_shape, n, dtype)
    y, aux = fused_dense(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), activation=activation, return_aux=True
    )
    lead = x_shape[:-1]
    assert y.shape == (*lead, n) and y.dtype == np.dtype(dtype)
    if activation is None:
        assert aux is None
    else:
        assert aux.shape == (*lead, aux_padded_width(Activation(activation), n))


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_k_is_activation_of_bias(rng, dtype, activation, with_bias):
    m, n = 5, 37
    x, w, b = make_inputs(rng, (m, 0), n, dtype, bias=with_bias)
    if with_bias:
        b[:3] = [0.0, -1.5, 2.0]  # an exact zero is not positive
    y, aux = fused_dense(
        jnp.asarray(x),
        jnp.asarray(w),
        None if b is None else jnp.asarray(b),
        activation=activation,
        return_aux=True,
    )
    z = np.broadcast_to(np.zeros(n) if b is None else np.asarray(b, np.float64), (m, n))
    expected, _ = oracle(np.zeros((m, 0)), np.zeros((0, n)), b, activation)
    assert y.shape == (m, n) and y.dtype == np.dtype(dtype)
    assert_close(y, expected, dtype, k=0)
    if activation == "relu":
        np.testing.assert_array_equal(first_bits(aux, n), z > 0)
    elif activation == "gelu":
        assert_close(np.asarray(aux)[:, :n], z, dtype, k=0)


def test_empty_n(rng):
    x, w, _ = make_inputs(rng, (3, 5), 0, "float32")
    y, aux = fused_dense(
        jnp.asarray(x), jnp.asarray(w), jnp.zeros((0,), jnp.float32), activation="relu", return_aux=True
    )
    assert y.shape == (3, 0) and aux.shape == (3, 0)


# --- bad inputs: each names the bad value and what is allowed ---------------------------------

F32 = jnp.float32


def _arr(shape, dtype=F32):
    return jnp.ones(shape, dtype)


def _raises(exc, call, *needles):
    """``call()`` raises ``exc`` whose message contains every needle (in any order)."""
    with pytest.raises(exc, match=re.escape(needles[0])) as info:
        call()
    message = str(info.value)
    for needle in needles[1:]:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def test_error_k_mismatch():
    _raises(ValueError, lambda: fused_dense(_arr((3, 5)), _arr((6, 7))), "last dimension 5", "K=6", "(6, 7)")


def test_error_bias_wrong_length():
    _raises(ValueError, lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), _arr((6,))), "(6,)", "(7,)")


def test_error_bias_wrong_rank():
    _raises(
        ValueError, lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), _arr((1, 7))), "(1, 7)", "(N,) = (7,)"
    )


@pytest.mark.parametrize("dtype", ["int32", "complex64", "bool", "uint8"])
def test_error_unsupported_x_dtype(dtype):
    _raises(
        TypeError,
        lambda: fused_dense(_arr((3, 5), dtype), _arr((5, 7), dtype)),
        f"dtype {dtype}",
        "float16",
        "bfloat16",
        "float32",
        "float64",
    )


def test_error_mixed_x_and_kernel_dtypes():
    _raises(
        TypeError,
        lambda: fused_dense(_arr((3, 5)), _arr((5, 7), jnp.float16)),
        "kernel dtype float16",
        "x dtype float32",
    )


@pytest.mark.parametrize(
    "x_dtype, b_dtype, allowed",
    [
        ("float32", "float16", "['float32']"),
        ("float32", "float64", "['float32']"),
        ("float64", "float32", "['float64']"),
        ("bfloat16", "float16", "['bfloat16', 'float32']"),
        ("float16", "bfloat16", "['float16', 'float32']"),
    ],
)
def test_error_bias_dtype(x_dtype, b_dtype, allowed):
    _raises(
        TypeError,
        lambda: fused_dense(_arr((3, 5), x_dtype), _arr((5, 7), x_dtype), _arr((7,), b_dtype)),
        f"bias dtype {b_dtype}",
        f"allowed: {allowed}",
    )


def test_error_unknown_activation():
    msg = _raises(
        ValueError,
        lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), activation="tanh"),
        "'tanh'",
        "'relu'",
        "'gelu'",
    )
    assert "None" in msg


@pytest.mark.parametrize("name", ["gelu_erf", "gelu_exact", "GELU"])
def test_error_exact_gelu_points_to_tanh_approximation(name):
    _raises(
        ValueError,
        lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), activation=name),
        repr(name),
        "'gelu'",
        "tanh approximation",
        "approximate=False",
    )


@pytest.mark.parametrize("value", ["COMPUTE_99F", "compute_32f", "", 3.0], ids=repr)
def test_error_unknown_compute_type(value):
    _raises(
        ValueError,
        lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), compute_type=value),
        f"unknown compute_type {value!r}",
        "allowed for float32 operands: ['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC', 'COMPUTE_32F_FAST_TF32'",
    )


@pytest.mark.parametrize(
    "x_dtype, b_dtype, compute_type, allowed",
    [
        ("bfloat16", None, "COMPUTE_16F", "['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC']"),
        ("float16", None, "COMPUTE_32F_FAST_TF32", "['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC', 'COMPUTE_16F'"),
        ("float16", "float32", "COMPUTE_16F", "['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC']"),
        (
            "float32",
            None,
            "COMPUTE_16F",
            (
                "['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC', 'COMPUTE_32F_FAST_TF32', 'COMPUTE_32F_FAST_16F', "
                "'COMPUTE_32F_FAST_16BF']"
            ),
        ),
        ("float64", None, "COMPUTE_32F", "['COMPUTE_64F', 'COMPUTE_64F_PEDANTIC']"),
    ],
)
def test_error_compute_type_invalid_for_dtype(x_dtype, b_dtype, compute_type, allowed):
    bias = None if b_dtype is None else _arr((7,), b_dtype)
    needles = [f"compute_type {compute_type} cannot run {x_dtype} operands", f"allowed: {allowed}"]
    if b_dtype == "float32":
        needles.append("with a float32 bias")
    for ct in (compute_type, ComputeType[compute_type]):
        _raises(
            ValueError,
            lambda ct=ct: fused_dense(_arr((3, 5), x_dtype), _arr((5, 7), x_dtype), bias, compute_type=ct),
            *needles,
        )


@pytest.mark.parametrize("which", ["x", "kernel", "bias"])
def test_error_python_list(which):
    args = {"x": _arr((3, 5)), "kernel": _arr((5, 7)), "bias": _arr((7,))}
    args[which] = np.asarray(args[which]).tolist()
    _raises(
        TypeError,
        lambda: fused_dense(args["x"], args["kernel"], args["bias"]),
        f"{which} must be",
        "JAX or NumPy array",
        "got list",
    )


@pytest.mark.parametrize("shape", [(5,), (5, 7, 1)], ids=["rank1", "rank3"])
def test_error_kernel_rank(shape):
    _raises(ValueError, lambda: fused_dense(_arr((3, 5)), _arr(shape)), f"got shape {shape}", "(K, N)")


def test_error_scalar_x():
    _raises(
        ValueError, lambda: fused_dense(jnp.asarray(1.0, F32), _arr((5, 7))), "scalar of shape ()", "(..., K)"
    )


# --- errors at trace time ---------------------------------------------------------------------

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize(
    "args, kwargs, exc, needle",
    [
        ((S((3, 5), F32), S((6, 7), F32)), {}, ValueError, "must equal kernel's first dimension K=6"),
        ((S((3, 5), F32), S((5, 7), F32), S((1, 7), F32)), {}, ValueError, "bias must have shape"),
        ((S((3, 5), jnp.int32), S((5, 7), jnp.int32)), {}, TypeError, "x has dtype int32"),
        ((S((3, 5), F32), S((5, 7), jnp.float16)), {}, TypeError, "kernel dtype float16"),
        ((S((3, 5), F32), S((5, 7), F32), S((7,), jnp.float16)), {}, TypeError, "bias dtype float16"),
        ((S((3, 5), F32), S((5, 7), F32)), {"activation": "tanh"}, ValueError, "unknown activation"),
        (
            (S((3, 5), jnp.bfloat16), S((5, 7), jnp.bfloat16)),
            {"compute_type": "COMPUTE_16F"},
            ValueError,
            "cannot run bfloat16",
        ),
        ((S((3, 5), F32), S((5,), F32)), {}, ValueError, "kernel must have shape (K, N)"),
    ],
    ids=["K", "bias-rank", "int32", "mixed", "bias-dtype", "activation", "compute-type", "kernel-rank"],
)
def test_errors_raise_at_trace_time(args, kwargs, exc, needle):
    with count_backend_compiles() as compiles:
        with pytest.raises(exc, match=re.escape(needle)):
            jit_dense.lower(*args, **kwargs)
        with pytest.raises(exc, match=re.escape(needle)):
            jax.eval_shape(lambda *a: fused_dense(*a, **kwargs), *args)
    assert not compiles  # nothing was compiled, let alone run


def test_abstract_trace_of_valid_inputs():
    out = jax.eval_shape(
        lambda x, w, b: fused_dense(x, w, b, activation="gelu", return_aux=True),
        S((2, 3, 40, 24), jnp.float16),
        S((24, 37), jnp.float16),
        S((37,), jnp.float32),
    )
    assert out[0].shape == (2, 3, 40, 37) and out[0].dtype == np.float16
    assert out[1].shape == (2, 3, 40, 40) and out[1].dtype == np.float32
    lowered = jit_dense.lower(S((2, 3, 40, 24), F32), S((24, 37), F32), activation="relu", return_aux=True)
    assert lowered.out_info[1].shape == (2, 3, 40, 16) and lowered.out_info[1].dtype == np.uint8


# --- NumPy float64 inputs without jax_enable_x64 ----------------------------------------------


def test_numpy_float64_inputs_without_x64(rng):
    x, w, b = make_inputs(rng, (3, 5), 7, "float64")
    with jax.enable_x64(False):
        # Like jnp.matmul: NumPy float64 inputs are canonicalised to float32.
        assert jnp.matmul(x, w).dtype == np.float32
        jitted = jit_dense(x, w, b, activation="gelu")
        assert jitted.dtype == np.float32
        eager = fused_dense(x, w, b, activation="gelu")
        assert eager.dtype == np.float32
    x32, w32, b32 = (a.astype(np.float32) for a in (x, w, b))
    expected, z = oracle(x32, w32, b32, "gelu")
    for y in (eager, jitted):
        assert_close(y, expected, "float32", k=5, slack=epilog_slack("float32", z, b32, "gelu"))
