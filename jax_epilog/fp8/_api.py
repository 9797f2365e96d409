"""``fused_dense(..., fp8=state)`` and ``fused_mlp(..., fp8=states)``: checks and shapes."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from .._checks import check_layer, dtype_name
from .._epilogs import ComputeType
from . import _dense, _mlp
from ._quant import Quantized
from ._recipes import E4M3, DenseState

__all__ = ["FP8_INPUT_DTYPES", "check_options", "check_state", "dense_call"]

FP8_INPUT_DTYPES = ("bfloat16", "float16", "float32")


def check_state(state, owner: str, name: str = "fp8") -> DenseState:
    if not isinstance(state, DenseState):
        raise TypeError(
            f"{owner}: {name} must be a jax_epilog.fp8.DenseState (jax_epilog.fp8.init(recipe)), "
            f"got {type(state).__name__}."
        )
    return state


def check_options(owner: str, compute_type, return_aux: bool, implementation: str) -> None:
    """What an FP8 call cannot take: another accumulation, the aux, XLA's expression."""
    name = getattr(compute_type, "name", compute_type)
    if name not in (None, "COMPUTE_32F"):
        raise ValueError(
            f"{owner}: fp8 GEMMs accumulate in float32; compute_type={compute_type!r} is not "
            f"allowed with fp8; allowed: [None, {ComputeType.COMPUTE_32F.name!r}]."
        )
    if return_aux:
        raise ValueError(f"{owner}: return_aux=True is not available with fp8; allowed: return_aux=False.")
    if implementation not in ("auto", "cublaslt"):
        raise ValueError(
            f"{owner}: implementation={implementation!r} with fp8; allowed: ('auto', 'cublaslt') "
            "(XLA's own FP8 path is Flax's fp8_ops)."
        )


def _check_inputs(owner: str, x, kernel, bias, activation):
    """(activation, the output's dtype) for an FP8 layer; x may be Quantized (E4M3)."""
    data = x.data if isinstance(x, Quantized) else x
    if isinstance(x, Quantized) and dtype_name(x.data) != E4M3.name:
        raise TypeError(f"{owner}: a Quantized x must hold float8_e4m3fn data, got {dtype_name(x.data)}.")
    dtype = dtype_name(kernel)
    if dtype not in FP8_INPUT_DTYPES:
        raise TypeError(f"{owner}: with fp8 the kernel has dtype {dtype}; allowed: {FP8_INPUT_DTYPES}.")
    dtype_of_x = kernel if isinstance(x, Quantized) else x  # (FP8 data: the kernel's dtype rules)
    act, *_ = check_layer(owner, data.shape, dtype_of_x, kernel, bias, activation, None)
    return act, dtype


def dense_call(x, kernel, bias, activation, state, fp8_output: bool, owner: str = "fused_dense"):
    """One FP8 layer on x of any leading shape: (y, new state), y Quantized for an FP8 output."""
    check_state(state, owner)
    act, dtype = _check_inputs(owner, x, kernel, bias, activation)
    if not isinstance(fp8_output, bool | np.bool_):
        raise TypeError(f"{owner}: fp8_output must be True or False, got {fp8_output!r}.")
    data = x.data if isinstance(x, Quantized) else x
    lead, k = data.shape[:-1], data.shape[-1]
    rows = data.reshape(math.prod(lead), k)
    layer = _dense.Layer(
        activation=act, out_dtype=E4M3.name if fp8_output else dtype, x_dtype=dtype,
        kernel_dtype=dtype, bias_dtype=None if bias is None else dtype_name(bias),
    )  # fmt: skip
    n = kernel.shape[1]
    if isinstance(x, Quantized) or fp8_output:  # forward only: FP8 data has no gradient here
        quantized_x = Quantized(rows, x.scale) if isinstance(x, Quantized) else rows
        fwd = _dense.forward(quantized_x, kernel, bias, state, layer, with_aux=False)
        y = fwd.y.reshape(*lead, n)
        return (Quantized(y, fwd.out_scale) if fp8_output else y), fwd.state
    y, new_state = _dense.dense(rows, kernel, bias, state, layer)
    return y.reshape(*lead, n), new_state


def mlp_call(x, layers, activations, states, owner: str = "fused_mlp"):
    """The FP8 block on x of any leading shape: (y, new states)."""
    if isinstance(states, DenseState) or not isinstance(states, Sequence) or len(states) != len(layers):
        raise TypeError(
            f"{owner}: fp8 must be a sequence of one jax_epilog.fp8.DenseState per layer "
            f"({len(layers)}), got {type(states).__name__}."
        )
    states = tuple(check_state(s, owner, f"fp8[{i}]") for i, s in enumerate(states))
    specs, width = [], x.shape[-1]
    for i, ((kernel, bias), activation) in enumerate(zip(layers, activations)):
        h = x if i == 0 else jax.ShapeDtypeStruct((*x.shape[:-1], width), x.dtype)
        act, dtype = _check_inputs(f"{owner} (layer {i})", h, kernel, bias, activation)
        if kernel.shape[0] != width:
            raise ValueError(
                f"{owner}: layer {i}'s kernel has K={kernel.shape[0]}; the layer before gives {width}."
            )
        width = kernel.shape[1]
        last = i == len(layers) - 1
        specs.append(_dense.Layer(
            activation=act, out_dtype=dtype if last else E4M3.name, x_dtype=dtype, kernel_dtype=dtype,
            bias_dtype=None if bias is None else dtype_name(bias),
        ))  # fmt: skip
    lead = x.shape[:-1]
    kernels, biases = tuple(k for k, _ in layers), tuple(b for _, b in layers)
    y, new = _mlp.mlp(
        x.reshape(math.prod(lead), x.shape[-1]), kernels, biases, states, _mlp.Block(tuple(specs))
    )
    return y.reshape(*lead, width), new
