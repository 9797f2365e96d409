"""``Policy.fp8_fused_dz``: the FP8 backward forms, reduces and quantizes dz in one
primitive (``fp8_output_grad_p``) under delayed scaling. On a CPU the primitive lowers to
XLA's passes, so the gradients equal those of XLA's separate passes (the policy off); its
sharding rule sums the column sums and takes the largest amax over split rows; on a GPU
its Pallas kernel gives the CPU emulation's gradients."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import layer_inputs

import jax_epilog as je
from jax_epilog import fp8
from jax_epilog.primitives.fp8_output_grad import fp8_output_grad

PRIMITIVE = "jax_epilog_fp8_output_grad"


def _dense_grads(x, w, b, state, activation):
    def loss(x, w, b, state):
        y, _ = je.fused_dense(x, w, b, activation=activation, fp8=state)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.shape[-1], dtype=jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, b, state)


def _trained_state(x, w, b, activation, recipe):
    """A state after one step, so that delayed scaling's scales fit the tensors."""
    return _dense_grads(x, w, b, fp8.init(recipe), activation)[3]


def _assert_same(got, want):
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_the_one_pass_gives_xlas_passes_gradients(rng, activation):
    x, w, b = layer_inputs(rng, 67, 40, 52, jnp.bfloat16)
    state = _trained_state(x, w, b, activation, fp8.DelayedScaling(history_length=3))
    # (a new function object per policy: JAX caches the trace of one it has seen)
    jaxpr = lambda: str(jax.make_jaxpr(lambda *a: _dense_grads(*a, activation))(x, w, b, state))
    with je.override_policy(fp8_fused_dz=False):
        want = _dense_grads(x, w, b, state, activation)
        assert PRIMITIVE not in jaxpr()
    with je.override_policy(fp8_fused_dz=True):
        got = _dense_grads(x, w, b, state, activation)
        text = jaxpr()
    assert PRIMITIVE in text
    _assert_same(got, want)
    assert float(got[3].grad.amax_history[0]) > 0


def test_current_scaling_keeps_xlas_passes(rng):
    x, w, b = layer_inputs(rng, 33, 24, 40, jnp.bfloat16)
    state = fp8.init(fp8.CurrentScaling())
    loss = lambda x: je.fused_dense(x, w, b, activation="gelu", fp8=state)[0].astype(jnp.float32).sum()
    with je.override_policy(fp8_fused_dz=True):
        assert PRIMITIVE not in str(jax.make_jaxpr(jax.grad(loss))(x))


@pytest.mark.parametrize("dgelu", [False, True])
def test_an_fp8_mlp_takes_one_pass_per_layer(rng, dgelu):
    x = jnp.asarray(rng.standard_normal((45, 24)), jnp.bfloat16)
    widths = (24, 56, 40, 16)
    layers = [
        (jnp.asarray(rng.standard_normal((a, c)) / np.sqrt(a), jnp.bfloat16), jnp.asarray(rng.standard_normal(c), jnp.bfloat16))
        for a, c in itertools.pairwise(widths)
    ]  # fmt: skip
    acts = ["gelu", "relu", None]

    def loss(x, layers, states):
        y, _ = je.fused_mlp(x, layers, acts, fp8=states)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    grad = lambda: jax.jit(jax.grad(loss, argnums=(0, 1, 2)))  # (traced anew under each policy)
    states = grad()(x, layers, tuple(fp8.init(fp8.DelayedScaling(history_length=2)) for _ in acts))[2]
    with je.override_policy(fp8_dgelu=dgelu):
        with je.override_policy(fp8_fused_dz=False):
            want = grad()(x, layers, states)
        with je.override_policy(fp8_fused_dz=True):
            got = grad()(x, layers, states)
            text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, layers, states))
    assert text.count(PRIMITIVE) == 3
    _assert_same(got, want)


def test_split_rows_sum_the_bias_gradient_and_share_the_amax(rng):
    if jax.device_count() < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("rows",))
    dy = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal((64, 48)) * 2, jnp.bfloat16)
    f = jax.jit(lambda dy, z: fp8_output_grad(dy, z, jnp.float32(0.01), kind="gelu"))
    want = f(dy, z)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    got = f(jax.device_put(dy, rows), jax.device_put(z, rows))
    assert "all-reduce" in f.lower(jax.device_put(dy, rows), jax.device_put(z, rows)).compile().as_text()
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert float(got[2]) == float(want[2]) > 0


def test_explicit_sharding_types_the_gradients_as_their_primals(rng):
    from helpers import assert_gradients_like_primals, explicit_mesh_2x2
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = explicit_mesh_2x2()
    x, w, b = layer_inputs(rng, 4 * 9, 2 * 20, 2 * 24, jnp.bfloat16)
    specs = (("data",), (None, "model"), ("model",))
    args = [jax.device_put(v, NamedSharding(mesh, PartitionSpec(*s))) for v, s in zip((x, w, b), specs)]
    state = _trained_state(x, w, b, "gelu", fp8.DelayedScaling())
    loss = lambda x, w, b: jnp.sum(
        jnp.sin(je.fused_dense(x, w, b, activation="gelu", fp8=state)[0].astype(jnp.float32))
    )
    with je.override_policy(fp8_fused_dz=True):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        assert_gradients_like_primals(grad(*args), grad(x, w, b), args)


def test_a_bad_kind_is_refused():
    with pytest.raises(ValueError, match="fp8_output_grad: kind='silu'; allowed: gelu, relu, none"):
        fp8_output_grad(jnp.ones((4, 4)), None, jnp.float32(1), kind="silu")


@pytest.mark.gpu
@pytest.mark.parametrize("activation", [None, "gelu"])
def test_the_pallas_pass_gives_the_emulations_gradients_on_a_gpu(rng, activation):
    """At a shape the kernel's tile divides (dz 256 x 384), against the same step on the
    CPU (XLA's passes, ml_dtypes' rounding). The loss's weights, cos(column), put whole
    columns of dy at the same value, some in E5M2's top binade (one step 8192 there): a
    pass that rounded those wrongly would be off by a sixth of a column. Elsewhere the GEMMs'
    summation order, and GELU's tail (one E5M2 step), leave a few per cent."""
    x, w, b = layer_inputs(rng, 256, 200, 384, jnp.bfloat16)
    state = _trained_state(x, w, b, activation, fp8.DelayedScaling())
    cpu = jax.device_put((x, w, b, state), jax.devices("cpu")[0])
    with je.override_policy(fp8_fused_dz=True):
        got = _dense_grads(x, w, b, state, activation)
        want = _dense_grads(*cpu, activation)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        r = np.asarray(r, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), r, rtol=0.02, atol=0.02 * np.abs(r).max())
