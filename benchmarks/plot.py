"""Plots of a benchmark suite results file (from benchmarks.run).

    python -m benchmarks.plot RESULTS.json [--out DIR]

Writes ``<stem>-tflops.png`` (TFLOP/s of every contender, grouped by case) and
``<stem>-speedup.png`` (each contender's speed-up over XLA's default jit), one panel per
table of the Markdown file (dtype and mode), next to RESULTS.json unless --out says where.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from benchmarks.suite_report import group_rows, ordered_unique, speedup, table_title


def _by_case(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """{"<shape>\\n<activation>" (a bar group's label): {contender: row}}, in first-seen order."""
    cases: dict[str, dict[str, dict]] = {}
    for r in rows:
        cases.setdefault(f"{r['shape']}\n{r['activation']}", {})[r["contender"]] = r
    return cases


def _tflops(by_contender: dict[str, dict], name: str) -> float:
    row = by_contender.get(name)
    return math.nan if row is None or row["tflops"] is None else row["tflops"]


def tflops_series(rows: list[dict]) -> tuple[list[str], dict[str, list[float]]]:
    """Case labels, and per contender with any measurement its TFLOP/s (NaN where skipped)."""
    cases = _by_case(rows)
    measured = ordered_unique(r["contender"] for r in rows if r["tflops"] is not None)
    return list(cases), {name: [_tflops(by, name) for by in cases.values()] for name in measured}


def speedup_series(rows: list[dict]) -> tuple[list[str], dict[str, list[float]]]:
    """Case labels, and per contender other than "xla" its XLA µs / own µs (NaN if unknown)."""
    cases = _by_case(rows)
    measured = ordered_unique(r["contender"] for r in rows if r["us"] is not None and r["contender"] != "xla")
    series = {name: [speedup(by, name) or math.nan for by in cases.values()] for name in measured}
    return list(cases), series


def _grouped_bars(ax, labels: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        offsets = [j - 0.4 + width * (i + 0.5) for j in range(len(labels))]
        ax.bar(offsets, values, width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def _figure(results: dict, series_of, ylabel: str, path: str, baseline: float | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(group_rows(results["rows"]).items())
    panels = max(1, len(groups))
    widest = max((len({(r["shape"], r["activation"]) for r in rows}) for _, rows in groups), default=1)
    fig, axes = plt.subplots(panels, 1, figsize=(max(8, 1.3 * widest), 3.6 * panels), squeeze=False)
    for ax, (key, rows) in zip(axes[:, 0], groups):
        labels, series = series_of(rows)
        _grouped_bars(ax, labels, series)
        if baseline is not None:
            ax.axhline(baseline, color="black", linewidth=0.8)
        ax.set_title(table_title(key), fontsize=9)
        ax.set_ylabel(ylabel)
        if series:
            ax.legend(fontsize=7, ncol=4)
    fig.suptitle(f"{results['versions'].get('gpu')}, {results.get('date')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(results_path: str, out_dir: str | None = None) -> list[str]:
    """Write both plots; raises ImportError when matplotlib is missing."""
    import matplotlib  # noqa: F401 -- fail before doing anything else

    with open(results_path) as fh:
        results = json.load(fh)
    stem = os.path.splitext(os.path.basename(results_path))[0]
    out_dir = out_dir or os.path.dirname(results_path) or "."
    os.makedirs(out_dir, exist_ok=True)
    paths = [
        _figure(results, tflops_series, "TFLOP/s", os.path.join(out_dir, f"{stem}-tflops.png")),
        _figure(
            results, speedup_series, "XLA jit µs / µs", os.path.join(out_dir, f"{stem}-speedup.png"), 1.0
        ),
    ]
    if isinstance(results.get("fp8"), list) and results["fp8"]:
        from benchmarks import fp8

        paths.append(fp8.plot(results["fp8"], os.path.join(out_dir, f"{stem}-fp8.png")))
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", help="a JSON file written by python -m benchmarks.run")
    parser.add_argument("--out", help="folder for the PNG files (default: the JSON file's)")
    args = parser.parse_args(argv)
    for path in make_plots(args.results, args.out):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
