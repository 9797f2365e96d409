"""``fused_dense(..., fp8=state)``: against an independent NumPy emulation of the FP8 GEMM
and (loosely) against float32, its gradients, FP8 inputs and outputs, errors, sharding."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import TWINS, masked_relu

import jax_epilog as je
from jax_epilog import fp8

SHAPES = [(37, 24, 40), (130, 50, 21)]  # M != K != N, none a multiple of 8


def _inputs(rng, m, k, n, dtype=jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal(n) * 0.5, dtype)
    return x, w, b


def _q(v, scale, dtype=fp8.E4M3):
    """The library's quantization, written again in NumPy."""
    v = np.asarray(v, np.float32) * (np.float32(1) / np.float32(scale))
    limit = float(ml_dtypes.finfo(dtype).max)
    return np.clip(v, -limit, limit).astype(dtype).astype(np.float64)


def _emulated(x, w, b, activation, out_dtype):
    """Current scaling's forward: scales from this step's amax, float64 GEMM, epilog (the
    bias in the output's 16-bit dtype, as cuBLASLt's FP8 kernels take it)."""
    sx = np.abs(np.asarray(x, np.float32)).max() * np.float32(1 / 448)  # float32, as the library
    sk = np.abs(np.asarray(w, np.float32)).max() * np.float32(1 / 448)
    z = (_q(x, sx) @ _q(w, sk)) * (np.float64(sx) * np.float64(sk))
    z = z + np.asarray(jnp.asarray(b).astype(out_dtype), np.float64)
    y = np.asarray(TWINS[activation](jnp.asarray(z))) if activation else z
    return np.asarray(jnp.asarray(y, jnp.float32).astype(out_dtype), np.float32)


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_forward_is_the_emulated_fp8_gemm(rng, activation, m, k, n, dtype):
    x, w, b = _inputs(rng, m, k, n, dtype)
    y, _ = jax.jit(functools.partial(je.fused_dense, activation=activation))(
        x, w, b, fp8=fp8.init(fp8.CurrentScaling())
    )
    assert y.dtype == dtype
    want = _emulated(x, w, b, activation, dtype)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2**-7, atol=1e-6)  # one bfloat16 ulp
    # ...and within FP8's error of the float32 layer.
    exact = np.asarray(TWINS.get(activation, lambda z: z)(x.astype(jnp.float32) @ w.astype(jnp.float32) + b))
    assert np.abs(np.asarray(y, np.float32) - exact).max() <= 0.1 * np.abs(exact).max()


def _loss(x, w, b, state, activation):
    y, _ = je.fused_dense(x, w, b, activation=activation, fp8=state)
    return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.shape[-1], dtype=jnp.float32)))


@pytest.mark.parametrize("activation", [None, "relu", "gelu"])
@pytest.mark.parametrize("recipe", [fp8.CurrentScaling(), fp8.DelayedScaling(history_length=4)])
def test_gradients_follow_float32_and_update_the_grad_scale(rng, activation, recipe):
    x, w, b = _inputs(rng, 61, 48, 36)
    state = fp8.init(recipe)
    if isinstance(recipe, fp8.DelayedScaling):  # a step first, so the scales fit
        state = jax.grad(_loss, argnums=3)(x, w, b, state, activation)
    grads = jax.jit(jax.grad(_loss, argnums=(0, 1, 2, 3)), static_argnums=4)(x, w, b, state, activation)

    y_fp8, _ = je.fused_dense(x, w, b, activation=activation, fp8=state)
    mask = np.asarray(y_fp8, np.float32) > 0  # ReLU's derivative as the FP8 forward saw it

    def exact(x, w, b):
        z = x.astype(jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32)
        y = masked_relu(z, mask) if activation == "relu" else TWINS[activation](z) if activation else z
        return jnp.sum(y * jnp.cos(jnp.arange(y.shape[-1], dtype=jnp.float32)))

    want = jax.grad(exact, argnums=(0, 1, 2))(x, w, b)
    for got, ref in zip(grads[:3], want):
        assert got.dtype == jnp.bfloat16 and got.shape == ref.shape
        # E5M2 keeps 2 mantissa bits; ReLU's mask flips where FP8 moved z across zero.
        err = np.linalg.norm(np.asarray(got, np.float32) - np.asarray(ref))
        assert err <= 0.1 * np.linalg.norm(np.asarray(ref))
    new = grads[3]
    dz_amax = float(new.grad.amax_history[0])
    assert dz_amax > 0 and np.isfinite(dz_amax)
    assert float(new.x.amax_history[0]) == pytest.approx(float(jnp.max(jnp.abs(x.astype(jnp.float32)))))


def test_fp8_output_and_fp8_input_chain(rng):
    x, w, b = _inputs(rng, 45, 32, 56)
    state = fp8.init(fp8.DelayedScaling(history_length=2))
    _, state = je.fused_dense(x, w, b, activation="gelu", fp8=state)
    y, _ = je.fused_dense(x, w, b, activation="gelu", fp8=state)
    q, new = jax.jit(lambda *a: je.fused_dense(*a, activation="gelu", fp8=state, fp8_output=True))(x, w, b)
    assert isinstance(q, fp8.Quantized) and q.data.dtype == fp8.E4M3
    # Within one E4M3 ulp (2**-3 of the binade) of the 16-bit output, at the output's scale.
    ulp = np.float32(q.scale) * 2.0 ** (
        np.floor(np.log2(np.maximum(np.abs(np.asarray(y, np.float32)) / q.scale, 2**-6))) - 3
    )
    assert np.all(
        np.abs(np.asarray(q.dequantize()) - np.asarray(y, np.float32))
        <= ulp + 2**-8 * np.abs(np.asarray(y, np.float32))
    )
    assert float(new.output.amax_history[0]) > 0
    w2 = jnp.asarray(rng.standard_normal((56, 24)) / 8, jnp.bfloat16)
    y2, s2 = je.fused_dense(q, w2, None, fp8=fp8.init(fp8.DelayedScaling(history_length=2)))
    assert y2.shape == (45, 24) and y2.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(s2.x.amax_history), 0)  # a Quantized x is used as it is


def test_leading_dimensions_jit_vmap_and_remat(rng):
    x, w, b = _inputs(rng, 3 * 17, 24, 40)
    x3 = x.reshape(3, 17, 24)
    state = fp8.init(fp8.CurrentScaling())
    y, _ = je.fused_dense(x3, w, b, activation="gelu", fp8=state)
    assert y.shape == (3, 17, 40)
    g = jax.grad(
        lambda x: jnp.sum(
            jax.checkpoint(lambda x: je.fused_dense(x, w, b, activation="gelu", fp8=state)[0])(x).astype(
                jnp.float32
            )
        )
    )(x3)
    assert g.shape == x3.shape and np.isfinite(np.asarray(g, np.float32)).all()
    batched = jax.vmap(lambda r: je.fused_dense(r, w, b, activation="relu", fp8=state)[0])(x3)
    single = jnp.stack([je.fused_dense(r, w, b, activation="relu", fp8=state)[0] for r in x3])
    # (each member scaled by its own amax; batched sums may round a bfloat16 step apart)
    np.testing.assert_allclose(
        np.asarray(batched, np.float32), np.asarray(single, np.float32), rtol=2**-7, atol=1e-6
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fp8": "delayed"}, "fp8 must be a jax_epilog.fp8.DenseState"),
        ({"compute_type": "COMPUTE_32F_FAST_TF32"}, "compute_type='COMPUTE_32F_FAST_TF32'"),
        ({"return_aux": True}, "return_aux=True is not available with fp8"),
        ({"implementation": "xla"}, "implementation='xla' with fp8"),
        ({"activation": "tanh"}, "unknown activation 'tanh'"),
        ({"fp8_output": 1}, "fp8_output must be True or False"),
    ],
)
def test_bad_fp8_calls_raise_at_trace_time(rng, kwargs, match):
    x, w, b = _inputs(rng, 8, 24, 40)
    kwargs = {"fp8": fp8.init()} | kwargs
    with pytest.raises((TypeError, ValueError), match=match) as info:
        jax.jit(lambda x: je.fused_dense(x, w, b, **kwargs)).lower(x)
    assert "fused_dense" in str(info.value)


def test_bad_fp8_dtypes_raise(rng):
    x, w, b = _inputs(rng, 8, 24, 40)
    with pytest.raises(TypeError, match="allowed: \\('bfloat16', 'float16', 'float32'\\)"):
        je.fused_dense(x.astype(jnp.int8), w.astype(jnp.int8), None, fp8=fp8.init())
    bad = fp8.Quantized(x.astype(fp8.E5M2), jnp.float32(1))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        je.fused_dense(bad, w, b, fp8=fp8.init())


def test_rows_split_over_devices_match_one_device_and_share_one_amax(rng):
    devices = np.array(jax.devices()[:4])
    if devices.size < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.sharding.Mesh(devices, ("rows",))
    x, w, b = _inputs(rng, 64, 40, 48)
    state = fp8.init(fp8.DelayedScaling(history_length=2))
    # An FP8 output: its amax comes from the GEMM, a max over every device's rows.
    f = jax.jit(lambda x, s: je.fused_dense(x, w, b, activation="gelu", fp8=s, fp8_output=True))
    q1, s1 = f(x, state)
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows")))
    q4, s4 = f(xs, state)
    assert "all-reduce" in f.lower(xs, state).compile().as_text()
    np.testing.assert_array_equal(np.asarray(q4.data, np.float32), np.asarray(q1.data, np.float32))
    assert float(s1.output.amax_history[0]) > 0
    for got, want in zip(jax.tree.leaves(s4), jax.tree.leaves(s1)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("split", ["column", "row"])
def test_explicit_sharding_types_every_fp8_gradient_as_its_primal(rng, split):
    """Under explicit sharding a gradient must have its primal's type: a column-parallel
    kernel's (and a row-parallel layer's x's) gradient comes out of a GEMM whole or split
    otherwise, and is resharded; the values are one device's."""
    from helpers import assert_gradients_like_primals, explicit_mesh_2x2
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = explicit_mesh_2x2()
    x, w, b = _inputs(rng, 4 * 9, 2 * 20, 2 * 24)
    specs = {
        "column": (("data",), (None, "model"), ("model",)),
        "row": (("data", "model"), ("model", None), ()),
    }
    args = [
        jax.device_put(v, NamedSharding(mesh, PartitionSpec(*s))) for v, s in zip((x, w, b), specs[split])
    ]
    loss = lambda x, w, b, s: jnp.sum(
        jnp.sin(je.fused_dense(x, w, b, activation="gelu", fp8=s)[0].astype(jnp.float32))
    )
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    assert_gradients_like_primals(grad(*args, fp8.init()), grad(x, w, b, fp8.init()), args)


def test_column_parallel_kernel_and_split_rows_match_one_device(rng):
    devices = np.array(jax.devices()[:4])
    if devices.size < 4:
        pytest.skip("needs 4 devices")
    mesh = jax.sharding.Mesh(devices.reshape(2, 2), ("rows", "cols"))
    spec = jax.sharding.PartitionSpec
    x, w, b = _inputs(rng, 64, 40, 96)
    state = fp8.init(fp8.DelayedScaling(history_length=2))
    f = jax.jit(lambda x, w, b, s: je.fused_dense(x, w, b, activation="relu", fp8=s, fp8_output=True))
    q1, s1 = f(x, w, b, state)
    put = lambda v, *axes: jax.device_put(v, jax.sharding.NamedSharding(mesh, spec(*axes)))
    args = (put(x, "rows"), put(w, None, "cols"), put(b, "cols"), state)
    q4, s4 = f(*args)
    assert q4.data.sharding.spec == spec("rows", "cols")  # no gather of x, columns stay split
    np.testing.assert_array_equal(np.asarray(q4.data, np.float32), np.asarray(q1.data, np.float32))
    np.testing.assert_array_equal(np.asarray(s4.output.amax_history), np.asarray(s1.output.amax_history))


@pytest.mark.parametrize("wgrad_in_xla", [True, False])
def test_the_gpu_program_is_three_fp8_gemms_with_k_and_n_padded_to_16(rng, cublaslt_accepts, wgrad_in_xla):
    import re

    from helpers import cuda_text, custom_calls

    x, w, b = _inputs(rng, 37, 24, 40)
    loss = lambda x, w, b, s: _loss(x, w, b, s, "gelu")
    with je.override_policy(fp8_wgrad_in_xla=wgrad_in_xla):
        text = cuda_text(jax.grad(loss, argnums=(0, 1, 2, 3)), x, w, b, fp8.init())
    calls = custom_calls(text)
    sizes = [tuple(int(re.search(rf"\b{d} = (\d+)", c)[1]) for d in "mnk") for c in calls]
    dots = re.findall(r"stablehlo.dot_general.*", text)
    if wgrad_in_xla:  # the kernel gradient: XLA's FP8 GEMM on the E4M3 x and the E5M2 dz
        assert [re.search(r'epilog = "(\w+)"', c)[1] for c in calls] == ["GELU_AUX_BIAS", "DEFAULT"]
        assert sizes == [(37, 48, 32), (37, 32, 48)]  # forward, dgrad
        assert len(dots) == 1 and "37x24xf8E4M3FN" in dots[0] and "37x40xf8E5M2" in dots[0]
    else:
        assert [re.search(r'epilog = "(\w+)"', c)[1] for c in calls] == [
            "GELU_AUX_BIAS",
            "DEFAULT",
            "DEFAULT",
        ]
        assert sizes == [(37, 48, 32), (37, 32, 48), (24, 48, 48)]  # forward, dgrad, wgrad (K: the rows)
        assert not dots


@pytest.mark.parametrize("command_buffers", [False, True])
def test_fp8_calls_run_outside_xlas_command_buffers_unless_the_policy_says(
    rng, cublaslt_accepts, command_buffers
):
    """By default the FP8 custom calls use the target without the command-buffer trait (XLA
    re-recorded them at every train step); the policy can hand them back to the command
    buffers. The bfloat16 op keeps the trait either way."""
    from helpers import cuda_text

    from jax_epilog.cuda.ffi import EAGER_TARGET_NAME, TARGET_NAME

    x, w, b = _inputs(rng, 37, 24, 40)
    loss = lambda x, w, b, s: _loss(x, w, b, s, "gelu")
    with je.override_policy(fp8_command_buffers=command_buffers):
        text = cuda_text(jax.grad(loss, argnums=(0, 1, 2, 3)), x, w, b, fp8.init())
        plain = cuda_text(
            lambda x, w, b: je.fused_dense(x, w, b, activation="gelu", implementation="cublaslt"), x, w, b
        )
    used, unused = (TARGET_NAME, EAGER_TARGET_NAME) if command_buffers else (EAGER_TARGET_NAME, TARGET_NAME)
    assert text.count(f"@{used}(") == 2 and f"@{unused}(" not in text  # forward and dgrad
    assert plain.count(f"@{TARGET_NAME}(") == 1 and EAGER_TARGET_NAME not in plain
