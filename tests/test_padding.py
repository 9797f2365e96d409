"""``jax_epilog._padding``: which calls pad K and N to whole rows, to what widths, and
that padded calls (their operands zero-padded, their results cut back) give the unpadded
calls' values, auxes and gradients. The CUDA lowerings run here on the CPU, each custom
call routed to its problem's reference math (conftest.py's ``reference_calls``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GRAD_TOL, TOL, assert_near, cuda_text, custom_calls

from jax_epilog import fused_dense, fused_mlp, get_policy, override_policy
from jax_epilog._epilogs import Activation, EpilogSpec, aux_padded_width
from jax_epilog._padding import (
    aligned_rows,
    cut_to,
    fast_rows,
    on_padded_rows,
    pad_to,
    padded_layer,
    padded_spec,
    pads_n,
)

op = functools.partial(fused_dense, implementation="cublaslt")
_MLIR_TYPE = {"bfloat16": "bf16", "float32": "f32"}


def test_pad_to_appends_zeros_and_cut_to_undoes_it(rng):
    a = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)
    padded = pad_to(a, 4, 7)
    assert padded.shape == (2, 4, 7)
    np.testing.assert_array_equal(np.asarray(padded[:, :3, :5]), np.asarray(a))
    assert not np.asarray(padded[:, 3:]).any() and not np.asarray(padded[..., 5:]).any()
    np.testing.assert_array_equal(np.asarray(cut_to(padded, 3, 5)), np.asarray(a))
    assert pad_to(a, 5) is a and cut_to(a, 3, 5) is a  # nothing to do: the array itself


# ------------------------------------------------------------------ which calls pad


def _spec(n, k, epilog="GELU_BIAS", dtype="bfloat16", m=8192, **kw):
    return EpilogSpec(
        m=m,
        n=n,
        k=k,
        epilog=epilog,
        compute_type="COMPUTE_32F",
        ab_dtype=dtype,
        bias_dtype=dtype,
        d_dtype=dtype,
        **kw,
    )


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
    """Which widths a padded bfloat16 call at 8192 rows has (``padded_spec``): K and an
    aux's N to 16-byte rows, the N of a forward without aux from 1024 up to 128 (float32:
    16-byte rows, the wider ones unmeasured there); wgrad's and dgrad's to 16 bytes."""
    spec = _spec(n, k, epilog)
    assert (padded_spec(spec).n, padded_spec(spec).k) == want
    single = padded_spec(_spec(n, k, epilog, "float32"))
    assert (single.n, single.k) == (-(-n // 4) * 4, -(-k // 4) * 4)
    for problem in ("wgrad", "dgrad"):  # their widths are 16-byte rows
        other = padded_spec(spec._replace(problem=problem))
        assert (other.n, other.k) == (-(-n // 8) * 8, -(-k // 8) * 8)


def test_the_policys_row_numbers_decide_what_pads():
    """``pad_min_rows`` and ``pad_min_work`` (times the members) decide which calls pad,
    ``row_bytes`` their rows (1: none), ``wide_row_bytes`` and ``wide_min_n`` a half
    forward's N without aux."""
    spec = _spec(4097, 1020, m=1024)  # M*N*K just under 2**32
    assert padded_spec(spec) == spec and not pads_n(1024, 4097, 1020, "bfloat16")
    assert (padded_spec(spec._replace(members=2)).n, padded_spec(spec._replace(members=2)).k) == (4160, 1024)
    with override_policy(pad_min_work=2**31):
        assert (padded_spec(spec).n, padded_spec(spec).k) == (4160, 1024) and pads_n(
            1024, 4097, 1020, "bfloat16"
        )
        with override_policy(pad_min_rows=1025):
            assert padded_spec(spec) == spec
        with override_policy(wide_min_n=4098):
            assert padded_spec(spec).n == 4104
        with override_policy(wide_row_bytes=256):
            assert padded_spec(spec).n == 4224
        with override_policy(row_bytes=32):
            assert (padded_spec(spec).n, padded_spec(spec).k) == (4160, 1024)
            assert (padded_spec(spec._replace(epilog="GELU_AUX_BIAS")).n, padded_spec(spec).k) == (4104, 1024)
            assert not aligned_rows(4104, 1024, "bfloat16") and aligned_rows(4112, 1024, "bfloat16")
        with override_policy(row_bytes=1):
            assert padded_spec(spec) == spec and aligned_rows(4097, 1020, "bfloat16")
    assert get_policy().row_bytes == 16


def test_fast_rows_are_aligned_or_padded():
    assert fast_rows(16, 4096, 1024, "bfloat16")  # aligned at any size
    assert not fast_rows(1024, 4097, 1020, "bfloat16")  # unaligned, too small to pad
    assert fast_rows(8192, 4097, 1020, "bfloat16")  # padded
    assert aligned_rows(4097, 1021, "float64") is False and aligned_rows(4098, 1022, "float64")


def test_padded_layer_pads_only_where_a_fused_call_would(rng):
    (batch,) = jax.export.symbolic_shape("b")
    x, w, b = (
        jnp.ones((2, 4096, 1020), jnp.bfloat16),
        jnp.ones((1020, 4097), jnp.bfloat16),
        jnp.ones((4097,), jnp.bfloat16),
    )
    shapes = [a.shape for a in padded_layer(x, w, b)]
    assert shapes == [(2, 4096, 1024), (1024, 4104), (4104,)]
    assert padded_layer(x, w, None)[2] is None
    small = [jnp.ones(s, jnp.bfloat16) for s in ((3, 5), (5, 7), (7,))]
    assert all(p is a for p, a in zip(padded_layer(*small), small))
    symbolic = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((batch, 1020), (1020, 4097), (4097,))]
    assert jax.eval_shape(lambda *a: padded_layer(*a)[1], *symbolic).shape == (
        1020,
        4097,
    )  # sizes unknown: as given
    # on_padded_rows: f on the padded operands, its result cut back to N
    x, w, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((9, 5), (5, 7), (7,)))
    with override_policy(pad_min_rows=0, pad_min_work=0):
        seen = []
        y = on_padded_rows(lambda *a: seen.append([o.shape for o in a]) or a[0] @ a[1] + a[2], x, w, b)
    assert seen == [[(9, 8), (8, 8), (8,)]] and y.shape == (9, 7)
    np.testing.assert_allclose(np.asarray(y), np.asarray(x @ w + b), rtol=1e-6, atol=1e-6)


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
    text = cuda_text(functools.partial(op, activation="gelu", return_aux=return_aux), *args)
    (call,) = custom_calls(text)
    assert f"m = {m}" in call and f"n = {n_call}" in call and f"k = {k}" in call, call
    assert f"-> tensor<{m}x{n_call}x{_MLIR_TYPE[dtype]}>" in call or f"-> (tensor<{m}x{n_call}x" in call, call
    assert f"tensor<{m}x{n}x{_MLIR_TYPE[dtype]}>" in text  # the user's y


# ------------------------------------------------------ padded calls keep the values


def _relu_bits(aux):
    return np.unpackbits(np.asarray(aux), axis=-1, bitorder="little")[..., :65]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_calls_pad_row_widths_and_slice_their_results(rng, reference_calls, dtype):
    """With K = 29 and N = 65 (rows not 16 bytes apart), and padding at any size, every
    custom call gets operands padded with zeros to whole 16-byte rows (the forward's,
    BGRADA's, fused_mlp's DGELU and an ensemble's batched call; a bfloat16 forward without
    aux pads N to 128 bytes, one with an aux to 16), and the layer's values, aux and
    gradients equal those of the same calls made unpadded (``row_bytes=1``)."""
    seen = reference_calls
    multiple = 16 // np.dtype(jnp.dtype(dtype)).itemsize
    x = jnp.asarray(rng.standard_normal((3, 11, 29)), dtype)
    w = jnp.asarray(rng.standard_normal((29, 65)) / 6, dtype)
    b, w2 = jnp.asarray(rng.standard_normal(65), dtype), jnp.asarray(rng.standard_normal((65, 6)) / 8, dtype)
    ws, bs = jnp.stack([w, -w]), jnp.stack([b, 2 * b])
    cases = {
        "relu": lambda x, w, b: op(x, w, b, activation="relu", return_aux=True)[0],
        "gelu": lambda x, w, b: op(x, w, b, activation="gelu"),
        "mlp": lambda x, w, b: fused_mlp(x, [(w, b), (w2, None)], ["gelu", None], implementation="cublaslt"),
        "members": lambda x, w, b: jax.vmap(lambda w, b: op(x, w, b, activation="gelu"))(ws + w, bs + b),
    }

    def results():  # (jitted afresh, so that each lowering reads the policy of its time)
        loss = lambda f: jax.jit(
            jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32))), argnums=(0, 1, 2))
        )
        values = {name: jax.jit(lambda *a, f=f: f(*a))(x, w, b) for name, f in cases.items()}
        grads = {name: loss(f)(x, w, b) for name, f in cases.items()}
        auxes = {
            act: jax.jit(lambda *a, act=act: op(*a, activation=act, return_aux=True)[1])(x, w, b)
            for act in ("relu", "gelu")
        }
        return values, grads, auxes

    with override_policy(pad_min_rows=0, pad_min_work=0, wide_min_n=0):
        padded = results()
        assert {(s.problem, s.members > 1) for s in seen} == {
            ("forward", False),
            ("forward", True),
            ("wgrad", False),
            ("dgrad", False),
        }
        assert all(s.n % multiple == 0 and s.k % multiple == 0 for s in seen)
        forwards = {(s.has_aux, s.n) for s in seen if s.problem == "forward"}
        wide = 8 * multiple if dtype == "bfloat16" else multiple  # (float32 keeps 16 bytes)
        assert (True, -(-65 // multiple) * multiple) in forwards and (
            False,
            -(-65 // wide) * wide,
        ) in forwards
        assert all(n % wide == 0 or aux for aux, n in forwards), forwards
        seen.clear()
        with override_policy(row_bytes=1):
            unpadded = results()
    assert {(s.n, s.k) for s in seen if s.problem == "forward"} == {
        (65, 29),
        (6, 65),
    }  # (fused_mlp's second layer)
    # (XLA's CPU GEMMs may sum in another order in the two programs: bf16 gradients moved by
    # a few units in the last place of their largest entry.)
    for name in cases:
        assert_near(padded[0][name], unpadded[0][name], TOL[dtype], f"{name} value")
        for arg, got, want in zip("xwb", padded[1][name], unpadded[1][name], strict=True):
            assert_near(got, want, GRAD_TOL[dtype], f"{name} d{arg}")
    # The aux: ReLU's bits and GELU's z over the N real columns (the padding is unspecified).
    np.testing.assert_array_equal(_relu_bits(padded[2]["relu"]), _relu_bits(unpadded[2]["relu"]))
    assert_near(padded[2]["gelu"][..., :65], unpadded[2]["gelu"][..., :65], TOL[dtype], "GELU aux")


@pytest.mark.parametrize("row_bytes", [64, 256])
def test_an_aux_keeps_the_layers_layout_at_any_row_width(rng, reference_calls, row_bytes):
    """Rows padded wider than 16 bytes (as ``benchmarks.probes.pad_width`` asks) leave each
    aux laid out as the layer's: a forward with an aux pads N, and fused_mlp's DGELU call
    K, no further than the aux's own padding (``aux_columns``), so cuBLASLt never writes or
    reads the aux by a wider row than its buffer has. (On an H100 the GELU forward padded
    to 64 bytes wrote its aux so, and its gradients were wrong.) The values, auxes and
    gradients equal the unpadded calls'."""
    seen = reference_calls
    x = jnp.asarray(rng.standard_normal((2, 9, 29)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((29, 65)) / 6, jnp.bfloat16)
    b, w2 = (
        jnp.asarray(rng.standard_normal(65), jnp.bfloat16),
        jnp.asarray(rng.standard_normal((65, 6)) / 8, jnp.bfloat16),
    )
    mlp = lambda x, w, b: fused_mlp(x, [(w, b), (w2, None)], ["gelu", None], implementation="cublaslt")

    def results():  # (jitted afresh, so that each lowering reads the row width of its time)
        auxed = {
            act: jax.jit(lambda *a, act=act: op(*a, activation=act, return_aux=True))(x, w, b)
            for act in ("relu", "gelu")
        }
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(jnp.sin(mlp(*a).astype(jnp.float32))), argnums=(0, 1, 2)))
        return auxed, grad(x, w, b)

    with override_policy(
        pad_min_rows=0, pad_min_work=0, wide_min_n=0, row_bytes=row_bytes
    ):  # (256: wider than wide_row_bytes too)
        wide = results()
    # (the aux's width is the first layer's N, 65: a forward's N, the second layer's DGELU K)
    widths = {
        (s.problem, s.activation): s.n if s.problem == "forward" else s.k
        for s in seen
        if s.has_aux or s.problem == "dgrad"
    }
    assert set(widths) == {("forward", Activation.RELU), ("forward", Activation.GELU), ("dgrad", None)}
    for (problem, act), width in widths.items():
        act = act or Activation.GELU  # (dgrad's aux is a GELU layer's z)
        assert width > 65 and aux_padded_width(act, width) == aux_padded_width(act, 65), (problem, act, width)
    assert all(
        s.n % (row_bytes // 2) == 0 for s in seen if s.problem == "forward" and not s.has_aux
    )  # (the rest pad on)
    seen.clear()
    with override_policy(pad_min_rows=0, pad_min_work=0, wide_min_n=0, row_bytes=1):
        narrow = results()
    assert {s.n for s in seen if s.problem == "forward" and s.has_aux} == {65}
    np.testing.assert_array_equal(_relu_bits(wide[0]["relu"][1]), _relu_bits(narrow[0]["relu"][1]))
    for act in ("relu", "gelu"):
        assert_near(wide[0][act][0], narrow[0][act][0], TOL["bfloat16"], f"{act} value")
    assert_near(wide[0]["gelu"][1][..., :65], narrow[0]["gelu"][1][..., :65], TOL["bfloat16"], "GELU aux")
    for arg, got, want in zip("xwb", wide[1], narrow[1], strict=True):
        assert_near(got, want, GRAD_TOL["bfloat16"], f"fused_mlp d{arg}")
