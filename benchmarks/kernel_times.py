"""Where an FP8 row's time goes: GPU kernel times of its contenders, from ``jax.profiler``.

    python -m benchmarks.kernel_times ROW [--contenders NAME ...] [--steps 5] [--out DIR]
        [--policy FIELD=VALUE ...]
    python -m benchmarks.kernel_times train [--contenders mlp_fp8 flax_fp8 dense] [--size large]

ROW names a row of ``benchmarks/fp8.py`` (a part of its name: "dense", "mlp fwd+bwd
8192x1024"), or ``train``: a train step of ``examples/train_transformer_mlp.py --fp8`` (its
models by key). The contenders default to ours (delayed scaling) and Flax's FP8. For
each, the program runs ``--steps`` times under the profiler and the kernels on the GPU's
streams are summed per name and divided by the steps: a table per contender, largest first,
with the total. ``--out`` keeps the traces and each compiled program's HLO text (the
fusions' names in the table are its computations). The numbers behind
docs/decisions.md#fp8-wgrad and #fp8-dgelu come from this.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax

from benchmarks import fp8
from benchmarks.common import add_policy_option, policy, policy_changes


def kernel_times(trace: dict, steps: int) -> dict[str, float]:
    """µs per step of each kernel name on a GPU stream of a perfetto ``trace``."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in names if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in names if e.get("name") == "thread_name"}
    total: dict[str, float] = collections.defaultdict(float)
    for e in events:
        on_gpu = "GPU" in processes.get(e.get("pid"), "")
        stream = threads.get((e.get("pid"), e.get("tid")), "").startswith("Stream")
        if e.get("ph") == "X" and on_gpu and stream:
            total[e["name"]] += e.get("dur", 0.0) / steps
    return dict(total)


def profile(fn, args, steps: int, folder: str) -> dict[str, float]:
    """Kernel µs per step of ``fn(*args)`` (already compiled and warm)."""
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(fn(*args))
    (path,) = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        return kernel_times(json.load(f), steps)


def render(name: str, times: dict[str, float], top: int = 20) -> str:
    lines = [f"{name}: {sum(times.values()):.0f} µs of kernels per step"]
    for kernel, us in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us:9.1f} µs  {kernel[:100]}")
    return "\n".join(lines)


def _row_programs(parser, row: str, names) -> tuple[str, dict]:
    """The benchmarks/fp8.py row ``row`` names: its contenders ``names`` (jitted, with args)."""
    rows = [r for r in fp8.ROWS if row in fp8.row_name(*r)]
    if len(rows) != 1:
        parser.error(f"{row!r} names {len(rows)} of {[fp8.row_name(*r) for r in fp8.ROWS]} (or: train)")
    _, m, widths, acts, backward = rows[0]
    contenders = fp8.block_contenders(m, widths, acts, backward)[0]
    return fp8.row_name(*rows[0]), {
        n: contenders[n] for n in names or ["ours fp8 delayed", "flax fp8 direct (xla)"]
    }


def _train_programs(size: str, keys) -> tuple[str, dict]:
    """The example's jitted train step of each model ``keys`` names, with its arguments."""
    from benchmarks.training import load_example

    example = load_example()
    args = example.parse_args(["--size", size, "--fp8"])
    programs = {}
    for key in keys:
        train_step, variables, opt_state, batch = example.setup(args, key)
        programs[key] = (train_step, (variables, opt_state, *batch(0)))
    return f"train_transformer_mlp --size {size} --fp8", programs


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("row", help="a part of a benchmarks/fp8.py row's name")
    parser.add_argument("--contenders", nargs="+", help="default: ours (delayed) and Flax's FP8")
    parser.add_argument("--size", default="large", help="the example's --size (train only)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="folder for the traces and HLO (default: a temporary one)")
    add_policy_option(parser)
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="kernel_times_")
    found = {}
    with policy(policy_changes(args.policy)):
        if args.row == "train":
            title, programs = _train_programs(args.size, args.contenders or ["mlp_fp8", "flax_fp8"])
        else:
            title, programs = _row_programs(parser, args.row, args.contenders)
        for name, (fn, fn_args) in programs.items():
            jax.block_until_ready(fn(*fn_args))  # compile and warm up
            folder = os.path.join(out, re.sub(r"\W+", "_", name).strip("_"))
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "program.hlo.txt"), "w") as f:
                f.write(fn.lower(*fn_args).compile().as_text())
            found[name] = profile(fn, fn_args, args.steps, folder)
            print(render(f"{title}, {name}", found[name]), flush=True)
    return found


if __name__ == "__main__":
    main()
