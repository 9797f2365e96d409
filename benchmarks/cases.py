"""The suite's cases: the shapes, dtypes, activations and modes each plan times (``PLANS``,
data), and the arithmetic on a case (flops, bytes, a rough time estimate)."""

from __future__ import annotations

from typing import NamedTuple

from benchmarks.timing import Settings

# "fwd": the layer's output. "fwd+bwd": jax.grad of the output's float32 sum in x, kernel and
# bias; XLA may then skip forming the output itself (only act'(z) is needed) and fold the
# constant cotangent away. "fwd+vjp": the output and its VJP for a given cotangent dy (an
# input, N(0, 1)), what a layer does in a training step, where y feeds the next layer.
MODES = ("fwd", "fwd+bwd", "fwd+vjp")
FWD = ("fwd",)
ALL_ACTS, RELU_GELU = ("relu", "gelu", "none"), ("relu", "gelu")
TF32 = "COMPUTE_32F_FAST_TF32"
DTYPES = ("bfloat16", "float16", "float32")  # the operand dtypes the plans draw on
BF16, HALF = ("bfloat16",), ("bfloat16", "float16")


class Case(NamedTuple):
    """One problem and mode; every contender is timed on it."""

    m: int
    k: int
    n: int
    dtype: str
    bias_dtype: str
    activation: str  # "relu", "gelu" or "none"
    mode: str  # one of MODES
    compute_type: str | None = None  # fused_dense's default when None

    @property
    def shape(self) -> str:
        return f"{self.m}x{self.k}->{self.n}"


class Shapes(NamedTuple):
    """A row of a plan: every combination of its row counts, dtypes, compute types,
    activations and modes, in that nesting order."""

    ms: tuple[int, ...]
    k: int
    n: int
    dtypes: tuple[str, ...]
    bias_dtype: str | None  # None: the operands' dtype
    activations: tuple[str, ...]
    modes: tuple[str, ...]
    compute_types: tuple[str | None, ...] = (None,)


PLANS = {
    "quick": (
        Shapes((256,), 784, 100, ("float16",), "float32", ALL_ACTS, FWD),  # the quickstart layer
        Shapes((8192,), 1024, 4096, BF16, None, ALL_ACTS, MODES),  # a transformer MLP's layers
        Shapes((8192,), 4096, 16384, BF16, None, RELU_GELU, MODES),
        Shapes((8192,), 4096, 1024, BF16, None, RELU_GELU, MODES),
        Shapes((64,), 4096, 16384, BF16, None, RELU_GELU, FWD),  # small-batch inference
        Shapes((1000,), 1000, 1003, BF16, None, RELU_GELU, FWD),
        Shapes((8192,), 1024, 4097, BF16, None, RELU_GELU, FWD),  # N not a multiple of 8: padded rows
    ),
    "full": (
        Shapes((256,), 784, 100, ("float16",), "float32", ALL_ACTS, MODES),
        Shapes((8192,), 1024, 4096, HALF, None, ALL_ACTS, MODES),
        Shapes((8192,), 4096, 16384, HALF, None, ALL_ACTS, MODES),
        Shapes((8192,), 4096, 1024, HALF, None, ALL_ACTS, MODES),
        Shapes((8192,), 16384, 4096, HALF, None, ALL_ACTS, MODES),
        Shapes((16, 64, 128), 4096, 16384, BF16, None, ALL_ACTS, FWD),
        Shapes((1000,), 1000, 1003, BF16, None, ALL_ACTS, MODES),
        Shapes((8192,), 1024, 4097, BF16, None, RELU_GELU, MODES),
        Shapes((8192,), 1024, 4096, ("float32",), None, ALL_ACTS, MODES, (None, TF32)),
    ),
}


def plan(full: bool) -> list[Case]:
    """The cases of --quick (full=False) or --full, in the order they run."""
    cases = []
    for s in PLANS["full" if full else "quick"]:
        for m in s.ms:
            for dtype in s.dtypes:
                for compute_type in s.compute_types:
                    for act in s.activations:
                        for mode in s.modes:
                            cases.append(
                                Case(m, s.k, s.n, dtype, s.bias_dtype or dtype, act, mode, compute_type)
                            )
    return cases


def shrink(case: Case, factor: int) -> Case:
    """The same case with every dimension divided by factor (for --cpu-smoke)."""
    return case._replace(m=max(1, case.m // factor), k=max(1, case.k // factor), n=max(1, case.n // factor))


def flops(case: Case) -> int:
    """2·M·N·K for the forward, three GEMMs' worth (6·M·N·K) with the backward."""
    return (2 if case.mode == "fwd" else 6) * case.m * case.n * case.k


def tflops(case: Case, us: float) -> float:
    return flops(case) / us / 1e6


ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


def operand_bytes(case: Case) -> int:
    """x, kernel, bias and the output, in bytes."""
    item = ITEMSIZE[case.dtype]
    return item * (case.m * case.k + case.k * case.n + case.m * case.n) + ITEMSIZE[case.bias_dtype] * case.n


def input_copies(case: Case) -> int:
    """Distinct input sets to rotate through, so no call finds its operands warm in L2."""
    return 3 if operand_bytes(case) < 200e6 else 2


# --dry-run's estimate: compiling a JAX contender (by mode), GEMMs at PEAK flop/s (600 TF/s
# in half precision), at least 15 µs a call (60 for nvmath's execute()).
SETUP_S = {"fwd": 0.3, "fwd+bwd": 0.8, "fwd+vjp": 0.8}
PEAK = {"float32": 50e12, TF32: 400e12}


def estimate_s(case: Case, contender: str, settings: Settings) -> float:
    """A rough H200 wall time for one measurement: compile or plan, warm-up, batches."""
    peak = PEAK.get(case.compute_type or case.dtype, 600e12)
    per_call = max(flops(case) / peak, 60e-6 if contender == "nvmath" else 15e-6)
    batch = max(settings.sample_s, settings.min_calls * per_call)
    setup = SETUP_S[case.mode] if "jax" in contender or "xla" in contender else 0.1
    return setup + (settings.samples + 1) * batch + settings.warmup * per_call


def inputs_s(case: Case) -> float:
    """Making one problem's inputs: host random numbers, a cast and upload per framework."""
    return (case.m * case.k + case.k * case.n) * 3 / 40e6


def estimate_total_s(todo: list[tuple[Case, str]], settings: Settings) -> float:
    """The measurements, each problem's inputs, and the ceiling and host-cost sections."""
    problems = {(c.m, c.k, c.n, c.dtype, c.bias_dtype): inputs_s(c) for c, _ in todo}
    return sum(estimate_s(c, name, settings) for c, name in todo) + sum(problems.values()) + 30
