"""The scaling recipes: how each scale and amax history updates, and bad recipes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_epilog as je
from jax_epilog import fp8


def _layer(rng, m=37, k=24, n=40):
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    return x, w


def test_init_starts_as_flax_does():
    state = fp8.init(fp8.DelayedScaling(history_length=5))
    for t in (state.x, state.kernel, state.output, state.grad):
        assert t.scale.shape == () and float(t.scale) == 1.0
        assert t.amax_history.shape == (5,) and not np.any(np.asarray(t.amax_history))
    assert jax.tree_util.tree_structure(state) == jax.tree_util.tree_structure(
        fp8.init(fp8.DelayedScaling(5))
    )
    assert len(jax.tree_util.tree_leaves(state)) == 8  # the recipe is static


@pytest.mark.parametrize("margin", [0.0, 1.0])
def test_delayed_scaling_uses_the_history_before_this_step(rng, margin):
    x, w = _layer(rng)
    recipe = fp8.DelayedScaling(history_length=3, margin=margin)
    step = jax.jit(lambda x, s: je.fused_dense(x, w, fp8=s)[1])
    s1 = step(x, fp8.init(recipe))
    amax1 = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    # The first step's scale is the initial one (an empty history teaches nothing).
    assert float(s1.x.scale) == 1.0
    np.testing.assert_allclose(np.asarray(s1.x.amax_history), [amax1, 0, 0])
    s2 = step(2 * x, s1)
    np.testing.assert_allclose(float(s2.x.scale), amax1 * 2**margin / 448.0, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(s2.x.amax_history), [2 * amax1, amax1, 0])
    s3 = step(x, s2)  # "max": the largest amax in the history
    np.testing.assert_allclose(float(s3.x.scale), 2 * amax1 * 2**margin / 448.0, rtol=1e-6)


def test_most_recent_takes_the_newest_amax(rng):
    x, w = _layer(rng)
    step = jax.jit(lambda x, s: je.fused_dense(x, w, fp8=s)[1])
    s = step(2 * x, fp8.init(fp8.DelayedScaling(history_length=4, amax_compute="most_recent")))
    s = step(x, s)
    s = step(x, s)
    amax1 = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    np.testing.assert_allclose(float(s.x.scale), amax1 / 448.0, rtol=1e-6)


def test_current_scaling_uses_this_steps_amax(rng):
    x, w = _layer(rng)
    s = jax.jit(lambda x, s: je.fused_dense(x, w, fp8=s)[1])(x, fp8.init(fp8.CurrentScaling()))
    amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    np.testing.assert_allclose(float(s.x.scale), amax / 448.0, rtol=1e-6)
    kmax = float(jnp.max(jnp.abs(w.astype(jnp.float32))))
    np.testing.assert_allclose(float(s.kernel.scale), kmax / 448.0, rtol=1e-6)


def test_zero_or_non_finite_amax_keeps_the_previous_scale(rng):
    x, w = _layer(rng)
    state = fp8.init(fp8.CurrentScaling())
    s = je.fused_dense(jnp.zeros_like(x), w, fp8=state)[1]
    assert float(s.x.scale) == 1.0


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: fp8.DelayedScaling(history_length=0), "history_length=0"),
        (lambda: fp8.DelayedScaling(amax_compute="mean"), "amax_compute='mean'"),
        (lambda: fp8.DelayedScaling(margin=float("inf")), "margin=inf"),
        (lambda: fp8.init("delayed"), "recipe='delayed'"),
    ],
)
def test_bad_recipes_name_the_value_and_the_choices(make, match):
    with pytest.raises((TypeError, ValueError), match=match) as info:
        make()
    assert "allowed" in str(info.value)
