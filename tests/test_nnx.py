"""jax_epilog.nnx.FusedLinear against its twin, flax.nnx.Linear followed by the activation.

The twin is built with the same arguments and the same ``nnx.Rngs`` seed, so both start from
bit-identical parameters (checked), and the only difference left is the fused numerics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ACTIVATIONS,
    FUSED,
    GRAD_TOL,
    LAYER_DTYPE_CASES,
    TOL,
    act_fn,
    assert_near,
    assert_same_tree,
    draw_x,
    grad_tol,
    jaxpr_text,
    perturb,
)

nnx = pytest.importorskip("flax.nnx")
serialization = pytest.importorskip("flax.serialization")
optax = pytest.importorskip("optax")

from jax_epilog.nnx import FusedLinear as _FusedLinear
from jax_epilog.nnx import FusedMLP

# The layer tests exercise the fused op itself ("cublaslt": the kernel on a GPU, the
# reference math on a CPU); "auto" would pick XLA's plain expression for these sizes.
FusedLinear = functools.partial(_FusedLinear, implementation="cublaslt")


class Twin(nnx.Module):
    """``act(nnx.Linear(...)(x))``: what FusedLinear must equal."""

    def __init__(self, *args, activation=None, **kwargs):
        self.linear = nnx.Linear(*args, **kwargs)
        self.activation = activation

    def __call__(self, x):
        return act_fn(self.activation)(self.linear(x))


def pair(in_features, out_features, seed, activation=None, **kwargs):
    fused = FusedLinear(in_features, out_features, activation=activation, rngs=nnx.Rngs(seed), **kwargs)
    linear = nnx.Linear(in_features, out_features, rngs=nnx.Rngs(seed), **kwargs)
    return fused, linear


def pure_params(module):
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def copy_params(src, dst):
    """Copy src's parameters into dst (same attribute names: kernel, bias)."""
    nnx.update(dst, nnx.state(src, nnx.Param))


def value_and_grads(module, x, ct):
    """y, d(sum(y * ct))/dparams (a pure dict) and d/dx, through the functional API."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def loss(params, x):
        y = nnx.merge(graphdef, params, rest)(x)
        return jnp.sum(y.astype(jnp.float32) * ct), y

    (_, y), (dparams, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, nnx.to_pure_dict(dparams), dx


@pytest.mark.parametrize(
    "activation, use_bias, x_shape",
    [
        (act, i % 2 == 0, shape)
        for i, (act, shape) in enumerate((a, s) for a in ACTIVATIONS for s in [(11, 19), (2, 5, 19)])
    ],
    ids=str,
)
def test_matches_linear_float32(rng, activation, use_bias, x_shape):
    seed = int(rng.integers(2**31))
    fused, linear = pair(19, 13, seed, activation, use_bias=use_bias)
    assert_same_tree(pure_params(fused), pure_params(linear))
    assert set(pure_params(fused)) == ({"kernel", "bias"} if use_bias else {"kernel"})
    assert fused.kernel.shape == (19, 13)
    assert isinstance(fused.kernel, nnx.Param)
    assert (fused.bias is None) == (linear.bias is None)

    nnx.update(fused, perturb(rng, nnx.state(fused, nnx.Param)))
    copy_params(fused, linear)
    x = draw_x(rng, x_shape, fused.kernel[...], fused.bias[...] if use_bias else None, "float32")
    ct = rng.standard_normal((*x_shape[:-1], 13)).astype(np.float32)

    twin = Twin(19, 13, activation=activation, use_bias=use_bias, rngs=nnx.Rngs(0))
    copy_params(fused, twin.linear)
    y, dp, dx = value_and_grads(fused, x, ct)
    y_ref, dp_ref, dx_ref = value_and_grads(twin, x, ct)
    assert y.dtype == y_ref.dtype == jnp.float32
    assert_near(y, y_ref, TOL["float32"], "y")
    assert_near(dx, dx_ref, GRAD_TOL["float32"], "dx")
    assert_same_tree(dp, dp_ref["linear"], values=False)
    for name in dp:
        assert_near(dp[name], dp_ref["linear"][name], GRAD_TOL["float32"], name)


def test_nnx_grad_and_jit(rng):
    """The NNX-native spelling: nnx.jit(nnx.grad(...)) with the module as an argument."""
    fused, _ = pair(6, 5, int(rng.integers(2**31)), "gelu")
    x = rng.standard_normal((4, 6)).astype(np.float32)

    @nnx.jit
    def grads(model, x):
        return nnx.grad(lambda m, x: jnp.sum(m(x) ** 2), argnums=(0, 1))(model, x)

    (dm, dx) = grads(fused, x)
    twin = Twin(6, 5, activation="gelu", rngs=nnx.Rngs(0))
    copy_params(fused, twin.linear)
    (dm_ref, dx_ref) = grads(twin, x)
    assert_near(dx, dx_ref, GRAD_TOL["float32"])
    for name in ("kernel", "bias"):
        assert_near(dm[name][...], dm_ref["linear"][name][...], GRAD_TOL["float32"], name)


@pytest.mark.parametrize("x_dtype, dtype, param_dtype, activation", LAYER_DTYPE_CASES, ids=str)
def test_dtypes_match_linear(rng, x_dtype, dtype, param_dtype, activation):
    seed = int(rng.integers(2**31))
    kwargs = {"dtype": dtype, "param_dtype": param_dtype}
    fused, _ = pair(33, 23, seed, activation, **kwargs)
    twin = Twin(33, 23, activation=activation, rngs=nnx.Rngs(seed), **kwargs)
    assert_same_tree(pure_params(fused), pure_params(twin.linear))
    nnx.update(fused, perturb(rng, nnx.state(fused, nnx.Param)))
    copy_params(fused, twin.linear)

    probe = jnp.zeros((15, 33), x_dtype)
    compute = nnx.eval_shape(lambda: twin(probe)).dtype  # the twin's promoted dtype
    x = draw_x(rng, probe.shape, fused.kernel[...], fused.bias[...], x_dtype, compute)
    ct = rng.standard_normal((15, 23)).astype(np.float32)
    y, dp, dx = value_and_grads(fused, x, ct)
    y_ref, dp_ref, dx_ref = value_and_grads(twin, x, ct)
    assert y.dtype == y_ref.dtype == compute
    assert dx.dtype == dx_ref.dtype == x.dtype
    assert_same_tree(dp, dp_ref["linear"], values=False)  # gradients in param_dtype
    assert_near(y, y_ref, TOL[np.dtype(compute).name], "y")
    assert_near(dx, dx_ref, grad_tol(compute, dx), "dx")
    for name in ("kernel", "bias"):
        assert_near(dp[name], dp_ref["linear"][name], grad_tol(compute, dp[name]), name)


def test_float64(rng):
    fused, linear = pair(9, 5, int(rng.integers(2**31)), "relu", param_dtype=jnp.float64)
    assert fused.kernel.dtype == jnp.float64
    nnx.update(fused, perturb(rng, nnx.state(fused, nnx.Param)))  # a non-zero bias, so that it matters
    copy_params(fused, linear)
    x = rng.standard_normal((7, 9))  # float64: conftest enables x64
    y = fused(x)
    assert y.dtype == jnp.float64
    assert_near(y, jax.nn.relu(linear(x)), TOL["float64"])


def test_attributes_and_metadata():
    fused, linear = pair(3, 4, 0, "relu", use_bias=False, dtype=jnp.bfloat16)
    for name in ("in_features", "out_features", "use_bias", "dtype", "param_dtype", "precision"):
        assert getattr(fused, name) == getattr(linear, name), name
    assert fused.bias is None
    assert fused.activation == "relu"
    tagged = FusedLinear(3, 4, rngs=nnx.Rngs(0), kernel_metadata={"tag": "k"}, bias_metadata={"tag": "b"})
    assert tagged.kernel.get_metadata()["tag"] == "k"
    assert tagged.bias.get_metadata()["tag"] == "b"


@pytest.mark.parametrize(
    "precision",
    [None, jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST, "high", ("highest", "highest")],
)
def test_precision_accepted(rng, precision):
    fused, linear = pair(11, 3, int(rng.integers(2**31)), precision=precision)
    nnx.update(fused, perturb(rng, nnx.state(fused, nnx.Param)))  # a non-zero bias, so that it matters
    copy_params(fused, linear)
    x = rng.standard_normal((5, 11)).astype(np.float32)
    assert_near(fused(x), linear(x), TOL["float32"])


@pytest.mark.parametrize(
    "precision, compute_type, match",
    [
        ("highest", "COMPUTE_32F_FAST_TF32", "reduced precision"),
        (("high", "highest"), None, "different precisions"),
        (jax.lax.DotAlgorithmPreset.TF32_TF32_F32, None, "not supported"),
    ],
)
def test_precision_refused(precision, compute_type, match):
    layer = FusedLinear(4, 3, precision=precision, compute_type=compute_type, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        layer(jnp.ones((2, 4), jnp.float32))


@pytest.mark.parametrize("kwarg", ["dot_general", "preferred_element_type"])
def test_unsupported_arguments(kwarg):
    with pytest.raises(TypeError, match=kwarg):
        FusedLinear(4, 3, rngs=nnx.Rngs(0), **{kwarg: None})
    layer = FusedLinear(4, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="out_sharding"):
        layer(jnp.ones((2, 4), jnp.float32), out_sharding=None)


class MLP(nnx.Module):
    def __init__(self, din, hidden, dout, *, fused, rngs):
        if fused:
            self.fc1 = FusedLinear(din, hidden, activation="gelu", rngs=rngs)
            self.fc2 = FusedLinear(hidden, hidden, activation="relu", rngs=rngs)
            self.head = FusedLinear(hidden, dout, rngs=rngs)
        else:
            self.fc1 = nnx.Linear(din, hidden, rngs=rngs)
            self.fc2 = nnx.Linear(hidden, hidden, rngs=rngs)
            self.head = nnx.Linear(hidden, dout, rngs=rngs)
        self.fused = fused

    def __call__(self, x):
        if self.fused:
            return self.head(self.fc2(self.fc1(x)))
        x = jax.nn.gelu(self.fc1(x), approximate=True)
        return self.head(jax.nn.relu(self.fc2(x)))


def test_mlp_state_interchangeable(rng):
    seed = int(rng.integers(2**31))
    fused = MLP(6, 29, 5, fused=True, rngs=nnx.Rngs(seed))
    dense = MLP(6, 29, 5, fused=False, rngs=nnx.Rngs(seed))
    assert_same_tree(pure_params(fused), pure_params(dense))
    # Non-zero biases, so that they matter; the state copies over unchanged.
    nnx.update(fused, perturb(rng, nnx.state(fused, nnx.Param)))
    copy_params(fused, dense)
    assert_same_tree(pure_params(fused), pure_params(dense))
    x = rng.standard_normal((9, 6)).astype(np.float32)
    assert_near(fused(x), dense(x), TOL["float32"])


def test_optimizer_step_lowers_loss(rng):
    x = rng.standard_normal((64, 6)).astype(np.float32)
    y = np.tanh(x @ rng.standard_normal((6, 4))).astype(np.float32) + 0.1 * x[:, :4] ** 2
    model = MLP(6, 32, 4, fused=True, rngs=nnx.Rngs(int(rng.integers(2**31))))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, x, y)) for _ in range(60)]
    assert losses[-1] < 0.3 * losses[0], losses


def make_stack(cls, layers, d, seed, **kwargs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
        return cls(d, d, rngs=rngs, **kwargs)

    return create(nnx.Rngs(seed))


def test_nnx_vmap_and_scan(rng):
    """Layers created with nnx.vmap (stacked params) and applied with nnx.scan."""
    seed = int(rng.integers(2**31))
    fused = make_stack(FusedLinear, 3, 8, seed, activation="gelu")
    linear = make_stack(nnx.Linear, 3, 8, seed)
    assert_same_tree(pure_params(fused), pure_params(linear))
    assert fused.kernel.shape == (3, 8, 8)
    nnx.update(fused, perturb(rng, nnx.state(fused, nnx.Param)))
    copy_params(fused, linear)

    @functools.partial(nnx.jit, static_argnums=2)
    def forward(stack, x, activation):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, layer):
            return h + act_fn(activation)(layer(h))

        return body(x, stack)

    x = rng.standard_normal((5, 8)).astype(np.float32)
    y = forward(fused, x, None)
    assert_near(y, forward(linear, x, "gelu"), TOL["float32"])

    # Gradients through the scan.
    def loss(stack, x, activation):
        return jnp.sum(forward(stack, x, activation) ** 2)

    g = nnx.grad(loss)(fused, x, None)
    g_ref = nnx.grad(loss)(linear, x, "gelu")
    for name in ("kernel", "bias"):
        assert_near(g[name][...], g_ref[name][...], GRAD_TOL["float32"], name)


def test_vmap(rng):
    seed = int(rng.integers(2**31))
    fused, linear = pair(5, 6, seed, "relu")
    nnx.update(fused, perturb(rng, nnx.state(fused, nnx.Param)))
    copy_params(fused, linear)
    xs = rng.standard_normal((4, 3, 5)).astype(np.float32)
    # Shared module, batched inputs: nnx.vmap and jax.vmap over a merged module.
    y = nnx.vmap(lambda m, x: m(x), in_axes=(None, 0))(fused, xs)
    assert_near(y, jax.nn.relu(linear(xs)), TOL["float32"])
    graphdef, state = nnx.split(fused)
    y = jax.jit(jax.vmap(lambda x: nnx.merge(graphdef, state)(x)))(xs)
    assert_near(y, jax.nn.relu(linear(xs)), TOL["float32"])
    # An ensemble: one FusedLinear per batch entry (stacked params), as nnx.vmap makes it.
    ens = make_stack(FusedLinear, 4, 5, seed, activation="relu")
    ens_ref = make_stack(nnx.Linear, 4, 5, seed)
    xs = rng.standard_normal((4, 3, 5)).astype(np.float32)
    y = nnx.vmap(lambda m, x: m(x), in_axes=(0, 0))(ens, xs)
    y_ref = nnx.vmap(lambda m, x: jax.nn.relu(m(x)), in_axes=(0, 0))(ens_ref, xs)
    assert_near(y, y_ref, TOL["float32"])


def test_state_round_trip_and_swap(rng):
    seed = int(rng.integers(2**31))
    fused = MLP(6, 16, 3, fused=True, rngs=nnx.Rngs(seed))
    nnx.update(fused, perturb(rng, nnx.state(fused, nnx.Param)))
    x = rng.standard_normal((8, 6)).astype(np.float32)
    y = fused(x)

    # A checkpoint as bytes: the pure dict of the state, through flax.serialization.
    blob = serialization.msgpack_serialize(nnx.to_pure_dict(nnx.state(fused)))
    restored = MLP(6, 16, 3, fused=True, rngs=nnx.Rngs(seed + 1))
    state = nnx.state(restored)
    nnx.replace_by_pure_dict(state, serialization.msgpack_restore(blob))
    nnx.update(restored, state)
    assert_same_tree(pure_params(restored), pure_params(fused))
    assert_near(restored(x), y, 0.0)

    # The same checkpoint loads into the nnx.Linear model, and that one's state loads back.
    dense = MLP(6, 16, 3, fused=False, rngs=nnx.Rngs(seed + 2))
    state = nnx.state(dense)
    nnx.replace_by_pure_dict(state, serialization.msgpack_restore(blob))
    nnx.update(dense, state)
    assert_near(dense(x), y, TOL["float32"])
    back = MLP(6, 16, 3, fused=True, rngs=nnx.Rngs(seed + 3))
    nnx.update(back, nnx.state(dense))
    assert_same_tree(pure_params(back), pure_params(fused))

    # A single layer's state merges with the other class's graphdef.
    layer, lin = pair(4, 3, seed)
    swapped = nnx.merge(nnx.graphdef(lin), nnx.state(layer))
    assert isinstance(swapped, nnx.Linear)
    assert_same_tree(pure_params(swapped), pure_params(layer))


def test_forward_mode_raises_naming_the_fix_and_works_with_auto():
    layer = FusedLinear(4, 3, activation="relu", rngs=nnx.Rngs(0))
    x = jnp.ones((2, 4), jnp.float32)
    with pytest.raises(TypeError, match="fused_dense: forward-mode autodiff .* implementation='xla'"):
        jax.jvp(layer, (x,), (x,))
    jax.jvp(_FusedLinear(4, 3, activation="relu", rngs=nnx.Rngs(0)), (x,), (x,))


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: _FusedLinear(4, 3, activation="swish", rngs=nnx.Rngs(0)),
            ValueError,
            "FusedLinear: unknown activation 'swish'",
        ),
        (
            lambda: _FusedLinear(4, 3, activation=jax.nn.gelu, rngs=nnx.Rngs(0)),
            TypeError,
            "FusedLinear: activation must be a name, not a function",
        ),
        (
            lambda: _FusedLinear(4, 3, implementation="fast", rngs=nnx.Rngs(0)),
            ValueError,
            "FusedLinear: unknown implementation 'fast'",
        ),
        (
            lambda: FusedMLP((4, 8, 2), ("gelu", "swish"), rngs=nnx.Rngs(0)),
            ValueError,
            "FusedMLP: unknown activation 'swish'",
        ),
        (
            lambda: FusedMLP((4, 8, 2), ("gelu", None), implementation="fast", rngs=nnx.Rngs(0)),
            ValueError,
            "unknown implementation 'fast'",
        ),
    ],
    ids=[
        "linear-activation",
        "linear-function",
        "linear-implementation",
        "mlp-activation",
        "mlp-implementation",
    ],
)
def test_a_bad_activation_or_implementation_fails_at_construction(make, error, match):
    """The layer's own arguments are checked when it is built, before any parameter is
    drawn, not first when it is called."""
    with pytest.raises(error, match=match):
        make()


def test_the_layer_passes_the_implementation_on(rng):
    x = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
    for impl, fused in (("cublaslt", True), ("xla", False), ("auto", False)):
        lin = _FusedLinear(6, 5, activation="relu", implementation=impl, rngs=nnx.Rngs(0))
        assert (FUSED in jaxpr_text(lin, x)) == fused


# ------------------------------------------------------------------------- FusedMLP


def test_fused_mlp_is_fused_linear_layers_built_in_turn(rng):
    seed = int(rng.integers(2**31))
    mlp = FusedMLP((16, 40, 12), ("gelu", None), dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))
    rngs = nnx.Rngs(seed)
    first = _FusedLinear(16, 40, activation="gelu", dtype=jnp.bfloat16, rngs=rngs)
    second = _FusedLinear(40, 12, dtype=jnp.bfloat16, rngs=rngs)
    for layer, twin in zip(mlp.layers, (first, second)):
        np.testing.assert_array_equal(layer.kernel[...], twin.kernel[...])
        layer.bias[...] = twin.bias[...] = jnp.asarray(rng.standard_normal(twin.bias.shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.float32)
    np.testing.assert_array_equal(
        nnx.jit(lambda m, x: m(x))(mlp, x), nnx.jit(lambda a, b, x: b(a(x)))(first, second, x)
    )
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32) ** 2)))(mlp)
    twin = nnx.jit(nnx.grad(lambda a, b: jnp.sum(b(a(x)).astype(jnp.float32) ** 2), argnums=(0, 1)))(
        first, second
    )
    grads = nnx.to_pure_dict(grads)["layers"]
    for i, t in enumerate(twin):
        t = nnx.to_pure_dict(t)
        assert_near(grads[i]["kernel"], t["kernel"], 6e-2)
        assert_near(grads[i]["bias"], t["bias"], 6e-2)
    with pytest.raises(ValueError, match=r"FusedMLP: features \(16, 4\) must hold the input width"):
        FusedMLP((16, 4), ("gelu", None), rngs=nnx.Rngs(0))


# ---------------------------------------------------------------------------- FP8


def test_fp8_state_is_overwritten_by_its_gradient_in_an_nnx_loop(rng):
    from jax_epilog import fp8
    from jax_epilog.nnx import OverwriteWithGradient, apply_fp8_gradients

    optax = pytest.importorskip("optax")
    x = jnp.asarray(rng.standard_normal((3, 37, 40)), jnp.float32)
    block = FusedMLP(
        (40, 72, 24), ("gelu", None), dtype=jnp.bfloat16, fp8=fp8.DelayedScaling(8), rngs=nnx.Rngs(0)
    )
    plain = FusedMLP((40, 72, 24), ("gelu", None), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    # The same parameters as the bfloat16 block: checkpoints move between them.
    assert_same_tree(
        nnx.to_pure_dict(nnx.state(plain, nnx.Param)), nnx.to_pure_dict(nnx.state(block, nnx.Param))
    )
    meta = block.layers[0].fp8_meta
    assert meta["input_scale"][...].shape == (1,) and meta["kernel_amax_history"][...].shape == (8,)
    optimizer = nnx.Optimizer(block, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(block, optimizer):
        wrt = nnx.DiffState(0, nnx.Any(nnx.Param, OverwriteWithGradient))
        grads = nnx.grad(lambda b: jnp.mean(b(x).astype(jnp.float32) ** 2), argnums=wrt)(block)
        optimizer.update(block, nnx.filter_state(grads, nnx.Param))
        apply_fp8_gradients(block, grads)

    step(block, optimizer)
    step(block, optimizer)
    amax = float(jnp.max(jnp.abs(x.astype(jnp.bfloat16).astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(meta["input_amax_history"][...][:2]), [amax, amax], rtol=1e-6)
    assert float(block.layers[1].fp8_meta["output_grad_amax_history"][...][0]) > 0
    # The hidden layer's output feeds the next GEMM in FP8: its amax is recorded.
    assert float(meta["output_amax_history"][...][0]) > 0
    with pytest.raises(TypeError, match="FusedLinear: fp8=1"):
        FusedLinear(4, 4, fp8=1, rngs=nnx.Rngs(0))
