"""Would split-K help small layers? cuBLASLt's candidates with and without it, GPU time only.

    python -m benchmarks.probes.splitk [OUT_DIR]

At 256x1024->1024 a GEMM has only 16 output tiles of 128x128 for 132 SMs, so splitting K
looked like a way to fill the GPU. For each shape and epilog this takes cuBLASLt's
heuristic candidates (as ``_nvmath.Plan`` asks for them), makes split-K variants of each
(2-16 slices, partial sums reduced in the compute type), lets ``cublasLtMatmulAlgoCheck``
validate them, and times every valid one (``benchmarks.algorithms.Timer.gpu_us``): 20
launches captured in a CUDA graph, median of 5 graph launches (launched one by one, a 4 µs
GEMM is timed at the host's launch rate).
Prints the best with and without split-K per case; every candidate goes to splitk.log.
Result on the H200 (benchmarks/results/2026-12-02-h200-e-graph-tuning/probes/splitk.log):
split-K was never faster (256x1024->1024 RELU_BIAS: 4.1 µs unsplit, 6.7 µs at the best split).
"""

from __future__ import annotations

import os
import sys

import cupy as cp
import numpy as np
from nvmath.bindings import cublasLt

from benchmarks import algorithms
from jax_epilog import _nvmath
from jax_epilog._epilogs import EpilogSpec

SHAPES = [(256, 1024, 1024), (64, 1024, 1024), (2048, 1024, 1024), (8192, 1024, 4096)]
EPILOGS = ("RELU_BIAS", "GELU_BIAS", "RELU_AUX_BIAS")
SPLITS = (1, 2, 3, 4, 6, 8, 16)
WORKSPACE = 256 << 20


def _set(algo: int, attr, value: int) -> None:
    buf = np.array([value], np.int32 if attr == cublasLt.MatmulAlgoConfigAttribute.SPLITK_NUM else np.uint32)
    cublasLt.matmul_algo_config_set_attribute(algo, attr, buf.ctypes.data, buf.nbytes)


def candidates_with_splits(m, k, n, epilog, timer, workspace, log):
    """[(heuristic index, split count, µs or None, workspace bytes or the error)] for one case."""
    spec = EpilogSpec(m, n, k, epilog, "COMPUTE_32F", "bfloat16", "bfloat16", "bfloat16")
    plan = _nvmath.Plan(spec, 0, 256)
    base = algorithms.candidates(plan, 16)
    a, b, bias, d, aux = algorithms._forward_pointers(timer, spec)
    for value, attr, slot in ((bias, plan._bias_attr, 0), (aux, plan._aux_attr, 1)):
        if value:
            plan._ptr_buf[slot] = value
            cublasLt.matmul_desc_set_attribute(plan._desc, attr, plan._ptr_buf.ctypes.data + 8 * slot, 8)
    store = cublasLt.MatmulHeuristicResult(len(base) * len(SPLITS))  # owns the variants' algos
    check = cublasLt.MatmulHeuristicResult(1)
    layouts = plan._layouts
    rows = []
    for j, (i, split) in enumerate((i, s) for i in range(len(base)) for s in SPLITS):
        record = store[j]
        record["algo"][...] = base[i]["algo"]
        algo = record["algo"].ctypes.data
        try:
            if split > 1:
                _set(algo, cublasLt.MatmulAlgoConfigAttribute.SPLITK_NUM, split)
                _set(
                    algo,
                    cublasLt.MatmulAlgoConfigAttribute.REDUCTION_SCHEME,
                    cublasLt.ReductionScheme.COMPUTE_TYPE,
                )
            cublasLt.matmul_algo_check(plan._handle, plan._desc, *layouts, algo, check.ptr)
            ws_size = int(np.max(check["workspace_size"]))

            def launch(algo=algo):
                cublasLt.matmul(
                    plan._handle, plan._desc, plan._alpha, a, layouts[0], b, layouts[1], plan._beta,
                    d, layouts[2], d, layouts[3], algo, workspace.ptr, WORKSPACE, timer.stream.ptr,
                )  # fmt: skip

            # (gpu_us first launches once uncaptured: a variant cuBLASLt refuses fails there)
            rows.append((i, split, timer.gpu_us(launch, n=20), ws_size))
        except Exception as exc:  # noqa: BLE001 -- an invalid variant is a row, not a stop
            timer.stream.synchronize()
            rows.append((i, split, None, type(exc).__name__))
        print(f"{m}x{k}->{n} {epilog}", rows[-1], file=log)
    return rows


def main(out: str) -> None:
    timer = algorithms.Timer()
    workspace = cp.cuda.alloc(WORKSPACE)
    with open(os.path.join(out, "splitk.log"), "w") as log:
        for m, k, n in SHAPES:
            for epilog in EPILOGS:
                rows = candidates_with_splits(m, k, n, epilog, timer, workspace, log)
                valid = [r for r in rows if r[2] is not None]
                unsplit = [r for r in valid if r[1] == 1]
                best_unsplit = min(unsplit, key=lambda r: r[2])
                best = min(valid, key=lambda r: r[2])
                print(
                    f"{m}x{k}->{n} {epilog}: heuristic first {unsplit[0][2]:.2f} µs, best unsplit "
                    f"{best_unsplit[2]:.2f} (candidate {best_unsplit[0]}), best of all {best[2]:.2f} "
                    f"(candidate {best[0]}, split-K {best[1]}); {len(valid)}/{len(rows)} variants valid",
                    flush=True,
                )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "."))
