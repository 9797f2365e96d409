"""``fused_mlp``: a stack of dense layers whose backward fuses each GELU into the next GEMM.

A layer's input gradient ``dz_l @ kernel_l.T`` is the cotangent of the layer before it;
when that layer applies GELU, its backward next multiplies by ``gelu'(z)``. Across single
``fused_dense`` calls that is a GEMM, then an elementwise pass over an (M, K) array. Here
one custom_vjp sees both layers, so the GEMM does the multiplication in its epilog
(cuBLASLt's DGELU, reading the GELU layer's aux) and only the bias gradient's reduction
remains. ReLU links (DRELU) and the fused bias-gradient epilogs measured slower than
XLA's ops, so they stay with XLA.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _reference
from ._checks import (
    check_array,
    check_implementation,
    check_layer,
    check_pairs,
    dtype_name,
    reverse_mode_only,
)
from ._dense import fused_dense
from ._dispatch import mlp_choice
from ._epilogs import ACTIVATIONS, XLA_COMPUTE_TYPES, Activation, ComputeType, aux_padded_width
from ._grads import layer_grads
from ._padding import on_padded_rows, pad_to
from ._typing import like
from .fp8._api import check_options, mlp_call
from .primitives import fused_gelu_input_grad, fused_matmul

__all__ = ["fused_mlp"]

_OWNER = "fused_mlp"


def fused_mlp(
    x: jax.Array,
    layers: Sequence[tuple[jax.Array, jax.Array | None]],
    activations: Sequence[str | Activation | None],
    *,
    compute_type=None,
    implementation: str = "auto",
    fp8: Sequence | None = None,
):
    """``fused_dense`` layers in sequence, differentiated as one block.

    ``h_{i+1} = act_i(h_i @ kernel_i + bias_i)`` from ``h_0 = x``; returns the last ``h``.

    Example::

        y = fused_mlp(x, [(w1, b1), (w2, b2)], ["gelu", None])

    Args:
      x: (..., K) array, as for ``fused_dense``.
      layers: ``(kernel, bias)`` pairs (``bias`` may be None); layer i's K is layer i-1's N.
      activations: one per layer: None, ``"relu"`` or ``"gelu"``.
      compute_type: as for ``fused_dense``, for every layer.
      implementation: ``"auto"`` (default), ``"cublaslt"`` or ``"xla"``, for every layer.
      fp8: one ``jax_epilog.fp8.DenseState`` per layer: run the block in FP8, each hidden
        layer's epilog writing the next GEMM's E4M3 operand (``docs/fp8.md``); returns
        ``(y, new_states)``.

    Returns:
      (..., N_last) array in ``x``'s dtype: the values of the stacked ``fused_dense`` calls
      (with ``fp8``: ``(y, new_states)``).

    The gradient also equals theirs, except where this function sees more than one call:
    a GELU layer that feeds another layer is *linked* ("cublaslt"; "auto" on large
    half-precision blocks): its dz is formed in the next layer's input-gradient GEMM
    (DGELU epilog), rounding once where separate calls round twice. With "auto", a large
    ReLU layer that feeds another keeps the fused kernel's mask for its backward, and a
    mid-size half-precision block runs every layer on cuBLASLt, where XLA's forward is the
    slower. A linked block is reverse-mode only (``jax.grad``, ``jax.vjp``; its gradient
    differentiates again). Raises TypeError/ValueError at trace time, naming the layer.
    """
    check_array(x, "x", _OWNER)
    layers, activations = check_pairs(layers, activations, _OWNER)
    if fp8 is not None:
        check_options(_OWNER, compute_type, False, implementation)
        return mlp_call(x, layers, activations, fp8)
    checked = _check_layers(x, layers, activations, compute_type, implementation)
    dtype = dtype_name(x)
    widths = [x.shape[-1], *(kernel.shape[1] for kernel, _ in layers)]
    choice = mlp_choice(
        implementation, [act for act, _, _ in checked], dtype, math.prod(x.shape[:-1]), widths
    )
    if not choice.link:
        return _stacked(x, layers, checked, choice, compute_type, implementation)
    config = _Config(
        layers=tuple(
            _Layer(
                activation=act,
                compute_type=ct,
                d_dtype="float32" if f32_bias else dtype,
                bias_dtype=None if bias is None else dtype_name(bias),
                fused_forward=implementation == "cublaslt" or ct not in XLA_COMPUTE_TYPES or fused,
            )
            for (_, bias), (act, ct, f32_bias), fused in zip(layers, checked, choice.fused)
        ),
        fused_wgrad=implementation == "cublaslt",
    )
    kernels, biases = tuple(kernel for kernel, _ in layers), tuple(bias for _, bias in layers)
    with reverse_mode_only(_OWNER):
        if x.ndim == 1:  # one row: the op takes it as (1, K)
            return _mlp(x[None], kernels, biases, config)[0]
        return _mlp(x, kernels, biases, config)  # (each device folds its own rows, however they are split)


def _check_layers(x, layers, activations, compute_type, implementation):
    """[(activation, compute type, float32 bias)] per layer, each checked as
    ``fused_dense`` checks it; messages name the layer."""
    shape, checked = x.shape, []
    for i, ((kernel, bias), activation) in enumerate(zip(layers, activations)):
        owner, source = f"{_OWNER}: layer {i}", "x" if i == 0 else f"layer {i - 1}'s output"
        act, _, ct, f32_bias = check_layer(owner, shape, x, kernel, bias, activation, compute_type, source)
        check_implementation(implementation, ct, False, owner)
        checked.append((act, ct, f32_bias))
        shape = (*shape[:-1], kernel.shape[1])
    return checked


def _stacked(x, layers, checked, choice, compute_type, implementation):
    """No link: the stack of ``fused_dense`` calls, some layers as "cublaslt" ("auto"'s
    mid-size blocks; large ReLU layers whose mask serves the backward)."""
    h = x
    for (kernel, bias), (act, _, _), fused in zip(layers, checked, choice.fused):
        cublaslt = choice.stack or (fused and act is Activation.RELU)
        impl = "cublaslt" if cublaslt else implementation
        h = fused_dense(h, kernel, bias, activation=act, compute_type=compute_type, implementation=impl)
    return h


class _Layer(NamedTuple):
    activation: Activation | None
    compute_type: ComputeType
    d_dtype: str  # the epilog's dtype: x's, or float32 beside a float32 bias
    bias_dtype: str | None
    fused_forward: bool  # cuBLASLt's kernel and aux, or XLA's expression saving z


class _Config(NamedTuple):
    layers: tuple[_Layer, ...]
    fused_wgrad: bool  # kernel and bias gradients from one BGRADA GEMM ("cublaslt")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mlp(x, kernels, biases, config: _Config):
    return _mlp_fwd(x, kernels, biases, config)[0]


def _layer_forward(h, kernel, bias, layer: _Layer):
    """(output, aux or None): the aux in fused_dense's layout (bits, or z)."""
    act = layer.activation
    if layer.fused_forward:
        outs = fused_matmul(
            h, kernel, bias, activation=act, with_aux=act is not None,
            compute_type=layer.compute_type, d_dtype=layer.d_dtype, out_dtype=h.dtype,
        )  # fmt: skip
        return outs[0], (outs[1] if len(outs) > 1 else None)
    # XLA's expression, on the rows a fused call pads (its GEMMs are slow on unaligned rows).
    tf32 = layer.compute_type is ComputeType.COMPUTE_32F_FAST_TF32
    z = on_padded_rows(lambda *operands: _reference.plain_preactivation(*operands, tf32), h, kernel, bias)
    y = _reference.activate(z, act).astype(h.dtype)
    if act is None or ACTIVATIONS[act].aux_bits:
        return y, None  # ReLU's derivative is read from y > 0
    return y, pad_to(z.astype(layer.d_dtype), aux_padded_width(act, kernel.shape[1]))


def _mlp_fwd(x, kernels, biases, config: _Config):
    h, inputs, auxes = x, [], []
    for kernel, bias, layer in zip(kernels, biases, config.layers):
        inputs.append(h)
        h, aux = _layer_forward(h, kernel, bias, layer)
        auxes.append(aux)
    last = config.layers[-1]
    y = h if last.activation is Activation.RELU and auxes[-1] is None else None
    return h, (tuple(inputs), kernels, biases, tuple(auxes), y)  # (biases for their types)


def _output_grad(layer: _Layer, aux, y, dy, dtype):
    if layer.activation is Activation.RELU and aux is None:
        return jnp.where(y > 0, dy, jnp.zeros((), dy.dtype)).astype(dtype)
    return _reference.output_grad(aux, dy, None, layer.activation, layer.compute_type, dtype)


def _mlp_bwd(config: _Config, residuals, dy):
    inputs, kernels, biases, auxes, y_last = residuals
    layers = config.layers
    dkernels, dbiases = [], []
    dz = None  # the current layer's dz, when the layer above formed it
    for i in reversed(range(len(layers))):
        layer, h, kernel = layers[i], inputs[i], kernels[i]
        if dz is None:
            y = y_last if i == len(layers) - 1 else inputs[i + 1]
            dz = _output_grad(layer, auxes[i], y, dy, h.dtype)
        ct = layer.compute_type
        below = layers[i - 1].activation if i > 0 else None
        linked = below is not None and ACTIVATIONS[below].links  # DGELU in the dx GEMM's epilog
        dh, dkernel, dbias = layer_grads(
            h,
            dz,
            kernel,
            layer.activation,
            ct,
            layer.d_dtype,
            layer.bias_dtype,
            config.fused_wgrad,
            not linked,
        )
        dkernels.append(like(dkernel, kernel))  # each its primal's type under explicit sharding
        dbiases.append(None if dbias is None else like(dbias, biases[i]))
        if linked:  # (the fused call pads its own rows)
            (dz_below,) = fused_gelu_input_grad(dz, kernel, auxes[i - 1], compute_type=ct)
            dz = dz_below.astype(h.dtype)
        else:
            dy, dz = dh, None
    return like(dy, inputs[0]), tuple(reversed(dkernels)), tuple(reversed(dbiases))


_mlp.defvjp(_mlp_fwd, _mlp_bwd)
