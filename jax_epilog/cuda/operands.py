"""Each problem's operands as cuBLASLt sees them: column-major views for planning.

Planning reads shapes, strides, dtypes and addresses only, never the data, so the views
are strided CuPy arrays over one small allocation offset to the plan's alignment (nvmath's
own heuristic query then sees the same alignment the plan promises). The layouts:

* forward: D[n, m] = A[n, k] @ B[k, m] with A the row-major (k, n) kernel and B the
  row-major (m, k) x; D is the row-major (m, n) output. An ensemble's members lead, each a
  contiguous block; an operand the members share keeps its 2-D view (batch stride 0).
* wgrad: D[n, k] = A[n, m] @ op(B) with A = dz (row-major (m, n)) and op(B) = x (row-major
  (m, k), a row-ordered layout). C fixes D as the column-major (n, k): the row-major (k, n)
  kernel gradient.
* dgrad: D[k, m] = A[k, n] @ B[n, m]: A the row-major (k, n) kernel read as row-ordered,
  B the row-major (m, n) dz, D the row-major (m, k) input gradient; the aux is the previous
  layer's GELU input in its forward layout.
* FP8 (``Fp8Spec``): D[n, m] = A^T[n, k] @ B[k, m] with A = Q and B = P, both row-major
  with K contiguous; described with cuBLASLt's own calls (``plan._Fp8Matmul``), no views.
"""

from __future__ import annotations

import math

import cupy as cp
import numpy as np

from .._epilogs import Activation, EpilogSpec, aux_padded_width

__all__ = ["planning_views"]


class _Views:
    """Views of any layout over one small allocation aligned to ``alignment``, not more."""

    def __init__(self, device_id: int, alignment: int):
        with cp.cuda.Device(device_id):
            self._base = cp.cuda.alloc(1024)
        self._ptr = self._base.ptr + alignment
        self._device_id = device_id

    def view(self, shape, dtype: str, strides_elems) -> cp.ndarray:
        dt = np.dtype(dtype)
        mem = cp.cuda.UnownedMemory(self._ptr, 1 << 40, self._base, self._device_id)
        strides = tuple(s * dt.itemsize for s in strides_elems)
        return cp.ndarray(shape, dtype=dt, memptr=cp.cuda.MemoryPointer(mem, 0), strides=strides)


def _members(spec: EpilogSpec, operand: str, shape, strides, dtype: str):
    """A forward operand's (shape, dtype, strides): its members' matrices one after
    another, or, shared by the members or without any, one matrix."""
    if spec.members == 1 or spec.is_shared(operand):
        return shape, dtype, strides
    return (spec.members, *shape), dtype, (math.prod(shape), *strides)


def planning_views(spec: EpilogSpec, device_id: int, alignment: int):
    """(a, b, c or None, epilog inputs or None) for nvmath's ``Matmul`` and its ``plan``."""
    views = _Views(device_id, alignment)
    m, n, k = spec.m, spec.n, spec.k
    if spec.problem == "wgrad":
        a = views.view((n, m), spec.ab_dtype, (1, n))
        b = views.view((m, k), spec.ab_dtype, (k, 1))
        return a, b, views.view((n, k), spec.d_dtype, (1, n)), None
    if spec.problem == "dgrad":
        a = views.view((k, n), spec.ab_dtype, (n, 1))
        b = views.view((n, m), spec.ab_dtype, (1, n))
        width = aux_padded_width(Activation.GELU, k)
        aux = views.view((width, m), spec.d_dtype, (1, width))
        return a, b, views.view((k, m), spec.d_dtype, (1, k)), {"gelu_aux": aux}
    a = views.view(*_members(spec, "kernel", (n, k), (1, n), spec.ab_dtype))
    b = views.view(*_members(spec, "x", (k, m), (1, k), spec.ab_dtype))
    c = None
    if spec.d_dtype != spec.ab_dtype:  # a float32 D (beside a float32 bias) for half operands
        c = views.view(*_members(spec, "d", (n, m), (1, n), spec.d_dtype))
    if spec.bias_dtype is None:
        return a, b, c, None
    bias = (n,), spec.bias_dtype, (1,)
    if spec.members > 1 and not spec.is_shared("bias"):  # a column per member
        bias = (spec.members, n, 1), spec.bias_dtype, (n, 1, 1)
    return a, b, c, {"bias": views.view(*bias)}
