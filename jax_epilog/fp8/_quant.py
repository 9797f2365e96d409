"""Quantizing to FP8 and back, and the passes that quantize a layer's tensors.

The arithmetic is the same on every backend (float32 multiply, clip to the format's finite
range, round to nearest even), so the CPU path emulates the GPU bit for bit where XLA
runs these passes, and to within the GEMM's float32 summation order where cuBLASLt does.
Under delayed scaling each pass reads its tensor once: XLA fuses the amax reduction and
the cast that read the same tensor. The K-contiguous copies a GEMM needs are made from the
FP8 data by the GEMM's lowering (``primitives/fp8_gemm.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._recipes import DenseState, TensorScale, fp8_max, next_scale, push_amax, scale_for

__all__ = ["Quantized", "amax", "dequantize", "quantize", "quantize_tensor", "saturate"]


class Quantized(NamedTuple):
    """An FP8 tensor and its dequantization scale: ``data * scale`` is the value.

    ``fused_dense`` takes one as ``x`` (used as it is) and returns one for an FP8 output.
    """

    data: jax.Array
    scale: jax.Array

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        return dequantize(self.data, self.scale, dtype)


def saturate(values: jax.Array, dtype) -> jax.Array:
    """float32 ``values`` cast to FP8 ``dtype``, saturated to its finite range and rounded
    to nearest even (ml_dtypes' and the GPU's rounding; ml_dtypes alone would give NaN)."""
    limit = np.float32(fp8_max(dtype))
    return jnp.clip(values, -limit, limit).astype(dtype)


def quantize(x: jax.Array, dtype, scale: jax.Array) -> jax.Array:
    """``x / scale`` in FP8 ``dtype``: float32 math, then ``saturate``."""
    return saturate(x.astype(jnp.float32) * (1.0 / scale.astype(jnp.float32)), dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def amax(x: jax.Array) -> jax.Array:
    """The largest magnitude in ``x``, as float32."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


class QuantizedTensor(NamedTuple):
    """One pass's products: the FP8 copy, the scale used, the tensor's next state."""

    data: jax.Array
    scale: jax.Array
    state: TensorScale


def quantize_tensor(x: jax.Array, state: TensorScale, dtype, owner: DenseState, seen=None) -> QuantizedTensor:
    """Quantize a tensor under ``owner``'s recipe: delayed scaling takes the scale from
    ``state``'s history and records this tensor's amax in the same pass; current scaling
    reads the tensor for its amax first. ``seen``: x's amax where the caller has it."""
    seen = amax(x) if seen is None else seen
    if owner.current:
        scale = scale_for(seen, state.scale, dtype, owner.recipe.margin)
    else:
        scale = next_scale(state, dtype, owner.recipe)
    scale = jax.lax.stop_gradient(scale)
    q = quantize(x, dtype, scale)
    return QuantizedTensor(q, scale, push_amax(state, scale, seen))
