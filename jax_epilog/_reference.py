"""Pure-JAX math of the fused layer: the CPU path and the test oracle.

Numerics follow cuBLASLt's epilog: the product is accumulated in the compute type,
bias and activation are applied in the epilog's precision (float32 for 32-bit compute
types) and the result is rounded once to the output dtype (cuBLASLt's epilog on a GPU may
round slightly more; see ``fused_dense``). The aux uses exactly the
padded layout the GPU kernel writes (see ``_epilogs.aux_padded_width``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._epilogs import Activation, ComputeType, aux_dtype, aux_padded_width

__all__ = ["activate", "dense", "dense_vjp", "pack_relu_mask", "unpack_relu_mask"]


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
    if mask.size == 0:  # jnp.unpackbits cannot reshape an empty array
        return jnp.zeros((*mask.shape[:-1], n), bool)
    return jnp.unpackbits(mask, axis=-1, count=n, bitorder="little").astype(bool)


def _epilog_dtype(ab_dtype: np.dtype, compute_type: ComputeType) -> np.dtype:
    if ab_dtype == np.float64:
        return np.dtype(np.float64)
    if compute_type in (ComputeType.COMPUTE_16F, ComputeType.COMPUTE_16F_PEDANTIC):
        return np.dtype(np.float16)
    return np.dtype(np.float32)


def _matmul(a: jax.Array, b: jax.Array, contract: tuple[int, int], compute_type: ComputeType) -> jax.Array:
    """``a`` and ``b`` contracted over one axis each, accumulated as ``compute_type`` does."""
    fast = compute_type.name.startswith("COMPUTE_32F_FAST")
    return jax.lax.dot_general(
        a,
        b,
        (((contract[0],), (contract[1],)), ((), ())),
        precision=jax.lax.Precision.DEFAULT if fast else jax.lax.Precision.HIGHEST,
        preferred_element_type=_epilog_dtype(np.dtype(a.dtype), compute_type),
    )


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
    z = _matmul(x, kernel, (x.ndim - 1, 0), compute_type)
    if bias is not None:
        z = z + bias.astype(z.dtype)
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


def dense_vjp(
    x: jax.Array,
    kernel: jax.Array,
    aux: jax.Array | None,
    dy: jax.Array,
    dz_extra: jax.Array | None,
    activation: Activation | None,
    compute_type: ComputeType,
    bias_dtype: np.dtype | None,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """The backward of ``dense`` from its aux: ``(dx, dkernel, dbias or None)``.

    ``x`` is (m, k), ``kernel`` (k, n), ``dy`` (m, n); ``aux`` is the forward's aux (the
    ReLU bit-mask or the GELU input), ``dz_extra`` a cotangent of the GELU aux's first n
    columns, or None. ``dz = dy * act'(z)`` is formed in the epilog's precision; the two
    GEMMs take it in ``x``'s dtype and accumulate like the forward. At ``z == 0`` ReLU's
    derivative is 0 (the mask holds ``z > 0``), as for ``jax.nn.relu``.
    """
    n = kernel.shape[1]
    acc = _epilog_dtype(np.dtype(x.dtype), compute_type)
    dz = dy.astype(acc)
    if activation is Activation.RELU:
        dz = jnp.where(unpack_relu_mask(aux, n), dz, jnp.zeros((), acc))
    elif activation is Activation.GELU:
        z = aux[:, :n].astype(acc)
        dz = jax.vjp(lambda z: activate(z, activation), z)[1](dz)[0]
    if dz_extra is not None:
        dz = dz + dz_extra.astype(acc)
    dz_op = dz.astype(x.dtype)
    dx = _matmul(dz_op, kernel, (1, 1), compute_type).astype(x.dtype)
    dkernel = _matmul(x, dz_op, (0, 0), compute_type).astype(kernel.dtype)
    dbias = None if bias_dtype is None else jnp.sum(dz, axis=0).astype(bias_dtype)
    return dx, dkernel, dbias
