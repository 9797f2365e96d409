"""Timing for the benchmarks: batches of back-to-back calls, contenders sampled in turn."""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple

import jax

__all__ = [
    "FULL",
    "QUICK",
    "SMOKE",
    "EventClock",
    "Settings",
    "Timing",
    "WallClock",
    "measure",
    "measure_interleaved",
    "waited_us",
]


@dataclass(frozen=True)
class Settings:
    samples: int = 5  # timed batches; the row reports their median
    min_calls: int = 20  # calls per batch, at least
    sample_s: float = 0.02  # and at least this long
    warmup: int = 2
    max_calls: int = 50_000
    order: str = "rotate"  # each round's contender order: a key of ROUND_ORDERS


# The suite's settings: --quick, --full, and --cpu-smoke (two samples of two calls).
QUICK, FULL = Settings(samples=5), Settings(samples=7)
SMOKE = Settings(samples=2, min_calls=2, sample_s=0.0, warmup=1)


def _rotate(s: int, n: int) -> list[int]:
    return [(s + r) % n for r in range(n)]


def _serpentine(s: int, n: int) -> list[int]:
    order = _rotate(s, n)
    return order if s % 2 == 0 else order[::-1]


def _shuffle(s: int, n: int) -> list[int]:
    return random.Random(s).sample(range(n), n)


# Round s of n contenders -> the order they are sampled in. "rotate": round s starts with
# contender s, the cyclic order kept (so each contender always follows the same one);
# "serpentine": the same, every other round backwards (each follows both neighbours);
# "shuffle": a fresh random order per round (seeded by s).
ROUND_ORDERS = {"rotate": _rotate, "serpentine": _serpentine, "shuffle": _shuffle}


class Timing(NamedTuple):
    us: float  # median µs per call
    samples: int
    iters: int  # calls per sample
    calls: int  # calls made in all, warm-up included


def measure(call, clock, settings: Settings) -> Timing:
    """Time ``call(i)`` (the i-th call; it picks its own input set) in batches.

    Each batch issues back-to-back calls between ``clock.start()`` and
    ``clock.stop(last_output)``, which synchronises. After warm-up a first batch of
    ``min_calls`` calls sets the batch length so that each batch lasts ``sample_s``.
    """
    return measure_interleaved([(call, clock)], settings)[0]


def measure_interleaved(contenders: list[tuple], settings: Settings) -> list[Timing]:
    """``measure`` for several (call, clock) pairs at once, samples taken in turn.

    Every contender is warmed up and its batch length set first; then the samples go
    round: sample s of each contender before sample s + 1 of any. The GPU's clocks drift
    under sustained load (at a power-limited size by several per cent over seconds), and
    this way the drift touches every contender alike instead of whichever ran last. The
    order within a round is ``settings.order`` (ROUND_ORDERS): by default round s starts
    with contender s (mod their number), so no contender keeps one slot in the round. No
    order removes every effect of the list: of two identical programs, the one listed
    first has timed up to 6% faster at 8192x4096->16384 on an H200 (docs/performance.md).
    """
    made = [0] * len(contenders)

    def batch(j: int, count: int) -> float:
        call, clock = contenders[j]
        out = None
        clock.start()
        for i in range(made[j], made[j] + count):
            out = call(i)
        made[j] += count
        return clock.stop(out)

    iters = []
    for j in range(len(contenders)):
        batch(j, settings.warmup)
        first = batch(j, settings.min_calls)
        count = settings.min_calls
        if first < settings.sample_s:
            count = min(settings.max_calls, math.ceil(count * 1.1 * settings.sample_s / max(first, 1e-9)))
        iters.append(count)
    seconds = [[] for _ in contenders]
    n = len(contenders)
    round_order = ROUND_ORDERS[settings.order]
    for s in range(settings.samples):
        for j in round_order(s, n):
            seconds[j].append(batch(j, iters[j]) / iters[j])
    return [
        Timing(statistics.median(s) * 1e6, len(s), count, calls)
        for s, count, calls in zip(seconds, iters, made)
    ]


def waited_us(call, count: int) -> float:
    """Median wall µs of ``call(i)`` for i in range(count), each call waited for (as a
    training loop that reads every step's loss runs)."""
    clock, times = WallClock(), []
    for i in range(count):
        clock.start()
        times.append(1e6 * clock.stop(call(i)))
    return statistics.median(times)


class WallClock:
    """The host's clock around dispatched JAX calls, read after block_until_ready."""

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, out) -> float:
        jax.block_until_ready(out)
        return time.perf_counter() - self._t0


class EventClock:
    """CUDA events on the current stream (torch's or CuPy's)."""

    def __init__(self, new_event, elapsed_ms):
        self._new, self._elapsed_ms = new_event, elapsed_ms

    def start(self) -> None:
        self._begin = self._new()
        self._begin.record()

    def stop(self, out) -> float:
        end = self._new()
        end.record()
        end.synchronize()
        return self._elapsed_ms(self._begin, end) / 1e3
