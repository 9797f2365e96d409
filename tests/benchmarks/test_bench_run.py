"""The suite's runner on a CPU: contenders, their rows, skips and failures, the sections,
and one whole (tiny) run writing its per-GPU folder."""

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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ under plain `pytest` too

from benchmarks import cases, contenders, run, sections
from benchmarks.cases import Case
from benchmarks.common import Progress
from benchmarks.timing import SMOKE, Settings, WallClock


def _tiny(mode="fwd", activation="relu"):
    return Case(4, 8, 16, "float32", "float32", activation, mode)


@pytest.mark.parametrize("mode", cases.MODES)
def test_jax_contenders_are_timed_together_on_cpu(mode):
    case = _tiny(mode, "gelu")
    names = contenders.contenders(mode)[:4]
    rows = run.run_group(case, names, contenders.Inputs(case), SMOKE)
    assert [r["contender"] for r in rows] == names
    for r in rows:
        assert r["skipped"] is None, r["skipped"]
        assert r["us"] > 0 and r["samples"] == 2 and r["tflops"] == pytest.approx(cases.tflops(case, r["us"]))
    assert all(r["handler_runs"] == 0 for r in rows if r["contender"].startswith("jax_epilog"))  # no GPU path


@pytest.mark.parametrize("contender", ["jax_epilog", "jax_epilog_auto", "xla"])
def test_fwd_vjp_program_returns_the_output_and_its_vjp_of_the_given_cotangent(contender):
    case = Case(24, 40, 56, "float32", "float32", "gelu", "fwd+vjp")
    inputs = contenders.Inputs(case)
    (x, w, b), (dy, dy_copy, *_) = inputs.jax()[0], inputs.jax_cotangents()
    assert dy.shape == (24, 56) and float(jnp.std(dy)) > 0.5
    assert bool(jnp.all(dy == dy_copy)) and dy is not dy_copy  # one value, one copy per input set
    y, dx, dw, db = jax.jit(contenders.jax_program(case, contender))(x, w, b, dy)

    def layer(x, w, b):
        return jax.nn.gelu(jnp.matmul(x, w, precision="highest") + b, approximate=True)

    want_y, pullback = jax.vjp(layer, x, w, b)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
    for got, want in zip((dx, dw, db), pullback(dy)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(want))))


@pytest.mark.parametrize("contender", [*contenders.TORCH, "nvmath"])
def test_library_contenders_skip_when_absent(monkeypatch, contender):
    for name in ("torch", "cupy", "nvmath"):
        monkeypatch.setitem(sys.modules, name, None)  # import now raises ImportError
    case = _tiny()
    row = run.run_one(case, contender, contenders.Inputs(case), SMOKE)
    assert row["skipped"] and "not importable" in row["skipped"]
    assert row["us"] is None and row["tflops"] is None and row["contender"] == contender


def test_a_failing_contender_becomes_a_row_and_spares_the_others(monkeypatch):
    def broken(*args):
        raise ValueError("boom\nsecond line")

    monkeypatch.setitem(contenders.BENCH, "nvmath", broken)
    case = _tiny()
    rows = run.run_group(case, ["xla", "nvmath"], contenders.Inputs(case), SMOKE)
    assert rows[0]["us"] > 0 and rows[1]["skipped"] == "ValueError: boom"


def test_library_contenders_are_interleaved_with_jax(monkeypatch):
    order = []

    @contextlib.contextmanager
    def fake(case, name, inputs):
        yield (lambda i: order.append(name)), WallClock()

    real = contenders.jax_timed

    def jax_timed(case, names, inputs):
        timed = real(case, names, inputs)
        return [
            (lambda i, c=call, n=name: (order.append(n), c(i))[1], clock)
            for name, (call, clock) in zip(names, timed)
        ]

    monkeypatch.setitem(contenders.BENCH, "nvmath", fake)
    monkeypatch.setattr(contenders, "jax_timed", jax_timed)
    case = _tiny()
    rows = run.run_group(case, ["xla", "nvmath"], contenders.Inputs(case), SMOKE)
    assert [r["skipped"] for r in rows] == [None, None]
    timed = order[order.index("nvmath") :]  # after warm-up and calibration of both
    switches = [name for j, name in enumerate(timed) if j == 0 or timed[j - 1] != name]
    assert set(switches) == {"xla", "nvmath"} and len(switches) > 3  # in turns, not one after the other


def test_run_jobs_groups_a_cases_contenders(monkeypatch):
    groups = []
    real = run.run_group
    monkeypatch.setattr(
        run, "run_group", lambda case, names, *a: groups.append(list(names)) or real(case, names, *a)
    )
    case = _tiny()
    todo = [(case, "jax_epilog"), (case, "xla"), (case._replace(activation="gelu"), "xla")]
    rows = run.run_jobs(todo, SMOKE, Progress(len(todo)))
    assert [r["contender"] for r in rows] == ["jax_epilog", "xla", "xla"]
    assert groups == [["jax_epilog", "xla"], ["xla"]]


def test_xla_cublaslt_is_xlas_program_compiled_with_the_option(monkeypatch):
    case = _tiny()
    inputs = contenders.Inputs(case)
    (xla, _), (cublaslt, _) = contenders.jax_timed(case, ["xla", "xla_cublaslt"], inputs)
    np.testing.assert_array_equal(
        np.asarray(xla(0)), np.asarray(cublaslt(0))
    )  # on a CPU the option changes nothing
    monkeypatch.setattr(contenders, "CUBLASLT_OPTIONS", {"xla_gpu_no_such_option": True})
    contenders.jax_timed(case, ["xla"], inputs)  # the options are for xla_cublaslt alone
    with pytest.raises(Exception, match="xla_gpu_no_such_option"):
        contenders.jax_timed(case, ["xla_cublaslt"], inputs)


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


def test_nvmath_gets_column_major_views_of_the_same_operands():
    """nvmath gets kernelᵀ (N, K) and xᵀ (K, M), column-major, so its yᵀ = kernelᵀ·xᵀ is our y."""
    case = Case(3, 5, 7, "bfloat16", "float32", "relu", "fwd")
    inputs = contenders.Inputs(case)
    x, w, b = inputs.host
    sets = inputs.cupy_transposed(_FakeCupy)
    assert len(sets) == 3 and len({id(s[0].data.buffer) for s in sets}) == 3  # distinct buffers
    for w_t, x_t, bias in sets:
        assert w_t.get().flags.f_contiguous and x_t.get().flags.f_contiguous
        np.testing.assert_array_equal(w_t.get(), w.T.astype(ml_dtypes.bfloat16))
        np.testing.assert_array_equal(x_t.get(), x.T.astype(ml_dtypes.bfloat16))
        np.testing.assert_array_equal(bias.get(), b)


def test_command_buffer_verdict():
    assert sections.command_buffer_verdict(46, 3392, True).startswith("captured")
    assert sections.command_buffer_verdict(3392, 3392, True).startswith("not captured")
    assert sections.command_buffer_verdict(1000, 3392, True) == "partly captured"
    assert sections.command_buffer_verdict(0, 3392, True).startswith("handler never ran")
    assert sections.command_buffer_verdict(0, 3392, False).startswith("n/a")


def test_host_section_times_each_chain_variant_on_cpu(monkeypatch):
    monkeypatch.setattr(sections, "CHAIN_DEPTH", 2)  # (16 layers compile for seconds on a CPU)
    settings = Settings(samples=1, min_calls=2, sample_s=0.0, warmup=1)
    progress = Progress(sections.N_HOST)
    host = sections.bench_host(settings, scale=16, progress=progress, on_gpu=False)
    assert progress.done == sections.N_HOST  # the progress counter's total is right
    assert [(c["activation"], c["weights"]) for c in host["chain"]] == [
        (act, weights) for act in ("relu", "gelu") for weights in sections.CHAIN_WEIGHTS
    ]
    assert all(c["jax_epilog_us"] > 0 and c["xla_us"] > 0 and c["layers"] == 2 for c in host["chain"])
    assert all(c["layer_runs"] > 0 and c["layer_runs"] % 2 == 0 for c in host["chain"])
    assert all(c["handler_runs"] == 0 and c["command_buffers"].startswith("n/a") for c in host["chain"])
    assert [(s["contender"], s["handler_runs"]) for s in host["single"]] == [("jax_epilog", 0)] * 2 + [
        ("xla", 0)
    ] * 2


def test_guarded_section_failure_is_recorded(capsys):
    def bench_broken():
        raise RuntimeError("no GPU memory")

    assert sections.guarded(bench_broken) == {"skipped": "RuntimeError: no GPU memory"}
    assert "bench_broken failed" in capsys.readouterr().out


def test_a_whole_run_writes_the_gpus_folder(monkeypatch, tmp_path, capsys):
    """A tiny plan end to end (--cpu-smoke): JSON, Markdown, RUN.md and the plots in
    <out>/<gpu slug>/, a second run replacing the first; --policy reaches the record."""
    monkeypatch.setitem(
        cases.PLANS, "quick", (cases.Shapes((128,), 128, 64, ("float32",), None, ("relu",), ("fwd",)),)
    )
    monkeypatch.setattr(run, "bench_host", lambda *a: {"skipped": "not timed in this test"})
    monkeypatch.setattr(run, "bench_ceiling", lambda *a: {"skipped": "not timed in this test"})
    for _ in range(2):
        results = run.main(
            ["--quick", "--cpu-smoke", "--out", str(tmp_path), "--policy", "pad_min_work=2**40"]
        )
    folder = tmp_path / "cpu"
    assert {"RUN.md", "suite.json", "suite.md"} <= {p.name for p in folder.iterdir()}
    saved = json.loads((folder / "suite.json").read_text())
    assert [r["contender"] for r in saved["rows"]] == contenders.contenders("fwd")
    assert saved["rows"][0]["shape"] == "2x2->1" and saved["policy"] == {"pad_min_work": "1099511627776"}
    assert saved == json.loads(json.dumps(results))
    note = (folder / "RUN.md").read_text()
    assert (
        "`python -m benchmarks.run --quick --cpu-smoke --out" in note and "pad_min_work=1099511627776" in note
    )
    assert "Not measured: not timed in this test" in (folder / "suite.md").read_text()
    assert "wrote" in capsys.readouterr().out
