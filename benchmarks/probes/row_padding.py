"""Probe: what padding K and N to whole 16-byte rows gains, and where.

    python -m benchmarks.probes.row_padding [--out DIR] [--modes fwd fwd+bwd mlp] [--case M K N ACT ...]
                                            [--policy FIELD=VALUE ...]

cuBLASLt picks far slower kernels when a matrix's rows are not 16 bytes apart (K or N not a
multiple of 8 in half precision), so a large fused call pads them with zeros and cuts its
results back (``Policy.row_bytes``, ``pad_min_rows``, ``pad_min_work``: docs/decisions.md,
row-padding). This times, per case (the suite's inputs and method, interleaved):

- ``padded``: ``fused_dense(implementation="cublaslt")``, padded at any size;
- ``unpadded``: the same, never padded (``row_bytes=1``);
- ``auto``: ``fused_dense``'s default;
- ``xla``: ``jax.jit`` of ``act(x @ w + b)``;
- ``xla_padded``: the same expression on the operands a fused call pads (where it pads:
  ``jax_epilog._padding.padded_layer``), its result cut back to N columns;

forward and forward + backward (the gradient of a sum; of a sum of squares without an
activation, whose summed gradient XLA folds into reductions), and for ``mlp`` rows the
gradient of ``fused_mlp``'s two layers K -> N -> K with a GELU link and a sum-of-squares
loss (the second layer has no activation: of a sum, XLA would fold its GEMMs away). Also
prints the padded and unpadded forwards' largest difference, relative to the largest output.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.cases import Case
from benchmarks.common import activation_fn, add_policy_option, policy, policy_changes, write_results
from benchmarks.contenders import Inputs, jax_program
from benchmarks.timing import QUICK, WallClock, measure_interleaved
from jax_epilog import fused_mlp, override_policy
from jax_epilog._padding import on_padded_rows

CASES = [  # (M, K, N, dtype, bias dtype, activation, modes)
    (8192, 1024, 4097, "bfloat16", "bfloat16", "relu", ("fwd", "fwd+bwd")),
    (8192, 1024, 4097, "bfloat16", "bfloat16", "gelu", ("fwd", "fwd+bwd", "mlp")),
    (8192, 1020, 4096, "bfloat16", "bfloat16", "relu", ("fwd", "fwd+bwd")),
    (8192, 1020, 4096, "bfloat16", "bfloat16", "gelu", ("fwd", "fwd+bwd")),
    (8192, 4097, 1024, "bfloat16", "bfloat16", "gelu", ("fwd",)),
    (8192, 1024, 4104, "bfloat16", "bfloat16", "gelu", ("fwd",)),  # aligned: both lower alike
    (4096, 1024, 1025, "bfloat16", "bfloat16", "gelu", ("fwd", "fwd+bwd")),  # M*N*K about 2**32
    (2048, 1024, 4097, "bfloat16", "bfloat16", "relu", ("fwd",)),  # about 2**33
    (2048, 1024, 4097, "bfloat16", "bfloat16", "gelu", ("fwd", "fwd+bwd")),
    (1024, 1024, 4097, "bfloat16", "bfloat16", "relu", ("fwd",)),  # about 2**32
    (1024, 1024, 4097, "bfloat16", "bfloat16", "gelu", ("fwd", "fwd+bwd")),
    (1024, 1024, 1025, "bfloat16", "bfloat16", "gelu", ("fwd",)),  # about 2**30
    (1000, 1000, 1003, "bfloat16", "bfloat16", "relu", ("fwd",)),
    (1000, 1000, 1003, "bfloat16", "bfloat16", "gelu", ("fwd",)),
    (256, 784, 100, "float16", "float32", "relu", ("fwd", "fwd+bwd")),  # the quickstart layer
    (8192, 1024, 4097, "bfloat16", "bfloat16", "none", ("fwd", "fwd+bwd")),  # (loss: a sum of squares)
    (8192, 4097, 1024, "bfloat16", "bfloat16", "none", ("fwd", "fwd+bwd")),
    (2048, 1024, 4097, "bfloat16", "bfloat16", "none", ("fwd", "fwd+bwd")),
]
CONTENDERS = ("padded", "unpadded", "auto", "xla", "xla_padded")


# The policy each contender's program is traced and lowered with.
POLICY = {"padded": {"pad_min_rows": 0, "pad_min_work": 0}, "unpadded": {"row_bytes": 1}}


def loss(case: Case, y):
    y = y.astype(jnp.float32)
    return jnp.sum(y * y) if case.activation == "none" else jnp.sum(y)


def program(case: Case, contender: str):
    """The un-jitted function ``contender`` times on ``case``."""
    if case.mode != "mlp":
        names = {
            "padded": "jax_epilog",
            "unpadded": "jax_epilog",
            "auto": "jax_epilog_auto",
            "xla_padded": "xla",
        }
        fwd = jax_program(case._replace(mode="fwd"), names.get(contender, contender))
        if contender == "xla_padded":
            fwd = functools.partial(on_padded_rows, fwd)
        if case.mode == "fwd":
            return fwd
        return jax.grad(lambda x, w, b: loss(case, fwd(x, w, b)), argnums=(0, 1, 2))
    impl = {"padded": "cublaslt", "unpadded": "cublaslt"}.get(contender, contender)
    act = activation_fn(case.activation)

    def mlp_loss(x, w, b):  # two layers, K -> N -> K, the second's kernel the first's transposed
        layers = [(w, b), (w.T, None)]
        if contender == "xla_padded":
            h = on_padded_rows(lambda x, w, b: act(x @ w + b), x, w, b)
            y = on_padded_rows(lambda x, w, b: x @ w, h, w.T, None)
        else:
            activation = None if case.activation == "none" else case.activation
            y = fused_mlp(x, layers, [activation, None], implementation=impl)
        return loss(case._replace(activation="none"), y)  # (the last layer has none)

    return jax.grad(mlp_loss, argnums=(0, 1, 2))


def compiled_program(case: Case, contender: str, sets, **changes):
    """``program(case, contender)`` jitted, lowered and compiled with the policy changed
    (the padding is decided while tracing and lowering)."""
    with override_policy(**changes):
        return jax.jit(program(case, contender)).lower(*sets[0]).compile()


def bench(case: Case) -> dict:
    sets = Inputs(case).jax()
    compiled = {c: compiled_program(case, c, sets, **POLICY.get(c, {})) for c in CONTENDERS}
    timings = measure_interleaved(
        [(lambda i, p=p: p(*sets[i % len(sets)]), WallClock()) for p in compiled.values()], QUICK
    )
    row = {"shape": case.shape, "dtype": case.dtype, "activation": case.activation, "mode": case.mode}
    row |= {f"{c}_us": t.us for c, t in zip(CONTENDERS, timings)}
    if case.mode == "fwd":
        a, b = (compiled[c](*sets[0]).astype(jnp.float32) for c in ("padded", "unpadded"))
        row["padded_vs_unpadded"] = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
    return row


def table(rows: list[dict]) -> str:
    names = ("padded", "unpadded", "auto", "XLA", "XLA padded")
    lines = [
        "| M×K→N | dtype | act | mode | "
        + " | ".join(f"{n} µs" for n in names)
        + " | XLA/padded | XLA/auto | XLA/XLA padded | unpadded/padded |",
        "|---|---|---|---|" + "---|" * (len(names) + 4),
    ]
    for r in rows:
        t = dict(zip(CONTENDERS, (r[f"{c}_us"] for c in CONTENDERS)))
        ratios = (
            t["xla"] / t["padded"],
            t["xla"] / t["auto"],
            t["xla"] / t["xla_padded"],
            t["unpadded"] / t["padded"],
        )
        cells = [r["shape"], r["dtype"], r["activation"], r["mode"], *(f"{v:.1f}" for v in t.values())]
        lines.append("| " + " | ".join(cells + [f"{v:.2f}×" for v in ratios]) + " |")
    diffs = [
        f"{r['shape']} {r['activation']}: {r['padded_vs_unpadded']:.1e}"
        for r in rows
        if "padded_vs_unpadded" in r
    ]
    return (
        "\n".join(lines)
        + "\n\nPadded against unpadded forward (max |diff| / max |y|): "
        + "; ".join(diffs)
        + "\n"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--modes", nargs="+", default=None, help="only these modes (fwd, fwd+bwd, mlp)")
    parser.add_argument(
        "--case", nargs=4, action="append", metavar=("M", "K", "N", "ACT"),
        help="bf16 cases of your own instead of CASES (repeatable), in --modes (default fwd)",
    )  # fmt: skip
    add_policy_option(parser)
    args = parser.parse_args(argv)
    cases = CASES
    if args.case:
        modes = tuple(args.modes or ("fwd",))
        cases = [(int(m), int(k), int(n), "bfloat16", "bfloat16", act, modes) for m, k, n, act in args.case]
    rows = []
    with policy(policy_changes(args.policy)):
        for m, k, n, dtype, bias_dtype, act, modes in cases:
            for mode in modes:
                if args.modes and mode not in args.modes:
                    continue
                rows.append(bench(Case(m, k, n, dtype, bias_dtype, act, mode)))
                print(rows[-1], flush=True)
    text = table(rows)
    print(text)
    if args.out:
        write_results(args.out, "row_padding", rows, text)


if __name__ == "__main__":
    main()
