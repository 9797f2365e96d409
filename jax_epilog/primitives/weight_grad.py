"""``fused_weight_grad_p``: a layer's kernel and bias gradients from one GEMM.

x (..., K) and dz (..., N) give x^T @ dz (K, N) and dz summed over the rows (N,), both in
``d_dtype``: one cuBLASLt GEMM whose BGRADA epilog reduces dz while the GEMM reads it.
Under ``vmap`` each batch member has its own gradient: XLA's batched GEMM and reduction
(a loop of BGRADA calls would cost a launch per member).
"""

from __future__ import annotations

import jax
import numpy as np

from .. import _reference
from .._epilogs import ComputeType, EpilogSpec
from .._padding import cut_to, pad_to, padded_spec
from .._partition import Layout
from .._typing import vary_alike
from ..cuda import ffi
from ._base import lower_fused_or_reference, new_primitive, register, row_factors, symbolic

__all__ = ["fused_weight_grad", "fused_weight_grad_p"]

fused_weight_grad_p = new_primitive("fused_weight_grad")


def fused_weight_grad(x, dz, *, compute_type, d_dtype):
    """(..., k) x and (..., n) dz -> [x^T @ dz, dz summed over the rows], in ``d_dtype``."""
    return fused_weight_grad_p.bind(*vary_alike(x, dz), compute_type=compute_type, d_dtype=np.dtype(d_dtype))


def _results(x, dz, *, compute_type, d_dtype):
    del compute_type
    k, n = x.shape[-1], dz.shape[-1]
    return [((k, n), d_dtype), ((n,), d_dtype)]


def _layout(args, **params) -> Layout:
    """x's and dz's rows split alike, both gradients summed over them; N split as dz's is,
    and the gradients alike."""
    del params
    row_dims = args[0].ndim - 1
    m = row_factors(row_dims)
    rule = f"{m} k, {m} n -> k n, n"
    return Layout(((0, 1), ()), (0, 1), ({1: 1}, {0: 1, 1: 0}), rule, whole=("k",), row_dims=row_dims)


def reference(x, dz, *, compute_type, d_dtype):
    return list(_reference.weight_grad(x, dz, compute_type, d_dtype, with_bias=True))


def _spec(x, dz, compute_type, d_dtype) -> EpilogSpec | None:
    """The padded problem, or None where XLA computes it: symbolic sizes, float64, an
    empty dimension, or K = 1 (cuBLASLt plans a one-row BGRADA GEMM, then refuses it)."""
    (m, k), n = x.shape, dz.shape[1]
    if symbolic(x, dz) or np.dtype(x.dtype) == np.float64 or 0 in (m, k, n) or k == 1:
        return None
    dt = np.dtype(d_dtype).name
    return padded_spec(EpilogSpec(
        m=int(m), n=int(n), k=int(k), epilog="BGRADA", compute_type=ComputeType(compute_type).name,
        ab_dtype=np.dtype(x.dtype).name, bias_dtype=dt, d_dtype=dt, problem="wgrad",
    ))  # fmt: skip


def _cuda(ctx, x, dz, *, compute_type, d_dtype):
    (k, n), params = (
        (ctx.avals_in[0].shape[1], ctx.avals_in[1].shape[1]),
        {"compute_type": compute_type, "d_dtype": d_dtype},
    )
    spec = _spec(*ctx.avals_in, compute_type, d_dtype)

    def fused(x, dz):
        results = [jax.ShapeDtypeStruct((spec.k, spec.n), d_dtype), jax.ShapeDtypeStruct((spec.n,), d_dtype)]
        dkernel, dbias = ffi.call((pad_to(x, spec.k), pad_to(dz, spec.n)), results, spec)
        return [cut_to(dkernel, k, n), cut_to(dbias, n)]

    return lower_fused_or_reference(ctx, (x, dz), params, spec, fused, reference)


register(fused_weight_grad_p, results=_results, layout=_layout, reference=reference, cuda=_cuda, batch=None)
