"""``jax_epilog.primitives.members``: an ensemble's forward (vmap over stacked weights) as
one batched GEMM, its batching (a vmap of an ensemble), its derivatives, and its CUDA
lowering read as text (cuBLASLt's planning stubbed to accept: conftest.py): one
strided-batched call, or a loop of single calls where cuBLASLt cannot batch."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    ENSEMBLES,
    GPU_TOL,
    MEMBERS,
    act_fn,
    assert_scaled_close,
    cuda_text,
    custom_calls,
    jaxpr_text,
    layer_inputs,
    ones_layer,
    oracle,
)
from tolerances import assert_close, epilog_slack

import jax_epilog
from jax_epilog import FastPathWarning, MembersLoopWarning
from jax_epilog.cuda import ffi

op = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")


def _stacked(args, in_axes, members=3):
    return [
        jnp.stack([a * (i + 1) for i in range(members)]) if ax == 0 else a for a, ax in zip(args, in_axes)
    ]


def _first_bits(mask, n):
    return np.unpackbits(np.asarray(mask), axis=-1, bitorder="little")[..., :n].astype(bool)


# ------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    "in_axes, activation",
    [
        ((None, 0, 0), "relu"),
        ((0, 0, 0), "gelu"),
        ((None, 0, None), None),
        ((None, None, 0), "relu"),
        ((0, None, 0), "gelu"),
    ],
    ids=str,
)
def test_vmap_ensemble_matches_python_loop(rng, in_axes, activation):
    """Each member's y and aux are those of its own call, and the float64 oracle's."""
    members, m, k, n, dtype = 3, 6, 24, 37, "float32"
    x = jnp.asarray(rng.standard_normal((members, m, k) if in_axes[0] == 0 else (m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((members, k, n) if in_axes[1] == 0 else (k, n)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal((members, n) if in_axes[2] == 0 else (n,)), dtype)
    f = lambda x, w, b: op(x, w, b, activation=activation, return_aux=True)
    y, aux = jax.jit(jax.vmap(f, in_axes=in_axes))(x, w, b)
    assert y.shape == (members, m, n)
    one = jax.jit(f)
    pick = lambda a, ax, i: a if ax is None else a[i]
    for i in range(members):
        xi, wi, bi = (pick(a, ax, i) for a, ax in zip((x, w, b), in_axes))
        yi, auxi = one(xi, wi, bi)
        expected, z = oracle(xi, wi, bi, activation)
        slack = epilog_slack(dtype, z, bi, activation)
        # Members run from slices of stacked buffers: on a GPU another cuBLASLt algorithm
        # may serve them, so the loop's result is compared with the epilog's slack too.
        assert_close(y[i], yi, dtype, k=k, slack=2 * slack)
        assert_close(y[i], expected, dtype, k=k, slack=slack)
        if activation is None:
            assert aux is None and auxi is None
        elif activation == "relu":
            assert aux.shape == (members, *auxi.shape)
            np.testing.assert_array_equal(_first_bits(aux[i], n), z > 0)
            np.testing.assert_array_equal(_first_bits(aux[i], n), _first_bits(auxi, n))
        else:
            assert aux.shape == (members, *auxi.shape)
            aux_slack = 2 * epilog_slack(dtype, z, bi)
            assert_close(np.asarray(aux[i])[:, :n], np.asarray(auxi)[:, :n], dtype, k=k, slack=aux_slack)


def test_grad_of_vmapped_ensemble(rng):
    x = jnp.asarray(rng.standard_normal((5, 12)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((3, 12, 7)) / 4, jnp.float32)
    bs = jnp.asarray(rng.standard_normal((3, 7)), jnp.float32)

    def loss(ws, bs):
        return jnp.sum(jax.vmap(lambda w, b: op(x, w, b, activation="gelu"))(ws, bs) ** 2)

    def plain(ws, bs):
        z = jnp.einsum("mk,ekn->emn", x, ws, precision=jax.lax.Precision.HIGHEST)  # no TF32 on a GPU
        return jnp.sum(jax.nn.gelu(z + bs[:, None], approximate=True) ** 2)

    got, want = (jax.jit(jax.grad(f, argnums=(0, 1)))(ws, bs) for f in (loss, plain))
    for g, r in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-4, atol=2e-5)


_OUTER = [(0, None, None), (None, 0, None), (None, None, 0), (0, 0, 0), (1, 1, None)]
_INNER = {"x-shared": (None, 0, 0), "x-per-member": (0, 0, 0)}


@pytest.mark.parametrize(
    "outer_axes, inner_axes, activation",
    [
        pytest.param(outer, inner, ("relu", "gelu")[(i + j) % 2], id=f"{outer}-{name}")
        for i, outer in enumerate(_OUTER)
        for j, (name, inner) in enumerate(_INNER.items())
    ],
)
def test_vmap_of_an_ensemble_over_any_operand_matches_plain_math(rng, outer_axes, inner_axes, activation):
    """A vmap around an ensemble (members_p), over any of its operands: the examples fold
    into the rows, or the new axis becomes an outer member dimension (broadcasting the
    operands it leaves out); values and gradients in float64, ReLU's and GELU's."""
    outer, members, m, k, n = 2, 3, 5, 7, 9
    inner_shapes = [(members,) * (a == 0) + s for a, s in zip(inner_axes, ((m, k), (k, n), (n,)))]
    shapes = [s if a is None else s[:a] + (outer,) + s[a:] for a, s in zip(outer_axes, inner_shapes)]
    x, w, b = (rng.standard_normal(s) for s in shapes)

    def nested(layer):
        return jax.vmap(jax.vmap(layer, in_axes=inner_axes), in_axes=outer_axes)

    loss = lambda layer: lambda *a: jnp.sum(jnp.sin(nested(layer)(*a)))
    fused = lambda x, w, b: op(x, w, b, activation=activation)
    plain = lambda x, w, b: act_fn(activation)(x @ w + b)
    np.testing.assert_allclose(
        jax.jit(nested(fused))(x, w, b), nested(plain)(x, w, b), rtol=1e-12, atol=1e-12
    )
    got = jax.jit(jax.grad(loss(fused), argnums=(0, 1, 2)))(x, w, b)
    for g, r in zip(got, jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-12)
    assert MEMBERS in jaxpr_text(nested(fused), x, w, b)


def test_an_ensembles_gradient_differentiates_again(rng):
    """The members' tangents are the forward's own rule batched over the members: a
    gradient penalty's gradient of an ensemble is the plain expression's (float64)."""
    x, w, b = rng.standard_normal((6, 10)), rng.standard_normal((4, 10, 8)) / 3, rng.standard_normal((4, 8))
    layer = lambda f: jax.vmap(f, in_axes=(None, 0, 0))
    fused = layer(lambda x, w, b: op(x, w, b, activation="gelu"))
    plain = layer(lambda x, w, b: act_fn("gelu")(x @ w + b))
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    penalty = lambda f: lambda *a: jnp.sum(jax.grad(loss(f), argnums=1)(*a) ** 2)
    got, want = (jax.jit(jax.grad(penalty(f), argnums=(0, 1, 2)))(x, w, b) for f in (fused, plain))
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10 * float(np.abs(r).max()))


# ---------------------------------------------------------------- the CUDA lowering


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("ensemble", list(ENSEMBLES))
def test_an_ensembles_forward_is_one_batched_call(cublaslt_accepts, ensemble, activation):
    """Each member's D and aux written in place by one strided-batched GEMM (no loop, so
    no copies in and out); a shared operand is passed once, whole."""
    in_axes = ENSEMBLES[ensemble]
    args = _stacked(ones_layer(jnp.bfloat16, jnp.float32), in_axes)
    layer = jax.vmap(functools.partial(op, activation=activation, return_aux=True), in_axes=in_axes)
    text = cuda_text(layer, *args)
    (call,) = custom_calls(text)
    shared = ",".join(name for name, ax in zip(("x", "kernel", "bias"), in_axes) if ax is None)
    assert "members = 3" in call and f'shared = "{shared}"' in call
    assert "stablehlo.while" not in text
    aux = "3x33x16xui8" if activation == "relu" else "3x33x72xf32"  # (members, m, aux width)
    assert call.endswith(f"-> (tensor<3x33x65xf32>, tensor<{aux}>)")  # D in float32 beside the float32 bias


def test_nested_ensembles_are_one_batched_call_over_every_member(cublaslt_accepts):
    x, w, b = (jnp.stack([jnp.stack([a] * 3)] * 2) for a in ones_layer(jnp.bfloat16))
    layer = jax.vmap(jax.vmap(functools.partial(op, activation="gelu")))
    (call,) = custom_calls(cuda_text(layer, x, w, b))
    assert "members = 6" in call and call.endswith("-> tensor<6x33x65xbf16>")


def test_members_sharing_x_and_the_kernel_loop_over_the_single_call(cublaslt_accepts):
    """Only the bias per member: no batched GEMM (nvmath batches by its operands), so the
    loop runs each member's fused call."""
    x, w, b = ones_layer(jnp.bfloat16)
    text = cuda_text(
        jax.vmap(functools.partial(op, activation="relu"), in_axes=(None, None, 0)), x, w, jnp.stack([b] * 3)
    )
    (call,) = custom_calls(text)
    assert "members = 1 " in call and "stablehlo.while" in text


@pytest.mark.parametrize("members", [0, 1])
def test_no_members_or_one_run_as_a_loop(cublaslt_accepts, members):
    args = [jnp.broadcast_to(a, (members, *a.shape)) for a in ones_layer(jnp.bfloat16)]
    text = cuda_text(jax.vmap(functools.partial(op, activation="relu")), *args)
    assert all(call.endswith("-> tensor<33x65xbf16>") for call in custom_calls(text))  # one member's, if any


def test_an_ensembles_gradient_batches_the_forward_and_leaves_the_weight_gradient_to_xla(cublaslt_accepts):
    """Each member's kernel and bias gradients are XLA's batched GEMM and reduction, not a
    loop of BGRADA calls (docs/decisions.md#ensembles)."""
    args = _stacked(ones_layer(jnp.bfloat16), (0, 0, 0))
    loss = lambda *a: jax.vmap(functools.partial(op, activation="gelu"))(*a).astype(jnp.float32).sum()
    text = cuda_text(jax.grad(loss, argnums=(0, 1, 2)), *args)
    (forward,) = custom_calls(text)
    assert "members = 3" in forward and 'epilog = "GELU_AUX_BIAS"' in forward
    assert "stablehlo.while" not in text


def test_explicit_sharding_binds_the_members_batched_call(cublaslt_accepts):
    """Under explicit sharding an ensemble binds members_p itself (typed by its layout),
    not a shard_map or a loop: on one device, one batched call (over several, each
    device's members are one such call: test_partition.py checks the types, blocks and
    collectives there)."""
    mesh = jax.make_mesh(
        (1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,), devices=jax.devices("cpu")[:1]
    )
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    args = [jax.device_put(a, sharding) for a in _stacked(ones_layer(jnp.bfloat16), (0, 0, 0), members=8)]
    with jax.set_mesh(mesh):
        text = cuda_text(jax.vmap(functools.partial(op, activation="gelu")), *args)
    (call,) = custom_calls(text)
    assert "members = 8" in call and call.endswith("-> tensor<8x33x65xbf16>")
    assert "stablehlo.while" not in text


def test_a_refused_batch_runs_one_fused_call_per_member_with_one_warning(monkeypatch, fresh_warnings):
    monkeypatch.setattr(ffi, "prepare", lambda spec: "no batch (test)" if spec.members > 1 else None)
    args = _stacked(ones_layer(jnp.bfloat16), (0, 0, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        text = cuda_text(jax.vmap(functools.partial(op, activation="relu")), *args)
    (call,) = custom_calls(text)
    assert "members = 1 " in call and "stablehlo.while" in text
    assert not [w for w in caught if issubclass(w.category, FastPathWarning)]  # still the fused path
    (warning,) = [w for w in caught if issubclass(w.category, MembersLoopWarning)]
    assert (
        str(warning.message)
        == "jax_epilog: 3 members run one fused call each, not one batched call: no batch (test)"
    )


# ------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_ensemble_runs_the_fused_path_and_differentiates(rng, activation):
    """vmap over the weights without explicit sharding (members_p): the forward is one
    batched custom call, the kernel and bias gradients XLA's batched GEMM and reduction;
    the gradients (ReLU's from the members' bit-masks) are the oracle's."""
    members = [layer_inputs(rng, 40, 24, 72, "bfloat16") for _ in range(3)]
    x, w, b = (jnp.stack(a) for a in zip(*members))
    layer = jax.vmap(lambda x, w, b: op(x, w, b, activation=activation))
    assert MEMBERS in jaxpr_text(layer, x, w, b)
    loss = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = grad.lower(x, w, b).as_text()
    assert text.count(f"@{ffi.TARGET_NAME}(") == 1 and "members = 3" in text  # the batched forward
    y = jax.jit(layer)(x, w, b)
    for i, (xi, wi, bi) in enumerate(members):
        assert_scaled_close(y[i], oracle(xi, wi, bi, activation)[0], GPU_TOL["bfloat16"])
    plain = lambda x, w, b: jnp.sum(act_fn(activation)(jnp.einsum("emk,ekn->emn", x, w) + b[:, None]))
    f32 = [a.astype(jnp.float32) for a in (x, w, b)]
    for g, want in zip(grad(x, w, b), jax.grad(plain, argnums=(0, 1, 2))(*f32), strict=True):
        assert_scaled_close(g, want, GPU_TOL["bfloat16"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, bias_dtype", [("bfloat16", None), ("float16", "float32"), ("float32", None)])
@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("ensemble", list(ENSEMBLES))
def test_an_ensembles_batched_forward_matches_the_oracle_member_by_member(
    rng, ensemble, activation, dtype, bias_dtype
):
    """One strided-batched cuBLASLt call for 3 members; each member's y and aux are its
    own layer's (sizes not multiples of 8: rows, N, and the aux's padding)."""
    in_axes = ENSEMBLES[ensemble]
    m, k, n = 33, 129, 65
    draws = [layer_inputs(rng, m, k, n, dtype, bias_dtype) for _ in range(3)]
    args = [jnp.stack(parts) if ax == 0 else parts[0] for parts, ax in zip(zip(*draws), in_axes)]
    layer = jax.jit(jax.vmap(functools.partial(op, activation=activation, return_aux=True), in_axes=in_axes))
    text = layer.lower(*args).as_text()
    assert text.count(f"@{ffi.TARGET_NAME}(") == 1 and "members = 3" in text
    y, aux = layer(*args)
    for i in range(3):
        xi, wi, bi = (a[i] if ax == 0 else a for a, ax in zip(args, in_axes))
        expected, z = oracle(xi, wi, bi, activation)
        assert_scaled_close(y[i], expected, GPU_TOL[dtype])
        if activation == "relu":
            bits = np.asarray(jax_epilog.unpack_relu_mask(aux[i], n))
            clear = np.abs(z) > 20 * GPU_TOL[dtype]  # signs that rounding cannot flip
            np.testing.assert_array_equal(bits[clear], (z > 0)[clear])
        elif activation == "gelu":
            assert_scaled_close(aux[i][:, :n], z, GPU_TOL[dtype])
    if activation is None:
        assert aux is None


# Ensembles at the edges: (in_axes of each vmap, innermost first; members; (m, k, n);
# dtype; the bias's dtype, or None for no bias; activation).
_EDGE_ENSEMBLES = {
    "no bias": ([(0, 0, None)], 3, (33, 129, 65), "bfloat16", None, "relu"),
    "no bias, x shared": ([(None, 0, None)], 3, (33, 129, 65), "bfloat16", None, "gelu"),
    "x shared, two rows, float32 bias": ([(None, 0, 0)], 3, (2, 40, 24), "float16", "float32", "gelu"),
    "kernel shared, float32 bias": ([(0, None, 0)], 4, (17, 40, 24), "float16", "float32", "relu"),
    "n = 1": ([(0, 0, 0)], 3, (33, 16, 1), "bfloat16", "bfloat16", "relu"),
    "k = 1": ([(0, 0, 0)], 3, (33, 1, 16), "bfloat16", "bfloat16", "gelu"),
    "one row": ([(0, 0, 0)], 3, (1, 64, 64), "bfloat16", "bfloat16", "relu"),
    "one row, float32 bias": ([(0, 0, 0)], 3, (1, 64, 64), "float16", "float32", "relu"),
    "nested, mixed sharing": ([(0, None, 0), (None, 0, 0)], 3, (24, 40, 56), "bfloat16", "bfloat16", "gelu"),
    "nested, per-example inside": ([(0, None, None), (0, 0, 0)], 3, (24, 40, 56), "bfloat16", "bfloat16", "relu"),
    "large, bias shared": ([(0, 0, None)], 8, (1000, 257, 300), "bfloat16", "bfloat16", "relu"),
    "float32, x shared": ([(None, 0, 0)], 5, (8, 16, 24), "float32", "float32", "gelu"),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("explicit", [False, True])
@pytest.mark.parametrize("case", list(_EDGE_ENSEMBLES))
def test_ensemble_edge_cases_match_the_float64_reference(rng, case, explicit):
    """Batched where cuBLASLt can, a loop (or XLA) where it cannot: y and the aux are each
    member's own, also with the members split over an explicit mesh of one GPU."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    levels, members, (m, k, n), dtype, bias_dtype, activation = _EDGE_ENSEMBLES[case]
    shapes = [(m, k), (k, n), (n,)]
    for axes in levels:  # each vmap level adds a leading member dimension
        shapes = [(members, *s) if ax == 0 else s for s, ax in zip(shapes, axes)]
    dtypes, scales = (dtype, dtype, bias_dtype or dtype), (1.0, k**-0.5, 1.0)
    x, w, b = (jnp.asarray(rng.standard_normal(s) * c, d) for s, c, d in zip(shapes, scales, dtypes))
    if explicit:
        mesh = jax.make_mesh((1,), ("e",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
        x, w, b = (
            jax.device_put(a, NamedSharding(mesh, P("e") if ax == 0 else P()))
            for a, ax in zip((x, w, b), levels[-1])
        )
    b = b if bias_dtype else None

    def layer(x, w, b):
        return op(x, w, b, activation=activation, return_aux=True)

    def reference(x, w, b):
        z = jnp.dot(x.astype(jnp.float64), w.astype(jnp.float64))
        z = z if b is None else z + b.astype(jnp.float64)
        return (jax.nn.relu(z) if activation == "relu" else jax.nn.gelu(z, approximate=True)), z

    f, g = layer, reference
    for axes in levels:
        f, g = jax.vmap(f, in_axes=axes), jax.vmap(g, in_axes=axes)
    (y, aux), (want, z) = jax.jit(f)(x, w, b), jax.jit(g)(x, w, b)
    assert_scaled_close(y, np.asarray(want), GPU_TOL[dtype])
    z = np.asarray(z)
    if activation == "relu":
        bits = np.unpackbits(np.asarray(aux), axis=-1, bitorder="little")[..., :n].astype(bool)
        clear = np.abs(z) > 20 * GPU_TOL[dtype]  # signs that rounding cannot flip
        np.testing.assert_array_equal(bits[clear], (z > 0)[clear])
    else:
        assert_scaled_close(np.asarray(aux, np.float64)[..., :n], z, GPU_TOL[dtype])


@pytest.mark.gpu
def test_nested_ensembles_run_one_batched_call(rng):
    draws = [[layer_inputs(rng, 24, 40, 56, "bfloat16") for _ in range(3)] for _ in range(2)]
    x, w, b = (jnp.stack([jnp.stack([member[p] for member in row]) for row in draws]) for p in range(3))
    layer = jax.jit(jax.vmap(jax.vmap(functools.partial(op, activation="relu"))))
    assert "members = 6" in layer.lower(x, w, b).as_text()
    y = layer(x, w, b)
    for i, row in enumerate(draws):
        for j, (xi, wi, bi) in enumerate(row):
            assert_scaled_close(y[i, j], oracle(xi, wi, bi, "relu")[0], GPU_TOL["bfloat16"])


@pytest.mark.gpu
def test_explicit_sharding_ensemble_runs_one_batched_fused_call(rng):
    """vmap over the weights with the members split over an explicit mesh (of one GPU):
    members_p, typed by its layout, runs each device's members' forward as one batched
    custom call, with the oracle's numbers; the gradients keep the split."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    members = [layer_inputs(rng, 40, 24, 72, "bfloat16") for _ in range(3)]
    x, w, b = (jax.device_put(jnp.stack(a), NamedSharding(mesh, P("data"))) for a in zip(*members))
    layer = jax.vmap(lambda x, w, b: op(x, w, b, activation="gelu"))
    grad = jax.jit(
        jax.value_and_grad(lambda *a: jnp.sum(layer(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    )
    jaxpr = jaxpr_text(layer, x, w, b)
    assert MEMBERS in jaxpr and "shard_map" not in jaxpr
    text = grad.lower(x, w, b).as_text()
    assert text.count(f"@{ffi.TARGET_NAME}(") == 1 and "members = 3" in text, text  # the batched forward
    y = jax.jit(layer)(x, w, b)
    assert jax.typeof(y).sharding.spec == P("data", None, None)
    for i, (xi, wi, bi) in enumerate(members):
        assert_scaled_close(y[i], oracle(xi, wi, bi, "gelu")[0], GPU_TOL["bfloat16"])
    _, grads = grad(x, w, b)
    assert all(jax.typeof(g).sharding.spec[0] == "data" for g in grads)
