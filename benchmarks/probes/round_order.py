"""Probe: does the order of the suite's rounds bias its large-shape rows?

    python -m benchmarks.probes.round_order [--out DIR] [--reps N] [--cpu-smoke]

At 8192x4096->16384 (bf16) ``fused_dense``'s "auto" runs the very program of
``implementation="cublaslt"`` (the same custom call and plan; their jaxprs are equal), yet
in five suite runs (2026-12-03 (m) and (s)) "auto" timed 1.2-6.3% slower than "cublaslt"
for ReLU and GELU, every time. In the suite's rounds (``benchmarks.timing``, order "rotate")
each round starts one contender later but keeps the cyclic order, so "auto" always runs
right after "cublaslt". This times the suite's forward cases at that shape (every
contender but XLA-with-cuBLASLt, which the suite then timed in a process of its own) with
each of ``timing.ROUND_ORDERS``, and with the pair listed in the suite's order and swapped,
``--reps`` times in turn, and reports auto / cublaslt (a same-program pair: 1.00 unless
the method is biased) beside XLA / cublaslt.

Found on the H200 (results/2026-12-03-h200-s-check/, runs 5 and 6): not the rounds. Under
every order the one of the pair listed first timed faster, by 0-6%.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from benchmarks import run, timing
from benchmarks.forward import write_results

SHAPE = (8192, 4096, 16384)


def cases():
    return [
        c for c in run.plan(False)
        if (c.m, c.k, c.n) == SHAPE and c.mode == "fwd" and c.dtype == "bfloat16" and c.activation != "none"
    ]  # fmt: skip


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="round_order", help="folder for round_order.{json,md}")
    parser.add_argument("--reps", type=int, default=3, help="runs of each order, taken in turns")
    parser.add_argument("--cpu-smoke", action="store_true", help="shapes / 64, two short samples: runs on a CPU")
    args = parser.parse_args(argv)
    base, scale = (run.SMOKE, 64) if args.cpu_smoke else (run.QUICK, 1)
    todo = [(run.shrink(c, scale), name) for c, name in run.jobs(cases()) if name != "xla_cublaslt"]
    # The suite lists "cublaslt" (jax_epilog) first; "auto first" swaps the pair in each case.
    swapped = {"jax_epilog": "jax_epilog_auto", "jax_epilog_auto": "jax_epilog"}
    lists = {"cublaslt first": todo, "auto first": [(c, swapped.get(name, name)) for c, name in todo]}
    rows = []
    for rep in range(args.reps):
        for order in timing.ROUND_ORDERS:
            for first, jobs in lists.items():
                settings = dataclasses.replace(base, order=order)
                got = run.run_jobs(jobs, settings, run.Progress(len(jobs), f"{order}, {first}, {rep}: "))
                for act in sorted({r["activation"] for r in got}):
                    us = {f"{r['contender']}_us": r["us"] for r in got if r["activation"] == act}
                    rows.append({"order": order, "first": first, "rep": rep, "activation": act, **us})
    lines = [
        "| order | listed first | act | auto / cublaslt, per rep | median | XLA / cublaslt, per rep |",
        "|---|---|---|---|---|---|",
    ]
    for order in timing.ROUND_ORDERS:
        for first in lists:
            for act in ("relu", "gelu"):
                mine = [r for r in rows if (r["order"], r["first"], r["activation"]) == (order, first, act)]
                same = [r["jax_epilog_auto_us"] / r["jax_epilog_us"] for r in mine]
                xla = [r["xla_us"] / r["jax_epilog_us"] for r in mine]
                lines.append(
                    f"| {order} | {first} | {act} | {', '.join(f'{v:.3f}' for v in same)} "
                    f"| {statistics.median(same):.3f} | {', '.join(f'{v:.3f}' for v in xla)} |"
                )
    table = "\n".join(lines)
    write_results(args.out, "round_order", rows, table)
    print(table)


if __name__ == "__main__":
    main()
