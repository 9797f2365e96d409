"""The example's train steps timed as training loops run them, in two ways.

    python -m benchmarks.train_loop [--size large] [--fp8] [--variant KEY:FIELD=VALUE ...]
        [--chunks 7] [--steps 10]

Each model of ``examples/train_transformer_mlp.py`` (``--fp8``: nn.Dense, our bfloat16 and
FP8 layers, Flax's FP8) trains on a fresh batch every step (8 batches made beforehand, in
turn), as a real loop does: new input buffers each step. Two timings, each the median of
``--chunks`` chunks of ``--steps`` steps, the models' chunks taken in turns:

* ``loop``: the steps dispatched back to back, waited for at the end of the chunk (a loop
  that reads its metrics every few steps);
* ``sync``: every step waited for, as the example times it (a loop that reads the loss at
  every step). The host's time per step (dispatch, XLA re-recording its command buffers
  for new buffer addresses) shows here and hides behind the GPU in ``loop``.

``--variant mlp_fp8:fp8_command_buffers=True`` adds a model traced under a changed
``jax_epilog.Policy`` field (docs/decisions.md). The numbers behind
docs/decisions.md#fp8-command-buffers come from this.
"""

from __future__ import annotations

import argparse
import statistics

import jax

from benchmarks.common import policy, policy_changes
from benchmarks.timing import WallClock, waited_us
from benchmarks.training import load_example

BATCHES = 8


def parse_variant(text: str) -> tuple[str, dict]:
    """``"mlp_fp8:fp8_command_buffers=True"`` -> ``("mlp_fp8", {"fp8_command_buffers": True})``."""
    key, sep, changes = text.partition(":")
    if not sep:
        raise ValueError(f"--variant wants KEY:FIELD=VALUE[,FIELD=VALUE], got {text!r}")
    return key, policy_changes(changes.split(","))


def prepare(example, args, key: str, changes: dict, warmup: int = 3):
    """(run, batches): the model ``key`` set up, compiled and warmed up under ``changes``."""
    with policy(changes):
        run = example.setup(args, key)
        batches = [jax.block_until_ready(run.batch(i)) for i in range(BATCHES)]
        for i in range(warmup):
            jax.block_until_ready(run.step(*batches[i % BATCHES]))
    return run, batches


def time_loop(run, batches, steps: int) -> float:
    """µs per step, the steps dispatched back to back and waited for once."""
    clock = WallClock()
    clock.start()
    for i in range(steps):
        loss = run.step(*batches[i % BATCHES])
    return 1e6 * clock.stop(loss) / steps


def time_sync(run, batches, steps: int) -> float:
    """µs per step (median), each step waited for."""
    return waited_us(lambda i: run.step(*batches[i % BATCHES]), steps)


def measure(prepared: dict, chunks: int, steps: int) -> dict[str, dict[str, float]]:
    """{mode: {label: median µs per step}}, the models' chunks in turns."""
    out = {}
    for mode, timer in (("loop", time_loop), ("sync", time_sync)):
        samples = {label: [] for label in prepared}
        for _ in range(chunks):
            for label, (run, batches) in prepared.items():
                samples[label].append(timer(run, batches, steps))
        out[mode] = {label: statistics.median(s) for label, s in samples.items()}
    return out


def render(title: str, results: dict[str, dict[str, float]], base: str) -> str:
    loop, sync = results["loop"], results["sync"]
    width = max(len(label) for label in loop)
    lines = [title, f"{'model':{width}s} {'loop µs':>9s} {'vs base':>8s} {'sync µs':>9s} {'vs base':>8s}"]
    for label in loop:
        lines.append(
            f"{label:{width}s} {loop[label]:9.0f} {loop[base] / loop[label]:7.2f}× "
            f"{sync[label]:9.0f} {sync[base] / sync[label]:7.2f}×"
        )
    return "\n".join(lines)


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
    return results


if __name__ == "__main__":
    main()
