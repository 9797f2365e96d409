"""Does the autotuner's algorithm cost fused_dense its forward at one shape?

    python -m benchmarks.probes.forced_algorithm [INDEX] [--shape M K N] [--activation relu|gelu]

Times ``fused_dense(implementation="cublaslt")`` against XLA's jit of ``act(x @ w + b)``,
nvmath-python's ``Matmul`` (its own first heuristic choice) and ``torch._addmm_activation``
(bf16, the suite's inputs and method: benchmarks.run.run_group, interleaved) with the fused
plan's algorithm forced to cuBLASLt heuristic candidate INDEX (as numbered by
``python -m benchmarks.algorithms --tuning``); without INDEX, the autotuner's own choice.
Default: 8192x4096->16384, ReLU. Run one process per index: plans are cached per process.
Prints one line (and, for the tuner's choice, each candidate's tuning time).
"""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks import run
from jax_epilog import _nvmath

SHAPE = (8192, 4096, 16384)
CONTENDERS = ("jax_epilog", "xla", "nvmath", "torch_addmm_act")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("index", nargs="?", type=int, default=None)
    parser.add_argument("--shape", nargs=3, type=int, default=SHAPE, metavar=("M", "K", "N"))
    parser.add_argument("--activation", choices=("relu", "gelu"), default="relu")
    args = parser.parse_args(argv)
    forced, shape = args.index, tuple(args.shape)
    if forced is not None:  # the "timings" make the tuner pick candidate ``forced``
        _nvmath.Plan._time_candidates = lambda self, h: [0.0 if i == forced else 1.0 for i in range(len(h))]
    case = run.Case(*shape, "bfloat16", "bfloat16", args.activation, "fwd")
    rows = run.run_group(case, list(CONTENDERS), run.Inputs(case), run.QUICK)
    us = {r["contender"]: r["us"] for r in rows}
    label = "tuner's choice" if forced is None else f"candidate {forced}"
    peers = ", ".join(f"{name} {us[name]:.1f} µs" if us[name] else f"{name} —" for name in CONTENDERS[1:])
    print(
        f"{case.m}x{case.k}->{case.n} {case.activation}, {label}: fused {us['jax_epilog']:.1f} µs, {peers}, "
        f"XLA/fused {us['xla'] / us['jax_epilog']:.3f}",
        flush=True,
    )
    if forced is None:  # which candidate the tuner took, and how close the others came
        for (spec, *_), plan in _nvmath._plans.items():
            if plan.tuning is not None and (spec.m, spec.k, spec.n) == shape:
                times = ", ".join(f"{i}: {t:.1f}" for i, t in enumerate(plan.tuning))
                print(f"  tuner chose candidate {int(np.argmin(plan.tuning))}; µs per run {times}")


if __name__ == "__main__":
    main()
