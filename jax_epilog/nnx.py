"""Flax NNX layer: ``FusedLinear``, ``flax.nnx.Linear`` with a fused activation.

``FusedLinear(in_features, out_features, activation="gelu", rngs=rngs)`` computes
``act(x @ kernel + bias)`` with :func:`jax_epilog.fused_dense`: one cuBLASLt kernel on an
NVIDIA GPU, plain JAX elsewhere. With ``activation=None`` it is ``nnx.Linear``; with
``"relu"``/``"gelu"`` it is ``jax.nn.relu(linear(x))`` / ``jax.nn.gelu(linear(x),
approximate=True)`` (cuBLASLt's GELU is the tanh approximation).

It is a drop-in for ``nnx.Linear``:

* the same constructor (``in_features, out_features, *, use_bias, dtype, param_dtype,
  precision, kernel_init, bias_init, promote_dtype, rngs, kernel_metadata, bias_metadata``),
  plus keyword-only ``activation``, ``compute_type`` and ``implementation``;
* the same state: ``kernel`` (in, out) and ``bias`` (out,) as ``nnx.Param`` (``bias`` is
  ``None`` without a bias), drawn from ``rngs.params()`` in the same order with the same
  default initializers, so the same ``Rngs`` seed gives bit-identical parameters and
  ``nnx.state``/``nnx.update`` (or ``nnx.to_pure_dict``/``nnx.replace_by_pure_dict``) move
  parameters between the two layers unchanged;
* the same attributes (``in_features``, ``out_features``, ``use_bias``, ``dtype``,
  ``param_dtype``, ``precision``, ``promote_dtype``) and the same dtype promotion
  (``flax.nnx.nn.dtypes.promote_dtype((inputs, kernel, bias), dtype=self.dtype)``).

Not honoured (and therefore not accepted: passing one raises ``TypeError``):
``dot_general`` (the GEMM is the fused kernel), ``preferred_element_type`` (the output is
always in the promoted dtype; the accumulation is float32, or float64 for float64) and
``__call__``'s ``out_sharding``. ``precision`` follows the rules of
:mod:`jax_epilog.linen`: None/DEFAULT use ``compute_type``; HIGH/HIGHEST are met by the
default full-precision compute types and raise ``ValueError`` at call time beside a
``compute_type`` below them; anything else raises ``ValueError``. Forward-mode
autodiff (``jax.jvp``) works as in :mod:`jax_epilog.linen` (with ``"auto"`` and
``"xla"``; ``"cublaslt"`` raises); ``jax.grad`` (its result differentiates again), ``nnx.jit``, ``nnx.grad``, ``nnx.vmap``,
``nnx.scan`` and ``nnx.remat`` work. Numerics: ``nnx.Linear`` + activation's own where
``"auto"`` runs XLA's expression; the fused op differs from it in half precision by about
one unit in the last place (one rounding instead of three; see :mod:`jax_epilog.linen`).

Example::

    from flax import nnx
    from jax_epilog.nnx import FusedLinear

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.fc1 = FusedLinear(784, 256, activation="relu", rngs=rngs)
            self.out = FusedLinear(256, 10, rngs=rngs)

        def __call__(self, x):
            return self.out(self.fc1(x))
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

try:
    from flax import nnx
    from flax.nnx.nn import dtypes as _nnx_dtypes
    from flax.nnx.nn.linear import default_bias_init as _default_bias_init
    from flax.nnx.nn.linear import default_kernel_init as _default_kernel_init
except ImportError as _exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(f"jax_epilog.nnx needs Flax: pip install 'jax_epilog[flax]' ({_exc})") from _exc

import jax.numpy as jnp

from ._dense import fused_dense
from ._epilogs import Activation
from ._flax import check_fp8_recipe, check_layer_options, fp8_state, resolve_compute_type
from ._mlp import fused_mlp

__all__ = ["FusedLinear", "FusedMLP", "OverwriteWithGradient", "apply_fp8_gradients"]


class OverwriteWithGradient(nnx.Variable):
    """FP8 scaling state: its gradient is its next value (Linen's ``_overwrite_with_gradient``
    collection, as a variable type). Differentiate with respect to it beside the parameters
    and assign the gradient (``apply_fp8_gradients``); never hand it to an optimizer."""


def apply_fp8_gradients(model: nnx.Module, grads: nnx.State) -> None:
    """Set every ``OverwriteWithGradient`` variable of ``model`` to its gradient in ``grads``.

    Example::

        wrt = nnx.DiffState(0, nnx.Any(nnx.Param, OverwriteWithGradient))
        grads = nnx.grad(loss_fn, argnums=wrt)(model, batch)
        optimizer.update(model, nnx.filter_state(grads, nnx.Param))
        apply_fp8_gradients(model, grads)
    """
    nnx.update(model, nnx.filter_state(grads, OverwriteWithGradient))


def _fp8_variables(recipe) -> nnx.Dict:
    made = {}

    def variable(name, init, shape):
        made[name] = OverwriteWithGradient(init(shape, jnp.float32))
        return made[name][...]

    fp8_state(variable, recipe)
    return nnx.Dict(made)


class FusedLinear(nnx.Module):
    """``act(x @ kernel + bias)`` over the last axis: ``nnx.Linear`` plus a fused activation.

    Args:
      in_features: the number of input features.
      out_features: the number of output features.
      use_bias: whether to add a bias to the output (default: True).
      dtype: the dtype of the computation (default: inferred from inputs and params).
      param_dtype: the dtype passed to parameter initializers (default: float32).
      precision: None, or ``jax.lax.Precision.DEFAULT``/``HIGH``/``HIGHEST`` (see the module
        docstring).
      kernel_init: initializer for the (in, out) kernel (default: ``nnx.Linear``'s).
      bias_init: initializer for the bias (default: zeros).
      promote_dtype: promotes ``(inputs, kernel, bias)`` to a common dtype (default:
        ``flax.nnx.nn.dtypes.promote_dtype``).
      rngs: the ``nnx.Rngs`` to draw the parameters from (``rngs.params()``).
      kernel_metadata, bias_metadata: metadata set on the ``nnx.Param`` (e.g. sharding).
      activation: None, ``"relu"`` or ``"gelu"`` (tanh approximation).
      compute_type: the cuBLAS compute type (a ``jax_epilog.ComputeType`` or nvmath
        ``MatmulComputeType`` member or its name); None for the default.
      implementation: ``"auto"``, ``"cublaslt"`` or ``"xla"``, as for ``fused_dense``.
      fp8: None, or a ``jax_epilog.fp8`` recipe: the GEMMs in FP8, the scaling state in
        ``self.fp8_meta`` as ``OverwriteWithGradient`` variables named as Flax's ``fp8_ops``
        names them (``input_scale``, ``input_amax_history``, ...).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Any = _default_kernel_init,
        bias_init: Any = _default_bias_init,
        promote_dtype: Any = _nnx_dtypes.promote_dtype,
        rngs: nnx.Rngs,
        kernel_metadata: Any = MappingProxyType({}),
        bias_metadata: Any = MappingProxyType({}),
        activation: str | Activation | None = None,
        compute_type: Any = None,
        implementation: str = "auto",
        fp8: Any = None,
    ):
        check_layer_options(activation, implementation, "FusedLinear")
        check_fp8_recipe(fp8, "FusedLinear")
        kernel_key = rngs.params()
        self.kernel = nnx.Param(
            kernel_init(kernel_key, (in_features, out_features), param_dtype), **kernel_metadata
        )
        self.bias: nnx.Param | None
        if use_bias:
            bias_key = rngs.params()
            self.bias = nnx.Param(bias_init(bias_key, (out_features,), param_dtype), **bias_metadata)
        else:
            self.bias = nnx.data(None)

        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.precision = precision
        self.promote_dtype = promote_dtype
        self.activation = activation
        self.compute_type = compute_type
        self.implementation = implementation
        self.fp8 = fp8
        self.fp8_meta = _fp8_variables(fp8) if fp8 is not None else nnx.data(None)

    def fp8_state(self):
        """This layer's ``jax_epilog.fp8.DenseState`` (None without ``fp8``)."""
        if self.fp8 is None:
            return None
        return fp8_state(lambda name, init, shape: self.fp8_meta[name][...], self.fp8)

    def __call__(self, inputs):
        """Applies ``act(inputs @ kernel + bias)`` along the last dimension of ``inputs``."""
        kernel = self.kernel[...]
        bias = self.bias[...] if self.bias is not None else None
        inputs, kernel, bias = self.promote_dtype((inputs, kernel, bias), dtype=self.dtype)
        compute_type = resolve_compute_type(self.precision, self.compute_type, inputs.dtype, "FusedLinear")
        if self.fp8 is not None:
            return fused_dense(inputs, kernel, bias, activation=self.activation, fp8=self.fp8_state())[0]
        return fused_dense(
            inputs, kernel, bias, activation=self.activation, compute_type=compute_type,
            implementation=self.implementation,
        )  # fmt: skip


class FusedMLP(nnx.Module):
    """``FusedLinear`` layers in sequence, as :func:`jax_epilog.fused_mlp`: the same values,
    and a backward that fuses each GELU layer's derivative into the next layer's GEMM.

    Args:
      features: the input width, then each layer's output width, e.g. ``(d, 4 * d, d)``.
      activations: one per layer: None, ``"relu"`` or ``"gelu"`` (tanh approximation).
      rngs: the ``nnx.Rngs`` to draw the parameters from, layer after layer.
      **kwargs: ``FusedLinear``'s keyword arguments (``use_bias``, ``dtype``,
        ``param_dtype``, ``precision``, initializers, ``compute_type``,
        ``implementation``, ``fp8``, ...), for every layer.

    ``self.layers`` is an ``nnx.List`` of ``FusedLinear``: the same state, drawn in the same
    order, as those layers built one after the other from the same ``rngs``.
    """

    def __init__(self, features, activations, *, rngs: nnx.Rngs, **kwargs):
        features, activations = tuple(features), tuple(activations)
        for activation in activations:
            check_layer_options(activation, kwargs.get("implementation", "auto"), "FusedMLP")
        if len(features) != len(activations) + 1:
            raise ValueError(
                f"FusedMLP: features {features} must hold the input width and one width per "
                f"layer: {len(activations) + 1} entries for {len(activations)} activations."
            )
        self.layers = nnx.List(
            FusedLinear(k, n, activation=act, rngs=rngs, **kwargs)
            for k, n, act in zip(features[:-1], features[1:], activations)
        )

    def __call__(self, inputs):
        """Applies the layers in turn along the last dimension of ``inputs``."""
        first = self.layers[0]
        layers = []
        for layer in self.layers:
            bias = layer.bias[...] if layer.bias is not None else None
            x, kernel, bias = layer.promote_dtype((inputs, layer.kernel[...], bias), dtype=layer.dtype)
            layers.append((kernel, bias))
        compute_type = resolve_compute_type(first.precision, first.compute_type, x.dtype, "FusedMLP")
        activations = [layer.activation for layer in self.layers]
        if first.fp8 is not None:
            return fused_mlp(x, layers, activations, fp8=[layer.fp8_state() for layer in self.layers])[0]
        return fused_mlp(
            x, layers, activations, compute_type=compute_type, implementation=first.implementation
        )
