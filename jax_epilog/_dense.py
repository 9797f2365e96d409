"""``fused_dense``: the public op, checked at trace time, differentiable through its aux."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
from jax.custom_derivatives import SymbolicZero

from . import _reference
from ._checks import (
    check_array,
    check_implementation,
    check_layer,
    check_return_aux,
    dtype_name,
    reverse_mode_only,
)
from ._dispatch import dense_implementation
from ._epilogs import ACTIVATIONS, Activation, ComputeType
from ._grads import layer_grads
from ._padding import on_padded_rows
from ._typing import like
from .fp8._api import check_options, dense_call
from .primitives import fused_matmul

__all__ = ["fused_dense"]


def fused_dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | Activation | None = None,
    compute_type=None,
    return_aux: bool = False,
    implementation: str = "auto",
    fp8=None,
    fp8_output: bool = False,
):
    """``act(x @ kernel + bias)`` as one cuBLASLt kernel on NVIDIA GPUs.

    Example::

        y = fused_dense(x, kernel, bias, activation="gelu")
        y, aux = fused_dense(x, kernel, bias, activation="relu", return_aux=True)
        y, state = fused_dense(x, kernel, bias, activation="gelu", fp8=state)

    Args:
      x: (..., K) float16, bfloat16, float32 or float64 array; its leading dimensions are M.
      kernel: (K, N) array in ``x``'s dtype (Flax's layout).
      bias: (N,) array in ``x``'s dtype (or float32 beside half ``x``), or None.
      activation: None, ``"relu"`` or ``"gelu"`` (the tanh approximation: cuBLASLt has no
        exact-erf GELU epilog).
      compute_type: a ``ComputeType`` (or nvmath ``MatmulComputeType``) member or its name.
        Default ``COMPUTE_32F`` (``COMPUTE_64F`` for float64); float32 also takes the
        ``COMPUTE_32F_FAST_*`` types, float16 ``COMPUTE_16F``.
      return_aux: also return the epilog's aux: for ReLU a uint8 bit-mask of shape
        (..., round_up(N, 128) // 8), bit ``j % 8`` of byte ``j // 8`` being ``z[..., j] >
        0`` (``unpack_relu_mask`` unpacks it); for GELU ``z`` itself, (..., round_up(N,
        8)); None without an activation. Padding contents are unspecified.
      implementation: ``"cublaslt"``: the fused kernels, forward and backward. ``"xla"``:
        the plain expression, compiled and differentiated by XLA. ``"auto"`` (default):
        whichever measured faster: the fused forward for large bfloat16/float16 ReLU and
        GELU layers, XLA's expression and autodiff elsewhere and for every backward, and
        the op wherever XLA cannot compute the result (``return_aux``, 16-bit compute).

      fp8: a ``jax_epilog.fp8.DenseState``: quantize x and the kernel to E4M3 with its
        scales, run the GEMMs in FP8 (gradients in E5M2) and return ``(y, new_state)``.
        ``x`` may then be a ``fp8.Quantized`` (used as it is; forward only).
      fp8_output: with ``fp8``, write y in E4M3 with the state's output scale: ``y`` is then
        a ``fp8.Quantized`` (forward only).

    Returns:
      ``y`` (..., N) in ``x``'s dtype, ``(y, aux)`` with ``return_aux=True``, or
      ``(y, new_state)`` with ``fp8``.

    Raises TypeError or ValueError at trace time for arguments the op cannot take. On a
    CPU, and where cuBLASLt cannot run a problem (float64, an empty dimension, a refused
    plan: one ``FastPathWarning``), the same outputs come from XLA. Reverse mode works
    everywhere and differentiates again; forward mode only through XLA's expression
    ("auto", "xla"). Numerics, padding and the aux: ``docs/numerics.md``.
    """
    if fp8 is not None:
        check_options("fused_dense", compute_type, return_aux, implementation)
        return dense_call(x, kernel, bias, activation, fp8, fp8_output)
    check_array(x, "x", "fused_dense")
    act, dtype, ct, f32_bias = check_layer("fused_dense", x.shape, x, kernel, bias, activation, compute_type)
    check_return_aux(return_aux, "fused_dense")
    check_implementation(implementation, ct, return_aux, "fused_dense")
    (k, n), m = kernel.shape, math.prod(x.shape[:-1])
    impl = dense_implementation(implementation, act, dtype, ct, return_aux, m, n, k)
    config = _Config(
        activation=act,
        compute_type=ct,
        d_dtype="float32" if f32_bias else dtype,
        bias_dtype=None if bias is None else dtype_name(bias),
        return_aux=return_aux,
    )
    if impl == "xla":
        return _plain(x, kernel, bias, config)  # the user's expression, leading dimensions and all
    if impl == "xla on padded rows":
        return _with_xla_derivatives(x, kernel, bias, config, False)
    # The rows go to the op with their leading dimensions (one row: (1, K)): each device
    # folds its own rows, however they are split.
    rows = x if x.ndim > 1 else x[None]
    if impl == "fused forward":
        y, aux = _with_xla_derivatives(rows, kernel, bias, config, True), None
    else:
        with reverse_mode_only("fused_dense"):
            y, aux = _dense(rows, kernel, bias, config)
    if x.ndim == 1:
        y, aux = y[0], (None if aux is None else aux[0])
    return (y, aux) if return_aux else y


class _Config(NamedTuple):
    """The static half of a call: hashable, so it can be a custom_vjp nondiff argument."""

    activation: Activation | None
    compute_type: ComputeType
    d_dtype: str  # the epilog's dtype: x's, or float32 beside a float32 bias
    bias_dtype: str | None
    return_aux: bool


def _plain(x, kernel, bias, config: _Config):
    tf32 = config.compute_type is ComputeType.COMPUTE_32F_FAST_TF32
    return _reference.plain(x, kernel, bias, config.activation, tf32)


def _plain_on_padded_rows(x, kernel, bias, config: _Config):
    """``_plain`` on the operands padded as a fused call pads them, cut back to N."""
    return on_padded_rows(functools.partial(_plain, config=config), x, kernel, bias)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _with_xla_derivatives(x, kernel, bias, config: _Config, fused: bool):
    """The layer's value where only the value is needed: the fused kernel (``fused``) or
    XLA's expression on padded rows. Differentiated, in either mode, the plain expression
    on those rows with its own derivatives (XLA's autodiff, and forward mode)."""
    if fused:
        return _forward(x, kernel, bias, config, with_aux=False)[0]
    return _plain_on_padded_rows(x, kernel, bias, config)


def _xd_jvp(config: _Config, fused: bool, primals, tangents):
    # Only the differentiated arguments enter the expression's jvp, so an argument held
    # constant adds no product with a zero tangent, and reverse mode lowers to the very
    # program of the user's expression under jax.grad (on padded rows where they pad).
    del fused
    live = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]

    def plain(*active):
        args = list(primals)
        for i, a in zip(live, active):
            args[i] = a
        return _plain_on_padded_rows(*args, config)

    return jax.jvp(plain, [primals[i] for i in live], [tangents[i] for i in live])


_with_xla_derivatives.defjvp(_xd_jvp, symbolic_zeros=True)


def _forward(x, kernel, bias, config: _Config, with_aux: bool):
    outs = fused_matmul(
        x, kernel, bias, activation=config.activation, with_aux=with_aux,
        compute_type=config.compute_type, d_dtype=config.d_dtype, out_dtype=x.dtype,
    )  # fmt: skip
    return outs[0], (outs[1] if len(outs) > 1 else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x, kernel, bias, config: _Config):
    """(..., k) x -> (y, aux or None), differentiable in x, kernel and bias."""
    return _forward(x, kernel, bias, config, with_aux=config.return_aux)


def _dense_fwd(x, kernel, bias, config: _Config):
    # The backward needs the aux (one bit per output for ReLU, never z), so the forward
    # always asks the epilog for it when there is an activation.
    y, aux = _forward(x, kernel, bias, config, with_aux=True)
    return (y, aux if config.return_aux else None), (x, kernel, bias, aux)


def _dense_bwd(config: _Config, residuals, cotangents):
    x, kernel, bias, aux = residuals  # (the bias for its type only)
    dy, daux = cotangents
    ct = config.compute_type
    dz_extra = None
    if config.return_aux and config.activation is not None and not ACTIVATIONS[config.activation].aux_bits:
        dz_extra = daux[..., : kernel.shape[1]]  # an aux that is z: its cotangent adds to dz
    dz = _reference.output_grad(aux, dy, dz_extra, config.activation, ct, x.dtype)
    dx, dkernel, dbias = layer_grads(x, dz, kernel, config.activation, ct, config.d_dtype, config.bias_dtype)
    # Under explicit sharding each gradient takes its primal's type.
    return like(dx, x), like(dkernel, kernel), (None if dbias is None else like(dbias, bias))


_dense.defvjp(_dense_fwd, _dense_bwd)
