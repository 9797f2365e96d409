"""``jax_epilog.cuda.tuning`` (GPU only): plans made at lowering time cuBLASLt's candidates
and keep the fastest, as many as ``Policy.tuning_candidates``; ``Policy.autotune`` off
keeps cuBLASLt's first choice."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from helpers import GPU_TOL, assert_scaled_close, layer_inputs, oracle

import jax_epilog
from jax_epilog import override_policy

pytestmark = pytest.mark.gpu
fused_dense = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")


def _plans_of(m, n, k):
    from jax_epilog.cuda import plan

    return [p for p in plan.plans() if (p.spec.m, p.spec.n, p.spec.k) == (m, n, k)]


def test_plans_made_at_lowering_are_autotuned(rng):
    x, w, b = layer_inputs(rng, 520, 264, 392, "bfloat16")
    y = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu"))(x, w, b)
    tuned = _plans_of(520, 392, 264)
    assert tuned and all(p.tuning for p in tuned)
    assert all(np.isfinite(min(p.tuning)) and p.choice == int(np.argmin(p.tuning)) for p in tuned)
    assert_scaled_close(y, oracle(x, w, b, "gelu")[0], GPU_TOL["bfloat16"])


def test_the_policy_bounds_the_candidates_timed_and_turns_tuning_off(rng):
    x, w, b = layer_inputs(rng, 392, 200, 136, "bfloat16")
    with override_policy(tuning_candidates=2):
        jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="relu")).lower(x, w, b)
    (few,) = _plans_of(392, 136, 200)
    assert 1 <= len(few.tuning) <= 2
    x, w, b = layer_inputs(rng, 392, 200, 144, "bfloat16")
    with override_policy(autotune=False):
        y = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="relu"))(x, w, b)
    untuned = _plans_of(392, 144, 200)
    assert untuned and all(p.tuning is None and p.choice == 0 for p in untuned)
    assert_scaled_close(y, oracle(x, w, b, "relu")[0], GPU_TOL["bfloat16"])
