"""Probe: how wide should a padded row be? 16 bytes or more?

    python -m benchmarks.probes.pad_width [--out DIR] [--widths 16 64 128 256] [--case M K N ACT MODE ...]
                                          [--policy FIELD=VALUE ...]

A large fused call whose K or N is not a multiple of 8 (half precision) pads them to whole
rows of ``Policy.row_bytes``; a half-precision forward without aux pads an N of
``wide_min_n`` or more to ``wide_row_bytes`` (docs/decisions.md, wide-rows). This times,
per case and row width W (bytes), interleaved (the suite's inputs and method):

- ``fused@W``: ``fused_dense(implementation="cublaslt")`` with K and N padded to W bytes
  at any size and any N (``row_bytes = wide_row_bytes = W``, no floors);
- ``auto@W``: ``fused_dense``'s default with that width (fused, or XLA's expression on the
  padded rows, and its derivatives there);
- ``xla@W``: ``jax.jit`` of ``act(x @ w + b)`` on the operands padded to W bytes, cut back;
- ``xla``: the expression as it is;

forward, or forward + backward (``row_padding``'s losses). A call with an aux keeps the
aux's layout whatever W: a GELU forward with its aux pads N to 8 elements only.
"""

from __future__ import annotations

import argparse

from benchmarks.cases import Case
from benchmarks.common import add_policy_option, policy, policy_changes, write_results
from benchmarks.contenders import Inputs
from benchmarks.probes import row_padding
from benchmarks.timing import QUICK, WallClock, measure_interleaved

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


def program(case: Case, kind: str):
    """The un-jitted function ``kind`` (fused, auto, xla: padded; plain: as it is) times."""
    return row_padding.program(case, _CONTENDERS[kind])


def width_policy(kind: str, width: int) -> dict:
    """The policy ``kind`` is lowered with at row width ``width`` (bytes)."""
    floor = {} if kind == "auto" else {"pad_min_rows": 0, "pad_min_work": 0}
    return {"row_bytes": width, "wide_row_bytes": width, "wide_min_n": 0, **floor}


def bench(case: Case, widths) -> dict:
    sets = Inputs(case).jax()
    compiled = {}
    for width in widths:
        for kind in KINDS:
            contender = _CONTENDERS[kind]
            compiled[f"{kind}@{width}"] = row_padding.compiled_program(
                case, contender, sets, **width_policy(kind, width)
            )
    compiled["xla"] = row_padding.compiled_program(case, "xla", sets)
    timings = measure_interleaved(
        [(lambda i, p=p: p(*sets[i % len(sets)]), WallClock()) for p in compiled.values()], QUICK
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
    add_policy_option(parser)
    args = parser.parse_args(argv)
    cases = [(int(m), int(k), int(n), a, mode) for m, k, n, a, mode in args.case] if args.case else CASES
    rows = []
    with policy(policy_changes(args.policy)):
        for m, k, n, act, mode in cases:
            rows.append(bench(Case(m, k, n, "bfloat16", "bfloat16", act, mode), args.widths))
            print(rows[-1], flush=True)
    text = table(rows, args.widths)
    print(text)
    if args.out:
        write_results(args.out, "pad_width", rows, text)


if __name__ == "__main__":
    main()
