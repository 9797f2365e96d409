"""``jax_epilog.cuda.replay`` (GPU only): calls that repeat their stream and pointers
replay a captured graph of their GEMM, which still reads each call's inputs and writes its
outputs; ``Policy.replay`` off never captures one."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import GPU_TOL, assert_scaled_close, layer_inputs, oracle

import jax_epilog
from jax_epilog import override_policy

pytestmark = pytest.mark.gpu
fused_dense = functools.partial(jax_epilog.fused_dense, implementation="cublaslt")


def _graphs(shape=None):
    from jax_epilog.cuda import plan

    plans = [p for p in plan.plans() if shape is None or (p.spec.m, p.spec.n, p.spec.k) == shape]
    return sum(p.replay_stats[0] for p in plans), plans


def test_replayed_calls_read_their_inputs_and_write_their_outputs(rng):
    """Calls on buffers seen before launch a captured graph: it must still read this call's
    contents (x changes every step, at recurring addresses) and write this call's output."""
    x, w, b = layer_inputs(rng, 96, 200, 200, "bfloat16")
    step = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu"), donate_argnums=0)
    before = _graphs()[0]
    y = jnp.array(x, copy=True)
    for _ in range(10):
        previous = np.asarray(y)  # y's buffer is donated to the next call
        y = step(y, w, b)
        assert_scaled_close(y, oracle(previous, w, b, "gelu")[0], GPU_TOL["bfloat16"])
    assert _graphs()[0] > before  # the steps above did replay


def test_replay_off_captures_no_graph(rng):
    x, w, b = layer_inputs(rng, 104, 200, 200, "bfloat16")  # (y feeds the next step: K = N)
    with override_policy(replay=False):  # (read when the plan is made, at lowering)
        step = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu"), donate_argnums=0)
        y = jnp.array(x, copy=True)
        for _ in range(5):
            y = step(y, w, b)
        jax.block_until_ready(y)  # (the handler may make a plan as the program runs)
    graphs, plans = _graphs((104, 200, 200))
    assert plans and graphs == 0 and not any(p.replay_stats[2] for p in plans)
