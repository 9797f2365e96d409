"""The library's warnings, each issued once per distinct reason."""

from __future__ import annotations

import functools
import warnings

__all__ = ["FastPathWarning", "MembersLoopWarning", "warn_once"]


class FastPathWarning(RuntimeWarning):
    """The fused cuBLASLt path could not be used on a GPU; XLA's unfused path ran instead."""


class MembersLoopWarning(RuntimeWarning):
    """cuBLASLt refused to batch an ensemble's members on a GPU: each member runs its own
    fused call instead, in a loop (or XLA's path, where cuBLASLt refuses that one too,
    with a FastPathWarning)."""


@functools.cache
def warn_once(
    reason: str, instead: str = "using XLA's unfused path on the GPU", category=FastPathWarning
) -> None:
    warnings.warn(f"jax_epilog: {instead}: {reason}", category, stacklevel=2)
