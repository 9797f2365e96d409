"""Argument validation at trace time, shared by ``fused_dense``, ``fused_mlp`` and the
Flax layers. Every message names the function (``owner``), the bad value and what is
allowed."""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from ._epilogs import (
    HALF_DTYPES,
    SUPPORTED_DTYPES,
    XLA_COMPUTE_TYPES,
    Activation,
    ComputeType,
    default_compute_type,
    valid_compute_types,
)

__all__ = [
    "IMPLEMENTATIONS",
    "check_activation",
    "check_array",
    "check_implementation",
    "check_layer",
    "check_pairs",
    "check_return_aux",
    "dtype_name",
    "reverse_mode_only",
]

IMPLEMENTATIONS = ("auto", "cublaslt", "xla")
_ACTIVATIONS = (None, *(a.value for a in Activation))


def check_array(value, name: str, owner: str) -> None:
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{owner}: {name} must be a JAX or NumPy array, got {type(value).__name__}")


def dtype_name(value) -> str:
    """The dtype JAX will compute in (NumPy float64 is float32 unless x64 is enabled)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(value.dtype)).name


def check_activation(value, owner: str) -> Activation | None:
    """``value`` as an ``Activation`` (None stays None)."""
    if value is None or isinstance(value, Activation):
        return value
    if isinstance(value, str) and value in _ACTIVATIONS:
        return Activation(value)
    if callable(value):  # e.g. jax.nn.relu: the epilog applies a named activation
        inner = getattr(value, "fun", None) or getattr(value, "func", None)  # custom_jvp, partial
        name = getattr(value, "__name__", None) or getattr(inner, "__name__", None)
        hint = f"; pass {name!r}" if name is not None and name in _ACTIVATIONS else ""
        raise TypeError(
            f"{owner}: activation must be a name, not a function ({value!r}){hint}; allowed: {_ACTIVATIONS}."
        )
    hint = ""
    if isinstance(value, str) and "gelu" in value.lower():
        hint = (
            " cuBLASLt's only GELU is the tanh approximation (activation='gelu'); for the exact"
            " erf GELU apply jax.nn.gelu(y, approximate=False) to the layer's output with activation=None."
        )
    raise ValueError(f"{owner}: unknown activation {value!r}; allowed: {_ACTIVATIONS}.{hint}")


def _compute_type(value, dtype: str, f32_bias: bool, owner: str) -> ComputeType:
    valid = valid_compute_types(dtype, f32_bias)
    if value is None:
        return default_compute_type(dtype)
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if not isinstance(value, (str, enum.Enum)) or name not in ComputeType.__members__:
        raise ValueError(
            f"{owner}: unknown compute_type {value!r}; pass a MatmulComputeType or its "
            f"name; allowed for {dtype} operands: {[c.name for c in valid]}."
        )
    ct = ComputeType[name]
    if ct not in valid:
        bias_note = " with a float32 bias" if f32_bias else ""
        raise ValueError(
            f"{owner}: compute_type {ct.name} cannot run {dtype} operands{bias_note}; "
            f"allowed: {[c.name for c in valid]}."
        )
    return ct


def _check_dtypes(owner: str, x, kernel, bias, x_name: str) -> tuple[str, bool]:
    """(the operands' dtype, whether the bias is float32 beside half operands)."""
    dtype = dtype_name(x)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{owner}: {x_name} has dtype {dtype}; allowed: {SUPPORTED_DTYPES}.")
    if dtype_name(kernel) != dtype:
        raise TypeError(
            f"{owner}: kernel dtype {dtype_name(kernel)} differs from {x_name} dtype {dtype}; "
            "cast one of them so both match."
        )
    if bias is None:
        return dtype, False
    b_dtype = dtype_name(bias)
    f32_bias = dtype in HALF_DTYPES and b_dtype == "float32"
    if b_dtype != dtype and not f32_bias:
        allowed = [dtype, "float32"] if dtype in HALF_DTYPES else [dtype]
        raise TypeError(f"{owner}: bias dtype {b_dtype} does not fit {dtype} operands; allowed: {allowed}.")
    return dtype, f32_bias


def _check_shapes(owner: str, x_shape, kernel, bias, x_name: str) -> None:
    if len(x_shape) < 1:
        raise ValueError(f"{owner}: {x_name} must have shape (..., K), got a scalar of shape {x_shape}.")
    if kernel.ndim != 2:
        raise ValueError(f"{owner}: kernel must have shape (K, N), got shape {kernel.shape}.")
    k, n = kernel.shape
    if x_shape[-1] != k:
        raise ValueError(
            f"{owner}: {x_name}'s last dimension {x_shape[-1]} (shape {x_shape}) must equal "
            f"kernel's first dimension K={k} (shape {kernel.shape})."
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{owner}: bias must have shape (N,) = ({n},), got shape {bias.shape}.")


def check_layer(owner: str, x_shape, x, kernel, bias, activation, compute_type, x_name: str = "x"):
    """Validate one dense layer; returns (activation, dtype name, compute type, whether the
    bias is float32 beside half operands). ``x`` is anything with the input's dtype."""
    check_array(kernel, "kernel", owner)
    if bias is not None:
        check_array(bias, "bias", owner)
    act = check_activation(activation, owner)
    dtype, f32_bias = _check_dtypes(owner, x, kernel, bias, x_name)
    _check_shapes(owner, x_shape, kernel, bias, x_name)
    return act, dtype, _compute_type(compute_type, dtype, f32_bias, owner), f32_bias


def check_return_aux(value, owner: str) -> None:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{owner}: return_aux must be True or False, got {value!r}.")


def check_implementation(value, ct: ComputeType, return_aux: bool, owner: str) -> str:
    if value not in IMPLEMENTATIONS:
        raise ValueError(f"{owner}: unknown implementation {value!r}; allowed: {IMPLEMENTATIONS}.")
    if value == "xla" and return_aux:
        raise ValueError(
            f"{owner}: return_aux=True needs the epilog's aux, which implementation='xla' does "
            "not compute; allowed with return_aux: ('auto', 'cublaslt')."
        )
    if value == "xla" and ct not in XLA_COMPUTE_TYPES:
        raise ValueError(
            f"{owner}: implementation='xla' cannot accumulate as compute_type {ct.name}; "
            f"allowed: {[c.name for c in XLA_COMPUTE_TYPES]} (or implementation='cublaslt')."
        )
    return value


def check_pairs(layers, activations, owner: str) -> tuple[list, list]:
    """``fused_mlp``'s layers and activations as lists of equal length."""
    if isinstance(activations, (str, Activation)) or not isinstance(activations, Sequence):
        raise TypeError(
            f"{owner}: activations must be a sequence with one entry per layer (each None, "
            f"'relu' or 'gelu'), got {activations!r}."
        )
    if not isinstance(layers, Sequence) or not all(
        isinstance(layer, Sequence) and len(layer) == 2 for layer in layers
    ):
        raise TypeError(f"{owner}: layers must be a sequence of (kernel, bias) pairs (bias may be None).")
    if len(layers) != len(activations) or not layers:
        raise ValueError(
            f"{owner}: got {len(layers)} layers and {len(activations)} activations; "
            "pass one activation per layer, and at least one layer."
        )
    return list(layers), list(activations)


@contextlib.contextmanager
def reverse_mode_only(owner: str) -> Iterator[None]:
    """Name the function and the fix where forward-mode autodiff meets the fused op (a
    ``jax.custom_vjp``), instead of JAX's generic message."""
    try:
        yield
    except TypeError as exc:
        if "forward-mode autodiff" not in str(exc):
            raise
        raise TypeError(
            f"{owner}: forward-mode autodiff (jax.jvp, jax.jacfwd) cannot run through the fused "
            "op, which is differentiable in reverse mode only (jax.grad, jax.vjp). For forward "
            "mode use implementation='auto' (with return_aux=False and a 32- or 64-bit compute "
            "type) or implementation='xla', whose derivatives are the plain expression's."
        ) from None
