"""Probe: does the plan's algorithm cost fused_dense its forward at one shape?

    python -m benchmarks.probes.forced_algorithm [INDEX] [--shape M K N] [--activation relu|gelu]
                                                 [--any-reduction] [--workspace-mib N] [--policy FIELD=VALUE ...]

Backs the autotuner's settings (docs/decisions.md: autotuning, heuristic-workspace,
splitk-reduction). Times ``fused_dense(implementation="cublaslt")`` against XLA's jit of
``act(x @ w + b)``, nvmath-python's ``Matmul`` (its own first heuristic choice) and
``torch._addmm_activation`` (bf16, the suite's inputs and method: ``benchmarks.run.run_group``,
interleaved) with the fused plan's algorithm forced to cuBLASLt heuristic candidate INDEX;
without INDEX, the autotuner's own choice. Default: 8192x4096->16384, ReLU.
``--any-reduction``: the candidates come from cuBLASLt's heuristic with every split-K
reduction scheme allowed (``Policy.splitk_any_reduction``), as nvmath's and PyTorch's own
plans do. ``--workspace-mib``: the workspace the heuristic may offer
(``Policy.heuristic_workspace``). ``--policy`` changes other fields, e.g.
``tuning_warm_us=0`` (no warm-up) or ``autotune=False`` (the heuristic's first choice).
Run one process per reading: plans are cached per process. Prints one line: the times, the
plan's split-K count, reduction scheme, tile and stages ids, and fused_dense's error
against float32 arithmetic on the same bf16 inputs (relative to the largest output); for
the tuner's choice, each candidate's tuning time.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import run
from benchmarks.cases import Case
from benchmarks.common import (
    activation_fn,
    add_policy_option,
    current_plans,
    force_candidate,
    policy,
    policy_changes,
)
from benchmarks.contenders import Inputs
from benchmarks.forward import layer_operands
from benchmarks.timing import QUICK
from jax_epilog import fused_dense

SHAPE = (8192, 4096, 16384)
CONTENDERS = ("jax_epilog", "xla", "nvmath", "torch_addmm_act")
ALGO_FIELDS = ("SPLITK_NUM", "REDUCTION_SCHEME", "TILE_ID", "STAGES_ID")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("index", nargs="?", type=int, default=None)
    parser.add_argument("--shape", nargs=3, type=int, default=SHAPE, metavar=("M", "K", "N"))
    parser.add_argument("--activation", choices=("relu", "gelu"), default="relu")
    parser.add_argument("--any-reduction", action="store_true")
    parser.add_argument("--workspace-mib", type=int, default=None)
    parser.add_argument("--out", default=None, help="folder for forced_algorithm.md (the lines printed)")
    add_policy_option(parser)
    return parser.parse_args(argv)


def changes_of(args) -> dict:
    changes = policy_changes(args.policy)
    if args.any_reduction:
        changes["splitk_any_reduction"] = True
    if args.workspace_mib is not None:
        changes["heuristic_workspace"] = args.workspace_mib << 20
    return changes


def label_of(args) -> str:
    label = "tuner's choice" if args.index is None else f"candidate {args.index}"
    return label + "".join(f" ({name}={value})" for name, value in changes_of(args).items())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = tuple(args.shape)
    if args.index is not None:
        force_candidate(args.index)
    case = Case(*shape, "bfloat16", "bfloat16", args.activation, "fwd")
    with policy(changes_of(args)):
        rows = run.run_group(case, list(CONTENDERS), Inputs(case), QUICK)
        error = _error(shape, args.activation)
    lines = [_line(case, args, {r["contender"]: r["us"] for r in rows}, error)]
    if args.index is None:  # which candidate the tuner took, and how close the others came
        for plan in _plans_of(shape):
            if plan.tuning is not None:
                times = ", ".join(f"{i}: {t:.1f}" for i, t in enumerate(plan.tuning))
                lines.append(f"  tuner chose candidate {int(np.argmin(plan.tuning))}; µs per run {times}")
    print("\n".join(lines), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "forced_algorithm.md"), "a") as fh:
            fh.write("\n".join(lines) + "\n")


def _line(case: Case, args, us: dict, error: float) -> str:
    peers = ", ".join(f"{name} {us[name]:.1f} µs" if us[name] else f"{name} —" for name in CONTENDERS[1:])
    ratio = us["xla"] / us["jax_epilog"] if us["xla"] and us["jax_epilog"] else float("nan")
    fused = f"{us['jax_epilog']:.1f} µs" if us["jax_epilog"] else "—"
    return (
        f"{case.shape} {case.activation}, {label_of(args)}: fused {fused}, {peers}, XLA/fused {ratio:.3f}; "
        f"{_algorithm(case[:3])}; error {error:.2e}"
    )


def _plans_of(shape) -> list:
    return [p for p in current_plans() if (p.spec.m, p.spec.k, p.spec.n) == shape]


def _error(shape, activation: str) -> float:
    """fused_dense against float32 arithmetic on the same bf16 inputs, relative to max |y|."""
    x, w, b = layer_operands(*shape)
    y = fused_dense(x, w, b, activation=activation, implementation="cublaslt").astype(jnp.float32)
    z = jnp.matmul(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    want = activation_fn(activation)(z + b.astype(jnp.float32))
    return float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want)))


def _algorithm(shape) -> str:
    """The planned algorithm's split-K count, reduction scheme, tile and stages ids (read
    from the plan's cuBLASLt algorithm struct)."""
    try:
        from nvmath.bindings import cublasLt
    except ImportError:
        return "no plan (nvmath-python is not importable)"
    out = []
    for plan in _plans_of(shape):
        for name in ALGO_FIELDS:
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
