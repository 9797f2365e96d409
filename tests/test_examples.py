"""Smoke tests of the Flax examples: each one's main() in-process, at small sizes."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest
from helpers import ON_GPU, TOL, assert_near, perturb

pytest.importorskip("flax")
pytest.importorskip("optax")
pytest.importorskip("sklearn")
pytest.importorskip("tqdm")

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load(name):
    """Import examples/NAME.py as a module (registered, as dataclasses need; once)."""
    module_name = f"jax_epilog_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


@pytest.mark.parametrize("name", ["train_digits_mlp", "train_transformer_mlp"])
def test_help(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load(name).main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_train_digits_mlp(rng, capsys):
    seed = str(rng.integers(2**16))
    result = load("train_digits_mlp").main(["--epochs", "8", "--no-progress", "--seed", seed])
    losses = result["losses"]
    assert len(losses) == 8
    assert losses[-1] < 0.2 * losses[0], losses
    assert result["test_accuracy"] > 0.9, result  # chance is 0.1; the defaults reach ~97%
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("test accuracy ") and "(FusedDense, 8 epochs" in out[-1]


def test_train_digits_mlp_baseline_matches(rng):
    """Same init and data: nn.Dense + relu trains to (nearly) the same losses."""
    digits = load("train_digits_mlp")
    args = ["--epochs", "2", "--no-progress", "--hidden", "32", "--seed", str(rng.integers(2**16))]
    fused = digits.main(args)
    dense = digits.main([*args, "--baseline"])
    assert dense["layer"] == "nn.Dense"
    # Bit-identical on a CPU (measured over seeds; a dropped bias moves them ~4e-3); on a GPU
    # nn.Dense's float32 matmuls may use TF32, FusedDense's do not.
    np.testing.assert_allclose(fused["losses"], dense["losses"], rtol=1e-2 if ON_GPU else 1e-5)
    # The biases start at zero and move little in two epochs: also compare the two models'
    # logits at the same parameters with every leaf (biases included) perturbed.
    x = rng.standard_normal((16, 64)).astype(np.float32)
    params = digits.MLP(hidden=(32,)).init(jax.random.key(int(rng.integers(2**16))), x)
    params = perturb(rng, params)
    assert_near(
        digits.MLP(hidden=(32,)).apply(params, x),
        digits.MLP(hidden=(32,), fused=False).apply(params, x),
        TOL["float32"],
        "logits",
    )


def test_train_transformer_mlp(rng, capsys):
    args = [
        "--d-model",
        "32",
        "--blocks",
        "2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "25",
        "--warmup",
        "2",
    ]
    args += ["--lr", "3e-3", "--seed", str(rng.integers(2**16))]
    # At this size "auto" picks XLA's own ops; "cublaslt" runs the fused primitives (their
    # reference math on a CPU), so the models below really train through them.
    args += ["--implementation", "cublaslt"]
    result = load("train_transformer_mlp").main(args)
    assert result["config"]["d_model"] == 32
    assert result["config"]["implementation"] == "cublaslt"
    for key in ("mlp", "fused", "dense"):
        r = result[key]
        assert len(r["losses"]) == 25
        # Measured over seeds: the last five steps' mean loss is ~0.4x the first five's.
        assert np.mean(r["losses"][-5:]) < 0.7 * np.mean(r["losses"][:5]), r["losses"]
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0
    # Same init and batches; bfloat16 rounding differs (~1e-3 apart measured), so loosely.
    np.testing.assert_allclose(result["fused"]["losses"], result["dense"]["losses"], rtol=2e-2)
    # FusedMLP: FusedDense's parameters and values; only its backward's rounding differs.
    assert result["mlp"]["losses"][0] == result["fused"]["losses"][0]
    np.testing.assert_allclose(result["mlp"]["losses"], result["fused"]["losses"], rtol=2e-2)
    out = capsys.readouterr().out
    if ON_GPU:  # the speed-ups over nn.Dense, measured
        assert set(result["speedup"]) == {"mlp", "fused"} and min(result["speedup"].values()) > 0
        assert "FusedDense step time speed-up" in out and "FusedMLP step time speed-up" in out
    else:  # no kernel ran: no speed-up is claimed
        assert "speedup" not in result and "speed-up over" not in out
        assert "No cuBLASLt kernel ran" in out


def test_train_transformer_mlp_fp8_trains_four_models_in_turn(rng, capsys, tmp_path):
    plot = tmp_path / "losses.png"
    args = ["--d-model", "32", "--blocks", "1", "--batch", "2", "--seq", "16", "--steps", "20"]
    args += [
        "--warmup",
        "2",
        "--lr",
        "3e-3",
        "--seed",
        str(rng.integers(2**16)),
        "--fp8",
        "--plot",
        str(plot),
    ]
    result = load("train_transformer_mlp").main(args)
    for key in ("dense", "mlp", "mlp_fp8", "flax_fp8"):
        losses = result[key]["losses"]
        assert len(losses) == 20 and np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), (key, losses)
        assert result[key]["last_mean_loss"] == pytest.approx(np.mean(losses[-5:]))
    # The same parameters and batches; FP8 rounding moves the losses by a few per cent.
    np.testing.assert_allclose(result["mlp_fp8"]["losses"][-1], result["dense"]["losses"][-1], rtol=0.1)
    assert plot.stat().st_size > 1000
    out = capsys.readouterr().out
    assert "last 5 mean" in out
    if jax.default_backend() != "gpu":
        assert "no FP8 kernel ran" in out


@pytest.mark.parametrize("key, flags", [("mlp", []), ("mlp_fp8", ["--fp8", "--plot", ""])], ids=str)
def test_train_transformer_mlp_data_parallel_is_the_same_training(rng, capsys, key, flags):
    """--devices 2 with one sequence a device trains as one device with two: the same
    batches, the gradients summed over the devices."""
    base = ["--d-model", "32", "--blocks", "1", "--seq", "16", "--steps", "6", "--warmup", "1"]
    base += ["--implementation", "cublaslt", "--seed", str(rng.integers(2**16)), "--layers", key, *flags]
    example = load("train_transformer_mlp")
    split = example.main([*base, "--devices", "2", "--batch", "1"])
    whole = example.main([*base, "--batch", "2"])
    assert split["config"]["devices"] == 2
    np.testing.assert_allclose(split[key]["losses"], whole[key]["losses"], rtol=1e-2)
    assert split[key]["tokens_per_s_per_device"] == split[key]["tokens_per_s"] / 2
    assert "2 x cpu" in capsys.readouterr().out or jax.default_backend() != "cpu"


@pytest.mark.parametrize("flags", [[], ["--no-donate"]], ids=["donated", "kept"])
def test_train_transformer_mlp_step_donates_its_state(flags):
    """The train step donates the parameters and optimizer state it is given (XLA then reuses
    their buffers), and a Run carries the new ones; --no-donate keeps the old ones alive."""
    example = load("train_transformer_mlp")
    args = example.parse_args(["--d-model", "32", "--blocks", "1", "--batch", "2", "--seq", "16", *flags])
    run = example.setup(args, "mlp_fp8")
    # (the state of a hidden layer's FP8 input is its layer below's output state: unused)
    before = jax.tree.leaves((run.variables["params"], run.opt_state))
    first = float(run.step(*run.batch(0)))
    second = float(run.step(*run.batch(0)))
    assert np.isfinite(first) and second < first  # trained on from the carried state
    deleted = [leaf.is_deleted() for leaf in before]
    assert all(deleted) if not flags else not any(deleted)
