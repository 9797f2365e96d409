"""Which GPU kernels a jitted program runs, and for how long (a CUPTI profile).

    python -m benchmarks.probes.kernels OUT_DIR [--case NAME ...] [--peer-shape M K N]

Each case is compiled and warmed up, then ``STEPS`` back-to-back calls run under
``jax.profiler.trace`` (CUPTI records every kernel, those replayed from XLA's command
buffers too). From the trace's GPU stream events this reports, per step: the kernels (by
XLA op where the trace names it, else by kernel name), how many ran and their GPU µs, the
GPU's busy time and the span from the first kernel's start to the last one's end; from its
host events (the Python tracer off) the runtime's busiest spans. Before tracing it times
``CALLS`` calls twice on the host clock: ``wall_us`` (to the results' readiness) and
``enqueue_us`` (until the loop has handed every call to the runtime): when the two are
equal and above the GPU's busy time, the program is bound by its host cost.

Cases: the forward at 8192x4096->16384 bf16 (ReLU, GELU), fused and XLA, one layer per call
and four per call as in benchmarks.forward's "in 4" rows (XLA's single call has timed up to 5%
faster than its own four-to-a-call rate there); the suite's forward calls at 8192x4096->1024
(``--peer-shape`` for another; ReLU, GELU) of the fused call, XLA, nvmath's ``Matmul`` and
``torch._addmm_activation`` ("peer-..."), and at 8192x4096->16384 the fused call beside "auto" ("auto-...", the same
plan: they have timed 1-3% apart in the suite); fwd+bwd ``jax.grad`` of ``sum(act(x @ w + b))`` at 8192x1024->4096 bf16 for
XLA's plain expression, ``fused_dense(implementation="cublaslt")`` and the fused forward with
XLA's backward (benchmarks.backward_variants), and the first two at benchmarks.training's
other fwd+bwd shapes ("grad-ACT-NAME-MxKxN"); 16-layer chains at 256x1024->1024 with the
weights stacked or per layer (benchmarks.chain_layout), fused and XLA; the MLP block of
``benchmarks.training --part mlp`` at 8192 and 2048 rows, XLA and ``fused_mlp`` linked; the
block of ``benchmarks.probes.mlp_layers`` at 1024x1024->4096->1024 (XLA, "both", "second"). Writes
kernels.json, kernels.md, the raw traces (traces/) and each jitted program's optimized HLO
(hlo/, where XLA's cuBLAS calls name the algorithm its autotuner chose) into OUT_DIR.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import itertools
import json
import os
import re
import shutil
import time
from functools import partial

import jax
import numpy as np

from benchmarks import run
from benchmarks.backward_variants import LOSSES
from benchmarks.backward_variants import layers as grad_layers
from benchmarks.forward import (
    chain,
    chain_operands,
    feedback,
    in_four,
    layer_operands,
    single_layers,
    write_results,
)
from benchmarks.training import GRAD_SHAPES, layer_inputs, mlp_grad_step, mlp_inputs

STEPS = {"fwd": 10, "grad": 10, "chain": 20}
CALLS = 500


def _forward_case(activation: str, name: str, four: bool = False):
    """benchmarks.forward's single-layer rows at 8192x4096->16384 (same inputs and programs)."""
    x, w, b = layer_operands(8192, 4096, 16384)
    layer = single_layers(activation)[name]
    if not four:
        return jax.jit(layer), (x, w, b)
    program, xs = in_four(layer, x)
    return program, (xs, w, b)


def _grad_case(activation: str, name: str, shape=(8192, 1024, 4096)):
    x, w, b = layer_inputs(*shape, np.random.default_rng(3))
    f = grad_layers(activation)[name]
    loss = LOSSES["sum"]
    return jax.jit(jax.grad(lambda x, w, b: loss(f(x, w, b)), argnums=(0, 1, 2))), (x, w, b)


def _chain_case(activation: str, layout: str, name: str, depth: int = 16, donate: bool = False):
    x, ws, bs = chain_operands(256, 1024, depth)
    if layout == "per-layer":
        ws, bs = tuple(ws[i] for i in range(depth)), tuple(bs[i] for i in range(depth))
    program = chain(single_layers(activation)[name], depth, donate)
    if not donate:
        return program, (x, ws, bs)
    return feedback(program, x, ws, bs), ()  # each result is the next (donated) input


# The peers' contexts (nvmath plans, torch's no_grad) stay open until main() has profiled every case.
_OPEN = contextlib.ExitStack()
PEER_SHAPE = (8192, 4096, 1024)  # where nvmath and PyTorch time ahead of the fused call


class _Synchronized:
    """A peer's result: ``jax.block_until_ready`` waits for the whole device."""

    def __init__(self, value):
        self.value = value

    def block_until_ready(self):
        import cupy as cp

        cp.cuda.Device().synchronize()
        return self


def _peer_case(activation: str, contender: str, shape=None):
    """The suite's own call of ``contender`` (benchmarks.run: its rotated input sets, the
    same plans) at ``shape`` (default PEER_SHAPE), bf16 forward: CUPTI's kernel times
    beside the suite's clocks."""
    case = run.Case(*(shape or PEER_SHAPE), "bfloat16", "bfloat16", activation, "fwd")
    inputs = run.Inputs(case)
    if contender in run.BENCH:
        call, _ = _OPEN.enter_context(run.BENCH[contender](case, contender, inputs))
    else:
        ((call, _),) = run._jax_timed(case, [contender], inputs)
    counter = itertools.count()

    def step():
        out = call(next(counter))
        return out if contender not in run.BENCH else _Synchronized(out)

    return step, ()


def _mlp_case(rows: int, contender: str):
    """fwd+bwd of the MLP block gelu(x @ w1 + b1) @ w2 + b2 (benchmarks.training), D = 1024."""
    return mlp_grad_step(contender), mlp_inputs(rows, 1024)


def _layers_case(activation: str, contender: str, rows: int = 1024):
    """benchmarks.probes.mlp_layers' block fwd+bwd at ROWSx1024->4096->1024 (D = 1024)."""
    from benchmarks.probes import mlp_layers

    return mlp_layers.grad_step(contender, activation), mlp_inputs(rows, 1024)


def cases() -> dict:
    out = {}
    for act in ("relu", "gelu"):
        for name in ("xla", "fused"):
            out[f"fwd-{act}-{name}"] = ("fwd", partial(_forward_case, act, name))
            out[f"fwd-{act}-{name}-in4"] = ("fwd", partial(_forward_case, act, name, four=True))
    for act in ("relu", "gelu"):
        for contender in ("jax_epilog", "xla", "nvmath", "torch_addmm_act"):
            out[f"peer-{act}-{contender}"] = ("fwd", partial(_peer_case, act, contender))
        for contender in ("jax_epilog", "jax_epilog_auto"):  # one plan, two programs
            out[f"auto-{act}-{contender}"] = ("fwd", partial(_peer_case, act, contender, (8192, 4096, 16384)))
    for rows in (8192, 2048):  # where fused_mlp's DGELU link measured faster, and slower
        for contender in ("xla", "fused_mlp_cublaslt"):
            out[f"mlp-{rows}-{contender}"] = ("grad", partial(_mlp_case, rows, contender))
    for act in ("relu", "gelu"):  # a mid-size block: both layers "cublaslt" read 1.13-1.18x here
        for contender in ("xla", "both", "second"):
            out[f"layers-{act}-1024-{contender}"] = ("grad", partial(_layers_case, act, contender))
    for act in ("relu", "gelu"):
        for name in ("xla", "cublaslt", "aux+xla"):
            out[f"grad-{act}-{name}"] = ("grad", partial(_grad_case, act, name))
        for m, k, n in GRAD_SHAPES[1:]:  # benchmarks.training's other fwd+bwd shapes
            for name in ("xla", "cublaslt"):
                out[f"grad-{act}-{name}-{m}x{k}x{n}"] = ("grad", partial(_grad_case, act, name, (m, k, n)))
    for act in ("relu", "gelu"):
        for layout in ("stacked", "per-layer"):
            for name in ("fused", "xla"):
                out[f"chain-{act}-{layout}-{name}"] = ("chain", partial(_chain_case, act, layout, name))
        for name in ("fused", "xla"):  # the same program with stable buffer addresses
            out[f"chain-{act}-stacked-{name}-donated"] = (
                "chain",
                partial(_chain_case, act, "stacked", name, donate=True),
            )
    return out


def _short(kernel: str) -> str:
    """A kernel's name without template arguments and parameter lists."""
    name = re.sub(r"^void ", "", kernel)
    depth, kept = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            kept.append(ch)
    return "".join(kept)[:90] or kernel[:90]


def read_trace(path: str, host: bool = False) -> list[dict]:
    """The GPU stream events (kernels, copies, memsets) of a perfetto trace from jax.profiler;
    with ``host``, the events of the host's threads instead."""
    with gzip.open(path, "rt") as fh:
        data = json.load(fh)
    events = data["traceEvents"] if isinstance(data, dict) else data
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            processes[e["pid"]] = e.get("args", {}).get("name", "")
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e.get("args", {}).get("name", "")
    gpu = {pid for pid, name in processes.items() if "GPU" in name or "gpu" in name}
    if host:
        return [e for e in events if e.get("ph") == "X" and e["pid"] not in gpu and "dur" in e]
    streams = {key for key, name in threads.items() if key[0] in gpu and "Stream" in name}
    if not streams:  # another naming: every GPU line except XLA's op/module summaries
        streams = {key for key, name in threads.items() if key[0] in gpu and not name.startswith("XLA")}
    return [e for e in events if e.get("ph") == "X" and (e["pid"], e.get("tid")) in streams and "dur" in e]


def summarize(events: list[dict], steps: int) -> dict:
    groups = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        args = e.get("args", {})
        op = args.get("hlo_op") or args.get("tf_op") or ""
        op = re.sub(r"[.]\d+$", "", op)  # fusion.12 -> fusion
        key = f"{_short(e['name'])} [{op}]" if op else _short(e["name"])
        groups[key][0] += 1
        groups[key][1] += float(e["dur"])
    if events:
        span = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    else:
        span = 0.0
    kernels = sorted(
        ({"kernel": k, "per_step": n / steps, "us_per_step": us / steps} for k, (n, us) in groups.items()),
        key=lambda r: -r["us_per_step"],
    )
    return {
        "steps": steps,
        "kernels_per_step": len(events) / steps,
        "busy_us_per_step": sum(float(e["dur"]) for e in events) / steps,
        "span_us_per_step": span / steps,
        "kernels": kernels,
    }


def host_spans(events: list[dict], steps: int, top: int = 40) -> list[dict]:
    """The host events with the most time per step (nested spans each count in full)."""
    groups = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        key = re.sub(r"[.]\d+$", "", e["name"])[:90]  # convert_fusion.3 -> convert_fusion
        groups[key][0] += 1
        groups[key][1] += float(e["dur"])
    spans = [{"span": k, "per_step": n / steps, "us_per_step": us / steps} for k, (n, us) in groups.items()]
    return sorted(spans, key=lambda r: -r["us_per_step"])[:top]


def host_clock(fn, args, calls: int = CALLS) -> dict:
    """µs per call: until the results are ready, and until the loop has enqueued them all."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(calls):
        result = fn(*args)
    t1 = time.perf_counter()
    jax.block_until_ready(result)
    t2 = time.perf_counter()
    return {"wall_us": (t2 - t0) / calls * 1e6, "enqueue_us": (t1 - t0) / calls * 1e6}


def profile(name: str, kind: str, make, out: str) -> dict:
    fn, args = make()
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    clock = host_clock(fn, args)
    if hasattr(fn, "lower"):  # the optimized program, for the kernels XLA chose
        os.makedirs(os.path.join(out, "hlo"), exist_ok=True)
        with open(os.path.join(out, "hlo", f"{name}.txt"), "w") as fh:
            fh.write(fn.lower(*args).compile().as_text())
    logdir = os.path.join(out, "traces", name)
    shutil.rmtree(logdir, ignore_errors=True)
    steps = STEPS[kind]
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # Python frames would swamp the host side
    with jax.profiler.trace(logdir, create_perfetto_trace=True, profiler_options=options):
        for _ in range(steps):
            result = fn(*args)
        jax.block_until_ready(result)
    paths = glob.glob(os.path.join(logdir, "**", "*perfetto_trace.json.gz"), recursive=True)
    if not paths:
        return {"case": name, "error": f"no perfetto trace under {logdir}"}
    summary = summarize(read_trace(paths[0]), steps)
    return {"case": name} | clock | summary | {"host": host_spans(read_trace(paths[0], host=True), steps)}


def render(rows: list[dict], top: int = 8) -> str:
    lines = [
        "| case | wall µs/call | enqueue µs/call | kernels/step | GPU busy µs/step | span µs/step |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | {r['error']} | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {r.get('wall_us', float('nan')):.1f} | {r.get('enqueue_us', float('nan')):.1f} "
            f"| {r['kernels_per_step']:.1f} | {r['busy_us_per_step']:.1f} | {r['span_us_per_step']:.1f} |"
        )
    for r in rows:
        if "error" in r:
            continue
        lines += ["", f"{r['case']}: top kernels (count per step, µs per step)", ""]
        lines += ["| kernel | n/step | µs/step |", "|---|---|---|"]
        for k in r["kernels"][:top]:
            lines.append(f"| `{k['kernel']}` | {k['per_step']:.1f} | {k['us_per_step']:.1f} |")
        if r.get("host"):
            lines += ["", "| host span | n/step | µs/step |", "|---|---|---|"]
            lines += [
                f"| `{h['span']}` | {h['per_step']:.1f} | {h['us_per_step']:.1f} |"
                for h in r["host"][: top + 8]
            ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    global PEER_SHAPE
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out")
    parser.add_argument("--case", action="append", help="case names (default: all)")
    parser.add_argument(
        "--peer-shape", type=int, nargs=3, metavar=("M", "K", "N"),
        help=f"the peer-... cases' shape (default {'x'.join(map(str, PEER_SHAPE))})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.peer_shape:
        PEER_SHAPE = tuple(args.peer_shape)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    with _OPEN:  # closes the peers' plans and torch's settings before the interpreter exits
        for name, (kind, make) in cases().items():
            if args.case and name not in args.case:
                continue
            try:
                row = profile(name, kind, make, args.out)
            except Exception as exc:  # noqa: BLE001 -- one failing case must not cost the others
                row = {"case": name, "error": f"{type(exc).__name__}: {exc}"[:300]}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("kernels", "host")}), flush=True)
    table = render(rows)
    write_results(args.out, "kernels", rows, table)
    print(table)


if __name__ == "__main__":
    main()
