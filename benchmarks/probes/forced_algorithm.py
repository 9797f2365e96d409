"""Does the autotuner's algorithm cost fused_dense its ReLU forward at 8192x4096->16384?

    python -m benchmarks.probes.forced_algorithm [INDEX]

Times ``fused_dense(implementation="cublaslt")`` against XLA's jit of ``relu(x @ w + b)``
(bf16, the suite's inputs and method: benchmarks.run.run_group, interleaved) with the fused
plan's algorithm forced to cuBLASLt heuristic candidate INDEX (as numbered by
``python -m benchmarks.algorithms --tuning``); without INDEX, the autotuner's own choice.
Run one process per index: plans are cached per process. Prints one line (and, for the
tuner's choice, each candidate's tuning time).
"""

from __future__ import annotations

import sys

import numpy as np

from benchmarks import run
from jax_epilog import _nvmath

SHAPE = (8192, 4096, 16384)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    forced = int(argv[0]) if argv else None
    if forced is not None:  # the "timings" make the tuner pick candidate ``forced``
        _nvmath.Plan._time_candidates = lambda self, h: [0.0 if i == forced else 1.0 for i in range(len(h))]
    case = run.Case(*SHAPE, "bfloat16", "bfloat16", "relu", "fwd")
    fused, xla = run.run_group(case, ["jax_epilog", "xla"], run.Inputs(case), run.QUICK)
    label = "tuner's choice" if forced is None else f"candidate {forced}"
    print(
        f"{case.m}x{case.k}->{case.n} relu, {label}: fused {fused['us']:.1f} µs, xla {xla['us']:.1f} µs, "
        f"XLA/fused {xla['us'] / fused['us']:.3f}",
        flush=True,
    )
    if forced is None:  # which candidate the tuner took, and how close the others came
        for (spec, *_), plan in _nvmath._plans.items():
            if plan.tuning is not None and (spec.m, spec.k, spec.n) == SHAPE:
                times = ", ".join(f"{i}: {t:.1f}" for i, t in enumerate(plan.tuning))
                print(f"  tuner chose candidate {int(np.argmin(plan.tuning))}; µs per run {times}")


if __name__ == "__main__":
    main()
