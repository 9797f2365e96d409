"""Does the chain benchmark's weight layout cost the custom call extra copies?

    python -m benchmarks.chain_layout [HLO_DIR]   # optimized HLO of each chain into HLO_DIR

The chains in benchmarks.forward and benchmarks.run keep the 16 layers' weights stacked in
one (16, K, K) array and slice ``ws[i]`` inside the jit. XLA can read a slice in place for
its own GEMMs; an operand of a custom call is a buffer of its own, so the slice may become
a copy. Flax's layers hold one array per layer instead (``nn.scan`` stacks them). This
times both layouts, fused and XLA, interleaved, and counts in the optimized HLO what runs
per step: our custom calls, XLA's GEMMs, copies and slices, fusions.
"""

from __future__ import annotations

import re
import sys
from functools import partial
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from benchmarks.forward import activation_fn, chain, tuning_choices
from benchmarks.run import QUICK, WallClock, measure_interleaved
from jax_epilog import _ffi, fused_dense

DEPTH = 16


def hlo_counts(compiled_text: str) -> dict[str, int]:
    lines = [line for line in compiled_text.splitlines() if " = " in line]
    ops = [re.search(r"= \S+ (\S+?)\(", line) for line in lines]
    names = [m.group(1) for m in ops if m]
    entry = compiled_text.split("ENTRY")[-1]  # what runs at the top level, per step
    top = [m.group(1) for m in (re.search(r"= \S+ (\S+?)\(", line) for line in entry.splitlines()) if m]
    return {
        "ours": compiled_text.count(f'custom_call_target="{_ffi.TARGET_NAME}"'),
        "xla_gemm": compiled_text.count('custom_call_target="__cublas'),
        "copies": sum(n in ("copy", "copy-start") for n in top),
        "slices": sum(n in ("slice", "dynamic-slice") for n in names),
        "top_fusions": sum(n == "fusion" for n in top),
    }


def main(hlo_dir: str | None = None):
    if hlo_dir:
        Path(hlo_dir).mkdir(parents=True, exist_ok=True)
    m, k = 256, 1024
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    ws = jnp.asarray(rng.standard_normal((DEPTH, k, k)) / np.sqrt(k), jnp.bfloat16)
    bs = jnp.asarray(rng.standard_normal((DEPTH, k)) * 0.1, jnp.bfloat16)
    separate = (tuple(ws[i] for i in range(DEPTH)), tuple(bs[i] for i in range(DEPTH)))
    print("| act | layout | contender | µs/step | our calls | XLA GEMMs | top-level copies | slices | top-level fusions |")
    print("|---|---|---|---|---|---|---|---|---|")
    for act in ("relu", "gelu"):
        layers = {
            "fused": partial(fused_dense, activation=act, implementation="cublaslt"),
            # The default binds this iteration's activation function.
            "xla": lambda x, w, b, f=activation_fn(act): f(x @ w + b),  # noqa: B008
        }
        cases, labels = [], []
        for layout, (w_arg, b_arg) in (("stacked", (ws, bs)), ("separate", separate)):
            for name, layer in layers.items():
                program = chain(layer, DEPTH)
                text = program.lower(x, w_arg, b_arg).compile().as_text()
                counts = hlo_counts(text)
                if hlo_dir:
                    Path(hlo_dir, f"{act}-{layout}-{name}.hlo.txt").write_text(text)
                cases.append((lambda i, p=program, w=w_arg, b=b_arg: p(x, w, b), WallClock()))
                labels.append((layout, name, counts))
        timings = measure_interleaved(cases, QUICK)
        for (layout, name, c), t in zip(labels, timings):
            print(f"| {act} | {layout} | {name} | {t.us:.1f} | {c['ours']} | {c['xla_gemm']} | {c['copies']} "
                  f"| {c['slices']} | {c['top_fusions']} |", flush=True)
    try:  # the tuner's choices (on a GPU), to compare runs by
        from jax_epilog import _nvmath
    except ImportError:  # no nvmath/CuPy here: nothing was tuned
        return
    for plan, choice in tuning_choices(_nvmath._plans).items():
        print(f"tuned {plan}: {choice}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
