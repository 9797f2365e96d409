"""benchmarks/train_loop.py on a CPU: its variants parse, each model is timed three ways
with its chunks in turns, and the table reads against nn.Dense."""

import jax
import jax.numpy as jnp
import pytest

from benchmarks import train_loop
from jax_epilog import get_policy


def test_variants_parse_into_policy_changes():
    key, changes = train_loop.parse_variant("mlp_fp8:fp8_command_buffers=True,replay_after=3")
    assert key == "mlp_fp8" and changes == {"fp8_command_buffers": True, "replay_after": 3}
    with pytest.raises(ValueError, match="KEY:FIELD=VALUE"):
        train_loop.parse_variant("fp8_command_buffers=True")
    key, changes = train_loop.parse_variant("dense:xla_gpu_enable_command_buffer=FUSION,CUBLAS,replay=False")
    assert changes == {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS", "replay": False}
    assert train_loop.parse_variant("dense:xla_gpu_enable_command_buffer=")[1] == {
        "xla_gpu_enable_command_buffer": ""
    }


class _TinyRun:
    """A stand-in for the example's ``Run``: a jitted step on a carried state."""

    def __init__(self):
        self.train_step = jax.jit(lambda v, x, y: (v + jnp.sum(x * y), jnp.sum(x)))
        self.v = jnp.zeros(())
        self.policy_seen = get_policy()

    def batch(self, i):
        return jnp.full((5,), float(i)), jnp.ones(5)

    def lower(self, x, y):
        return self.train_step.lower(self.v, x, y)

    def step(self, x, y):
        self.v, loss = self.train_step(self.v, x, y)
        return loss


class _Example:
    def setup(self, args, key):
        return _TinyRun()


def test_xla_options_reach_the_compiler_of_that_models_step_alone():
    changes = {"xla_gpu_enable_command_buffer": "", "auto_min_rows": 4096}
    run, batches = train_loop.prepare(_Example(), None, "dense", changes, warmup=2)
    assert isinstance(run.train_step, jax.stages.Compiled) and len(batches) == train_loop.BATCHES
    assert run.policy_seen.auto_min_rows == 4096 != get_policy().auto_min_rows  # while set up only
    assert float(run.v) == 5 * (0 + 1)  # the compiled step ran the warm-up steps
    with pytest.raises(Exception, match="not a valid enum value"):
        train_loop.prepare(_Example(), None, "dense", {"xla_gpu_enable_command_buffer": "BOGUS"})
    plain, _ = train_loop.prepare(_Example(), None, "dense", {})
    assert not isinstance(plain.train_step, jax.stages.Compiled)


class _Run:
    """A stand-in train step that logs which model ran on which batch."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def step(self, x, y):
        self.log.append((self.name, int(x)))
        return jnp.float32(x)

    def batch(self, i):
        return jnp.int32(i), jnp.int32(i)


def test_each_model_runs_every_batch_in_turn_three_ways():
    log = []
    batches = [(i, i) for i in range(train_loop.BATCHES)]
    prepared = {name: (_Run(name, log), batches) for name in ("a", "b")}
    results = train_loop.measure(prepared, chunks=2, steps=10)
    assert set(results) == {"loop", "sync", "fresh"} and all(set(r) == {"a", "b"} for r in results.values())
    assert len(log) == 3 * 2 * 2 * 10  # modes × chunks × models × steps
    # chunks alternate between the models; loop and sync cycle through the batches made
    # beforehand, fresh makes a new one (numbered past them) for each step
    assert [name for name, _ in log[::10]] == ["a", "b"] * 6
    assert [batch for _, batch in log[:10]] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert [batch for _, batch in log[-10:]] == list(range(8, 18))
    loop = results["loop"]["a"]
    assert 0 < loop.dispatch_us <= loop.us and loop.handler_runs == 0  # (no custom call on a CPU)


def test_the_table_gives_each_model_against_the_base():
    chunk = train_loop.Chunk
    results = {
        "loop": {"nn.Dense": chunk(400.0, 50.0, 0, 0), "FP8": chunk(200.0, 90.0, 0, 0)},
        "sync": {"nn.Dense": chunk(500.0, 0, 0, 0), "FP8": chunk(1000.0, 0, 13.25, 400.0)},
        "fresh": {"nn.Dense": chunk(600.0, 0, 0, 0), "FP8": chunk(400.0, 0, 24, 700.4)},
    }
    table = train_loop.render("title", results, "nn.Dense").splitlines()
    assert table[0] == "title"
    assert table[-1].split() == [
        "FP8",
        "200",
        "2.00×",
        "1000",
        "0.50×",
        "400",
        "1.50×",
        "90",
        "13.2/400",
        "24.0/700",
    ]
