"""``fused_gelu_input_grad_p``: an input-gradient GEMM that also applies the previous
GELU layer's derivative (cuBLASLt's DGELU epilog).

dz (..., N), the kernel (K, N) and the previous layer's GELU aux (..., round_up(K, 8)) give
(dz @ kernel^T) * gelu'(z), (..., K) in the aux's dtype: the previous layer's dz, formed in
the GEMM's epilog instead of an elementwise pass after it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _reference
from .._epilogs import ComputeType, EpilogSpec
from .._padding import cut_to, pad_to, padded_spec
from .._partition import Layout
from .._typing import vary_alike
from ..cuda import ffi
from ._base import batched_reference, lower_fused_or_reference, new_primitive, register, row_factors, symbolic

__all__ = ["fused_gelu_input_grad", "fused_gelu_input_grad_p"]

fused_gelu_input_grad_p = new_primitive("fused_gelu_input_grad")


def fused_gelu_input_grad(dz, kernel, aux, *, compute_type):
    """(..., n) dz, (k, n) kernel, (..., round_up(k, 8)) GELU aux -> [(..., k) dz below]."""
    return fused_gelu_input_grad_p.bind(*vary_alike(dz, kernel, aux), compute_type=compute_type)


def _results(dz, kernel, aux, *, compute_type):
    del compute_type
    return [((*dz.shape[:-1], kernel.shape[0]), aux.dtype)]


def _layout(args, **params) -> Layout:
    """dz's and the aux's rows split alike, and the result's with them; N (summed over
    here, before the derivative) and K whole."""
    del params
    row_dims = args[0].ndim - 1
    m = row_factors(row_dims)
    rule = f"{m} n, k n, {m} a -> {m} k"
    return Layout(((0, 2), (0,)), (), ({}, {}), rule, whole=("n", "k", "a"), row_dims=row_dims)


def reference(dz, kernel, aux, *, compute_type):
    return [_reference.gelu_input_grad(dz, kernel, aux, compute_type)]


def _spec(dz, kernel, aux, compute_type) -> EpilogSpec | None:
    """The padded problem, or None where XLA computes it: symbolic sizes, float64, an
    empty dimension, N = 1 (nvmath refuses DGELU with an inner dimension of 1) or one row
    (cuBLASLt plans it, then refuses every launch)."""
    (m, n), k = dz.shape, kernel.shape[0]
    if symbolic(dz, kernel, aux) or np.dtype(dz.dtype) == np.float64 or 0 in (m, k, n) or 1 in (m, n):
        return None
    return padded_spec(EpilogSpec(
        m=int(m), n=int(n), k=int(k), epilog="DGELU", compute_type=ComputeType(compute_type).name,
        ab_dtype=np.dtype(dz.dtype).name, bias_dtype=None, d_dtype=np.dtype(aux.dtype).name, problem="dgrad",
    ))  # fmt: skip


def _cuda(ctx, dz, kernel, aux, *, compute_type):
    k = ctx.avals_in[1].shape[0]
    spec = _spec(*ctx.avals_in, compute_type)

    def fused(dz, kernel, aux):  # (the aux's rows, round_up(k, 8) wide, are padded already)
        results = [jax.ShapeDtypeStruct((spec.m, spec.k), aux.dtype)]
        (d,) = ffi.call((pad_to(dz, spec.n), pad_to(kernel, spec.k, spec.n), aux), results, spec)
        return [cut_to(d, k)]

    return lower_fused_or_reference(
        ctx, (dz, kernel, aux), {"compute_type": compute_type}, spec, fused, reference
    )


def _batch(args, dims, **params):
    """Batched kernels: XLA's batched GEMM. A shared kernel: the batch is one more leading
    dimension of the rows (one call)."""
    (dz, kernel, aux), (dz_dim, k_dim, aux_dim) = args, dims
    if k_dim is not None:
        return batched_reference(reference)(args, dims, **params)
    size = dz.shape[dz_dim] if dz_dim is not None else aux.shape[aux_dim]
    dz, aux = (
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in ((dz, dz_dim), (aux, aux_dim))
    )
    return fused_gelu_input_grad_p.bind(dz, kernel, aux, **params), [0]


register(
    fused_gelu_input_grad_p, results=_results, layout=_layout, reference=reference, cuda=_cuda, batch=_batch
)
