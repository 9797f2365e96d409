"""Per-tensor FP8 scaling: the recipes, the state they keep, and how it updates.

A tensor ``x`` is stored in FP8 as ``q = saturate(x / scale)``, so that ``x ≈ q * scale``:
``scale`` is the dequantization factor, as in Flax's ``fp8_ops`` (Transformer Engine keeps
its reciprocal). A good scale maps the tensor's largest magnitude, its *amax*, to the
format's largest finite value, less ``margin`` powers of two of headroom:
``scale = amax * 2**margin / fp8_max``.

* ``DelayedScaling`` takes amax from a history of earlier steps: this step's tensor is
  quantized with a scale from the history before it, and its own amax, which the same pass
  (or the GEMM's epilog) produces, joins the history for the next step. No extra pass over
  the data.
* ``CurrentScaling`` takes amax from this step's tensor: one extra read of the tensor
  before it is quantized. An output that the GEMM itself writes in FP8 cannot be scaled by
  an amax that does not exist yet; it always uses the delayed rule (its history holds the
  previous steps' amax).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

__all__ = [
    "E4M3",
    "E5M2",
    "CurrentScaling",
    "DelayedScaling",
    "DenseState",
    "Recipe",
    "TensorScale",
    "check_recipe",
    "fp8_max",
    "init",
    "next_scale",
    "push_amax",
]

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)  # activations and weights
E5M2 = np.dtype(ml_dtypes.float8_e5m2)  # gradients


def fp8_max(dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).max)


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Scales from the amax of earlier steps (Flax's and Transformer Engine's default).

    Attributes:
      history_length: how many steps of amax each tensor remembers.
      margin: powers of two of headroom below the format's largest value.
      amax_compute: ``"max"`` (the largest amax in the history) or ``"most_recent"``.
    """

    history_length: int = 1024
    margin: float = 0.0
    amax_compute: str = "max"

    def __post_init__(self):
        _check_recipe(self, self.margin)
        if not isinstance(self.history_length, int) or self.history_length < 1:
            raise ValueError(f"DelayedScaling: history_length={self.history_length!r}; allowed: an int >= 1.")
        if self.amax_compute not in ("max", "most_recent"):
            raise ValueError(
                f"DelayedScaling: amax_compute={self.amax_compute!r}; allowed: 'max', 'most_recent'."
            )


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Scales from this step's amax (one extra read of each input and gradient).

    Attributes:
      margin: powers of two of headroom below the format's largest value.
      history_length: steps of amax kept for FP8 outputs, which use the delayed rule.
    """

    margin: float = 0.0
    history_length: int = 16
    amax_compute: str = "max"

    def __post_init__(self):
        _check_recipe(self, self.margin)


Recipe = DelayedScaling | CurrentScaling


def check_recipe(recipe, owner: str, name: str, none_allowed: bool = False) -> None:
    """Raise TypeError unless ``recipe`` is a recipe (or None, where ``none_allowed``)."""
    if (recipe is None and none_allowed) or isinstance(recipe, DelayedScaling | CurrentScaling):
        return
    allowed = "None, " if none_allowed else ""
    raise TypeError(
        f"{owner}: {name}={recipe!r}; allowed: {allowed}jax_epilog.fp8.DelayedScaling(...), "
        "jax_epilog.fp8.CurrentScaling(...)."
    )


def _check_recipe(recipe, margin) -> None:
    if not isinstance(margin, int | float) or not np.isfinite(margin):
        raise ValueError(f"{type(recipe).__name__}: margin={margin!r}; allowed: a finite number.")


class TensorScale(NamedTuple):
    """One tensor's scaling state: its dequantization ``scale`` (float32 scalar) and the
    amax of its last steps (float32, newest first)."""

    scale: jax.Array
    amax_history: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseState:
    """The FP8 state of one dense layer: a ``TensorScale`` for each tensor it quantizes,
    and its recipe (static: part of the pytree's structure, not a leaf).

    ``x`` and ``kernel`` are the GEMM's inputs, ``output`` its result (used when the
    layer writes FP8, and the amax of what it writes), ``grad`` the output gradient.
    """

    x: TensorScale
    kernel: TensorScale
    output: TensorScale
    grad: TensorScale
    recipe: Recipe = dataclasses.field(metadata={"static": True}, default=DelayedScaling())

    @property
    def current(self) -> bool:
        return isinstance(self.recipe, CurrentScaling)


def _tensor(length: int) -> TensorScale:
    return TensorScale(jnp.ones((), jnp.float32), jnp.zeros((length,), jnp.float32))


def init(recipe: Recipe | None = None) -> DenseState:
    """A fresh state for one layer: every scale 1, every history zeros (as Flax starts).

    Example::

        state = jax_epilog.fp8.init(jax_epilog.fp8.DelayedScaling(history_length=16))
        y, state = jax_epilog.fused_dense(x, kernel, bias, activation="gelu", fp8=state)
    """
    recipe = DelayedScaling() if recipe is None else recipe
    check_recipe(recipe, "fp8.init", "recipe")
    length = recipe.history_length
    return DenseState(*(_tensor(length) for _ in range(4)), recipe=recipe)


def _amax_of(history: jax.Array, recipe: Recipe) -> jax.Array:
    return history[0] if recipe.amax_compute == "most_recent" else jnp.max(history)


def scale_for(amax: jax.Array, previous: jax.Array, dtype, margin: float) -> jax.Array:
    """The scale that maps ``amax`` to ``dtype``'s largest value less ``margin``; the
    previous scale where amax is zero or not finite (nothing to learn from)."""
    scale = amax.astype(jnp.float32) * np.float32(2.0**margin / fp8_max(dtype))
    usable = (amax > 0) & jnp.isfinite(amax)
    return jnp.where(usable, scale, previous)


def next_scale(state: TensorScale, dtype, recipe: Recipe) -> jax.Array:
    """The delayed scale for this step, from the history of the steps before it."""
    return scale_for(_amax_of(state.amax_history, recipe), state.scale, dtype, recipe.margin)


def push_amax(state: TensorScale, scale: jax.Array, amax: jax.Array) -> TensorScale:
    """The state after a step that used ``scale`` and saw ``amax`` (newest first)."""
    history = jnp.roll(state.amax_history, 1).at[0].set(amax.astype(jnp.float32))
    return TensorScale(scale.astype(jnp.float32), history)
