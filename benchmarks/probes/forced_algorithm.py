"""Does the autotuner's algorithm cost fused_dense its forward at one shape?

    python -m benchmarks.probes.forced_algorithm [INDEX] [--shape M K N] [--activation relu|gelu] [--any-reduction] [--workspace-mib N]

Times ``fused_dense(implementation="cublaslt")`` against XLA's jit of ``act(x @ w + b)``,
nvmath-python's ``Matmul`` (its own first heuristic choice) and ``torch._addmm_activation``
(bf16, the suite's inputs and method: benchmarks.run.run_group, interleaved) with the fused
plan's algorithm forced to cuBLASLt heuristic candidate INDEX (as numbered by
``python -m benchmarks.algorithms --tuning``); without INDEX, the autotuner's own choice.
Default: 8192x4096->16384, ReLU. ``--any-reduction``: the candidates come from cuBLASLt's
heuristic with every split-K reduction scheme allowed (jax_epilog allows only reductions in
the compute type), as nvmath's and PyTorch's own plans do. ``--workspace-mib``: the
workspace the heuristic may ask for (jax_epilog: 64 MiB; nvmath offers most of the device).
Run one process per index: plans
are cached per process. Prints one line: the times, the plan's split-K count and reduction
scheme, and fused_dense's error against float32 arithmetic on the same bf16 inputs
(relative to the largest output); for the tuner's choice, each candidate's tuning time.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import run
from benchmarks.forward import activation_fn, force_candidate, layer_operands
from jax_epilog import _nvmath, fused_dense

SHAPE = (8192, 4096, 16384)
CONTENDERS = ("jax_epilog", "xla", "nvmath", "torch_addmm_act")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("index", nargs="?", type=int, default=None)
    parser.add_argument("--shape", nargs=3, type=int, default=SHAPE, metavar=("M", "K", "N"))
    parser.add_argument("--activation", choices=("relu", "gelu"), default="relu")
    parser.add_argument("--any-reduction", action="store_true")
    parser.add_argument("--workspace-mib", type=int, default=None)
    args = parser.parse_args(argv)
    forced, shape = args.index, tuple(args.shape)
    if args.any_reduction:
        _nvmath._REDUCTION_SCHEMES = 7  # CUBLASLT_REDUCTION_SCHEME_MASK: in place, compute or output type
    if args.workspace_mib is not None:
        _nvmath._HEURISTIC_WORKSPACE = args.workspace_mib << 20
    if forced is not None:
        force_candidate(forced)
    case = run.Case(*shape, "bfloat16", "bfloat16", args.activation, "fwd")
    rows = run.run_group(case, list(CONTENDERS), run.Inputs(case), run.QUICK)
    us = {r["contender"]: r["us"] for r in rows}
    label = (
        ("tuner's choice" if forced is None else f"candidate {forced}")
        + (" (any reduction)" if args.any_reduction else "")
        + (f" ({args.workspace_mib} MiB workspace)" if args.workspace_mib is not None else "")
    )
    peers = ", ".join(f"{name} {us[name]:.1f} µs" if us[name] else f"{name} —" for name in CONTENDERS[1:])
    print(
        f"{case.m}x{case.k}->{case.n} {case.activation}, {label}: fused {us['jax_epilog']:.1f} µs, {peers}, "
        f"XLA/fused {us['xla'] / us['jax_epilog']:.3f}; {_algorithm(shape)}; error {_error(shape, args.activation):.2e}",
        flush=True,
    )
    if forced is None:  # which candidate the tuner took, and how close the others came
        for (spec, *_), plan in _nvmath._plans.items():
            if plan.tuning is not None and (spec.m, spec.k, spec.n) == shape:
                times = ", ".join(f"{i}: {t:.1f}" for i, t in enumerate(plan.tuning))
                print(f"  tuner chose candidate {int(np.argmin(plan.tuning))}; µs per run {times}")


def _error(shape, activation: str) -> float:
    """fused_dense against float32 arithmetic on the same bf16 inputs, relative to max |y|."""
    x, w, b = layer_operands(*shape)
    y = fused_dense(x, w, b, activation=activation, implementation="cublaslt").astype(jnp.float32)
    z = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    want = activation_fn(activation)(z + b.astype(jnp.float32))
    return float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want)))


def _algorithm(shape) -> str:
    """The planned algorithm's split-K count, reduction scheme, tile and stages ids."""
    from nvmath.bindings import cublasLt

    out = []
    for (spec, *_), plan in _nvmath._plans.items():
        if (spec.m, spec.k, spec.n) != shape:
            continue
        for name in ("SPLITK_NUM", "REDUCTION_SCHEME", "TILE_ID", "STAGES_ID"):
            value, written = np.zeros(1, np.uint32), np.zeros(1, np.uint64)
            try:
                attr = cublasLt.MatmulAlgoConfigAttribute[name]
                cublasLt.matmul_algo_config_get_attribute(
                    plan._algo, attr, value.ctypes.data, 4, written.ctypes.data
                )
                out.append(f"{name.lower()} {int(value[0])}")
            except Exception as exc:  # noqa: BLE001 -- a probe's detail, not its result
                out.append(f"{name.lower()} ? ({type(exc).__name__})")
    return ", ".join(out) or "no plan"


if __name__ == "__main__":
    main()
