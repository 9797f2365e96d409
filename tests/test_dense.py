"""``jax_epilog.fused_dense`` and its custom_vjp: values, the aux and gradients against
float64 oracles, every implementation's semantics, and JAX's transformations.

Most tests run the op itself (implementation="cublaslt": its cuBLASLt kernels on a GPU,
its reference math on a CPU), so the file doubles as a GPU test; "auto"'s choices are
test_dispatch.py's, argument errors test_checks.py's.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import (
    FUSED,
    GPU_TOL,
    ON_GPU,
    act_fn,
    assert_relatively_close,
    assert_scaled_close,
    jaxpr_text,
    masked_relu,
    np_dtype,
    oracle,
    reference_relu_mask,
    relu_clear,
    round_operand,
)
from jax.test_util import check_grads
from tolerances import assert_close, epilog_slack, tolerance

import jax_epilog
from jax_epilog import Activation, ComputeType, aux_padded_width, override_policy

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
SEED_SHAPE = ((256, 784), 100)


def _shape_id(shape):
    x_shape, n = shape
    return f"{'x'.join(map(str, x_shape))}-N{n}"


def _cases(shapes, per_pair):
    """(dtype, activation, with_bias, shape, i) for every dtype, activation and bias, each
    with ``per_pair`` of ``shapes``, rotating so that every dtype and every activation
    meets every shape: the full product would compile the same programs over again."""
    cases = []
    for (i, dtype), (j, act), bias, t in itertools.product(
        enumerate(DTYPES), enumerate(ACTIVATIONS), (True, False), range(per_pair)
    ):
        shape = shapes[(4 * j + 2 * bias + t + i) % len(shapes)]
        case_id = f"{dtype}-{act}-{'bias' if bias else 'nobias'}-{_shape_id(shape)}"
        cases.append(pytest.param(dtype, act, bias, shape, t, id=case_id))
    return cases


def make_inputs(rng, x_shape, n, dtype, *, bias=True, bias_dtype=None, activation=None, margin=None):
    """Random O(1) inputs made in float64 and cast: x ~ N(0, 1), kernel ~ N(0, 1/K), bias
    ~ N(0, 1); NumPy arrays in ``dtype`` (bias in ``bias_dtype``, or None). With
    ``margin`` and ReLU, redrawn until no pre-activation lies within it of the kink, where
    rounding could flip the derivative."""
    k = x_shape[-1]
    for _ in range(100):
        x = rng.standard_normal(x_shape).astype(np_dtype(dtype))
        w = (rng.standard_normal((k, n)) / np.sqrt(max(k, 1))).astype(np_dtype(dtype))
        b = rng.standard_normal(n).astype(np_dtype(bias_dtype or dtype)) if bias else None
        if margin is None or activation != "relu":
            return x, w, b
        z = oracle(x, w, b, None)[1]
        if z.size == 0 or np.abs(z).min() > margin:
            return x, w, b
    raise AssertionError("could not draw inputs clear of the ReLU kink")


def first_bits(mask, n):
    """The first n bits of each row of a uint8 mask (bit j % 8 of byte j // 8), with NumPy."""
    return np.unpackbits(np.asarray(mask), axis=-1, bitorder="little")[..., :n].astype(bool)


def assert_relu_bits(
    aux, z, dtype, k, *, acc_eps=None, factor=10.0, min_coverage=0.9, bias=None, epilog_dtype=None
):
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


def assert_aux(aux, z, activation, dtype, k, lead, n, *, bias=None, epilog_dtype=None):
    """The aux's layout (``aux_padded_width``, its dtype) and its first N columns: ReLU's
    bits z > 0, GELU's z itself."""
    epilog_dtype = epilog_dtype or dtype
    if activation is None:
        assert aux is None
    elif Activation(activation) is Activation.RELU:
        assert aux.dtype == np.uint8 and aux.shape == (*lead, -(-n // 128) * 16)
        assert_relu_bits(aux, z, dtype, k, bias=bias, epilog_dtype=epilog_dtype)
    else:
        assert aux.dtype == np.dtype(epilog_dtype) and aux.shape == (*lead, -(-n // 8) * 8)
        assert_close(
            np.asarray(aux)[..., :n], z, epilog_dtype, k=k, slack=epilog_slack(epilog_dtype, z, bias)
        )


# --- forward and aux vs the float64 oracle ----------------------------------------------------


@pytest.mark.parametrize("dtype, activation, with_bias, shape, t", _cases(SHAPES, 2))
def test_forward_and_aux_match_float64_oracle(rng, dtype, activation, with_bias, shape, t):
    """y (and, every other case, the aux: ReLU's bit-mask, GELU's z, padded as
    ``aux_padded_width`` says) against the float64 oracle of the cast inputs."""
    x_shape, n = shape
    k, lead = x_shape[-1], x_shape[:-1]
    return_aux = t == 0
    x, w, b = make_inputs(rng, x_shape, n, dtype, bias=with_bias)
    out = fused_dense(
        jnp.asarray(x),
        jnp.asarray(w),
        None if b is None else jnp.asarray(b),
        activation=activation,
        return_aux=return_aux,
    )
    y, aux = out if return_aux else (out, None)
    assert isinstance(y, jax.Array) and y.dtype == np.dtype(dtype) and y.shape == (*lead, n)
    expected, z = oracle(x, w, b, activation)
    assert_close(y, expected, dtype, k=k, slack=epilog_slack(dtype, z, b, activation))
    if return_aux:
        assert_aux(aux, z, activation, dtype, k, lead, n, bias=b)


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
    # The epilog runs in float32, so z must be float32-accurate: a bias rounded to float16
    # before the add would fail here.
    assert_aux(aux, z, activation, "float16", k, (m,), n, bias=b, epilog_dtype="float32")


@pytest.mark.parametrize(
    "dtype, activation, shape",
    [
        (dtype, act, shape)
        for (dtype, act), shape in zip(
            itertools.product(HALF, ACTIVATIONS), [((33, 129), 65), ((2, 3, 5, 17), 37)] * 3
        )
    ],
    ids=str,
)
def test_half_with_float32_bias(rng, dtype, activation, shape):
    x_shape, n = shape
    x, w, b = make_inputs(rng, x_shape, n, dtype, bias_dtype="float32")
    y, aux = fused_dense(
        jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), activation=activation, return_aux=True
    )
    expected, z = oracle(x, w, b, activation)
    assert y.dtype == np.dtype(dtype) and y.shape == (*x_shape[:-1], n)
    assert_close(y, expected, dtype, k=x_shape[-1], slack=epilog_slack("float32", z, b, activation))
    assert_aux(aux, z, activation, dtype, x_shape[-1], x_shape[:-1], n, bias=b, epilog_dtype="float32")


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
        assert_close(
            np.asarray(aux)[:, :n], z, "float16", k=k, acc_eps=eps16, slack=epilog_slack("float16", z, b)
        )
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
        assert_close(
            jit_dense(xj, wj, bj, activation=act), expected, dtype, k=k, slack=slack
        )  # right: passes
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
    transposed = jit_dense(
        jnp.asarray(xs), jnp.asarray(np.ascontiguousarray(ws.T)), jnp.asarray(bs), activation="gelu"
    )
    rejects(transposed, ys, epilog_slack(dtype, zs, bs, "gelu"))
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


# --- the call's forms -------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_return_aux_without_activation_returns_y_and_none(rng, implementation):
    for dtype in DTYPES:
        x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (3, 5), 7, dtype))
        out = jax_epilog.fused_dense(x, w, b, return_aux=True, implementation=implementation)
        assert isinstance(out, tuple) and len(out) == 2 and out[1] is None
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(fused_dense(x, w, b)))


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


@pytest.mark.parametrize(
    "dtype, activation, return_aux",
    [(dtype, ACTIVATIONS[i % 3], i % 2 == 0) for i, dtype in enumerate(DTYPES + ["bfloat16", "float32"])],
    ids=str,
)
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


def test_abstract_trace_of_valid_inputs():
    out = jax.eval_shape(
        lambda x, w, b: fused_dense(x, w, b, activation="gelu", return_aux=True),
        jax.ShapeDtypeStruct((2, 3, 40, 24), jnp.float16),
        jax.ShapeDtypeStruct((24, 37), jnp.float16),
        jax.ShapeDtypeStruct((37,), jnp.float32),
    )
    assert out[0].shape == (2, 3, 40, 37) and out[0].dtype == np.float16
    assert out[1].shape == (2, 3, 40, 40) and out[1].dtype == np.float32
    args = (jax.ShapeDtypeStruct((2, 3, 40, 24), jnp.float32), jax.ShapeDtypeStruct((24, 37), jnp.float32))
    lowered = jit_dense.lower(*args, activation="relu", return_aux=True)
    assert lowered.out_info[1].shape == (2, 3, 40, 16) and lowered.out_info[1].dtype == np.uint8


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


# --- compute types ----------------------------------------------------------------------------


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
    or may keep more bits (see _reference._FAST_FORMATS), so on a GPU the result need only
    lie within that rounding of the exact one."""
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


# --- vmap with shared weights -----------------------------------------------------------------


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


@pytest.mark.parametrize(
    "dtype, activation", [("bfloat16", "relu"), ("float32", "gelu"), ("float32", None)], ids=str
)
def test_vmap_over_x_shared_kernel(rng, dtype, activation):
    """vmap over x alone (any axis, jitted, and over single rows) is the call on the
    stacked rows, bit for bit."""
    batch, m, k, n = 4, 6, 129, 65
    xs, w, b = (jnp.asarray(a) for a in make_inputs(rng, (batch, m, k), n, dtype))
    f = lambda x: fused_dense(x, w, b, activation=activation, return_aux=True)
    stacked = fused_dense(xs, w, b, activation=activation, return_aux=True)
    for in_axis in (0, 1):
        mapped = jax.vmap(f, in_axes=in_axis)(jnp.moveaxis(xs, 0, in_axis))
        _assert_same_outputs(mapped, stacked, n)
    _assert_same_outputs(jax.jit(jax.vmap(f))(xs), stacked, n)
    rows = jax.vmap(f)(xs.reshape(batch * m, k))  # x batched as single rows: vmap of a 1-D x
    _assert_same_outputs(rows, tuple(None if o is None else o.reshape(batch * m, -1) for o in stacked), n)


# --- empty dimensions -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, activation, x_shape",
    [(dtype, ACTIVATIONS[i % 3], [(0, 24), (2, 0, 24)][i % 2]) for i, dtype in enumerate(DTYPES * 2)],
    ids=str,
)
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


@pytest.mark.parametrize(
    "dtype, activation, with_bias",
    [
        (dtype, ACTIVATIONS[i % 3], i < 3)
        for i, dtype in enumerate(["float32", "bfloat16", "float16", "float64", "float32", "bfloat16"])
    ],
    ids=str,
)
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


@pytest.mark.parametrize("activation", ACTIVATIONS, ids=str)
def test_empty_dimensions_have_defined_gradients(rng, activation):
    w = jnp.asarray(rng.standard_normal((5, 7)), jnp.float64)
    b = jnp.asarray(rng.standard_normal(7), jnp.float64)
    loss = lambda x, w, b: fused_dense(x, w, b, activation=activation).sum()
    dx, dw, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jnp.zeros((0, 5), jnp.float64), w, b)
    assert dx.shape == (0, 5)
    np.testing.assert_array_equal(np.asarray(dw), 0)
    np.testing.assert_array_equal(np.asarray(db), 0)
    # K = 0: y = act(bias) in every row, so dbias = m * act'(bias).
    xk = jnp.zeros((4, 0), jnp.float64)
    db = jax.jit(
        jax.grad(lambda b: fused_dense(xk, jnp.zeros((0, 7), jnp.float64), b, activation=activation).sum())
    )(b)
    want = 4 * jax.vmap(jax.grad(act_fn(activation)))(b)
    np.testing.assert_allclose(np.asarray(db), np.asarray(want), rtol=1e-12)


# --- gradients vs the float64 reference VJP ---------------------------------------------------

# (x shape, N): M = 1, N = 1, K = 1, leading dims, sizes that are no multiple of 8.
GRAD_SHAPES = [((1, 1), 1), ((1, 40), 1), ((17, 1), 9), ((3, 5), 7), ((33, 129), 65), ((2, 3, 5, 17), 37)]
# Largest error relative to the gradient's natural scale. The half dtypes round dz to the
# operand dtype before the backward GEMMs (as XLA's own autodiff of a bf16 graph does).
GRAD_TOL = {"float16": 6e-3, "bfloat16": 5e-2, "float32": 2e-5, "float64": 1e-12}


def reference_vjp(x, w, b, activation, dy, relu_mask=None):
    """Gradients of act(x @ w + b) in float64, from the *cast* inputs.

    ``relu_mask`` (from ``reference_relu_mask``) replaces ReLU's derivative (z > 0).
    """
    args = [np.asarray(a, np.float64) for a in (x, w) + (() if b is None else (b,))]
    return _reference_vjp(np.asarray(dy, np.float64), relu_mask, *args, activation=activation)


@functools.partial(jax.jit, static_argnames="activation")
def _reference_vjp(dy, relu_mask, x, w, *b, activation):
    """(Compiled once per shapes and activation: the cases of every dtype share it.)"""

    def f(x, w, *b):
        z = x @ w + (b[0] if b else 0.0)
        if relu_mask is not None:
            return masked_relu(z, relu_mask)
        return act_fn(activation)(z)

    return jax.vjp(f, x, w, *b)[1](dy)


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
    assert err <= GRAD_TOL[dtype], (
        f"{what} ({dtype}): max error {err:.3g} of the scale {scale:.3g} > {GRAD_TOL[dtype]}"
    )


@pytest.mark.parametrize("dtype, activation, with_bias, shape, t", _cases(GRAD_SHAPES, 2))
def test_grads_match_float64_reference_vjp(rng, dtype, activation, with_bias, shape, t):
    x_shape, n = shape
    x, w, b = make_inputs(rng, x_shape, n, dtype, bias=with_bias, activation=activation, margin=1e-4)
    dy = rng.standard_normal((*x_shape[:-1], n)).astype(np_dtype(dtype))
    args = (x, w) if b is None else (x, w, b)

    def f(x, w, *b):
        return fused_dense(x, w, b[0] if b else None, activation=activation)

    grads = jax.jit(lambda dy, *a: jax.vjp(f, *a)[1](dy))(dy, *args)  # (one compilation: faster than eager)
    mask = reference_relu_mask(x, w, b, dtype) if activation == "relu" else None
    want = reference_vjp(x, w, b, activation, dy, relu_mask=mask)
    for name, got, ref, primal, scale in zip(
        ("dx", "dkernel", "dbias"), grads, want, args, grad_scales(x, w, dy)
    ):
        assert got.dtype == primal.dtype, f"{name} dtype {got.dtype} != primal dtype {primal.dtype}"
        assert_grad_close(got, ref, dtype, name, scale)


@pytest.mark.parametrize("dtype, activation", [("float16", "gelu"), ("bfloat16", "relu")])
def test_half_operands_with_float32_bias_give_float32_dbias(rng, dtype, activation):
    x, w, b = make_inputs(rng, (33, 129), 65, dtype, bias_dtype="float32", activation=activation, margin=1e-4)
    dy = rng.standard_normal((33, 65)).astype(np_dtype(dtype))
    layer = lambda x, w, b: fused_dense(x, w, b, activation=activation)
    dx, dw, db = jax.jit(lambda dy, *a: jax.vjp(layer, *a)[1](dy))(dy, x, w, b)
    assert (dx.dtype, dw.dtype, db.dtype) == (np.dtype(np_dtype(dtype)),) * 2 + (np.dtype(np.float32),)
    # The epilog adds the float32 bias in float32 (the float32-bias forward tests above).
    mask = reference_relu_mask(x, w, b, dtype, epilog_dtype="float32") if activation == "relu" else None
    want = reference_vjp(x, w, b, activation, dy, relu_mask=mask)
    for name, got, ref, scale in zip(("dx", "dkernel", "dbias"), (dx, dw, db), want, grad_scales(x, w, dy)):
        assert_grad_close(got, ref, dtype, name, scale)


@pytest.mark.parametrize(
    "dtype, activation, with_bias",
    [
        ("float64", None, True),
        ("float64", "relu", False),
        ("float64", "gelu", True),
        ("float32", "gelu", False),
    ],
    ids=str,
)
def test_check_grads_reverse_mode(rng, dtype, activation, with_bias):
    # Finite differences step 1e-3 (float64) or ~1e-2 (float32): keep ReLU's kink further away.
    x, w, b = make_inputs(rng, (4, 9), 6, dtype, bias=with_bias, activation=activation, margin=0.05)
    args = (x, w) if b is None else (x, w, b)

    def f(x, w, *b):
        return fused_dense(x, w, b[0] if b else None, activation=activation)

    tol = 2e-2 if dtype == "float32" else 1e-5
    check_grads(jax.jit(f), tuple(map(jnp.asarray, args)), order=1, modes=("rev",), atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "dtype, activation, with_bias, return_aux",
    [
        ("float64", None, True, False),
        ("float64", "relu", False, True),
        ("float64", "gelu", True, True),
        ("float32", "gelu", False, False),
        ("float32", "relu", True, True),
    ],
    ids=str,
)
def test_gradients_differentiate_again(rng, dtype, activation, with_bias, return_aux):
    """Reverse over reverse (a gradient penalty, MAML, a Hessian): the fused primitives
    differentiate through their reference math, so a gradient of the op has the plain
    expression's derivatives: checked numerically (float64), and against the expression's
    gradient of a gradient penalty and its Hessian in the kernel. With ``return_aux`` the
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
        check_grads(jax.jit(fused), args, order=2, modes=("rev",), atol=1e-4, rtol=1e-4)

    argnums = tuple(range(len(args)))
    penalty = lambda f: lambda *a: jnp.sum(jax.grad(f, argnums=1)(*a) ** 2)
    hessian = lambda f: jax.jit(jax.hessian(f, argnums=1))
    as64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
    tol = 1e-4 if dtype == "float32" else 1e-12
    got = jax.jit(jax.grad(penalty(fused), argnums))(*args)
    want = jax.jit(jax.grad(penalty(plain), argnums))(*as64)
    for name, g, r in zip(("x", "kernel", "bias"), got, want):
        assert_relatively_close(g, r, tol, f"penalty's gradient in {name}")
    assert_relatively_close(hessian(fused)(*args), hessian(plain)(*as64), tol, "Hessian in the kernel")


def test_gradients_of_a_tf32_layer_differentiate_again(rng):
    """A float32 GELU layer with COMPUTE_32F_FAST_TF32 keeps TF32 in its second derivatives
    (on a CPU the operands' rounding is emulated): its gradient penalty's gradient and
    Hessian are the plain expression's to TF32's precision."""
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (7, 19), 10, "float32"))
    tf32 = functools.partial(fused_dense, activation="gelu", compute_type="COMPUTE_32F_FAST_TF32")
    fused = lambda x, w, b: jnp.sum(jnp.sin(tf32(x, w, b)))
    plain = lambda x, w, b: jnp.sum(jnp.sin(act_fn("gelu")(x @ w + b)))
    penalty = lambda f: lambda *a: jnp.sum(jax.grad(f, argnums=1)(*a) ** 2)
    as64 = [jnp.asarray(np.asarray(a, np.float64)) for a in (x, w, b)]
    tol = 1e-2  # (seen: up to 2.0e-3 over 120 draws; TF32 keeps 10 mantissa bits)
    got = jax.jit(jax.grad(penalty(fused), (0, 1, 2)))(x, w, b)
    want = jax.jit(jax.grad(penalty(plain), (0, 1, 2)))(*as64)
    for name, g, r in zip(("x", "kernel", "bias"), got, want):
        assert_relatively_close(g, r, tol, f"penalty's gradient in {name}")
    hessian = lambda f: jax.jit(jax.hessian(f, argnums=1))
    assert_relatively_close(hessian(fused)(x, w, b), hessian(plain)(*as64), tol, "Hessian in the kernel")


def test_gelu_aux_is_differentiable_and_relu_mask_is_not(rng):
    x, w, b = make_inputs(rng, (2, 5, 13), 11, "float64")

    def with_aux(x, w, b):
        y, aux = fused_dense(x, w, b, activation="gelu", return_aux=True)
        return y.sum() + (aux[..., :11] ** 2).sum()

    def plain(x, w, b):
        z = x @ w + b
        return jax.nn.gelu(z, approximate=True).sum() + (z**2).sum()

    got = jax.jit(jax.grad(with_aux, argnums=(0, 1, 2)))(x, w, b)
    want = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(x, w, b)
    for name, g, r in zip(("dx", "dkernel", "dbias"), got, want):
        assert_grad_close(g, r, "float64", name)
    # The ReLU mask is integer data: gradients flow through y only.
    relu_loss = lambda x: fused_dense(x, w, b, activation="relu", return_aux=True)[0].sum()
    dx = jax.jit(jax.grad(relu_loss))(x)
    assert_grad_close(dx, reference_vjp(x, w, b, "relu", np.ones((2, 5, 11)))[0], "float64", "dx")


def test_transformations_agree(rng):
    x, w, b = (
        jnp.asarray(a) for a in make_inputs(rng, (8, 12), 10, "float32", activation="relu", margin=1e-4)
    )

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
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (6, 12), 10, "float32"))
    loss = lambda x, w, b: fused_dense(x, w, b, activation="gelu").sum()
    per_example = jax.jit(jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None, None)))(x, w, b)
    one_example = jax.jit(jax.grad(loss, argnums=1))
    for i in range(6):
        one = one_example(x[i], w, b)
        # Batched and unbatched float32 arithmetic round differently: ~1e-6 apart.
        np.testing.assert_allclose(np.asarray(per_example[i]), np.asarray(one), rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")  # the CPU backend cannot donate
def test_training_step_with_donated_parameters(rng):
    x = jnp.asarray(rng.standard_normal((16, 12)), jnp.float32)
    params = {
        "w": jnp.asarray(rng.standard_normal((12, 8)) / 4, jnp.float32),
        "b": jnp.zeros(8, jnp.float32) + 0.1,
    }

    @functools.partial(jax.jit, donate_argnums=0)
    def step(params, x):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean(fused_dense(x, p["w"], p["b"], activation="gelu") ** 2)
        )(params)
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
        (
            jnp.asarray(rng.standard_normal((i, o)) / np.sqrt(i), jnp.float32),
            jnp.full((o,), 0.05, jnp.float32),
        )
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


# --- implementation="xla" and "auto"'s XLA paths ----------------------------------------------


def _plain(x, w, b, activation):
    z = jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST) + b
    return act_fn(activation)(z)


def _inputs(rng, m, k, n, dtype="float32"):
    return tuple(jnp.asarray(a) for a in make_inputs(rng, (m, k), n, dtype))


@pytest.mark.parametrize("activation, implementation", [("relu", "xla"), ("gelu", "xla"), ("gelu", "auto")])
def test_plain_expression_values_grads_and_forward_mode(rng, activation, implementation):
    """Below the "auto" threshold, and always with "xla": exactly the user's expression,
    differentiated by JAX (forward mode included)."""
    x, w, b = _inputs(rng, 33, 17, 9)
    f = functools.partial(jax_epilog.fused_dense, activation=activation, implementation=implementation)
    assert FUSED not in jaxpr_text(f, x, w, b)
    np.testing.assert_array_equal(np.asarray(f(x, w, b)), np.asarray(_plain(x, w, b, activation)))
    loss = lambda g: lambda x, w, b: jnp.sum(g(x, w, b) ** 2)
    grads = jax.grad(loss(f), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(loss(functools.partial(_plain, activation=activation)), argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(grads, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-6)
    tangent = jnp.asarray(rng.standard_normal(x.shape), x.dtype)
    got = jax.jvp(lambda x: f(x, w, b), (x,), (tangent,))[1]  # forward mode works here
    want = jax.jvp(lambda x: _plain(x, w, b, activation), (x,), (tangent,))[1]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "implementation, activation, dtype, x_shape",
    [
        ("xla", "relu", "bfloat16", (37, 19)),
        ("xla", None, "float16", (3, 5, 19)),
        ("xla", "gelu", "bfloat16", (3, 5, 19)),
        ("auto", "gelu", "float16", (37, 19)),
        ("auto", "relu", "float16", (3, 5, 19)),
        ("auto", None, "bfloat16", (37, 19)),
    ],
    ids=str,
)
def test_half_precision_plain_path_is_the_users_program(dtype, activation, implementation, x_shape):
    """Where "auto" or "xla" run XLA's expression, XLA compiles the very program users
    write (default precision and leading dimensions included), so the benchmarks' "auto"
    and "xla" rows time one executable and "auto" inherits every choice XLA makes for it."""
    args = [jax.ShapeDtypeStruct(s, dtype) for s in (x_shape, (19, 11), (11,))]
    ours = lambda x, w, b: jax_epilog.fused_dense(
        x, w, b, activation=activation, implementation=implementation
    )
    users = lambda x, w, b: act_fn(activation)(x @ w + b)
    text = [jax.jit(f).lower(*args).as_text(debug_info=False) for f in (ours, users)]  # both "jit__lambda"
    assert text[0] == text[1]


def _near(got, want, tol, padded, padded_tol=1e-5):
    """Padded: float32 sums in another order, so up to padded_tol of the largest entry (or of 1)."""
    want = np.asarray(want)
    atol = padded_tol * max(1.0, float(np.abs(want).max())) if padded else tol
    np.testing.assert_allclose(np.asarray(got), want, rtol=tol, atol=atol)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_auto_fused_forward_with_xla_derivatives(rng, activation, padded):
    """ "auto"'s large-layer path ("fused forward", here on a small float32 problem through
    the policy): the op's value, the plain gradients, and forward mode (jvp, jacfwd,
    hessian) as the plain expression has it; ``padded``: with padding at any size, so that
    the derivatives' expression runs on rows padded from K = 17, N = 9 to 20 and 12."""
    rows = (
        {"pad_min_rows": 0, "pad_min_work": 0, "auto_fuse_relu_padded_n": True}
        if padded
        else {"row_bytes": 1}
    )
    x, w, b = _inputs(rng, 33, 17, 9)
    f = functools.partial(jax_epilog.fused_dense, activation=activation)
    near = functools.partial(_near, padded=padded)
    with override_policy(auto_dtypes=("float32",), auto_min_rows=0, auto_min_work=0, **rows):
        assert FUSED in jaxpr_text(f, x, w, b)
        grad_jaxpr = jaxpr_text(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)), x, w, b)
        assert ("f32[20,12]" in grad_jaxpr) == padded and ("f32[17,9]" in grad_jaxpr)
        op = fused_dense(x, w, b, activation=activation)
        np.testing.assert_array_equal(np.asarray(f(x, w, b)), np.asarray(op))
        jit = lambda g: jax.jit(lambda *a: g(*a))  # (one compilation each: faster than eager)
        grads = jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))(x, w, b)
        want = jit(jax.grad(lambda *a: jnp.sum(_plain(*a, activation) ** 2), argnums=(0, 1, 2)))(x, w, b)
        for g, r in zip(grads, want):
            near(g, r, 1e-5)
        # No bias, and leading dimensions.
        xs = x.reshape(3, 11, 17)
        g = jit(jax.grad(lambda x: jnp.sum(f(x, w) ** 2)))(xs)
        r = jit(jax.grad(lambda x: jnp.sum(act_fn(activation)(jnp.matmul(x, w, precision="highest")) ** 2)))(
            xs
        )
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)
        # Forward mode: the plain expression's derivatives, in every argument or some of them.
        plain = functools.partial(_plain, activation=activation)
        tangents = tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (x, w, b))
        (y, dy), (y_ref, dy_ref) = (jit(lambda *p, g=g: jax.jvp(g, p, tangents))(x, w, b) for g in (f, plain))
        near(y, y_ref, 0)
        near(dy, dy_ref, 1e-6)
        jacobians = [jit(jax.jacfwd(g, argnums=(1, 2)))(x, w, b) for g in (f, plain)]
        for got, want in zip(*jacobians):
            near(got, want, 1e-6)
        hessian = lambda g: jit(jax.hessian(lambda x: jnp.sum(g(x, w, b) ** 2)))(x)
        # GELU's padded Hessian against the unpadded one: up to 2.2e-5 of the largest entry over
        # 200 draws (5 above 1e-5); each is up to 4.4e-5 from the float64 Hessian.
        near(hessian(f), hessian(plain), 1e-5, padded_tol=1e-4)


@pytest.mark.parametrize("activation", ["relu", "gelu", None])
def test_auto_on_padded_rows_gives_the_plain_values_and_gradients(rng, activation):
    """ "auto"'s forward and derivatives on padded rows (padding at any size, so that
    bfloat16 K = 17, N = 9 pad to 24 and 16): the values and gradients of
    implementation="xla", whose program keeps the user's shapes."""
    x, w, b = _inputs(rng, 33, 17, 9, "bfloat16")
    f = functools.partial(jax_epilog.fused_dense, activation=activation)
    xla = functools.partial(f, implementation="xla")
    loss = lambda g: jax.jit(jax.grad(lambda *a: jnp.sum(g(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    with override_policy(pad_min_rows=0, pad_min_work=0):
        assert "bf16[24,16]" in jaxpr_text(f, x, w, b) and FUSED not in jaxpr_text(f, x, w, b)
        assert "bf16[24,16]" in jaxpr_text(loss(f), x, w, b) and "bf16[24,16]" not in jaxpr_text(
            loss(xla), x, w, b
        )
        assert "bf16[24,16]" not in jaxpr_text(xla, x, w, b)
        tol = {"rtol": 2e-2, "atol": 2e-2}
        np.testing.assert_allclose(*(np.asarray(jax.jit(g)(x, w, b), np.float32) for g in (f, xla)), **tol)
        tangents = tuple(jnp.asarray(rng.standard_normal(a.shape), a.dtype) for a in (x, w, b))
        forward_mode = [jax.jit(lambda *p, g=g: jax.jvp(g, p, tangents)[1])(x, w, b) for g in (f, xla)]
        for got, want in zip((*loss(f)(x, w, b), forward_mode[0]), (*loss(xla)(x, w, b), forward_mode[1])):
            assert got.shape == want.shape
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


# --- on a GPU ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_autos_fused_forward_on_leading_dimensions_matches_the_oracle(rng, activation):
    """ "auto"'s fused forward (on a small layer, through the policy) on x of shape
    (3, 11, K), whose rows the lowering folds around one custom call: y is the oracle's,
    and its gradients the plain expression's ("xla")."""
    x, w, b = (jnp.asarray(a) for a in make_inputs(rng, (3, 11, 129), 65, "bfloat16"))
    with override_policy(auto_min_rows=0, auto_min_work=0, row_bytes=1):
        layer = jax.jit(lambda x, w, b: jax_epilog.fused_dense(x, w, b, activation=activation))
        assert layer.lower(x, w, b).as_text().count("@jax_epilog_fused_matmul(") == 1
        y = layer(x, w, b)
    assert y.shape == (3, 11, 65)
    assert_scaled_close(y, oracle(x, w, b, activation)[0], GPU_TOL["bfloat16"])

    # "auto" differentiates the plain expression at the layer's dtype: its gradients are
    # "xla"'s. (Against the float32 expression, a bfloat16 z within rounding of ReLU's kink
    # flipped whole rows of dx on the H100.)
    def grads(implementation):
        layer = functools.partial(
            jax_epilog.fused_dense, activation=activation, implementation=implementation
        )
        loss = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)

    with override_policy(auto_min_rows=0, auto_min_work=0, row_bytes=1):
        auto = grads("auto")
    for g, want in zip(auto, grads("xla"), strict=True):
        assert_scaled_close(g, want, GPU_TOL["bfloat16"])
