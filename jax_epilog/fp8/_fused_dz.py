"""An FP8 layer's output gradient in one pass over it (a Pallas kernel, delayed scaling).

Under delayed scaling dz's E5M2 scale is known before dz exists, so everything the backward
needs from dz can come from one read of dy (and GELU's aux z, or ReLU's y): dz = dy * act'(.)
in float32, rounded once to dy's dtype (``dz_of``, which XLA's passes use too), quantized
to E5M2 as ``_quant.quantize`` does, with each tile's column sums (the bias gradient) and
column maxima of |dz| (the amax); XLA sums those few rows. ``transposed=True`` also writes
the E5M2 copy transposed (M contiguous), the layout the kernel-gradient GEMM reads on
Hopper. XLA's own program for the same work is two passes over dz and a transpose.

The tile (``Policy.fp8_fused_dz_block``) must divide dz: ``fits`` says whether it does.
``interpret=True`` runs the kernel through Pallas' interpreter (any backend), which the CPU
tests use.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ._recipes import E5M2, fp8_max

__all__ = ["KINDS", "FusedDz", "column_sums_and_amax", "dz_of", "fits", "fused_dz", "gelu_slope"]

KINDS = ("gelu", "relu", "none")  # the activation whose derivative dz takes

_SQRT_2_OVER_PI = float(np.sqrt(2.0 / np.pi))


def gelu_slope(z: jax.Array) -> jax.Array:
    """d/dz of the tanh GELU (cuBLASLt's), written out with one tanh so that XLA forms
    dy * gelu'(z) in one elementwise pass."""
    t = jnp.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z**3))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * z * z)


def dz_of(kind: str, dy: jax.Array, other) -> jax.Array:
    """dz = dy * act'(.) in dy's dtype, in float32 math rounded once (the E5M2 cast that
    reads it keeps two mantissa bits): GELU's derivative at ``other`` (its z, at least N
    columns), ReLU's where ``other`` (its y) is positive, or dy itself."""
    if kind == "gelu":
        z = other[:, : dy.shape[1]].astype(jnp.float32)
        return (dy.astype(jnp.float32) * gelu_slope(z)).astype(dy.dtype)
    if kind == "relu":
        return jnp.where(other.astype(jnp.float32) > 0, dy, jnp.zeros((), dy.dtype))
    return dy


def column_sums_and_amax(dz: jax.Array) -> tuple[jax.Array, jax.Array]:
    """dz's column sums and its largest magnitude (float32), both reduced in dz's own dtype
    (the sum accumulates in float32 inside the reduction; the max is exact): XLA forms dz
    and reduces it in one pass. Reducing a float32 copy made XLA write that copy out."""
    sums = jnp.sum(dz, axis=0, dtype=jnp.float32)
    return sums, jnp.max(jnp.max(jnp.abs(dz), axis=0)).astype(jnp.float32)


class FusedDz(NamedTuple):
    data: jax.Array  # (M, N) E5M2, dz / scale
    data_t: jax.Array | None  # (N, M) E5M2, its transpose (transposed=True)
    column_sums: jax.Array  # (N,) float32: the bias gradient before its cast
    amax: jax.Array  # () float32: max |dz|


def fits(shape, block) -> bool:
    """Whether ``block`` (rows, columns: powers of two, as Triton wants) tiles a dz of
    ``shape`` exactly."""
    (m, n), (bm, bn) = shape, block
    return m % bm == 0 and n % bn == 0


def _kernel(*refs, kind: str, limit: float, transposed: bool):
    refs = list(refs)
    dy_ref = refs.pop(0)
    other = None if kind == "none" else refs.pop(0)[...]
    inv_ref, q_ref = refs.pop(0), refs.pop(0)
    qt_ref = refs.pop(0) if transposed else None
    sum_ref, max_ref = refs
    dz = dz_of(kind, dy_ref[...], other).astype(jnp.float32)
    q = jnp.clip(dz * inv_ref[...], -limit, limit).astype(q_ref.dtype)
    q_ref[...] = q
    if transposed:
        qt_ref[...] = q.T
    sum_ref[...] = jnp.sum(dz, axis=0, keepdims=True)
    max_ref[...] = jnp.max(jnp.abs(dz), axis=0, keepdims=True)


@functools.partial(jax.jit, static_argnames=("kind", "block", "transposed", "interpret"))
def fused_dz(dy, other, scale, *, kind: str, block, transposed=False, interpret=False) -> FusedDz:
    """dz of ``kind`` from dy (M, N) and ``other`` (GELU's z, at least N columns; ReLU's
    y; None), quantized to E5M2 with the dequantization ``scale`` (a float32 scalar), one
    program per ``block`` of dz (``Policy.fp8_fused_dz_block`` in the library);
    ``fits(dy.shape, block)`` must hold."""
    from jax.experimental import pallas as pl  # (only where the kernel runs)

    (m, n), (bm, bn) = dy.shape, block
    if not fits(dy.shape, block):
        raise ValueError(f"fused_dz: block {block} does not tile dz of shape {dy.shape}")
    tile = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    row = pl.BlockSpec((1, bn), lambda i, j: (i, j))
    inv = jnp.reshape(1.0 / scale.astype(jnp.float32), (1, 1))
    operands = [dy, *([] if kind == "none" else [other]), inv]
    in_specs = [tile] * (len(operands) - 1) + [pl.BlockSpec((1, 1), lambda i, j: (0, 0))]
    out_specs = [tile, *([pl.BlockSpec((bn, bm), lambda i, j: (j, i))] if transposed else []), row, row]
    out_shape = [
        jax.ShapeDtypeStruct((m, n), E5M2),
        *([jax.ShapeDtypeStruct((n, m), E5M2)] if transposed else []),
        jax.ShapeDtypeStruct((m // bm, n), jnp.float32),
        jax.ShapeDtypeStruct((m // bm, n), jnp.float32),
    ]
    kernel = functools.partial(_kernel, kind=kind, limit=float(fp8_max(E5M2)), transposed=transposed)
    outs = pl.pallas_call(
        kernel, grid=(m // bm, n // bn), in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
        interpret=interpret,
    )(*operands)  # fmt: skip
    data_t = outs[1] if transposed else None
    return FusedDz(outs[0], data_t, jnp.sum(outs[-2], axis=0), jnp.max(outs[-1]))
