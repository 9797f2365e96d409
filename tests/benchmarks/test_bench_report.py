"""The results files: the suite's Markdown, its noise summary, RUN.md, the plots, the
forward benchmark's tables, and the runs kept in benchmarks/results."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # benchmarks/ under plain `pytest` too

from benchmarks import report, suite_report
from benchmarks.cases import TF32, Case
from benchmarks.run import make_row
from benchmarks.sections import command_buffer_verdict
from benchmarks.timing import Timing

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _row(case, contender, us, skipped=None, **extra):
    return make_row(case, contender, Timing(us, 5, 20, 112) if us else None, skipped=skipped, **extra)


def _results():
    a, b = (
        Case(4, 8, 16, "float32", "float32", "relu", "fwd"),
        Case(4, 8, 16, "float32", "float32", "relu", "fwd+bwd", TF32),
    )
    rows = [
        _row(a, "jax_epilog", 10.0, note="fell back"),
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
    }
    single |= {"handler_runs": 100, "handler_host_us": 12.5}
    chain = {
        "layers": 16,
        "shape": "256x1024->1024",
        "activation": "relu",
        "jax_epilog_us": 100.0,
        "xla_us": 120.0,
    }
    chain |= {"handler_runs": 3, "layer_runs": 1600, "handler_host_us": 20.0}
    chain |= {"command_buffers": command_buffer_verdict(3, 1600, True)}
    return {
        "date": "2026-01-02",
        "versions": {
            "gpu": "NVIDIA H200",
            "jax": "0.11.2",
            "XLA_FLAGS": "",
            "driver": "580.1",
            "commit": "abc",
        },
        "command": ["python", "-m", "benchmarks.run", "--quick"],
        "settings": {"samples": 5, "min_calls": 20, "sample_s": 0.02},
        "rows": rows,
        "ceiling": {
            "matmul": {"shape": "8192x8192x8192", "dtype": "bfloat16", "us": 1900.0, "tflops": 578.7},
            "copy": {"what": "jit(v + 1), float32", "bytes": 1 << 30, "us": 500.0, "gbps": 4294.97},
        },
        "host": {"single": [single], "chain": [chain]},
    }


def test_markdown_rendering():
    md = suite_report.render_markdown(_results())
    assert md.startswith("# jax_epilog benchmark suite: NVIDIA H200, 2026-01-02\n")
    assert "`python -m benchmarks.run --quick`" in md and "Policy changed" not in md
    assert "## float32 (float32 bias), fwd\n" in md and f"## float32 (float32 bias, {TF32}), fwd+bwd" in md
    assert "| 4x8->16 | relu | 10.0 (0.00) | 25.0 (0.00) | — | — | 2.50× |" in md
    assert "| 4x8->16 | relu | 40.0 (0.00) | 30.0 (0.00) | 0.75× |" in md
    assert "xla_cublaslt: flag refused" in md and "torch_linear: torch is not importable" in md
    assert "578.7 TF/s" in md and "4295 GB/s" in md and "| 3 / 1600 |" in md
    assert (
        "| 16× 256x1024->1024 | relu | stacked | 100.0 | 120.0 | 1.20× |" in md
    )  # results without "weights"
    assert "Notes: jax_epilog 4x8->16 relu: fell back" in md
    changed = suite_report.render_markdown(
        _results() | {"policy": {"row_bytes": "1"}, "ceiling": {"skipped": "x"}}
    )
    assert "Policy changed for this run: row_bytes=1" in changed and "Not measured: x" in changed


def test_auto_vs_xla_reads_noise_from_identical_programs():
    case = Case(8, 8, 8, "bfloat16", "bfloat16", "relu", "fwd")
    gelu, none = case._replace(activation="gelu"), case._replace(activation="none")
    rows = [
        _row(case, "xla", 100.0), _row(case, "jax_epilog_auto", 102.0, handler_runs=0),  # XLA's program twice
        _row(gelu, "xla", 150.0), _row(gelu, "jax_epilog_auto", 120.0, handler_runs=40),  # fused
        _row(none, "xla", 10.0), _row(none, "jax_epilog_auto", None, handler_runs=0),  # not measured
    ]  # fmt: skip
    s = suite_report.auto_vs_xla(rows)
    assert s["cases"] == 2 and s["same_program_cases"] == 1 and s["fused_pair_cases"] == 0
    assert s["worst_ratio"] == pytest.approx(100 / 102) and "relu" in s["worst_case"]
    assert s["noise_max"] == pytest.approx(2 / 102)
    assert suite_report.auto_vs_xla([_row(case, "xla", 1.0)]) is None
    # Where "auto" fused the forward, it and jax_epilog ran one program: another noise reading.
    rows += [
        _row(gelu, "jax_epilog", 125.0, handler_runs=40),
        _row(case, "jax_epilog", 99.0, handler_runs=40),
    ]
    s = suite_report.auto_vs_xla(rows)
    assert s["fused_pair_cases"] == 1 and s["fused_pair_first_faster"] == 0
    assert s["fused_pair_median"] == pytest.approx(5 / 125)
    assert s["fused_pair_max"] == (pytest.approx(120 / 125), "8x8->8 bfloat16 gelu fwd")
    text = "\n".join(suite_report._auto_lines(s))
    assert "In 1 forward cases" in text and "4.0% (median)" in text and "auto / jax_epilog µs 0.960" in text


def test_results_go_to_one_folder_per_gpu(tmp_path):
    assert suite_report.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert suite_report.gpu_slug("NVIDIA GeForce RTX 4090 (x/y)") == "nvidia-geforce-rtx-4090-x-y"
    stem = suite_report.results_stem(str(tmp_path), "NVIDIA H200")
    assert stem == str(tmp_path / "nvidia-h200" / "suite")
    json_path, md_path = suite_report.write_results(_results() | {"policy": {"replay": "False"}}, stem)
    assert json.loads(Path(json_path).read_text())["rows"][0]["contender"] == "jax_epilog"
    assert Path(md_path).read_text().startswith("# jax_epilog benchmark suite")
    note = (tmp_path / "nvidia-h200" / "RUN.md").read_text()
    assert "- Date: 2026-01-02" in note and "- GPU: NVIDIA H200 (driver 580.1)" in note
    assert "- Command: `python -m benchmarks.run --quick`" in note and "jax 0.11.2" in note
    assert "- Policy changed for this run: replay=False" in note and "checkout: abc" in note


def test_plots(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import plot

    path = tmp_path / "suite.json"
    path.write_text(json.dumps(_results()))
    written = [Path(p) for p in plot.make_plots(str(path), str(tmp_path / "plots"))]
    assert written == [tmp_path / "plots" / "suite-tflops.png", tmp_path / "plots" / "suite-speedup.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    labels, series = plot.speedup_series(_results()["rows"][:4])
    assert labels == ["4x8->16\nrelu"] and series == {"jax_epilog": [2.5]}


def test_forward_report_renders_single_layers_and_chains(tmp_path):
    single = {"shape": "8x8->8", "dtype": "bfloat16/bfloat16 bias", "activation": "gelu", "fused_us": 50.0}
    single |= {
        "xla_us": 75.0,
        "fused_in4_us": 40.0,
        "xla_in4_us": 60.0,
        "nvmath_us": None,
        "nvmath_host_us": None,
    }
    single |= {"handler_host_us": 5.0}
    chain = {
        "chain": "2x 5x3->3",
        "activation": "relu",
        "fused_us": 80.0,
        "xla_us": 100.0,
        "handler_calls": 4,
    }
    chain |= {"layer_runs": 400, "handler_host_us": 20.0, "fused_released_us": 75.0, "xla_released_us": 99.0}
    chain |= {"fused_donated_us": 70.0, "xla_donated_us": 91.0}
    path = tmp_path / "forward-x.json"
    path.write_text(
        json.dumps(
            {
                "label": "x",
                "versions": {"gpu": "H200", "jax": "0.11.2", "XLA_FLAGS": ""},
                "rows": [single, chain],
            }
        )
    )
    table = report.render([str(path)])
    assert (
        "| 8x8->8 | bfloat16/bfloat16 bias | gelu | 50.0 | 75.0 | 1.50× | 40.0 / 60.0 | 1.50× | — (—) | — |"
        in table
    )
    assert "75.0 / 99.0 | 1.32×" in table and "70.0 / 91.0 | 1.30×" in table and "| 4 / 400 |" in table


SUITE_FILES = {"RUN.md", "suite.json", "suite.md", "suite-tflops.png", "suite-speedup.png"}
FP8_FILES = {"fp8.json", "fp8.md", "fp8.png", "train-fp8.txt", "train-fp8.png"}  # (an FP8 run)


@pytest.mark.parametrize("gpu", ["nvidia-h200", "nvidia-h100-80gb-hbm3"])
def test_kept_suite_runs_are_whole_and_their_tables_are_their_json(gpu):
    folder = BENCHMARKS / "results" / gpu
    names = {p.name for p in folder.iterdir()}
    assert names in (SUITE_FILES, SUITE_FILES | FP8_FILES)
    results = json.loads((folder / "suite.json").read_text())
    assert suite_report.gpu_slug(results["versions"]["gpu"]) == gpu
    assert results["command"][:4] == ["python", "-m", "benchmarks.run", "--quick"]
    assert suite_report.render_markdown(results) == (folder / "suite.md").read_text()
    note = (folder / "RUN.md").read_text()
    assert f"- Date: {results['date']}" in note and "- Command: `python -m benchmarks.run --quick" in note
    if FP8_FILES <= names:
        from benchmarks import fp8

        record = json.loads((folder / "fp8.json").read_text())
        assert suite_report.gpu_slug(record["device"]) == gpu
        want = f"FP8 rows on {record['device']}, jax {record['jax']}\n\n{fp8.render(record['rows'])}\n"
        assert (folder / "fp8.md").read_text() == want
        assert "`python -m benchmarks.fp8 --quick" in note and "--size large --fp8" in note


def test_results_keep_the_latest_run_per_gpu_and_benchmarks_stay_small():
    """One folder per GPU model, holding one suite run (a new run replaces it)."""
    results = BENCHMARKS / "results"
    assert {"nvidia-h100-80gb-hbm3", "nvidia-h200"} <= {p.name for p in results.iterdir()}
    for folder in results.iterdir():
        assert folder.is_dir() and folder.name == suite_report.gpu_slug(folder.name), folder
        assert {p.name for p in folder.iterdir()} <= SUITE_FILES | FP8_FILES
    files = [p for p in BENCHMARKS.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(p.stat().st_size for p in files) < 3 << 20
