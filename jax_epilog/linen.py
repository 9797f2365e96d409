"""Flax Linen layers: ``FusedDense``, ``flax.linen.Dense`` with a fused activation, and
``FusedMLP``, a stack of them differentiated as one (:func:`jax_epilog.fused_mlp`).

``FusedDense(features, activation="gelu")`` computes ``act(x @ kernel + bias)`` with
:func:`jax_epilog.fused_dense`: one cuBLASLt kernel on an NVIDIA GPU, plain JAX elsewhere.
With ``activation=None`` it is ``nn.Dense``; with ``activation="relu"``/``"gelu"`` it is
``jax.nn.relu(nn.Dense(...)(x))`` / ``jax.nn.gelu(nn.Dense(...)(x), approximate=True)``
(cuBLASLt's GELU is the tanh approximation; there is no exact-erf GELU epilog).

It is a drop-in for ``nn.Dense``:

* the same fields, defaults and field order as ``nn.Dense`` (``features``, ``use_bias``,
  ``dtype``, ``param_dtype``, ``precision``, ``kernel_init``, ``bias_init``,
  ``promote_dtype``), then ``activation``, ``compute_type`` and ``implementation``;
* the same parameters: ``"kernel"`` of shape (in, out) and ``"bias"`` of shape (out,), in
  ``param_dtype``, drawn with the same initializers in the same order, so with the same
  RNG key and the same module path ``init`` gives bit-identical parameters, and
  parameters trained with either layer load into the other unchanged;
* the same dtype promotion: inputs, kernel and bias are promoted together by
  ``promote_dtype(..., dtype=self.dtype)`` (``flax.linen.dtypes.promote_dtype`` by default),
  and the output has that dtype.

Differences from ``nn.Dense``:

* **Numerics.** Where ``implementation="auto"`` (the default) runs XLA's expression (no
  activation, float32, small layers), the result is ``nn.Dense`` + activation's own. The
  fused op (``"cublaslt"``, and ``"auto"`` on large bfloat16/float16 layers) accumulates the
  product in float32 (float64 for float64 inputs), applies the bias and activation to that
  accumulator and rounds the result to the compute dtype (once on the CPU path; see
  :func:`jax_epilog.fused_dense` for the GPU epilog's own rounding), where ``nn.Dense`` +
  activation with a bfloat16/float16 ``dtype`` rounds after the matmul, after the bias add
  and after the activation: the two differ by about one unit in the last place of the
  output dtype. In float32 they agree to rounding.
* **precision.** ``fused_dense`` takes a cuBLAS compute type, not a ``jax.lax.Precision``.
  ``precision=None`` or ``DEFAULT`` uses ``compute_type`` (default: ``COMPUTE_32F``, full
  float32 accumulation, no TF32; ``COMPUTE_64F`` for float64; note that on Ampere and newer
  GPUs ``nn.Dense`` at DEFAULT precision may use TF32: pass
  ``compute_type="COMPUTE_32F_FAST_TF32"`` for that speed). ``HIGH`` and ``HIGHEST`` (also as
  strings, or as a pair of equal values) ask for at least float32-accurate products, which
  the default compute types give; combined with a ``compute_type`` below them they raise
  ``ValueError`` when the layer is called (HIGHEST: any ``COMPUTE_32F_FAST_*`` or
  ``COMPUTE_16F*``; HIGH, which JAX also spells ``"tensorfloat32"``, admits
  ``COMPUTE_32F_FAST_TF32`` but not the 16-bit ones). Anything else (a pair of different precisions, a ``jax.lax.DotAlgorithm`` or
  ``DotAlgorithmPreset``) raises ``ValueError`` too. The global
  ``jax_default_matmul_precision`` setting is not consulted.
* **dot_general / dot_general_cls** are not fields: the GEMM *is* the fused kernel, so a
  custom dot_general (quantized matmuls, AQT, ...) cannot be honoured. Passing either raises
  ``TypeError`` (an unknown field).
* **Forward-mode autodiff** (``jax.jvp``, ``jax.jacfwd``) works with
  ``implementation="auto"`` (the default) and ``"xla"``, whose derivatives are the plain
  expression's, and raises with ``"cublaslt"`` or a 16-bit ``compute_type`` (the fused
  op is a ``jax.custom_vjp``; ``FusedMLP`` raises wherever ``fused_mlp`` does). Reverse
  mode (``jax.grad``) works in all arguments, and its result differentiates again in either
  mode (``jax.grad`` of a gradient, ``jax.hessian``); ``jax.jit``, ``jax.vmap``,
  ``nn.scan``, ``nn.vmap`` and ``nn.remat`` work.
* **Automatic names.** Linen names an unnamed submodule after its class, so in a
  ``@nn.compact`` parent ``FusedDense`` layers are ``FusedDense_0, ...`` where ``nn.Dense``
  layers are ``Dense_0, ...`` (and draw different initial values, since Linen folds the
  name into the RNG). Give the layers explicit names (``FusedDense(..., name="fc1")`` or
  attributes assigned in ``setup``) to make parameter trees interchangeable.
* The output is in the promoted dtype; a ``compute_type`` that cannot run that dtype raises
  ``ValueError`` at call time (see :func:`jax_epilog.fused_dense`).

Example::

    import flax.linen as nn
    from jax_epilog.linen import FusedDense

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = FusedDense(256, activation="relu", name="fc1")(x)
            return FusedDense(10, name="out")(x)

``FusedMLP((4 * d, d), ("gelu", None), layer_names=("fc_in", "fc_out"))`` holds the same
parameters as those two ``FusedDense`` layers with those names (and initialises them
bit-identically) and computes the same values; its backward forms the GELU layer's
gradient inside the next layer's GEMM (see :func:`jax_epilog.fused_mlp`).
"""

from __future__ import annotations

from typing import Any

try:
    import flax.linen as nn
    from flax.linen import dtypes as _flax_dtypes
    from flax.linen.linear import default_kernel_init as _default_kernel_init
except ImportError as _exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(f"jax_epilog.linen needs Flax: pip install 'jax_epilog[flax]' ({_exc})") from _exc

import jax.numpy as jnp

from ._dense import fused_dense
from ._epilogs import Activation
from ._flax import check_fp8_recipe, check_layer_options, fp8_state, resolve_compute_type
from ._mlp import fused_mlp

__all__ = ["OVERWRITE_WITH_GRADIENT", "FusedDense", "FusedMLP"]

# Flax's collection for FP8 scaling state, whose gradient is its next value.
OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


def _fp8_state(module: nn.Module, recipe):
    def variable(name, init, shape):
        return module.variable(OVERWRITE_WITH_GRADIENT, name, init, shape, jnp.float32).value

    return fp8_state(variable, recipe)


class FusedDense(nn.Module):
    """``act(x @ kernel + bias)`` over the last axis: ``nn.Dense`` plus a fused activation.

    Attributes:
      features: the number of output features.
      use_bias: whether to add a bias to the output (default: True).
      dtype: the dtype of the computation (default: inferred from inputs and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: None, or ``jax.lax.Precision.DEFAULT``/``HIGH``/``HIGHEST`` (see the module
        docstring: the fused kernel's accumulation is set by ``compute_type``).
      kernel_init: initializer for the (in, out) kernel (default: ``nn.Dense``'s, LeCun
        normal).
      bias_init: initializer for the bias (default: zeros).
      promote_dtype: promotes ``(inputs, kernel, bias)`` to a common dtype (default:
        ``flax.linen.dtypes.promote_dtype``); the results must satisfy ``fused_dense``'s
        dtype rules (kernel in the inputs' dtype; bias in it or float32 with half inputs).
      activation: None, ``"relu"`` or ``"gelu"`` (tanh approximation).
      compute_type: the cuBLAS compute type (a ``jax_epilog.ComputeType`` or nvmath
        ``MatmulComputeType`` member or its name); None for the default (``COMPUTE_32F``,
        ``COMPUTE_64F`` for float64).
      implementation: ``"auto"``, ``"cublaslt"`` or ``"xla"``, as for ``fused_dense``
        (``"auto"``: the fused kernel where it measured faster, XLA elsewhere).
      fp8: None, or a ``jax_epilog.fp8`` recipe: the GEMMs in FP8, the scaling state in the
        ``_overwrite_with_gradient`` collection under Flax's ``fp8_ops`` names.
    """

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = _default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    promote_dtype: Any = _flax_dtypes.promote_dtype
    activation: str | Activation | None = None
    compute_type: Any = None
    implementation: str = "auto"
    fp8: Any = None

    def __post_init__(self):
        check_layer_options(self.activation, self.implementation, "FusedDense")
        check_fp8_recipe(self.fp8, "FusedDense")
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs):
        """Applies ``act(inputs @ kernel + bias)`` along the last dimension of ``inputs``."""
        kernel = self.param(
            "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
        )
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        )
        inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
        compute_type = resolve_compute_type(self.precision, self.compute_type, inputs.dtype, "FusedDense")
        if self.fp8 is not None:
            state = _fp8_state(self, self.fp8)
            return fused_dense(inputs, kernel, bias, activation=self.activation, fp8=state)[0]
        return fused_dense(
            inputs, kernel, bias, activation=self.activation, compute_type=compute_type,
            implementation=self.implementation,
        )  # fmt: skip


class _DenseParams(nn.Module):
    """A dense layer's parameters, as ``FusedDense`` makes them (same names, shapes, order)."""

    features: int
    use_bias: bool
    param_dtype: Any
    kernel_init: Any
    bias_init: Any
    fp8: Any = None

    @nn.compact
    def __call__(self, in_features: int):
        kernel = self.param("kernel", self.kernel_init, (in_features, self.features), self.param_dtype)
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
        )
        return kernel, bias, (None if self.fp8 is None else _fp8_state(self, self.fp8))


class FusedMLP(nn.Module):
    """``FusedDense`` layers in sequence, as :func:`jax_epilog.fused_mlp`: the same values,
    and a backward that fuses each GELU layer's derivative into the next layer's GEMM.

    Attributes:
      features: output features of each layer, e.g. ``(4 * d, d)``.
      activations: one per layer: None, ``"relu"`` or ``"gelu"`` (tanh approximation).
      layer_names: the parameter collections' names, one per layer (default
        ``layers_0, layers_1, ...``); each holds ``"kernel"`` and ``"bias"`` exactly as a
        ``FusedDense`` of that name would.
      use_bias, dtype, param_dtype, precision, kernel_init, bias_init, promote_dtype,
      compute_type, implementation, fp8: as for ``FusedDense``, for every layer (each
        layer's FP8 state sits beside its parameters, as a ``FusedDense``'s does).
    """

    features: Any
    activations: Any
    layer_names: Any = None
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Any = _default_kernel_init
    bias_init: Any = nn.initializers.zeros_init()
    promote_dtype: Any = _flax_dtypes.promote_dtype
    compute_type: Any = None
    implementation: str = "auto"
    fp8: Any = None

    def __post_init__(self):
        for activation in self.activations:
            check_layer_options(activation, self.implementation, "FusedMLP")
        check_fp8_recipe(self.fp8, "FusedMLP")
        super().__post_init__()

    @nn.compact
    def __call__(self, inputs):
        features = tuple(self.features)
        names = tuple(self.layer_names or (f"layers_{i}" for i in range(len(features))))
        if len(names) != len(features):
            raise ValueError(f"FusedMLP: {len(names)} layer_names for {len(features)} layers.")
        layers, in_features = [], jnp.shape(inputs)[-1]
        for width, name in zip(features, names):
            params = _DenseParams(
                width, self.use_bias, self.param_dtype, self.kernel_init, self.bias_init, self.fp8, name=name
            )
            layers.append(params(in_features))
            in_features = width
        promoted = [self.promote_dtype(inputs, kernel, bias, dtype=self.dtype) for kernel, bias, _ in layers]
        x = promoted[0][0]
        compute_type = resolve_compute_type(self.precision, self.compute_type, x.dtype, "FusedMLP")
        if self.fp8 is not None:
            pairs, states = [(kernel, bias) for _, kernel, bias in promoted], [s for *_, s in layers]
            return fused_mlp(x, pairs, self.activations, fp8=states)[0]
        return fused_mlp(
            x, [(kernel, bias) for _, kernel, bias in promoted], self.activations,
            compute_type=compute_type, implementation=self.implementation,
        )  # fmt: skip
