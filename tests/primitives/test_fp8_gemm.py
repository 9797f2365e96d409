"""``fp8_matmul_p``: its emulation against NumPy, its CUDA lowering (padding to 16, the
K-contiguous copies) against its CPU lowering, and on a GPU, cuBLASLt against the
emulation within one E4M3 ulp of the output scale."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ON_GPU, TWINS

import jax_epilog as je
from jax_epilog import fp8
from jax_epilog.primitives.fp8_gemm import fp8_matmul, operand_names, reference

BF16 = jnp.bfloat16


def _fp8(rng, shape, dtype=fp8.E4M3, scale=1.0):
    return jnp.asarray((rng.standard_normal(shape) * scale).astype(dtype))


def _forward_operands(rng, m, k, n, d_dtype):
    x, kernel = _fp8(rng, (m, k)), _fp8(rng, (k, n))
    scales = [jnp.float32(0.5), jnp.float32(1 / np.sqrt(k))]
    d_scale = [jnp.float32(40.0)] if np.dtype(d_dtype) == fp8.E4M3 else []
    return [x, kernel, *scales, *d_scale, jnp.asarray(rng.standard_normal(n), BF16)]


CASES = {  # name: (problem, epilog, d_dtype, aux_dtype)
    "forward gelu aux, bf16": ("forward", "GELU_AUX_BIAS", BF16, BF16),
    "forward gelu aux, e4m3": ("forward", "GELU_AUX_BIAS", fp8.E4M3, BF16),
    "forward relu, e4m3": ("forward", "RELU_BIAS", fp8.E4M3, None),
    "forward bias, bf16": ("forward", "BIAS", BF16, None),
}


def _numpy_forward(ops, epilog, d_dtype):
    x, kernel, sx, sk, *rest = (np.asarray(o, np.float64) for o in ops)
    z = x @ kernel * (sx * sk) + rest[-1]
    act = next((a for a in ("relu", "gelu") if epilog.lower().startswith(a)), None)
    y = np.asarray(TWINS[act](jnp.asarray(z))) if act else z
    if np.dtype(d_dtype) == fp8.E4M3:
        d = np.clip(y * rest[0], -448, 448).astype(fp8.E4M3)
    else:
        d = np.asarray(jnp.asarray(y, jnp.float32).astype(d_dtype))
    return d, np.abs(y).max(), z


@pytest.mark.parametrize("case", list(CASES))
def test_emulation_is_the_gemm_then_the_epilog(rng, case):
    problem, epilog, d_dtype, aux_dtype = CASES[case]
    ops = _forward_operands(rng, 45, 37, 29, d_dtype)
    outs = fp8_matmul(*ops, problem=problem, epilog=epilog, d_dtype=d_dtype, aux_dtype=aux_dtype)
    d, amax, z = _numpy_forward(ops, epilog, d_dtype)
    got = np.asarray(outs[0]).astype(np.float32)
    if np.dtype(d_dtype) == fp8.E4M3:  # within one E4M3 step (float32 vs float64 sums)
        np.testing.assert_allclose(got, d.astype(np.float32), rtol=2**-3, atol=2**-9)
        assert np.mean(got != d.astype(np.float32)) < 0.02
    else:
        np.testing.assert_allclose(got, d.astype(np.float32), rtol=2**-7, atol=1e-6)
    np.testing.assert_allclose(float(outs[1]), amax, rtol=1e-5)
    if "AUX" in epilog:
        assert outs[2].shape == (45, 32)  # rows of round_up(N, 8)
        np.testing.assert_allclose(np.asarray(outs[2][:, :29], np.float32), z, rtol=2**-7, atol=1e-5)


def test_dgrad_applies_gelus_derivative_and_wgrad_contracts_the_rows(rng):
    dz, kernel = _fp8(rng, (45, 29), fp8.E5M2), _fp8(rng, (37, 29))
    aux = jnp.asarray(rng.standard_normal((45, 40)), BF16)
    s = [jnp.float32(0.25), jnp.float32(0.125)]
    (dx, _amax) = fp8_matmul(dz, kernel, *s, aux, problem="dgrad", epilog="DGELU", d_dtype=jnp.float32)
    dh = np.asarray(dz, np.float64) @ np.asarray(kernel, np.float64).T * (0.25 * 0.125)
    slope = np.asarray(jax.vmap(jax.vmap(jax.grad(TWINS["gelu"])))(aux[:, :37].astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(dx), dh * slope, rtol=1e-5, atol=1e-6)
    x = _fp8(rng, (45, 37))
    (dw,) = fp8_matmul(x, dz, *s, problem="wgrad", epilog="DEFAULT", d_dtype=jnp.float32, amax=False)
    want = np.asarray(x, np.float64).T @ np.asarray(dz, np.float64) * (0.25 * 0.125)
    np.testing.assert_allclose(np.asarray(dw), want, rtol=1e-5, atol=1e-6)


def _all_cases(rng, m, k, n):
    """Every problem at one size: (operands, params) pairs."""
    out = []
    for problem, epilog, d_dtype, aux_dtype in CASES.values():
        ops = _forward_operands(rng, m, k, n, d_dtype)
        amax = d_dtype is fp8.E4M3  # (cuBLASLt writes the amax of an FP8 D only)
        params = {
            "problem": problem,
            "epilog": epilog,
            "d_dtype": d_dtype,
            "aux_dtype": aux_dtype,
            "amax": amax,
        }
        out.append((ops, params))
    dz, kernel = _fp8(rng, (m, n), fp8.E5M2), _fp8(rng, (k, n))
    aux = jnp.asarray(rng.standard_normal((m, -(-k // 8) * 8)), BF16)
    s = [jnp.float32(0.25), jnp.float32(0.125)]
    out.append(
        ([dz, kernel, *s, aux], {"problem": "dgrad", "epilog": "DGELU", "d_dtype": BF16, "amax": False})
    )
    out.append(
        (
            [_fp8(rng, (m, k)), dz, *s],
            {"problem": "wgrad", "epilog": "DEFAULT", "d_dtype": jnp.float32, "amax": False},
        )
    )
    return out


def test_cuda_lowering_pads_to_16_and_makes_k_contiguous_copies(rng, reference_calls):
    for ops, params in _all_cases(rng, 45, 37, 29):
        call = jax.jit(functools.partial(fp8_matmul, **params))
        with je.override_policy(fp8_wgrad_in_xla=False):
            fused = call(*ops)  # the CUDA lowering, its custom call from the emulation
        spec = reference_calls[-1]
        assert spec.n % 16 == 0 and spec.k % 16 == 0 and spec.problem == "fp8"
        assert len(ops) == len(operand_names(params["problem"], params["epilog"], params["d_dtype"]))
        plain = reference(*ops, **{"aux_dtype": None, "amax": True} | params)
        for a, b in zip(fused, plain, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            # (sums in another order: at most a step of the output's dtype apart)
            rtol = 2**-3 if a.dtype == fp8.E4M3 else 2**-7
            np.testing.assert_allclose(
                np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=rtol, atol=1e-5
            )


def test_the_kernel_gradient_as_xlas_fp8_gemm_is_the_emulation(rng):
    from jax_epilog.primitives.fp8_gemm import _xla_wgrad

    ops, params = next(c for c in _all_cases(rng, 45, 37, 29) if c[1]["problem"] == "wgrad")
    for d_dtype in (jnp.float32, jnp.bfloat16):
        (got,) = jax.jit(functools.partial(_xla_wgrad, d_dtype=d_dtype))(*ops)
        (want,) = reference(*ops, **(params | {"d_dtype": d_dtype, "aux_dtype": None}))
        assert got.dtype == want.dtype and got.shape == want.shape == (37, 29)
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-5
        )


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("m, k, n", [(1000, 200, 300), (777, 130, 90)])
def test_gpu_matches_the_emulation_within_one_e4m3_ulp(rng, m, k, n, fresh_warnings):
    cpu = jax.devices("cpu")[0]
    for ops, params in _all_cases(rng, m, k, n):
        call = jax.jit(functools.partial(fp8_matmul, **params))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no fallback: cuBLASLt ran every problem
            got = call(*ops)
        want = call(*jax.device_put(ops, cpu))
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            a, b = np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
            top = np.abs(b).max()
            if params["d_dtype"] is fp8.E4M3 and a.ndim:  # one E4M3 ulp at each value
                ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(b), 2**-6))) - 3)
                if "BIAS" in params["epilog"]:
                    # Where the bias cancels the product, cuBLASLt's result is off the
                    # float32 emulation by about one 16-bit step of the product (as if its
                    # epilog added the bias in the bias's type): up to 2^-8 of the largest
                    # value (docs/decisions.md#fp8-epilogs).
                    ulp = np.maximum(ulp, 2**-8 * top)
                off = np.abs(a - b) > ulp
                assert not off.any(), (params, off.sum(), a[off][:8], b[off][:8])
            else:
                assert np.abs(a - b).max() <= 2**-7 * top + 1e-6, params


REFUSALS = {  # what cuBLASLt refuses -> (what runs instead, the warning)
    "epilogs": (
        lambda spec: spec.epilog != "DEFAULT",
        "DEFAULT",
        "its epilog runs in XLA after cuBLASLt's FP8 GEMM",
    ),
    "FP8 outputs": (lambda spec: spec.d_fp8, None, "its FP8 output is cast in XLA"),
    "float32 outputs too": (
        lambda spec: spec.epilog != "DEFAULT" or spec.d_dtype == "float32",
        "DEFAULT",
        "its epilog runs in XLA",
    ),
}


@pytest.mark.parametrize("refused", list(REFUSALS))
def test_a_refused_problem_runs_the_nearest_one_and_the_rest_in_xla(
    rng, reference_calls, monkeypatch, fresh_warnings, refused
):
    from jax_epilog import FastPathWarning, _warnings
    from jax_epilog.cuda import ffi

    refuses, runs, warning = REFUSALS[refused]
    monkeypatch.setattr(ffi, "prepare", lambda spec: "no" if refuses(spec) else None)
    for ops, params in _all_cases(rng, 45, 37, 29):
        probe = fp8_gemm_spec(ops, params)
        if not refuses(probe):
            continue
        _warnings.warn_once.cache_clear()  # (one warning per reason)
        with pytest.warns(FastPathWarning, match=warning), je.override_policy(fp8_wgrad_in_xla=False):
            fused = jax.jit(functools.partial(fp8_matmul, **params))(*ops)
        assert not refuses(reference_calls[-1])
        assert runs is None or reference_calls[-1].epilog == runs
        plain = reference(*ops, **{"aux_dtype": None, "amax": True} | params)
        for a, b in zip(fused, plain, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            is_fp8 = a.dtype == fp8.E4M3
            rtol, atol = (2**-3 if is_fp8 else 2**-7), 1e-5
            a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
            if refused == "float32 outputs too":  # a bfloat16 product, then the epilog: near
                # zero, where bias and product cancel, its rounding is the product's
                rtol, atol = max(rtol, 2**-6), 2**-7 * float(np.abs(b).max())
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def fp8_gemm_spec(ops, params):
    from jax_epilog.primitives.fp8_gemm import _spec

    avals = [jax.core.ShapedArray(o.shape, o.dtype) for o in ops]
    return _spec(avals, **{"aux_dtype": None, "amax": True} | params)
