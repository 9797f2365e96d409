"""What the benchmarks share: the layers they time and their inputs, interleaved timing of
jitted programs, the FFI handler's counts, the ``--policy`` option, each plan's record and
the results files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import jax_epilog
from benchmarks.timing import Settings, WallClock, measure_interleaved
from jax_epilog import fused_dense
from jax_epilog.cuda.ffi import recording

# ------------------------------------------------------------------------ layers, inputs


def activation_fn(name: str | None):
    """The activation a plain-JAX contender applies: None or "none", "relu", or "gelu"
    (the tanh approximation, as cuBLASLt's epilog)."""
    if name in (None, "none"):
        return lambda z: z
    return jax.nn.relu if name == "relu" else partial(jax.nn.gelu, approximate=True)


def single_layers(activation: str | None) -> dict:
    """The two layers the benchmarks compare, not jitted: {"fused": fused_dense on the
    cuBLASLt path, "xla": XLA's ``act(x @ w + b)`` in x's dtype}."""
    act = activation_fn(activation)
    return {
        "fused": partial(fused_dense, activation=activation, implementation="cublaslt"),
        "xla": lambda x, w, b: act(x @ w + b).astype(x.dtype),
    }


def output_and_vjp(layer):
    """``(x, w, b, dy) -> (y, dx, dw, db)``: the layer's output and its VJP for the output
    cotangent ``dy``, as a training step computes both (mode "fwd+vjp")."""

    def step(x, w, b, dy):
        y, pullback = jax.vjp(layer, x, w, b)
        return (y, *pullback(dy))

    return step


def layer_inputs(
    m: int, k: int, n: int, rng: np.random.Generator, dtype=jnp.bfloat16, bias_scale: float = 0.1
):
    """x ~ N(0, 1) of shape (m, k), kernel ~ N(0, 1/k), bias ~ N(0, bias_scale²)."""
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
    b = jnp.asarray(rng.standard_normal(n) * bias_scale, dtype)
    return x, w, b


# ------------------------------------------------------------------------------- timing

# Medians of 7 samples, each at least 30 back-to-back calls and 20 ms (benchmarks/timing.py).
SETTINGS = Settings(samples=7, min_calls=30, sample_s=0.02, max_calls=2000)


def time_jax_interleaved(*cases) -> list[float]:
    """Median µs per call for each ``(f, args)``, their samples taken in turns."""
    calls = [(lambda i, f=f, args=args: f(*args), WallClock()) for f, args in cases]
    return [t.us for t in measure_interleaved(calls, SETTINGS)]


class HandlerClock(WallClock):
    """The wall clock, also counting the FFI handler's runs and host time between start and
    stop (``jax_epilog.cuda.ffi.recording``: stop waits for the outputs, so every run of
    the timed calls has happened). One recording per batch: nothing else records meanwhile."""

    def __init__(self):
        self.runs, self.busy_ns = 0, 0

    def start(self) -> None:
        self._recording = recording()
        self._stats = self._recording.__enter__()
        super().start()

    def stop(self, out) -> float:
        try:
            return super().stop(out)
        finally:
            self._recording.__exit__(None, None, None)
            self.runs += self._stats.calls
            self.busy_ns += self._stats.busy_ns

    @property
    def host_us(self) -> float | None:
        """Host µs per handler run, or None where it never ran."""
        return self.busy_ns / self.runs / 1e3 if self.runs else None


class Progress:
    """``[i/total] label: result`` lines."""

    def __init__(self, total: int, prefix: str = ""):
        self.total, self.done, self.prefix = total, 0, prefix

    def report(self, label: str, result: str) -> None:
        self.done += 1
        print(f"[{self.prefix}{self.done}/{self.total}] {label}: {result}", flush=True)


def failure_reason(exc: BaseException) -> str:
    """The exception's type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


# ------------------------------------------------------------------------------- policy


def _value(text: str):
    """A policy value from the command line: a Python literal, or ``a**b``."""
    import ast

    if "**" in text:
        base, exponent = text.split("**", 1)
        return int(base) ** int(exponent)
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def policy_changes(items: list[str] | None) -> dict:
    """``["row_bytes=1", "pad_min_work=2**30"]`` -> ``{"row_bytes": 1, "pad_min_work": 1073741824}``."""
    changes = {}
    for item in items or ():
        name, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"--policy wants FIELD=VALUE, got {item!r}")
        changes[name.strip()] = _value(text.strip())
    return changes


def add_policy_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy", nargs="+", metavar="FIELD=VALUE", default=[],
        help="run with jax_epilog.Policy fields changed (docs/decisions.md), e.g. row_bytes=1",
    )  # fmt: skip


def policy(changes: dict):
    """``jax_epilog.override_policy(**changes)``, or nothing to change."""
    return jax_epilog.override_policy(**changes) if changes else contextlib.nullcontext()


# -------------------------------------------------------------------------------- plans


def current_plans() -> list:
    """Every plan this process made (none without nvmath-python: the CPU path plans nothing)."""
    try:
        from jax_epilog.cuda.plan import plans
    except ImportError:
        return []
    return list(plans())


def plan_name(plan) -> str:
    """e.g. "RELU_BIAS 256x1024->1024 bfloat16 (align 256)"."""
    s = plan.spec
    align = getattr(plan, "alignment", None)
    return f"{s.epilog} {s.m}x{s.k}->{s.n} {s.ab_dtype}" + (f" (align {align})" if align else "")


def tuning_choices(plans) -> dict[str, str]:
    """The autotuner's choice per tuned plan, e.g. "candidate 0 of 8 at 4.02 µs; next best
    4.19 µs": whether two processes chose alike."""
    choices = {}
    for plan in plans:
        if not plan.tuning:
            continue
        order = sorted(range(len(plan.tuning)), key=plan.tuning.__getitem__)
        best = order[0]
        runner_up = plan.tuning[order[1]] if len(order) > 1 else float("nan")
        found = f"candidate {best} of {len(plan.tuning)} at {plan.tuning[best]:.2f} µs"
        choices[plan_name(plan)] = f"{found}; next best {runner_up:.2f} µs"
    return choices


def replay_states(plans) -> dict[str, str]:
    """Each plan's one-GEMM graphs for calls outside command buffers, e.g. "48 graphs
    kept, 0 dropped, replaying"."""
    states = {}
    for plan in plans:
        kept, dropped, replaying = plan.replay_stats
        states[plan_name(plan)] = (
            f"{kept} graphs kept, {dropped} dropped, {'replaying' if replaying else 'replay off'}"
        )
    return states


def plan_states() -> dict:
    """The tuner's choice and the replay state of every plan made so far ({} without any)."""
    plans = current_plans()
    if not plans:
        return {}
    return {"tuned": tuning_choices(plans), "replay": replay_states(plans)}


def force_candidate(index: int) -> None:
    """Make every plan this process tunes from now on pick cuBLASLt heuristic candidate
    ``index`` (its "timings" then put it first). Nothing to force without nvmath-python."""
    try:
        from jax_epilog.cuda import tuning
    except ImportError:
        return
    tuning.time_candidates = lambda plan, count, workspace: [0.0 if i == index else 1.0 for i in range(count)]


# -------------------------------------------------------------------------- result files


def git_commit() -> str | None:
    """The checkout's commit, with "-dirty" where tracked files changed, or None outside
    git. Read-only: no git command here writes the index (GIT_OPTIONAL_LOCKS=0)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = os.environ | {"GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=here, env=env, capture_output=True, text=True, timeout=10, check=True
        )
        return done.stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "") if commit else None


def versions() -> dict:
    info = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "gpu": str(jax.devices()[0].device_kind),
    }
    for name in ("nvmath", "cupy"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    try:
        from nvmath.bindings import cublasLt

        info["cublasLt"] = cublasLt.get_version()
    except ImportError:
        pass
    info["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "")
    info["commit"] = git_commit()
    return info


def write_listing(out: str | None, stem: str, lines: list[str]) -> None:
    """OUT/STEM.md: ``lines`` as one preformatted block (nothing without ``out``)."""
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{stem}.md"), "w") as fh:
            fh.write("```\n" + "\n".join(lines) + "\n```\n")


def listing_main(argv, doc: str, stem: str, lines) -> list[str]:
    """A probe's command line: ``--out DIR``; each line ``lines()`` yields printed as it
    comes, then all of them written to DIR/STEM.md (``write_listing``)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"folder for {stem}.md")
    args = parser.parse_args(argv)
    done = []
    for line in lines():
        done.append(line)
        print(line, flush=True)
    write_listing(args.out, stem, done)
    return done


def write_results(out: str, stem: str, rows: list[dict], table: str) -> None:
    """OUT/STEM.json (``versions()`` and ``rows``) and OUT/STEM.md (``table``)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as fh:
        json.dump({"versions": versions(), "rows": rows}, fh, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as fh:
        fh.write(table)


def ratio_table(rows: list[dict], contenders, columns: dict) -> str:
    """Markdown: the ``columns`` ({header: row -> cell}), each contender's µs
    (``row[c + "_us"]``), then the first contender's time over each other's."""
    first = contenders[0]
    head = [*columns, *(f"{c} µs" for c in contenders), *(f"XLA/{c}" for c in contenders[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [cell(r) for cell in columns.values()] + [f"{r[c + '_us']:.1f}" for c in contenders]
        cells += [f"{r[first + '_us'] / r[c + '_us']:.2f}×" for c in contenders[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main_over_shapes(argv, doc: str, stem: str, bench, table, shapes, **options) -> None:
    """A probe's command line: ``--shape M K N`` (repeatable; ``shapes`` without it),
    ``--out DIR``, ``--policy`` and ``--NAME VALUE`` for each of ``options`` (NAME: its
    default), which ``bench`` takes as keywords. Prints ``table(bench(shapes))``; with
    ``--out`` writes DIR/STEM.{json,md}."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--shape", nargs=3, type=int, action="append", metavar=("M", "K", "N"))
    for name, default in options.items():
        parser.add_argument(f"--{name}", type=type(default), default=default)
    add_policy_option(parser)
    args = parser.parse_args(argv)
    with policy(policy_changes(args.policy)):
        shapes = [tuple(s) for s in args.shape] if args.shape else shapes
        rows = bench(shapes, **{n: getattr(args, n) for n in options})
    text = table(rows)
    print(text)
    if args.out:
        write_results(args.out, stem, rows, text)
