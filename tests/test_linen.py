"""jax_epilog.linen.FusedDense against its twin, flax.linen.Dense followed by the activation.

Every comparison copies (or identically initializes) the parameters, so the only difference
left is the fused layer's numerics: one rounding of act(x @ kernel + bias) from a float32
accumulator instead of a rounding after each of the twin's ops.
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
    run_python,
)

nn = pytest.importorskip("flax.linen")
serialization = pytest.importorskip("flax.serialization")
optax = pytest.importorskip("optax")

import jax_epilog
from jax_epilog.linen import FusedDense as _FusedDense
from jax_epilog.linen import FusedMLP

# The layer tests exercise the fused op itself ("cublaslt": the kernel on a GPU, the
# reference math on a CPU); "auto" would pick XLA's plain expression for these sizes.
FusedDense = functools.partial(_FusedDense, implementation="cublaslt")


def twin(activation, **kwargs):
    """``act(nn.Dense(**kwargs)(x))`` as an ``apply(params, x)`` function."""
    dense = nn.Dense(**kwargs)
    act = act_fn(activation)
    return lambda params, x: act(dense.apply(params, x))


def value_and_grads(apply, params, x, ct):
    def loss(params, x):
        y = apply(params, x)
        return jnp.sum(y.astype(jnp.float32) * ct), y

    (_, y), (dparams, dx) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return y, dparams, dx


@pytest.mark.parametrize(
    "activation, use_bias, x_shape",
    [
        (act, i % 2 == 0, shape)
        for i, (act, shape) in enumerate((a, s) for a in ACTIVATIONS for s in [(11, 19), (2, 5, 19)])
    ],
    ids=str,
)
def test_matches_dense_float32(rng, activation, use_bias, x_shape):
    key = jax.random.key(int(rng.integers(2**31)))
    features = 13
    layer = FusedDense(features, use_bias=use_bias, activation=activation)
    probe = jnp.zeros(x_shape, jnp.float32)
    params = layer.init(key, probe)
    twin_params = nn.Dense(features, use_bias=use_bias).init(key, probe)
    assert_same_tree(params, twin_params)
    expected_keys = {"kernel", "bias"} if use_bias else {"kernel"}
    assert set(params["params"]) == expected_keys
    assert params["params"]["kernel"].shape == (19, features)

    # Non-zero bias so that it matters.
    params = perturb(rng, params)
    p = params["params"]
    x = draw_x(rng, x_shape, p["kernel"], p.get("bias"), "float32")
    ct = rng.standard_normal((*x_shape[:-1], features)).astype(np.float32)

    y, dparams, dx = jax.jit(functools.partial(value_and_grads, layer.apply))(params, x, ct)
    y_ref, dparams_ref, dx_ref = value_and_grads(
        twin(activation, features=features, use_bias=use_bias), params, x, ct
    )
    assert y.dtype == y_ref.dtype == jnp.float32
    assert_near(y, y_ref, TOL["float32"], "y")
    assert_near(dx, dx_ref, GRAD_TOL["float32"], "dx")
    assert_same_tree(dparams, dparams_ref, values=False)
    for name in dparams["params"]:
        assert_near(dparams["params"][name], dparams_ref["params"][name], GRAD_TOL["float32"], name)


@pytest.mark.parametrize("x_dtype, dtype, param_dtype, activation", LAYER_DTYPE_CASES, ids=str)
def test_dtypes_match_dense(rng, x_dtype, dtype, param_dtype, activation):
    key = jax.random.key(int(rng.integers(2**31)))
    kwargs = {"features": 23, "dtype": dtype, "param_dtype": param_dtype}
    probe = jnp.zeros((15, 33), x_dtype)
    params = FusedDense(**kwargs, activation=activation).init(key, probe)
    assert_same_tree(params, nn.Dense(**kwargs).init(key, probe))
    params = perturb(rng, params)

    ref_apply = twin(activation, **kwargs)
    compute = jax.eval_shape(ref_apply, params, probe).dtype  # the twin's promoted dtype
    p = params["params"]
    x = draw_x(rng, probe.shape, p["kernel"], p["bias"], x_dtype, compute)
    ct = rng.standard_normal((15, 23)).astype(np.float32)

    layer = FusedDense(**kwargs, activation=activation)
    # Eager: every case has the same shapes, so the cases share each op's compilation.
    y, dparams, dx = value_and_grads(layer.apply, params, x, ct)
    y_ref, dparams_ref, dx_ref = value_and_grads(ref_apply, params, x, ct)
    assert y.dtype == y_ref.dtype == compute
    assert dx.dtype == dx_ref.dtype == x.dtype
    assert_same_tree(dparams, dparams_ref, values=False)  # gradients in param_dtype
    name = np.dtype(compute).name
    assert_near(y, y_ref, TOL[name], "y")

    assert_near(dx, dx_ref, grad_tol(compute, dx), "dx")
    for leaf in ("kernel", "bias"):
        g = dparams["params"][leaf]
        assert_near(g, dparams_ref["params"][leaf], grad_tol(compute, g), leaf)


def test_float64(rng):
    x = rng.standard_normal((7, 9))  # float64: conftest enables x64
    key = jax.random.key(int(rng.integers(2**31)))
    layer = FusedDense(5, activation="gelu")
    params = layer.init(key, x)
    assert params["params"]["kernel"].dtype == jnp.float32  # param_dtype stays float32
    params = perturb(rng, params)  # a non-zero bias, so that it matters
    y = layer.apply(params, x)
    assert y.dtype == jnp.float64
    assert_near(y, twin("gelu", features=5)(params, x), TOL["float64"])
    params64 = FusedDense(5, param_dtype=jnp.float64).init(key, x)
    assert params64["params"]["kernel"].dtype == jnp.float64


@pytest.mark.parametrize(
    "precision",
    [
        None,
        jax.lax.Precision.DEFAULT,
        jax.lax.Precision.HIGH,
        jax.lax.Precision.HIGHEST,
        "highest",
        (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST),
        ("default", "default"),
    ],
)
def test_precision_accepted(rng, precision):
    x = rng.standard_normal((5, 11)).astype(np.float32)
    key = jax.random.key(int(rng.integers(2**31)))
    params = perturb(rng, FusedDense(3).init(key, x))
    y = FusedDense(3, precision=precision, activation="relu").apply(params, x)
    assert_near(y, twin("relu", features=3, precision=precision)(params, x), TOL["float32"])


@pytest.mark.parametrize(
    "precision, compute_type, match",
    [
        (jax.lax.Precision.HIGHEST, "COMPUTE_32F_FAST_TF32", "reduced precision"),
        ("high", "COMPUTE_32F_FAST_16BF", "reduced precision"),
        ("float32", "COMPUTE_32F_FAST_16F", "reduced precision"),
        ((jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST), None, "different precisions"),
        (("highest",) * 3, None, "must be one value or a pair"),
        (jax.lax.DotAlgorithmPreset.BF16_BF16_F32, None, "not supported"),
        ("bogus", None, "not supported"),
    ],
)
def test_precision_refused(precision, compute_type, match):
    layer = FusedDense(3, precision=precision, compute_type=compute_type)
    with pytest.raises(ValueError, match=match):
        layer.init(jax.random.key(0), jnp.ones((2, 4), jnp.float32))


def test_compute_type(rng):
    x = rng.standard_normal((5, 11)).astype(np.float32)
    params = perturb(rng, FusedDense(3).init(jax.random.key(int(rng.integers(2**31))), x))
    y = FusedDense(3, compute_type="COMPUTE_32F_FAST_TF32").apply(params, x)
    assert_near(y, twin(None, features=3)(params, x), 1e-2)  # TF32 on a GPU
    y = FusedDense(3, precision="tensorfloat32", compute_type="COMPUTE_32F_FAST_TF32").apply(params, x)
    assert_near(y, twin(None, features=3)(params, x), 1e-2)
    y = FusedDense(3, precision="highest", compute_type="COMPUTE_32F").apply(params, x)
    assert_near(y, twin(None, features=3)(params, x), TOL["float32"])
    with pytest.raises(ValueError, match="COMPUTE_64F"):  # fused_dense's own check
        FusedDense(3, compute_type="COMPUTE_64F").apply(params, x)


def test_unsupported_fields():
    with pytest.raises(TypeError, match="dot_general"):
        FusedDense(3, dot_general=jax.lax.dot_general)
    with pytest.raises(TypeError, match="dot_general_cls"):
        FusedDense(3, dot_general_cls=object)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: _FusedDense(4, activation="swish"), ValueError, "FusedDense: unknown activation 'swish'"),
        (
            lambda: _FusedDense(4, activation=jax.nn.relu),
            TypeError,
            "FusedDense: activation must be a name, not a function",
        ),
        (
            lambda: _FusedDense(4, implementation="fast"),
            ValueError,
            "FusedDense: unknown implementation 'fast'",
        ),
        (lambda: FusedMLP((8, 4), ("gelu", "swish")), ValueError, "FusedMLP: unknown activation 'swish'"),
        (
            lambda: FusedMLP((8, 4), ("gelu", None), implementation="fast"),
            ValueError,
            "FusedMLP: unknown implementation 'fast'",
        ),
    ],
    ids=[
        "dense-activation",
        "dense-function",
        "dense-implementation",
        "mlp-activation",
        "mlp-implementation",
    ],
)
def test_a_bad_activation_or_implementation_fails_at_construction(make, error, match):
    """The layer's own arguments are checked when it is built, not first at ``init``."""
    with pytest.raises(error, match=match):
        make()


def test_forward_mode_raises_naming_the_fix_and_works_with_auto():
    layer = FusedDense(3, activation="relu")
    x = jnp.ones((2, 4), jnp.float32)
    params = layer.init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="fused_dense: forward-mode autodiff .* implementation='xla'"):
        jax.jvp(lambda x: layer.apply(params, x), (x,), (x,))
    auto = _FusedDense(3, activation="relu")
    jax.jvp(lambda x: auto.apply(params, x), (x,), (x,))


def test_the_layer_passes_the_implementation_on(rng):
    x = jnp.asarray(rng.standard_normal((4, 6)), jnp.float32)
    for impl, fused in (("cublaslt", True), ("xla", False), ("auto", False)):
        layer = _FusedDense(5, activation="relu", implementation=impl)
        params = layer.init(jax.random.key(0), x)
        assert (FUSED in jaxpr_text(layer.apply, params, x)) == fused


class MLP(nn.Module):
    """Named layers, so a FusedDense MLP and an nn.Dense MLP have the same tree and init."""

    hidden: int = 32
    out: int = 4
    fused: bool = True

    @nn.compact
    def __call__(self, x):
        def layer(features, activation, name):
            if self.fused:
                return FusedDense(features, activation=activation, name=name)
            return lambda x: act_fn(activation)(nn.Dense(features, name=name)(x))

        x = layer(self.hidden, "gelu", "fc1")(x)
        x = layer(self.hidden, "relu", "fc2")(x)
        return layer(self.out, None, "head")(x)


def test_mlp_tree_and_outputs_match(rng):
    x = rng.standard_normal((9, 6)).astype(np.float32)
    key = jax.random.key(int(rng.integers(2**31)))
    fused, dense = MLP(hidden=29, out=5, fused=True), MLP(hidden=29, out=5, fused=False)
    params = fused.init(key, x)
    assert_same_tree(params, dense.init(key, x))
    assert set(params["params"]) == {"fc1", "fc2", "head"}
    params = perturb(rng, params)  # non-zero biases, so that they matter
    assert_near(fused.apply(params, x), dense.apply(params, x), TOL["float32"])


def test_autonames_differ(rng):
    """Documented: unnamed layers are FusedDense_i, not Dense_i."""

    class Unnamed(nn.Module):
        @nn.compact
        def __call__(self, x):
            return FusedDense(3)(x)

    params = Unnamed().init(jax.random.key(0), jnp.ones((1, 2), jnp.float32))
    assert set(params["params"]) == {"FusedDense_0"}


def test_adam_step_lowers_loss(rng):
    x = rng.standard_normal((64, 6)).astype(np.float32)
    w_true = rng.standard_normal((6, 4)).astype(np.float32)
    y = np.tanh(x @ w_true) + 0.1 * x[:, :4] ** 2
    model = MLP()
    params = model.init(jax.random.key(int(rng.integers(2**31))), x)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    def loss_fn(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(60):
        params, opt_state, loss = step(params, opt_state, x, y)
        losses.append(float(loss))
    assert losses[-1] < 0.3 * losses[0], losses


class ScanBlock(nn.Module):
    fused: bool = True

    @nn.compact
    def __call__(self, h, _):
        d = h.shape[-1]
        if self.fused:
            h = h + FusedDense(d, activation="gelu", name="fc")(h)
        else:
            h = h + jax.nn.gelu(nn.Dense(d, name="fc")(h), approximate=True)
        return h, None


class ScanStack(nn.Module):
    fused: bool = True
    layers: int = 3

    @nn.compact
    def __call__(self, h):
        stack = nn.scan(
            ScanBlock,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        h, _ = stack(self.fused, name="blocks")(h, None)
        return h


def test_nn_scan(rng):
    x = rng.standard_normal((5, 8)).astype(np.float32)
    key = jax.random.key(int(rng.integers(2**31)))
    params = ScanStack(fused=True).init(key, x)
    assert_same_tree(params, ScanStack(fused=False).init(key, x))
    assert params["params"]["blocks"]["fc"]["kernel"].shape == (3, 8, 8)
    ct = rng.standard_normal((5, 8)).astype(np.float32)
    y, dp, dx = jax.jit(functools.partial(value_and_grads, ScanStack(fused=True).apply))(params, x, ct)
    y_ref, dp_ref, dx_ref = value_and_grads(ScanStack(fused=False).apply, params, x, ct)
    assert_near(y, y_ref, TOL["float32"])
    assert_near(dx, dx_ref, GRAD_TOL["float32"])
    jax.tree.map(lambda a, b: assert_near(a, b, GRAD_TOL["float32"]), dp, dp_ref)


def test_jax_vmap(rng):
    layer = FusedDense(6, activation="relu")
    ref = twin("relu", features=6)
    xs = rng.standard_normal((4, 3, 5)).astype(np.float32)
    params = layer.init(jax.random.key(int(rng.integers(2**31))), xs[0])
    # Shared parameters, batched inputs.
    y = jax.vmap(layer.apply, in_axes=(None, 0))(params, xs)
    assert_near(y, ref(params, xs), TOL["float32"])
    # An ensemble: one parameter set per batch entry.
    keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), 4)
    ens = jax.vmap(layer.init, in_axes=(0, None))(keys, xs[0])
    ens = perturb(rng, ens)
    y = jax.jit(jax.vmap(layer.apply))(ens, xs)
    assert_near(y, jax.vmap(ref)(ens, xs), TOL["float32"])

    # Per-example gradients.
    def loss(apply, params, x):
        return jnp.sum(apply(params, x) ** 2)

    member = jax.tree.map(lambda p: p[0], ens)
    per_ex = jax.vmap(jax.grad(functools.partial(loss, layer.apply)), in_axes=(None, 0))(member, xs)
    per_ex_ref = jax.vmap(jax.grad(functools.partial(loss, ref)), in_axes=(None, 0))(member, xs)
    jax.tree.map(lambda a, b: assert_near(a, b, GRAD_TOL["float32"]), per_ex, per_ex_ref)


def test_nn_vmap_ensemble(rng):
    def ensemble(fused):
        class Member(nn.Module):
            @nn.compact
            def __call__(self, x):
                if fused:
                    return FusedDense(4, activation="gelu", name="fc")(x)
                return jax.nn.gelu(nn.Dense(4, name="fc")(x), approximate=True)

        return nn.vmap(
            Member, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None, axis_size=3
        )()

    x = rng.standard_normal((2, 5)).astype(np.float32)
    key = jax.random.key(int(rng.integers(2**31)))
    params = ensemble(True).init(key, x)
    assert_same_tree(params, ensemble(False).init(key, x))
    params = perturb(rng, params)  # non-zero biases, so that they matter
    y = ensemble(True).apply(params, x)
    assert y.shape == (3, 2, 4)
    assert_near(y, ensemble(False).apply(params, x), TOL["float32"])


def test_serialization_round_trip_and_swap(rng):
    x = rng.standard_normal((8, 6)).astype(np.float32)
    key = jax.random.key(int(rng.integers(2**31)))
    fused, dense = MLP(fused=True), MLP(fused=False)
    params = fused.init(key, x)
    params = perturb(rng, params)

    blob = serialization.to_bytes(params)
    restored = serialization.from_bytes(fused.init(jax.random.key(1), x), blob)
    assert_same_tree(restored, params)
    assert_near(fused.apply(restored, x), fused.apply(params, x), 0.0)

    # Parameters saved from the nn.Dense model load into the FusedDense model, and back.
    into_dense = serialization.from_bytes(dense.init(jax.random.key(2), x), blob)
    assert_near(dense.apply(into_dense, x), fused.apply(params, x), TOL["float32"])
    back = serialization.from_bytes(fused.init(jax.random.key(3), x), serialization.to_bytes(into_dense))
    assert_same_tree(back, params)
    # The state-dict form too (what checkpointing libraries store).
    state = serialization.to_state_dict(params)
    assert_same_tree(serialization.from_state_dict(dense.init(key, x), state), params)


def test_import_error_without_flax():
    code = (
        "import sys\n"
        "sys.modules['flax'] = None\n"
        "import jax_epilog\n"
        "for name in ('linen', 'nnx'):\n"
        "    try:\n"
        "        __import__('jax_epilog.' + name)\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
        "    else:\n"
        "        raise SystemExit('imported without flax')\n"
    )
    out = run_python(code, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("jax_epilog.linen needs Flax: pip install 'jax_epilog[flax]'")
    assert lines[1].startswith("jax_epilog.nnx needs Flax: pip install 'jax_epilog[flax]'")


# ------------------------------------------------------------------------- FusedMLP


def test_fused_mlp_is_two_fused_dense_layers_with_those_names(rng):
    class Two(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = _FusedDense(40, activation="gelu", name="fc_in", dtype=jnp.bfloat16)(x)
            return _FusedDense(12, name="fc_out", dtype=jnp.bfloat16)(x)

    mlp = FusedMLP((40, 12), ("gelu", None), layer_names=("fc_in", "fc_out"), dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 7, 16)), jnp.float32)
    key = jax.random.key(int(rng.integers(2**31)))
    params = Two().init(key, x)
    jax.tree.map(np.testing.assert_array_equal, mlp.init(key, x), params)
    params = perturb(rng, params)
    np.testing.assert_array_equal(jax.jit(mlp.apply)(params, x), jax.jit(Two().apply)(params, x))
    loss = lambda apply: jax.jit(jax.grad(lambda p: jnp.sum(apply(p, x).astype(jnp.float32) ** 2)))
    jax.tree.map(lambda g, t: assert_near(g, t, 6e-2), loss(mlp.apply)(params), loss(Two().apply)(params))
    assert set(FusedMLP((4, 2), ("gelu", None)).init(key, x)["params"]) == {"layers_0", "layers_1"}
    with pytest.raises(ValueError, match="FusedMLP: 1 layer_names for 2 layers"):
        FusedMLP((4, 2), ("gelu", None), layer_names=("a",)).init(key, x)


@pytest.mark.parametrize(
    "precision, compute_type, match",
    [
        (jax.lax.Precision.HIGHEST, "COMPUTE_32F_FAST_TF32", "FusedMLP: precision=HIGHEST"),
        ("bogus", None, "not supported"),
    ],
)
def test_fused_mlp_precision_as_fused_dense_s(rng, precision, compute_type, match):
    x = jnp.asarray(rng.standard_normal((3, 5)), jnp.float32)
    with pytest.raises(ValueError, match=match):
        FusedMLP((4, 2), ("gelu", None), precision=precision, compute_type=compute_type).init(
            jax.random.key(0), x
        )
    layer = FusedMLP((4, 2), ("gelu", None), precision="highest", implementation="cublaslt")
    params = perturb(rng, layer.init(jax.random.key(0), x))
    p = params["params"]
    h = act_fn("gelu")(x @ p["layers_0"]["kernel"] + p["layers_0"]["bias"])
    assert_near(layer.apply(params, x), h @ p["layers_1"]["kernel"] + p["layers_1"]["bias"], TOL["float32"])


# ---------------------------------------------------------------------------- FP8


def test_fp8_state_lives_where_flax_keeps_its_own(rng):
    from flax.linen import fp8_ops
    from flax.training import train_state

    from jax_epilog import fp8
    from jax_epilog.linen import OVERWRITE_WITH_GRADIENT

    x = jnp.asarray(rng.standard_normal((3, 37, 40)), jnp.float32)
    recipe = fp8.DelayedScaling(history_length=16)
    layer = _FusedDense(24, activation="gelu", dtype=jnp.bfloat16, fp8=recipe, name="fc")
    variables = layer.init(jax.random.PRNGKey(1), x)
    flax_layer = nn.Dense(24, dtype=jnp.bfloat16, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)
    (flax_state,) = flax_layer.init(jax.random.PRNGKey(1), x)[OVERWRITE_WITH_GRADIENT].values()
    ours = variables[OVERWRITE_WITH_GRADIENT]
    for name, value in flax_state.items():  # Flax's names, shapes and initial values
        assert ours[name].shape[0] == 1 or ours[name].shape == (16,)
        np.testing.assert_array_equal(np.asarray(ours[name])[:1], np.asarray(value)[:1])
    # The parameters are a bfloat16 layer's: a plain FusedDense's checkpoint loads as it is.
    plain = _FusedDense(24, activation="gelu", dtype=jnp.bfloat16, name="fc").init(jax.random.PRNGKey(1), x)
    assert_same_tree(plain["params"], variables["params"])
    # A training loop written for Flax's FP8 layers: TrainState overwrites the state with its gradient.
    state = train_state.TrainState.create(apply_fn=layer.apply, params=variables, tx=optax.sgd(0.1))
    loss = lambda v: jnp.mean(state.apply_fn(v, x).astype(jnp.float32) ** 2)
    for _ in range(2):
        state = state.apply_gradients(grads=jax.grad(loss)(state.params))
    new = state.params[OVERWRITE_WITH_GRADIENT]
    amax = float(jnp.max(jnp.abs(x.astype(jnp.bfloat16).astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(new["input_amax_history"][:2]), [amax, amax], rtol=1e-6)
    assert float(new["output_grad_amax_history"][0]) > 0
    np.testing.assert_allclose(float(new["input_scale"][0]), amax / 448, rtol=1e-6)


def test_fp8_mlp_keeps_each_layers_state_beside_its_parameters(rng):
    from jax_epilog import fp8

    x = jnp.asarray(rng.standard_normal((21, 40)), jnp.bfloat16)
    block = FusedMLP(
        (72, 24), ("gelu", None), dtype=jnp.bfloat16, fp8=fp8.CurrentScaling(), layer_names=("a", "b")
    )
    variables = block.init(jax.random.PRNGKey(0), x)
    assert set(variables["_overwrite_with_gradient"]) == {"a", "b"}
    layers = [(variables["params"][n]["kernel"], variables["params"][n]["bias"]) for n in "ab"]
    states = [fp8.init(fp8.CurrentScaling()) for _ in "ab"]
    want, _ = jax_epilog.fused_mlp(
        x, [(k.astype(x.dtype), b.astype(x.dtype)) for k, b in layers], ["gelu", None], fp8=states
    )
    np.testing.assert_array_equal(
        np.asarray(block.apply(variables, x), np.float32), np.asarray(want, np.float32)
    )
    with pytest.raises(TypeError, match="FusedDense: fp8='e4m3'"):
        _FusedDense(4, fp8="e4m3")
