"""``fused_dense``: the public op, checked at trace time, differentiable through its aux."""

from __future__ import annotations

import enum
import functools
import math
from typing import NamedTuple

import jax
import numpy as np

from . import _reference
from ._epilogs import (
    HALF_DTYPES,
    SUPPORTED_DTYPES,
    Activation,
    ComputeType,
    default_compute_type,
    valid_compute_types,
)
from ._primitive import fused_matmul

__all__ = ["fused_dense"]

_ACTIVATIONS = (None, *(a.value for a in Activation))


def _check_array(value, name: str) -> None:
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"fused_dense: {name} must be a JAX or NumPy array, got {type(value).__name__}")


def _dtype_name(value) -> str:
    """The dtype JAX will compute in (NumPy float64 is float32 unless x64 is enabled)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(value.dtype)).name


def _activation(value) -> Activation | None:
    if value is None or isinstance(value, Activation):
        return value
    if isinstance(value, str) and value in _ACTIVATIONS:
        return Activation(value)
    hint = ""
    if isinstance(value, str) and "gelu" in value.lower():
        hint = (
            " cuBLASLt's only GELU is the tanh approximation (activation='gelu'); for the exact"
            " erf GELU apply jax.nn.gelu(y, approximate=False) to fused_dense(..., activation=None)."
        )
    raise ValueError(f"fused_dense: unknown activation {value!r}; allowed: {_ACTIVATIONS}.{hint}")


def _compute_type(value, dtype: str, f32_bias: bool) -> ComputeType:
    valid = valid_compute_types(dtype, f32_bias)
    if value is None:
        return default_compute_type(dtype)
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if not isinstance(value, (str, enum.Enum)) or name not in ComputeType.__members__:
        raise ValueError(
            f"fused_dense: unknown compute_type {value!r}; pass a MatmulComputeType or its "
            f"name, one of {[c.name for c in ComputeType]}."
        )
    ct = ComputeType[name]
    if ct not in valid:
        bias_note = " with a float32 bias" if f32_bias else ""
        raise ValueError(
            f"fused_dense: compute_type {ct.name} cannot run {dtype} operands{bias_note}; "
            f"allowed: {[c.name for c in valid]}."
        )
    return ct


def fused_dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | Activation | None = None,
    compute_type=None,
    return_aux: bool = False,
):
    """``act(x @ kernel + bias)`` as one cuBLASLt kernel on NVIDIA GPUs.

    Args:
      x: (..., K) array; its leading dimensions fold into the GEMM's M.
      kernel: (K, N) array (Flax's layout), the same dtype as ``x``.
      bias: (N,) array or None, in ``x``'s dtype, or float32 when ``x`` is float16 or
        bfloat16.
      activation: None, ``"relu"`` or ``"gelu"``. ``"gelu"`` is the tanh approximation,
        ``jax.nn.gelu(z, approximate=True)``: cuBLASLt has no exact-erf GELU epilog.
      compute_type: a ``nvmath.linalg.advanced.MatmulComputeType`` (or
        ``jax_epilog.ComputeType``) member or its name. Default: ``COMPUTE_32F`` (float32
        accumulation) for float16, bfloat16 and float32; ``COMPUTE_64F`` for float64.
        float32 also accepts ``COMPUTE_32F_FAST_TF32`` (and ``_FAST_16F``/``_FAST_16BF``).
      return_aux: also return the epilog's auxiliary output, which the backward pass uses:
        for ReLU a uint8 bit-mask of shape (..., round_up(N, 128) // 8) where bit ``j % 8``
        of byte ``j // 8`` is ``z[..., j] > 0``; for GELU the pre-activation ``z`` of shape
        (..., round_up(N, 8)); None without activation. Padding contents are unspecified.

    Returns:
      ``y`` of shape (..., N) in ``x``'s dtype, or ``(y, aux)`` with ``return_aux=True``.

    Numerics: the product is accumulated in the compute type; bias and activation are
    applied to that accumulator and the result is rounded to ``x``'s dtype (the CPU path
    rounds once; on the H200 cuBLASLt's epilog was measured to round the accumulator to the
    output dtype before the bias and to use a fast tanh for GELU: about one unit in the
    last place of ``z``, ~5e-6 absolute for float32 GELU). A float32
    bias with half operands keeps exact float32 semantics, ``cast(act(x @ kernel + bias))``
    with the sum in float32: the GEMM writes a float32 D with the epilog fused (cuBLASLt
    refuses a float32 bias beside a half D) and XLA casts it; the GELU aux is then float32.

    float64 runs on XLA's path everywhere (cuBLASLt has no float64 epilogs), as does a
    problem with an empty dimension or one cuBLASLt refuses (a warning says so, once).
    Raises TypeError/ValueError at trace time for anything else it cannot compute.

    Differentiation: reverse mode (``jax.grad``, ``jax.vjp``) in ``x``, ``kernel`` and
    ``bias``, each gradient in its primal's dtype. The forward saves only ``x``, ``kernel``
    and the aux (one bit per output for ReLU); the backward forms ``dz = dy * act'(z)``
    from it (ReLU's derivative at ``z == 0`` is 0, as for ``jax.nn.relu``) and runs its
    GEMMs with XLA. With ``return_aux=True`` the GELU aux is differentiable (it is ``z``);
    the ReLU mask is not. Forward mode (``jax.jvp``) is not supported and raises.
    """
    _check_array(x, "x")
    _check_array(kernel, "kernel")
    if bias is not None:
        _check_array(bias, "bias")
    act = _activation(activation)
    dtype = _dtype_name(x)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"fused_dense: x has dtype {dtype}; allowed: {SUPPORTED_DTYPES}.")
    if _dtype_name(kernel) != dtype:
        raise TypeError(
            f"fused_dense: kernel dtype {_dtype_name(kernel)} differs from x dtype {dtype}; "
            "cast one of them so both match."
        )
    if x.ndim < 1:
        raise ValueError(f"fused_dense: x must have shape (..., K), got a scalar of shape {x.shape}.")
    if kernel.ndim != 2:
        raise ValueError(f"fused_dense: kernel must have shape (K, N), got shape {kernel.shape}.")
    k, n = kernel.shape
    if x.shape[-1] != k:
        raise ValueError(
            f"fused_dense: x's last dimension {x.shape[-1]} (shape {x.shape}) must equal "
            f"kernel's first dimension K={k} (shape {kernel.shape})."
        )
    f32_bias = False
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(
                f"fused_dense: bias must have shape (N,) = ({n},), got shape {bias.shape}."
            )
        b_dtype = _dtype_name(bias)
        f32_bias = dtype in HALF_DTYPES and b_dtype == "float32"
        if b_dtype != dtype and not f32_bias:
            allowed = [dtype, "float32"] if dtype in HALF_DTYPES else [dtype]
            raise TypeError(
                f"fused_dense: bias dtype {b_dtype} does not fit {dtype} operands; allowed: {allowed}."
            )
    ct = _compute_type(compute_type, dtype, f32_bias)

    config = _Config(
        activation=act,
        compute_type=ct,
        d_dtype="float32" if f32_bias else dtype,
        bias_dtype=None if bias is None else _dtype_name(bias),
        return_aux=return_aux,
    )
    lead = x.shape[:-1]
    y, aux = _dense(x.reshape(math.prod(lead), k), kernel, bias, config)
    y = y.reshape(*lead, n)
    if not return_aux:
        return y
    return y, (None if aux is None else aux.reshape(*lead, aux.shape[-1]))


class _Config(NamedTuple):
    """The static half of a call: hashable, so it can be a custom_vjp nondiff argument."""

    activation: Activation | None
    compute_type: ComputeType
    d_dtype: str
    bias_dtype: str | None
    return_aux: bool


def _forward(x2, kernel, bias, config: _Config, with_aux: bool):
    outs = fused_matmul(
        x2,
        kernel,
        bias,
        activation=config.activation,
        with_aux=with_aux,
        compute_type=config.compute_type,
        d_dtype=config.d_dtype,
        out_dtype=x2.dtype,
    )
    return outs[0], (outs[1] if len(outs) > 1 else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x2, kernel, bias, config: _Config):
    """(m, k) x2 -> (y, aux or None), differentiable in x2, kernel and bias."""
    return _forward(x2, kernel, bias, config, with_aux=config.return_aux)


def _dense_fwd(x2, kernel, bias, config: _Config):
    # The backward needs the aux (never z itself for ReLU: one bit per output), so the
    # forward always asks the epilog for it when there is an activation.
    y, aux = _forward(x2, kernel, bias, config, with_aux=True)
    return (y, aux if config.return_aux else None), (x2, kernel, aux)


def _dense_bwd(config: _Config, residuals, cotangents):
    x2, kernel, aux = residuals
    dy, daux = cotangents
    dz_extra = None
    if config.activation is Activation.GELU and config.return_aux:
        dz_extra = daux[:, : kernel.shape[1]]  # the GELU aux is z: its cotangent adds to dz
    dx, dkernel, dbias = _reference.dense_vjp(
        x2, kernel, aux, dy, dz_extra, config.activation, config.compute_type, config.bias_dtype
    )
    return dx, dkernel, dbias


_dense.defvjp(_dense_fwd, _dense_bwd)
