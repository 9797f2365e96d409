import functools
import os
import secrets
import zlib

# Four virtual CPU devices for the tests that split fused_dense over several devices
# (test_partition.py). XLA reads the flag when jax starts; it changes nothing for the GPU.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    )

import jax  # (after XLA_FLAGS)
import numpy as np
import pytest
from jax.interpreters import mlir

from jax_epilog import _reference, _warnings
from jax_epilog._epilogs import ComputeType, check_buffers
from jax_epilog._fp8_spec import check_fp8_buffers
from jax_epilog._partition import partitioned_lowering
from jax_epilog.cuda import ffi
from jax_epilog.primitives import forward, fp8_gemm, gelu_input_grad, members, weight_grad
from jax_epilog.primitives._base import _with_rows_folded

jax.config.update("jax_enable_x64", True)


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SEED = int(os.environ.get("JAX_EPILOG_TEST_SEED", secrets.randbits(32)))
# pytest-xdist's workers inherit the environment: each draws this process's seed.
os.environ["JAX_EPILOG_TEST_SEED"] = str(SEED)


def _seed_line() -> str:
    return f"jax_epilog test seed: JAX_EPILOG_TEST_SEED={SEED} (set it to replay a run)"


def pytest_report_header(config):
    return _seed_line()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Under ``-q`` (the README's command) pytest prints no header: name the seed again
    after a failure, so the failing data can be drawn again."""
    if terminalreporter.stats.get("failed") or terminalreporter.stats.get("error"):
        terminalreporter.write_line(_seed_line())


@pytest.fixture
def rng(request):
    """Fresh random data for each test and each run; the header prints the seed to replay."""
    return np.random.default_rng([SEED, zlib.crc32(request.node.nodeid.encode())])


# ------------------------------------------------- the CUDA lowerings, on any machine


@pytest.fixture
def cublaslt_accepts(monkeypatch):
    """cuBLASLt accepting every problem at lowering (``cuda.ffi.prepare`` stands in for
    planning), so that a program lowered for "cuda" here holds the fused custom calls."""
    monkeypatch.setattr(ffi, "prepare", lambda spec: None)


@pytest.fixture
def fresh_warnings():
    """Each warning's once-per-reason memory emptied, before and after the test."""
    _warnings.warn_once.cache_clear()
    yield
    _warnings.warn_once.cache_clear()


# (primitive, its CUDA lowering, its reference math, its layout)
_RULES = [
    (forward.fused_matmul_p, forward._cuda, forward.reference, forward.layout),
    (weight_grad.fused_weight_grad_p, weight_grad._cuda, weight_grad.reference, weight_grad._layout),
    (
        gelu_input_grad.fused_gelu_input_grad_p,
        gelu_input_grad._cuda,
        gelu_input_grad.reference,
        gelu_input_grad._layout,
    ),
    (members.members_p, members._cuda, members._member_loop, members._layout),
    (fp8_gemm.fp8_matmul_p, fp8_gemm._cuda, fp8_gemm.reference, fp8_gemm._layout),
]


@pytest.fixture
def cuda_lowerings_on_cpu(cublaslt_accepts):
    """The primitives' CUDA lowerings registered for the CPU, cuBLASLt accepting every
    problem: each pads its operands to the problem's rows, folds its rows' leading
    dimensions and emits ``ffi.call`` (route it with ``reference_calls``, or use float64
    operands, which the lowerings hand to the reference math as on a GPU). Restored after."""
    for primitive, cuda, _, layout in _RULES:
        lowering = _with_rows_folded(cuda, layout)
        mlir.register_lowering(primitive, partitioned_lowering(primitive, lowering, layout), platform="cpu")
    yield
    for primitive, _, reference, layout in _RULES:
        cpu = mlir.lower_fun(reference, multiple_results=True)
        mlir.register_lowering(primitive, partitioned_lowering(primitive, cpu, layout), platform="cpu")


def _reference_call(seen: list, operands, results, spec, command_buffer: bool = True):
    """The custom call's results from its problem's reference math on the operands it is
    handed, whose shapes must be the problem's (padded) sizes, as ``ffi.call`` checks
    them. Appends ``spec`` to ``seen``."""
    if spec.problem == "fp8":
        return _fp8_reference_call(seen, operands, results, spec)
    check_buffers([o.shape for o in operands], [r.shape for r in results], spec)
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
            return _reference.dense(
                x, kernel, bias[0] if bias else None, spec.activation, ct, d_dtype, spec.has_aux
            )

        if spec.members > 1:
            names = ("x", "kernel", "bias")[: len(operands)]
            one = jax.vmap(one, in_axes=[None if spec.is_shared(name) else 0 for name in names])
        d, aux = one(x, kernel, *bias)
        outs = [d] if aux is None else [d, aux]
    assert [(o.shape, o.dtype) for o in outs] == [(r.shape, r.dtype) for r in results]
    return list(outs)


def _fp8_reference_call(seen: list, operands, results, spec):
    """An FP8 custom call from the emulation, on the GPU's K-contiguous P (M, K) and Q (N, K)."""
    check_fp8_buffers([o.shape for o in operands], [r.shape for r in results], spec)
    assert operands[0].dtype.name == spec.p_dtype and operands[1].dtype.name == spec.q_dtype
    seen.append(spec)
    p, q, *rest = operands
    params = {"epilog": spec.epilog, "d_dtype": results[0].dtype, "amax": bool(spec.amax)}
    params["aux_dtype"] = results[-1].dtype if spec.aux_out else None
    if spec.aux_in:  # DGELU reads the aux in the dgrad layout: Q is the kernel (N, K)
        outs = fp8_gemm.reference(p, q, *rest, problem="dgrad", **params)
    else:
        outs = fp8_gemm.reference(p, q.T, *rest, problem="forward", **params)
    assert [(o.shape, o.dtype) for o in outs] == [(r.shape, r.dtype) for r in results]
    return outs


@pytest.fixture
def reference_calls(monkeypatch, cuda_lowerings_on_cpu):
    """The CUDA lowerings on the CPU (``cuda_lowerings_on_cpu``), each custom call routed
    to its problem's reference math; returns the list of the problems called, in order."""
    seen: list = []
    monkeypatch.setattr(ffi, "call", functools.partial(_reference_call, seen))
    return seen
