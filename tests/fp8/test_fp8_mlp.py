"""``fused_mlp(..., fp8=states)``: the chain equals its layers run one by one with an FP8
output between them, gradients follow float32, every state updates."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cuda_text, custom_calls

import jax_epilog as je
from jax_epilog import fp8


def _block(rng, m=53, widths=(40, 72, 24)):
    x = jnp.asarray(rng.standard_normal((m, widths[0])), jnp.bfloat16)
    layers = [
        (jnp.asarray(rng.standard_normal((a, b)) / np.sqrt(a), jnp.bfloat16),
         jnp.asarray(rng.standard_normal(b) * 0.3, jnp.bfloat16))
        for a, b in itertools.pairwise(widths)
    ]  # fmt: skip
    return x, layers


def _states(n, recipe=None):
    return tuple(fp8.init(recipe or fp8.DelayedScaling(history_length=3)) for _ in range(n))


@pytest.mark.parametrize("hidden", ["gelu", "relu", None])
def test_chain_equals_layers_with_an_fp8_output_between(rng, hidden):
    x, layers = _block(rng)
    states = jax.jit(lambda x, s: je.fused_mlp(x, layers, [hidden, None], fp8=s)[1])(x, _states(2))
    y, new = jax.jit(lambda x, s: je.fused_mlp(x, layers, [hidden, None], fp8=s))(x, states)
    (w1, b1), (w2, b2) = layers
    h, s1 = je.fused_dense(x, w1, b1, activation=hidden, fp8=states[0], fp8_output=True)
    y2, _s2 = je.fused_dense(h, w2, b2, fp8=states[1])
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y2, np.float32))
    np.testing.assert_array_equal(np.asarray(new[0].output.amax_history), np.asarray(s1.output.amax_history))
    # The second layer's x is the first layer's output: one state, one history.
    np.testing.assert_array_equal(np.asarray(new[1].x.amax_history), np.asarray(new[0].output.amax_history))


@pytest.mark.parametrize("dgelu", [False, True])
def test_gradients_follow_float32_and_update_every_grad_scale(rng, dgelu):
    x, layers = _block(rng, m=3 * 21)
    x = x.reshape(3, 21, -1)
    loss = lambda x, p, s: jnp.sum(je.fused_mlp(x, p, ["gelu", None], fp8=s)[0].astype(jnp.float32) ** 2)
    with je.override_policy(fp8_dgelu=dgelu):
        states = jax.grad(loss, argnums=2)(x, layers, _states(2))
        gx, gp, gs = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, layers, states)

    def exact(x, p):
        h = x.astype(jnp.float32)
        for (w, b), act in zip(p, ["gelu", None]):
            h = h @ w.astype(jnp.float32) + b.astype(jnp.float32)
            h = jax.nn.gelu(h, approximate=True) if act else h
        return jnp.sum(h**2)

    want = jax.grad(exact, argnums=(0, 1))(x, layers)
    for got, ref in zip(jax.tree.leaves((gx, gp)), jax.tree.leaves(want)):
        assert got.dtype == jnp.bfloat16 and got.shape == ref.shape
        assert np.linalg.norm(np.asarray(got, np.float32) - np.asarray(ref)) <= 0.1 * np.linalg.norm(
            np.asarray(ref)
        )
    assert all(float(s.grad.amax_history[0]) > 0 for s in gs)


def test_bad_states_raise(rng):
    x, layers = _block(rng)
    with pytest.raises(TypeError, match="one jax_epilog.fp8.DenseState per layer \\(2\\)"):
        je.fused_mlp(x, layers, ["gelu", None], fp8=_states(1))
    with pytest.raises(TypeError, match="fp8\\[1\\] must be"):
        je.fused_mlp(x, layers, ["gelu", None], fp8=(fp8.init(), "x"))


@pytest.mark.parametrize("dgelu", [False, True])
def test_the_gpu_program_is_six_fp8_gemms_and_no_other_gemm(rng, cublaslt_accepts, dgelu):
    """On a GPU a two-layer FP8 block's step is its six FP8 GEMMs: four custom calls (the
    chain's first one writing GELU's output in E4M3 with the aux; with ``fp8_dgelu`` an
    input gradient applying GELU's derivative) and the kernel gradients, XLA's FP8 GEMMs."""
    x, layers = _block(rng, m=64, widths=(48, 80, 32))
    loss = lambda x, p, s: jnp.sum(je.fused_mlp(x, p, ["gelu", None], fp8=s)[0].astype(jnp.float32) ** 2)
    with je.override_policy(fp8_dgelu=dgelu):
        text = cuda_text(jax.grad(loss, argnums=(0, 1, 2)), x, layers, _states(2))
    calls = custom_calls(text)
    epilogs = [re.search(r'epilog = "(\w+)"', call)[1] for call in calls]
    d_dtypes = [re.search(r'd_dtype = "(\w+)"', call)[1] for call in calls]
    last = "DGELU" if dgelu else "DEFAULT"
    assert sorted(epilogs) == sorted(["GELU_AUX_BIAS", "BIAS", "DEFAULT", last])
    assert d_dtypes[epilogs.index("GELU_AUX_BIAS")] == "float8_e4m3fn"
    dots = re.findall(r"stablehlo.dot_general.*", text)
    assert len(dots) == 2 and all("xf8E4M3FN" in d and "xf8E5M2" in d for d in dots)


def test_explicit_sharding_types_a_megatron_blocks_fp8_gradients(rng):
    """Column- then row-parallel kernels under explicit sharding: every gradient has its
    primal's type, the values one device's."""
    from helpers import assert_gradients_like_primals, explicit_mesh_2x2
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = explicit_mesh_2x2()
    x, layers = _block(rng, m=4 * 9, widths=(40, 96, 24))
    put = lambda v, *s: jax.device_put(v, NamedSharding(mesh, PartitionSpec(*s)))
    (w1, b1), (w2, b2) = layers
    args = (put(x, "data"), [(put(w1, None, "model"), put(b1, "model")), (put(w2, "model", None), put(b2))])
    loss = lambda x, p, s: jnp.sum(jnp.sin(je.fused_mlp(x, p, ["gelu", None], fp8=s)[0].astype(jnp.float32)))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    assert_gradients_like_primals(grad(*args, _states(2)), grad(x, layers, _states(2)), args)
