"""Helpers the Flax layers share (Linen and NNX): precision, constructor checks, and the
FP8 state as Flax's own FP8 layers name and shape it.

No Flax import here: ``linen.py`` and ``nnx.py`` each import their own Flax API.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np

from ._checks import check_activation, check_implementation
from ._epilogs import ComputeType
from .fp8._recipes import DenseState, TensorScale, check_recipe

__all__ = ["FP8_TENSORS", "check_fp8_recipe", "check_layer_options", "fp8_state", "resolve_compute_type"]

# (DenseState field, the variables' name prefix): Flax's fp8_ops names for x, the kernel and
# the output gradient, and one more for the output (the scale of an FP8 output).
FP8_TENSORS = (("x", "input"), ("kernel", "kernel"), ("output", "output"), ("grad", "output_grad"))


# Compute types below what each precision asks for. HIGH is also spelled "tensorfloat32" in
# JAX, so it admits TF32 products, but not 16-bit ones; HIGHEST admits only full precision.
_BELOW_HIGH = frozenset(
    {
        ComputeType.COMPUTE_16F,
        ComputeType.COMPUTE_16F_PEDANTIC,
        ComputeType.COMPUTE_32F_FAST_16F,
        ComputeType.COMPUTE_32F_FAST_16BF,
    }
)
_TOO_LOW = {
    jax.lax.Precision.HIGH: _BELOW_HIGH,
    jax.lax.Precision.HIGHEST: _BELOW_HIGH | {ComputeType.COMPUTE_32F_FAST_TF32},
}


def _precision_enum(value, owner: str) -> jax.lax.Precision:
    if isinstance(value, jax.lax.Precision):
        return value
    if isinstance(value, str):
        try:
            return jax.lax.Precision(value)
        except ValueError:
            pass
    raise ValueError(
        f"{owner}: precision {value!r} is not supported; fused_dense takes a cuBLAS compute "
        "type instead of a jax.lax.Precision: use precision=None (or DEFAULT, HIGH, HIGHEST) "
        "and pick the accumulation with compute_type=..."
    )


def resolve_compute_type(precision, compute_type, dtype, owner: str):
    """The ``compute_type`` to pass to ``fused_dense`` for a layer's ``precision``.

    ``dtype`` is the promoted operand dtype. Raises ValueError for a precision the fused
    kernel cannot honour; leaves the validation of ``compute_type`` itself to fused_dense.
    """
    if precision is None:
        return compute_type
    if isinstance(precision, (tuple, list)):
        if len(precision) != 2:
            raise ValueError(f"{owner}: precision {precision!r} must be one value or a pair.")
        lhs, rhs = (_precision_enum(p, owner) for p in precision)
        if lhs != rhs:
            raise ValueError(
                f"{owner}: precision {precision!r} asks for different precisions for the "
                "inputs and the kernel; the fused kernel has one compute type for both."
            )
        prec = lhs
    else:
        prec = _precision_enum(precision, owner)
    if prec == jax.lax.Precision.DEFAULT or compute_type is None:
        # HIGH/HIGHEST without a compute type: the default (COMPUTE_32F, or COMPUTE_64F for
        # float64) accumulates at full precision, at least what either asks for.
        return compute_type
    name = compute_type if isinstance(compute_type, str) else getattr(compute_type, "name", None)
    known = isinstance(compute_type, (str, enum.Enum)) and name in ComputeType.__members__
    if known and ComputeType[name] in _TOO_LOW[prec]:
        raise ValueError(
            f"{owner}: precision={prec.name} asks for more accurate products than "
            f"compute_type={name} gives ({name} computes at reduced precision for "
            f"{np.dtype(dtype).name} operands); drop one of the two."
        )
    return compute_type


def check_layer_options(activation, implementation, owner: str) -> None:
    """Check a layer's activation and implementation when it is built, not first called."""
    check_activation(activation, owner)
    check_implementation(implementation, ComputeType.COMPUTE_32F, False, owner)


def check_fp8_recipe(recipe, owner: str) -> None:
    check_recipe(recipe, owner, "fp8", none_allowed=True)


def fp8_state(variable, recipe) -> DenseState:
    """A layer's ``DenseState`` from its variables: ``variable(name, init, shape)`` returns
    the value of the float32 variable ``name`` (made with ``init(shape, float32)`` the first
    time). As Flax's ``fp8_ops``: ``<tensor>_scale`` of shape (1,), ones, and
    ``<tensor>_amax_history`` of shape (history_length,), zeros."""
    tensors = {}
    for field, name in FP8_TENSORS:
        scale = variable(f"{name}_scale", jnp.ones, (1,))
        history = variable(f"{name}_amax_history", jnp.zeros, (recipe.history_length,))
        tensors[field] = TensorScale(scale.reshape(()), history)
    return DenseState(**tensors, recipe=recipe)
