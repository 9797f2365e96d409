"""Every tuned number of the library, in one frozen object.

Each field has a one-line rule in its ``metadata`` and its evidence (what was measured,
on which GPU, the command that reproduces it) in ``docs/decisions.md``, under the anchor
that ``metadata["evidence"]`` names. Code reads the numbers through ``get_policy()``; tests
and benchmarks change them with ``override_policy``, never by patching module globals.

The policy is read when a program is traced and lowered (the "auto" rules, row padding)
or when a plan is made (autotuning, replay): a program traced before an override keeps the
numbers it was traced with (JAX caches traces per function; ``jax.clear_caches()`` drops
them).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator

__all__ = ["Policy", "get_policy", "override_policy"]

_DECISIONS = "docs/decisions.md#"


def _field(default, rule: str, anchor: str):
    return dataclasses.field(default=default, metadata={"rule": rule, "evidence": _DECISIONS + anchor})


def _env_flag(name: str) -> bool:
    """An on/off switch from the environment: on unless set to "0"."""
    return os.environ.get(name, "1") != "0"


@dataclasses.dataclass(frozen=True)
class Policy:
    """The tuned numbers behind ``implementation="auto"``, row padding, autotuning and replay.

    Example::

        import jax_epilog

        with jax_epilog.override_policy(auto_min_rows=4096):
            y = jax.jit(layer)(x)  # traced with the changed rule

    ``Policy.rules()`` lists every field with its rule and where its evidence is.
    """

    # fused_dense's "auto": which forward passes run the fused kernel.
    auto_dtypes: tuple[str, ...] = _field(
        ("bfloat16", "float16"), "operand dtypes whose layers 'auto' may fuse", "auto-forward"
    )
    auto_min_rows: int = _field(1024, "'auto' fuses a layer's forward from this many rows", "auto-forward")
    auto_min_work: int = _field(2**33, "... and from this M*N*K", "auto-forward")
    auto_fuse_relu_padded_n: bool = _field(
        False, "'auto' fuses a ReLU layer whose N the call pads", "auto-relu-padded-n"
    )
    # fused_mlp's "auto".
    link_min_rows: int = _field(
        8192, "fused_mlp links a GELU layer to the next GEMM (DGELU) from this many rows", "mlp-link"
    )
    stack_rows: tuple[int, int] = _field(
        (512, 1536), "fused_mlp runs every layer on cuBLASLt for row counts in this band", "mlp-stack"
    )
    stack_min_work: int = _field(2**31, "... when some layer has at least this M*N*K", "mlp-stack")
    # The backward.
    relu_bgrad_epilog: bool = _field(
        False,
        "ReLU's kernel and bias gradients from one BGRADA GEMM (else XLA's GEMM and reduction)",
        "relu-bgrad",
    )
    # Row padding: cuBLASLt's fast kernels want rows a multiple of 16 bytes apart.
    row_bytes: int = _field(
        16, "large calls pad K and N to whole rows of this many bytes (1: never)", "row-padding"
    )
    pad_min_rows: int = _field(1024, "a call pads its rows from this many rows", "row-padding")
    pad_min_work: int = _field(2**32, "... and from this M*N*K (times the members)", "row-padding")
    wide_row_bytes: int = _field(
        128, "a half-precision forward without aux pads N to this many bytes", "wide-rows"
    )
    wide_min_n: int = _field(1024, "... where N is at least this", "wide-rows")
    # Planning.
    autotune: bool = _field(
        _env_flag("JAX_EPILOG_AUTOTUNE"),
        "time cuBLASLt's candidates at lowering (env JAX_EPILOG_AUTOTUNE=0: off)",
        "autotuning",
    )
    tuning_candidates: int = _field(16, "how many of cuBLASLt's heuristic candidates to time", "autotuning")
    tuning_graph_us: float = _field(
        200.0, "about this much GPU work per candidate's timed CUDA graph", "autotuning"
    )
    tuning_min_runs: int = _field(5, "... but at least this many runs of the candidate", "autotuning")
    tuning_max_runs: int = _field(50, "... and at most this many", "autotuning")
    tuning_warm_us: float = _field(100_000.0, "GPU work to warm up with before timing", "autotuning")
    tuning_warm_graphs: int = _field(20, "... in at most this many graphs", "autotuning")
    heuristic_workspace: int = _field(
        64 << 20, "the most workspace (bytes) a candidate may ask for", "heuristic-workspace"
    )
    splitk_any_reduction: bool = _field(
        False, "allow split-K partial sums reduced outside the compute type", "splitk-reduction"
    )
    # FP8.
    fp8_fast_accum: tuple[str, ...] = _field(
        ("forward",),
        "FP8 problems ('forward', 'dgrad', 'wgrad') accumulated in the tensor cores' fast mode",
        "fp8-fast-accum",
    )
    fp8_wgrad_in_xla: bool = _field(
        True,
        "the FP8 kernel gradient (x^T dz, no epilog) is XLA's own FP8 GEMM, not the custom call",
        "fp8-wgrad",
    )
    fp8_dgelu: bool = _field(
        False,
        "fused_mlp in FP8 applies GELU's derivative in the input-gradient GEMM (DGELU epilog)",
        "fp8-dgelu",
    )
    fp8_fused_dz: bool = _field(
        True,
        "under delayed scaling an FP8 layer's dz, its E5M2 copy, bias gradient and amax come "
        "from one Pallas pass (where its tile divides dz), not XLA's passes",
        "fp8-fused-dz",
    )
    fp8_fused_dz_block: tuple[int, int] = _field(
        (64, 128), "rows and columns of dz per program of that pass (powers of two)", "fp8-fused-dz"
    )
    fp8_command_buffers: bool = _field(
        False,
        "XLA may capture the FP8 custom calls into its command buffers (False: they run outside)",
        "fp8-command-buffers",
    )
    # Replay of one-GEMM CUDA graphs outside XLA's command buffers.
    replay: bool = _field(
        _env_flag("JAX_EPILOG_REPLAY"),
        "replay a captured graph for repeated pointers (env JAX_EPILOG_REPLAY=0: off)",
        "replay",
    )
    replay_after: int = _field(
        2, "capture a graph on the n-th call with the same stream and pointers", "replay"
    )
    replay_graphs: int = _field(
        256, "graphs kept per plan (a plan that drops as many stops replaying)", "replay"
    )

    @classmethod
    def rules(cls) -> list[tuple[str, object, str, str]]:
        """``(field, default, rule, evidence)`` for every field."""
        return [
            (f.name, f.default, f.metadata["rule"], f.metadata["evidence"]) for f in dataclasses.fields(cls)
        ]


_lock = threading.Lock()
_current = Policy()


def get_policy() -> Policy:
    """The policy in force (the defaults, or an ``override_policy`` block's)."""
    return _current


@contextlib.contextmanager
def override_policy(**changes) -> Iterator[Policy]:
    """Run a block with some of the policy's fields changed; yields the policy in force.

    Programs traced (and plans made) inside the block use the changed numbers. JAX caches
    a function's trace: a function traced before the block keeps its program, even when
    jitted again inside it, until ``jax.clear_caches()`` or for a new function object.
    Raises TypeError for a name that is not a field.
    """
    global _current
    unknown = set(changes) - {f.name for f in dataclasses.fields(Policy)}
    if unknown:
        raise TypeError(
            f"override_policy: unknown fields {sorted(unknown)}; allowed: {[f.name for f in dataclasses.fields(Policy)]}."
        )
    with _lock:
        previous = _current
        _current = dataclasses.replace(previous, **changes)
    try:
        yield _current
    finally:
        with _lock:
            _current = previous
