"""Quantizing: saturation, round to nearest even (ml_dtypes' cast), the way back."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_epilog import fp8


@pytest.mark.parametrize("dtype", [fp8.E4M3, fp8.E5M2])
def test_quantize_is_a_saturating_rne_cast_of_x_over_scale(rng, dtype):
    x = rng.standard_normal((33, 19)).astype(np.float32) * 50
    scale = np.float32(0.37)
    q = np.asarray(fp8.quantize(jnp.asarray(x), dtype, jnp.float32(scale)))
    limit = float(ml_dtypes.finfo(dtype).max)
    expected = np.clip(x * (np.float32(1) / scale), -limit, limit).astype(dtype)
    np.testing.assert_array_equal(q.view(np.uint8), expected.view(np.uint8))
    assert np.isfinite(q.astype(np.float32)).all()  # saturated, never NaN


def test_dequantize_is_within_half_an_ulp(rng):
    x = jnp.asarray(rng.standard_normal(1000), jnp.float32)
    scale = jnp.float32(float(jnp.max(jnp.abs(x))) / 448)
    back = fp8.Quantized(fp8.quantize(x, fp8.E4M3, scale), scale).dequantize()
    # E4M3 has 3 mantissa bits: relative error at most 2**-4 for normal values.
    normal = np.abs(np.asarray(x)) > 2.0**-6 * float(scale)
    rel = np.abs(np.asarray(back - x))[normal] / np.abs(np.asarray(x))[normal]
    assert rel.max() <= 2.0**-4 + 1e-7
    assert fp8.fp8_max(fp8.E4M3) == 448.0 and fp8.fp8_max(fp8.E5M2) == 57344.0
