"""The one-pass FP8 output gradient (``fp8/_fused_dz.py``, a Pallas kernel, through the
interpreter on the CPU and through Triton on a GPU) against XLA's passes run on the CPU,
which round as ml_dtypes does: dz = dy * act'(.), its E5M2 copy and transpose, its column
sums and amax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_epilog import fp8
from jax_epilog.fp8 import _fused_dz, _quant

# M != N, several tiles each way (the kernel needs tiles that divide dz)
BLOCK = (64, 128)
SHAPES = [(192, 256), (128, 384)]
E5_STEP = 0.25  # one E5M2 step: 2 mantissa bits


def _reference(kind, dy, other, scale):
    """XLA's passes, as the library writes them without the kernel."""
    dz = _fused_dz.dz_of(kind, dy, other)
    return dz, _quant.quantize(dz, fp8.E5M2, scale)


def _inputs(rng, shape, dtype):
    dy = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    other = jnp.asarray(rng.standard_normal(shape) * 2, dtype)
    # the largest |dy| a little past E5M2's top (57344): the top binade, where one step is
    # 8192, and saturation are both exercised
    scale = jnp.float32(np.abs(np.asarray(dy, np.float32)).max() / 60000)
    return dy, other, scale


def _check_one_pass(kind, shape, dtype, interpret):
    rng = np.random.default_rng([len(kind), *shape])
    dy, other, scale = _inputs(rng, shape, dtype)
    other = None if kind == "none" else other
    got = _fused_dz.fused_dz(dy, other, scale, kind=kind, block=BLOCK, transposed=True, interpret=interpret)
    dz, q = _reference(kind, *jax.device_put((dy, other, scale), jax.devices("cpu")[0]))
    data = np.asarray(got.data, np.float32)
    want = np.asarray(q, np.float32)
    assert got.data.dtype == fp8.E5M2 and got.data_t.shape == shape[::-1]
    np.testing.assert_array_equal(np.asarray(got.data_t, np.float32), data.T)
    apart = data != want
    if kind != "gelu":
        assert not apart.any()
    else:
        # float32 resolves GELU's slope to a few 1e-7 near its tail (tanh near -1, times
        # about z cubed there): the kernel's tanh and XLA's may put a value one E5M2 step
        # apart, or, where the slope is under about 1e-5, by up to |dy| * 3e-5; no further.
        assert apart.mean() <= 0.01
        slack = E5_STEP * np.abs(want) + 3e-5 * np.abs(np.asarray(dy, np.float32)) / float(scale)
        assert np.all(np.abs(data - want)[apart] <= slack[apart])
    wide = np.asarray(dz, np.float32)
    np.testing.assert_allclose(got.column_sums, wide.sum(0), rtol=1e-3, atol=1e-3 * np.abs(wide).max())
    np.testing.assert_allclose(got.amax, np.abs(wide).max(), rtol=1e-2)


@pytest.mark.parametrize("kind", ["gelu", "relu", "none"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_one_pass_matches_xlas_passes(kind, shape, dtype):
    _check_one_pass(kind, shape, dtype, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gelu", "none"])
def test_the_compiled_kernel_matches_the_emulation(kind):
    """Through Triton on the GPU, at a shape of several tiles each way, against XLA's
    passes on the CPU."""
    _check_one_pass(kind, (512, 768), jnp.bfloat16, interpret=False)


def test_the_aux_may_be_wider_than_dz():
    """GELU's aux has N rounded up; the kernel reads its first N columns."""
    rng = np.random.default_rng(3)
    dy, z, scale = _inputs(rng, (128, 128), jnp.bfloat16)
    wider = jnp.concatenate([z, jnp.full((128, 128), jnp.nan, z.dtype)], axis=1)
    got = _fused_dz.fused_dz(dy, wider, scale, kind="gelu", block=BLOCK, interpret=True)
    want = _fused_dz.fused_dz(dy, z, scale, kind="gelu", block=BLOCK, interpret=True)
    np.testing.assert_array_equal(np.asarray(got.data, np.float32), np.asarray(want.data, np.float32))


def test_a_shape_the_tile_does_not_divide_is_refused():
    assert _fused_dz.fits((192, 256), BLOCK) and not _fused_dz.fits((200, 256), BLOCK)
    assert not _fused_dz.fits((192, 250), BLOCK)
    dy = jnp.ones((100, 128), jnp.bfloat16)
    with pytest.raises(
        ValueError, match=r"fused_dz: block \(64, 128\) does not tile dz of shape \(100, 128\)"
    ):
        _fused_dz.fused_dz(dy, None, jnp.float32(1), kind="none", block=BLOCK, interpret=True)
