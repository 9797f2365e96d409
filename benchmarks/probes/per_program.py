"""Probe: is what the fused call loses to nvmath at 8192x4096->1024 a cost per jitted program?

    python -m benchmarks.probes.per_program [--shape M K N ...] [--activation relu gelu]
                                            [--layers L] [--reps R] [--out DIR] [--cpu-smoke]

The suite times one layer per jitted call. At 8192x4096->1024 nvmath-python's ``Matmul``,
issuing the same cuBLASLt kernel (2026-12-03 (n)), read 2-4% faster than the fused call,
and XLA's own program paid the same. Under CUPTI ((n), ``run2/kernels.md``) every JAX
execution, XLA's or ours, enqueued one host function on the compute stream
(``cuLaunchHostFunc``, PjRt's); CUDA holds back the stream's later work until the host has
run it. nvmath and PyTorch enqueue none. This probe times, in turns and on the same input
sets (the suite's ``Inputs``, ``L`` distinct copies, bf16):

- ``fused`` / ``xla``: one layer per jitted call, rotating over the sets (the suite's rows);
- ``fused_in_L`` / ``xla_in_L``: all ``L`` sets' layers in one jitted call, reported per
  layer: one execution, so one host function, for ``L`` kernels;
- ``nvmath``: ``Matmul`` planned per set and executed back to back (CUDA events).

If the gap is a cost per program, ``nvmath / fused_in_L`` reads 1.00 where ``nvmath /
fused`` reads ~0.97. Each of ``R`` repetitions is a fresh interleaved measurement, every
other one with the contenders listed in reverse (the first listed of two identical
programs timed up to 6% faster in (s)). Results: DIR/per_program.{json,md}.

Found on the H200 (results/2026-12-04-h200-y-float32-blocks/run5, L = 8, four readings):
at 8192x4096->1024 nvmath / fused 0.969-0.989 one layer per call, 1.003-1.036 eight to a
call; 1.5-7.0 µs per layer paid once per execution, by XLA's program too.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import jax

from benchmarks import run
from benchmarks.forward import write_results
from benchmarks.timing import WallClock, measure_interleaved

SHAPES = [(8192, 4096, 1024), (8192, 1024, 4096)]
CONTENDERS = ("nvmath", "fused", "fused_in_L", "xla", "xla_in_L")


def jax_calls(case: run.Case, sets: list[tuple]) -> dict:
    """{name: (call(i), clock, layers per call)} for the four JAX contenders."""
    calls = {}
    for name, contender in (("fused", "jax_epilog"), ("xla", "xla")):
        layer = run.jax_program(case, contender)
        one = jax.jit(layer)
        many = jax.jit(lambda sets, layer=layer: [layer(*s) for s in sets])
        calls[name] = (lambda i, f=one: f(*sets[i % len(sets)]), WallClock(), 1)
        calls[f"{name}_in_L"] = (lambda i, f=many: f(sets), WallClock(), len(sets))
    return calls


def measure_case(case: run.Case, layers: int, order: tuple[str, ...], settings) -> dict[str, float]:
    """µs per layer for each contender, sampled in turns in ``order``."""
    inputs = run.Inputs(case, copies=layers)
    calls = jax_calls(case, inputs.jax())
    with contextlib.ExitStack() as stack:
        try:
            call, clock = stack.enter_context(run.nvmath_timed(case, "nvmath", inputs))
            calls["nvmath"] = (call, clock, 1)
        except run.Skip as exc:
            print(f"nvmath skipped: {exc}", flush=True)
        names = [name for name in order if name in calls]
        timings = measure_interleaved([calls[name][:2] for name in names], settings)
    return {name: t.us / calls[name][2] for name, t in zip(names, timings)}


def _ratio(row: dict, a: str, b: str) -> str:
    """``a``'s µs over ``b``'s in ``row``, or a dash where either is missing."""
    top, bottom = row.get(a + "_us"), row.get(b + "_us")
    return f"{top / bottom:.3f}" if top and bottom else "—"


def render(rows: list[dict]) -> str:
    head = "| M×K→N | act | rep (order) | " + " | ".join(f"{c} µs/layer" for c in CONTENDERS)
    head += " | nvmath/fused | nvmath/fused_in_L | XLA/fused | XLA_in_L/fused_in_L |"
    lines = [head, "|" + "---|" * (3 + len(CONTENDERS) + 4)]
    for r in rows:
        us = [r.get(f"{c}_us") for c in CONTENDERS]
        cells = [r["shape"], r["activation"], f"{r['rep']} ({r['order']})"]
        cells += ["—" if u is None else f"{u:.1f}" for u in us]
        pairs = [("nvmath", "fused"), ("nvmath", "fused_in_L"), ("xla", "fused"), ("xla_in_L", "fused_in_L")]
        cells += [_ratio(r, a, b) for a, b in pairs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + summary(rows)


def summary(rows: list[dict]) -> str:
    """Median over the repetitions of each case's two nvmath ratios."""
    out = []
    for shape, act in dict.fromkeys((r["shape"], r["activation"]) for r in rows):
        mine = [r for r in rows if (r["shape"], r["activation"]) == (shape, act) and r.get("nvmath_us")]
        if mine:
            one = statistics.median(r["nvmath_us"] / r["fused_us"] for r in mine)
            many = statistics.median(r["nvmath_us"] / r["fused_in_L_us"] for r in mine)
            out.append(
                f"{shape} {act}: nvmath / fused median {one:.3f}, nvmath / fused_in_L median {many:.3f}"
            )
    return "\n".join(out) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", nargs=3, type=int, action="append", metavar=("M", "K", "N"))
    parser.add_argument("--activation", nargs="+", choices=("relu", "gelu"), default=["relu", "gelu"])
    parser.add_argument(
        "--layers", type=int, default=8, help="input sets, and layers per call in the _in_L rows"
    )
    parser.add_argument("--reps", type=int, default=2, help="measurements per case, every other one reversed")
    parser.add_argument("--out", default="per_program", help="folder for per_program.{json,md}")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="shapes / 64, two short samples: runs on a CPU"
    )
    args = parser.parse_args(argv)
    settings, scale = (run.SMOKE, 64) if args.cpu_smoke else (run.QUICK, 1)
    rows = []
    for m, k, n in [tuple(s) for s in args.shape] if args.shape else SHAPES:
        for act in args.activation:
            case = run.shrink(run.Case(m, k, n, "bfloat16", "bfloat16", act, "fwd"), scale)
            for rep in range(args.reps):
                order = CONTENDERS if rep % 2 == 0 else CONTENDERS[::-1]
                us = measure_case(case, args.layers, order, settings)
                row = {"shape": case.shape, "activation": act, "rep": rep, "layers": args.layers}
                row["order"] = "listed" if rep % 2 == 0 else "reversed"
                rows.append(row | {f"{name}_us": t for name, t in us.items()})
                print(rows[-1], flush=True)
    table = render(rows)
    write_results(args.out, "per_program", rows, table)
    print(table)


if __name__ == "__main__":
    main()
