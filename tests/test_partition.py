"""fused_dense and fused_mlp over several devices (four virtual CPU devices, conftest.py).

The primitives split by rows, and by N where the weights are column-parallel, through
custom_partitioning (jax_epilog/_partition.py) on every platform, so these CPU tests run the
same partitioning rules a multi-GPU program does: each device must compute its own block
only (the spies below record the shapes the per-device computation sees), the results must
equal the float64 reference, and the weight gradients must be summed over the devices
exactly once.
"""

from __future__ import annotations

import functools
import math
import re

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
    oracle,
    problems,
    run_python,
)
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_epilog
from jax_epilog import _partition, _reference, override_policy
from jax_epilog.primitives import forward

fused_dense = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")
CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 CPU devices (conftest.py sets XLA_FLAGS)")
TOL = 1e-12  # float64: the only differences are the order of the sums


def mesh(shape, names, axis_type=AxisType.Auto):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names), devices=CPUS[: math.prod(shape)])


@pytest.fixture(params=["shardy", "gspmd"])
def partitioner(request):
    """Each partitioner XLA may run: Shardy (jax's default) and GSPMD. (A test that needs
    only some cases under GSPMD names them: ``parametrize("partitioner", ..., indirect=True)``.)"""
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", request.param == "shardy")
    yield request.param
    jax.config.update("jax_use_shardy_partitioner", before)


@pytest.fixture
def seen(monkeypatch):
    """The (rows, K, N) of every per-device forward and weight gradient that gets traced."""
    shapes = {"dense": [], "weight_grad": []}

    def spy(name):
        original = getattr(_reference, name)

        def wrapper(a, b, *args, **kwargs):
            shapes[name].append((math.prod(a.shape[:-1]), a.shape[-1], b.shape[-1]))  # (rows folded)
            return original(a, b, *args, **kwargs)

        monkeypatch.setattr(_reference, name, wrapper)

    spy("dense")
    spy("weight_grad")
    return shapes


def weight_grad_traced(activation, per_device, whole):
    """What ``seen["weight_grad"]`` holds after one gradient: the fused weight-gradient
    primitive traces it on each device's block; ReLU's backward calls it on the whole
    arrays itself, once, and XLA splits that GEMM and reduction like any of its own."""
    return [whole if activation == "relu" else per_device]


def operands(rng, m, k, n):
    x = rng.standard_normal((m, k))
    w = rng.standard_normal((k, n)) / np.sqrt(k)
    b = rng.standard_normal(n)
    return x, w, b


def put(mesh_, array, *spec):
    return jax.device_put(array, NamedSharding(mesh_, P(*spec)))


def reference(x, w, b, activation):
    return act_fn(activation)(jnp.asarray(x) @ w + (0.0 if b is None else b))


def assert_near(actual, expected):
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=TOL, atol=TOL * np.abs(expected).max())


def fused_layer(x, w, b, activation):
    return fused_dense(x, w, b, activation=activation)


def layer_grads(loss, sharded, plain, argnums=(0, 1, 2)):
    """``loss(layer)`` differentiated with the fused layer on the sharded arrays (jitted),
    compared with the reference layer on the host arrays; returns the jitted gradient and
    its results."""
    grad = jax.jit(jax.grad(loss(fused_layer), argnums=argnums))
    got = grad(*sharded)
    want = jax.jit(jax.grad(loss(reference), argnums=argnums))(*plain)
    for g, r in zip(got, want, strict=True):
        assert_near(g, r)
    return grad, got


def collectives(compiled_text: str) -> dict[str, int]:
    return {op: compiled_text.count(f" {op}(") for op in ("all-gather", "all-reduce", "all-to-all")}


def all_reduced_bytes(compiled_text: str) -> int:
    """The bytes every all-reduce of a compiled program sums, together (a sum over two mesh
    axes in two steps counts twice)."""
    total = 0
    for types in re.findall(r"= \(?([^=]*?)\)? all-reduce\(", compiled_text):
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", types):
            bits = int(re.sub(r"\D", "", dtype) or 8)  # (f64, bf16, u8; pred)
            total += bits // 8 * math.prod(int(d) for d in dims.split(",") if d)
    return total


@pytest.mark.parametrize(
    "partitioner, activation, with_bias",
    [
        (p, act, (i + j) % 2 == 0)
        for i, p in enumerate(["shardy", "gspmd"])
        for j, act in enumerate([None, "relu", "gelu"])
    ],
    ids=str,
    indirect=["partitioner"],
)
def test_forward_computes_each_devices_rows_on_that_device(rng, seen, partitioner, activation, with_bias):
    m4 = mesh((4,), ("data",))
    x, w, b = operands(rng, 4 * 13, 29, 37)
    b = b if with_bias else None
    args = (put(m4, x, "data"), put(m4, w), None if b is None else put(m4, b))
    f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation=activation))
    y = f(*args)
    assert_near(y, reference(x, w, b, activation))
    assert y.sharding.spec[0] == "data"
    assert seen["dense"] == [(13, 29, 37)]  # one device's rows, whole weights
    assert collectives(f.lower(*args).compile().as_text()) == {
        "all-gather": 0,
        "all-reduce": 0,
        "all-to-all": 0,
    }


@pytest.mark.parametrize(
    "partitioner, activation",
    [("shardy", None), ("shardy", "relu"), ("shardy", "gelu"), ("gspmd", "gelu")],
    ids=str,
    indirect=["partitioner"],
)
def test_gradients_sum_the_devices_weight_gradients_once(rng, seen, partitioner, activation):
    m4 = mesh((4,), ("data",))
    x, w, b = operands(rng, 4 * 11, 23, 19)
    dy = rng.standard_normal((4 * 11, 19))

    def loss(layer):
        return lambda x, w, b, dy: jnp.sum(layer(x, w, b, activation) * dy)

    args = (put(m4, x, "data"), put(m4, w), put(m4, b), put(m4, dy, "data"))
    grad, got = layer_grads(loss, args, (x, w, b, dy))
    assert got[0].sharding.spec[0] == "data"
    assert got[1].sharding.is_fully_replicated and got[2].sharding.is_fully_replicated
    assert seen["weight_grad"] == weight_grad_traced(activation, (11, 23, 19), (44, 23, 19))
    text = grad.lower(*args).compile().as_text()
    assert collectives(text)["all-gather"] == 0
    assert collectives(text)["all-reduce"] >= 1  # the kernel and bias gradients' sums


def test_rows_split_over_two_mesh_axes_and_weights_split_along_n(rng, seen, partitioner):
    """Rows over ("data", "fsdp") together; the kernel and bias split along N over an axis
    that also splits the rows (as FSDP stores them) are gathered whole for the GEMM."""
    m22 = mesh((2, 2), ("data", "fsdp"))
    x, w, b = operands(rng, 4 * 5, 17, 24)
    dy = rng.standard_normal((4 * 5, 24))
    args = (put(m22, x, ("data", "fsdp")), put(m22, w, None, "fsdp"), put(m22, b, "fsdp"))

    def loss(layer):
        return lambda x, w, b: jnp.sum(layer(x, w, b, "gelu") * dy)

    layer_grads(loss, args, (x, w, b))
    np.testing.assert_allclose(
        float(jax.jit(loss(fused_layer))(*args)), float(loss(reference)(x, w, b)), rtol=TOL
    )
    assert set(seen["dense"]) == {(5, 17, 24)}  # traced twice: the gradient and the loss
    assert seen["weight_grad"] == [(5, 17, 24)]


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
def test_column_parallel_weights_keep_each_devices_columns(rng, seen, partitioner, activation):
    """Rows over "data" and the kernel and bias split along N over "model" (tensor
    parallelism's column-parallel layer): each device computes its rows of its columns,
    and the forward needs no communication."""
    m22 = mesh((2, 2), ("data", "model"))
    x, w, b = operands(rng, 2 * 7, 19, 2 * 11)
    args = (put(m22, x, "data"), put(m22, w, None, "model"), put(m22, b, "model"))
    f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation=activation))
    y = f(*args)
    assert_near(y, reference(x, w, b, activation))
    assert y.sharding.spec == P("data", "model")
    assert seen["dense"] == [(7, 19, 11)]
    assert collectives(f.lower(*args).compile().as_text()) == {
        "all-gather": 0,
        "all-reduce": 0,
        "all-to-all": 0,
    }


def column_parallel_grads(rng, rows, k, n, activation):
    """A layer's gradients with x split by rows over "data" and the kernel and bias split
    along N over "model" (checked against the reference): (jitted gradient, its results,
    the sharded operands)."""
    m22 = mesh((2, 2), ("data", "model"))
    x, w, b = operands(rng, 2 * rows, k, n)
    dy = rng.standard_normal((2 * rows, n))

    def loss(layer):
        return lambda x, w, b, dy: jnp.sum(layer(x, w, b, activation) * dy)

    args = (
        put(m22, x, "data"),
        put(m22, w, None, "model"),
        put(m22, b, "model"),
        put(m22, dy, "data", "model"),
    )
    grad, got = layer_grads(loss, args, (x, w, b, dy))
    return grad, got, args


@pytest.mark.parametrize(
    "partitioner, activation, n",
    [
        ("shardy", "relu", 2 * 128),
        ("shardy", "gelu", 2 * 16),
        ("shardy", None, 2 * 9),
        ("gspmd", "relu", 2 * 128),
    ],
    ids=str,
    indirect=["partitioner"],
)
def test_column_parallel_gradients_keep_the_weights_split(rng, seen, partitioner, activation, n):
    """The gradient of a column-parallel layer whose aux splits with N, unpadded on each
    device (its N a multiple of 128 for ReLU's bits, of 8 for GELU's z): the forward and
    the kernel-gradient GEMM each run on one device's rows and columns, the kernel and bias
    gradients come back split like the weights, and no weight is gathered (the sums over
    rows and over N are all-reduces)."""
    grad, got, args = column_parallel_grads(rng, 5, 13, n, activation)
    assert [g.sharding.spec for g in got] == [P("data"), P(None, "model"), P("model")]
    assert seen["dense"] == [(5, 13, n // 2)] * (activation is not None)  # (no activation: XLA's dot)
    assert seen["weight_grad"] == weight_grad_traced(activation, (5, 13, n // 2), (10, 13, n))
    text = grad.lower(*args).compile().as_text()
    assert collectives(text)["all-gather"] == 0
    assert collectives(text)["all-reduce"] >= 2  # dx over "model"; the weight gradients over "data"


@pytest.mark.parametrize(
    "partitioner, activation, n",
    [("shardy", "relu", 2 * 64), ("shardy", "gelu", 2 * 12), ("gspmd", "gelu", 2 * 12)],
    ids=str,
    indirect=["partitioner"],
)
def test_each_device_cuts_its_aux_from_its_own(rng, seen, partitioner, activation, n):
    """Each device's N no multiple of the aux's padding (128 bits for ReLU, 8 for GELU):
    each device still computes its own columns, and cuts its share of the unpadded aux
    from its own padded one; no weight is gathered."""
    grad, got, args = column_parallel_grads(rng, 6, 9, n, activation)
    assert seen["dense"] == [(6, 9, n // 2)]
    assert seen["weight_grad"] == weight_grad_traced(activation, (6, 9, n // 2), (12, 9, n))
    assert got[1].sharding.spec == P(None, "model")
    assert collectives(grad.lower(*args).compile().as_text())["all-gather"] == 0


@pytest.mark.parametrize(
    "partitioner, activation, n",
    [("shardy", "relu", 2 * 40), ("shardy", "gelu", 2 * 9), ("gspmd", "relu", 2 * 40)],
    ids=str,
    indirect=["partitioner"],
)
def test_a_padded_aux_keeps_n_whole_in_the_forward(rng, seen, partitioner, activation, n):
    """N no multiple of the aux's padding: the aux cannot be cut along N, so the forward
    that saves it gathers the weights and each device computes every column; it keeps its
    own block of y (split as without an aux) and the whole aux. The kernel gradient still
    splits."""
    _, got, (x, w, b, _) = column_parallel_grads(rng, 6, 9, n, activation)
    assert seen["dense"] == [(6, 9, n)]
    assert seen["weight_grad"] == weight_grad_traced(activation, (6, 9, n // 2), (12, 9, n))
    assert got[1].sharding.spec == P(None, "model")
    y, aux = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation=activation, return_aux=True))(x, w, b)
    assert_near(y, reference(*(np.asarray(a) for a in (x, w, b)), activation))
    assert (y.sharding.spec, aux.sharding.spec) == (P("data", "model"), P("data"))


@pytest.mark.parametrize("devices,n,whole", [(16, 128, ()), (32, 128, (1,)), (2, 40, (1,)), (1, 128, ())])
def test_relu_bits_split_only_by_whole_bytes(devices, n, whole):
    """The ReLU aux packs 8 columns a byte: where a device's N (n / devices) is no multiple
    of 8, the rule keeps the aux whole and gathers the operands' N (the rule alone; such a
    gradient: the test below)."""
    abstract = jax.sharding.AbstractMesh((devices,), ("model",))
    x, w = jax.ShapeDtypeStruct((64, 8), jnp.float32), jax.ShapeDtypeStruct((8, n), jnp.float32)
    layout = forward.layout((x, w), activation="relu", with_aux=True)
    shardings = [NamedSharding(abstract, P()), NamedSharding(abstract, P(None, "model"))]
    split = _partition._split(layout, abstract, [x.shape, w.shape], shardings)
    assert split == _partition.Split(((),), ("model",), whole)


def run_in_a_fresh_process(devices: int, script: str, partitioner_name: str, rng) -> None:
    """``script`` in a new interpreter with ``devices`` virtual CPU devices on a mesh of
    one Auto axis ("axis"), the named partitioner, float64, and ``rng`` seeded from this
    test's; its failure (an exception, or an abort) fails the test with its stderr."""
    preamble = f"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"  # (on a GPU machine too: the rule on CPU devices)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
jax.config.update("jax_use_shardy_partitioner", sys.argv[1] == "shardy")
jax.config.update("jax_enable_x64", True)
import jax_epilog
mesh = jax.make_mesh(({devices},), ("axis",), axis_types=(jax.sharding.AxisType.Auto,))
rng = np.random.default_rng(int(sys.argv[2]))
"""
    done = run_python(preamble + script, partitioner_name, str(int(rng.integers(1 << 31))))
    assert done.returncode == 0, done.stderr[-3000:]


_RELU_ON_32_DEVICES = """
x, w, b = rng.standard_normal((6, 9)), rng.standard_normal((9, 128)) / 3, rng.standard_normal(128)
put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
loss = lambda layer: lambda x, w, b: jnp.sum(layer(x, w, b) ** 2)
fused = loss(lambda x, w, b: jax_epilog.fused_dense(x, w, b, activation="relu", implementation="cublaslt"))
got = jax.jit(jax.grad(fused, argnums=(0, 1, 2)))(put(x), put(w, None, "axis"), put(b, "axis"))
want = jax.jit(jax.grad(loss(lambda x, w, b: jax.nn.relu(x @ w + b)), argnums=(0, 1, 2)))(x, w, b)
for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-12, atol=1e-12)
"""


@pytest.mark.parametrize("partitioner_name", ["gspmd", "shardy"])
def test_relu_gradient_with_n_split_into_less_than_a_byte_a_device(rng, partitioner_name):
    """A ReLU layer's gradient with N = 128 split over 32 devices (4 columns, half a byte
    of the aux, each). dy's columns ask for the aux split over part of the mesh axis (a
    [1, 16, 2] tiling), which no PartitionSpec names: jax's custom_partitioning raised an
    IndivisibleError decoding that result's sharding, under both partitioners, until the
    rule took over decoding (of the operands only: _partition._decoded). 32 CPU devices,
    in a fresh process."""
    run_in_a_fresh_process(32, _RELU_ON_32_DEVICES, partitioner_name, rng)


def test_rows_that_do_not_divide_evenly_are_gathered(rng, seen):
    """30 of 32 split rows (a slice inside the jit): no device gets a padded block."""
    m4 = mesh((4,), ("data",))
    x, w, b = operands(rng, 4 * 8, 9, 11)

    def loss(layer):
        return lambda x, w, b: jnp.sum(layer(x[:30], w, b, "relu") ** 2)

    layer_grads(loss, (put(m4, x, "data"), put(m4, w), put(m4, b)), (x, w, b))
    assert seen["dense"] == [(30, 9, 11)] and seen["weight_grad"] == [(30, 9, 11)]


def test_inside_shard_map_the_fused_calls_lower_and_the_weight_gradients_sum(cublaslt_accepts):
    """A linked GELU block in a shard_map over rows, lowered for "cuda": each device's
    forward, DGELU and BGRADA calls on its own rows, and an all-reduce for each weight
    gradient (w1, b1, w2: the weights are the same on every device). Before, jax refused
    the backward's types there."""
    m4 = mesh((4,), ("data",))
    x, w1, b1 = (
        jnp.ones((4 * 33, 129), jnp.bfloat16),
        jnp.ones((129, 65), jnp.bfloat16),
        jnp.ones((65,), jnp.bfloat16),
    )
    w2 = jnp.ones((65, 17), jnp.bfloat16)

    def block(x, w1, b1, w2):
        return jax_epilog.fused_mlp(x, [(w1, b1), (w2, None)], ["gelu", None], implementation="cublaslt")

    sharded = jax.shard_map(block, mesh=m4, in_specs=(P("data"), P(), P(), P()), out_specs=P("data"))
    loss = lambda *args: sharded(*args).astype(jnp.float32).sum()
    text = cuda_text(jax.grad(loss, argnums=(0, 1, 2, 3)), x, w1, b1, w2)
    assert sorted(problems(text)) == ["dgrad", "forward", "wgrad"]
    assert all("m = 33" in call for call in custom_calls(text))  # each device's rows
    assert text.count("stablehlo.all_reduce") == 3


def test_inside_shard_map_each_device_runs_its_block(rng, seen):
    m4 = mesh((4,), ("data",))
    x, w, b = operands(rng, 4 * 6, 10, 13)
    f = jax.jit(
        jax.shard_map(
            lambda x, w, b: fused_dense(x, w, b, activation="relu"),
            mesh=m4,
            in_specs=(P("data"), P(), P()),
            out_specs=P("data"),
        )
    )
    assert_near(f(put(m4, x, "data"), put(m4, w), put(m4, b)), reference(x, w, b, "relu"))
    assert seen["dense"] == [(6, 10, 13)]


def inside_shard_map(layer, m4, x_spec, w_spec, out_spec):
    """``layer(x, w, b)`` in a shard_map over "data" (b split as w's last dimension)."""
    b_spec = P(*w_spec[1:])
    return jax.shard_map(layer, mesh=m4, in_specs=(x_spec, w_spec, b_spec), out_specs=out_spec)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize(
    "x_spec, w_spec, out_spec",
    [(P("data"), P(), P("data")), (P(), P(None, "data"), P(None, "data"))],
    ids=["rows-per-device", "columns-per-device"],
)
def test_inside_shard_map_results_vary_by_device_and_gradients_sum_over_them(
    rng, activation, x_spec, w_spec, out_spec
):
    """Inside shard_map jax types each value by the mesh axes it differs over: a result
    computed from per-device rows (or columns) differs by device, so an out_spec that
    says it does not is refused (before, the fused call's results claimed to be the same
    everywhere, and out_specs=P() returned device 0's block). The gradient of an operand
    that is the same on every device sums every device's part (before, jax refused the
    backward's types)."""
    m4 = mesh((4,), ("data",))
    x, w, b = operands(rng, 4 * 5, 9, 4 * 3)
    layer = lambda x, w, b: fused_dense(x, w, b, activation=activation)
    with pytest.raises(ValueError, match="out_specs"):
        jax.jit(inside_shard_map(lambda *a: layer(*a).sum(0), m4, x_spec, w_spec, P()))(x, w, b)
    loss = lambda f: lambda x, w, b: jnp.sum(jnp.sin(f(x, w, b)))
    got = jax.jit(jax.grad(loss(inside_shard_map(layer, m4, x_spec, w_spec, out_spec)), argnums=(0, 1, 2)))(
        x, w, b
    )
    want = jax.jit(jax.grad(loss(lambda x, w, b: reference(x, w, b, activation)), argnums=(0, 1, 2)))(x, w, b)
    for g, r in zip(got, want, strict=True):
        assert_near(g, r)


def test_inside_shard_map_a_fused_mlp_and_an_ensemble_differentiate(rng):
    """The same inside shard_map for fused_mlp's linked backward (its DGELU primitive) and
    for an ensemble (members_p), weights the same on every device."""
    m4 = mesh((4,), ("data",))
    x, w1, b1 = operands(rng, 4 * 6, 10, 16)
    w2 = rng.standard_normal((16, 7)) / 4
    ws, bs = rng.standard_normal((3, 10, 16)) / 3, rng.standard_normal((3, 16))

    def mlp(x, w1, b1, w2):
        return jax_epilog.fused_mlp(x, [(w1, b1), (w2, None)], ["gelu", None], implementation="cublaslt")

    def plain_mlp(x, w1, b1, w2):
        return reference(reference(x, w1, b1, "gelu"), w2, None, None)

    def members(x, ws, bs):
        return jax.vmap(lambda w, b: fused_dense(x, w, b, activation="relu"))(ws, bs)

    def plain_members(x, ws, bs):
        return jax.nn.relu(jnp.einsum("mk,ekn->emn", x, ws) + bs[:, None])

    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for f, plain, args, out_spec in (
        (mlp, plain_mlp, (x, w1, b1, w2), P("data")),
        (members, plain_members, (x, ws, bs), P(None, "data")),
    ):
        in_specs = (P("data"), *(P() for _ in args[1:]))
        sharded = jax.shard_map(f, mesh=m4, in_specs=in_specs, out_specs=out_spec)
        got = jax.jit(jax.grad(loss(sharded), argnums=tuple(range(len(args)))))(*args)
        for g, r in zip(
            got, jax.jit(jax.grad(loss(plain), argnums=tuple(range(len(args)))))(*args), strict=True
        ):
            assert_near(g, r)


def test_fused_mlp_over_split_rows(rng, seen):
    """fused_mlp's linked backward (the GELU layer's dz from the next GEMM) on split rows."""
    m4 = mesh((4,), ("data",))
    x, w1, b1 = operands(rng, 4 * 9, 12, 20)
    _, w2, b2 = operands(rng, 1, 20, 7)
    dy = rng.standard_normal((4 * 9, 7))

    def loss(mlp):
        return lambda x, w1, b1, w2, b2: jnp.sum(mlp(x, w1, b1, w2, b2) * dy)

    fused = loss(
        lambda x, w1, b1, w2, b2: jax_epilog.fused_mlp(
            x, [(w1, b1), (w2, b2)], ["gelu", None], implementation="cublaslt"
        )
    )
    plain = loss(lambda x, w1, b1, w2, b2: reference(reference(x, w1, b1, "gelu"), w2, b2, None))
    args = (x, w1, b1, w2, b2)
    sharded = (put(m4, x, "data"), *(put(m4, a) for a in args[1:]))
    got = jax.jit(jax.grad(fused, argnums=tuple(range(5))))(*sharded)
    want = jax.jit(jax.grad(plain, argnums=tuple(range(5))))(*args)
    for g, r in zip(got, want):
        assert_near(g, r)
    assert {s[0] for s in seen["dense"] + seen["weight_grad"]} == {9}


def test_fused_mlp_with_megatron_style_weights(rng, seen, partitioner):
    """The first kernel split along N (column-parallel), the second along K (row-parallel):
    the first layer computes its columns, the second gathers its input and kernel (the
    epilog needs the whole sum), and the gradients are exact."""
    m22 = mesh((2, 2), ("data", "model"))
    x, w1, b1 = operands(rng, 2 * 5, 11, 2 * 16)
    _, w2, b2 = operands(rng, 1, 2 * 16, 9)
    dy = rng.standard_normal((2 * 5, 9))

    def loss(mlp):
        return lambda x, w1, b1, w2, b2: jnp.sum(mlp(x, w1, b1, w2, b2) * dy)

    fused = loss(
        lambda x, w1, b1, w2, b2: jax_epilog.fused_mlp(
            x, [(w1, b1), (w2, b2)], ["gelu", "relu"], implementation="cublaslt"
        )
    )
    plain = loss(lambda x, w1, b1, w2, b2: reference(reference(x, w1, b1, "gelu"), w2, b2, "relu"))
    args = (x, w1, b1, w2, b2)
    specs = (("data",), (None, "model"), ("model",), ("model", None), ())
    sharded = [put(m22, a, *spec) for a, spec in zip(args, specs, strict=True)]
    got = jax.jit(jax.grad(fused, argnums=tuple(range(5))))(*sharded)
    want = jax.jit(jax.grad(plain, argnums=tuple(range(5))))(*args)
    for g, r in zip(got, want, strict=True):
        assert_near(g, r)
    assert seen["dense"] == [(5, 11, 16), (5, 32, 9)]


def test_linen_layer_with_partitioned_params_is_column_parallel(rng, seen):
    """The Flax way to ask for tensor parallelism (``nn.with_partitioning`` on the kernel and
    bias) reaches the fused layer: its parameters live split along N, and the forward and
    the kernel gradient each run on one device's rows and columns."""
    import flax.linen as nn

    from jax_epilog.linen import FusedDense

    m22 = mesh((2, 2), ("data", "model"))
    layer = FusedDense(
        2 * 24,
        activation="gelu",
        param_dtype=jnp.float64,
        implementation="cublaslt",
        kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model")),
        bias_init=nn.with_partitioning(nn.initializers.normal(1.0), ("model",)),
    )
    x_host = rng.standard_normal((2 * 6, 20))
    x = put(m22, x_host, "data")
    with jax.set_mesh(m22):
        specs = nn.get_partition_spec(jax.eval_shape(layer.init, jax.random.key(0), x))
        shardings = jax.tree.map(lambda spec: NamedSharding(m22, spec), specs)
        params = jax.jit(layer.init, out_shardings=shardings)(jax.random.key(0), x)
        grads = jax.jit(jax.grad(lambda p, x: jnp.sum(layer.apply(p, x) ** 2)))(params, x)
    kernel, bias = (nn.meta.unbox(params)["params"][name] for name in ("kernel", "bias"))
    assert kernel.sharding.spec == P(None, "model")
    want = jax.jit(jax.grad(lambda k, b: jnp.sum(reference(x_host, k, b, "gelu") ** 2), argnums=(0, 1)))(
        np.asarray(kernel), np.asarray(bias)
    )
    got = nn.meta.unbox(grads)["params"]
    assert_near(got["kernel"], want[0])
    assert_near(got["bias"], want[1])
    assert got["kernel"].sharding.spec == P(None, "model")
    assert seen["dense"] == [(6, 20, 24)] and seen["weight_grad"] == [(6, 20, 24)]


def test_one_device_lowers_without_a_partitioning_call(rng):
    x, w, b = operands(rng, 8, 5, 3)
    f = jax.jit(jax.grad(lambda x, w, b: jnp.sum(fused_dense(x, w, b, activation="relu")), argnums=(0, 1, 2)))
    text = f.lower(x, w, b).as_text()
    assert "CustomSPMDPartitioning" not in text
    sharded = f.lower(
        *(put(mesh((4,), ("data",)), a, *(("data",) if a is x else ())) for a in (x, w, b))
    ).as_text()
    assert "CustomSPMDPartitioning" in sharded  # the rule is in force once there are several


def test_without_jaxs_device_hook_the_primitives_lower_whole(monkeypatch):
    """A jax without the (private) set of primitives that get their devices at lowering:
    the primitives lower directly, whole (XLA gathers their operands; correct, slower)."""
    monkeypatch.setattr(_partition, "_NEEDS_DEVICES", None)
    direct = lambda ctx, *args, **params: None
    assert _partition.partitioned_lowering(forward.fused_matmul_p, direct, forward.layout) is direct


NO_COLLECTIVES = {"all-gather": 0, "all-reduce": 0, "all-to-all": 0}


def ensemble(rng, n):
    """Eight members' (x, kernel, bias): (8, 6, 10), (8, 10, n), (8, n)."""
    return rng.standard_normal((8, 6, 10)), rng.standard_normal((8, 10, n)) / 3, rng.standard_normal((8, n))


def plain_ensemble(activation):
    """The members' layers in XLA's ops; x per member (e, m, k) or shared (m, k)."""

    def layers(x, w, b):
        z = jnp.einsum("emk,ekn->emn" if x.ndim == 3 else "mk,ekn->emn", x, w) + b[:, None]
        return act_fn(activation)(z)

    return layers


@pytest.mark.parametrize(
    "partitioner, activation",
    [("shardy", "relu"), ("shardy", "gelu"), ("gspmd", "gelu")],
    ids=str,
    indirect=["partitioner"],
)
def test_ensemble_split_over_members(rng, seen, activation, partitioner):
    """vmap over weights (an ensemble) whose members are split over devices: each device
    loops over its own members, forward and backward, with no collective, whether x is
    per member or shared (members_p's lowering; a plain loop's members XLA gathered onto
    every device)."""
    m4 = mesh((4,), ("data",))
    x, w, b = ensemble(rng, 16)
    xs, ws, bs = (put(m4, a, "data") for a in (x, w, b))
    layer = functools.partial(fused_dense, activation=activation)
    for in_axes, args, x_in in (((0, 0, 0), (xs, ws, bs), x), ((None, 0, 0), (put(m4, x[0]), ws, bs), x[0])):
        f = jax.jit(jax.vmap(layer, in_axes=in_axes))
        y = f(*args)
        assert_near(y, plain_ensemble(activation)(x_in, w, b))
        assert y.sharding.spec[0] == "data"
        assert collectives(f.lower(*args).compile().as_text()) == NO_COLLECTIVES
    assert seen["dense"] == [(6, 10, 16)] * 2  # one member at a time
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    grad = jax.jit(jax.grad(loss(jax.vmap(layer)), argnums=(0, 1, 2)))
    for got, want in zip(
        grad(xs, ws, bs), jax.jit(jax.grad(loss(plain_ensemble(activation)), argnums=(0, 1, 2)))(x, w, b)
    ):
        assert_near(got, want)
        assert got.sharding.spec[0] == "data"
    assert collectives(grad.lower(xs, ws, bs).compile().as_text()) == NO_COLLECTIVES


@pytest.mark.parametrize(
    "specs, per_member",
    [
        ((P("a", "b"), P("a"), P("a")), (3, 10, 8)),  # each device's rows of its members
        ((P("a"), P("a", None, "b"), P("a", "b")), (6, 10, 4)),  # its columns (the aux cut)
        ((P(None, "b"), P("a"), P("a")), (3, 10, 8)),  # x's members follow the kernel's
    ],
    ids=["rows-b", "cols-b", "x-members-whole"],
)
@pytest.mark.parametrize("partitioner", ["shardy"], indirect=True)
def test_ensemble_on_a_two_axis_mesh_splits_members_rows_and_columns(
    rng, seen, specs, per_member, partitioner
):
    """Members over "a" and each member's rows or N over "b": each device runs its own
    members on its own block, gathering nothing in the forward."""
    m = mesh((2, 2), ("a", "b"))
    x, w, b = ensemble(rng, 8)
    args = [put(m, a, *spec) for a, spec in zip((x, w, b), specs)]
    layer = jax.vmap(functools.partial(fused_dense, activation="gelu"))
    f = jax.jit(layer)
    assert_near(f(*args), plain_ensemble("gelu")(x, w, b))
    assert seen["dense"] == [per_member]
    assert collectives(f.lower(*args).compile().as_text())["all-gather"] == 0
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    got = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2)))(*args)
    for g, want in zip(got, jax.jit(jax.grad(loss(plain_ensemble("gelu")), argnums=(0, 1, 2)))(x, w, b)):
        assert_near(g, want)


@pytest.mark.parametrize("partitioner", ["shardy"], indirect=True)
def test_ensemble_of_fused_mlps_keeps_members_split(rng, partitioner):
    """An ensemble of linked GELU blocks (each member's DGELU and kernel gradient XLA's
    batched GEMMs) differentiates with each device on its own members, with no collective."""
    m4 = mesh((4,), ("data",))
    x, w1, b1 = ensemble(rng, 12)
    w2 = rng.standard_normal((8, 12, 5)) / 3
    args = [put(m4, jnp.asarray(a, jnp.float32), "data") for a in (x, w1, b1, w2)]  # (float64 is not linked)

    def block(x, w1, b1, w2):
        return jax_epilog.fused_mlp(x, [(w1, b1), (w2, None)], ["gelu", None], implementation="cublaslt")

    def plain(x, w1, b1, w2):
        return jnp.einsum("emk,ekn->emn", plain_ensemble("gelu")(x, w1, b1), w2)

    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    unjitted = jax.grad(loss(jax.vmap(block)), argnums=(0, 1, 2, 3))
    grad = jax.jit(unjitted)
    ops = str(jax.make_jaxpr(unjitted)(*args))
    assert "jax_epilog_members" in ops and "jax_epilog_fused_gelu_input_grad" not in ops
    for got, ref in zip(grad(*args), jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2, 3)))(x, w1, b1, w2)):
        ref = np.asarray(ref)  # float64, against float32 gradients
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert got.sharding.spec[0] == "data"
    assert collectives(grad.lower(*args).compile().as_text()) == NO_COLLECTIVES


@pytest.mark.parametrize("partitioner", ["shardy"], indirect=True)
def test_ensemble_differentiates_again_and_nests(rng, partitioner):
    """A gradient penalty's gradient of an ensemble keeps its members split (members_p
    for the values, XLA's ops for the tangents), with no collective; a vmap of an
    ensemble of ensembles keeps whichever of its member axes is split (an outer member
    dimension; before, a split inner axis was gathered), forward and backward."""
    m4 = mesh((4,), ("data",))
    x, w, b = ensemble(rng, 8)
    layer = jax.vmap(functools.partial(fused_dense, activation="gelu"))
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    penalty = lambda f: lambda *a: jnp.sum(jax.jit(jax.grad(loss(f), argnums=1))(*a) ** 2)
    args = [put(m4, a, "data") for a in (x, w, b)]
    grad = jax.jit(jax.grad(penalty(layer), argnums=(0, 1, 2)))
    for g, want in zip(
        grad(*args), jax.jit(jax.grad(penalty(plain_ensemble("gelu")), argnums=(0, 1, 2)))(x, w, b)
    ):
        assert_near(g, want)
        assert g.sharding.spec[0] == "data"
    assert collectives(grad.lower(*args).compile().as_text()) == NO_COLLECTIVES
    plain = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    for outer, spec in ((4, ("data",)), (2, (None, "data"))):
        nested = [a.reshape(outer, 8 // outer, *a.shape[1:]) for a in (x, w, b)]
        args = [put(m4, a, *spec) for a in nested]
        f = jax.jit(jax.vmap(layer))
        y = f(*args)
        assert_near(y, jax.vmap(plain_ensemble("gelu"))(*nested))
        assert (*y.sharding.spec, None, None)[:2] == (*spec, None)[:2]
        assert collectives(f.lower(*args).compile().as_text()) == NO_COLLECTIVES
        grad = jax.jit(jax.grad(plain(jax.vmap(layer)), argnums=(0, 1, 2)))
        want = jax.jit(jax.grad(plain(jax.vmap(plain_ensemble("gelu"))), argnums=(0, 1, 2)))(*nested)
        for g, r in zip(grad(*args), want, strict=True):
            assert_near(g, r)
        assert collectives(grad.lower(*args).compile().as_text()) == NO_COLLECTIVES


@pytest.mark.parametrize(
    "partitioner, activation, x_per_member",
    [
        ("shardy", None, False),
        ("shardy", "gelu", False),
        ("shardy", "relu", True),
        ("shardy", None, True),
        ("gspmd", "gelu", True),
    ],
    ids=str,
    indirect=["partitioner"],
)
def test_per_example_model_over_an_ensemble_keeps_the_members_split(
    rng, activation, x_per_member, partitioner
):
    """vmap over examples (x alone) of an ensemble: the examples fold into the rows of one
    members' loop, which keeps the members split, whether the members share x or each
    has its own; the weight gradients, sums over the rows, loop over examples and members
    (an outer member dimension), also split. No more collectives than XLA's own
    expression needs (before, x per member, and the weight gradients of GELU and of no
    activation, gathered every member onto every device)."""
    m4 = mesh((4,), ("data",))
    e, p, k, n = 8, 5, 10, 16
    x = rng.standard_normal((p, e, k) if x_per_member else (p, k))
    w, b = rng.standard_normal((e, k, n)) / 3, rng.standard_normal((e, n))
    x_axes = 0 if x_per_member else None

    def model(x, w, b):  # one example through every member: (members, N)
        return jax.vmap(lambda x, w, b: fused_dense(x, w, b, activation=activation), in_axes=(x_axes, 0, 0))(
            x, w, b
        )

    def plain(x, w, b):
        return act_fn(activation)(jnp.einsum("pek,ekn->pen" if x_per_member else "pk,ekn->pen", x, w) + b)

    f = jax.vmap(model, in_axes=(0, None, None))
    args = (put(m4, x, *((None, "data") if x_per_member else ())), put(m4, w, "data"), put(m4, b, "data"))
    y = jax.jit(f)(*args)
    assert_near(y, plain(x, w, b))
    assert y.sharding.spec[:2] == (None, "data")
    assert collectives(jax.jit(f).lower(*args).compile().as_text()) == NO_COLLECTIVES
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    grad = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))
    for g, want in zip(grad(*args), jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b)):
        assert_near(g, want)
    plain_grad = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))
    assert collectives(grad.lower(*args).compile().as_text()) == collectives(
        plain_grad.lower(*args).compile().as_text()
    )


_PERMUTED_ROWS = """
x, w, b = rng.standard_normal((32, 10)), rng.standard_normal((10, 16)) / 3, rng.standard_normal(16)
permute = lambda x: x.reshape(2, 2, 8, 10).transpose(1, 0, 2, 3).reshape(32, 10)
fused = lambda x, w, b: jax_epilog.fused_dense(permute(x), w, b, activation="gelu", implementation="cublaslt")
got = jax.jit(fused)(jax.device_put(x, NamedSharding(mesh, P("axis"))), w, b)
want = jax.nn.gelu(permute(x) @ w + b, approximate=True)
np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12)
"""


_PARTLY_MANUAL = """
two = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
x, w, b = rng.standard_normal((16, 10)), rng.standard_normal((10, 12)) / 3, rng.standard_normal(12)
for activation in (None, "relu", "gelu"):
    layer = lambda x, w, b: jax_epilog.fused_dense(x, w, b, activation=activation, implementation="cublaslt")
    f = jax.shard_map(layer, mesh=two, in_specs=(P("a"), P(), P()), out_specs=P("a"), axis_names={"a"})
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    rows = jax.device_put(x, NamedSharding(two, P(("a", "b"))))
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(rows, w, b)
    plain = lambda x, w, b: {None: x @ w + b, "relu": jax.nn.relu(x @ w + b),
                             "gelu": jax.nn.gelu(x @ w + b, approximate=True)}[activation]
    for g, r in zip(got, jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-12, atol=1e-12)
"""


@pytest.mark.parametrize("partitioner_name", ["gspmd", "shardy"])
def test_inside_a_shard_map_over_some_axes_the_primitive_runs_per_block(rng, partitioner_name):
    """A shard_map manual over "a" of an Auto mesh whose "b" is left to XLA: the
    primitives lower directly there (custom_partitioning could not read the operands'
    shardings: GSPMD aborted the process, so this runs in a fresh one)."""
    run_in_a_fresh_process(4, _PARTLY_MANUAL, partitioner_name, rng)


@pytest.mark.parametrize("partitioner_name", ["gspmd", "shardy"])
def test_rows_split_in_a_permuted_device_order_compile_and_match(rng, partitioner_name):
    """Rows whose blocks a transpose moved between devices arrive split over the mesh's
    devices in another order, which no PartitionSpec names (the rule takes them as
    unsplit). jax's own decoding raised there (an AssertionError; under GSPMD the process
    aborted), so this runs in a fresh process."""
    run_in_a_fresh_process(4, _PERMUTED_ROWS, partitioner_name, rng)


@pytest.mark.parametrize(
    "weights, activation", [("whole", "relu"), ("split-n", "gelu"), ("split-n", "relu")], ids=str
)
def test_explicit_sharding_types_every_result_and_gradient(rng, seen, weights, activation):
    """Under explicit sharding (jax.make_mesh's default) an array's type names its sharding:
    the output is typed split by rows (and by N where the kernel is: column-parallel), and
    each gradient takes its primal's type."""
    m = mesh((2, 2), ("data", "model"), AxisType.Explicit)
    n_axis, n = ("model", 2 * 128) if weights == "split-n" else (None, 14)
    x, w, b = operands(rng, 4 * 3, 10, n)
    dy = rng.standard_normal((4 * 3, n))
    args = (put(m, x, "data"), put(m, w, None, n_axis), put(m, b, n_axis), put(m, dy, "data"))
    y = jax.jit(lambda x, w, b, dy: fused_dense(x, w, b, activation=activation))(*args)
    assert_near(y, reference(x, w, b, activation))
    assert jax.typeof(y).sharding.spec == P("data", n_axis)

    def loss(layer):
        return lambda x, w, b, dy: jnp.sum(layer(x, w, b, activation) * dy)

    _, got = layer_grads(loss, args, (x, w, b, dy))
    for g, primal in zip(got, args):
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec
    # rows split over "data" only; N over "model" where the weights are
    assert seen["weight_grad"] == weight_grad_traced(
        activation, (6, 10, n // 2 if n_axis else n), (12, 10, n)
    )


def test_explicit_sharding_fused_mlp(rng, seen):
    m = mesh((2, 2), ("data", "model"), AxisType.Explicit)
    x, w1, b1 = operands(rng, 4 * 5, 12, 16)
    _, w2, _ = operands(rng, 1, 16, 7)
    args = (x, w1, b1, w2)
    sharded = (put(m, x, "data"), *(put(m, a) for a in args[1:]))

    def loss(mlp):
        return lambda x, w1, b1, w2: jnp.sum(mlp(x, w1, b1, w2) ** 2)

    fused = loss(
        lambda x, w1, b1, w2: jax_epilog.fused_mlp(
            x, [(w1, b1), (w2, None)], ["gelu", None], implementation="cublaslt"
        )
    )
    plain = loss(lambda x, w1, b1, w2: reference(reference(x, w1, b1, "gelu"), w2, None, None))
    got = jax.jit(jax.grad(fused, argnums=(0, 1, 2, 3)))(*sharded)
    want = jax.jit(jax.grad(plain, argnums=(0, 1, 2, 3)))(*args)
    for g, r, primal in zip(got, want, sharded, strict=True):
        assert_near(g, r)
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec


@pytest.mark.parametrize("implementation", ["xla", "auto", "cublaslt"])
def test_explicit_sharding_of_a_row_parallel_layer(rng, implementation):
    """A row-parallel layer (x and the kernel split along K) under explicit sharding: every
    implementation sums over the split K, where XLA's plain ``x @ kernel`` is refused as
    ambiguous (as "auto" and "xla" once ran it). y is split by rows only, the
    gradients typed as their primals, the values the reference's."""
    m = mesh((2, 2), ("data", "model"), AxisType.Explicit)
    x, w, b = operands(rng, 2 * 5, 2 * 6, 9)
    dy = rng.standard_normal((2 * 5, 9))
    args = (put(m, x, "data", "model"), put(m, w, "model", None), put(m, b))
    layer = functools.partial(jax_epilog.fused_dense, activation="gelu", implementation=implementation)
    y = jax.jit(layer)(*args)
    assert_near(y, reference(x, w, b, "gelu"))
    assert jax.typeof(y).sharding.spec == P("data", None)
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(layer(*a) * dy), argnums=(0, 1, 2)))(*args)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(reference(*a, "gelu") * dy), argnums=(0, 1, 2)))(x, w, b)
    for g, r, primal in zip(grad, want, args, strict=True):
        assert_near(g, r)
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec


@pytest.mark.parametrize(
    "implementation, activation",
    [("xla", "relu"), ("auto", "gelu"), ("cublaslt", "relu"), ("cublaslt", "gelu")],
    ids=str,
)
def test_explicit_sharding_of_a_sequence_axis(rng, seen, implementation, activation):
    """x of shape (batch, seq, K) split along seq (sequence parallelism): a reshape cannot
    fold (3, 8@seq) into rows, so the op folds seq first. y and every gradient keep their
    primal's split, as the plain expression's do, and each device computes its own rows."""
    m = mesh((4,), ("seq",), AxisType.Explicit)
    x, w, b = rng.standard_normal((3, 8, 10)), *operands(rng, 1, 10, 7)[1:]
    dy = rng.standard_normal((3, 8, 7))
    args = (put(m, x, None, "seq"), put(m, w), put(m, b), put(m, dy, None, "seq"))

    def layer(x, w, b):
        return jax_epilog.fused_dense(x, w, b, activation=activation, implementation=implementation)

    y = jax.jit(layer)(*args[:3])
    assert_near(y, reference(x, w, b, activation))
    assert jax.typeof(y).sharding.spec == P(None, "seq", None)
    got = jax.jit(jax.grad(lambda x, w, b, dy: jnp.sum(layer(x, w, b) * dy), argnums=(0, 1, 2)))(*args)
    want = jax.jit(jax.grad(lambda x, w, b: jnp.sum(reference(x, w, b, activation) * dy), argnums=(0, 1, 2)))(
        x, w, b
    )
    for g, r, primal in zip(got, want, args, strict=False):
        assert_near(g, r)
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec
    # the op's own per-device forward (XLA's expression has none): 3 x 2 rows on each device
    assert set(seen["dense"]) == ({(6, 10, 7)} if implementation == "cublaslt" else set())


# A (batch, sequence) x split over the sequence, both or their product, and each device's rows.
_SEQUENCE_SPLITS = [
    pytest.param("shardy", P(None, "seq"), 16, "relu", id="shardy-seq-relu"),
    pytest.param("shardy", P("data", "seq"), 8, "gelu", id="shardy-data-seq-gelu"),
    pytest.param("shardy", P(("data", "seq")), 8, "relu", id="shardy-data+seq-relu"),
    pytest.param("gspmd", P("data", "seq"), 8, "gelu", id="gspmd-data-seq-gelu"),
]


@pytest.mark.parametrize("partitioner, spec, rows, activation", _SEQUENCE_SPLITS, indirect=["partitioner"])
def test_auto_fused_forward_keeps_a_split_sequence(rng, seen, partitioner, spec, rows, activation):
    """Under automatic sharding "auto"'s fused forward takes x with its leading dimensions,
    so each device runs its own (batch, sequence) block, however the two are split: no
    collective, y split as the expression's, the same gradients (before, x was folded into
    rows by a reshape that XLA partitioned first: it gathered the sequence, and every
    device computed all of its batch's rows)."""
    m = mesh((2, 2), ("data", "seq"))
    x, w, b = rng.standard_normal((4, 8, 10)), *operands(rng, 1, 10, 16)[1:]
    args = (put(m, x, *spec), put(m, w), put(m, b))
    layer = lambda x, w, b: jax_epilog.fused_dense(x, w, b, activation=activation)
    plain = lambda x, w, b: reference(x, w, b, activation)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    with override_policy(
        auto_dtypes=("float64",), auto_min_rows=0, auto_min_work=0
    ):  # (a small layer, fused)
        f = jax.jit(layer)
        y = f(*args)
        assert_near(y, plain(x, w, b))
        assert y.sharding.spec == jax.jit(plain)(*args).sharding.spec
        assert collectives(f.lower(*args).compile().as_text()) == NO_COLLECTIVES
        assert seen["dense"] == [(rows, 10, 16)]  # each device's own rows
        got = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2)))(*args)
    for g, want in zip(got, jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b)):
        assert_near(g, want)


@pytest.mark.parametrize("partitioner, spec, rows, activation", _SEQUENCE_SPLITS, indirect=["partitioner"])
def test_auto_cublaslt_gradient_keeps_a_split_sequence(rng, seen, partitioner, spec, rows, activation):
    """Under automatic sharding "cublaslt"'s differentiable path and fused_mlp's linked
    backward take x with its leading dimensions too: the backward's primitives (BGRADA,
    DGELU) fold each device's rows in their lowering, like the forward. So the sequence is
    not gathered, forward or backward; the weight gradients are summed over the devices
    with no more bytes than XLA's autodiff sums (before, x was folded by a reshape first,
    and XLA gathered the sequence for it)."""
    m = mesh((2, 2), ("data", "seq"))
    x, w, b = rng.standard_normal((4, 8, 10)), *operands(rng, 1, 10, 16)[1:]
    w2 = operands(rng, 1, 16, 5)[1]
    args = (put(m, x, *spec), put(m, w), put(m, b), put(m, w2))

    def dense(x, w, b, w2):
        return fused_dense(x, w, b, activation=activation)

    def mlp(x, w, b, w2):
        return jax_epilog.fused_mlp(x, [(w, b), (w2, None)], [activation, None], implementation="cublaslt")

    plain_dense = lambda x, w, b, w2: reference(x, w, b, activation)
    plain_mlp = lambda x, w, b, w2: reference(reference(x, w, b, activation), w2, None, None)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    argnums = (0, 1, 2, 3)
    for f, plain in ((dense, plain_dense), (mlp, plain_mlp)):
        forward = jax.jit(f)
        assert_near(forward(*args), plain(x, w, b, w2))
        assert collectives(forward.lower(*args).compile().as_text()) == NO_COLLECTIVES
        grad = jax.jit(jax.grad(loss(f), argnums=argnums))
        for g, want in zip(
            grad(*args), jax.jit(jax.grad(loss(plain), argnums=argnums))(x, w, b, w2), strict=True
        ):
            assert_near(g, want)
        got = grad.lower(*args).compile().as_text()
        want = jax.jit(jax.grad(loss(plain), argnums=argnums)).lower(*args).compile().as_text()
        assert collectives(got)["all-gather"] == collectives(got)["all-to-all"] == 0
        assert all_reduced_bytes(got) <= all_reduced_bytes(want), (collectives(got), collectives(want))
    assert set(seen["dense"]) == {(rows, 10, 16), (rows, 16, 5)}  # each device's own rows
    if activation == "gelu":  # BGRADA's too (ReLU's weight gradient is XLA's GEMM)
        assert (rows, 10, 16) in seen["weight_grad"]


@pytest.mark.parametrize("implementation, activation", [("auto", "relu"), ("cublaslt", "gelu")], ids=str)
def test_explicit_sharding_of_batch_and_sequence_axes(rng, seen, implementation, activation):
    """x of type (4@data, 8@seq, K), two examples a device: the op folds each device's
    blocks into its own rows (before, a reshape merged the two splits into one over
    (data, seq), which needs an all-to-all, and a GELU gradient then raised; on a 2x4 mesh
    the reshape raised). y and every gradient keep their primal's split, with no more
    collectives than the plain expression's, fused_dense's and fused_mlp's (its linked
    GELU backward)."""
    m = mesh((2, 2), ("data", "seq"), AxisType.Explicit)
    x, w, b = rng.standard_normal((4, 8, 10)), *operands(rng, 1, 10, 16)[1:]
    w2 = operands(rng, 1, 16, 5)[1]
    args = (put(m, x, "data", "seq"), put(m, w), put(m, b), put(m, w2))

    def dense(x, w, b, w2):
        return jax_epilog.fused_dense(x, w, b, activation=activation, implementation=implementation)

    def mlp(x, w, b, w2):
        return jax_epilog.fused_mlp(
            x, [(w, b), (w2, None)], [activation, None], implementation=implementation
        )

    plain_dense = lambda x, w, b, w2: reference(x, w, b, activation)
    plain_mlp = lambda x, w, b, w2: reference(reference(x, w, b, activation), w2, None, None)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    for f, plain in ((dense, plain_dense), (mlp, plain_mlp)):
        y = jax.jit(f)(*args)
        assert_near(y, plain(x, w, b, w2))
        assert jax.typeof(y).sharding.spec == P("data", "seq", None)
        grad = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2, 3)))
        for g, r, primal in zip(
            grad(*args), jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2, 3)))(x, w, b, w2), args, strict=True
        ):
            assert_near(g, r)
            assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec
        want = jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2, 3))).lower(*args).compile().as_text()
        got = grad.lower(*args).compile().as_text()
        assert all(collectives(got)[op] <= collectives(want)[op] for op in ("all-gather", "all-to-all"))
        assert all_reduced_bytes(got) <= all_reduced_bytes(want), (collectives(got), collectives(want))
        assert collectives(jax.jit(f).lower(*args).compile().as_text()) == NO_COLLECTIVES
    if implementation == "cublaslt":
        assert (8, 10, 16) in set(seen["dense"])  # each device's 2 x 4 rows


def test_explicit_sharding_vmap_over_split_rows_with_shared_weights(rng, seen):
    """vmap with shared weights folds the batch into the GEMM's rows; with each member's
    rows split, they fold first. Also through fused_mlp's linked GELU backward."""
    m = mesh((4,), ("data",), AxisType.Explicit)
    x, w1, b1 = rng.standard_normal((3, 8, 10)), *operands(rng, 1, 10, 16)[1:]
    w2 = operands(rng, 1, 16, 5)[1]
    xs = put(m, x, None, "data")
    y = jax.jit(jax.vmap(lambda x: fused_dense(x, w1, b1, activation="relu")))(xs)
    assert_near(y, reference(x, w1, b1, "relu"))
    assert jax.typeof(y).sharding.spec == P(None, "data", None)
    assert set(seen["dense"]) == {(6, 10, 16)}

    def loss(mlp):
        return lambda x: jnp.sum(jax.vmap(mlp)(x) ** 2)

    linked = loss(
        lambda x: jax_epilog.fused_mlp(x, [(w1, b1), (w2, None)], ["gelu", None], implementation="cublaslt")
    )
    plain = loss(lambda x: reference(reference(x, w1, b1, "gelu"), w2, None, None))
    dx = jax.jit(jax.grad(linked))(xs)
    assert_near(dx, jax.jit(jax.grad(plain))(x))
    assert jax.typeof(dx).sharding.spec == P(None, "data", None)


@pytest.mark.parametrize(
    "partitioner, activation", [("shardy", "relu"), ("gspmd", "gelu")], ids=str, indirect=["partitioner"]
)
def test_explicit_sharding_ensemble_split_over_members(rng, activation, partitioner):
    """vmap over weights (an ensemble) runs member by member; members split over devices
    stay split: each device runs its own (shard_map), with no collective, forward and
    backward, whether x is per member or shared."""
    m = mesh((4,), ("data",), AxisType.Explicit)
    x, w, b = (
        rng.standard_normal((8, 6, 10)),
        rng.standard_normal((8, 10, 7)) / 3,
        rng.standard_normal((8, 7)),
    )
    xs, ws, bs = (put(m, a, "data") for a in (x, w, b))
    layer = functools.partial(fused_dense, activation=activation)
    want = act_fn(activation)(jnp.einsum("emk,ekn->emn", x, w) + b[:, None])
    none = {"all-gather": 0, "all-reduce": 0, "all-to-all": 0}
    for in_axes, args, expected in (
        ((0, 0, 0), (xs, ws, bs), want),
        ((None, 0, 0), (put(m, x[0]), ws, bs), None),
    ):
        f = jax.jit(jax.vmap(layer, in_axes=in_axes))
        y = f(*args)
        if expected is None:  # x shared by the members
            expected = act_fn(activation)(jnp.einsum("mk,ekn->emn", x[0], w) + b[:, None])
        assert_near(y, expected)
        assert jax.typeof(y).sharding.spec == P("data", None, None)
        assert collectives(f.lower(*args).compile().as_text()) == none
    loss = lambda x, w, b: jnp.sum(jax.vmap(layer)(x, w, b) ** 2)
    plain = lambda x, w, b: jnp.sum(act_fn(activation)(jnp.einsum("emk,ekn->emn", x, w) + b[:, None]) ** 2)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    for got, ref in zip(grad(xs, ws, bs), jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(x, w, b)):
        assert_near(got, ref)
        assert jax.typeof(got).sharding.spec[0] == "data"
    assert collectives(grad.lower(xs, ws, bs).compile().as_text()) == none


def test_explicit_sharding_ensemble_differentiates_again(rng):
    """A gradient penalty's gradient of an ensemble whose members are split (inside
    map_members' shard_map the values are typed as differing by device, like their
    tangents: before, jax refused to cast them)."""
    m = mesh((4,), ("data",), AxisType.Explicit)
    x, w, b = rng.standard_normal((6, 10)), rng.standard_normal((8, 10, 12)) / 3, rng.standard_normal((8, 12))
    args = (put(m, x), put(m, w, "data"), put(m, b, "data"))
    layer = functools.partial(fused_dense, activation="gelu")
    loss = lambda f: lambda x, w, b: jnp.sum(jnp.sin(jax.vmap(f, in_axes=(None, 0, 0))(x, w, b)))
    penalty = lambda f: lambda *a: jnp.sum(jax.jit(jax.grad(loss(f), argnums=1))(*a) ** 2)
    got = jax.jit(jax.grad(penalty(layer), argnums=(0, 1, 2)))(*args)
    plain = lambda x, w, b: reference(x, w, b, "gelu")
    for g, want, primal in zip(
        got, jax.jit(jax.grad(penalty(plain), argnums=(0, 1, 2)))(x, w, b), args, strict=True
    ):
        assert_near(g, want)
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec


_TWO_AXIS_ENSEMBLES = {
    "members-a": ((P("a"), P("a"), P("a")), (6, 10, 8), P("a", None, None)),  # "b" splits nothing
    "members-ab": ((P(("a", "b")), P(("a", "b")), P(("a", "b"))), (6, 10, 8), P(("a", "b"), None, None)),
    "rows-b": (
        (P("a", "b"), P("a"), P("a")),
        (3, 10, 8),
        P("a", "b", None),
    ),  # each device's rows of its members
    "cols-b": (
        (P("a"), P("a", None, "b"), P("a", "b")),
        (6, 10, 4),
        P("a", None, "b"),
    ),  # its columns (the aux cut)
    "whole-rows-b": (
        (P(None, "b"), P(), P()),
        (3, 10, 8),
        P(None, "b", None),
    ),  # members whole, rows over "b"
    "whole-cols-b": (
        (P(), P(None, None, "b"), P(None, "b")),
        (6, 10, 4),
        P(None, None, "b"),
    ),  # members whole, N over "b"
}


@pytest.mark.parametrize(
    "partitioner, specs, per_member, y_spec",
    [pytest.param("shardy", *case, id=f"shardy-{name}") for name, case in _TWO_AXIS_ENSEMBLES.items()]
    + [
        pytest.param("gspmd", *_TWO_AXIS_ENSEMBLES[name], id=f"gspmd-{name}")
        for name in ("members-ab", "cols-b")
    ],
    indirect=["partitioner"],
)
def test_explicit_sharding_ensemble_on_a_two_axis_mesh(rng, seen, specs, per_member, y_spec, partitioner):
    """On a 2x2 explicit mesh the members, each member's rows and its N stay split as they
    arrive (members_p typed by its layout: each device runs its own members on its own
    block), members whole included: no gather in the forward (before, the members were
    gathered for a loop wherever another axis split an operand, and members no axis split
    looped). Values, types and gradients as the expression's."""
    m = mesh((2, 2), ("a", "b"), AxisType.Explicit)
    x, w, b = (
        rng.standard_normal((8, 6, 10)),
        rng.standard_normal((8, 10, 8)) / 3,
        rng.standard_normal((8, 8)),
    )
    args = [put(m, a, *spec) for a, spec in zip((x, w, b), specs)]
    layer = jax.vmap(functools.partial(fused_dense, activation="gelu"))
    plain = lambda x, w, b: act_fn("gelu")(jnp.einsum("emk,ekn->emn", x, w) + b[:, None])
    f = jax.jit(layer)
    y = f(*args)
    assert_near(y, plain(x, w, b))
    assert seen["dense"] == [per_member]
    assert jax.typeof(y).sharding.spec == y_spec
    assert collectives(f.lower(*args).compile().as_text())["all-gather"] == 0
    assert "shard_map" not in str(jax.make_jaxpr(layer)(*args))
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    got = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2)))(*args)
    for g, want, primal in zip(got, jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b), args):
        assert_near(g, want)
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec


@pytest.mark.parametrize(
    "x_spec, w_spec",
    [(P(None, "a"), P("a")), (P("b", "a"), P("a")), (P(None, "a", "b"), P("a")), (P("a", None, "b"), P())],
    ids=["examples-whole", "examples-b", "rows-b", "examples-a-rows-b"],
)
def test_explicit_sharding_per_example_model_over_an_ensemble_keeps_every_split(rng, x_spec, w_spec):
    """A vmap of x alone over an ensemble: the examples fold into each member's rows,
    where both are split too (two examples a device), so one members_p runs where a loop
    ran before; nothing gathered; values, gradients and types as the expression's."""
    m = mesh((2, 2), ("a", "b"), AxisType.Explicit)
    x, w, b = (
        rng.standard_normal((4, 4, 6, 10)),
        rng.standard_normal((4, 10, 8)) / 3,
        rng.standard_normal((4, 8)),
    )
    args = [put(m, x, *x_spec), put(m, w, *w_spec), put(m, b, *w_spec)]
    model = jax.vmap(jax.vmap(functools.partial(fused_dense, activation="relu")), in_axes=(0, None, None))
    plain = lambda x, w, b: act_fn("relu")(jnp.einsum("pemk,ekn->pemn", x, w) + b[:, None])
    f = jax.jit(model)
    y = f(*args)
    assert_near(y, plain(x, w, b))
    assert jax.typeof(y).sharding.spec == P(*x_spec, *[None] * (4 - len(x_spec)))
    assert collectives(f.lower(*args).compile().as_text()) == NO_COLLECTIVES
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    got = jax.jit(jax.grad(loss(model), argnums=(0, 1, 2)))(*args)
    for g, want, primal in zip(
        got, jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b), args, strict=True
    ):
        assert_near(g, want)
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec


@pytest.mark.parametrize("split", ["members-b", "rows-b", "whole"])
def test_explicit_sharding_ensemble_inside_a_shard_map_over_the_other_axis(rng, split):
    """An ensemble inside a shard_map manual over "a" of a 2x2 explicit mesh, its members
    (or each member's rows) split over "b": the primitive lowers directly there, XLA
    gathering over "b", and the members' loop takes its members whole (lax.map refuses a
    split axis). Values and gradients as the expression's."""
    m = mesh((2, 2), ("a", "b"), AxisType.Explicit)
    x, w, b = (
        rng.standard_normal((2, 4, 6, 10)),
        rng.standard_normal((4, 10, 8)) / 3,
        rng.standard_normal((4, 8)),
    )
    x_spec, w_spec = {
        "members-b": (("a", "b"), ("b",)),
        "rows-b": (("a", None, "b"), ()),
        "whole": (("a",), ()),
    }[split]
    args = [put(m, x, *x_spec), put(m, w, *w_spec), put(m, b, *w_spec)]
    layer = jax.vmap(functools.partial(fused_dense, activation="gelu"))
    f = jax.shard_map(
        lambda x, w, b: layer(x[0], w, b)[None],
        mesh=m,
        in_specs=(P("a"), P(), P()),
        out_specs=P("a"),
        axis_names={"a"},
    )
    plain = lambda x, w, b: act_fn("gelu")(jnp.einsum("semk,ekn->semn", x, w) + b[:, None])
    assert_near(jax.jit(f)(*args), plain(x, w, b))
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))(*args)
    for g, want in zip(got, jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b), strict=True):
        assert_near(g, want)


def test_explicit_sharding_ensemble_beside_an_auto_axis_keeps_members_split(rng):
    """Members split over the explicit axis of a mesh whose other axis is Auto: each
    device loops over its own (a shard_map manual over that axis; before, the members
    were gathered), no collective, values and gradients as the expression's."""
    m = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit, AxisType.Auto), devices=CPUS[:4])
    x, w, b = (
        rng.standard_normal((4, 6, 10)),
        rng.standard_normal((4, 10, 12)) / 3,
        rng.standard_normal((4, 12)),
    )
    args = [put(m, a, "a") for a in (x, w, b)]
    layer = jax.vmap(functools.partial(fused_dense, activation="gelu"))
    plain = lambda x, w, b: act_fn("gelu")(jnp.einsum("emk,ekn->emn", x, w) + b[:, None])
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    grad = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2)))
    assert_near(jax.jit(layer)(*args), plain(x, w, b))
    for g, want in zip(grad(*args), jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b), strict=True):
        assert_near(g, want)
    for f in (jax.jit(layer), grad):
        assert collectives(f.lower(*args).compile().as_text()) == NO_COLLECTIVES


def test_explicit_sharding_ensemble_of_ensembles_split_over_both_axes(rng):
    """vmap of an ensemble whose two member axes are split over both axes of an explicit
    mesh: one members_p over both, nothing gathered in the forward; values, gradients and
    types as the expression's (before, the inner shard_map named an axis the outer vmap had
    taken, and jax refused it; later the members were gathered for a loop)."""
    m = mesh((2, 2), ("a", "b"), AxisType.Explicit)
    x, w, b = (
        rng.standard_normal((6, 10)),
        rng.standard_normal((2, 4, 10, 8)) / 3,
        rng.standard_normal((2, 4, 8)),
    )
    args = [put(m, x), put(m, w, "a", "b"), put(m, b, "a", "b")]
    layer = functools.partial(fused_dense, activation="gelu")
    nested = jax.vmap(jax.vmap(layer, in_axes=(None, 0, 0)), in_axes=(None, 0, 0))
    plain = lambda x, w, b: act_fn("gelu")(jnp.einsum("mk,fekn->femn", x, w) + b[:, :, None])
    y = jax.jit(nested)(*args)
    assert_near(y, plain(x, w, b))
    assert jax.typeof(y).sharding.spec[:2] == ("a", "b")
    assert collectives(jax.jit(nested).lower(*args).compile().as_text()) == NO_COLLECTIVES
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))
    got = jax.jit(jax.grad(loss(nested), argnums=(0, 1, 2)))(*args)
    for g, want, primal in zip(
        got, jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b), args, strict=True
    ):
        assert_near(g, want)
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec


@pytest.mark.parametrize(
    "activation,n",
    [("gelu", 2 * 4), ("gelu", 2 * 5), ("relu", 2 * 64), ("relu", 2 * 20)],
    ids=["gelu-cut", "gelu-padded", "relu-cut", "relu-padded"],
)
def test_explicit_sharding_ensemble_gradient_with_n_split_finer_than_the_aux(rng, activation, n):
    """vmap over weights split along N where each device's N is no multiple of the aux's
    padding: the gradient's forward types y split along N as the primal does (each device
    cuts its share of the aux, or, where the aux is padded, computes every column and keeps
    its own), so the custom_vjp's check under a jitted vmap accepts it."""
    m = mesh((2, 2), ("a", "b"), AxisType.Explicit)
    x, w, b = (
        rng.standard_normal((8, 6, 10)),
        rng.standard_normal((8, 10, n)) / 3,
        rng.standard_normal((8, n)),
    )
    specs = (P("a"), P("a", None, "b"), P("a", "b"))
    args = [put(m, jnp.asarray(a, jnp.float32), *spec) for a, spec in zip((x, w, b), specs)]
    layer = jax.jit(jax.vmap(functools.partial(fused_dense, activation=activation)))
    plain = lambda x, w, b: act_fn(activation)(jnp.einsum("emk,ekn->emn", x, w) + b[:, None])
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    got = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2)))(*args)
    for g, want, primal in zip(got, jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2)))(x, w, b), args):
        want = np.asarray(want)  # float64, against float32 gradients
        np.testing.assert_allclose(np.asarray(g), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec


def test_explicit_sharding_ensemble_of_fused_mlps_keeps_members_split(rng):
    """An ensemble of linked GELU blocks (fused_mlp's DGELU backward, batched over the
    members' weights) differentiates with each device on its own members."""
    m = mesh((4,), ("data",), AxisType.Explicit)
    shapes = ((4, 6, 10), (4, 10, 12), (4, 12), (4, 12, 5))
    x, w1, b1, w2 = (rng.standard_normal(s) / (3 if len(s) == 3 and s[1] > 6 else 1) for s in shapes)

    def block(x, w1, b1, w2):
        return jax_epilog.fused_mlp(x, [(w1, b1), (w2, None)], ["gelu", None], implementation="cublaslt")

    def plain(x, w1, b1, w2):
        h = act_fn("gelu")(jnp.einsum("emk,ekn->emn", x, w1) + b1[:, None])
        return jnp.einsum("emk,ekn->emn", h, w2)

    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)
    unjitted = jax.grad(loss(jax.vmap(block)), argnums=(0, 1, 2, 3))
    grad = jax.jit(unjitted)
    args = [put(m, jnp.asarray(a, jnp.float32), "data") for a in (x, w1, b1, w2)]  # (float64 is not linked)
    ops = str(jax.make_jaxpr(unjitted)(*args))
    assert "jax_epilog_members" in ops and "jax_epilog_fused_gelu_input_grad" not in ops
    for got, ref in zip(grad(*args), jax.jit(jax.grad(loss(plain), argnums=(0, 1, 2, 3)))(x, w1, b1, w2)):
        ref = np.asarray(ref)  # float64, against float32 gradients
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert jax.typeof(got).sharding.spec[0] == "data"
    assert collectives(grad.lower(*args).compile().as_text()) == {
        "all-gather": 0,
        "all-reduce": 0,
        "all-to-all": 0,
    }


def _assert_padded_gradients_match_unpadded(f, args, op=None, unpadded_pads=0, **policy):
    """jax.grad of sum(f(*args)**2) on padded rows (padding at any size; ``policy``: more
    fields to override; the program holds ``op``, where given) against the same program
    never padded (``row_bytes=1``), which holds ``unpadded_pads`` pad ops (an aux's): every
    gradient typed as its primal, and the values those of the unpadded program."""

    def gradients():  # (a new function each time: JAX caches traces by function)
        argnums = tuple(range(len(args)))
        grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=argnums)
        return jax.jit(grad)(*args), str(jax.make_jaxpr(grad)(*args))

    with override_policy(pad_min_rows=0, pad_min_work=0, **policy):
        padded, text = gradients()
        assert op is None or op in text
        with override_policy(row_bytes=1):
            unpadded, unpadded_text = gradients()
    assert " pad[" in text and unpadded_text.count(" pad[") == unpadded_pads, unpadded_text.count(" pad[")
    for got, want, primal in zip(padded, unpadded, args, strict=True):
        assert jax.typeof(got).sharding.spec == jax.typeof(primal).sharding.spec
        want = np.asarray(want, np.float32)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max()
        )


@pytest.mark.parametrize("implementation", ["cublaslt", "auto"])
def test_padded_backward_under_explicit_sharding(rng, implementation):
    """The backward's GEMMs on padded rows (bfloat16 K = 10 and a column-parallel N = 258
    pad to 16 and 264) under explicit sharding: every gradient typed as its primal, and the
    values those of the unpadded program."""
    m = mesh((2, 2), ("data", "model"), AxisType.Explicit)
    x, w, b = (jnp.asarray(a, jnp.bfloat16) for a in operands(rng, 4 * 3, 10, 2 * 129))
    args = (put(m, x, "data"), put(m, w, None, "model"), put(m, b, "model"))
    f = functools.partial(jax_epilog.fused_dense, activation="gelu", implementation=implementation)
    _assert_padded_gradients_match_unpadded(f, args)


@pytest.mark.parametrize("implementation", ["cublaslt", "auto"])
def test_padded_linked_mlp_backward_under_explicit_sharding(rng, implementation):
    """fused_mlp's linked backward on padded rows (bfloat16 K = 10, a column-parallel
    N = 258 that pads to 264, then a row-parallel layer to 7 columns, which pad to 8) under
    explicit sharding: every gradient typed as its primal, and the values those of the
    unpadded program. "auto" (linked at any size here) runs both layers' forwards as
    XLA's expressions on the padded rows."""
    m = mesh((2, 2), ("data", "model"), AxisType.Explicit)
    x, w1, b1 = (jnp.asarray(a, jnp.bfloat16) for a in operands(rng, 4 * 3, 10, 2 * 129))
    _, w2, b2 = (jnp.asarray(a, jnp.bfloat16) for a in operands(rng, 1, 2 * 129, 7))
    specs = (("data",), (None, "model"), ("model",), ("model", None), ())
    args = [put(m, a, *spec) for a, spec in zip((x, w1, b1, w2, b2), specs, strict=True)]

    def mlp(x, w1, b1, w2, b2):
        return jax_epilog.fused_mlp(x, [(w1, b1), (w2, b2)], ["gelu", None], implementation=implementation)

    # ("auto"'s XLA forward pads the GELU layer's z to the aux's 8-column rows either way.)
    aux_pads = 1 if implementation == "auto" else 0
    _assert_padded_gradients_match_unpadded(
        mlp, args, "jax_epilog_fused_gelu_input_grad", aux_pads, link_min_rows=0
    )


# ------------------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_explicit_sharding_on_the_gpu_runs_the_fused_path(rng, activation):
    """Under an explicit mesh (jax.make_mesh's default) the primitives' results are typed with
    the mesh's shardings and the cotangents are resharded to their primals' types
    (_partition.typed / _typing.like): on one GPU the forward and its gradient still lower
    to our custom calls and give the oracle's numbers."""
    mesh_ = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1])
    x, w, b = (jnp.asarray(a, jnp.float32) for a in operands(rng, 96, 72, 40))
    dy = jnp.asarray(rng.standard_normal((96, 40)), jnp.float32)
    rows, whole = NamedSharding(mesh_, P("data")), NamedSharding(mesh_, P())
    x, dy = jax.device_put(x, rows), jax.device_put(dy, rows)
    w, b = jax.device_put(w, whole), jax.device_put(b, whole)

    loss = lambda x, w, b: jnp.sum(fused_dense(x, w, b, activation=activation) * dy)
    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    text = grad.lower(x, w, b).as_text()
    # the forward, and for GELU the BGRADA GEMM (ReLU's bias gradient is XLA's reduction)
    assert text.count("@jax_epilog_fused_matmul(") == (2 if activation == "gelu" else 1), text
    value, grads = grad(x, w, b)

    x64, w64, b64, dy64 = (np.asarray(a, np.float64) for a in (x, w, b, dy))
    y, z = oracle(x64, w64, b64, activation)
    assert_scaled_close(value, np.sum(y * dy64), GPU_TOL["float32"] * 10)
    if activation == "relu":
        dz = dy64 * (z > 0)
    else:
        t = np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)
        dz = dy64 * (
            0.5 * (1 + np.tanh(t))
            + 0.5 * z * (1 - np.tanh(t) ** 2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z**2)
        )
    for g, want, primal in zip(grads, (dz @ w64.T, x64.T @ dz, dz.sum(0)), (x, w, b), strict=True):
        assert_scaled_close(g, want, GPU_TOL["float32"] * 10)
        assert jax.typeof(g).sharding.spec == jax.typeof(primal).sharding.spec


@pytest.mark.gpu
def test_inside_shard_map_the_fused_path_runs_and_differentiates(rng):
    """A shard_map over a mesh of one GPU: the primitives lower directly to our custom
    calls (the forward and BGRADA), typed as varying over the manual axis, and the weight
    gradients (summed over that axis) match the oracle's."""
    mesh_ = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:1])
    x, w, b = (jnp.asarray(a, jnp.bfloat16) for a in operands(rng, 48, 40, 72))
    layer = jax.shard_map(
        lambda x, w, b: fused_dense(x, w, b, activation="gelu"),
        mesh=mesh_,
        in_specs=(P("data"), P(), P()),
        out_specs=P("data"),
    )
    loss = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert grad.lower(x, w, b).as_text().count("@jax_epilog_fused_matmul(") == 2  # the forward and BGRADA
    assert_scaled_close(jax.jit(layer)(x, w, b), oracle(x, w, b, "gelu")[0], GPU_TOL["bfloat16"])
    plain = lambda x, w, b: jnp.sum(jax.nn.gelu(x @ w + b, approximate=True))
    f32 = [a.astype(jnp.float32) for a in (x, w, b)]
    for g, want in zip(grad(x, w, b), jax.grad(plain, argnums=(0, 1, 2))(*f32), strict=True):
        assert_scaled_close(g, want, GPU_TOL["bfloat16"])
