"""The benchmark suite: every contender on every case, in one command.

    python -m benchmarks.run [--quick | --full] [--dtype D ...] [--out DIR] [--policy FIELD=VALUE ...]
                             [--dry-run] [--cpu-smoke]

Writes ``<out>/<gpu>/suite.json``, its Markdown rendering (``suite.md``), two plots when
matplotlib is importable (``benchmarks/plot.py``) and ``RUN.md`` (command, date, GPU,
versions). The cases are ``benchmarks/cases.py``'s plans, the contenders
``benchmarks/contenders.py``'s, the ceiling and host-cost sections
``benchmarks/sections.py``'s; the method is in benchmarks/README.md.

``--dtype`` keeps the cases whose operands have one of the dtypes named: ``--full``
outlasts a 10-minute device session, so it runs in parts. ``--policy`` runs the whole suite
with ``jax_epilog.Policy`` fields changed. ``--dry-run`` lists the measurements and an H200
time estimate without timing anything; ``--cpu-smoke`` divides every dimension by 64 and
takes two samples of two calls, so the whole code path runs on a CPU (torch and nvmath rows
then say why they were skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import subprocess
import sys
import warnings
from dataclasses import asdict

import jax

from benchmarks import contenders as con
from benchmarks.cases import DTYPES, Case, estimate_s, estimate_total_s, input_copies, plan, shrink, tflops
from benchmarks.common import (
    Progress,
    add_policy_option,
    failure_reason,
    plan_states,
    policy,
    policy_changes,
    versions,
)
from benchmarks.sections import N_CEILING, N_HOST, bench_ceiling, bench_host, guarded
from benchmarks.suite_report import _tf, auto_vs_xla, results_stem, write_results
from benchmarks.timing import FULL, QUICK, SMOKE, Settings, Timing, measure_interleaved
from jax_epilog import FastPathWarning

ROW_CASE_FIELDS = ("shape", "m", "k", "n", "dtype", "bias_dtype", "compute_type", "activation", "mode")


def make_row(
    case: Case, contender: str, timing: Timing | None = None, skipped: str | None = None, **extra
) -> dict:
    row = {field: getattr(case, field) for field in ROW_CASE_FIELDS}
    row.update(contender=contender, us=None, samples=0, tflops=None, skipped=skipped)
    if timing is not None:
        row.update(us=timing.us, samples=timing.samples, iters=timing.iters, tflops=tflops(case, timing.us))
    return row | extra


def _reason(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, con.Skip) else failure_reason(exc)


def run_one(case: Case, contender: str, inputs: con.Inputs, settings: Settings) -> dict:
    """Time one contender on one case; any failure becomes a row with its reason."""
    return run_group(case, [contender], inputs, settings)[0]


def run_group(case: Case, names: list[str], inputs: con.Inputs, settings: Settings) -> list[dict]:
    """Time contenders on one case, all of them interleaved (benchmarks/timing.py). A
    contender that cannot start (not importable, refused) becomes a row with its reason; a
    group that fails while timing is retried one contender at a time, so one failure does
    not take the others' rows with it."""
    rows: dict[str, dict] = {}
    try:
        with contextlib.ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FastPathWarning)
            jax_names = [name for name in names if name not in con.BENCH]
            timed = dict(zip(jax_names, con.jax_timed(case, jax_names, inputs) if jax_names else []))
            for name in names:
                if name in con.BENCH:
                    try:
                        timed[name] = stack.enter_context(con.BENCH[name](case, name, inputs))
                    except Exception as exc:  # noqa: BLE001 -- this contender's row says why
                        rows[name] = make_row(case, name, skipped=_reason(exc))
            running = [name for name in names if name in timed]
            timings = measure_interleaved([timed[name] for name in running], settings)
            fell_back = [str(w.message) for w in caught if issubclass(w.category, FastPathWarning)]
        for name, timing in zip(running, timings):
            extra = {}
            if name.startswith("jax_epilog"):
                extra["handler_runs"] = timed[name][1].runs
                if fell_back and name == "jax_epilog":  # the one that always asks for the fused path
                    extra["note"] = fell_back[0]
            rows[name] = make_row(case, name, timing, **extra)
    except Exception as exc:  # noqa: BLE001 -- one failing contender must not end the run
        if len(names) > 1:
            return [row for name in names for row in run_group(case, [name], inputs, settings)]
        return [make_row(case, names[0], skipped=_reason(exc))]
    return [rows[name] for name in names]


def _ct(case: Case) -> str:
    return f" {case.compute_type}" if case.compute_type else ""


def describe(row: dict) -> str:
    if row["skipped"]:
        return f"skipped: {row['skipped']}"
    return f"{row['us']:.1f} µs, {_tf(row['tflops'])} TF/s ({row['samples']} x {row['iters']} calls)"


def _case_group(todo: list[tuple[Case, str]], start: int) -> list[str]:
    """The contenders of todo[start]'s case that follow it: they are timed together."""
    case, names = todo[start][0], []
    for other, name in todo[start:]:
        if other != case:
            break
        names.append(name)
    return names


def run_jobs(todo: list[tuple[Case, str]], settings: Settings, progress: Progress) -> list[dict]:
    """Every job, in order; a case's consecutive contenders are timed interleaved."""
    rows, inputs, i = [], None, 0
    while i < len(todo):
        case = todo[i][0]
        problem = (case.m, case.k, case.n, case.dtype, case.bias_dtype)
        if inputs is None or inputs.problem != problem:
            # Host data is reused across dtypes; the last problem's device copies are
            # dropped before the next are made.
            host = inputs.host if inputs is not None and inputs.problem[:3] == problem[:3] else None
            inputs = None
            inputs = con.Inputs(case, host)
        names = _case_group(todo, i)
        for row in run_group(case, names, inputs, settings):
            rows.append(row)
            label = f"{case.shape} {case.dtype}{_ct(case)} {case.activation} {case.mode} {row['contender']}"
            progress.report(label, describe(row))
        i += len(names)
    return rows


def environment() -> dict:
    import jaxlib

    info = versions() | {
        "jaxlib": jaxlib.__version__,
        "platform": platform.platform(),
        "driver": driver_version(),
    }
    try:
        import torch

        info["torch"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except ImportError:
        info["torch"] = None
    return info


def driver_version() -> str | None:
    query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
    try:
        smi = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = smi.stdout.split()
    return lines[0] if lines else None


def summary(todo: list[tuple[Case, str]], settings: Settings) -> str:
    return (
        f"{len(todo)} measurements + {N_CEILING} ceiling + {N_HOST} host-cost; estimated H200 wall "
        f"time ~{estimate_total_s(todo, settings) / 60:.1f} min"
    )


def print_plan(todo: list[tuple[Case, str]], settings: Settings) -> None:
    for i, (case, contender) in enumerate(todo, 1):
        what = f"{case.shape} {case.dtype}/{case.bias_dtype} bias{_ct(case)} {case.activation} {case.mode}"
        est = estimate_s(case, contender, settings)
        print(f"[{i}/{len(todo)}] {what} {contender} (~{est:.2f} s, {input_copies(case)} input sets)")
    print(summary(todo, settings))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the short plan (default; ~2 min on an H200)")
    size.add_argument("--full", action="store_true", help="every shape, dtype and activation (~9 min)")
    parser.add_argument(
        "--out", default="benchmarks/results", help="folder for the results (default: %(default)s)"
    )
    parser.add_argument(
        "--dtype", nargs="+", choices=DTYPES, default=DTYPES, help="only the cases of these operand dtypes"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="list the measurements and an estimate; time nothing"
    )
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="shapes / 64, 2 samples of 2 calls: runs on a CPU"
    )
    parser.add_argument(
        "--fp8", action="store_true", help="also the FP8 rows (benchmarks/fp8.py: ~3 min more on an H100)"
    )
    add_policy_option(parser)
    return parser.parse_args(argv)


def measure_all(todo, settings: Settings, scale: int, with_fp8: bool = False) -> dict:
    """The ceiling, every case, the host-cost section and (``with_fp8``) the FP8 rows."""
    progress = Progress(len(todo) + N_CEILING + N_HOST)
    on_gpu = jax.devices()[0].platform == "gpu"
    ceiling = guarded(bench_ceiling, settings, scale, progress)
    rows = run_jobs(todo, settings, progress)
    host = guarded(bench_host, settings, scale, progress, on_gpu)
    measured = {"rows": rows, "auto_vs_xla": auto_vs_xla(rows), "ceiling": ceiling, "host": host}
    if with_fp8:
        from benchmarks import fp8

        measured["fp8"] = guarded(fp8.measure, settings, scale)
    return measured | {"plans": plan_states()}


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    settings = SMOKE if args.cpu_smoke else FULL if args.full else QUICK
    scale = 64 if args.cpu_smoke else 1
    todo = con.jobs([shrink(case, scale) for case in plan(args.full) if case.dtype in args.dtype])
    if args.dry_run:
        print_plan(todo, settings)
        return None
    print(summary(todo, settings), flush=True)
    changes = policy_changes(args.policy)
    with policy(changes):
        measured = measure_all(todo, settings, scale, args.fp8)
    versions_now = environment() | {"xla_cublaslt_options": con.CUBLASLT_OPTIONS}
    results = {
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
        "versions": versions_now,
        "command": ["python", "-m", "benchmarks.run", *argv],
        "settings": asdict(settings),
        "policy": {name: repr(value) for name, value in changes.items()},
        **measured,
    }
    json_path, md_path = write_results(results, results_stem(args.out, str(jax.devices()[0].device_kind)))
    print(f"wrote {json_path}\nwrote {md_path}", flush=True)
    try:
        from benchmarks import plot

        for path in plot.make_plots(json_path):
            print(f"wrote {path}", flush=True)
    except Exception as exc:  # noqa: BLE001 -- ImportError without matplotlib; the results are saved
        hint = "once matplotlib is installed" if isinstance(exc, ImportError) else "to retry"
        print(f"no plots ({failure_reason(exc)}); {hint}: python -m benchmarks.plot {json_path}", flush=True)
    return results


if __name__ == "__main__":
    main()
