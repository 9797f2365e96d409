"""``jax_epilog.primitives._base``: what every primitive shares. The eager impl (compiled
once, also under ``disable_jit``), derivatives through the reference math (second order
at the layer's precision), the CUDA lowering's choice between the custom call and XLA's
math (a refusal or symbolic shapes: one FastPathWarning) and its folding of leading row
dimensions. The CUDA lowerings are read as text, lowered here for "cuda" with cuBLASLt's
planning stubbed to accept (conftest.py)."""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    GPU_TOL,
    act_fn,
    assert_scaled_close,
    cuda_text,
    custom_calls,
    jaxpr_text,
    masked_relu,
    ones_layer,
    oracle,
    problems,
    reference_relu_mask,
)

from jax_epilog import FastPathWarning, fused_dense, fused_mlp, override_policy
from jax_epilog._epilogs import Activation, ComputeType
from jax_epilog._reference import dense as reference_dense
from jax_epilog.cuda import ffi

op = functools.partial(fused_dense, implementation="cublaslt")


def _fast_path_warnings(caught):
    return [w for w in caught if issubclass(w.category, FastPathWarning)]


# ------------------------------------------------------------------- the eager impl


def test_eager_calls_work_with_jit_disabled(rng):
    """Under jax.disable_jit() the primitives still run (compiled): the eager path binds
    them inside a jit, which would otherwise bind them again without end."""
    x, w, b = (rng.standard_normal(s) for s in ((5, 12), (12, 9), (9,)))
    with jax.disable_jit():
        y, aux = op(x, w, b, activation="relu", return_aux=True)
        dw = jax.grad(lambda w: op(x, w, b, activation="gelu").sum())(w)
    z = x @ w + b
    np.testing.assert_allclose(y, np.maximum(z, 0), rtol=1e-12, atol=1e-12)
    assert aux.shape == (5, 16)
    want = jax.grad(lambda w: act_fn("gelu")(x @ w + b).sum())(w)
    np.testing.assert_allclose(dw, want, rtol=1e-12, atol=1e-12)


def test_eager_calls_do_not_recompile(rng):
    """An eager call compiles each primitive once per parameter set (the eager impl once
    wrapped a fresh partial in a fresh jax.jit on every call)."""
    x, w, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((3, 5), (5, 7), (7,)))
    op(x, w, b, activation="relu").block_until_ready()  # warm up
    compiles = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(kwargs)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for _ in range(3):
            op(x, w, b, activation="relu").block_until_ready()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert len(compiles) == 0, f"{len(compiles)} XLA compilations for 3 identical eager calls"


# ------------------------------------------------- derivatives of the primitives


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_derivatives_of_a_bfloat16_gradient_run_no_float32_gemm(cublaslt_accepts, activation):
    """The gradient of a gradient penalty through the fused primitives: their derivatives'
    GEMMs read bfloat16, as in XLA's own second derivatives (with float32 products in the
    tangents, their transposes were float32 GEMMs: 5x slower than XLA's program at
    8192x1024->4096 on the H200)."""
    x, w, b = ones_layer(jnp.bfloat16)

    def penalty_grad(layer):
        loss = lambda x, w, b: jnp.sum(jnp.square(layer(x, w, b).astype(jnp.float32)))
        penalty = lambda x, w, b: jnp.sum(jnp.square(jax.grad(loss, argnums=1)(x, w, b).astype(jnp.float32)))
        return jax.grad(penalty, argnums=(0, 1, 2))

    text = cuda_text(penalty_grad(functools.partial(op, activation=activation)), x, w, b)
    assert custom_calls(text)  # the fused forward is there
    operands = re.findall(r"stablehlo.dot_general .*: \((tensor<[^)]*)\)", text)
    assert len(operands) >= 4 and all(t.count("xbf16>") == 2 for t in operands), operands


@pytest.mark.parametrize(
    "compute_type,precision", [("COMPUTE_32F_FAST_TF32", "DEFAULT"), ("COMPUTE_32F", "HIGHEST")]
)
def test_derivatives_of_a_float32_gradient_keep_the_layers_precision(
    cublaslt_accepts, compute_type, precision
):
    """A float32 layer's second derivatives run their GEMMs at its precision: TF32 where
    its compute type lets cuBLASLt round the operands (as the "xla" implementation's
    DEFAULT precision does), full float32 otherwise (as the plain expression's)."""
    x, w, b = ones_layer(jnp.float32)
    layer = functools.partial(op, activation="gelu", compute_type=compute_type)
    loss = lambda x, w, b: jnp.sum(jnp.square(layer(x, w, b)))
    penalty = lambda x, w, b: jnp.sum(jnp.square(jax.grad(loss, argnums=1)(x, w, b)))
    text = cuda_text(jax.grad(penalty, argnums=(0, 1, 2)), x, w, b)
    dots = re.findall(r"stablehlo.dot_general .*", text)
    assert custom_calls(text) and len(dots) >= 4
    assert all(("HIGHEST" in d) == (precision == "HIGHEST") for d in dots), dots


# ----------------------------------------------------- the custom call, or XLA's math


def test_a_refusal_lowers_to_xla_with_one_warning(monkeypatch, fresh_warnings):
    """A problem cuBLASLt refuses at planning lowers to XLA's math, with one
    FastPathWarning for the reason (not one per call or per program)."""
    monkeypatch.setattr(ffi, "prepare", lambda spec: "cuBLASLt refused (test)")
    x, w, b = ones_layer(jnp.bfloat16)
    grad = jax.grad(
        lambda x, w, b: op(x, w, b, activation="gelu").astype(jnp.float32).sum(), argnums=(0, 1, 2)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = cuda_text(grad, x, w, b)
        cuda_text(lambda *a: op(*a, activation="gelu") * 2, x, w, b)  # the same reason again
    assert not custom_calls(text) and "stablehlo.dot_general" in text
    (refusal,) = _fast_path_warnings(caught)
    assert str(refusal.message) == "jax_epilog: using XLA's unfused path on the GPU: cuBLASLt refused (test)"


def test_problems_xla_computes_lower_to_its_math_without_a_warning(cublaslt_accepts, fresh_warnings):
    """float64, an empty dimension and one row with a float32 D beside half operands
    (cuBLASLt plans that, then refuses every launch) are documented XLA cases: no custom
    call, no warning."""
    cases = [
        (functools.partial(op, activation="gelu", return_aux=True), ones_layer(jnp.float64)),
        (functools.partial(op, activation="relu"), ones_layer(jnp.bfloat16, m=0)),
        (functools.partial(op, activation="relu"), ones_layer(jnp.bfloat16, n=0)),
        (functools.partial(op, activation="gelu"), ones_layer(jnp.float16, jnp.float32, m=1)),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for f, args in cases:
            assert not custom_calls(cuda_text(f, *args))
    assert not _fast_path_warnings(caught)
    assert custom_calls(
        cuda_text(cases[-1][0], *ones_layer(jnp.float16, jnp.float32, m=2))
    )  # two rows: fused


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_symbolic_shapes_export_with_xla_math(rng, cublaslt_accepts, fresh_warnings, implementation):
    """jax.export with a symbolic batch size: "auto" (whose rules compare sizes) keeps XLA's
    expression, and the op, whose cuBLASLt plan needs its sizes, lowers to XLA's path on
    "cuda" with one FastPathWarning; the exported function runs at any batch size."""
    (batch,) = jax.export.symbolic_shape("b")
    k, n = 24, 19
    specs = (jax.ShapeDtypeStruct((batch, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))

    def dense(x, w):
        return fused_dense(x, w, None, activation="gelu", implementation=implementation)

    def mlp(x, w):
        return fused_mlp(x, [(w, None), (w.T, None)], ["gelu", None], implementation=implementation)

    def grad(x, w):
        return jax.grad(lambda x, w: mlp(x, w).astype(jnp.float32).sum(), argnums=(0, 1))(x, w)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for f in (dense, mlp, grad):
            text = jax.export.export(jax.jit(f), platforms=("cuda",))(*specs).mlir_module()
            assert not custom_calls(text)
    symbolic = _fast_path_warnings(caught)
    assert len(symbolic) == (implementation == "cublaslt") and all(
        "symbolic" in str(w.message) for w in symbolic
    )

    x = rng.standard_normal((37, k)).astype(jnp.bfloat16)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    y = jax.export.export(jax.jit(dense))(*specs).call(x, w)
    np.testing.assert_allclose(np.asarray(y, np.float64), oracle(x, w, None, "gelu")[0], rtol=2e-2, atol=2e-2)


# --------------------------------------------------------- folding the leading rows


@pytest.mark.parametrize("ensemble", [False, True])
def test_autos_fused_forward_folds_its_leading_dimensions_in_the_lowering(cublaslt_accepts, ensemble):
    """x of shape (3, 11, K) reaches "auto"'s fused forward (a small layer here, through
    the policy) whole, so that each device folds its own rows: the lowering folds the rows
    around one call of m = 33 rows (per member for an ensemble's batched call) and
    unfolds y after."""
    x, w, b = ones_layer(jnp.bfloat16)
    x = jnp.ones((3, 11, x.shape[1]), x.dtype)
    layer = functools.partial(fused_dense, activation="gelu")
    if ensemble:
        layer, w, b = jax.vmap(layer, in_axes=(None, 0, 0)), jnp.stack([w] * 4), jnp.stack([b] * 4)
    with override_policy(auto_min_rows=0, auto_min_work=0, row_bytes=1):
        assert "bf16[33,129]" not in jaxpr_text(layer, x, w, b)  # no fold before the op
        (call,) = custom_calls(cuda_text(layer, x, w, b))
        assert jax.jit(lambda *a: layer(*a))(x, w, b).shape == ((4,) if ensemble else ()) + (3, 11, 65)
    assert "m = 33" in call and call.endswith(
        "-> tensor<4x33x65xbf16>" if ensemble else "-> tensor<33x65xbf16>"
    )


def test_the_fused_backward_folds_its_leading_dimensions_in_the_lowering(cublaslt_accepts):
    """ "cublaslt"'s backward and fused_mlp's linked one take x (3, 11, K) with its leading
    dimensions too: the forward, BGRADA and DGELU calls each fold m = 33 rows in their
    lowering, and nothing folds before the ops."""
    x, w, b = ones_layer(jnp.bfloat16)
    x = jnp.ones((3, 11, x.shape[1]), x.dtype)
    w2 = jnp.ones((65, 17), x.dtype)
    dense = lambda x, w, b, w2: op(x, w, b, activation="gelu")
    mlp = lambda x, w, b, w2: fused_mlp(x, [(w, b), (w2, None)], ["gelu", None], implementation="cublaslt")
    for f, want in ((dense, ["forward", "wgrad"]), (mlp, ["forward", "forward", "dgrad", "wgrad"])):
        grad = jax.grad(lambda *a, f=f: (f(*a).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2, 3))
        assert "bf16[33," not in jaxpr_text(grad, x, w, b, w2)  # no fold before the ops
        text = cuda_text(grad, x, w, b, w2)
        assert sorted(problems(text)) == sorted(want)
        assert all("m = 33" in c for c in custom_calls(text))
        assert all(s.shape == a.shape for s, a in zip(jax.eval_shape(grad, x, w, b, w2), (x, w, b, w2)))


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_the_cuda_lowerings_row_folding_keeps_the_values(rng, cuda_lowerings_on_cpu, activation):
    """The CUDA lowerings, run on the CPU on float64 operands (which they hand to the
    reference math, as on a GPU), each folding its rows' leading dimensions around that
    math: x of shape (2, 3, 5, K), fused_dense's value, aux and gradients (the forward and
    BGRADA fold), fused_mlp's linked gradient (DGELU folds), an ensemble's forward and
    gradients with x per member (the members' call folds after the member dimension) and
    a per-example model over an ensemble, all as the float64 expression's."""
    act = act_fn(activation)
    x = rng.standard_normal((2, 3, 5, 17))
    w, b, w2 = rng.standard_normal((17, 37)) / 4, rng.standard_normal(37), rng.standard_normal((37, 6)) / 6
    ws, bs, xs = (np.stack([a * (i + 1) for i in range(3)]) for a in (w, b, x))
    dense = lambda x, w, b, w2: op(x, w, b, activation=activation)
    mlp = lambda x, w, b, w2: fused_mlp(x, [(w, b), (w2, None)], ["gelu", None], implementation="cublaslt")
    members = lambda x, w, b, w2: jax.vmap(lambda x, w, b: dense(x, w, b, w2))(x, w, b)
    per_example = lambda x, w, b, w2: jax.vmap(lambda x: members(x, w, b, w2), in_axes=1, out_axes=1)(x)
    ensemble = lambda x, w, b, w2: act(jnp.einsum("eabmk,ekn->eabmn", x, w) + b[:, None, None, None])
    cases = [
        (dense, lambda x, w, b, w2: act(x @ w + b), (x, w, b, w2)),
        (mlp, lambda x, w, b, w2: jax.nn.gelu(x @ w + b, approximate=True) @ w2, (x, w, b, w2)),
        (members, ensemble, (xs, ws, bs, w2)),
        (per_example, ensemble, (xs, ws, bs, w2)),
    ]
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for f, plain, args in cases:
        np.testing.assert_allclose(jax.jit(f)(*args), plain(*args), rtol=1e-12, atol=1e-12)
        got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3)))(*args)
        for g, want in zip(got, jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2, 3)))(*args), strict=True):
            np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-10)
    aux = jax.jit(functools.partial(op, activation=activation, return_aux=True))(x, w, b)[1]
    want = reference_dense(
        x.reshape(30, 17), w, b, Activation(activation), ComputeType.COMPUTE_64F, np.float64, True
    )
    np.testing.assert_array_equal(aux.reshape(30, -1), want[1])


# ------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
def test_leading_dims_fold_into_m(rng):
    x = jnp.asarray(rng.standard_normal((2, 3, 40, 24)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((24, 40)) / 5, jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(40), jnp.bfloat16)
    y, aux = jax.jit(functools.partial(op, activation="relu", return_aux=True))(x, w, b)
    assert y.shape == (2, 3, 40, 40) and aux.shape == (2, 3, 40, 16)
    assert_scaled_close(y, oracle(x, w, b, "relu")[0], GPU_TOL["bfloat16"])


@pytest.mark.gpu
def test_refused_problem_falls_back_with_one_warning(rng, monkeypatch, fresh_warnings):
    from jax_epilog.cuda import plan

    def refuse(spec, device_id, alignment=256, autotune=False):
        raise plan.PlanningError(f"test refusal of {spec}")

    monkeypatch.setattr(plan, "get_plan", refuse)
    x, w, b = (
        jnp.asarray(a, jnp.bfloat16)
        for a in (rng.standard_normal((37, 61)), rng.standard_normal((61, 19)) / 8, rng.standard_normal(19))
    )
    with pytest.warns(FastPathWarning, match="test refusal"):
        y = jax.jit(lambda x, w, b: op(x, w, b, activation="relu"))(x, w, b)
    assert_scaled_close(y, oracle(x, w, b, "relu")[0], GPU_TOL["bfloat16"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason is not repeated
        jax.jit(lambda x, w, b: op(x, w, b, activation="relu") * 2)(x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_the_cublaslt_gradient_on_leading_dimensions_matches_the_expressions(rng, activation):
    """ "cublaslt"'s backward and fused_mlp's linked one on x of shape (3, 11, K): the
    forward, BGRADA and DGELU calls fold their rows in the lowering; the gradients are the
    plain expression's."""
    x = jnp.asarray(rng.standard_normal((33, 129)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((129, 65)) / np.sqrt(129), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal(65), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((65, 17)) / np.sqrt(65), jnp.bfloat16)
    act = functools.partial(jax.nn.gelu, approximate=True)
    if activation == "relu":
        # cuBLASLt's epilog may round x @ w to bfloat16 before adding the bias, so near the
        # kink its bit may differ from z > 0 and flip a whole row of dx. Away from it the
        # folded mask must be z > 0; near it the expression takes the op's bit.
        mask = jnp.asarray(reference_relu_mask(x.reshape(3, 11, 129), w, b, "bfloat16"), jnp.float32)
        act = lambda z: masked_relu(z, mask)
    x = x.reshape(3, 11, 129)
    layers = {
        "dense": lambda x, w, b, w2: op(x, w, b, activation=activation),
        "mlp": lambda x, w, b, w2: fused_mlp(
            x, [(w, b), (w2, None)], [activation, None], implementation="cublaslt"
        ),
    }
    plain = {"dense": lambda x, w, b, w2: act(x @ w + b), "mlp": lambda x, w, b, w2: act(x @ w + b) @ w2}
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))
    f32 = [a.astype(jnp.float32) for a in (x, w, b, w2)]
    argnums = (0, 1, 2, 3)
    for name, layer in layers.items():
        grad = jax.jit(jax.grad(loss(layer), argnums=argnums))
        text = grad.lower(x, w, b, w2).as_text()
        assert text.count(f"@{ffi.TARGET_NAME}(") >= 1 and "bf16[33," not in jaxpr_text(grad, x, w, b, w2)
        for g, want in zip(
            grad(x, w, b, w2), jax.grad(loss(plain[name]), argnums=argnums)(*f32), strict=True
        ):
            assert_scaled_close(g, want, GPU_TOL["bfloat16"])
