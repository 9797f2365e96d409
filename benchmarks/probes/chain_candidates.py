"""Probe: does the autotuner's pick decide the 16-layer chain's speed?

    python -m benchmarks.probes.chain_candidates [--activation relu|gelu] [--candidate I] [--out DIR] [--cpu-smoke]
    python -m benchmarks.probes.chain_candidates --summarize DIR

Once in 14 readings (2026-12-03 (s), ``run2/suite2``) the fused ReLU chain of 16 layers at
256x1024->1024 (bf16, command buffers on, each result released or x donated) took 109-110
µs a step instead of 77-83, while GELU in the same process did not move. At that size the
tuner's first and second candidates time within ~5% of each other (4.15 against 4.36 µs in
its graphs), so two processes may run different algorithms. This process times the suite's
two buffer-stable chain patterns (``benchmarks.run``'s host section: "stacked, result
released" and "stacked, x donated"), fused and XLA interleaved, with the layer's plan forced
to cuBLASLt heuristic candidate ``I`` (``benchmarks.forward.force_candidate``)
or, without ``--candidate``, the tuner's own pick, and appends one JSON line to
``DIR/chain_candidates.jsonl``: the candidate run, the tuner's times if it tuned, the
step times, every timed batch's length and our handler's runs. One process per reading (plans are cached per process); ``--summarize`` renders
a folder's lines as ``chain_candidates.md``.

Found on the H200 (results/2026-12-04-h200-t-chain-candidates/): not the algorithm. The tuner
chose candidate 0 in all 38 processes and one ReLU reading of 21 still fell to 0.88× XLA.
Candidate 1, 8% slower in the tuner's graphs, ran the chain 4-5% faster than candidate 0
(eight processes each, in turns); timing the tuner's runs as child graphs, as XLA's command
buffer holds a custom call, did not change its ranking.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import jax

from benchmarks import forward, run
from benchmarks.timing import measure_interleaved

PATTERNS = ("stacked, result released", "stacked, x donated")


def chain_plan(m: int, k: int) -> dict:
    """The chain layer's plan: which candidate it runs and, if tuned, each one's µs."""
    try:
        from jax_epilog import _nvmath
    except ImportError:  # no nvmath-python: the CPU path, no plan
        return {}
    for (spec, *_), plan in _nvmath._plans.items():
        if (spec.m, spec.k, spec.n) == (m, k, k):
            return {"plan": str(spec), "choice": plan.choice, "tuning_us": plan.tuning}
    return {}


class SampleClock(run.HandlerCountingClock):
    """The suite's clock for the chains, also keeping every batch's length: whether a slow
    reading is slow throughout (a state of the program) or in a few batches."""

    def __init__(self):
        super().__init__()
        self.batches_ms: list[float] = []

    def stop(self, out) -> float:
        seconds = super().stop(out)
        self.batches_ms.append(round(seconds * 1e3, 3))
        return seconds


def measure(activation: str, settings: run.Settings, scale: int) -> dict:
    m, k = 256 // scale, 1024 // scale
    x, ws, bs = forward.chain_operands(m, k, run.CHAIN_DEPTH)
    layers = forward.single_layers(activation)
    row = {"shape": f"{m}x{k}->{k}", "activation": activation}
    for pattern in PATTERNS:
        steps = [run._chain_step(layers[name], pattern, x, ws, bs) for name in ("fused", "xla")]
        clocks = [SampleClock() for _ in steps]
        fused, xla = measure_interleaved([(lambda i, s=s: s(), c) for s, c in zip(steps, clocks)], settings)
        row[pattern] = {
            "fused_us": fused.us, "xla_us": xla.us, "xla_over_fused": xla.us / fused.us,
            "calls_per_batch": [fused.iters, xla.iters], "handler_runs": clocks[0].runs,
            "fused_batches_ms": clocks[0].batches_ms, "xla_batches_ms": clocks[1].batches_ms,
        }  # fmt: skip
    return row


def summarize(folder: Path) -> str:
    rows = [json.loads(line) for line in (folder / "chain_candidates.jsonl").read_text().splitlines() if line]
    lines = [
        "| act | forced | candidate run | tuner's µs (0, 1, 2, ...) | "
        + " | ".join(f"{p}: fused µs, XLA / fused" for p in PATTERNS)
        + " |",
        "|---|---|---|---|" + "---|" * len(PATTERNS),
    ]
    for r in sorted(rows, key=lambda r: (r["activation"], r["forced"] is None, r["forced"] or 0)):
        tuning = ", ".join(f"{t:.2f}" for t in r["tuning_us"]) if r.get("tuning_us") else ""
        cells = [f"{r[p]['fused_us']:.1f}, {r[p]['xla_over_fused']:.2f}×" for p in PATTERNS]
        forced = "tuner" if r["forced"] is None else str(r["forced"])
        lines.append(
            f"| {r['activation']} | {forced} | {r.get('choice', '')} | {tuning} | {' | '.join(cells)} |"
        )
    lines.append("")
    for act in sorted({r["activation"] for r in rows}):
        for p in PATTERNS:
            ratios = [r[p]["xla_over_fused"] for r in rows if r["activation"] == act]
            lines.append(
                f"- {act}, {p}: XLA / fused median {statistics.median(ratios):.2f}× in {len(ratios)} processes"
            )
    table = "\n".join(lines)
    (folder / "chain_candidates.md").write_text(table + "\n")
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--activation", choices=("relu", "gelu"), default="relu")
    parser.add_argument("--candidate", type=int, default=None, help="force this heuristic candidate")
    parser.add_argument("--out", default="chain_candidates", help="folder of chain_candidates.jsonl")
    parser.add_argument("--summarize", metavar="DIR", help="render DIR's lines as Markdown and exit")
    parser.add_argument("--cpu-smoke", action="store_true", help="dimensions / 64, two short samples")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(Path(args.summarize)))
        return
    if args.candidate is not None:
        forward.force_candidate(args.candidate)
    settings, scale = (run.SMOKE, 64) if args.cpu_smoke else (run.QUICK, 1)
    row = {"forced": args.candidate, **measure(args.activation, settings, scale)}
    row |= chain_plan(256 // scale, 1024 // scale)
    row["device"] = str(jax.devices()[0].device_kind)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "chain_candidates.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    ratios = ", ".join(f"{p} {row[p]['fused_us']:.1f} µs ({row[p]['xla_over_fused']:.2f}×)" for p in PATTERNS)
    print(
        f"{args.activation} candidate {row.get('choice', '—')} (forced {args.candidate}): {ratios}",
        flush=True,
    )


if __name__ == "__main__":
    main()
