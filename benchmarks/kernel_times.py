"""Where an FP8 row's time goes: GPU kernel times of its contenders, from ``jax.profiler``.

    python -m benchmarks.kernel_times ROW [--contenders NAME ...] [--steps 5] [--out DIR]
        [--policy FIELD=VALUE ...]
    python -m benchmarks.kernel_times train [--contenders mlp_fp8 flax_fp8 dense] [--size large]
        [--example no-donate]

ROW names a row of ``benchmarks/fp8.py`` (a part of its name: "dense", "mlp fwd+bwd
8192x1024"), or ``train``: a train step of ``examples/train_transformer_mlp.py --fp8`` (its
models by key). The contenders default to ours (delayed scaling) and Flax's FP8. For
each, the program runs ``--steps`` times under the profiler and the kernels on the GPU's
streams are summed per name and divided by the steps: a table per contender, largest first,
with the total, the launches, the wall time of a step waited for (timed outside the
profiler; wall minus kernels is the time the GPU idles) and the largest host-side events.
``--out`` keeps the traces and each compiled program's HLO text (the fusions' names in the
table are its computations). The numbers behind docs/decisions.md#fp8-wgrad and #fp8-dgelu
come from this.
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
from typing import NamedTuple

import jax

from benchmarks import fp8
from benchmarks.common import add_policy_option, policy, policy_changes
from benchmarks.timing import waited_us


class Times(NamedTuple):
    """One program's profile, per step: µs and launches of each GPU kernel name, µs of each
    host-side event name (XLA's thunks, the FFI handler), and the wall time of a step."""

    kernels: dict[str, float]
    launches: dict[str, float]
    host: dict[str, float]
    wall_us: float = 0.0


def kernel_times(trace: dict, steps: int) -> Times:
    """Per-step kernel and host times of a perfetto ``trace`` of ``steps`` steps."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = [e for e in events if e.get("ph") == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in names if e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in names if e.get("name") == "thread_name"}
    kernels: dict[str, float] = collections.defaultdict(float)
    launches: dict[str, float] = collections.defaultdict(float)
    host: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("ph") != "X":
            continue
        on_gpu = "GPU" in processes.get(e.get("pid"), "")
        if on_gpu and threads.get((e.get("pid"), e.get("tid")), "").startswith("Stream"):
            kernels[e["name"]] += e.get("dur", 0.0) / steps
            launches[e["name"]] += 1 / steps
        elif not on_gpu:
            host[e["name"]] += e.get("dur", 0.0) / steps
    return Times(dict(kernels), dict(launches), dict(host))


def profile(fn, args, steps: int, folder: str) -> Times:
    """The profile of ``fn(*args)`` (already compiled and warm), and its wall time."""
    wall = waited_us(lambda _: fn(*args), 3 * steps)
    with jax.profiler.trace(folder, create_perfetto_trace=True):
        for _ in range(steps):
            jax.block_until_ready(fn(*args))
    (path,) = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path) as f:
        return kernel_times(json.load(f), steps)._replace(wall_us=wall)


def render(name: str, times: Times, top: int = 20, top_host: int = 8) -> str:
    busy, launches = sum(times.kernels.values()), sum(times.launches.values())
    head = f"{name}: {busy:.0f} µs of kernels per step ({launches:.0f} launches)"
    lines = [f"{head}, {times.wall_us:.0f} µs wall per step (GPU idle {times.wall_us - busy:.0f} µs)"]
    for kernel, us in sorted(times.kernels.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us:9.1f} µs  {times.launches[kernel]:4.0f}×  {kernel[:90]}")
    lines.append("  host side, largest:")
    for event, us in sorted(times.host.items(), key=lambda kv: -kv[1])[:top_host]:
        lines.append(f"  {us:9.1f} µs  host  {event[:90]}")
    return "\n".join(lines)


def _row_programs(parser, row: str, names) -> tuple[str, dict]:
    """The benchmarks/fp8.py row ``row`` names: its contenders ``names`` as (jitted fn, args)."""
    rows = [r for r in fp8.ROWS if row in fp8.row_name(*r)]
    if len(rows) != 1:
        parser.error(f"{row!r} names {len(rows)} of {[fp8.row_name(*r) for r in fp8.ROWS]} (or: train)")
    _, m, widths, acts, backward = rows[0]
    contenders = fp8.block_contenders(m, widths, acts, backward)[0]
    return fp8.row_name(*rows[0]), {
        n: contenders[n] for n in names or ["ours fp8 delayed", "flax fp8 direct (xla)"]
    }


def _train_programs(size: str, keys, options) -> tuple[str, dict]:
    """The example's train step of each model ``keys`` names, as (step, batch 0): each
    call trains on, carrying the state the step donates."""
    from benchmarks.training import load_example

    example = load_example()
    args = example.parse_args(["--size", size, "--fp8", *options])
    programs = {}
    for key in keys:
        run = example.setup(args, key)
        programs[key] = (run, run.batch(0))
    return " ".join(["train_transformer_mlp --size", size, "--fp8", *options]), programs


def _folder(out: str, name: str) -> str:
    folder = os.path.join(out, re.sub(r"\W+", "_", name).strip("_"))
    os.makedirs(folder, exist_ok=True)
    return folder


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("row", help="a part of a benchmarks/fp8.py row's name")
    parser.add_argument("--contenders", nargs="+", help="default: ours (delayed) and Flax's FP8")
    parser.add_argument("--size", default="large", help="the example's --size (train only)")
    parser.add_argument(
        "--example",
        nargs="*",
        default=[],
        help="more of the example's flags, without their dashes (train only: no-donate)",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", help="folder for the traces and HLO (default: a temporary one)")
    add_policy_option(parser)
    args = parser.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="kernel_times_")
    found = {}
    with policy(policy_changes(args.policy)):
        if args.row == "train":
            keys = args.contenders or ["mlp_fp8", "flax_fp8"]
            title, programs = _train_programs(args.size, keys, [f"--{o}" for o in args.example])
        else:
            title, programs = _row_programs(parser, args.row, args.contenders)
        for name, (fn, fn_args) in programs.items():
            folder = _folder(out, name)
            with open(os.path.join(folder, "program.hlo.txt"), "w") as f:
                f.write(fn.lower(*fn_args).compile().as_text())  # (a Run lowers its step)
            if hasattr(fn, "step"):  # the example's Run: each call a train step
                fn = fn.step
            jax.block_until_ready(fn(*fn_args))  # compile and warm up
            found[name] = profile(fn, fn_args, args.steps, folder)
            print(render(f"{title}, {name}", found[name]), flush=True)
    return found


if __name__ == "__main__":
    main()
