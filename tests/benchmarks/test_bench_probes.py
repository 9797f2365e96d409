"""The probes behind docs/decisions.md: each computes what it claims to time, on a CPU
(their timings are meaningful on a GPU only), and the GPU-only ones on a GPU."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import dot_shapes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ under plain `pytest` too

import jax_epilog
from benchmarks import common, training
from benchmarks.cases import Case
from benchmarks.contenders import Inputs
from benchmarks.probes import (
    backward_variants,
    ensemble,
    forced_algorithm,
    fused_dz,
    mlp_layers,
    pad_width,
    row_padding,
    small_batch,
)
from benchmarks.timing import SMOKE, Settings

PROBES = Path(__file__).resolve().parents[2] / "benchmarks" / "probes"
DECISIONS = Path(__file__).resolve().parents[2] / "docs" / "decisions.md"


@pytest.fixture
def short(monkeypatch):
    """Two samples of a few calls for every probe."""
    monkeypatch.setattr(common, "SETTINGS", Settings(samples=2, min_calls=2, sample_s=0.0, warmup=1))
    for module in (row_padding, pad_width, small_batch, forced_algorithm):
        monkeypatch.setattr(module, "QUICK", SMOKE)


def test_every_probe_is_linked_from_decisions():
    text = DECISIONS.read_text()
    probes = sorted(p.stem for p in PROBES.glob("*.py") if p.stem != "__init__")
    assert probes and all(f"benchmarks.probes.{name}" in text for name in probes), probes


def _values(program, args) -> list[np.ndarray]:
    """The leaves of jitted ``program(*args)`` as float32 arrays."""
    return [np.asarray(a, np.float32) for a in jax.tree.leaves(jax.jit(program)(*args))]


def _assert_values(program, args, want, label):
    """``program``'s results on ``args`` are ``want``, to 3e-2 of each one's largest entry."""
    for got, w in zip(_values(program, args), want, strict=True):
        np.testing.assert_allclose(got, w, atol=3e-2 * float(np.max(np.abs(w))), err_msg=label)


@pytest.mark.parametrize(("activation", "modes"), [("gelu", ("fwd", "mlp")), ("none", ("fwd+bwd",))])
def test_row_padding_contenders_agree_and_pad(short, rng, activation, modes, tmp_path, capsys):
    """Every contender computes the same forward and gradients (padding at any size), and
    "xla_padded"'s GEMMs write rows whose widths are multiples of 8 (K and N odd, 9-39)."""
    m, k, n = (int(v) | 1 for v in rng.integers(9, 40, size=3))
    with jax_epilog.override_policy(pad_min_rows=0, pad_min_work=0):
        for mode in modes:
            case = Case(m, k, n, "bfloat16", "bfloat16", activation, mode)
            args = Inputs(case).jax()[0]
            want = _values(row_padding.program(case, "xla"), args)
            assert all(np.max(np.abs(w)) > 0 for w in want)
            for contender in row_padding.CONTENDERS:
                _assert_values(row_padding.program(case, contender), args, want, f"{mode} {contender}")
            widths = [shape[-1] for shape in dot_shapes(row_padding.program(case, "xla_padded"), *args)]
            assert widths and all(w % 8 == 0 for w in widths), (mode, widths)
    assert row_padding.POLICY == {
        "padded": {"pad_min_rows": 0, "pad_min_work": 0},
        "unpadded": {"row_bytes": 1},
    }
    row_padding.main(["--case", "24", "9", "11", activation, "--modes", modes[0], "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "row_padding.json").read_text())["rows"]
    assert [(r["shape"], r["mode"]) for r in rows] == [("24x9->11", modes[0])]
    assert all(r[f"{c}_us"] > 0 for r in rows for c in row_padding.CONTENDERS)
    assert "| XLA/padded | XLA/auto | XLA/XLA padded | unpadded/padded |" in capsys.readouterr().out


def test_pad_width_pads_to_each_width(short, rng, tmp_path):
    m, k, n = (int(v) | 1 for v in rng.integers(9, 40, size=3))
    case = Case(m, k, n, "bfloat16", "bfloat16", "gelu", "fwd+bwd")
    args = Inputs(case).jax()[0]
    want = _values(pad_width.program(case, "plain"), args)
    for width in (16, 64):
        with jax_epilog.override_policy(**pad_width.width_policy("fused", width)):
            for kind in pad_width.KINDS:
                _assert_values(pad_width.program(case, kind), args, want, f"{kind}@{width}")
            widths = [shape[-1] for shape in dot_shapes(pad_width.program(case, "xla"), *args)]
        assert widths and all(w % (width // 2) == 0 for w in widths), (width, widths)
    assert "pad_min_rows" not in pad_width.width_policy("auto", 64)  # "auto" keeps its floors
    pad_width.main(["--case", "24", "9", "11", "relu", "fwd", "--widths", "16", "64", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "pad_width.json").read_text())["rows"]
    assert sorted(row) == sorted(
        ["shape", "activation", "mode", "xla_us"] + [f"{c}@{w}_us" for w in (16, 64) for c in pad_width.KINDS]
    )


def test_mlp_layers_contenders_compute_one_gradient(short, rng, tmp_path, capsys):
    m, d = (int(v) for v in rng.integers(9, 40, size=2))
    args = [jnp.asarray(a, jnp.float32) for a in training.mlp_inputs(m, d)]
    full = mlp_layers.Arithmetic.of("float32", False)  # on a GPU, XLA's DEFAULT would be TF32
    want = mlp_layers.grad_step("xla", "relu", full)(*args)
    for contender in mlp_layers.CONTENDERS[1:]:
        for g, w in zip(mlp_layers.grad_step(contender, "relu", full)(*args), want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=contender)
    mlp_layers.main(
        ["--shape", "24", "8", "--activation", "relu", "gelu", "--forward", "--out", str(tmp_path)]
    )
    rows = json.loads((tmp_path / "mlp_layers.json").read_text())["rows"]
    assert [(r["shape"], r["activation"], r["mode"]) for r in rows] == [
        ("24x8->32->8", a, "forward") for a in ("relu", "gelu")
    ]
    assert (
        "| XLA/auto | XLA/both | XLA/first | XLA/second | XLA/bgrada | XLA/fused_mlp | XLA/fused_mlp_cublaslt |"
        in capsys.readouterr().out
    )
    assert mlp_layers.Arithmetic.of("float32", True).compute_type.name == "COMPUTE_32F_FAST_TF32"


def test_small_batch_rotates_inputs_and_times_each_contender(short, monkeypatch, tmp_path):
    monkeypatch.setattr(small_batch, "ROWS", (3,))
    monkeypatch.setattr(small_batch, "WEIGHTS", ((5, 7),))
    small_batch.main(["--out", str(tmp_path)])
    rows = json.loads((tmp_path / "small_batch.json").read_text())["rows"]
    assert [(r["shape"], r["activation"]) for r in rows] == [("3x5->7", "relu"), ("3x5->7", "gelu")]
    assert all(r["copies"] == 32 and all(r[c] > 0 for c in small_batch.CONTENDERS) for r in rows)
    assert (tmp_path / "small_batch.md").read_text().splitlines()[2].count("×") == 2


@pytest.mark.parametrize(("activation", "losses"), [("relu", ("sum", "next")), ("gelu", ("sq",))])
def test_backward_variants_compute_the_same_gradients(rng, activation, losses):
    x, w, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((37, 19), (19, 23), (23,)))
    assert set(backward_variants.layers(activation)) == set(backward_variants.NAMES)
    for loss_name in losses:
        with jax.default_matmul_precision("highest"):  # XLA's float32 dot on a GPU: not TF32
            grads = backward_variants.compiled_gradients(
                activation, backward_variants.LOSSES[loss_name], (x, w, b)
            )
            got = {name: g(x, w, b) for name, g in grads.items()}
        for name, g in got.items():
            for a, want in zip(g, got["xla"]):
                np.testing.assert_allclose(a, want, rtol=1e-4, atol=1e-4, err_msg=f"{name}, {loss_name}")
    kernel_row = {
        "shape": "1x1->1",
        "part": "kernel gradient",
        "bgrada_us": 1.0,
        "xla_dot_sum_us": 1.0,
        "xla_dot_us": 1.0,
    }
    assert "BGRADA GEMM µs" in backward_variants.render([kernel_row])


def test_ensemble_contenders_agree_and_time_each_pass(short, rng, monkeypatch, tmp_path):
    e, m, k, n = 3, *(int(v) for v in rng.integers(17, 60, size=3))
    args = ensemble.members_inputs(e, m, k, n, rng, jnp.float32)
    assert (
        args[0].shape == (e, m, k) and args[1].shape == (e, k, n) and not np.allclose(args[1][0], args[1][1])
    )
    for pass_, progs in ensemble.programs("gelu").items():
        with jax.default_matmul_precision("highest"):
            outs = {c: jax.tree.leaves(f(*args)) for c, f in progs.items()}
        for c in ("auto", "cublaslt"):
            for got, want in zip(outs[c], outs["xla"], strict=True):
                scale = max(1.0, float(np.abs(want).max()))
                assert np.abs(np.asarray(got) - np.asarray(want)).max() <= 1e-4 * scale, (pass_, c)
    monkeypatch.setattr(ensemble, "CONTENDERS", ("xla", "cublaslt"))  # (fewer programs to compile)
    ensemble.main(["--shape", "40", "24", "56", "--members", "2", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "ensemble.json").read_text())["rows"]
    assert [(r["activation"], r["pass_"]) for r in rows] == [
        (a, p) for a in ("relu", "gelu") for p in ("forward", "gradient", "per-example gradient")
    ]
    assert all(r["shape"] == "2x 40x24->56" and r["cublaslt_us"] > 0 for r in rows)


def test_forced_algorithm_prints_a_reading_with_the_policy_it_ran(short, tmp_path, capsys):
    forced_algorithm.main(
        ["--shape", "24", "16", "40", "--any-reduction", "--workspace-mib", "128", "--out", str(tmp_path)]
    )
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(
        "24x16->40 relu, tuner's choice (splitk_any_reduction=True) (heuristic_workspace=134217728): fused "
    )
    assert "XLA/fused" in line and "error" in line
    assert (tmp_path / "forced_algorithm.md").read_text().startswith(line)


@pytest.mark.gpu
def test_refusals_probe_reproduces_the_one_row_refusals():
    from benchmarks.probes import refusals

    results = {name: refusals.attempt(spec) for name, spec in refusals.specs()}
    assert results["forward BIAS d=float32 m1k6n11"].startswith("REFUSED")
    assert results["forward BIAS d=bfloat16 m1k6n11"].startswith("ran")
    assert results["forward BIAS d=float32 m2k6n11"].startswith("ran")
    assert results["dgrad DGELU aux=bfloat16 m1n16k24"].startswith("REFUSED")
    assert results["dgrad DGELU aux=bfloat16 m2n16k24"].startswith("ran")
    assert results["wgrad BGRADA m4k1n11"].startswith("REFUSED") and results[
        "wgrad BGRADA m4k6n11"
    ].startswith("ran")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("kind", ["gelu", "none"])
def test_fused_dz_probe_compares_the_kernel_with_xlas_passes(kind, transposed):
    keys = jax.random.split(jax.random.key(7), 2)
    dy = jax.random.normal(keys[0], (128, 256), jnp.bfloat16)
    z = jax.random.normal(keys[1], (128, 256), jnp.bfloat16) * 2
    scale = jnp.float32(1e-4)
    want = fused_dz.xla_passes(kind, transposed)(dy, z, scale)
    got = fused_dz.kernel(kind, (64, 128), transposed, interpret=True)(dy, z, scale)
    shapes = [(128, 256), *([(256, 128)] if transposed else []), (256,), ()]
    assert [a.shape for a in got] == [a.shape for a in want] == shapes
    note = fused_dz.check(got, want)
    assert float(note.split("apart ")[1].split(",")[0]) < 0.01, note
    assert ("transpose ok" in note) == transposed, note
