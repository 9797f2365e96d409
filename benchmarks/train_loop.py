"""The example's train steps timed as training loops run them, in three ways.

    python -m benchmarks.train_loop [--size large] [--fp8] [--variant KEY:FIELD=VALUE ...]
        [--chunks 7] [--steps 10]

Each model of ``examples/train_transformer_mlp.py`` (``--fp8``: nn.Dense, our bfloat16 and
FP8 layers, Flax's FP8) trains on a new batch every step, as a real loop does: new input
buffers each step. Three timings, each the median of ``--chunks`` chunks of ``--steps``
steps, the models' chunks taken in turns:

* ``loop``: the steps dispatched back to back on 8 batches made beforehand, waited for at
  the end of the chunk (a loop that reads its metrics every few steps);
* ``sync``: the same, every step waited for (a loop that reads the loss at every step).
  The host's time per step (dispatch, the FFI handler, XLA re-recording its command
  buffers for new buffer addresses) shows here and hides behind the GPU in ``loop``;
* ``fresh``: a batch made anew just before each step, then the step waited for: the
  example's own timing.

Beside them, per step: the host's time until the step call returned in ``loop`` (the
dispatch), and the FFI handler's runs and host time in ``sync`` and ``fresh``
(``jax_epilog.cuda.ffi.recording``); after the table, each plan that dropped graphs or
stopped replaying (docs/decisions.md#replay). Where the handler's time or its runs grow
from ``sync`` to ``fresh``, the host pays for the new addresses.

``--variant mlp_fp8:fp8_command_buffers=True`` adds a model traced under a changed
``jax_epilog.Policy`` field (docs/decisions.md); ``dense:xla_gpu_enable_command_buffer=``
one whose train step XLA compiles with that option (here: no command buffers). The
numbers behind docs/decisions.md#fp8-command-buffers come from this.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import NamedTuple

import jax

from benchmarks.common import current_plans, policy, policy_changes, replay_states
from benchmarks.timing import WallClock, waited_us
from benchmarks.training import load_example
from jax_epilog.cuda.ffi import recording

BATCHES = 8


def parse_variant(text: str) -> tuple[str, dict]:
    """``"mlp_fp8:fp8_command_buffers=True"`` -> ``("mlp_fp8", {"fp8_command_buffers": True})``.
    A comma starts a new field only where an ``=`` follows: an XLA option's list value
    (``xla_gpu_enable_command_buffer=FUSION,CUBLAS``) stays whole."""
    key, sep, changes = text.partition(":")
    if not sep:
        raise ValueError(f"--variant wants KEY:FIELD=VALUE[,FIELD=VALUE], got {text!r}")
    fields: list[str] = []
    for piece in changes.split(","):
        if "=" in piece or not fields:
            fields.append(piece)
        else:
            fields[-1] += "," + piece
    return key, policy_changes(fields)


def prepare(example, args, key: str, changes: dict, warmup: int = 3):
    """(run, batches): the model ``key`` set up, compiled and warmed up under ``changes``:
    ``jax_epilog.Policy`` fields, and XLA options (``xla_*``) that its train step is
    compiled with (``jax.stages.Lowered.compile``'s ``compiler_options``)."""
    options = {name: value for name, value in changes.items() if name.startswith("xla_")}
    with policy({name: value for name, value in changes.items() if name not in options}):
        run = example.setup(args, key)
        batches = [jax.block_until_ready(run.batch(i)) for i in range(BATCHES)]
        if options:
            run.train_step = run.lower(*batches[0]).compile(options)
        for i in range(warmup):
            jax.block_until_ready(run.step(*batches[i % BATCHES]))
    return run, batches


class Chunk(NamedTuple):
    """One chunk of steps, per step: wall µs, host µs until the step calls returned, and
    the FFI handler's runs and host µs."""

    us: float
    dispatch_us: float
    handler_runs: float
    handler_us: float


def time_loop(run, batches, steps: int) -> tuple[float, float]:
    """(µs per step, dispatch µs per step): the steps dispatched back to back, waited for once."""
    start = time.perf_counter()
    for i in range(steps):
        loss = run.step(*batches[i % BATCHES])
    dispatched = time.perf_counter()
    jax.block_until_ready(loss)
    return 1e6 * (time.perf_counter() - start) / steps, 1e6 * (dispatched - start) / steps


def time_sync(run, batches, steps: int) -> tuple[float, float]:
    """(median µs per step, nan): each step waited for."""
    return waited_us(lambda i: run.step(*batches[i % BATCHES]), steps), math.nan


def time_fresh(run, batches, steps: int) -> tuple[float, float]:
    """(median µs per step, nan): a new batch made and waited for, then the step waited for
    (the example's ``_timed_step``)."""
    clock, times = WallClock(), []
    for i in range(steps):
        x, y = jax.block_until_ready(run.batch(BATCHES + i))
        clock.start()
        times.append(1e6 * clock.stop(run.step(x, y)))
    return statistics.median(times), math.nan


TIMERS = {"loop": time_loop, "sync": time_sync, "fresh": time_fresh}


def time_chunk(timer, run, batches, steps: int) -> Chunk:
    with recording() as handler:
        us, dispatch_us = timer(run, batches, steps)
    return Chunk(us, dispatch_us, handler.calls / steps, handler.busy_ns / 1e3 / steps)


def measure(prepared: dict, chunks: int, steps: int) -> dict[str, dict[str, Chunk]]:
    """{mode: {label: the median of each Chunk field}}, the models' chunks in turns."""
    out = {}
    for mode, timer in TIMERS.items():
        samples = {label: [] for label in prepared}
        for _ in range(chunks):
            for label, (run, batches) in prepared.items():
                samples[label].append(time_chunk(timer, run, batches, steps))
        out[mode] = {label: Chunk(*map(statistics.median, zip(*s))) for label, s in samples.items()}
    return out


def render(title: str, results: dict[str, dict[str, Chunk]], base: str) -> str:
    """The table: each mode's µs per step and speed over ``base``, the dispatch, and the
    handler's runs / host µs per step in sync and fresh."""
    width = max(len(label) for label in results["loop"])
    head = "".join(f"{mode + ' µs':>9s} {'vs base':>8s}" for mode in TIMERS)
    lines = [title, f"{'model':{width}s}{head} {'dispatch':>9s} {'handler sync':>14s} {'fresh':>11s}"]
    for label in results["loop"]:
        row = "".join(f"{r[label].us:9.0f} {r[base].us / r[label].us:7.2f}×" for r in results.values())
        handler = [
            f"{r[label].handler_runs:.1f}/{r[label].handler_us:.0f}"
            for r in map(results.get, ("sync", "fresh"))
        ]
        lines.append(
            f"{label:{width}s}{row} {results['loop'][label].dispatch_us:9.0f} {handler[0]:>14s} {handler[1]:>11s}"
        )
    return "\n".join(lines)


def dropping_plans() -> list[str]:
    """Each plan that dropped replay graphs or stopped replaying, as "plan: state"."""
    plans = [p for p in current_plans() if p.replay_stats[1] or not p.replay_stats[2]]
    return [f"{name}: {state}" for name, state in replay_states(plans).items()]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large", help="the example's --size")
    parser.add_argument("--fp8", action="store_true", help="the example's FP8 models too")
    parser.add_argument("--variant", nargs="+", default=[], metavar="KEY:FIELD=VALUE")
    parser.add_argument("--chunks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10, help="steps per chunk")
    args = parser.parse_args(argv)
    example = load_example()
    ex_args = example.parse_args(["--size", args.size, *(["--fp8"] if args.fp8 else [])])
    names = example.FP8_LAYERS if args.fp8 else example.LAYERS
    models = [(names[key], key, {}) for key in names]
    for text in args.variant:
        key, changes = parse_variant(text)
        label = f"{example.NAMES[key]} ({', '.join(f'{k}={v}' for k, v in changes.items())})"
        models.append((label, key, changes))
    prepared = {label: prepare(example, ex_args, key, changes) for label, key, changes in models}
    results = measure(prepared, args.chunks, args.steps)
    device = jax.devices()[0]
    title = (
        f"train_transformer_mlp --size {args.size}{' --fp8' if args.fp8 else ''} on "
        f"{device.device_kind} ({device.platform}), jax {jax.__version__}: µs per step, median "
        f"of {args.chunks} chunks of {args.steps} steps; base: nn.Dense"
    )
    print(render(title, results, "nn.Dense"), flush=True)
    print("dispatch: host µs per step in loop; handler: its runs / host µs per step")
    drops = dropping_plans()
    print(
        "\n".join(["plans that dropped replay graphs:", *drops])
        if drops
        else "no plan dropped a replay graph"
    )
    return results


if __name__ == "__main__":
    main()
