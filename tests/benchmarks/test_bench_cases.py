"""The suite's plans, the arithmetic on a case, and the timing loops (no JAX program runs)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ under plain `pytest` too

from benchmarks import cases, contenders, run, timing
from benchmarks.cases import Case


def _shapes(plan):
    return {(c.m, c.k, c.n) for c in plan}


def test_quick_plan():
    plan = cases.plan(full=False)
    assert _shapes(plan) == {
        (256, 784, 100), (8192, 1024, 4096), (8192, 4096, 16384), (8192, 4096, 1024),
        (64, 4096, 16384), (1000, 1000, 1003), (8192, 1024, 4097),
    }  # fmt: skip
    assert plan[0] == Case(256, 784, 100, "float16", "float32", "relu", "fwd")  # the seed layer first
    assert {c.dtype for c in plan if c.m != 256} == {"bfloat16"}
    assert {(c.m, c.k, c.n) for c in plan if c.activation == "none"} == {(256, 784, 100), (8192, 1024, 4096)}
    backward = {
        mode: {(c.m, c.k, c.n, c.activation) for c in plan if c.mode == mode} for mode in cases.MODES[1:]
    }
    assert backward["fwd+bwd"] == backward["fwd+vjp"] and len(backward["fwd+vjp"]) == 7
    assert {c.m for c in plan if c.mode != "fwd"} == {8192}
    assert len(plan) == len(set(plan)) == 30
    assert all(c.compute_type is None and c.bias_dtype == c.dtype for c in plan if c.m != 256)


def test_full_plan():
    plan = cases.plan(full=True)
    assert {(8192, 16384, 4096), (16, 4096, 16384), (128, 4096, 16384)} <= _shapes(plan)
    assert {c.dtype for c in plan if c.m == 8192 and c.dtype != "float32"} == {"bfloat16", "float16"}
    f32 = [c for c in plan if c.dtype == "float32"]
    assert _shapes(f32) == {(8192, 1024, 4096)} and {c.compute_type for c in f32} == {None, cases.TF32}
    assert set(cases.plan(full=False)) < set(plan) and len(plan) == len(set(plan))
    # Nesting order: row counts, dtypes, compute types, activations, modes.
    small = [c for c in plan if c.k == 4096 and c.n == 16384 and c.m < 8192]
    assert [(c.m, c.activation) for c in small][:4] == [
        (16, "relu"),
        (16, "gelu"),
        (16, "none"),
        (64, "relu"),
    ]


def test_case_arithmetic():
    fwd = Case(2, 3, 5, "bfloat16", "bfloat16", "relu", "fwd")
    assert fwd.shape == "2x3->5" and cases.flops(fwd) == 60
    assert cases.flops(fwd._replace(mode="fwd+bwd")) == cases.flops(fwd._replace(mode="fwd+vjp")) == 180
    big = Case(8192, 4096, 16384, "bfloat16", "bfloat16", "relu", "fwd")
    assert cases.tflops(big, 1000.0) == pytest.approx(2 * 8192 * 4096 * 16384 / 1e-3 / 1e12)
    assert cases.operand_bytes(fwd) == 2 * (6 + 15 + 10) + 2 * 5
    assert cases.input_copies(big) == 2 and cases.input_copies(big._replace(k=1024, n=4096)) == 3
    assert cases.shrink(big, 64)[:3] == (128, 64, 256) and cases.shrink(fwd, 64)[:3] == (1, 1, 1)


def test_contenders_and_jobs():
    assert contenders.contenders("fwd") == [
        "jax_epilog", "jax_epilog_auto", "xla", "xla_cublaslt", "torch_matmul_add", "torch_linear",
        "torch_addmm_act", "nvmath",
    ]  # fmt: skip
    assert contenders.contenders("fwd+vjp") == ["jax_epilog", "jax_epilog_auto", "xla", "xla_cublaslt"]
    case = Case(8, 8, 8, "bfloat16", "bfloat16", "relu", "fwd+bwd")
    assert contenders.jobs([case]) == [(case, n) for n in contenders.contenders("fwd+bwd")]
    assert set(contenders.BENCH) == {"nvmath", *contenders.TORCH}


def test_dry_run_lists_the_plan_with_an_estimate(capsys):
    run.main(["--quick", "--dry-run"])
    lines = capsys.readouterr().out.splitlines()
    total = len(contenders.jobs(cases.plan(full=False)))
    assert len(lines) == total + 1
    assert lines[0].startswith(f"[1/{total}] 256x784->100 float16/float32 bias relu fwd jax_epilog")
    assert "estimated H200 wall time" in lines[-1]
    minutes = float(lines[-1].split("~")[1].split(" min")[0])
    assert 1.0 < minutes < 6.0  # the quick plan: about two minutes on an H200


def test_dtype_splits_the_full_plan_into_parts(capsys):
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


class _FakeClock:
    """Each call "takes" ``ms``; records the batches in ``order``."""

    def __init__(self, name="a", ms=1.0, order=None):
        self.name, self.ms, self.order, self.batches = name, ms, order if order is not None else [], []

    def start(self):
        self.calls = 0

    def stop(self, out):
        self.batches.append(self.calls)
        self.order.append(self.name)
        return self.calls * self.ms * 1e-3

    def call(self, i):
        self.calls += 1
        return i


def test_measure_adapts_batch_length():
    clock = _FakeClock()
    settings = timing.Settings(samples=3, min_calls=5, sample_s=0.02, warmup=2)
    t = timing.measure(clock.call, clock, settings)
    assert clock.batches[:2] == [2, 5]  # warm-up, then the calibrating batch
    assert t.iters >= 20 and clock.batches[2:] == [t.iters] * 3
    assert t.us == pytest.approx(1000.0) and t.samples == 3 and t.calls == sum(clock.batches)


def test_interleaved_samples_take_turns_each_round_led_by_the_next():
    order = []
    a, b = _FakeClock("a", 1.0, order), _FakeClock("b", 3.0, order)
    settings = timing.Settings(samples=3, min_calls=5, sample_s=0.02, warmup=2)
    ta, tb = timing.measure_interleaved([(a.call, a), (b.call, b)], settings)
    assert order == ["a", "a", "b", "b"] + ["a", "b", "b", "a", "a", "b"]
    assert ta.us == pytest.approx(1000.0) and tb.us == pytest.approx(3000.0)
    assert ta.iters >= 20 and 5 <= tb.iters < ta.iters and tb.samples == 3


def test_round_orders():
    rounds = {name: [f(s, 3) for s in range(4)] for name, f in timing.ROUND_ORDERS.items()}
    assert rounds["rotate"] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert rounds["serpentine"] == [[0, 1, 2], [0, 2, 1], [2, 0, 1], [2, 1, 0]]
    assert all(sorted(r) == [0, 1, 2] for r in rounds["shuffle"])
    order = []

    def contender(name):
        return (lambda i: None), SimpleNamespace(
            start=lambda: None, stop=lambda out: order.append(name) or 0.05
        )

    settings = timing.Settings(samples=2, min_calls=1, sample_s=0.0, warmup=0, order="serpentine")
    timing.measure_interleaved([contender("a"), contender("b"), contender("c")], settings)
    assert order[6:] == ["a", "b", "c", "a", "c", "b"]  # after a calibration batch each
