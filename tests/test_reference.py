"""``jax_epilog._reference``: the pure-JAX math that is both the CPU path and the oracle of
the GPU tests. Every check here is against an independent NumPy computation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

import jax_epilog
from jax_epilog import Activation, ComputeType, _reference

# Jitted once per shape: the same math as the eager functions, at a fraction of the compile cost.
pack = jax.jit(_reference.pack_relu_mask)
unpack = jax.jit(jax_epilog.unpack_relu_mask, static_argnums=1)
dense = jax.jit(_reference.dense, static_argnums=(3, 4, 5, 6))

ODD_NS = [1, 7, 8, 100, 127, 128, 129, 200, 256, 257]
LEADS = [(), (3,), (2, 3)]


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


def _np_gelu_tanh(z):
    z = np.asarray(z, np.float64)
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


def _np_gelu_erf(z):
    z = np.asarray(z, np.float64)
    return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))


def _np_pack(z, width):
    """NumPy oracle of the ReLU bit-mask: bits (z > 0) padded with zeros to width * 8."""
    bits = np.asarray(z) > 0
    pad = [(0, 0)] * (bits.ndim - 1) + [(0, width * 8 - bits.shape[-1])]
    return np.packbits(np.pad(bits, pad), axis=-1, bitorder="little")


def _first_bits(mask, n):
    """The first n bits (little-endian bit order) of each row of a uint8 mask, as bool."""
    return np.unpackbits(np.asarray(mask), axis=-1, bitorder="little")[..., :n].astype(bool)


# --- ReLU bit-mask packing --------------------------------------------------------------------


@pytest.mark.parametrize("n, lead", [(n, LEADS[i % 3]) for i, n in enumerate(ODD_NS)], ids=str)
def test_pack_relu_mask_matches_numpy_packbits(rng, n, lead):
    z = rng.standard_normal((*lead, n)).astype(np.float32)
    packed = pack(jnp.asarray(z))
    width = _round_up(n, 128) // 8
    assert width == jax_epilog.aux_padded_width(Activation.RELU, n)
    assert packed.shape == (*lead, width) and packed.dtype == np.uint8
    packed = np.asarray(packed)
    expected = _np_pack(z, width)
    # Bytes holding only real bits must match exactly; the last partial byte in its low bits.
    full = n // 8
    np.testing.assert_array_equal(packed[..., :full], expected[..., :full])
    if n % 8:
        low = (1 << (n % 8)) - 1
        np.testing.assert_array_equal(packed[..., full] & low, expected[..., full] & low)
    np.testing.assert_array_equal(_first_bits(packed, n), z > 0)


def test_pack_relu_mask_known_bytes():
    # bits j = 0..8: z > 0 at j = 0, 2, 3, 8 -> byte0 = 0b00001101 = 13, byte1 = 0b1 = 1.
    z = jnp.asarray([1.0, -1.0, 2.0, 3.0, 0.0, -0.0, -5.0, -1e-30, 1e-30], jnp.float32)
    packed = np.asarray(_reference.pack_relu_mask(z))
    assert packed.shape == (16,)
    assert packed[0] == 13 and packed[1] == 1


def test_pack_relu_mask_zero_is_not_positive():
    z = jnp.asarray([[0.0, -0.0, 1.0, -1.0, np.nan, np.inf, -np.inf]], jnp.float32)
    bits = _first_bits(_reference.pack_relu_mask(z), 7)
    np.testing.assert_array_equal(bits, [[False, False, True, False, False, True, False]])


@pytest.mark.parametrize("n, lead", [(n, LEADS[(i + 1) % 3]) for i, n in enumerate(ODD_NS)], ids=str)
def test_pack_unpack_round_trip(rng, n, lead):
    z = rng.standard_normal((*lead, n))
    unpacked = unpack(pack(jnp.asarray(z)), n)
    assert unpacked.shape == (*lead, n)
    assert unpacked.dtype == np.bool_
    np.testing.assert_array_equal(np.asarray(unpacked), z > 0)


@pytest.mark.parametrize("n", ODD_NS)
def test_unpack_relu_mask_of_numpy_packbits(rng, n):
    # The other direction: a mask packed by NumPy, with garbage in the padding bits.
    z = rng.standard_normal((5, n))
    width = _round_up(n, 128) // 8
    packed = _np_pack(z, width)
    garbage = rng.integers(0, 256, size=packed.shape, dtype=np.uint8)
    bit_is_real = np.arange(width * 8) < n
    real_mask = np.packbits(np.broadcast_to(bit_is_real, (5, width * 8)), axis=-1, bitorder="little")
    dirty = (packed & real_mask) | (garbage & ~real_mask)
    unpacked = np.asarray(unpack(jnp.asarray(dirty), n))
    np.testing.assert_array_equal(unpacked, z > 0)


@pytest.mark.parametrize("n", [-1, 129])
def test_unpack_relu_mask_refuses_more_bits_than_the_mask_holds(rng, n):
    mask = pack(jnp.asarray(rng.standard_normal((3, 100))))  # 16 bytes: 128 bits a row
    with pytest.raises(
        ValueError, match=rf"n={n} does not fit a mask of shape \(3, 16\) \(allowed: 0 <= n <= 128"
    ):
        unpack(mask, n)


def test_unpack_relu_mask_refuses_a_gelu_aux(rng):
    """A GELU layer's aux is z itself (a float array), not a mask: unpacking it is a
    TypeError naming the function and what it takes, not a mask of garbage bits."""
    x, w = (
        jnp.asarray(rng.standard_normal((3, 5)), jnp.float32),
        jnp.asarray(rng.standard_normal((5, 7)), jnp.float32),
    )
    _, aux = jax_epilog.fused_dense(x, w, activation="gelu", return_aux=True)
    with pytest.raises(
        TypeError, match=r"unpack_relu_mask: mask has dtype float32; it takes the uint8 bit-mask"
    ):
        jax_epilog.unpack_relu_mask(aux, 7)


def test_unpack_relu_mask_of_an_empty_mask():
    assert jax_epilog.unpack_relu_mask(jnp.zeros((0, 16), jnp.uint8), 100).shape == (0, 100)


# --- activations ------------------------------------------------------------------------------


def test_gelu_matches_tanh_formula_float64(rng):
    z = np.concatenate([rng.standard_normal(4096) * 3, np.linspace(-10, 10, 2001)])
    got = np.asarray(_reference.activate(jnp.asarray(z), Activation.GELU))
    assert got.dtype == np.float64
    assert_close(got, _np_gelu_tanh(z), "float64", what="gelu(float64)")


def test_gelu_matches_tanh_formula_float32(rng):
    z = (rng.standard_normal(4096) * 3).astype(np.float32)
    got = np.asarray(_reference.activate(jnp.asarray(z), Activation.GELU))
    assert got.dtype == np.float32
    assert_close(got, _np_gelu_tanh(np.asarray(z, np.float64)), "float32", what="gelu(float32)")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gelu_matches_tanh_formula_half(rng, dtype):
    # Evaluated in the 16-bit dtype itself (the COMPUTE_16F epilog does this): 1 + tanh(u)
    # cancels for z < 0, so the error is absolute, O(eps * |z|), as for a 16-bit accumulator.
    z = (rng.standard_normal(4096) * 3).astype(dtype)
    got = np.asarray(_reference.activate(jnp.asarray(z), Activation.GELU))
    assert got.dtype == np.dtype(dtype)
    eps = float(jnp.finfo(dtype).eps)
    assert_close(got, _np_gelu_tanh(np.asarray(z, np.float64)), dtype, acc_eps=eps, what=f"gelu({dtype})")


def test_gelu_tolerance_tells_tanh_from_erf():
    # The test above could not pass for the exact erf GELU: the two differ by up to ~5e-4.
    z = np.linspace(-4, 4, 801)
    with pytest.raises(AssertionError, match="not close"):
        assert_close(_np_gelu_erf(z), _np_gelu_tanh(z), "float32")
    with pytest.raises(AssertionError, match="not close"):
        assert_close(
            np.asarray(_reference.activate(jnp.asarray(z), Activation.GELU)), _np_gelu_erf(z), "float32"
        )


def test_relu_and_identity(rng):
    z = rng.standard_normal((7, 13))
    np.testing.assert_array_equal(
        np.asarray(_reference.activate(jnp.asarray(z), Activation.RELU)), np.maximum(z, 0)
    )
    np.testing.assert_array_equal(np.asarray(_reference.activate(jnp.asarray(z), None)), z)


# --- reference.dense: the aux layout ----------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, d_dtype, n",
    [
        ("float32", "float32", 1),
        ("float16", "float16", 7),
        ("float16", "float32", 100),
        ("bfloat16", "bfloat16", 129),
    ],
)
def test_dense_aux_layout(rng, dtype, d_dtype, n):
    k, m = 11, 6
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal(n), d_dtype)
    z = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    ct = ComputeType.COMPUTE_32F

    d, aux = dense(x, w, b, Activation.RELU, ct, np.dtype(d_dtype), True)
    assert d.dtype == np.dtype(d_dtype) and d.shape == (m, n)
    assert aux.dtype == np.uint8 and aux.shape == (m, _round_up(n, 128) // 8)
    clear = np.abs(z) > 1e-3
    np.testing.assert_array_equal(_first_bits(aux, n)[clear], (z > 0)[clear])

    d, aux = dense(x, w, b, Activation.GELU, ct, np.dtype(d_dtype), True)
    assert aux.dtype == np.dtype(d_dtype) and aux.shape == (m, _round_up(n, 8))
    assert_close(np.asarray(aux)[:, :n], z, d_dtype, k=k, what="gelu aux")
    assert_close(d, _np_gelu_tanh(z), d_dtype, k=k, what="gelu d")

    for act in (None, Activation.RELU, Activation.GELU):
        assert dense(x, w, b, act, ct, np.dtype(d_dtype), False)[1] is None
    assert dense(x, w, b, None, ct, np.dtype(d_dtype), True)[1] is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(
    "compute_type", [ComputeType.COMPUTE_32F, ComputeType.COMPUTE_32F_PEDANTIC], ids=lambda c: c.name
)
def test_backward_gemms_ask_for_their_result_dtype(rng, dtype, compute_type):
    """dx and the kernel gradient: half operands with COMPUTE_32F ask XLA for a product in
    their own dtype (as XLA's own backward does; a float32 product cast after cost the H200
    a convert kernel or a slower GEMM), everything else for the float32 accumulator. Values
    agree with the float32 product rounded once, within two units in the last place."""
    m, k, n = 37, 19, 29
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    kernel = jnp.asarray(rng.standard_normal((k, n)), dtype)
    dz = jnp.asarray(rng.standard_normal((m, n)), dtype)
    direct = dtype != "float32" and compute_type is ComputeType.COMPUTE_32F
    want_dtype = dtype if direct else "float32"
    for f, args, want in (
        (
            lambda dz, w: _reference.input_grad(dz, w, compute_type),
            (dz, kernel),
            np.float32(dz) @ np.float32(kernel).T,
        ),
        (
            lambda x, dz: _reference.weight_grad(x, dz, compute_type, x.dtype, with_bias=False)[0],
            (x, dz),
            np.float32(x).T @ np.float32(dz),
        ),
    ):
        text = jax.jit(f).lower(*args).as_text()
        dots = [line for line in text.splitlines() if "dot_general" in line]
        assert len(dots) == 1, dots
        short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[want_dtype]
        assert dots[0].rstrip().endswith(f"x{short}>"), dots[0]
        got = f(*args)
        assert got.dtype == np.dtype(dtype)
        ulp = float(jnp.finfo(dtype).eps)
        np.testing.assert_allclose(np.float32(got), want, rtol=2 * ulp, atol=2 * ulp * np.abs(want).max())
