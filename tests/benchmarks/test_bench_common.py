"""What the benchmarks share: the --policy option, each plan's record, the handler-counting
clock, the results files."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ under plain `pytest` too

import jax_epilog
from benchmarks import common
from benchmarks.timing import Settings, measure
from jax_epilog._epilogs import EpilogSpec


def test_policy_values_parse_from_the_command_line():
    changes = common.policy_changes(
        ["row_bytes=1", "pad_min_work=2**30", "replay=False", "stack_rows=(256, 512)"]
    )
    assert changes == {"row_bytes": 1, "pad_min_work": 1 << 30, "replay": False, "stack_rows": (256, 512)}
    assert common.policy_changes(["auto_dtypes=('bfloat16',)"]) == {"auto_dtypes": ("bfloat16",)}
    assert common.policy_changes(None) == {}
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        common.policy_changes(["row_bytes"])


def test_policy_option_changes_the_policy_inside_its_block_only():
    before = jax_epilog.get_policy()
    with common.policy({"row_bytes": 1, "link_min_rows": 4096}):
        assert jax_epilog.get_policy().row_bytes == 1 and jax_epilog.get_policy().link_min_rows == 4096
    assert jax_epilog.get_policy() == before
    with common.policy({}):
        assert jax_epilog.get_policy() == before
    with pytest.raises(TypeError), common.policy({"no_such_field": 1}):
        pass


def test_plan_records_name_each_plan_its_choice_and_its_graphs():
    relu = EpilogSpec(
        256, 1024, 512, "RELU_BIAS", "COMPUTE_32F", "bfloat16", "bfloat16", "bfloat16"
    )  # m, n, k
    gelu = relu._replace(epilog="GELU_BIAS", m=8, n=24, k=16, ab_dtype="float16")
    plans = [
        SimpleNamespace(
            spec=relu, alignment=256, tuning=[4.3, 4.02, float("inf"), 4.19], replay_stats=(108, 0, True)
        ),
        SimpleNamespace(
            spec=gelu, alignment=16, tuning=None, replay_stats=(0, 64, False)
        ),  # planned in the handler
    ]
    assert common.tuning_choices(plans) == {
        "RELU_BIAS 256x512->1024 bfloat16 (align 256)": "candidate 1 of 4 at 4.02 µs; next best 4.19 µs"
    }
    assert common.replay_states(plans) == {
        "RELU_BIAS 256x512->1024 bfloat16 (align 256)": "108 graphs kept, 0 dropped, replaying",
        "GELU_BIAS 8x16->24 float16 (align 16)": "0 graphs kept, 64 dropped, replay off",
    }


def test_no_plans_are_recorded_where_the_cuda_path_cannot_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax_epilog.cuda.plan", None)  # as without nvmath-python
    monkeypatch.setitem(sys.modules, "jax_epilog.cuda.tuning", None)
    assert common.current_plans() == [] and common.plan_states() == {}
    common.force_candidate(3)  # nothing to force: no error


def test_handler_clock_counts_nothing_on_the_xla_path():
    clock = common.HandlerClock()
    w, x = jnp.ones((4, 4), jnp.float32), jnp.ones((2, 4), jnp.float32)
    f = jax.jit(lambda x: jax_epilog.fused_dense(x, w, None, implementation="xla"))
    t = measure(lambda i: f(x), clock, Settings(samples=2, min_calls=2, sample_s=0.0, warmup=1))
    assert t.us > 0 and clock.runs == 0 and clock.host_us is None


@pytest.mark.gpu
def test_handler_clock_counts_the_fused_calls_runs():
    clock = common.HandlerClock()
    x, w, b = common.layer_inputs(64, 64, 64, np.random.default_rng(0))
    f = jax.jit(common.single_layers("relu")["fused"])
    t = measure(lambda i: f(x, w, b), clock, Settings(samples=2, min_calls=4, sample_s=0.0, warmup=1))
    assert clock.runs == t.calls and clock.host_us > 0  # one handler run per call outside command buffers


def test_write_results_and_ratio_tables(tmp_path):
    common.write_results(str(tmp_path / "new"), "x", [{"a_us": 2.0, "xla_us": 3.0}], "| a |\n")
    data = json.loads((tmp_path / "new" / "x.json").read_text())
    assert data["rows"] == [{"a_us": 2.0, "xla_us": 3.0}] and data["versions"]["jax"] == jax.__version__
    assert "commit" in data["versions"] and (tmp_path / "new" / "x.md").read_text() == "| a |\n"
    table = common.ratio_table(
        [{"xla_us": 3.0, "a_us": 2.0, "s": "8x8"}], ("xla", "a"), {"shape": lambda r: r["s"]}
    )
    assert table.splitlines() == [
        "| shape | xla µs | a µs | XLA/a |",
        "|---|---|---|---|",
        "| 8x8 | 3.0 | 2.0 | 1.50× |",
    ]


def test_a_listing_is_one_preformatted_block(tmp_path):
    from benchmarks.common import write_listing

    write_listing(None, "nothing", ["a"])  # no folder: nothing written
    write_listing(str(tmp_path / "out"), "probe", ["# GPU", "problem  ran"])
    assert (tmp_path / "out" / "probe.md").read_text() == "```\n# GPU\nproblem  ran\n```\n"
    assert list(tmp_path.iterdir()) == [tmp_path / "out"]


def test_a_probes_command_line_prints_and_writes_its_lines(tmp_path, capsys):
    from benchmarks.common import listing_main

    lines = listing_main(
        ["--out", str(tmp_path)], "A probe.\n\nMore.", "probe", lambda: iter(["# GPU", "x  ran"])
    )
    assert lines == ["# GPU", "x  ran"] and capsys.readouterr().out == "# GPU\nx  ran\n"
    assert (tmp_path / "probe.md").read_text() == "```\n# GPU\nx  ran\n```\n"
