"""The suite's results files: names, the Markdown rendering and the run's note.

A run writes ``<out>/<gpu>/suite.json``, ``suite.md`` (``render_markdown``), the two plots
(``benchmarks/plot.py``) and ``RUN.md`` (``render_run_note``: command, date, GPU,
versions), replacing that GPU's previous run: benchmarks/results keeps the latest per GPU.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import statistics

KEY_FIELDS = ("shape", "dtype", "bias_dtype", "compute_type", "activation", "mode")


def row_key(row: dict) -> tuple:
    """What identifies a results row's case."""
    return tuple(row.get(field) for field in KEY_FIELDS)


def gpu_slug(device_kind: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200'."""
    slug = re.sub(r"[^a-z0-9._]+", "-", device_kind.lower())  # spaces and anything odd
    return slug.strip("-") or "device"


def results_stem(out_dir: str, device_kind: str) -> str:
    """``<out_dir>/<gpu slug>/suite``: one folder per GPU model, the latest run in it."""
    return os.path.join(out_dir, gpu_slug(device_kind), "suite")


def _f(value, digits=1) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _tf(value: float) -> str:
    """TFLOP/s with about three significant digits."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def table_key(row: dict) -> tuple:
    return (row["dtype"], row["bias_dtype"], row.get("compute_type"), row["mode"])


def table_title(key: tuple) -> str:
    dtype, bias_dtype, compute_type, mode = key
    ct = f", {compute_type}" if compute_type else ""
    return f"{dtype} ({bias_dtype} bias{ct}), {mode}"


def group_rows(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Rows by table (dtype, bias dtype, compute type, mode), in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(table_key(row), []).append(row)
    return groups


def ordered_unique(values) -> list:
    return list(dict.fromkeys(values))


def speedup(by_contender: dict[str, dict], contender: str, baseline: str = "xla") -> float | None:
    """baseline µs / contender µs for one case (above 1: the contender is faster)."""
    a, b = by_contender.get(contender), by_contender.get(baseline)
    if not a or not b or a["us"] is None or b["us"] is None:
        return None
    return b["us"] / a["us"]


def _markdown_table(rows: list[dict]) -> list[str]:
    names = ordered_unique(r["contender"] for r in rows)
    lines = _md_header("M×K→N", "act", *(f"{n} µs (TF/s)" for n in names), "fused/XLA speed-up")
    cases: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["shape"], r["activation"]), {})[r["contender"]] = r
    for (shape, act), by in cases.items():
        cells = []
        for name in names:
            r = by.get(name)
            cells.append("—" if r is None or r["us"] is None else f"{r['us']:.1f} ({_tf(r['tflops'])})")
        ratio = speedup(by, "jax_epilog")
        lines.append(_md_row(shape, act, *cells, f"{_f(ratio, 2)}{'×' if ratio else ''}"))
    reasons = ordered_unique(f"{r['contender']}: {r['skipped']}" for r in rows if r["skipped"])
    if reasons:
        lines += ["", "Skipped (—): " + "; ".join(reasons)]
    notes = ordered_unique(
        f"{r['contender']} {r['shape']} {r['activation']}: {r['note']}" for r in rows if r.get("note")
    )
    if notes:
        lines += ["", "Notes: " + "; ".join(notes)]
    return lines


def _md_row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _md_header(*names) -> list[str]:
    return [_md_row(*names), "|" + "---|" * len(names)]


def _ceiling_lines(ceiling: dict) -> list[str]:
    lines = ["## Machine ceiling (measured in this run)", ""]
    if "skipped" in ceiling:
        return [*lines, f"Not measured: {ceiling['skipped']}"]
    mm, copy = ceiling["matmul"], ceiling["copy"]
    return [
        *lines,
        *_md_header("what", "µs", "rate"),
        _md_row(f"{mm['shape']} {mm['dtype']} matmul, jit", _f(mm["us"]), f"{_f(mm['tflops'])} TF/s"),
        _md_row(
            f"{copy['what']}, {copy['bytes'] >> 20} MiB",
            _f(copy["us"]),
            f"{_f(copy['gbps'], 0)} GB/s (read+write)",
        ),
    ]


def _host_lines(host: dict) -> list[str]:
    lines = ["## Host cost per call", ""]
    if "skipped" in host:
        return [*lines, f"Not measured: {host['skipped']}"]
    lines += _md_header("what", "contender", "µs per call", "handler runs / calls", "handler host µs per run")
    for h in host["single"]:
        runs = f"{h['handler_runs']} / {h['calls']}"
        lines.append(_md_row(h["what"], h["contender"], _f(h["us_per_call"]), runs, _f(h["handler_host_us"])))
    lines += [""] + _md_header(
        "chain", "act", "weights", "fused_dense µs/step", "XLA µs/step", "XLA/fused", "handler runs / layer runs",
        "handler host µs per run", "command buffers",
    )  # fmt: skip
    for c in host["chain"]:
        ratio = f"{_f(c['xla_us'] / c['jax_epilog_us'], 2)}×"
        runs = f"{c['handler_runs']} / {c['layer_runs']}"
        chain = f"{c['layers']}× {c['shape']}"
        times = (_f(c["jax_epilog_us"]), _f(c["xla_us"]), ratio)
        weights = c.get("weights", "stacked")
        lines.append(
            _md_row(
                chain, c["activation"], weights, *times, runs, _f(c["handler_host_us"]), c["command_buffers"]
            )
        )
    return lines


def auto_vs_xla(rows: list[dict]) -> dict | None:
    """How "auto" compares with XLA's jit, and the noise to read that against.

    Where "auto" ran XLA's own program (our handler never ran), its row and the "xla" row
    time the same executable, interleaved: their difference is the measurement's noise.
    Where it fused a forward pass, it ran the very program of "jax_epilog" (the same custom
    call and plan), listed just before it: that pair's difference is noise too, and at a
    power-limited size the contender listed first has timed faster whichever it was.
    """
    pairs = {}
    for r in rows:
        if r["contender"] in ("xla", "jax_epilog_auto", "jax_epilog") and r["us"] is not None:
            pairs.setdefault(row_key(r), {})[r["contender"]] = r
    ratios, same_program, fused_pair = [], [], []
    for by in pairs.values():
        auto = by.get("jax_epilog_auto")
        if auto is None:
            continue
        label = f"{auto['shape']} {auto['dtype']} {auto['activation']} {auto['mode']}"
        fused = by.get("jax_epilog")
        if fused and auto["mode"] == "fwd" and auto.get("handler_runs"):
            fused_pair.append((auto["us"] / fused["us"], label))
        if "xla" not in by:
            continue
        ratio = by["xla"]["us"] / auto["us"]
        ratios.append((ratio, label))
        if auto.get("handler_runs") == 0:
            same_program.append(abs(ratio - 1))
    if not ratios:
        return None
    worst = min(ratios)
    gaps = [abs(ratio - 1) for ratio, _ in fused_pair]
    return {
        "cases": len(ratios),
        "worst_ratio": worst[0],
        "worst_case": worst[1],
        "same_program_cases": len(same_program),
        "noise_median": statistics.median(same_program) if same_program else None,
        "noise_max": max(same_program) if same_program else None,
        "fused_pair_cases": len(fused_pair),
        "fused_pair_median": statistics.median(gaps) if gaps else None,
        "fused_pair_max": max(fused_pair, key=lambda p: abs(p[0] - 1)) if fused_pair else None,
        "fused_pair_first_faster": sum(ratio > 1 for ratio, _ in fused_pair),
    }


def _auto_lines(summary: dict | None) -> list[str]:
    if not summary:
        return []
    s = summary
    lines = [
        '## "auto" against XLA', "",
        (f'Slowest "auto" case against XLA\'s jit: {s["worst_ratio"]:.3f}× ({s["worst_case"]}), '
         f'over {s["cases"]} cases (XLA µs / auto µs; below 1: auto is slower).'),
    ]  # fmt: skip
    if s["same_program_cases"]:
        lines.append(
            f'Noise: in {s["same_program_cases"]} cases "auto" ran XLA\'s own program (the handler never ran), '
            f"so its row and the xla row time one executable; they differ by {s['noise_median'] * 100:.1f}% "
            f"(median), {s['noise_max'] * 100:.1f}% at most."
        )
    if s.get("fused_pair_cases"):
        ratio, case = s["fused_pair_max"]
        lines.append(
            f'In {s["fused_pair_cases"]} forward cases "auto" fused the layer and so ran the program of '
            f"jax_epilog, listed just before it: they differ by {s['fused_pair_median'] * 100:.1f}% (median), "
            f"{abs(ratio - 1) * 100:.1f}% at most ({case}: auto / jax_epilog µs {ratio:.3f}); "
            f"jax_epilog, listed first, was the faster in {s['fused_pair_first_faster']}. "
            "Read ratios of that size as noise."
        )
    return lines


def render_markdown(results: dict) -> str:
    v, st = results["versions"], results.get("settings", {})
    shown = ("jax", "jaxlib", "python", "driver", "cublasLt", "nvmath", "cupy", "torch")
    options = v.get("xla_cublaslt_options") or {}
    also = ", ".join(f"{k}={val}" for k, val in options.items())
    flags = f"XLA_FLAGS '{v.get('XLA_FLAGS', '')}'" + (
        f" (xla_cublaslt: compiled with {also})" if also else ""
    )
    method = (
        f"Each cell: median µs per call over {st.get('samples', '?')} samples (each at least "
        f"{st.get('min_calls', '?')} back-to-back calls and {st.get('sample_s', 0) * 1e3:.0f} ms), then "
        "TFLOP/s in brackets (2·M·N·K per forward, 6·M·N·K with the backward). "
        "Speed-up: XLA jit µs / fused_dense µs (above 1: fused_dense is faster)."
    )
    lines = [
        f"# jax_epilog benchmark suite: {v.get('gpu')}, {results.get('date')}",
        "",
        f"Command: `{shlex.join(results['command'])}`",
        "",
        "Versions: " + ", ".join(f"{name} {v.get(name)!s}" for name in shown if name in v) + f"; {flags}",
        "",
        method,
    ]
    if results.get("policy"):
        lines[4:4] = [f"Policy changed for this run: {_policy_text(results['policy'])}", ""]
    for key, rows in group_rows(results["rows"]).items():
        lines += ["", f"## {table_title(key)}", "", *_markdown_table(rows)]
    lines += ["", *_auto_lines(auto_vs_xla(results["rows"]))]
    if results.get("ceiling"):
        lines += ["", *_ceiling_lines(results["ceiling"])]
    if results.get("host"):
        lines += ["", *_host_lines(results["host"])]
    if isinstance(results.get("fp8"), list):
        from benchmarks import fp8

        lines += ["", "## FP8 (benchmarks/fp8.py)", "", fp8.render(results["fp8"])]
    elif results.get("fp8"):
        lines += ["", "## FP8", "", f"Not measured: {results['fp8'].get('skipped')}"]
    return "\n".join(lines) + "\n"


def _policy_text(changes: dict) -> str:
    return ", ".join(f"{name}={value}" for name, value in changes.items())


def write_results(results: dict, stem: str) -> tuple[str, str]:
    """STEM.json, STEM.md and RUN.md beside them."""
    os.makedirs(os.path.dirname(stem) or ".", exist_ok=True)
    json_path, md_path = f"{stem}.json", f"{stem}.md"
    with open(json_path, "w") as fh:
        json.dump(results, fh, indent=1)
    with open(md_path, "w") as fh:
        fh.write(render_markdown(results))
    with open(os.path.join(os.path.dirname(stem) or ".", "RUN.md"), "w") as fh:
        fh.write(render_run_note(results, os.path.basename(stem)))
    return json_path, md_path


NOTE_VERSIONS = ("jax", "jaxlib", "nvmath", "cublasLt", "cupy", "torch", "python")


def render_run_note(results: dict, stem: str = "suite") -> str:
    """RUN.md: what ran, where and with what, and the files it wrote."""
    v = results["versions"]
    lines = [
        f"# Benchmark suite run: {v.get('gpu')}",
        "",
        f"- Date: {results.get('date')}",
        f"- GPU: {v.get('gpu')} (driver {v.get('driver')})",
        f"- Command: `{shlex.join(results['command'])}`",
        "- Versions: " + ", ".join(f"{name} {v[name]}" for name in NOTE_VERSIONS if v.get(name) is not None),
        f"- XLA_FLAGS: '{v.get('XLA_FLAGS', '')}'",
    ]
    if results.get("policy"):
        lines.append(f"- Policy changed for this run: {_policy_text(results['policy'])}")
    if v.get("commit"):
        lines.append(f"- jax_epilog checkout: {v['commit']}")
    if results.get("note"):
        lines.append(f"- Note: {results['note']}")
    lines += [
        "",
        f"Files: `{stem}.json` (every row, the settings, each plan's tuning), `{stem}.md` (the tables),",
        f"`{stem}-tflops.png` and `{stem}-speedup.png` (`python -m benchmarks.plot {stem}.json`).",
        "Method: benchmarks/README.md; findings: docs/performance.md.",
    ]
    return "\n".join(lines) + "\n"
