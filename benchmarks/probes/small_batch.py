"""Probe: does the fused forward win at inference batch sizes (few rows)?

    python -m benchmarks.probes.small_batch [--out DIR] [--policy FIELD=VALUE ...]

Backs "auto"'s size floor (``Policy.auto_min_rows``, ``auto_min_work``: docs/decisions.md,
auto-forward). A single jitted call of a few rows is bound by host time unless the layer's
weights are large. This times, for M in 16..256 rows and five weight sizes (bf16, ReLU and
GELU), ``fused_dense(implementation="cublaslt")``, ``"auto"`` and ``jax.jit(act(x @ w +
b))``, interleaved, with the suite's method (``benchmarks.run``); inputs rotate over enough
copies (at least ~256 MB in all) that no call finds its weights in L2, as in a model whose
layers take turns.
"""

from __future__ import annotations

import argparse
import math

from benchmarks import run
from benchmarks.cases import Case, operand_bytes
from benchmarks.common import add_policy_option, policy, policy_changes, write_results
from benchmarks.contenders import Inputs
from benchmarks.timing import QUICK

ROWS = (16, 64, 128, 256)
WEIGHTS = ((1024, 4096), (4096, 1024), (4096, 4096), (4096, 16384), (16384, 4096))  # (K, N)
CONTENDERS = ["jax_epilog", "jax_epilog_auto", "xla"]
ROTATE_BYTES = 256e6


def cases():
    for k, n in WEIGHTS:
        for m in ROWS:
            for act in ("relu", "gelu"):
                yield Case(m, k, n, "bfloat16", "bfloat16", act, "fwd")


def bench(case: Case) -> dict:
    copies = min(32, max(3, math.ceil(ROTATE_BYTES / operand_bytes(case))))
    results = run.run_group(case, CONTENDERS, Inputs(case, copies=copies), QUICK)
    row = {"shape": case.shape, "activation": case.activation, "copies": copies}
    for r in results:
        row[r["contender"]] = r["us"]
        if r["skipped"]:
            row[r["contender"] + "_skipped"] = r["skipped"]
    print(row, flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    add_policy_option(parser)
    args = parser.parse_args(argv)
    with policy(policy_changes(args.policy)):
        rows = [bench(case) for case in cases()]
    lines = [
        "| M×K→N (bf16) | act | fused µs | auto µs | XLA µs | XLA/fused | XLA/auto |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        fused, auto, xla = (r.get(c) for c in CONTENDERS)
        cells = ["—" if t is None else f"{t:.1f}" for t in (fused, auto, xla)]
        ratios = ["—" if not t or not xla else f"{xla / t:.2f}×" for t in (fused, auto)]
        lines.append(f"| {r['shape']} | {r['activation']} | {' | '.join(cells + ratios)} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_results(args.out, "small_batch", rows, table)


if __name__ == "__main__":
    main()
