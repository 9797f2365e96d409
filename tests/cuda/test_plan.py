"""``jax_epilog.cuda.plan`` (GPU only: nvmath-python and cupy): planning a problem, the plan
cache, the tuned choice shared by untuned plans, and a launch that allocates nothing."""

from __future__ import annotations

import functools

import jax
import pytest
from helpers import GPU_TOL, assert_scaled_close, layer_inputs, oracle

import jax_epilog
from jax_epilog import override_policy
from jax_epilog._epilogs import EpilogSpec
from jax_epilog.cuda import ffi

pytestmark = pytest.mark.gpu
fused_dense = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")


def test_nvmath_internals_are_where_the_fast_path_expects():
    from jax_epilog.cuda import plan

    spec = EpilogSpec(64, 40, 24, "RELU_AUX_BIAS", "COMPUTE_32F", "bfloat16", "bfloat16", "bfloat16")
    made = plan.Plan(spec, plan.current_device(), 256)  # raises if nvmath moved them
    assert all(hasattr(made._mm, name) for name in plan._MATMUL_INTERNALS)
    assert made.tuning is None and made.choice == 0 and made.problem == "forward"


def test_a_problem_cublaslt_plans_but_never_runs_is_refused_at_planning():
    """One row, half operands, float32 D (a float32 bias): planned by cuBLASLt 13.1, then
    every algorithm fails to launch (measured). The tuner's failures make it a PlanningError,
    so lowering falls back (the primitive also routes this case to XLA up front)."""
    from jax_epilog.cuda import plan

    spec = EpilogSpec(1, 11, 6, "GELU_AUX_BIAS", "COMPUTE_32F", "bfloat16", "float32", "float32")
    with pytest.raises(plan.PlanningError, match="refused to run each of its"):
        plan.Plan(spec, plan.current_device(), 256, autotune=True)


def test_a_plan_made_without_tuning_runs_the_tuned_choice(rng, monkeypatch):
    """The FFI handler plans (untuned) for the other GPUs of a multi-GPU program: each takes
    the choice tuned at lowering for the same problem, alignment and GPU model."""
    from jax_epilog.cuda import plan

    monkeypatch.setattr(plan, "_plans", {})
    monkeypatch.setattr(plan, "_tuned", {})
    monkeypatch.setattr(ffi._handler, "_plans", {})
    x, w, b = layer_inputs(rng, 776, 264, 392, "bfloat16")
    f = lambda x, w, b: fused_dense(x, w, b, activation="gelu")
    jax.jit(f).lower(x, w, b)  # lowering plans and tunes; nothing runs
    ((key, tuned),) = plan._plans.items()
    spec, device, alignment = key
    assert tuned.tuning is not None and len(tuned.tuning) > 1
    model_key = (spec, alignment, plan._model(device))
    assert plan._tuned == {model_key: tuned.choice}
    # As if another GPU of this model had tuned it and preferred the last candidate.
    last = len(tuned.tuning) - 1
    plan._plans.clear()
    plan._tuned[model_key] = last
    # The handler plans this device anew, untuned, when the program runs (with PjRt's
    # asynchronous dispatch, after the call returns).
    with override_policy(autotune=False):  # (should the jit lower again)
        y = jax.block_until_ready(jax.jit(lambda *a: f(*a))(x, w, b))
    plans = [p for k, p in plan._plans.items() if k[0] == spec and k[2] == alignment]
    assert plans and all(p.tuning is None and p.choice == last for p in plans)
    assert_scaled_close(y, oracle(x, w, b, "gelu")[0], GPU_TOL["bfloat16"])


def test_no_device_memory_leak_over_1000_jitted_calls(rng):
    import cupy as cp

    x, w, b = layer_inputs(rng, 512, 256, 384, "bfloat16")
    f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="relu", return_aux=True))
    jax.block_until_ready(f(x, w, b))
    device = jax.devices("gpu")[0]
    before_jax = device.memory_stats()["bytes_in_use"]
    before_free = cp.cuda.runtime.memGetInfo()[0]
    for _ in range(1000):
        out = f(x, w, b)
    jax.block_until_ready(out)
    del out
    after_jax = device.memory_stats()["bytes_in_use"]
    after_free = cp.cuda.runtime.memGetInfo()[0]
    assert after_jax <= before_jax
    assert before_free - after_free < 4 << 20  # no per-call allocations outside XLA either


def test_every_plan_made_is_listed(rng):
    from jax_epilog.cuda import plan

    x, w, b = layer_inputs(rng, 72, 40, 56, "float16")
    jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="relu")).lower(x, w, b)
    listed = [
        p
        for p in plan.plans()
        if (p.spec.m, p.spec.n, p.spec.k, getattr(p.spec, "ab_dtype", None)) == (72, 56, 40, "float16")
    ]
    assert listed and all(p.spec.epilog == "RELU_BIAS" for p in listed)  # (no gradient: no aux)
