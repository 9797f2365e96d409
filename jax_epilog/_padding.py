"""Row widths: when a fused call pads K and N, and padding and cutting arrays.

cuBLASLt's fast kernels need every matrix's rows a multiple of 16 bytes apart. K and N
are the row widths of the column-major matrices (M is none), so a large call whose K or N
is not a multiple of 8 half (4 single) elements pads them with zeros and cuts its results
back: zero columns of x and zero rows of the kernel add nothing to a product. Small calls
stay unpadded, since the copies cost more than they save there. A half-precision forward
without aux pads a wide N further, to ``Policy.wide_row_bytes``. The aux needs none of
this: its rows are padded already (``_epilogs.aux_columns``). The numbers are
``Policy.row_bytes``, ``pad_min_rows``, ``pad_min_work``, ``wide_row_bytes`` and
``wide_min_n``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ._epilogs import Activation, EpilogSpec, aux_columns, known_sizes
from ._policy import get_policy

__all__ = [
    "aligned_rows",
    "cut_to",
    "fast_rows",
    "on_padded_rows",
    "pad_to",
    "padded_layer",
    "padded_spec",
    "pads_n",
]


def pad_to(value: jax.Array, *sizes: int) -> jax.Array:
    """``value`` with zeros appended to its last ``len(sizes)`` dimensions up to ``sizes``."""
    lead = value.ndim - len(sizes)
    widths = [(0, 0)] * lead + [
        (0, want - have) for have, want in zip(value.shape[lead:], sizes, strict=True)
    ]
    return jnp.pad(value, widths) if any(w for _, w in widths) else value


def cut_to(value: jax.Array, *sizes: int) -> jax.Array:
    """``value``'s leading block of ``sizes`` in its last dimensions (undoes ``pad_to``)."""
    lead = value.ndim - len(sizes)
    if value.shape[lead:] == tuple(sizes):
        return value
    return value[(Ellipsis, *(slice(0, size) for size in sizes))]


def _row_width(width: int, dtype, row_bytes: int) -> int:
    """``width`` rounded up to whole rows of ``row_bytes`` bytes of ``dtype``."""
    multiple = max(1, row_bytes // np.dtype(dtype).itemsize)
    return -(-width // multiple) * multiple


def _pads(m: int, n: int, k: int, members: int = 1) -> bool:
    """Whether a fused call on this problem is large enough to pad its rows."""
    policy = get_policy()
    return m >= policy.pad_min_rows and m * n * k * members >= policy.pad_min_work


def _row_widths(m: int, n: int, k: int, dtype, members: int = 1) -> tuple[int, int]:
    """(N, K) as a fused call on this problem has them: padded where it is large enough."""
    if not _pads(m, n, k, members):
        return n, k
    row_bytes = get_policy().row_bytes
    return _row_width(n, dtype, row_bytes), _row_width(k, dtype, row_bytes)


def padded_spec(spec: EpilogSpec) -> EpilogSpec:
    """``spec`` with N and K as the fused call has them (``_row_widths``; a half N of at
    least ``wide_min_n`` in a forward without aux: rows of ``wide_row_bytes``). An aux
    keeps the layer's layout: the width it is laid out by (a forward's N, a dgrad's K)
    pads no further than ``aux_columns``, else cuBLASLt would write or read the aux by a
    wider row than its buffer has."""
    policy = get_policy()
    n, k = _row_widths(spec.m, spec.n, spec.k, spec.ab_dtype, spec.members)
    half = np.dtype(spec.ab_dtype).itemsize == 2
    forward = spec.problem == "forward"
    if n != spec.n and half and spec.n >= policy.wide_min_n and forward and not spec.has_aux:
        n = max(n, _row_width(spec.n, spec.ab_dtype, policy.wide_row_bytes))
    if forward and spec.has_aux:
        n = min(n, aux_columns(spec.activation, spec.n))
    elif spec.problem == "dgrad":
        k = min(k, aux_columns(Activation.GELU, spec.k))
    return spec._replace(n=n, k=k)


def aligned_rows(n: int, k: int, dtype) -> bool:
    """Whether ``dtype``'s (m, k) x and (k, n) kernel have whole rows as they are."""
    row_bytes = get_policy().row_bytes
    return _row_width(n, dtype, row_bytes) == n and _row_width(k, dtype, row_bytes) == k


def fast_rows(m: int, n: int, k: int, dtype) -> bool:
    """Whether a fused call on this layer gets whole rows: aligned, or padded."""
    return aligned_rows(n, k, dtype) or _pads(m, n, k)


def pads_n(m: int, n: int, k: int, dtype) -> bool:
    """Whether a fused call on ``dtype``'s (m, k) x and (k, n) kernel pads N."""
    return _row_widths(m, n, k, dtype)[0] != n


def padded_layer(x, kernel, bias):
    """(x, kernel, bias) padded with zeros to whole rows where a fused call on them would
    pad, else as given."""
    (k, n), m = kernel.shape, math.prod(x.shape[:-1])
    if not known_sizes(m, n, k):
        return x, kernel, bias
    n_rows, k_rows = _row_widths(m, n, k, x.dtype)
    return pad_to(x, k_rows), pad_to(kernel, k_rows, n_rows), None if bias is None else pad_to(bias, n_rows)


def on_padded_rows(f, x, kernel, bias):
    """``f(x, kernel, bias)`` on the operands ``padded_layer`` pads, cut back to N columns.

    XLA's own GEMMs are as slow on unaligned rows as cuBLASLt's, so XLA's expressions for
    such layers (the "auto" forward and the backward's GEMMs) run on the padded rows too.
    """
    return f(*padded_layer(x, kernel, bias))[..., : kernel.shape[1]]
