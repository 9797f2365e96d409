"""scripts/gpu_check.sh's benchmarks on a CPU: the forward benchmark's chains and "in 4"
programs, the training benchmark's rows, and (GPU only) the host-overhead probe."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ under plain `pytest` too

from benchmarks import common, forward, training
from benchmarks.timing import Settings, measure_interleaved


@pytest.fixture
def counted(monkeypatch):
    """Short timing settings; the list records how many contenders each measurement took."""
    monkeypatch.setattr(common, "SETTINGS", Settings(samples=2, min_calls=2, sample_s=0.0, warmup=1))
    timed = []
    monkeypatch.setattr(
        common,
        "measure_interleaved",
        lambda calls, s: timed.append(len(calls)) or measure_interleaved(calls, s),
    )
    return timed


def test_donated_chain_feeds_each_result_back(rng):
    x = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    ws, bs = (
        jnp.asarray(rng.standard_normal((2, 3, 3)), jnp.float32),
        jnp.asarray(rng.standard_normal((2, 3)), jnp.float32),
    )
    layer = lambda x, w, b: jnp.tanh(x @ w + b)
    plain = forward.chain(layer, depth=2)
    step = forward.feedback(forward.chain(layer, depth=2, donate=True), x, ws, bs)
    want = x
    for _ in range(3):
        want = plain(want, ws, bs)
        np.testing.assert_allclose(step(), want, rtol=1e-6, atol=1e-6)
    assert not x.is_deleted()  # the caller's array is copied before the first donation


def test_released_chain_deletes_each_result_before_the_next_call(rng):
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((4, 3), (3, 3)))
    step = forward.released(jax.jit(lambda x, w: x @ w), x, w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    first = step()
    assert_close(first, want, "float32", k=3)
    second = step()
    assert first.is_deleted() and not second.is_deleted() and not x.is_deleted()
    assert_close(second, want, "float32", k=3)


def test_in_four_runs_the_single_layer_four_times():
    x, w, b = forward.layer_operands(5, 3, 7, "float32", "float32")
    for name, layer in common.single_layers("gelu").items():
        program, xs = forward.in_four(layer, x)
        outs = program(xs, w, b)
        assert len(outs) == 4, name
        for i, y in enumerate(outs):
            np.testing.assert_allclose(y, layer(x * (1 + i / 8), w, b), rtol=1e-5, atol=1e-6, err_msg=name)


def test_chain_rows_time_every_calling_pattern(counted):
    rows = []
    forward.bench_chain(rows, depth=2, sizes=((5, 8),))
    assert counted == [6, 6]  # fused and XLA, three calling patterns each, in one measurement
    assert [(r["chain"], r["activation"]) for r in rows] == [("2x 5x8->8", "relu"), ("2x 5x8->8", "gelu")]
    for r in rows:
        assert all(r[f"{c}{v}_us"] > 0 for c in ("fused", "xla") for v in ("", "_released", "_donated"))
        assert (
            r["layer_runs"] > 0 and r["layer_runs"] % 2 == 0 and r["handler_calls"] == 0
        )  # no handler on a CPU


def test_grad_rows_time_both_backward_modes(counted):
    rows = []
    training.bench_grad(rows, shapes=[(24, 16, 40)])
    assert counted == [3] * 4  # fused, auto and XLA together, per activation and mode
    assert [(r["activation"], r["mode"]) for r in rows] == [
        ("relu", "fwd+bwd"), ("relu", "fwd+vjp"), ("gelu", "fwd+bwd"), ("gelu", "fwd+vjp"),
    ]  # fmt: skip
    assert all(r[f"{c}_us"] > 0 for r in rows for c in training.GRAD_CONTENDERS)
    table = training.render(rows)
    assert "| 24x16->40 | gelu | fwd+vjp |" in table and "| mode |" in table


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_fwd_vjp_steps_agree_with_xlas(activation):
    x, w, b = common.layer_inputs(24, 16, 40, np.random.default_rng(0), dtype=jnp.float32)
    dy = jnp.asarray(np.random.default_rng(1).standard_normal((24, 40)), jnp.float32)
    outs = {c: step(x, w, b, dy) for c, step in training.grad_steps(activation, "fwd+vjp").items()}
    assert [o.shape for o in outs["xla"]] == [(24, 40), (24, 16), (16, 40), (40,)]
    for c in ("fused", "auto"):
        for got, want in zip(outs[c], outs["xla"]):
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(want))))
    other = training.grad_steps(activation, "fwd+vjp")["fused"](x, w, b, 2 * dy)  # dy is an input
    np.testing.assert_allclose(other[2], 2 * outs["fused"][2], rtol=1e-4, atol=1e-5)


def test_mlp_rows_time_each_activation_and_compute_one_block(counted):
    rows = []
    training.bench_mlp(rows, ("gelu", "relu"), shapes=[(24, 8)])
    assert counted == [len(training.MLP_CONTENDERS)] * 2
    assert [(r["shape"], r["activation"]) for r in rows] == [("24x8->32->8", "gelu"), ("24x8->32->8", "relu")]
    assert "| 24x8->32->8 | relu |" in training.render(rows)
    args = training.mlp_inputs(24, 8)
    ref = training.mlp_block("xla", "relu")(*args).astype(np.float32)
    assert not np.allclose(ref, training.mlp_block("xla", "gelu")(*args).astype(np.float32), atol=1e-2)
    for contender in training.MLP_CONTENDERS[1:]:
        got = training.mlp_block(contender, "relu")(*args).astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2, err_msg=contender)


def test_example_rows_time_the_train_steps_interleaved(counted):
    pytest.importorskip("flax")
    rows = []
    options = (
        "--d-model",
        "16",
        "--blocks",
        "1",
        "--batch",
        "2",
        "--seq",
        "8",
        "--steps",
        "4",
        "--warmup",
        "1",
    )
    training.bench_example(rows, size="small", options=options)
    assert counted == [3]  # the three models' steps, in one interleaved measurement
    assert [r["layer"] for r in rows] == ["FusedMLP", "FusedDense", "nn.Dense"]
    assert all(r["interleaved_step_ms"] > 0 and r["step_ms"] > 0 for r in rows)
    assert (
        rows[0]["example"]
        == "train_transformer_mlp --size small " + " ".join(options) + " --implementation auto"
    )
    assert training.render(rows).count("| train_transformer_mlp") == 3


@pytest.mark.gpu
def test_host_overhead_probe_runs(capsys):
    from benchmarks import host_overhead

    host_overhead.main()
    out = capsys.readouterr().out
    assert "replayed" in out and "replay off" in out and out.count("handler") == 2
