"""benchmarks/fp8.py on a CPU: every contender of a block runs and computes the block."""

import jax
import numpy as np
import pytest

pytest.importorskip("flax")

from benchmarks import fp8 as bench


def test_every_contender_computes_the_same_block():
    contenders, calls_fp8 = bench.block_contenders(32, (24, 40, 16), ("gelu", None), backward=False)
    assert set(contenders) == {
        "xla bf16", "ours fp8 delayed", "ours fp8 current", "flax fp8 qdq (xla)", "flax fp8 direct (xla)",
    }  # fmt: skip
    assert set(calls_fp8) == {"flax fp8 qdq (xla)", "flax fp8 direct (xla)"}
    outputs = {}
    for name, (f, args) in contenders.items():
        y = f(*args)
        outputs[name] = np.asarray(y[0] if isinstance(y, tuple) else y, np.float32)
    want = outputs["xla bf16"]
    for name, y in outputs.items():  # FP8's error: within 15 % of the block's largest value
        assert y.shape == want.shape and np.abs(y - want).max() <= 0.15 * np.abs(want).max(), name


def test_the_backward_rows_return_every_gradient():
    contenders, _ = bench.block_contenders(32, (24, 40, 16), ("gelu", None), backward=True)
    f, args = contenders["ours fp8 current"]
    dx, (layers, states) = f(*args)
    assert dx.shape == (32, 24) and len(layers) == 2 and len(states) == 2
    assert all(np.isfinite(np.asarray(leaf, np.float32)).all() for leaf in jax.tree.leaves((dx, layers)))
