"""The FP8 GEMM's table: which operand dtypes pair, and ``Fp8Spec``, one FP8 problem with
its buffers in call order. Pure data, like ``_epilogs``: no nvmath, no GPU."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

from ._epilogs import Activation, aux_columns

__all__ = ["FP8_DTYPES", "FP8_PAIRS", "FP8_ROW", "Fp8Spec", "check_fp8_buffers", "scaled_operands"]

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
# The operand pairs cuBLASLt multiplies (E5M2 x E5M2 is not one).
FP8_PAIRS = (
    ("float8_e4m3fn", "float8_e4m3fn"),
    ("float8_e4m3fn", "float8_e5m2"),
    ("float8_e5m2", "float8_e4m3fn"),
)
FP8_ROW = 16  # FP8 GEMMs need K and N (each matrix's row) a multiple of 16 elements


def scaled_operands(epilog: str, d_dtype: str) -> tuple[str, ...]:
    """An FP8 GEMM's operands after its two matrices, in call order: the scales, D's scale
    (an FP8 D), the bias (an epilog with a bias input) and the DGELU input."""
    return (
        "p_scale", "q_scale",
        *(["d_scale"] if d_dtype in FP8_DTYPES else []),
        *(["bias"] if "BIAS" in epilog else []),  # (the BGRAD epilogs write theirs)
        *(["aux"] if epilog.startswith("DGELU") else []),
    )  # fmt: skip


class Fp8Spec(NamedTuple):
    """One FP8 GEMM with per-tensor scales, in row-major terms:

    ``D[m, n] = epilog(p_scale * q_scale * P[m, k] @ Q[n, k]^T + bias[n])``, P and Q both
    K-contiguous (the only FP8 layout Hopper runs: "TN" in cuBLAS's column-major terms,
    with A = Q and B = P). A forward layer is P = x, Q = the kernel transposed; its input
    gradient P = dz, Q = the kernel; its kernel gradient P = x^T, Q = dz^T.

    ``d_dtype`` FP8: D is written as ``saturate(D * d_scale)``. ``amax``: the epilog also
    writes max|D| (before D's scaling) as a float32 scalar. ``aux_dtype``: the GELU aux
    (``GELU_AUX*``: z written in this dtype, rows ``aux_ld`` apart) or the ``DGELU`` input.
    ``BGRADA``: the sum of Q over K written as a vector of ``bias_dtype`` (an output).
    """

    m: int
    n: int
    k: int
    epilog: str
    p_dtype: str
    q_dtype: str
    d_dtype: str
    bias_dtype: str | None = None
    aux_dtype: str | None = None
    amax: int = 1
    fast_accum: int = 0  # 1: the tensor cores' fast FP8 accumulation (no float32 promotion)
    problem: str = "fp8"

    members = 1  # (not a field: FP8 GEMMs are never batched)

    @property
    def d_fp8(self) -> bool:
        return self.d_dtype in FP8_DTYPES

    @property
    def bias_in(self) -> bool:
        return "bias" in self.operands()

    @property
    def aux_out(self) -> bool:
        return "AUX" in self.epilog

    @property
    def aux_in(self) -> bool:
        return self.epilog.startswith("DGELU")

    @property
    def aux_ld(self) -> int:
        return aux_columns(Activation.GELU, self.n)

    def operands(self) -> tuple[str, ...]:
        """The custom call's operands, in order."""
        return ("p", "q", *scaled_operands(self.epilog, self.d_dtype))

    def results(self) -> tuple[str, ...]:
        """The custom call's results, in order."""
        return (
            "d",
            *(["amax"] if self.amax else []),
            *(["aux"] if self.aux_out else []),
            *(["dbias"] if "BGRAD" in self.epilog else []),
        )

    def elements(self) -> dict[str, int]:
        """Elements of each buffer the GEMM reads or writes."""
        m, n, k = self.m, self.n, self.k
        sizes = {"p": m * k, "q": n * k, "d": m * n, "bias": n, "dbias": n, "aux": m * self.aux_ld}
        return sizes | {"p_scale": 1, "q_scale": 1, "d_scale": 1, "amax": 1}

    def call_pointers(self, ins, outs) -> tuple[int, ...]:
        """(A, B, D, then the rest in ``operands()``/``results()`` order) from a call's
        pointers: A = Q, B = P."""
        return (ins[1], ins[0], outs[0], *ins[2:], *outs[1:])

    def matrix_pointers(self, pointers) -> tuple[int, ...]:
        """The pointers whose alignment a plan promises cuBLASLt: not the float32 scalars."""
        names = (*self.operands()[2:], *self.results()[1:])
        return (
            *pointers[:3],
            *(p for p, name in zip(pointers[3:], names) if name in ("bias", "dbias", "aux")),
        )


@functools.cache
def _matrix_slots(spec: Fp8Spec) -> tuple[int, ...]:
    """Where ``call_pointers`` puts the matrices (A, B, D, bias, aux), once per problem:
    the FFI handler asks at every call."""
    names = ("q", "p", "d", *spec.operands()[2:], *spec.results()[1:])
    return tuple(i for i, name in enumerate(names) if name not in ("p_scale", "q_scale", "d_scale", "amax"))


def check_fp8_buffers(operand_shapes, result_shapes, spec: Fp8Spec) -> None:
    """Raise unless the custom call's buffers are exactly those ``spec`` reads and writes."""
    sizes = spec.elements()
    for role, shapes, names in (
        ("operands", operand_shapes, spec.operands()),
        ("results", result_shapes, spec.results()),
    ):
        got, want = [math.prod(s) for s in shapes], [sizes[name] for name in names]
        if got != want:
            raise RuntimeError(
                f"jax_epilog bug: the FP8 custom call for {spec} was given {role} of {got} "
                f"elements, where its GEMM needs {want} ({', '.join(names)})"
            )
