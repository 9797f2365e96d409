"""The ``implementation="auto"`` rules: which layers run the fused kernel, and which XLA.

Each rule follows what was measured faster (``docs/decisions.md``); its numbers are
``Policy`` fields. The rules need the sizes: a symbolic dimension (``jax.export``'s shape
polymorphism) always takes XLA's program.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

from ._epilogs import ACTIVATIONS, XLA_COMPUTE_TYPES, Activation, ComputeType, known_sizes
from ._padding import aligned_rows, fast_rows, pads_n
from ._policy import get_policy

__all__ = ["MlpChoice", "auto_fuses", "dense_implementation", "mlp_choice"]


def auto_fuses(activation: Activation | None, dtype: str, m: int, n: int, k: int) -> bool:
    """A forward worth fusing: ReLU or GELU (without an activation XLA fuses the bias
    itself) on a large layer (small ones are bound by host time) in a dtype where fusing
    measured faster, on whole or padded rows."""
    policy = get_policy()
    return (
        known_sizes(m, n, k) and activation is not None and dtype in policy.auto_dtypes
        and m >= policy.auto_min_rows and m * n * k >= policy.auto_min_work and fast_rows(m, n, k, dtype)
    )  # fmt: skip


def _auto_fuses_alone(activation: Activation | None, dtype: str, m: int, n: int, k: int) -> bool:
    """``fused_dense``'s rule: ``auto_fuses``, except a ReLU layer whose N the call pads
    (XLA's expression on the padded rows ties it; ``fused_mlp`` keeps the fused kernel
    where its mask serves the backward)."""
    if not auto_fuses(activation, dtype, m, n, k):
        return False
    padded_relu = activation is Activation.RELU and pads_n(m, n, k, dtype)
    return not padded_relu or get_policy().auto_fuse_relu_padded_n


def _auto_pads(dtype: str, m: int, n: int, k: int) -> bool:
    """A half-precision layer with K or N unaligned that a fused call would pad: XLA's
    GEMMs are slow on such rows too, so XLA's expression runs on the padded operands."""
    if not known_sizes(m, n, k):
        return False
    return dtype in get_policy().auto_dtypes and not aligned_rows(n, k, dtype) and fast_rows(m, n, k, dtype)


def dense_implementation(
    implementation: str, act, dtype: str, ct: ComputeType, return_aux: bool, m, n, k
) -> str:
    """How ``fused_dense`` runs: "cublaslt" (the op and its backward), "fused forward"
    (the fused kernel's value, XLA's derivatives), "xla on padded rows" or "xla".

    With "auto", what XLA's expression cannot compute (the aux, 16-bit compute types) runs
    the op; the backward is always XLA's autodiff, which measured at least as fast."""
    if implementation != "auto":
        return implementation
    if return_aux or ct not in XLA_COMPUTE_TYPES:
        return "cublaslt"
    if _auto_fuses_alone(act, dtype, m, n, k):
        return "fused forward"
    if _auto_pads(dtype, m, n, k):
        return "xla on padded rows"
    return "xla"


class MlpChoice(NamedTuple):
    """``fused_mlp``'s plan: ``link`` (a GELU layer's derivative inside the next layer's
    input-gradient GEMM), ``fused`` (per layer: the fused kernel and its aux in a linked
    block), ``stack`` (every layer as "cublaslt", unlinked)."""

    link: bool
    fused: tuple[bool, ...]
    stack: bool


def mlp_choice(implementation: str, activations, dtype: str, m: int, widths: list[int]) -> MlpChoice:
    """``widths`` = [K, N_0, N_1, ...]. "cublaslt" links every layer whose activation
    links (GELU) to the layer it feeds; "auto" follows the measured rules, on known sizes,
    whole or padded rows, in ``Policy.auto_dtypes``."""
    policy, pairs = get_policy(), list(itertools.pairwise(widths))
    links = any(act is not None and ACTIVATIONS[act].links for act in activations[:-1])
    auto = (
        implementation == "auto" and dtype in policy.auto_dtypes and known_sizes(m, *widths)
        and all(fast_rows(m, n, k, dtype) for k, n in pairs)
    )  # fmt: skip
    link = links and (implementation == "cublaslt" or (auto and m >= policy.link_min_rows))
    # Large GELU layers, and large ReLU layers whose output the next layer's GEMM reads.
    fused = tuple(
        auto and (act is Activation.GELU or (act is Activation.RELU and i < len(pairs) - 1))
        and auto_fuses(act, dtype, m, pairs[i][1], pairs[i][0])
        for i, act in enumerate(activations)
    )  # fmt: skip
    low, high = policy.stack_rows
    stack = (
        auto and len(pairs) > 1 and low <= m <= high and max(m * k * n for k, n in pairs) >= policy.stack_min_work
    )  # fmt: skip
    return MlpChoice(link=link and dtype != "float64", fused=fused, stack=stack)
