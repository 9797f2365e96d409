"""An FP8 layer's output gradient in one pass over it (a Pallas kernel, delayed scaling).

Under delayed scaling dz's E5M2 scale is known before dz exists, so everything the backward
needs from dz can come from one read of dy (and GELU's aux z, or ReLU's y): dz = dy * act'(z)
in float32, rounded once to dy's dtype as ``_dense.output_grad`` rounds it, quantized to
E5M2 as ``_quant.quantize`` does, and written twice, row-major for the input-gradient GEMM
and transposed (M contiguous) for the kernel-gradient GEMM, which on Hopper needs both its
FP8 operands K-contiguous. Each tile also writes its column sums (the bias gradient) and
column maxima of |dz| (the amax); XLA sums those few rows. XLA's own program for the same
work is three passes: dz with its reductions, the E5M2 cast, the transpose.

The tile must divide dz: ``fits`` says whether it does; otherwise the caller keeps XLA's
passes. ``interpret=True`` runs the kernel through Pallas' interpreter (any backend), which
the CPU tests use.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._recipes import E5M2, fp8_max

__all__ = ["BLOCK", "FusedDz", "fits", "fused_dz"]

BLOCK = (64, 128)  # (rows, columns) of dz per program; powers of two, as Triton wants


class FusedDz(NamedTuple):
    data: jax.Array  # (M, N) E5M2, dz / scale
    data_t: jax.Array  # (N, M) E5M2, its transpose
    column_sums: jax.Array  # (N,) float32: the bias gradient before its cast
    amax: jax.Array  # () float32: max |dz|


def fits(shape, block=BLOCK) -> bool:
    """Whether ``block`` tiles a dz of ``shape`` exactly."""
    (m, n), (bm, bn) = shape, block
    return m % bm == 0 and n % bn == 0


def _slope(kind: str, dy, other):
    """act'(z) · dy in float32 for ``kind`` ('gelu': other is z; 'relu': other is y)."""
    from ._dense import gelu_slope  # (the same formula as XLA's pass)

    if kind == "gelu":
        return dy * gelu_slope(other.astype(jnp.float32))
    if kind == "relu":
        return jnp.where(other.astype(jnp.float32) > 0, dy, 0.0)
    return dy


def _kernel(*refs, kind: str, dy_dtype, limit: float):
    if kind == "none":
        dy_ref, inv_ref, q_ref, qt_ref, sum_ref, max_ref = refs
        other = None
    else:
        dy_ref, other_ref, inv_ref, q_ref, qt_ref, sum_ref, max_ref = refs
        other = other_ref[...]
    dz = _slope(kind, dy_ref[...].astype(jnp.float32), other).astype(dy_dtype).astype(jnp.float32)
    q = jnp.clip(dz * inv_ref[...], -limit, limit).astype(q_ref.dtype)
    q_ref[...] = q
    qt_ref[...] = q.T
    sum_ref[...] = jnp.sum(dz, axis=0, keepdims=True)
    max_ref[...] = jnp.max(jnp.abs(dz), axis=0, keepdims=True)


@functools.partial(jax.jit, static_argnames=("kind", "block", "interpret"))
def fused_dz(dy, other, scale, *, kind: str, block=BLOCK, interpret: bool = False) -> FusedDz:
    """dz of ``kind`` ('gelu', 'relu' or 'none') from dy (M, N) and ``other`` (GELU's z,
    at least N columns; ReLU's y; None), quantized to E5M2 with the dequantization
    ``scale`` (a float32 scalar); ``fits(dy.shape, block)`` must hold."""
    (m, n), (bm, bn) = dy.shape, block
    if not fits(dy.shape, block):
        raise ValueError(f"fused_dz: block {block} does not tile dz of shape {dy.shape}")
    tile = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    row = pl.BlockSpec((1, bn), lambda i, j: (i, j))
    inv = jnp.reshape(1.0 / scale.astype(jnp.float32), (1, 1))
    operands = [dy] + ([] if kind == "none" else [other]) + [inv]
    in_specs = [tile] * (len(operands) - 1) + [pl.BlockSpec((1, 1), lambda i, j: (0, 0))]
    kernel = functools.partial(_kernel, kind=kind, dy_dtype=dy.dtype, limit=float(fp8_max(E5M2)))
    data, data_t, sums, maxima = pl.pallas_call(
        kernel,
        grid=(m // bm, n // bn),
        in_specs=in_specs,
        out_specs=[tile, pl.BlockSpec((bn, bm), lambda i, j: (j, i)), row, row],
        out_shape=[
            jax.ShapeDtypeStruct((m, n), E5M2),
            jax.ShapeDtypeStruct((n, m), E5M2),
            jax.ShapeDtypeStruct((m // bm, n), jnp.float32),
            jax.ShapeDtypeStruct((m // bm, n), jnp.float32),
        ],
        interpret=interpret,
    )(*operands)
    return FusedDz(data, data_t, jnp.sum(sums, axis=0), jnp.max(maxima))
