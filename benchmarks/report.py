"""Render benchmark JSON files (from benchmarks.forward) as Markdown tables.

python -m benchmarks.report RESULTS.json [...]
"""

from __future__ import annotations

import json
import sys


def _f(value, digits=1):
    return "—" if value is None else f"{value:.{digits}f}"


def _pair(row: dict, variant: str) -> str:
    """ "fused / XLA µs | XLA/fused×" for a chain variant; "— | —" where the file predates it."""
    fused, xla = row.get(f"fused_{variant}_us"), row.get(f"xla_{variant}_us")
    return f"{_f(fused)} / {_f(xla)} | {_f(xla / fused, 2)}×" if fused and xla else "— | —"


def render(paths: list[str]) -> str:
    lines = []
    for path in paths:
        with open(path) as fh:
            data = json.load(fh)
        v = data["versions"]
        lines.append(
            f"### {data['label']}: {v['gpu']}, jax {v['jax']}, nvmath {v.get('nvmath')}, "
            f"cuBLASLt {v.get('cublasLt')}, cupy {v.get('cupy')}, XLA_FLAGS='{v['XLA_FLAGS']}'"
        )
        single = [r for r in data["rows"] if "shape" in r]
        if single:
            lines += [
                "",
                (
                    "| M×K→N | dtype | act | fused_dense µs | XLA jit µs | XLA/fused "
                    "| in 4: fused / XLA µs | in 4: XLA/fused | nvmath direct µs (host) "
                    "| nvmath/fused (in 4) | handler host µs |"
                ),
                "|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in single:
                nv_ratio = r["nvmath_us"] / r["fused_in4_us"] if r["nvmath_us"] else None
                lines.append(
                    f"| {r['shape']} | {r['dtype']} | {r['activation']} | {_f(r['fused_us'])} | {_f(r['xla_us'])} "
                    f"| {_f(r['xla_us'] / r['fused_us'], 2)}× | {_f(r['fused_in4_us'])} / {_f(r['xla_in4_us'])} "
                    f"| {_f(r['xla_in4_us'] / r['fused_in4_us'], 2)}× | {_f(r['nvmath_us'])} ({_f(r['nvmath_host_us'])}) "
                    f"| {_f(nv_ratio, 2)}{'×' if nv_ratio else ''} | {_f(r['handler_host_us'])} |"
                )
        chain = [r for r in data["rows"] if "chain" in r]
        if chain:
            # With command buffers off a 256-row chain is bound by host time, so the step time
            # difference per layer is what one fused_dense call costs the host beyond XLA's op.
            # "result released": the previous step's result deleted before the next call, and
            # "x donated": x = chain(x, ...) with x's buffer donated; either way every step runs
            # on the same buffers (XLA then launches its recorded graph without updating it).
            lines += [
                "",
                (
                    "| chain | act | fused_dense µs/step | XLA µs/step | XLA/fused "
                    "| (fused − XLA) / layers µs | result released: fused / XLA µs "
                    "| result released: XLA/fused "
                    "| x donated: fused / XLA µs | x donated: XLA/fused "
                    "| handler runs / layer runs | handler host µs/run |"
                ),
                "|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in chain:
                depth = int(r["chain"].split("x")[0])
                lines.append(
                    f"| {r['chain']} | {r['activation']} | {_f(r['fused_us'])} | {_f(r['xla_us'])} "
                    f"| {_f(r['xla_us'] / r['fused_us'], 2)}× | {_f((r['fused_us'] - r['xla_us']) / depth)} "
                    f"| {_pair(r, 'released')} | {_pair(r, 'donated')} "
                    f"| {r['handler_calls']} / {r['layer_runs']} | {_f(r['handler_host_us'])} |"
                )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render(sys.argv[1:]))
