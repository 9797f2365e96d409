"""The benchmark suite's CPU-testable parts: plan, arithmetic, skips, merging, rendering."""

import contextlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ under plain `pytest` too
from helpers import dot_shapes
from tolerances import assert_close

from benchmarks import run
from benchmarks.run import Case


def _shapes(cases):
    return {(c.m, c.k, c.n) for c in cases}


def test_quick_plan():
    cases = run.plan(full=False)
    assert _shapes(cases) == {
        (256, 784, 100), (8192, 1024, 4096), (8192, 4096, 16384), (8192, 4096, 1024),
        (64, 4096, 16384), (1000, 1000, 1003), (8192, 1024, 4097),
    }  # fmt: skip
    seed = [c for c in cases if c.m == 256]
    assert {(c.dtype, c.bias_dtype) for c in seed} == {("float16", "float32")}
    assert {c.dtype for c in cases if c.m != 256} == {"bfloat16"}
    assert {(c.m, c.k, c.n) for c in cases if c.activation == "none"} == {(256, 784, 100), (8192, 1024, 4096)}
    assert {c.m for c in cases if c.mode != "fwd"} == {8192}
    backward = {mode: {(c.m, c.k, c.n, c.activation) for c in cases if c.mode == mode} for mode in run.MODES[1:]}
    assert backward["fwd+bwd"] == backward["fwd+vjp"] and len(backward["fwd+vjp"]) == 7
    assert len(cases) == len(set(cases))
    assert all(c.compute_type is None for c in cases)


def test_full_plan():
    cases = run.plan(full=True)
    assert {(8192, 16384, 4096), (16, 4096, 16384), (128, 4096, 16384)} <= _shapes(cases)
    assert {c.dtype for c in cases if c.m == 8192 and c.dtype != "float32"} == {"bfloat16", "float16"}
    f32 = [c for c in cases if c.dtype == "float32"]
    assert _shapes(f32) == {(8192, 1024, 4096)}
    assert {c.compute_type for c in f32} == {None, run.TF32}
    assert {c.activation for c in cases} == {"relu", "gelu", "none"}
    assert set(run.plan(full=False)) < set(cases)


def test_contenders_and_jobs():
    assert run.contenders("fwd", with_auto=False) == [
        "jax_epilog", "xla", "xla_cublaslt", "torch_matmul_add", "torch_linear", "torch_addmm_act", "nvmath",
    ]  # fmt: skip
    assert run.contenders("fwd+bwd", with_auto=True) == [
        "jax_epilog",
        "jax_epilog_auto",
        "xla",
        "xla_cublaslt",
    ]
    case = Case(8, 8, 8, "bfloat16", "bfloat16", "relu", "fwd+bwd")
    assert run.jobs([case], with_auto=False) == [(case, n) for n in ("jax_epilog", "xla", "xla_cublaslt")]


def test_flops_and_tflops():
    fwd = Case(2, 3, 5, "bfloat16", "bfloat16", "relu", "fwd")
    assert run.flops(fwd) == 60
    assert run.flops(fwd._replace(mode="fwd+bwd")) == run.flops(fwd._replace(mode="fwd+vjp")) == 180
    big = Case(8192, 4096, 16384, "bfloat16", "bfloat16", "gelu", "fwd")
    assert run.tflops(big, 1000.0) == pytest.approx(2 * 8192 * 4096 * 16384 / 1e-3 / 1e12)
    assert big.shape == "8192x4096->16384"


def test_shrink_and_input_copies():
    big = Case(8192, 4096, 16384, "bfloat16", "bfloat16", "relu", "fwd")
    assert run.input_copies(big) == 2  # operands and output are far beyond L2 already
    assert run.input_copies(big._replace(k=1024, n=4096)) == 3
    assert run.shrink(big, 64)[:3] == (128, 64, 256)
    assert run.shrink(Case(16, 4096, 16384, "bfloat16", "bfloat16", "relu", "fwd"), 64).m == 1


class _FakeClock:
    """Each call "takes" 1 ms; records batch sizes."""

    def __init__(self):
        self.batches = []

    def start(self):
        self.calls = 0

    def stop(self, out):
        self.batches.append(self.calls)
        return self.calls * 1e-3


def test_measure_adapts_batch_length():
    clock = _FakeClock()

    def call(i):
        clock.calls += 1
        return i

    settings = run.Settings(samples=3, min_calls=5, sample_s=0.02, warmup=2)
    t = run.measure(call, clock, settings)
    assert clock.batches[:2] == [2, 5]  # warm-up, then the calibrating batch
    assert t.iters >= 20 and clock.batches[2:] == [t.iters] * 3
    assert t.us == pytest.approx(1000.0) and t.samples == 3 and t.calls == sum(clock.batches)


def test_interleaved_samples_take_turns():
    order = []

    class Clock(_FakeClock):
        def __init__(self, name, ms):
            super().__init__()
            self.name, self.ms = name, ms

        def stop(self, out):
            order.append(self.name)
            return self.calls * self.ms * 1e-3

    def counting(clock):
        def call(i):
            clock.calls += 1

        return call

    a, b = Clock("a", 1.0), Clock("b", 3.0)
    settings = run.Settings(samples=3, min_calls=5, sample_s=0.02, warmup=2)
    ta, tb = run.measure_interleaved([(counting(a), a), (counting(b), b)], settings)
    # warm-up + calibration each, then in turn, each round starting with the next contender
    assert order == ["a", "a", "b", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert ta.us == pytest.approx(1000.0) and tb.us == pytest.approx(3000.0)
    assert ta.iters >= 20 and 5 <= tb.iters < ta.iters and tb.samples == 3


def test_round_orders():
    from benchmarks import timing

    rounds = {name: [f(s, 3) for s in range(4)] for name, f in timing.ROUND_ORDERS.items()}
    assert rounds["rotate"] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert rounds["serpentine"] == [[0, 1, 2], [0, 2, 1], [2, 0, 1], [2, 1, 0]]  # odd rounds backwards
    assert all(sorted(r) == [0, 1, 2] for r in rounds["shuffle"])
    assert rounds["shuffle"] == [timing.ROUND_ORDERS["shuffle"](s, 3) for s in range(4)]  # seeded

    order = []

    def contender(name):
        clock = SimpleNamespace(start=lambda: None, stop=lambda out: order.append(name) or 0.05)
        return (lambda i: None), clock

    settings = run.Settings(samples=2, min_calls=1, sample_s=0.0, warmup=0, order="serpentine")
    run.measure_interleaved([contender("a"), contender("b"), contender("c")], settings)
    assert order[6:] == ["a", "b", "c", "a", "c", "b"]  # after a warm-up and a calibration batch each


def test_auto_vs_xla_reads_noise_from_identical_programs():
    def row(contender, us, act="relu", runs=None):
        r = {"shape": "8x8->8", "m": 8, "k": 8, "n": 8, "dtype": "bfloat16", "bias_dtype": "bfloat16",
             "activation": act, "mode": "fwd", "compute_type": None, "contender": contender,
             "us": us}  # fmt: skip
        return r | ({"handler_runs": runs} if runs is not None else {})

    rows = [
        row("xla", 100.0), row("jax_epilog_auto", 102.0, runs=0),  # XLA's program twice
        row("xla", 150.0, "gelu"), row("jax_epilog_auto", 120.0, "gelu", runs=40),  # fused
        row("xla", 10.0, "none"), row("jax_epilog_auto", None, "none", runs=0),  # not measured
    ]
    s = run.auto_vs_xla(rows)
    assert s["cases"] == 2 and s["same_program_cases"] == 1
    assert s["worst_ratio"] == pytest.approx(100 / 102) and "relu" in s["worst_case"]
    assert s["noise_max"] == pytest.approx(2 / 102)
    assert s["fused_pair_cases"] == 0
    assert run.auto_vs_xla([row("xla", 1.0)]) is None

    # Where "auto" fused the forward, it and jax_epilog ran one program: another noise reading.
    rows += [row("jax_epilog", 125.0, "gelu", runs=40), row("jax_epilog", 99.0, runs=40)]
    s = run.auto_vs_xla(rows)
    assert s["fused_pair_cases"] == 1 and s["fused_pair_first_faster"] == 0
    assert s["fused_pair_median"] == pytest.approx(5 / 125)
    assert s["fused_pair_max"] == (pytest.approx(120 / 125), "8x8->8 bfloat16 gelu fwd")
    text = "\n".join(run._auto_lines(s))
    assert "In 1 forward cases" in text and "4.0% (median)" in text and "auto / jax_epilog µs 0.960" in text


def _tiny(mode="fwd", activation="relu"):
    return Case(4, 8, 16, "float32", "float32", activation, mode)


@pytest.mark.parametrize("contender", [*run.TORCH, "nvmath"])
def test_library_contenders_skip_when_absent(monkeypatch, contender):
    for name in ("torch", "cupy", "nvmath"):
        monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError
    case = _tiny()
    row = run.run_one(case, contender, run.Inputs(case), run.SMOKE)
    assert row["skipped"] and "not importable" in row["skipped"]
    assert row["us"] is None and row["tflops"] is None and row["contender"] == contender


def test_a_failing_contender_becomes_a_row(monkeypatch):
    def broken(*args):
        raise ValueError("boom\nsecond line")

    monkeypatch.setitem(run.BENCH, "nvmath", broken)
    row = run.run_one(_tiny(), "nvmath", None, run.SMOKE)
    assert row["skipped"] == "ValueError: boom"


@pytest.mark.parametrize("mode", run.MODES)
@pytest.mark.parametrize("contender", ["jax_epilog", "xla", "xla_cublaslt"])
def test_jax_contenders_run_on_cpu(contender, mode):
    case = _tiny(mode, "gelu")
    row = run.run_one(case, contender, run.Inputs(case), run.SMOKE)
    assert row["skipped"] is None, row["skipped"]
    assert (
        row["us"] > 0 and row["samples"] == 2 and row["tflops"] == pytest.approx(run.tflops(case, row["us"]))
    )


@pytest.mark.parametrize("contender", ["jax_epilog", "jax_epilog_auto", "xla"])
def test_fwd_vjp_mode_returns_the_output_and_its_vjp_of_the_given_cotangent(contender):
    case = Case(24, 40, 56, "float32", "float32", "gelu", "fwd+vjp")
    inputs = run.Inputs(case)
    (x, w, b), (dy, dy_copy, *_) = inputs.jax()[0], inputs.jax_cotangents()
    assert dy.shape == (24, 56) and dy.dtype == jnp.float32 and float(jnp.std(dy)) > 0.5
    assert bool(jnp.all(dy == dy_copy)) and dy is not dy_copy  # one value, one copy per input set
    y, dx, dw, db = jax.jit(run.jax_program(case, contender))(x, w, b, dy)

    def layer(x, w, b):
        return jax.nn.gelu(jnp.matmul(x, w, precision="highest") + b, approximate=True)

    want_y, pullback = jax.vjp(layer, x, w, b)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    for got, want in zip((dx, dw, db), pullback(dy)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want))))


class _FakeCupy:
    """Just enough of CuPy for Inputs.cupy_transposed: "device" memory is a host buffer."""

    uint8 = np.uint8

    class _Pointer:
        def __init__(self, buffer):
            self.buffer = buffer

        def copy_from_device(self, src, size):
            self.buffer[:size] = src.buffer[:size]

    class ndarray:  # CuPy's name
        def __init__(self, shape, dtype, memptr, strides):
            self.shape, self.dtype, self.data, self.strides = shape, np.dtype(dtype), memptr, strides
            self.nbytes = int(np.prod(shape)) * self.dtype.itemsize

        def get(self):
            return np.ndarray(self.shape, self.dtype, buffer=self.data.buffer, strides=self.strides)

    @classmethod
    def asarray(cls, host):
        return SimpleNamespace(data=cls._Pointer(host.copy()))

    @classmethod
    def empty(cls, size, dtype):
        return SimpleNamespace(data=cls._Pointer(np.empty(size, dtype)))


def test_cupy_operands_are_column_major_views():
    """nvmath gets kernelᵀ (N, K) and xᵀ (K, M), column-major, so its yᵀ = kernelᵀ·xᵀ is our y."""
    case = Case(3, 5, 7, "bfloat16", "float32", "relu", "fwd")
    inputs = run.Inputs(case)
    x, w, b = inputs.host
    sets = inputs.cupy_transposed(_FakeCupy)
    assert len(sets) == run.input_copies(case) == 3
    assert len({id(s[0].data.buffer) for s in sets}) == 3  # distinct buffers
    for w_t, x_t, bias in sets:
        assert w_t.get().flags.f_contiguous and x_t.get().flags.f_contiguous
        np.testing.assert_array_equal(w_t.get(), w.T.astype(ml_dtypes.bfloat16))
        np.testing.assert_array_equal(x_t.get(), x.T.astype(ml_dtypes.bfloat16))
        np.testing.assert_array_equal(bias.get(), b)
        assert bias.dtype == np.float32 and w_t.dtype == ml_dtypes.bfloat16


def test_guarded_section_failure_is_recorded(capsys):
    def bench_broken():
        raise RuntimeError("no GPU memory")

    assert run.guarded(bench_broken) == {"skipped": "RuntimeError: no GPU memory"}
    assert "bench_broken failed" in capsys.readouterr().out
    md = run.render_markdown(_results() | {"ceiling": {"skipped": "RuntimeError: x"}})
    assert "Not measured: RuntimeError: x" in md


def _row(case, contender, us, skipped=None):
    return run.make_row(case, contender, run.Timing(us, 5, 20, 112) if us else None, skipped=skipped)


def test_xla_cublaslt_is_xlas_program_compiled_with_the_option_in_this_process(monkeypatch):
    case = _tiny("fwd", "relu")
    inputs = run.Inputs(case)
    (xla, _), (cublaslt, _) = run._jax_timed(case, ["xla", "xla_cublaslt"], inputs)
    np.testing.assert_array_equal(np.asarray(xla(0)), np.asarray(cublaslt(0)))  # on a CPU the flag changes nothing
    monkeypatch.setattr(run, "CUBLASLT_OPTIONS", {"xla_gpu_no_such_option": True})
    run._jax_timed(case, ["xla"], inputs)  # the options are for xla_cublaslt alone
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        run._jax_timed(case, ["xla_cublaslt"], inputs)


def _results():
    a, b = _tiny(), Case(4, 8, 16, "float32", "float32", "relu", "fwd+bwd", run.TF32)
    rows = [
        _row(a, "jax_epilog", 10.0) | {"note": "fell back"},
        _row(a, "xla", 25.0),
        _row(a, "xla_cublaslt", None, "flag refused"),
        _row(a, "torch_linear", None, "torch is not importable"),
        _row(b, "jax_epilog", 40.0),
        _row(b, "xla", 30.0),
    ]
    single = {
        "what": "python loop of jitted calls",
        "contender": "jax_epilog",
        "us_per_call": 30.0,
        "calls": 100,
        "handler_runs": 100,
        "handler_host_us": 12.5,
    }
    chain = {
        "layers": 16,
        "shape": "256x1024->1024",
        "activation": "relu",
        "jax_epilog_us": 100.0,
        "xla_us": 120.0,
        "handler_runs": 3,
        "layer_runs": 1600,
        "handler_host_us": 20.0,
        "command_buffers": run.command_buffer_verdict(3, 1600, True),
    }
    matmul = {"shape": "8192x8192x8192", "dtype": "bfloat16", "us": 1900.0, "tflops": 578.7}
    copy = {"what": "jit(v + 1), float32", "bytes": 1 << 30, "us": 500.0, "gbps": 4294.97}
    return {
        "date": "2026-01-02",
        "versions": {"gpu": "NVIDIA H200", "jax": "0.11.2", "XLA_FLAGS": ""},
        "command": ["python", "-m", "benchmarks.run", "--quick"],
        "settings": {"samples": 5, "min_calls": 20, "sample_s": 0.02},
        "rows": rows,
        "ceiling": {"matmul": matmul, "copy": copy},
        "host": {"single": [single], "chain": [chain]},
    }


def test_markdown_rendering():
    md = run.render_markdown(_results())
    assert "# jax_epilog benchmark suite: NVIDIA H200, 2026-01-02" in md
    assert "`python -m benchmarks.run --quick`" in md
    assert "## float32 (float32 bias), fwd\n" in md
    assert f"## float32 (float32 bias, {run.TF32}), fwd+bwd" in md
    assert "| 4x8->16 | relu | 10.0 (0.00) | 25.0 (0.00) | — | — | 2.50× |" in md
    assert "| 4x8->16 | relu | 40.0 (0.00) | 30.0 (0.00) | 0.75× |" in md
    assert "xla_cublaslt: flag refused" in md and "torch_linear: torch is not importable" in md
    assert "578.7 TF/s" in md and "4295 GB/s" in md
    assert "| 3 / 1600 |" in md and "captured" in md
    assert "| 16× 256x1024->1024 | relu | stacked | 100.0 | 120.0 | 1.20× |" in md  # results without "weights"
    assert "Notes: jax_epilog 4x8->16 relu: fell back" in md


def test_command_buffer_verdict():
    assert run.command_buffer_verdict(46, 3392, True).startswith("captured")
    assert run.command_buffer_verdict(3392, 3392, True).startswith("not captured")
    assert run.command_buffer_verdict(1000, 3392, True) == "partly captured"
    assert run.command_buffer_verdict(0, 3392, True).startswith("handler never ran")
    assert run.command_buffer_verdict(0, 3392, False).startswith("n/a")


def test_host_section_times_each_chain_variant_on_cpu():
    settings = run.Settings(samples=1, min_calls=2, sample_s=0.0, warmup=1)
    progress = run.Progress(run.N_HOST)
    host = run.bench_host(settings, scale=16, progress=progress, on_gpu=False)
    assert progress.done == run.N_HOST  # the progress counter's total is right
    variants = [(c["activation"], c["weights"]) for c in host["chain"]]
    assert variants == [
        (act, weights)
        for act in run.RELU_GELU
        for weights in ("stacked", "per-layer", "stacked, result released", "stacked, x donated")
    ]
    for c in host["chain"]:
        assert c["jax_epilog_us"] > 0 and c["xla_us"] > 0 and c["layer_runs"] > 0
    md = "\n".join(run._host_lines(host))
    assert "| 16× 16x64->64 | gelu | stacked, x donated |" in md


def test_write_results_names(tmp_path):
    import datetime

    stem = run.results_stem(str(tmp_path), "NVIDIA H200", datetime.date(2026, 1, 2))
    assert stem.endswith("2026-01-02-nvidia-h200")
    json_path, md_path = run.write_results(_results(), stem)
    assert json.loads(Path(json_path).read_text())["rows"][0]["contender"] == "jax_epilog"
    assert Path(md_path).read_text().startswith("# jax_epilog benchmark suite")
    assert run.gpu_slug("NVIDIA GeForce RTX 4090 (x/y)") == "nvidia-geforce-rtx-4090-x-y"


def test_dry_run_lists_the_plan(capsys):
    run.main(["--quick", "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    total = len(run.jobs(run.plan(full=False)))
    assert lines[0].startswith(f"[1/{total}] 256x784->100 float16/float32 bias relu fwd jax_epilog")
    assert "estimated H200 wall time" in lines[-1]


def test_dtype_splits_the_full_plan_into_parts(capsys):
    """--full in parts (one per device session): the parts' cases are the whole plan's."""

    def listed(*argv):  # the dry run's measurements, without their index and estimate
        run.main(["--full", *argv, "--dry-run"])
        lines = capsys.readouterr().out.splitlines()[:-1]
        return [line.split("] ", 1)[1].rsplit(" (~", 1)[0] for line in lines]

    half, rest = listed("--dtype", "bfloat16"), listed("--dtype", "float16", "float32")
    assert half and all(" bfloat16/" in line for line in half)
    assert rest and not any(" bfloat16/" in line for line in rest)
    assert sorted(half + rest) == sorted(listed())
    with pytest.raises(SystemExit):
        run.main(["--full", "--dtype", "float64", "--dry-run"])
    assert "invalid choice: 'float64'" in capsys.readouterr().err


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot

    path = tmp_path / "2026-01-02-nvidia-h200.json"
    path.write_text(json.dumps(_results()))
    written = [Path(p) for p in plot.make_plots(str(path), str(tmp_path / "plots"))]
    stem = "2026-01-02-nvidia-h200"
    assert written == [tmp_path / "plots" / f"{stem}-tflops.png", tmp_path / "plots" / f"{stem}-speedup.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    labels, series = plot.speedup_series(_results()["rows"][:4])
    assert labels == ["4x8->16\nrelu"] and series == {"jax_epilog": [2.5]}


def test_run_jobs_times_a_cases_contenders_together(monkeypatch):
    groups, timed_together = [], []
    real_group, real_measure = run.run_group, run.measure_interleaved

    def group_spy(case, names, inputs, settings):
        groups.append(list(names))
        return real_group(case, names, inputs, settings)

    def measure_spy(contenders, settings):
        timed_together.append(len(contenders))
        return real_measure(contenders, settings)

    real_nvmath = run.BENCH["nvmath"]

    @contextlib.contextmanager
    def nvmath_without_cupy(*args):
        # nvmath cannot start (a row with the reason). CuPy is hidden from this contender's
        # imports only: on a GPU jax_epilog's own planning uses it meanwhile.
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, "cupy", None)
            with real_nvmath(*args) as timed:
                yield timed

    monkeypatch.setattr(run, "run_group", group_spy)
    monkeypatch.setattr(run, "measure_interleaved", measure_spy)
    monkeypatch.setitem(run.BENCH, "nvmath", nvmath_without_cupy)
    case = _tiny()
    todo = [(case, "jax_epilog"), (case, "jax_epilog_auto"), (case, "xla"), (case, "nvmath"),
            (case._replace(activation="gelu"), "xla")]  # fmt: skip
    rows = run.run_jobs(todo, run.SMOKE, run.Progress(len(todo)))
    assert [r["contender"] for r in rows] == [name for _, name in todo]
    assert groups == [["jax_epilog", "jax_epilog_auto", "xla", "nvmath"], ["xla"]]
    assert timed_together == [3, 1]
    assert all(r["us"] > 0 for r in rows if r["contender"] != "nvmath")
    assert "not importable" in rows[3]["skipped"]


def test_library_contenders_are_interleaved_with_jax(monkeypatch):
    """A non-JAX contender's samples alternate with the JAX contenders' (same power state)."""
    order = []

    @contextlib.contextmanager
    def fake(case, name, inputs):
        yield (lambda i: order.append(name)), run.WallClock()

    monkeypatch.setitem(run.BENCH, "nvmath", fake)
    real = run._jax_timed

    def jax_timed(case, names, inputs):
        return [(lambda i, c=call, n=name: (order.append(n), c(i))[1], clock)
                for name, (call, clock) in zip(names, real(case, names, inputs))]  # fmt: skip

    monkeypatch.setattr(run, "_jax_timed", jax_timed)
    case = _tiny()
    rows = run.run_group(case, ["xla", "nvmath"], run.Inputs(case), run.SMOKE)
    assert [r["skipped"] for r in rows] == [None, None]
    timed = order[order.index("nvmath") :]  # after warm-up and calibration of both
    runs = [name for j, name in enumerate(timed) if j == 0 or timed[j - 1] != name]
    # rounds (xla, nvmath), (nvmath, xla), (xla, nvmath), ...: one of each per round, so
    # more than the two runs that timing one contender after the other would give
    assert set(runs) == {"xla", "nvmath"} and len(runs) > 3


def test_chain_layout_counts_the_optimized_hlo():
    from benchmarks import chain_layout

    text = """HloModule m
%fused (p: bf16[4]) -> bf16[4] {
  %s = bf16[4]{0} slice(bf16[8]{0} %p), slice={[0:4]}
  ROOT %c = bf16[4]{0} custom-call(%s), custom_call_target="jax_epilog_fused_matmul"
}
ENTRY %main (w: bf16[8]) -> bf16[4] {
  %w = bf16[8]{0} parameter(0)
  %copy.1 = bf16[8]{0} copy(%w)
  %g = bf16[4]{0} custom-call(%copy.1), custom_call_target="__cublas$lt$matmul"
  ROOT %f = bf16[4]{0} fusion(%g), kind=kCustom, calls=%fused
}
"""
    counts = chain_layout.hlo_counts(text)
    assert counts == {"ours": 1, "xla_gemm": 1, "copies": 1, "slices": 1, "top_fusions": 1}


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_backward_variants_compute_the_same_gradients(rng, activation):
    """Each contender of benchmarks.backward_variants differentiates the same layer."""
    from benchmarks import backward_variants as bv

    x, w, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((37, 19), (19, 23), (23,)))
    for loss_name, loss in bv.LOSSES.items():
        with jax.default_matmul_precision("highest"):  # XLA's float32 dot on a GPU: not TF32
            grads = {
                name: jax.grad(lambda x, w, b, f=f, loss=loss: loss(f(x, w, b)), argnums=(0, 1, 2))(x, w, b)
                for name, f in bv.layers(activation).items()
            }
        for name, got in grads.items():
            for g, want in zip(got, grads["xla"]):
                np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-4, err_msg=f"{name}, {loss_name}")
    assert "bgrada" in bv.render([{"shape": "1x1->1", "part": "kernel gradient", "bgrada_us": 1.0,
                                   "xla_dot_sum_us": 1.0, "xla_dot_us": 1.0}]).lower()  # fmt: skip


def test_forward_reports_the_tuners_choices():
    from benchmarks import forward
    from jax_epilog._epilogs import EpilogSpec

    spec = EpilogSpec(256, 512, 1024, "RELU_BIAS", "COMPUTE_32F", "bfloat16", "bfloat16", "bfloat16")  # m, n, k
    plans = {
        (spec, 0, 256): SimpleNamespace(tuning=[4.3, 4.02, float("inf"), 4.19]),
        (spec, 0, 16): SimpleNamespace(tuning=None),  # planned inside the handler: not tuned
    }
    assert forward.tuning_choices(plans) == {
        "RELU_BIAS 256x1024->512 bfloat16 (align 256)": "candidate 1 of 4 at 4.02 µs; next best 4.19 µs"
    }


def test_kernel_profile_reads_gpu_streams_only(tmp_path):
    import gzip

    from benchmarks.probes import kernels

    trace = {"traceEvents": [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #7(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "X", "pid": 1, "tid": 1, "ts": 0, "dur": 500, "name": "host work"},
        {"ph": "X", "pid": 2, "tid": 8, "ts": 0, "dur": 500, "name": "fusion.3"},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 10, "dur": 30, "name": "void gemm<int, 3>(Params)",
         "args": {"hlo_op": "custom-call.12"}},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 50, "dur": 10, "name": "loop_fusion", "args": {}},
        {"ph": "X", "pid": 2, "tid": 7, "ts": 100, "dur": 30, "name": "void gemm<int, 3>(Params)",
         "args": {"hlo_op": "custom-call.12"}},
    ]}  # fmt: skip
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as fh:
        json.dump(trace, fh)
    summary = kernels.summarize(kernels.read_trace(str(path)), steps=2)
    assert summary["kernels_per_step"] == 1.5
    assert summary["busy_us_per_step"] == 35.0
    assert summary["span_us_per_step"] == 60.0
    assert summary["kernels"][0] == {"kernel": "gemm [custom-call]", "per_step": 1.0, "us_per_step": 30.0}
    assert "gemm [custom-call]" in kernels.render([{"case": "c"} | summary])


def test_chain_with_donated_input_feeds_each_result_back(rng, tmp_path):
    from benchmarks import forward, report

    x = jnp.asarray(rng.standard_normal((5, 3)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((2, 3, 3)), jnp.float32)
    bs = jnp.asarray(rng.standard_normal((2, 3)), jnp.float32)
    layer = lambda x, w, b: jnp.tanh(x @ w + b)
    plain = forward.chain(layer, depth=2)
    step = forward.feedback(forward.chain(layer, depth=2, donate=True), x, ws, bs)
    want = x
    for _ in range(3):
        want = plain(want, ws, bs)
        np.testing.assert_allclose(step(), want, rtol=1e-6, atol=1e-6)  # tanh: O(1) values, some near 0
    assert not x.is_deleted()  # the caller's array is copied before the first donation

    row = {"chain": "2x 5x3->3", "activation": "relu", "fused_us": 80.0, "xla_us": 100.0, "handler_calls": 4,
           "layer_runs": 400, "handler_host_us": 20.0, "fused_released_us": 75.0, "xla_released_us": 99.0,
           "fused_donated_us": 70.0, "xla_donated_us": 91.0}  # fmt: skip
    old = {k: v for k, v in row.items() if "donated" not in k and "released" not in k}  # files before the columns
    for rows, cells in (([row], ("75.0 / 99.0 | 1.32×", "70.0 / 91.0 | 1.30×")), ([old], ("— | — | — | —",))):
        path = tmp_path / "forward-x.json"
        versions = {"gpu": "H200", "jax": "0.11.2", "XLA_FLAGS": ""}
        path.write_text(json.dumps({"label": "x", "versions": versions, "rows": rows}))
        table = report.render([str(path)])
        assert all(cell in table for cell in cells), table


def test_released_chain_deletes_each_result_before_the_next_call(rng):
    from benchmarks import forward

    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 3)), jnp.float32)
    step = forward.released(jax.jit(lambda x, w: x @ w), x, w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)  # a bare rtol failed on an H100 (an entry near 0)
    first = step()
    assert_close(first, want, "float32", k=3)
    second = step()
    assert first.is_deleted() and not second.is_deleted() and not x.is_deleted()
    assert_close(second, want, "float32", k=3)


def test_write_results_writes_json_and_markdown(tmp_path):
    from benchmarks import forward

    forward.write_results(str(tmp_path / "new"), "x", [{"a": 1}], "| a |\n")
    data = json.loads((tmp_path / "new" / "x.json").read_text())
    assert data["rows"] == [{"a": 1}] and data["versions"]["jax"] == jax.__version__
    assert (tmp_path / "new" / "x.md").read_text() == "| a |\n"


def test_small_batch_probe_times_every_contender(tmp_path, monkeypatch):
    from benchmarks.probes import small_batch

    monkeypatch.setattr(small_batch, "ROWS", (3,))
    monkeypatch.setattr(small_batch, "WEIGHTS", ((5, 7),))
    monkeypatch.setattr(run, "QUICK", run.SMOKE)
    small_batch.main(["--out", str(tmp_path)])
    rows = json.loads((tmp_path / "small_batch.json").read_text())["rows"]
    assert [(r["shape"], r["activation"]) for r in rows] == [("3x5->7", "relu"), ("3x5->7", "gelu")]
    for r in rows:  # inputs rotate over enough copies to leave the L2 behind (capped at 32)
        assert r["copies"] == 32 and all(r[c] > 0 for c in small_batch.CONTENDERS)
    table = (tmp_path / "small_batch.md").read_text().splitlines()
    assert table[2].startswith("| 3x5->7 | relu | ") and table[2].count("×") == 2


def test_forward_in_four_runs_the_single_layer_four_times():
    """benchmarks.forward's "in 4" program (shared with probes.kernels) computes four
    independent layers, the i-th on x * (1 + i/8), with the same single-layer program."""
    from benchmarks import forward

    x, w, b = forward.layer_operands(5, 3, 7, "float32", "float32")
    for name, layer in forward.single_layers("gelu").items():
        program, xs = forward.in_four(layer, x)
        outs = program(xs, w, b)
        assert len(outs) == 4, name
        for i, y in enumerate(outs):
            np.testing.assert_allclose(y, layer(x * (1 + i / 8), w, b), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_dz_pallas_probe_kernel_matches_the_reference_on_partial_blocks(rng, activation):
    from benchmarks.probes import dz_pallas
    from jax_epilog._epilogs import Activation

    act = Activation(activation)
    m, n = 45, 150  # neither a multiple of the 32x128 block
    dy, aux = dz_pallas._operands(m, n, act, seed=int(rng.integers(1 << 30)))
    want_dz, want_db = jax.jit(dz_pallas._xla("xla_dz_sum", act))(dy, aux)
    dz, db = dz_pallas.dz_and_sum(dy, aux, act, 32, 128, interpret=True)
    assert dz.shape == (m, n) and db.shape == (n,)
    np.testing.assert_allclose(np.asarray(dz, np.float32), np.asarray(want_dz, np.float32), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(db, want_db, rtol=2e-2, atol=5e-2)
    _, db_only = dz_pallas.dz_and_sum(dy, aux, act, 32, 128, store_dz=False, interpret=True)
    # (without the dz store XLA may skip dz's rounding to bfloat16 before the sum)
    np.testing.assert_allclose(db_only, want_db, rtol=2e-2, atol=5e-2)


def test_kernel_profile_peer_case_runs_the_suites_call(monkeypatch):
    from benchmarks.probes import kernels

    monkeypatch.setattr(kernels, "PEER_SHAPE", (24, 40, 56))
    assert {f"peer-gelu-{c}" for c in ("jax_epilog", "xla", "nvmath", "torch_addmm_act")} <= set(kernels.cases())
    step, args = kernels._peer_case("relu", "jax_epilog")
    y = jax.block_until_ready(step(*args))
    assert y.shape == (24, 56) and float(jnp.min(y)) == 0.0 and float(jnp.max(y)) > 0.0


def test_kernel_profile_peer_shape_option_sets_the_peers_shape(tmp_path, monkeypatch):
    from benchmarks.probes import kernels

    monkeypatch.setattr(kernels, "PEER_SHAPE", kernels.PEER_SHAPE)  # restored after the test
    shapes = []

    def profile(name, kind, make, out):  # the case's own step, not a CUPTI trace
        step, args = make()
        shapes.append(jax.block_until_ready(step(*args)).shape)
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(kernels, "profile", profile)
    kernels.main([str(tmp_path), "--case", "peer-gelu-xla", "--peer-shape", "24", "40", "56"])
    assert shapes == [(24, 56)]
    assert "peer-gelu-xla | RuntimeError: no profiler here" in (tmp_path / "kernels.md").read_text()


def test_forward_chain_rows_time_every_calling_pattern(monkeypatch):
    from benchmarks import forward

    monkeypatch.setattr(forward, "SETTINGS", run.Settings(samples=1, min_calls=2, sample_s=0.0, warmup=1))
    rows = []
    forward.bench_chain(rows, depth=2, sizes=((5, 8),))
    assert [(r["chain"], r["activation"]) for r in rows] == [("2x 5x8->8", "relu"), ("2x 5x8->8", "gelu")]
    for r in rows:
        for variant in ("", "_released", "_donated"):
            assert r[f"fused{variant}_us"] > 0 and r[f"xla{variant}_us"] > 0
        assert r["layer_runs"] > 0


def test_chain_outputs_probe_times_every_pattern(monkeypatch, capsys):
    from benchmarks.probes import chain_outputs

    monkeypatch.setattr(chain_outputs, "M", 3)
    monkeypatch.setattr(chain_outputs, "K", 8)
    monkeypatch.setattr(chain_outputs, "DEPTH", 2)
    monkeypatch.setattr(chain_outputs, "time_jax_interleaved", lambda *cases: [float(len(cases))] * len(cases))
    rows = chain_outputs.main()
    patterns = {(r["program"], r["pattern"]) for r in rows}
    assert {("fused", p) for p in ("replace", "released", "keep 8", "donated")} <= patterns
    assert ("one XLA op", "released") in patterns and len(rows) == 2 * 12
    assert "relu released   XLA/fused 1.00x" in capsys.readouterr().out


def test_replay_states_name_each_plan_and_its_graphs():
    from collections import namedtuple

    from benchmarks import forward

    Spec = namedtuple("Spec", "epilog m k n ab_dtype")
    relu, gelu = Spec("RELU_BIAS", 256, 1024, 1024, "bfloat16"), Spec("GELU_BIAS", 8, 16, 24, "float16")
    plans = {
        (relu, 0, 256): SimpleNamespace(replay_stats=(108, 0, True)),
        (gelu, 0, 16): SimpleNamespace(replay_stats=(0, 64, False)),
    }
    assert forward.replay_states(plans) == {
        "RELU_BIAS 256x1024->1024 bfloat16 (align 256)": "108 graphs kept, 0 dropped, replaying",
        "GELU_BIAS 8x16->24 float16 (align 16)": "0 graphs kept, 64 dropped, replay off",
    }


def test_suite_records_each_plans_tuning_and_replay(monkeypatch):
    from collections import namedtuple

    import jax_epilog

    monkeypatch.delattr(jax_epilog, "_nvmath", raising=False)  # set where the GPU path was imported
    monkeypatch.setitem(sys.modules, "jax_epilog._nvmath", None)  # no nvmath-python: nothing to record
    assert run.plan_states() == {}
    Spec = namedtuple("Spec", "epilog m k n ab_dtype")
    spec = Spec("GELU_BIAS", 256, 1024, 1024, "bfloat16")
    plan = SimpleNamespace(tuning=[5.0, 4.5], replay_stats=(3, 0, True))
    monkeypatch.setitem(sys.modules, "jax_epilog._nvmath", SimpleNamespace(_plans={(spec, 0, 256): plan}))
    name = "GELU_BIAS 256x1024->1024 bfloat16 (align 256)"
    assert run.plan_states() == {
        "tuned": {name: "candidate 1 of 2 at 4.50 µs; next best 5.00 µs"},
        "replay": {name: "3 graphs kept, 0 dropped, replaying"},
    }


def _count_interleaved(monkeypatch) -> list[int]:
    """Short timing settings for benchmarks.forward; returns the list that records how many
    contenders each interleaved measurement took."""
    from benchmarks import forward

    monkeypatch.setattr(forward, "SETTINGS", run.Settings(samples=2, min_calls=2, sample_s=0.0, warmup=1))
    timed = []
    real = forward.measure_interleaved
    monkeypatch.setattr(forward, "measure_interleaved", lambda calls, s: timed.append(len(calls)) or real(calls, s))
    return timed


def test_grad_rows_time_both_backward_modes(monkeypatch):
    from benchmarks import training

    timed = _count_interleaved(monkeypatch)
    rows = []
    training.bench_grad(rows, shapes=[(24, 16, 40)])
    assert timed == [3] * 4  # fused, auto and XLA together, per activation and mode
    assert [(r["activation"], r["mode"]) for r in rows] == [
        ("relu", "fwd+bwd"), ("relu", "fwd+vjp"), ("gelu", "fwd+bwd"), ("gelu", "fwd+vjp"),
    ]  # fmt: skip
    assert all(r[f"{c}_us"] > 0 for r in rows for c in training.GRAD_CONTENDERS)
    table = training.render(rows)
    assert "| 24x16->40 | gelu | fwd+vjp |" in table and "| mode |" in table


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_fwd_vjp_grad_steps_agree_with_xlas(activation):
    from benchmarks import training

    x, w, b = training.layer_inputs(24, 16, 40, np.random.default_rng(0), dtype=jnp.float32)
    dy = jnp.asarray(np.random.default_rng(1).standard_normal((24, 40)), jnp.float32)
    outs = {c: step(x, w, b, dy) for c, step in training.grad_steps(activation, "fwd+vjp").items()}
    assert [o.shape for o in outs["xla"]] == [(24, 40), (24, 16), (16, 40), (40,)]
    for c in ("fused", "auto"):
        for got, want in zip(outs[c], outs["xla"]):
            np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * float(jnp.max(jnp.abs(want))))
    # the cotangent is an input: another dy gives other gradients
    other = training.grad_steps(activation, "fwd+vjp")["fused"](x, w, b, 2 * dy)
    np.testing.assert_allclose(other[2], 2 * outs["fused"][2], rtol=1e-4, atol=1e-5)


def test_example_rows_time_the_train_steps_interleaved(monkeypatch):
    from benchmarks import training

    timed = _count_interleaved(monkeypatch)
    rows = []
    options = ("--d-model", "16", "--blocks", "1", "--batch", "2", "--seq", "8", "--steps", "4", "--warmup", "1")
    training.bench_example(rows, size="small", options=options)
    assert timed == [3]  # the three models' steps, in one interleaved measurement
    assert [r["layer"] for r in rows] == ["FusedMLP", "FusedDense", "nn.Dense"]
    assert all(r["interleaved_step_ms"] > 0 and r["step_ms"] > 0 for r in rows)
    assert rows[0]["example"] == "train_transformer_mlp --size small " + " ".join(options) + " --implementation auto"
    table = training.render(rows)
    assert "| step ms, interleaved | nn.Dense / layer, interleaved |" in table
    assert table.count("| train_transformer_mlp") == 3 and "| 1.00× |" in table  # nn.Dense against itself


def test_round_order_probe_times_the_pair_both_ways_on_cpu(tmp_path, capsys):
    from benchmarks.probes import round_order

    round_order.main(["--out", str(tmp_path), "--reps", "1", "--cpu-smoke"])
    rows = json.loads((tmp_path / "round_order.json").read_text())["rows"]
    assert len(rows) == 3 * 2 * 2  # orders × pair placements × activations
    assert {r["first"] for r in rows} == {"cublaslt first", "auto first"}
    assert all(r["jax_epilog_us"] > 0 and r["jax_epilog_auto_us"] > 0 and r["xla_us"] > 0 for r in rows)
    table = capsys.readouterr().out
    assert table.count("| rotate |") == 4 and table.count("| shuffle |") == 4


def test_chain_candidates_probe_appends_a_reading_per_process_on_cpu(tmp_path, capsys):
    from benchmarks.probes import chain_candidates

    chain_candidates.main(["--out", str(tmp_path), "--cpu-smoke"])
    chain_candidates.main(["--out", str(tmp_path), "--cpu-smoke", "--activation", "gelu", "--candidate", "1"])
    rows = [json.loads(line) for line in (tmp_path / "chain_candidates.jsonl").read_text().splitlines()]
    assert [(r["activation"], r["forced"]) for r in rows] == [("relu", None), ("gelu", 1)]
    for r in rows:
        for pattern in chain_candidates.PATTERNS:
            assert r[pattern]["fused_us"] > 0 and r[pattern]["xla_us"] > 0
    capsys.readouterr()
    chain_candidates.main(["--summarize", str(tmp_path)])
    table = capsys.readouterr().out
    assert "| gelu | 1 |" in table and "| relu | tuner |" in table
    assert (tmp_path / "chain_candidates.md").read_text().strip() == table.strip()


def test_grad_floor_probe_times_the_gemms_a_layers_gradient_needs_on_cpu(rng, tmp_path, capsys):
    from benchmarks.probes import grad_floor

    m, k, n = (int(v) for v in rng.integers(17, 90, size=3))
    x, w, dz = (jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in ((m, k), (k, n), (m, n)))
    f32 = lambda a: np.asarray(a, np.float32)
    want = (f32(x) @ f32(w), f32(dz) @ f32(w).T, f32(x).T @ f32(dz))
    progs = grad_floor.programs("relu", x, w, jnp.zeros(n, jnp.bfloat16), dz)
    for name in ("gemms", "gemms_cublaslt", "gemms_pass"):
        f, args = progs[name]
        scale = 0.5 if name == "gemms_pass" else 1.0  # its dz is dy * 0.5
        for got, ref, s in zip(f(*args), want, (1.0, scale, scale)):
            assert got.shape == ref.shape
            np.testing.assert_allclose(f32(got), s * ref, rtol=2e-2, atol=0.1, err_msg=name)
    grad_floor.main(["--shape", "40", "24", "56", "--shape", "24", "1024", "8", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "grad_floor.json").read_text())["rows"]
    assert [(r["shape"], r["activation"]) for r in rows] == [
        ("40x24->56", "relu"), ("40x24->56", "gelu"), ("24x1024->8", "relu"), ("24x1024->8", "gelu")
    ]
    assert [r["bar"] for r in rows] == [None, None, 1.05, 1.15]
    assert all(r[f"{c}_us"] > 0 for r in rows for c in grad_floor.CONTENDERS)
    assert "XLA / GEMMs (most gain)" in capsys.readouterr().out


def test_epilog_rounding_probe_tells_once_from_twice_rounded(rng, tmp_path, capsys):
    """On the CPU the op's reference adds the bias before rounding (its ReLU bits are the
    float64 signs) and XLA's plain expression rounds x @ w first (a few bits flip, each
    within that rounding of the kink); the two models differ on most entries, so the probe
    can tell them apart. On a GPU only the bound is asserted: what cuBLASLt does is what
    the probe is for."""
    from benchmarks.probes import epilog_rounding

    m, k, n = (int(v) for v in rng.integers(17, 90, size=3))
    epilog_rounding.main(["--shape", str(m), str(k), str(n), "--shape", "96", "300", "40", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "epilog_rounding.json").read_text())["rows"]
    assert [r["program"] for r in rows] == [*epilog_rounding.programs()] * 2
    for r in rows:
        assert r["entries"] == (epilog_rounding.MEMBERS if "ensemble" in r["program"] else 1) * (
            m * n if r["shape"] == f"{m}x{k}->{n}" else 96 * 40
        )
        assert r["flipped_max_abs_z"] <= r["flipped_max_rounding"] + 1e-5, r  # flips only at the kink
        if jax.default_backend() == "cpu":
            expected, other = ("twice", "once") if r["program"] == "xla" else ("once", "twice")
            assert r[expected] > 0.999 and r[other] < 0.9, r
            assert r["program"] == "xla" or r["bits_flipped"] == 0, r
    assert "D = twice" in (tmp_path / "epilog_rounding.md").read_text() and "| xla |" in capsys.readouterr().out


def test_second_order_probe_times_one_gradient_of_a_penalty_three_ways_on_cpu(rng, tmp_path, capsys):
    from benchmarks.probes import second_order
    from benchmarks.training import layer_inputs

    m, k, n = (int(v) for v in rng.integers(17, 60, size=3))
    args = layer_inputs(m, k, n, rng)
    for activation in ("relu", "gelu"):
        grads = {c: f(*args) for c, f in second_order.programs(activation).items()}
        for c in ("auto", "cublaslt"):  # the same derivatives (bf16 arithmetic)
            for got, want in zip(grads[c], grads["xla"], strict=True):
                want = np.asarray(want, np.float32)
                scale = max(1.0, float(np.abs(want).max()))
                assert np.abs(np.asarray(got, np.float32) - want).max() <= 5e-2 * scale, (activation, c)
    second_order.main(["--shape", "40", "24", "56", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "second_order.json").read_text())["rows"]
    assert [(r["shape"], r["activation"]) for r in rows] == [("40x24->56", "relu"), ("40x24->56", "gelu")]
    assert all(r[f"{c}_us"] > 0 for r in rows for c in second_order.CONTENDERS)
    assert "XLA / cublaslt" in capsys.readouterr().out


def test_ensemble_probe_times_each_pass_three_ways_on_cpu(rng, tmp_path, capsys):
    from benchmarks.probes import ensemble

    e, m, k, n = 3, *(int(v) for v in rng.integers(17, 60, size=3))
    # The contenders compute the same thing: checked in float32 (in bfloat16 XLA rounds
    # z before the bias and the activation, so a few ReLU mask bits differ: up to 4% of a
    # small kernel gradient).
    args = ensemble.members_inputs(e, m, k, n, rng, jnp.float32)
    assert args[0].shape == (e, m, k) and args[1].shape == (e, k, n) and args[2].shape == (e, n)
    assert not np.allclose(args[1][0], args[1][1])
    for activation in ("relu", "gelu"):
        for pass_, progs in ensemble.programs(activation).items():
            # XLA's float32 dots as fused_dense's (on a GPU, DEFAULT is TF32)
            with jax.default_matmul_precision("highest"):
                outs = {c: jax.tree.leaves(f(*args)) for c, f in progs.items()}
            for c in ("auto", "cublaslt"):
                for got, want in zip(outs[c], outs["xla"], strict=True):
                    scale = max(1.0, float(np.abs(want).max()))
                    assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 1e-4 * scale, (activation, pass_, c)
    ensemble.main(["--shape", "40", "24", "56", "--members", "2", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "ensemble.json").read_text())["rows"]
    assert [(r["shape"], r["activation"], r["pass_"]) for r in rows] == [
        ("2x 40x24->56", a, p) for a in ("relu", "gelu") for p in ("forward", "gradient", "per-example gradient")
    ]
    assert all(r[f"{c}_us"] > 0 for r in rows for c in ensemble.CONTENDERS)
    assert "XLA / cublaslt" in capsys.readouterr().out


def test_mlp_rows_time_each_activation_interleaved(monkeypatch):
    from benchmarks import training

    timed = _count_interleaved(monkeypatch)
    rows = []
    training.bench_mlp(rows, ("gelu", "relu"), shapes=[(24, 8)])
    assert timed == [len(training.MLP_CONTENDERS)] * 2
    assert [(r["shape"], r["activation"]) for r in rows] == [("24x8->32->8", "gelu"), ("24x8->32->8", "relu")]
    table = training.render(rows)
    assert "| M×D→4D→D (bf16) | act |" in table and "| 24x8->32->8 | relu |" in table
    # The block each contender times computes the same thing, activation included.
    args = training.mlp_inputs(24, 8)
    ref = training.mlp_block("xla", "relu")(*args).astype(np.float32)
    assert not np.allclose(ref, training.mlp_block("xla", "gelu")(*args).astype(np.float32), atol=1e-2)
    for contender in training.MLP_CONTENDERS[1:]:
        got = training.mlp_block(contender, "relu")(*args).astype(np.float32)
        np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-2)


def test_mlp_layers_probe_times_each_layers_implementation_on_cpu(rng, tmp_path, capsys):
    from benchmarks import training
    from benchmarks.probes import mlp_layers

    m, d = (int(v) for v in rng.integers(9, 40, size=2))
    args = [jnp.asarray(a, jnp.float32) for a in training.mlp_inputs(m, d)]
    full = mlp_layers.Arithmetic.of("float32", False)  # on a GPU, XLA's DEFAULT would be TF32
    want = mlp_layers.grad_step("xla", "relu", full)(*args)
    for contender in mlp_layers.CONTENDERS[1:]:
        got = mlp_layers.grad_step(contender, "relu", full)(*args)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=contender)
    mlp_layers.main(["--shape", "24", "8", "--activation", "relu", "gelu", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "mlp_layers.json").read_text())["rows"]
    assert [(r["shape"], r["activation"]) for r in rows] == [("24x8->32->8", "relu"), ("24x8->32->8", "gelu")]
    assert all(r[f"{c}_us"] > 0 for r in rows for c in mlp_layers.CONTENDERS)
    ratios = "| XLA/auto | XLA/both | XLA/first | XLA/second | XLA/bgrada | XLA/fused_mlp | XLA/fused_mlp_cublaslt |"
    assert ratios in capsys.readouterr().out
    dtypes = ["--dtype", "bfloat16", "float16"]
    mlp_layers.main(["--shape", "24", "8", "--forward", *dtypes, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "mlp_layers.json").read_text())["rows"]
    assert [(r["mode"], r["dtype"]) for r in rows] == [("forward", "bfloat16"), ("forward", "float16")]
    out = capsys.readouterr().out
    assert "| 24x8->32->8 (forward) | bfloat16 | relu |" in out
    assert "| 24x8->32->8 (forward) | float16 | relu |" in out
    assert training.mlp_inputs(24, 8, jnp.float16)[3].dtype == jnp.float16
    mlp_layers.main(["--shape", "24", "8", "--dtype", "float32", "--tf32", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "mlp_layers.json").read_text())["rows"]
    assert [(r["dtype"], r["compute_type"]) for r in rows] == [("float32", "COMPUTE_32F_FAST_TF32")]
    assert "| 24x8->32->8 (fwd+bwd) | float32 (TF32) | relu |" in capsys.readouterr().out


def test_mlp_layers_probe_asks_xla_for_the_fused_arithmetic(rng):
    """Float32 blocks: XLA's dots at HIGHEST (full float32, fused_dense's default) or at
    DEFAULT with --tf32 (what "auto" runs then); half dtypes keep the expression as written."""
    from benchmarks import training
    from benchmarks.probes import mlp_layers

    m, d = (int(v) for v in rng.integers(9, 40, size=2))
    for dtype, tf32, highest in [("float32", False, True), ("float32", True, False), ("bfloat16", False, False)]:
        arithmetic = mlp_layers.Arithmetic.of(dtype, tf32)
        args = training.mlp_inputs(m, d, jnp.dtype(dtype))
        hlo = mlp_layers.forward_step("xla", "gelu", arithmetic).lower(*args).as_text()
        assert ("HIGHEST" in hlo) == highest, (dtype, tf32)
        assert arithmetic.compute_type.name == ("COMPUTE_32F_FAST_TF32" if tf32 else "COMPUTE_32F")


def test_per_program_probe_times_one_and_many_layers_per_call_on_cpu(rng, tmp_path, capsys):
    from benchmarks import run
    from benchmarks.probes import per_program

    m, k, n = (int(v) for v in rng.integers(9, 40, size=3))
    case = run.Case(m, k, n, "bfloat16", "bfloat16", "gelu", "fwd")
    sets = run.Inputs(case, copies=3).jax()
    assert len(sets) == 3 and len({s[0].unsafe_buffer_pointer() for s in sets}) == 3
    calls = per_program.jax_calls(case, sets)
    assert {name: c[2] for name, c in calls.items()} == {"fused": 1, "fused_in_L": 3, "xla": 1, "xla_in_L": 3}
    many = calls["fused_in_L"][0](0)
    for i, y in enumerate(many):  # each of the program's layers is the one-layer call's
        np.testing.assert_array_equal(np.asarray(y), np.asarray(calls["fused"][0](i)))
    layer = run.jax_program(case, "jax_epilog")
    jaxpr = str(jax.make_jaxpr(lambda sets: [layer(*s) for s in sets])(sets))
    assert jaxpr.count("jax_epilog_fused_matmul") == 3
    argv = ["--cpu-smoke", "--shape", "640", "256", "128", "--activation", "relu", "--layers", "2"]
    per_program.main([*argv, "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "per_program.json").read_text())["rows"]
    assert [(r["shape"], r["order"]) for r in rows] == [("10x4->2", "listed"), ("10x4->2", "reversed")]
    assert all(r[f"{c}_us"] > 0 for r in rows for c in ("fused", "fused_in_L", "xla", "xla_in_L"))
    assert "| nvmath/fused | nvmath/fused_in_L |" in capsys.readouterr().out


def test_mixed_block_probe_times_gelu_and_relu_layers_in_one_block_on_cpu(rng, tmp_path, capsys):
    from benchmarks.probes import mixed_block

    m, d = (int(v) for v in rng.integers(9, 40, size=2))
    args = [jnp.asarray(a, jnp.float32) for a in mixed_block.inputs(m, d)]
    assert [a.shape for a in args] == [(m, d), (d, 4 * d), (4 * d,), (4 * d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    with jax.default_matmul_precision("highest"):
        want = mixed_block.grad_step("xla")(*args)
    assert all(float(jnp.max(jnp.abs(w))) > 0 for w in want)
    for contender in mixed_block.CONTENDERS[1:]:
        with jax.default_matmul_precision("highest"):
            got = mixed_block.grad_step(contender)(*args)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=contender)
    mixed_block.main(["--shape", "24", "8", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "mixed_block.json").read_text())["rows"]
    assert [r["shape"] for r in rows] == ["24x8->32->32->8"]
    assert all(r[f"{c}_us"] > 0 for r in rows for c in mixed_block.CONTENDERS)
    assert "| XLA/fused_dense | XLA/fused_mlp | XLA/fused_mlp_cublaslt |" in capsys.readouterr().out


def _values(program, args) -> list[np.ndarray]:
    """The leaves of jitted ``program(*args)`` as float32 arrays."""
    return [np.asarray(a, np.float32) for a in jax.tree.leaves(jax.jit(program)(*args))]


def _assert_values(program, args, want, label):
    """``program``'s results on ``args`` are ``want``, to 3e-2 of each one's largest entry."""
    for got, w in zip(_values(program, args), want, strict=True):
        np.testing.assert_allclose(got, w, atol=3e-2 * float(np.max(np.abs(w))), err_msg=label)


@pytest.mark.parametrize("activation", ["gelu", "none"])
def test_row_padding_probe_contenders_agree_and_pad_on_cpu(rng, monkeypatch, tmp_path, capsys, activation):
    """Every contender of benchmarks.probes.row_padding computes the same forward and
    gradients (padding forced at any size), "xla_padded"'s GEMMs write rows whose widths are
    multiples of 8 (K and N are not: odd, 9-39), and the probe writes its table."""
    from benchmarks.probes import row_padding
    from jax_epilog import _primitive

    monkeypatch.setattr(_primitive, "_PAD_MIN_ROWS", 0)
    monkeypatch.setattr(_primitive, "_PAD_MIN_WORK", 0)
    m, k, n = (int(v) | 1 for v in rng.integers(9, 40, size=3))
    for mode in ("fwd", "fwd+bwd", "mlp"):
        case = Case(m, k, n, "bfloat16", "bfloat16", activation, mode)
        args = run.Inputs(case).jax()[0]
        want = _values(row_padding.program(case, "xla"), args)
        assert all(np.max(np.abs(w)) > 0 for w in want)
        for contender in row_padding.CONTENDERS:
            _assert_values(row_padding.program(case, contender), args, want, f"{mode} {contender}")
        widths = [shape[-1] for shape in dot_shapes(row_padding.program(case, "xla_padded"), *args)]
        assert widths and all(w % 8 == 0 for w in widths), (mode, widths)
    monkeypatch.undo()
    row_padding.main(["--case", "24", "9", "11", activation, "--modes", "fwd", "fwd+bwd", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "row_padding.json").read_text())["rows"]
    assert [(r["shape"], r["mode"]) for r in rows] == [("24x9->11", "fwd"), ("24x9->11", "fwd+bwd")]
    assert all(r[f"{c}_us"] > 0 for r in rows for c in row_padding.CONTENDERS)
    assert "| XLA/padded | XLA/auto | XLA/XLA padded | unpadded/padded |" in capsys.readouterr().out


def test_pad_width_probe_pads_to_each_width_and_agrees_on_cpu(rng, tmp_path, capsys):
    """benchmarks.probes.pad_width: at each row width every kind computes the plain
    expression's forward and gradients, "xla@W"'s GEMMs run on rows of whole W bytes (K
    and N odd, 9-39), and the probe writes a row per case with every contender."""
    from benchmarks.probes import pad_width
    from benchmarks.probes.row_padding import knobs

    m, k, n = (int(v) | 1 for v in rng.integers(9, 40, size=3))
    for mode in ("fwd", "fwd+bwd"):
        case = Case(m, k, n, "bfloat16", "bfloat16", "gelu", mode)
        args = run.Inputs(case).jax()[0]
        want = _values(pad_width.program(case, "plain"), args)
        for width in (16, 64):
            with knobs(_ROW_BYTES=width, _PAD_MIN_ROWS=0, _PAD_MIN_WORK=0):
                for kind in pad_width.KINDS:
                    _assert_values(pad_width.program(case, kind), args, want, f"{mode} {kind}@{width}")
                widths = [shape[-1] for shape in dot_shapes(pad_width.program(case, "xla"), *args)]
            assert widths and all(w % (width // 2) == 0 for w in widths), (mode, width, widths)
    pad_width.main(["--case", "24", "9", "11", "relu", "fwd", "--widths", "16", "64", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "pad_width.json").read_text())["rows"]
    assert [(r["shape"], r["mode"]) for r in rows] == [("24x9->11", "fwd")]
    assert sorted(rows[0]) == sorted(["shape", "activation", "mode", "xla_us"] + [f"{c}@{w}_us" for w in (16, 64) for c in pad_width.KINDS])
    assert "| fused@16 µs | auto@16 µs | xla@16 µs | fused@64 µs |" in capsys.readouterr().out
