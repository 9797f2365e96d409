"""FP8 per-tensor scaling for ``fused_dense`` and ``fused_mlp``.

Example::

    from jax_epilog import fp8, fused_dense

    state = fp8.init(fp8.DelayedScaling())  # or fp8.CurrentScaling()
    y, state = fused_dense(x, kernel, bias, activation="gelu", fp8=state)

In training, differentiate with respect to the state too: its "gradient" is the next state,
the gradient tensor's scaling included (Flax's ``_overwrite_with_gradient`` convention).
Recipes, numerics and what is fused where: ``docs/fp8.md``.
"""

from ._quant import Quantized, dequantize, quantize
from ._recipes import (
    E4M3,
    E5M2,
    CurrentScaling,
    DelayedScaling,
    DenseState,
    Recipe,
    TensorScale,
    fp8_max,
    init,
)

__all__ = [
    "E4M3",
    "E5M2",
    "CurrentScaling",
    "DelayedScaling",
    "DenseState",
    "Quantized",
    "Recipe",
    "TensorScale",
    "dequantize",
    "fp8_max",
    "init",
    "quantize",
]
