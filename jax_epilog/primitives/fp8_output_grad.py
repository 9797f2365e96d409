"""``fp8_output_grad_p``: an FP8 layer's output gradient, quantized to E5M2, in one pass.

dy (M, N)[, GELU's z (M, >= N) or ReLU's y (M, N)] and dz's E5M2 dequantization scale give
dz = dy * act'(.) in dy's dtype (``fp8._fused_dz.dz_of``) as [E5M2 dz / scale (M, N), its
column sums (N,) float32, its amax () float32]. The CUDA lowering is one Pallas kernel
(``fp8/_fused_dz.py``) where its tile (``Policy.fp8_fused_dz_block``) divides dz;
otherwise, and on the CPU, the same math as XLA's passes (``reference``). The scale must
be known before dz: delayed scaling.
"""

from __future__ import annotations

import functools

import numpy as np
from jax.interpreters import mlir

from .._partition import Layout
from .._policy import get_policy
from .._typing import vary_alike
from ..fp8._fused_dz import KINDS, column_sums_and_amax, dz_of, fits, fused_dz
from ..fp8._quant import quantize
from ..fp8._recipes import E5M2
from ._base import new_primitive, register

__all__ = ["fp8_output_grad", "fp8_output_grad_p", "reference"]

fp8_output_grad_p = new_primitive("fp8_output_grad")


def fp8_output_grad(dy, other, scale, *, kind: str):
    """[E5M2 dz, column sums, amax] for ``kind`` in ``KINDS`` (``other``: GELU's z, ReLU's
    y, or None)."""
    if kind not in KINDS:
        raise ValueError(f"fp8_output_grad: kind={kind!r}; allowed: {', '.join(KINDS)}")
    operands = (dy, scale) if kind == "none" else (dy, other, scale)
    return fp8_output_grad_p.bind(*vary_alike(*operands), kind=kind)


def _results(dy, *rest, kind):
    m, n = dy.shape
    return [((m, n), np.dtype(E5M2)), ((n,), np.dtype(np.float32)), ((), np.dtype(np.float32))]


def _layout(avals, *, kind) -> Layout:
    """Rows split alike in dy, the aux and dz; the column sums summed over them and the
    amax their maximum; N whole."""
    paired = kind != "none"
    rule = f"m n, {'m a, ' if paired else ''} -> m n, n, "
    rows = ((0, 1) if paired else (0,), (0,))
    return Layout(rows, (1,), ({}, {}), rule, whole=("n", "a"), maxed=(2,))


def reference(*args, kind):
    """XLA's passes: dz with both reductions, and its E5M2 copy."""
    dy, scale = args[0], args[-1]
    dz = dz_of(kind, dy, None if kind == "none" else args[1])
    return [quantize(dz, E5M2, scale), *column_sums_and_amax(dz)]


def _kernel(*args, kind, block):
    dy, scale = args[0], args[-1]
    out = fused_dz(dy, None if kind == "none" else args[1], scale, kind=kind, block=block)
    return [out.data, out.column_sums, out.amax]


def _cuda(ctx, *args, kind):
    block = tuple(get_policy().fp8_fused_dz_block)
    if fits(ctx.avals_in[0].shape, block):
        lowered = functools.partial(_kernel, kind=kind, block=block)
    else:
        lowered = functools.partial(reference, kind=kind)
    return mlir.lower_fun(lowered, multiple_results=True)(ctx, *args)


register(fp8_output_grad_p, results=_results, layout=_layout, reference=reference, cuda=_cuda, batch=None)
