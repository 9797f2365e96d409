"""``fused_matmul_p``: the forward GEMM with bias and activation, optionally the aux.

x (..., K) with its leading dimensions (the rows, at least one), kernel (K, N) and bias
(N,) or none give y (..., N) and, with an aux, (..., aux width). Weights batched under
``vmap`` (an ensemble) bind ``members_p`` instead (``members.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _reference
from .._epilogs import (
    ACTIVATIONS,
    Activation,
    ComputeType,
    EpilogSpec,
    aux_dtype,
    aux_padded_width,
    epilog_name,
)
from .._padding import cut_to, pad_to, padded_spec
from .._partition import Layout
from .._typing import vary_alike
from ..cuda import ffi
from ._base import lower_fused_or_reference, new_primitive, register, results_like, row_factors, symbolic

__all__ = ["forward_spec", "fused_matmul", "fused_matmul_p", "padded_operands"]

fused_matmul_p = new_primitive("fused_matmul")


def fused_matmul(x, kernel, bias, *, activation, with_aux, compute_type, d_dtype, out_dtype):
    """(..., k) x, (k, n) kernel, (n,) bias or None -> [y] or [y, aux], each (..., width)."""
    operands = (x, kernel) if bias is None else (x, kernel, bias)
    return fused_matmul_p.bind(
        *vary_alike(*operands),
        activation=activation,
        with_aux=with_aux and activation is not None,
        compute_type=compute_type,
        d_dtype=np.dtype(d_dtype),
        out_dtype=np.dtype(out_dtype),
    )


def _results(x, kernel, *bias, activation, with_aux, compute_type, d_dtype, out_dtype):
    del bias, compute_type
    lead, n = x.shape[:-1], kernel.shape[1]
    results = [((*lead, n), out_dtype)]
    if with_aux:
        results.append(((*lead, aux_padded_width(activation, n)), aux_dtype(activation, d_dtype)))
    return results


def layout(args, *, activation, with_aux, **params) -> Layout:
    """x's rows (its leading dimensions, each split as it comes) split as they come, y and
    the aux alike; N split as the kernel's is (the bias and y alike), the aux with it where
    it is unpadded and, for an aux of bits, each device's N a multiple of 8."""
    del params
    has_bias, n, row_dims = len(args) == 3, args[1].shape[1], args[0].ndim - 1
    m = row_factors(row_dims)

    def rule(n_factor, aux_factor=None):
        operands = f"{m} k, k {n_factor}" + f", {n_factor}" * has_bias
        return f"{operands} -> {m} {n_factor}" + (f", {m} {aux_factor}" if aux_factor else "")

    operand_cols = {1: 1, 2: 0} if has_bias else {1: 1}
    if not with_aux:
        return Layout(((0,), (0,)), (), (operand_cols, {0: 1}), rule("n"), whole=("k",), row_dims=row_dims)
    rows, cols = ((0,), (0, 1)), (operand_cols, {0: 1, 1: 1})
    row = ACTIVATIONS[Activation(activation)]
    if n % row.aux_multiple:  # a padded aux cannot be cut along N: it stays whole
        return Layout(rows, (), cols, rule("n", "a"), whole=("k", "a"), packed=((1, 0),), row_dims=row_dims)
    if not row.aux_bits:  # the aux is z itself: one factor for both
        return Layout(rows, (), cols, rule("n", "n"), whole=("k",), row_dims=row_dims)
    # Bits: the aux holds N/8 bytes, so N is the compound of the aux's bytes and 8 bits.
    return Layout(
        rows, (), cols, rule("(a bits)", "a"), whole=("k", "bits"), factor_sizes=(("bits", 8),), packed=((1, 8),),
        row_dims=row_dims,
    )  # fmt: skip


def reference(x, kernel, *bias, activation, with_aux, compute_type, d_dtype, out_dtype):
    d, aux = _reference.dense(
        x, kernel, bias[0] if bias else None, activation, compute_type, d_dtype, with_aux
    )
    return [d.astype(out_dtype), aux] if with_aux else [d.astype(out_dtype)]


def forward_spec(avals, *, activation, with_aux, compute_type, d_dtype, out_dtype) -> EpilogSpec | None:
    """The cuBLASLt problem of a call on ``avals`` (x with its rows in one dimension,
    kernel[, bias]), unpadded; None where XLA computes it: symbolic sizes, float64, an
    empty dimension, or one row with a float32 D beside half operands (cuBLASLt plans that
    and then refuses every launch)."""
    del out_dtype
    if symbolic(*avals):
        return None
    x, kernel = avals[:2]
    one_row_f32_d = x.shape[0] == 1 and np.dtype(d_dtype) != np.dtype(x.dtype)
    empty = 0 in (*x.shape, kernel.shape[1])
    if np.dtype(x.dtype) == np.float64 or empty or one_row_f32_d:
        return None
    bias = avals[2] if len(avals) > 2 else None
    return EpilogSpec(
        m=int(x.shape[0]),
        n=int(kernel.shape[1]),
        k=int(x.shape[1]),
        epilog=epilog_name(activation, bias is not None, with_aux),
        compute_type=ComputeType(compute_type).name,
        ab_dtype=np.dtype(x.dtype).name,
        bias_dtype=None if bias is None else np.dtype(bias.dtype).name,
        d_dtype=np.dtype(d_dtype).name,
    )


def padded_operands(spec: EpilogSpec, x, kernel, *bias):
    """A forward's operands (members leading where they have them), padded to ``spec``."""
    return (pad_to(x, spec.k), pad_to(kernel, spec.k, spec.n), *(pad_to(b, spec.n) for b in bias))


def _cuda(ctx, x, kernel, *bias, **params):
    spec = forward_spec(ctx.avals_in, **params)
    spec = None if spec is None else padded_spec(spec)

    def fused(x, kernel, *bias):
        # D (padded rows) in the epilog's dtype, then the aux as the primitive returns it.
        results = [
            jax.ShapeDtypeStruct((spec.m, spec.n), params["d_dtype"]),
            *results_like(ctx.avals_out[1:]),
        ]
        d, *aux = ffi.call(padded_operands(spec, x, kernel, *bias), results, spec)
        return [
            cut_to(d, kernel.shape[1]).astype(params["out_dtype"]),
            *aux,
        ]  # (a no-op cast but for a float32 D)

    return lower_fused_or_reference(ctx, (x, kernel, *bias), params, spec, fused, reference)


def _batch(args, dims, **params):
    """Shared weights: the batch is one more leading dimension of the rows (one call).
    Batched weights (an ensemble): ``members_p``, one batched GEMM on a GPU."""
    from .members import bind_members

    x, kernel, *bias = args
    if dims[1] is None and all(d is None for d in dims[2:]):
        outs = fused_matmul_p.bind(jnp.moveaxis(x, dims[0], 0), kernel, *bias, **params)
        return outs, [0] * len(outs)
    return bind_members(args, dims, params)


tangents = register(
    fused_matmul_p, results=_results, layout=layout, reference=reference, cuda=_cuda, batch=_batch
)
# The handler is registered at import: a program holding the custom call may come from
# elsewhere (``jax.export``) and never be lowered in this process.
ffi.ensure_registered()
