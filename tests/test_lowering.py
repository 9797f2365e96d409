"""The CUDA lowerings, checked on any machine: JAX lowers for platform "cuda" here, with
cuBLASLt's planning stubbed to accept, so the emitted custom calls can be read as text."""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ENSEMBLES, GRAD_TOL, TOL, act_fn, assert_near
from jax.interpreters import mlir

import jax_epilog
from jax_epilog import (
    EXPORT_CHECKS,
    FastPathWarning,
    MembersLoopWarning,
    _primitive,
    _reference,
    fused_dense,
    fused_mlp,
)
from jax_epilog._epilogs import Activation, ComputeType, EpilogSpec, aux_padded_width
from jax_epilog._sharding import partitioned_lowering

TARGET = "jax_epilog_fused_matmul"
op = functools.partial(fused_dense, implementation="cublaslt")


def _cuda_text(f, *args) -> str:
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _calls(text: str) -> list[str]:
    return re.findall(rf"stablehlo.custom_call @{TARGET}\(.*", text)


def _args(dtype, bias_dtype=None, m=33, k=129, n=65):
    return jnp.ones((m, k), dtype), jnp.ones((k, n), dtype), jnp.ones((n,), bias_dtype or dtype)


@pytest.fixture
def cublaslt_accepts(monkeypatch):
    monkeypatch.setattr(_primitive, "_fast_path_refusal", lambda spec: None)


def test_forward_call_carries_the_problem_and_writes_d_and_aux(cublaslt_accepts):
    (call,) = _calls(_cuda_text(functools.partial(op, activation="relu", return_aux=True), *_args(jnp.bfloat16)))
    for attr in ('epilog = "RELU_AUX_BIAS"', 'problem = "forward"', "m = 33", "n = 65", "k = 129"):
        assert attr in call
    # D (m, n) and the bit-mask (m, round_up(65, 128) / 8 = 16 bytes).
    assert call.endswith("-> (tensor<33x65xbf16>, tensor<33x16xui8>)")


def test_float32_bias_makes_a_float32_d_that_xla_casts(cublaslt_accepts):
    text = _cuda_text(functools.partial(op, activation="gelu"), *_args(jnp.float16, jnp.float32))
    (call,) = _calls(text)
    assert call.endswith("-> tensor<33x65xf32>")
    assert "stablehlo.convert" in text


@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_backward_adds_one_bgrada_call_only_with_a_bias_and_gelu(cublaslt_accepts, with_bias, activation):
    """ReLU's bias gradient is XLA's reduction: no BGRADA call (benchmarks/README.md (u))."""
    x, w, b = _args(jnp.bfloat16)
    loss = lambda x, w, b: op(x, w, b if with_bias else None, activation=activation).astype(jnp.float32).sum()
    calls = _calls(_cuda_text(jax.grad(loss, argnums=(0, 1, 2)), x, w, b))
    assert len(calls) == (2 if with_bias and activation == "gelu" else 1)
    assert 'problem = "forward"' in calls[0]
    if len(calls) == 2:
        wgrad = calls[1]
        assert 'epilog = "BGRADA"' in wgrad and 'problem = "wgrad"' in wgrad
        # (x, dz) -> (dkernel (k, n), dbias (n,))
        assert wgrad.endswith("(tensor<33x129xbf16>, tensor<33x65xbf16>) -> (tensor<129x65xbf16>, tensor<65xbf16>)")


def test_weight_gradient_with_k_1_stays_on_xla(cublaslt_accepts):
    x, w, b = _args(jnp.bfloat16, k=1)
    grad = jax.grad(lambda x, w, b: op(x, w, b, activation="gelu").astype(jnp.float32).sum(), argnums=(0, 1, 2))
    calls = _calls(_cuda_text(grad, x, w, b))
    assert len(calls) == 1 and 'problem = "forward"' in calls[0]


def test_a_refusal_lowers_to_xla_with_one_warning(monkeypatch):
    monkeypatch.setattr(_primitive, "_fast_path_refusal", lambda spec: "cuBLASLt refused (test)")
    _primitive._warn_once.cache_clear()
    x, w, b = _args(jnp.bfloat16)
    grad = jax.grad(lambda x, w, b: op(x, w, b, activation="relu").astype(jnp.float32).sum(), argnums=(0, 1, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = _cuda_text(grad, x, w, b)
    assert not _calls(text)
    refusals = [w for w in caught if issubclass(w.category, FastPathWarning)]
    assert len(refusals) == 1 and "cuBLASLt refused (test)" in str(refusals[0].message)


@pytest.mark.parametrize("implementation", ["auto", "cublaslt"])
def test_symbolic_shapes_export_with_xla_math(rng, cublaslt_accepts, implementation):
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

    _primitive._warn_once.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for f in (dense, mlp, grad):
            text = jax.export.export(jax.jit(f), platforms=("cuda",))(*specs).mlir_module()
            assert not _calls(text)
    symbolic = [w for w in caught if issubclass(w.category, FastPathWarning)]
    assert len(symbolic) == (implementation == "cublaslt") and all("symbolic" in str(w.message) for w in symbolic)

    x = rng.standard_normal((37, k)).astype(jnp.bfloat16)
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    y = jax.export.export(jax.jit(dense))(*specs).call(x, w)
    want = act_fn("gelu")(np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2e-2, atol=2e-2)


def test_export_refuses_the_custom_call_unless_export_checks_allow_it(cublaslt_accepts):
    """jax.export guards against custom calls without compatibility guarantees: exporting
    a fused program for "cuda" raises, naming our target, unless ``EXPORT_CHECKS`` is
    passed; the exported module then holds the fused calls of the forward and of its
    gradient (running one elsewhere: tests/test_gpu.py)."""
    x, w, b = _args(jnp.bfloat16)
    forward = jax.jit(functools.partial(op, activation="gelu"))
    grad = jax.jit(jax.grad(lambda *a: forward(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    with pytest.raises(ValueError, match=TARGET):
        jax.export.export(forward, platforms=("cuda",))(x, w, b)
    for f, count in ((forward, 1), (grad, 2)):  # the grad's forward and BGRADA GEMM
        exported = jax.export.export(f, platforms=("cuda",), disabled_checks=EXPORT_CHECKS)(x, w, b)
        assert len(_calls(exported.mlir_module())) == count
        loaded = jax.export.deserialize(exported.serialize())  # (needs flatbuffers: the test extra)
        assert len(_calls(loaded.mlir_module())) == count and loaded.platforms == ("cuda",)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_derivatives_of_a_bfloat16_gradient_run_no_float32_gemm(cublaslt_accepts, activation):
    """The gradient of a gradient penalty through the fused primitives: their derivatives'
    GEMMs read bfloat16, as in XLA's own second derivatives (with float32 products in the
    tangents, their transposes were float32 GEMMs: 5x slower than XLA's program at
    8192x1024->4096 on the H200, benchmarks/README.md (ab))."""
    x, w, b = _args(jnp.bfloat16)

    def penalty_grad(layer):
        loss = lambda x, w, b: jnp.sum(jnp.square(layer(x, w, b).astype(jnp.float32)))
        penalty = lambda x, w, b: jnp.sum(jnp.square(jax.grad(loss, argnums=1)(x, w, b).astype(jnp.float32)))
        return jax.grad(penalty, argnums=(0, 1, 2))

    text = _cuda_text(penalty_grad(functools.partial(op, activation=activation)), x, w, b)
    assert _calls(text)  # the fused forward is there
    operands = re.findall(r"stablehlo.dot_general .*: \((tensor<[^)]*)\)", text)
    assert len(operands) >= 4 and all(t.count("xbf16>") == 2 for t in operands), operands


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


@pytest.mark.parametrize(
    "compute_type,precision", [("COMPUTE_32F_FAST_TF32", "DEFAULT"), ("COMPUTE_32F", "HIGHEST")]
)
def test_derivatives_of_a_float32_gradient_keep_the_layers_precision(cublaslt_accepts, compute_type, precision):
    """A float32 layer's second derivatives run their GEMMs at its precision: TF32 where
    its compute type lets cuBLASLt round the operands (as the "xla" implementation's
    DEFAULT precision does), full float32 otherwise (as the plain expression's)."""
    x, w, b = _args(jnp.float32)
    layer = functools.partial(op, activation="gelu", compute_type=compute_type)
    loss = lambda x, w, b: jnp.sum(jnp.square(layer(x, w, b)))
    penalty = lambda x, w, b: jnp.sum(jnp.square(jax.grad(loss, argnums=1)(x, w, b)))
    text = _cuda_text(jax.grad(penalty, argnums=(0, 1, 2)), x, w, b)
    dots = re.findall(r"stablehlo.dot_general .*", text)
    assert _calls(text) and len(dots) >= 4
    assert all(("HIGHEST" in d) == (precision == "HIGHEST") for d in dots), dots


def test_inside_shard_map_the_fused_calls_lower_and_the_weight_gradients_sum(cublaslt_accepts):
    """A linked GELU block in a shard_map over rows: each device's forward, DGELU and
    BGRADA calls, and an all-reduce for each weight gradient (w1, b1, w2: the weights are
    the same on every device). Before, jax refused the backward's types there."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("cpu")[:4])
    x, w1, b1 = _args(jnp.bfloat16, m=4 * 33)
    w2 = jnp.ones((65, 17), jnp.bfloat16)
    block = lambda x, w1, b1, w2: fused_mlp(x, [(w1, b1), (w2, None)], ["gelu", None], implementation="cublaslt")
    P = jax.sharding.PartitionSpec
    sharded = jax.shard_map(block, mesh=mesh, in_specs=(P("data"), P(), P(), P()), out_specs=P("data"))
    loss = lambda *args: sharded(*args).astype(jnp.float32).sum()
    text = _cuda_text(jax.grad(loss, argnums=(0, 1, 2, 3)), x, w1, b1, w2)
    problems = [re.search(r'problem = "(\w+)"', call).group(1) for call in _calls(text)]
    assert sorted(problems) == ["dgrad", "forward", "wgrad"]
    assert "m = 33" in _calls(text)[0]  # each device's rows
    assert text.count("stablehlo.all_reduce") == 3




@pytest.mark.parametrize("ensemble", [False, True])
def test_autos_fused_forward_folds_its_leading_dimensions_in_the_lowering(cublaslt_accepts, monkeypatch, ensemble):
    """x of shape (3, 11, K) reaches "auto"'s fused forward whole (so that each device folds
    its own rows): the lowering folds the rows around one call of m = 33 rows (per member
    for an ensemble's batched call) and unfolds y after."""
    monkeypatch.setattr(jax_epilog._dense, "_auto_fuses_alone", lambda *args: True)
    x, w, b = _args(jnp.bfloat16)
    x = jnp.ones((3, 11, x.shape[1]), x.dtype)
    layer = functools.partial(fused_dense, activation="gelu")
    if ensemble:
        layer, (w, b) = jax.vmap(layer, in_axes=(None, 0, 0)), _stacked((w, b), (0, 0), members=4)
    assert "bf16[33,129]" not in str(jax.make_jaxpr(layer)(x, w, b))  # no fold before the op
    (call,) = _calls(_cuda_text(layer, x, w, b))
    assert "m = 33" in call and call.endswith("-> tensor<4x33x65xbf16>" if ensemble else "-> tensor<33x65xbf16>")
    assert jax.jit(layer)(x, w, b).shape == ((4,) if ensemble else ()) + (3, 11, 65)


def test_the_fused_backward_folds_its_leading_dimensions_in_the_lowering(cublaslt_accepts):
    """"cublaslt"'s backward and fused_mlp's linked one take x (3, 11, K) with its leading
    dimensions too: the forward, BGRADA and DGELU calls each fold m = 33 rows in their
    lowering, and nothing folds before the ops."""
    x, w, b = _args(jnp.bfloat16)
    x = jnp.ones((3, 11, x.shape[1]), x.dtype)
    w2 = jnp.ones((65, 17), x.dtype)
    dense = lambda x, w, b, w2: op(x, w, b, activation="gelu")
    mlp = lambda x, w, b, w2: fused_mlp(x, [(w, b), (w2, None)], ["gelu", None], implementation="cublaslt")
    for f, problems in ((dense, ["forward", "wgrad"]), (mlp, ["forward", "forward", "dgrad", "wgrad"])):
        grad = jax.grad(lambda *a, f=f: (f(*a).astype(jnp.float32) ** 2).sum(), argnums=(0, 1, 2, 3))
        assert "bf16[33," not in str(jax.make_jaxpr(grad)(x, w, b, w2))  # no fold before the ops
        calls = _calls(_cuda_text(grad, x, w, b, w2))
        assert sorted(re.search(r'problem = "(\w+)"', c)[1] for c in calls) == sorted(problems)
        assert all("m = 33" in c for c in calls)
        assert all(s.shape == a.shape for s, a in zip(jax.eval_shape(grad, x, w, b, w2), (x, w, b, w2)))


def _stacked(args, in_axes, members=3):
    return [jnp.stack([a * (i + 1) for i in range(members)]) if ax == 0 else a for i, (a, ax) in enumerate(zip(args, in_axes))]


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("ensemble", list(ENSEMBLES))
def test_an_ensembles_forward_is_one_batched_call(cublaslt_accepts, ensemble, activation):
    """Each member's D and aux written in place by one strided-batched GEMM (no loop, so
    no copies in and out); a shared operand is passed once, whole."""
    in_axes = ENSEMBLES[ensemble]
    args = _stacked(_args(jnp.bfloat16, jnp.float32), in_axes)
    layer = jax.vmap(functools.partial(op, activation=activation, return_aux=True), in_axes=in_axes)
    text = _cuda_text(layer, *args)
    (call,) = _calls(text)
    shared = ",".join(name for name, ax in zip(("x", "kernel", "bias"), in_axes) if ax is None)
    assert "members = 3" in call and f'shared = "{shared}"' in call
    assert "stablehlo.while" not in text
    aux = "3x33x16xui8" if activation == "relu" else "3x33x72xf32"  # (members, m, aux width)
    assert call.endswith(f"-> (tensor<3x33x65xf32>, tensor<{aux}>)")  # D in float32 beside the float32 bias


def test_nested_ensembles_are_one_batched_call_over_every_member(cublaslt_accepts):
    x, w, b = (jnp.stack([jnp.stack([a] * 3)] * 2) for a in _args(jnp.bfloat16))
    layer = jax.vmap(jax.vmap(functools.partial(op, activation="gelu")))
    (call,) = _calls(_cuda_text(layer, x, w, b))
    assert "members = 6" in call and call.endswith("-> tensor<6x33x65xbf16>")


def test_members_sharing_x_and_the_kernel_loop_over_the_single_call(cublaslt_accepts):
    """Only the bias per member: no batched GEMM (nvmath batches by its operands), so the
    loop runs each member's fused call."""
    x, w, b = _args(jnp.bfloat16)
    text = _cuda_text(jax.vmap(functools.partial(op, activation="relu"), in_axes=(None, None, 0)), x, w, jnp.stack([b] * 3))
    (call,) = _calls(text)
    assert "members" not in call and "stablehlo.while" in text


@pytest.mark.parametrize("members", [0, 1])
def test_no_members_or_one_run_as_a_loop(cublaslt_accepts, members):
    args = [jnp.broadcast_to(a, (members, *a.shape)) for a in _args(jnp.bfloat16)]
    text = _cuda_text(jax.vmap(functools.partial(op, activation="relu")), *args)
    assert all(call.endswith("-> tensor<33x65xbf16>") for call in _calls(text))  # one member's, if any


def test_an_ensembles_gradient_batches_the_forward_and_leaves_the_weight_gradient_to_xla(cublaslt_accepts):
    """Each member's kernel and bias gradients are XLA's batched GEMM and reduction, not a
    loop of BGRADA calls (benchmarks/README.md (ad))."""
    args = _stacked(_args(jnp.bfloat16), (0, 0, 0))
    loss = lambda *a: jax.vmap(functools.partial(op, activation="gelu"))(*a).astype(jnp.float32).sum()
    text = _cuda_text(jax.grad(loss, argnums=(0, 1, 2)), *args)
    (forward,) = _calls(text)
    assert "members = 3" in forward and 'epilog = "GELU_AUX_BIAS"' in forward
    assert "stablehlo.while" not in text


def test_explicit_sharding_binds_the_members_batched_call(cublaslt_accepts):
    """Under explicit sharding an ensemble binds members_p itself (typed by its layout),
    not a shard_map or a loop: on one device, one batched call (over several, each
    device's members are one such call: test_sharding checks the types, blocks and
    collectives there)."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices("cpu")[:1])
    args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())) for a in _stacked(_args(jnp.bfloat16), (0, 0, 0), members=8)]
    with jax.set_mesh(mesh):
        text = _cuda_text(jax.vmap(functools.partial(op, activation="gelu")), *args)
    (call,) = _calls(text)
    assert "members = 8" in call and call.endswith("-> tensor<8x33x65xbf16>")
    assert "stablehlo.while" not in text


def test_a_refused_batch_runs_one_fused_call_per_member_with_one_warning(monkeypatch):
    monkeypatch.setattr(_primitive, "_fast_path_refusal", lambda spec: "no batch (test)" if spec.members > 1 else None)
    _primitive._warn_once.cache_clear()
    args = _stacked(_args(jnp.bfloat16), (0, 0, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = _cuda_text(jax.vmap(functools.partial(op, activation="relu")), *args)
    (call,) = _calls(text)
    assert "members" not in call and "stablehlo.while" in text
    assert not [w for w in caught if issubclass(w.category, FastPathWarning)]  # still the fused path
    (warning,) = [w for w in caught if issubclass(w.category, MembersLoopWarning)]
    assert "3 members run one fused call each" in str(warning.message) and "no batch (test)" in str(warning.message)



@pytest.fixture
def cuda_lowerings_on_cpu():
    """The primitives' CUDA lowerings registered for the CPU, on float64 operands (which
    they hand to the reference math, as on a GPU): each folds its rows' leading dimensions
    around that math and unfolds its results, so the folding's values are checked here."""
    p = _primitive
    rules = [
        (p.fused_matmul_p, p._cuda_lowering, p._reference_lowering, p._layout),
        (p.fused_weight_grad_p, p._wgrad_cuda_lowering, p._wgrad_reference_lowering, p._wgrad_layout),
        (p.fused_gelu_input_grad_p, p._igrad_cuda_lowering, p._igrad_reference_lowering, p._igrad_layout),
        (p.members_p, p._members_cuda_lowering, mlir.lower_fun(p._member_loop, multiple_results=True), p._members_layout),
    ]
    for primitive, cuda, _, layout in rules:
        lowering = p._with_rows_folded(cuda, layout)
        mlir.register_lowering(primitive, partitioned_lowering(primitive, lowering, layout), platform="cpu")
    yield
    for primitive, _, reference, layout in rules:
        mlir.register_lowering(primitive, partitioned_lowering(primitive, reference, layout), platform="cpu")


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_the_cuda_lowerings_row_folding_keeps_the_values(rng, cuda_lowerings_on_cpu, activation):
    """x of shape (2, 3, 5, K): fused_dense's value, aux and gradients (the forward and
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
    cases = [
        (dense, lambda x, w, b, w2: act(x @ w + b), (x, w, b, w2)),
        (mlp, lambda x, w, b, w2: jax.nn.gelu(x @ w + b, approximate=True) @ w2, (x, w, b, w2)),
        (members, lambda x, w, b, w2: act(jnp.einsum("eabmk,ekn->eabmn", x, w) + b[:, None, None, None]), (xs, ws, bs, w2)),
        (per_example, lambda x, w, b, w2: act(jnp.einsum("eabmk,ekn->eabmn", x, w) + b[:, None, None, None]), (xs, ws, bs, w2)),
    ]
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for f, plain, args in cases:
        np.testing.assert_allclose(jax.jit(f)(*args), plain(*args), rtol=1e-12, atol=1e-12)
        got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3)))(*args)
        for g, want in zip(got, jax.grad(loss(plain), argnums=(0, 1, 2, 3))(*args), strict=True):
            np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-10)
    aux = jax.jit(functools.partial(op, activation=activation, return_aux=True))(x, w, b)[1]
    want = _reference.dense(x.reshape(30, 17), w, b, Activation(activation), ComputeType.COMPUTE_64F, np.float64, True)
    np.testing.assert_array_equal(aux.reshape(30, -1), want[1])


def _reference_call(seen: list, operands, results, spec):
    """The custom call's results from its problem's reference math on the operands it is
    handed, whose shapes must be the problem's (padded) sizes, as ``_ffi.call`` checks them.
    Appends ``spec`` to ``seen``."""
    _primitive._ffi._check_buffers(operands, results, spec)
    seen.append(spec)
    ct = ComputeType[spec.compute_type]
    d_dtype = results[0].dtype
    if spec.problem == "wgrad":
        x, dz = operands
        assert (x.shape[-1], dz.shape[-1]) == (spec.k, spec.n)
        outs = _reference.weight_grad(x, dz, ct, d_dtype, with_bias=True)
    elif spec.problem == "dgrad":
        dz, kernel, aux = operands
        assert (dz.shape[-1], kernel.shape) == (spec.n, (spec.k, spec.n))
        outs = [_reference.gelu_input_grad(dz, kernel, aux, ct)]
    else:
        x, kernel, *bias = operands
        assert (x.shape[-1], kernel.shape[-2:]) == (spec.k, (spec.k, spec.n))
        assert all(b.shape[-1] == spec.n for b in bias)

        def one(x, kernel, *bias):
            return _reference.dense(x, kernel, bias[0] if bias else None, spec.activation, ct, d_dtype, spec.has_aux)

        if spec.members > 1:
            names = ("x", "kernel", "bias")[: len(operands)]
            one = jax.vmap(one, in_axes=[None if spec.is_shared(name) else 0 for name in names])
        d, aux = one(x, kernel, *bias)
        outs = [d] if aux is None else [d, aux]
    assert [(o.shape, o.dtype) for o in outs] == [(r.shape, r.dtype) for r in results]
    return list(outs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_calls_pad_row_widths_and_slice_their_results(rng, monkeypatch, cuda_lowerings_on_cpu, cublaslt_accepts, dtype):
    """With K = 29 and N = 65 (rows not 16 bytes apart), and padding asked for at any size,
    every custom call gets operands
    padded with zeros to whole 16-byte rows (the forward's, BGRADA's, fused_mlp's DGELU
    and an ensemble's batched call; a bfloat16 forward without aux pads N to 128 bytes,
    one with an aux to 16), and the layer's values, aux and gradients equal those
    of the same calls made unpadded (``_ROW_BYTES = 1``). The custom call runs its
    reference math here, on the CPU, and checks its operands' shapes."""
    seen: list = []
    monkeypatch.setattr(_primitive._ffi, "call", functools.partial(_reference_call, seen))
    monkeypatch.setattr(_primitive, "_PAD_MIN_ROWS", 0)
    monkeypatch.setattr(_primitive, "_PAD_MIN_WORK", 0)
    monkeypatch.setattr(_primitive, "_WIDE_MIN_N", 0)
    multiple = 16 // np.dtype(jnp.dtype(dtype)).itemsize
    x = jnp.asarray(rng.standard_normal((3, 11, 29)), dtype)
    w = jnp.asarray(rng.standard_normal((29, 65)) / 6, dtype)
    b, w2 = jnp.asarray(rng.standard_normal(65), dtype), jnp.asarray(rng.standard_normal((65, 6)) / 8, dtype)
    ws, bs = jnp.stack([w, -w]), jnp.stack([b, 2 * b])
    loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32))), argnums=(0, 1, 2)))
    cases = {
        "relu": lambda x, w, b: op(x, w, b, activation="relu", return_aux=True)[0],
        "gelu": lambda x, w, b: op(x, w, b, activation="gelu"),
        "mlp": lambda x, w, b: fused_mlp(x, [(w, b), (w2, None)], ["gelu", None], implementation="cublaslt"),
        "members": lambda x, w, b: jax.vmap(lambda w, b: op(x, w, b, activation="gelu"))(ws + w, bs + b),
    }
    aux = {act: jax.jit(functools.partial(op, activation=act, return_aux=True)) for act in ("relu", "gelu")}

    def results():
        values = {name: jax.jit(f)(x, w, b) for name, f in cases.items()}
        grads = {name: loss(f)(x, w, b) for name, f in cases.items()}
        return values, grads, {act: f(x, w, b)[1] for act, f in aux.items()}

    padded = results()
    assert {(s.problem, s.members > 1) for s in seen} == {("forward", False), ("forward", True), ("wgrad", False), ("dgrad", False)}
    assert all(s.n % multiple == 0 and s.k % multiple == 0 for s in seen)
    forwards = {(s.has_aux, s.n) for s in seen if s.problem == "forward"}
    wide = 8 * multiple if dtype == "bfloat16" else multiple  # (float32 keeps 16 bytes)
    assert (True, -(-65 // multiple) * multiple) in forwards and (False, -(-65 // wide) * wide) in forwards
    assert all(n % wide == 0 or aux for aux, n in forwards), forwards
    seen.clear()
    monkeypatch.setattr(_primitive, "_ROW_BYTES", 1)
    unpadded = results()
    assert {(s.n, s.k) for s in seen if s.problem == "forward"} == {(65, 29), (6, 65)}  # (fused_mlp's second layer)
    # (XLA's CPU GEMMs may sum in another order in the two programs: bf16 gradients moved by
    # a few units in the last place of their largest entry.)
    for name in cases:
        assert_near(padded[0][name], unpadded[0][name], TOL[dtype], f"{name} value")
        for arg, got, want in zip("xwb", padded[1][name], unpadded[1][name], strict=True):
            assert_near(got, want, GRAD_TOL[dtype], f"{name} d{arg}")
    # The aux: ReLU's bits and GELU's z over the N real columns (the padding is unspecified).
    relu_bits = lambda a: np.unpackbits(np.asarray(a), axis=-1, bitorder="little")[..., :65]
    np.testing.assert_array_equal(relu_bits(padded[2]["relu"]), relu_bits(unpadded[2]["relu"]))
    assert_near(padded[2]["gelu"][..., :65], unpadded[2]["gelu"][..., :65], TOL[dtype], "GELU aux")


@pytest.mark.parametrize("row_bytes", [64, 256])
def test_an_aux_keeps_the_layers_layout_at_any_row_width(rng, monkeypatch, cuda_lowerings_on_cpu, cublaslt_accepts, row_bytes):
    """Rows padded wider than 16 bytes (as ``benchmarks.probes.pad_width`` asks) leave each
    aux laid out as the layer's: a forward with an aux pads N, and fused_mlp's DGELU call
    K, no further than the aux's own padding (``aux_columns``), so cuBLASLt never writes or
    reads the aux by a wider row than its buffer has. (On an H100 the GELU forward padded
    to 64 bytes wrote its aux so, and its gradients were wrong: 2026-12-06 (an).) The
    values, auxes and gradients equal the unpadded calls'."""
    seen: list = []
    monkeypatch.setattr(_primitive._ffi, "call", functools.partial(_reference_call, seen))
    for knob in ("_PAD_MIN_ROWS", "_PAD_MIN_WORK", "_WIDE_MIN_N"):
        monkeypatch.setattr(_primitive, knob, 0)
    x = jnp.asarray(rng.standard_normal((2, 9, 29)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((29, 65)) / 6, jnp.bfloat16)
    b, w2 = jnp.asarray(rng.standard_normal(65), jnp.bfloat16), jnp.asarray(rng.standard_normal((65, 6)) / 8, jnp.bfloat16)
    mlp = lambda x, w, b: fused_mlp(x, [(w, b), (w2, None)], ["gelu", None], implementation="cublaslt")

    def results():  # (jitted afresh, so that each lowering reads the row width of its time)
        auxed = {act: jax.jit(functools.partial(op, activation=act, return_aux=True))(x, w, b) for act in ("relu", "gelu")}
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(mlp(*a).astype(jnp.float32))), argnums=(0, 1, 2)))
        return auxed, grad(x, w, b)

    monkeypatch.setattr(_primitive, "_ROW_BYTES", row_bytes)  # (256: wider than _WIDE_ROW_BYTES too)
    wide = results()
    # (the aux's width is the first layer's N, 65: a forward's N, the second layer's DGELU K)
    widths = {(s.problem, s.activation): s.n if s.problem == "forward" else s.k for s in seen if s.has_aux or s.problem == "dgrad"}
    assert set(widths) == {("forward", Activation.RELU), ("forward", Activation.GELU), ("dgrad", None)}
    for (problem, act), width in widths.items():
        act = act or Activation.GELU  # (dgrad's aux is a GELU layer's z)
        assert width > 65 and aux_padded_width(act, width) == aux_padded_width(act, 65), (problem, act, width)
    assert all(s.n % (row_bytes // 2) == 0 for s in seen if s.problem == "forward" and not s.has_aux)  # (the rest pad on)
    seen.clear()
    monkeypatch.setattr(_primitive, "_ROW_BYTES", 1)
    narrow = results()
    assert {s.n for s in seen if s.problem == "forward" and s.has_aux} == {65}
    relu_bits = lambda a: np.unpackbits(np.asarray(a), axis=-1, bitorder="little")[..., :65]
    np.testing.assert_array_equal(relu_bits(wide[0]["relu"][1]), relu_bits(narrow[0]["relu"][1]))
    for act in ("relu", "gelu"):
        assert_near(wide[0][act][0], narrow[0][act][0], TOL["bfloat16"], f"{act} value")
    assert_near(wide[0]["gelu"][1][..., :65], narrow[0]["gelu"][1][..., :65], TOL["bfloat16"], "GELU aux")
    for arg, got, want in zip("xwb", wide[1], narrow[1], strict=True):
        assert_near(got, want, GRAD_TOL["bfloat16"], f"fused_mlp d{arg}")


@pytest.mark.parametrize("return_aux", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("m,pads", [(8192, True), (1024, False), (512, False)])
def test_only_large_problems_pad_their_rows(cublaslt_accepts, dtype, m, pads, return_aux):
    """K = 1020 and N = 4097 go to the call padded to 16-byte rows (1024 and 4104 in
    bfloat16; 1020 and 4100 in float32), a bfloat16 N to 128-byte rows where the call has
    no aux (4160), the layer's result cut back, at 8192 rows; not at 1024 (M*N*K just
    under 2**32) nor at 512 (fewer than 1024 rows; N = 16385, larger)."""
    n = 4097 if m != 512 else 16385
    n_call = {"bfloat16": (4104, 4160), "float32": (4100, 4100)}[dtype][not return_aux] if pads else n
    k = {"bfloat16": 1024, "float32": 1020}[dtype] if pads else 1020
    args = [jax.ShapeDtypeStruct(s, dtype) for s in ((m, 1020), (1020, n), (n,))]
    text = _cuda_text(functools.partial(op, activation="gelu", return_aux=return_aux), *args)
    (call,) = _calls(text)
    assert f"m = {m}" in call and f"n = {n_call}" in call and f"k = {k}" in call, call
    assert f"-> tensor<{m}x{n_call}x{_MLIR_TYPE[dtype]}>" in call or f"-> (tensor<{m}x{n_call}x" in call, call
    assert f"tensor<{m}x{n}x{_MLIR_TYPE[dtype]}>" in text  # the user's y


@pytest.mark.parametrize(
    "n,k,epilog,want",
    [
        (4097, 1020, "GELU_BIAS", (4160, 1024)),  # N to 128 bytes, K to 16
        (4097, 1020, "GELU_AUX_BIAS", (4104, 1024)),  # the aux is round_up(N, 8) wide
        (4097, 1020, "RELU_AUX_BIAS", (4104, 1024)),
        (1025, 4097, "BIAS", (1088, 4104)),
        (1001, 4096, "RELU_BIAS", (1008, 4096)),  # N < 1024: 16 bytes
        (4096, 1020, "GELU_BIAS", (4096, 1024)),  # N aligned stays
        (4104, 1024, "DEFAULT", (4104, 1024)),
    ],
)
def test_a_forward_without_aux_pads_n_to_128_byte_rows(n, k, epilog, want):
    """Which widths a padded bfloat16 call at 8192 rows has (``_primitive._padded_rows``):
    K and an aux's N to 16-byte rows, the N of a forward without aux from 1024 up to 128
    (float32: 16-byte rows, the wider ones unmeasured there)."""
    spec = EpilogSpec(m=8192, n=n, k=k, epilog=epilog, compute_type="COMPUTE_32F", ab_dtype="bfloat16",
                      bias_dtype="bfloat16", d_dtype="bfloat16")  # fmt: skip
    assert (_primitive._padded_rows(spec).n, _primitive._padded_rows(spec).k) == want
    single = _primitive._padded_rows(spec._replace(ab_dtype="float32", bias_dtype="float32", d_dtype="float32"))
    assert (single.n, single.k) == (-(-n // 4) * 4, -(-k // 4) * 4)
    for problem in ("wgrad", "dgrad"):  # their widths are 16-byte rows
        other = _primitive._padded_rows(spec._replace(problem=problem))
        assert (other.n, other.k) == (-(-n // 8) * 8, -(-k // 8) * 8)


_MLIR_TYPE = {"bfloat16": "bf16", "float32": "f32"}
