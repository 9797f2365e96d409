"""Probe: how wide should a padded row be? 16 bytes (today's ``_ROW_BYTES``) or more?

    python -m benchmarks.probes.pad_width [--out DIR] [--widths 16 32 64 128 256] [--case M K N ACT MODE ...]

A fused call on a large problem whose K or N is not a multiple of 8 (bf16) pads them to
whole ``_primitive._ROW_BYTES`` rows (since 2026-12-05 (ah)). Above "auto"'s fused floor, a
ReLU layer whose N pads read about 8% slower padded and fused than XLA's expression on the
same padded rows (2026-12-06 (ak), (al)): 182 against 167 µs at 8192x1024->4097, where the
aligned 8192x1024->4096 layer takes about 117 µs either way. This times, per case and per
row width W (bytes), interleaved (the suite's inputs and method, ``benchmarks.run``):

- ``fused@W``: ``fused_dense(implementation="cublaslt")`` with K and N padded to W bytes
  (``_ROW_BYTES`` and ``_WIDE_ROW_BYTES``, any N; at any size: ``_PAD_MIN_ROWS = _PAD_MIN_WORK = 0``);
- ``auto@W``: ``fused_dense``'s default with that width (what "auto" runs: fused or XLA's
  expression on the padded rows, and its derivatives there);
- ``xla@W``: ``jax.jit`` of ``act(x @ w + b)`` on the operands padded to W bytes, cut back;
- ``xla``: the expression as it is;

forward, or forward + backward (``benchmarks.probes.row_padding``'s losses). A call with
an aux keeps the aux's layout whatever W (``_primitive._padded_rows``): a GELU forward with
its aux pads N to 8 elements only, so "fused@W" fwd+bwd GELU rows time 16-byte N rows
(before 2026-12-06 (an) they padded N to W and wrote the aux out of its bounds: void).
"""

from __future__ import annotations

import argparse

import jax

from benchmarks import run
from benchmarks.forward import write_results
from benchmarks.probes import row_padding
from benchmarks.probes.row_padding import knobs
from benchmarks.timing import WallClock, measure_interleaved

CASES = [  # (M, K, N, activation, mode); bf16 with a bf16 bias
    (8192, 1024, 4096, "relu", "fwd"),  # aligned at every width: the control
    (8192, 1024, 4097, "relu", "fwd"),
    (8192, 1024, 4097, "gelu", "fwd"),
    (8192, 1024, 4097, "none", "fwd"),
    (8192, 1020, 4096, "relu", "fwd"),
    (8192, 4097, 1024, "gelu", "fwd"),
    (2048, 1024, 4097, "gelu", "fwd"),
    (8192, 1024, 4097, "gelu", "fwd+bwd"),
    (8192, 1024, 4097, "relu", "fwd+bwd"),
]
WIDTHS = (16, 64, 128, 256)
KINDS = ("fused", "auto", "xla")
# Each kind (and "plain": XLA's expression as it is) is a row_padding contender's program;
# this probe sets the row width around it.
_CONTENDERS = {"fused": "padded", "auto": "auto", "xla": "xla_padded", "plain": "xla"}


def program(case: run.Case, kind: str):
    """The un-jitted function ``kind`` (fused, auto, xla: padded; plain: as it is) times."""
    return row_padding.program(case, _CONTENDERS[kind])


def bench(case: run.Case, widths) -> dict:
    sets = run.Inputs(case).jax()
    compiled = {}
    for width in widths:
        for kind in KINDS:
            floor = {} if kind == "auto" else {"_PAD_MIN_ROWS": 0, "_PAD_MIN_WORK": 0}
            with knobs(_ROW_BYTES=width, _WIDE_ROW_BYTES=width, _WIDE_MIN_N=0, **floor):
                compiled[f"{kind}@{width}"] = jax.jit(program(case, kind)).lower(*sets[0]).compile()
    compiled["xla"] = jax.jit(program(case, "plain")).lower(*sets[0]).compile()
    timings = measure_interleaved(
        [(lambda i, p=p: p(*sets[i % len(sets)]), WallClock()) for p in compiled.values()], run.QUICK
    )
    row = {"shape": case.shape, "activation": case.activation, "mode": case.mode}
    return row | {f"{name}_us": t.us for name, t in zip(compiled, timings)}


def table(rows: list[dict], widths) -> str:
    names = [f"{kind}@{w}" for w in widths for kind in KINDS] + ["xla"]
    lines = [
        "| M×K→N | act | mode | " + " | ".join(f"{n} µs" for n in names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        cells = [r["shape"], r["activation"], r["mode"], *(f"{r[f'{n}_us']:.1f}" for n in names)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS), help="row widths in bytes")
    parser.add_argument(
        "--case", nargs=5, action="append", metavar=("M", "K", "N", "ACT", "MODE"),
        help="bf16 cases of your own instead of CASES (repeatable)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    cases = [(int(m), int(k), int(n), a, mode) for m, k, n, a, mode in args.case] if args.case else CASES
    rows = []
    for m, k, n, act, mode in cases:
        row = bench(run.Case(m, k, n, "bfloat16", "bfloat16", act, mode), args.widths)
        print(row, flush=True)
        rows.append(row)
    text = table(rows, args.widths)
    print(text)
    if args.out:
        write_results(args.out, "pad_width", rows, text)


if __name__ == "__main__":
    main()
