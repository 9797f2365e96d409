"""benchmarks/train_loop.py on a CPU: its variants parse, each model is timed both ways
with its chunks in turns, and the table reads against nn.Dense."""

import jax.numpy as jnp
import pytest

from benchmarks import train_loop


def test_variants_parse_into_policy_changes():
    key, changes = train_loop.parse_variant("mlp_fp8:fp8_command_buffers=True,replay_after=3")
    assert key == "mlp_fp8" and changes == {"fp8_command_buffers": True, "replay_after": 3}
    with pytest.raises(ValueError, match="KEY:FIELD=VALUE"):
        train_loop.parse_variant("fp8_command_buffers=True")


class _Run:
    """A stand-in train step that logs which model ran on which batch."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def step(self, x, y):
        self.log.append((self.name, int(x)))
        return jnp.float32(x)


def test_each_model_runs_every_batch_in_turn_both_ways():
    log = []
    batches = [(i, i) for i in range(train_loop.BATCHES)]
    prepared = {name: (_Run(name, log), batches) for name in ("a", "b")}
    results = train_loop.measure(prepared, chunks=2, steps=10)
    assert set(results) == {"loop", "sync"} and all(set(r) == {"a", "b"} for r in results.values())
    assert len(log) == 2 * 2 * 2 * 10  # modes × chunks × models × steps
    # chunks alternate between the models, and each chunk cycles through the batches
    assert [name for name, _ in log[::10]] == ["a", "b"] * 4
    assert [batch for _, batch in log[:10]] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]


def test_the_table_gives_each_model_against_the_base():
    results = {"loop": {"nn.Dense": 400.0, "FP8": 200.0}, "sync": {"nn.Dense": 500.0, "FP8": 1000.0}}
    table = train_loop.render("title", results, "nn.Dense").splitlines()
    assert table[0] == "title"
    assert table[-1].split() == ["FP8", "200", "2.00×", "1000", "0.50×"]
