"""Probe: which small problems does cuBLASLt plan but then refuse to launch?

    python -m benchmarks.probes.refusals [--out DIR]

Backs the refusals rule (docs/decisions.md, refusals): the library sends these problems to
XLA before planning, so this probe bypasses that routing and makes each plan itself, with
the autotuner on (which launches every candidate algorithm once: a problem none of them
can run raises ``PlanningError``). Problems, bf16 operands, compute type COMPUTE_32F: the
forward with a float32 D (a float32 bias beside half operands) and the bf16 one, with and
without GELU's aux, at one row and at a few; the kernel-gradient GEMM with BGRADA
(``"wgrad"``) with K = 1 and K = 6; the DGELU input-gradient GEMM (``"dgrad"``) at one row,
N = 1 and a few rows.
Prints "ran" or the refusal, with the candidates' tuning µs (inf: that candidate failed).
"""

from __future__ import annotations

from benchmarks.common import listing_main
from jax_epilog._epilogs import EpilogSpec
from jax_epilog.cuda.plan import Plan, current_device

CT = "COMPUTE_32F"


def specs():
    """(name, EpilogSpec) of every problem tried."""
    for m, k, n in [(1, 6, 11), (1, 11, 1), (2, 6, 11), (4, 6, 11)]:
        for epilog in ("BIAS", "GELU_AUX_BIAS"):
            for d in ("float32", "bfloat16"):
                yield (
                    f"forward {epilog} d={d} m{m}k{k}n{n}",
                    EpilogSpec(m, n, k, epilog, CT, "bfloat16", d, d),
                )
    for m, k, n in [(4, 1, 11), (1, 1, 11), (4, 6, 11), (1, 6, 11)]:  # K = 1: one output row of D
        spec = EpilogSpec(m, n, k, "BGRADA", CT, "bfloat16", "bfloat16", "bfloat16", "wgrad")
        yield f"wgrad BGRADA m{m}k{k}n{n}", spec
    for m, n, k in [(1, 3, 5), (4, 1, 8), (1, 16, 24), (2, 16, 24), (8, 16, 24)]:
        for aux in ("bfloat16", "float32"):
            spec = EpilogSpec(m, n, k, "DGELU", CT, "bfloat16", None, aux, "dgrad")
            yield f"dgrad DGELU aux={aux} m{m}n{n}k{k}", spec


def attempt(spec: EpilogSpec) -> str:
    try:
        plan = Plan(spec, current_device(), 256, autotune=True)
    except Exception as exc:  # noqa: BLE001 -- a probe reports what cuBLASLt refused
        return "REFUSED " + str(exc).splitlines()[0][:140]
    times = ", ".join(f"{t:.1f}" for t in plan.tuning or ())
    return f"ran (candidate {plan.choice}; tuning µs {times})"


def main(argv=None):
    listing_main(argv, __doc__, "refusals", lambda: (f"{name:52s} {attempt(spec)}" for name, spec in specs()))


if __name__ == "__main__":
    main()
