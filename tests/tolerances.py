"""Tolerances for comparing ``fused_dense``'s output (computed at a dtype) with a float64 oracle.

The oracle is computed in float64 from the *cast* inputs, so the only error left is the op's
own rounding. That error has two parts, and each gets its own term:

* ``rtol``: the single final rounding of the result to the output dtype (half a unit in the
  last place, ``eps / 2``), plus the activation's evaluation in the epilog. We allow
  ``2 * eps`` for the 16-bit dtypes (whose rounding dominates everything else) and ``16 * eps``
  for float32/float64, where a few ulps of ``tanh`` in GELU matter.
* ``atol``: the accumulation error of the dot product, which does not shrink with the output
  (cancellation can make ``z`` tiny while the partial sums were O(scale)). For a K-term sum of
  O(1) terms whose partial sums stay O(scale) (the tests scale inputs by ``1/sqrt(K)``) it
  grows like ``eps_acc * sqrt(K) * scale``, where ``eps_acc`` is the epsilon of the
  accumulator (float32 for the 16-bit dtypes by default, so their ``atol`` is tiny). We
  allow ``4 * eps_acc * sqrt(K + 16) * scale`` (the ``+ 16`` keeps a floor for K = 0 or 1),
  plus the dtype's smallest normal number (float16 results near zero are subnormal).

Measured on CPU over many seeds and the test shapes (K up to 2048), the worst element uses
about a quarter of this budget. Yet it is far tighter than any real bug: a missing bias,
a missing or wrong activation, a transposed kernel or an aux shifted by one column is an
O(1) error, and even a result rounded to the next narrower dtype (float64 -> float32,
float32 -> float16, float16 -> bfloat16, bfloat16 -> float8) fails. ``test_dense.py``
proves each of these.
"""

from __future__ import annotations

import math

import jax
import ml_dtypes
import numpy as np

__all__ = ["ACC_DTYPE", "RTOL", "TOLERANCES", "assert_close", "dtype_name", "epilog_slack", "tolerance"]

ON_GPU = jax.default_backend() == "gpu"

# Relative tolerance: the final rounding to the dtype (and the activation's evaluation).
RTOL = {
    "float16": 2 * float(np.finfo(np.float16).eps),  # 1.95e-3
    "bfloat16": 2 * float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps),  # 1.56e-2
    "float32": 16 * float(np.finfo(np.float32).eps),  # 1.9e-6
    "float64": 16 * float(np.finfo(np.float64).eps),  # 3.6e-15
}
# The accumulator of the default compute type (COMPUTE_32F, or COMPUTE_64F for float64).
ACC_DTYPE = {"float16": "float32", "bfloat16": "float32", "float32": "float32", "float64": "float64"}
ATOL_FACTOR = 4.0


def dtype_name(dtype) -> str:
    """'float16', 'bfloat16', ... for a name, a NumPy/JAX dtype or a scalar type."""
    return np.dtype(dtype).name


def _eps(dtype) -> float:
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps)


def tolerance(dtype, k: int = 1, *, scale: float = 1.0, acc_eps: float | None = None):
    """``(rtol, atol)`` for a result in ``dtype`` of a ``k``-term dot product of O(``scale``).

    ``acc_eps`` overrides the accumulator's epsilon (e.g. float16's for ``COMPUTE_16F``,
    ``2**-10`` for TF32); by default it is that of ``ACC_DTYPE[dtype]``.
    """
    name = dtype_name(dtype)
    if acc_eps is None:
        acc_eps = _eps(ACC_DTYPE[name])
    tiny = float(ml_dtypes.finfo(np.dtype(name)).tiny)
    atol = ATOL_FACTOR * acc_eps * math.sqrt(max(k, 0) + 16) * scale + tiny
    return RTOL[name], atol


# (rtol, atol) per dtype for K = 1 and O(1) values; `tolerance` scales atol with sqrt(K).
TOLERANCES = {name: tolerance(name, 1) for name in RTOL}


def epilog_slack(epilog_dtype, z, bias=None, activation=None):
    """The extra absolute error of cuBLASLt's epilog, elementwise; 0 on the CPU path.

    Measured on the H200 (cuBLASLt 13.1): the epilog may round the accumulator ``x @ w`` to
    D's dtype before adding the bias (which kernels do is cuBLASLt's choice: on an H100,
    bfloat16 kernels were seen rounding first only where K or N is not a multiple of 8,
    and not all of those) and evaluates the activation at D's precision (for
    bfloat16 GELU, ``1 + tanh(u)`` can round to 0), and its GELU uses a fast tanh with
    errors near ``2**-11 |z|`` even in float32. So on a GPU each element may also be off by
    one unit in the last place of ``|x @ w|`` and of ``|z|`` at D's precision, plus
    ``2**-11 |z|`` for GELU. Everything the tolerance tests prove it catches is O(1) larger.
    """
    name = dtype_name(epilog_dtype)
    if not ON_GPU or name == "float64":
        return 0.0
    z = np.asarray(z, dtype=np.float64)
    acc = z if bias is None else z - np.asarray(bias, dtype=np.float64)
    slack = _eps(name) * (np.abs(acc) + np.abs(z))
    if activation == "gelu":
        slack = slack + 2.0**-11 * np.abs(z)
    return slack


def assert_close(
    actual, expected, dtype, *, k: int = 1, scale: float = 1.0, acc_eps=None, slack=0.0, what=""
):
    """Assert ``|actual - expected| <= atol + rtol * |expected| + slack`` elementwise (see
    ``tolerance``; ``slack`` is ``epilog_slack(...)`` where the GPU epilog computed ``actual``).

    ``actual`` is the op's output (any float dtype); ``expected`` the float64 oracle. Shapes
    must match exactly and ``actual`` must be finite wherever ``expected`` is.
    """
    actual = np.asarray(actual)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what} shape {actual.shape} != expected {expected.shape}"
    a = actual.astype(np.float64)
    rtol, atol = tolerance(dtype, k, scale=scale, acc_eps=acc_eps)
    with np.errstate(invalid="ignore"):
        err = np.abs(a - expected)
        bound = atol + rtol * np.abs(expected) + slack
        bad = ~(err <= bound)  # NaN counts as bad
    if bad.any():
        idx = np.unravel_index(int(np.argmax(np.where(bad, err / bound, -np.inf))), bad.shape)
        raise AssertionError(
            f"{what} not close at {dtype_name(dtype)} (rtol={rtol:.3g}, atol={atol:.3g}, k={k}): "
            f"{int(bad.sum())} of {bad.size} elements differ; worst at {tuple(map(int, idx))}: "
            f"actual {a[idx]!r}, expected {expected[idx]!r}, |diff| {err[idx]:.3g} > {bound[idx]:.3g}"
        )
