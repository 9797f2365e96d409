"""benchmarks/fp8.py on a CPU: every contender of a block runs and computes the block."""

import jax
import numpy as np
import pytest

pytest.importorskip("flax")

from benchmarks import fp8 as bench


def test_every_contender_computes_the_same_block():
    contenders, calls_fp8 = bench.block_contenders(32, (24, 40, 16), ("gelu", None), backward=False)
    assert set(contenders) == {
        "xla bf16", "ours fp8 delayed", "ours fp8 current", "fp8 gemms only", "flax fp8 qdq (xla)",
        "flax fp8 direct (xla)",
    }  # fmt: skip
    assert set(calls_fp8) == {"flax fp8 qdq (xla)", "flax fp8 direct (xla)"}
    f, args = contenders.pop("fp8 gemms only")  # the block's GEMMs alone: one per layer forward
    assert [y.shape for y in f(*args)] == [(32, 40), (32, 16)]
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
    f, args = contenders["fp8 gemms only"]  # forward, input and kernel gradient per layer
    assert [y.shape for y in f(*args)] == [(32, 40), (32, 24), (24, 40), (32, 16), (32, 40), (40, 16)]
    assert all(np.isfinite(np.asarray(leaf, np.float32)).all() for leaf in jax.tree.leaves((dx, layers)))


def test_rows_render_as_ratios_over_xla_and_plot(tmp_path):
    rows = [
        {"row": "forward 8x16->32 gelu", "us": {"xla bf16": 30.0, "ours fp8 delayed": 20.0},
         "flax_calls_fp8_gemm": {"flax fp8 qdq (xla)": True}},
        {"row": "gemm 8192^3", "us": {"ours fp8 gemm": 105.0, "nvmath fp8 autotuned": 100.0}},
    ]  # fmt: skip
    table = bench.render(rows)
    assert "| forward 8x16->32 gelu | ours fp8 delayed | 20.0 | 1.50× |" in table
    assert "| gemm 8192^3 | ours fp8 gemm | 105.0 | 0.95× |" in table
    assert "flax fp8 qdq (xla): yes" in table
    pytest.importorskip("matplotlib")
    assert (tmp_path / "fp8.png").samefile(bench.plot(rows, str(tmp_path / "fp8.png")))


def test_kernel_times_sum_the_gpu_streams_per_step():
    from benchmarks.kernel_times import kernel_times, render

    meta = lambda pid, tid, kind, name: {
        "ph": "M",
        "pid": pid,
        "tid": tid,
        "name": kind,
        "args": {"name": name},
    }
    run = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur}
    trace = {
        "traceEvents": [
            meta(1, 0, "process_name", "/device:GPU:0"), meta(2, 0, "process_name", "/host:CPU"),
            meta(1, 7, "thread_name", "Stream #14(Compute)"), meta(1, 8, "thread_name", "XLA Ops"),
            run(1, 7, "gemm", 300.0), run(1, 7, "gemm", 100.0), run(1, 7, "fusion", 50.0),
            run(1, 8, "gemm", 999.0), run(2, 0, "gemm", 999.0),  # (an op's span; the host)
        ]
    }  # fmt: skip
    times = kernel_times(trace, steps=2)._replace(wall_us=300.0)
    assert times.kernels == {"gemm": 200.0, "fusion": 25.0}
    assert times.launches == {"gemm": 1.0, "fusion": 0.5}
    assert times.host == {"gemm": 499.5}  # the host's span, and XLA's op-span row is neither
    assert render("row", times).splitlines()[:2] == [
        "row: 225 µs of kernels per step (2 launches), 300 µs wall per step (GPU idle 75 µs)",
        "      200.0 µs     1×  gemm",
    ]


def test_kernel_times_profiles_the_examples_train_step(tmp_path):
    from benchmarks import kernel_times

    found = kernel_times.main(
        ["train", "--size", "small", "--steps", "1", "--contenders", "dense", "--out", str(tmp_path)]
    )
    assert set(found) == {"dense"}  # (on a CPU no kernel runs on a GPU stream: an empty table)
    assert "dot" in (tmp_path / "dense" / "program.hlo.txt").read_text()
    if jax.default_backend() == "gpu":
        assert sum(found["dense"].kernels.values()) > 0
    assert found["dense"].wall_us > 0
