"""Pure-JAX math of the fused layer: the CPU path and the test oracle.

Numerics follow cuBLASLt's epilog: the product is accumulated in the compute type,
bias and activation are applied in the epilog's precision (float32 for 32-bit compute
types) and the result is rounded once to the output dtype. The aux uses exactly the
padded layout the GPU kernel writes (see ``_epilogs.aux_padded_width``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._epilogs import Activation, ComputeType, aux_dtype, aux_padded_width

__all__ = ["activate", "dense", "pack_relu_mask", "unpack_relu_mask"]


def activate(z: jax.Array, activation: Activation | None) -> jax.Array:
    if activation is None:
        return z
    if activation is Activation.RELU:
        return jax.nn.relu(z)
    return jax.nn.gelu(z, approximate=True)


def pack_relu_mask(z: jax.Array) -> jax.Array:
    """(..., n) pre-activation -> (..., round_up(n, 128) // 8) uint8, bit j%8 of byte j//8."""
    n = z.shape[-1]
    width = aux_padded_width(Activation.RELU, n)
    bits = jnp.pad(z > 0, [(0, 0)] * (z.ndim - 1) + [(0, width * 8 - n)])
    return jnp.packbits(bits, axis=-1, bitorder="little")


def unpack_relu_mask(mask: jax.Array, n: int) -> jax.Array:
    """Inverse of ``pack_relu_mask``: a bool array of shape (..., n)."""
    return jnp.unpackbits(mask, axis=-1, count=n, bitorder="little").astype(bool)


def _epilog_dtype(ab_dtype: np.dtype, compute_type: ComputeType) -> np.dtype:
    if ab_dtype == np.float64:
        return np.dtype(np.float64)
    if compute_type in (ComputeType.COMPUTE_16F, ComputeType.COMPUTE_16F_PEDANTIC):
        return np.dtype(np.float16)
    return np.dtype(np.float32)


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    activation: Activation | None,
    compute_type: ComputeType,
    d_dtype: np.dtype,
    with_aux: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """Returns ``(d, aux)``: ``d = act(x @ kernel + bias)`` in ``d_dtype``; aux or None.

    ``x`` is (..., k), ``kernel`` (k, n), ``bias`` (n,) or None.
    """
    acc = _epilog_dtype(np.dtype(x.dtype), compute_type)
    fast = compute_type.name.startswith("COMPUTE_32F_FAST")
    precision = jax.lax.Precision.DEFAULT if fast else jax.lax.Precision.HIGHEST
    z = jax.lax.dot_general(
        x,
        kernel,
        (((x.ndim - 1,), (0,)), ((), ())),
        precision=precision,
        preferred_element_type=acc,
    )
    if bias is not None:
        z = z + bias.astype(acc)
    d = activate(z, activation).astype(d_dtype)
    aux = None
    if with_aux and activation is not None:
        n = kernel.shape[1]
        if activation is Activation.RELU:
            aux = pack_relu_mask(z)
        else:
            width = aux_padded_width(activation, n)
            zd = z.astype(aux_dtype(activation, d_dtype))
            aux = jnp.pad(zd, [(0, 0)] * (z.ndim - 1) + [(0, width - n)])
    return d, aux
