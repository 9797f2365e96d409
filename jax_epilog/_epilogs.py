"""The epilog table: activations, compute types, cuBLASLt epilog names and the aux layout.

This module is pure data and arithmetic. It imports neither nvmath nor anything that
touches a GPU, so the CPU path, the validation and the GPU path all share one truth.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import numpy as np

__all__ = [
    "Activation",
    "ComputeType",
    "EpilogSpec",
    "aux_columns",
    "aux_dtype",
    "aux_padded_width",
    "buffer_elements",
    "default_compute_type",
    "epilog_name",
    "known_sizes",
    "valid_compute_types",
]


class Activation(str, enum.Enum):
    """Activations that cuBLASLt can apply in the GEMM epilog.

    ``GELU`` is cuBLASLt's GELU: the tanh approximation, i.e.
    ``jax.nn.gelu(z, approximate=True)``. There is no exact-erf GELU epilog.
    """

    RELU = "relu"
    GELU = "gelu"


class ComputeType(enum.IntEnum):
    """cuBLAS compute types (values of ``cublasComputeType_t``).

    The names and values equal ``nvmath.linalg.advanced.MatmulComputeType``'s, so either
    enum, or the name as a string, may be passed as ``compute_type``.
    """

    COMPUTE_16F = 64
    COMPUTE_16F_PEDANTIC = 65
    COMPUTE_32F = 68
    COMPUTE_32F_PEDANTIC = 69
    COMPUTE_64F = 70
    COMPUTE_64F_PEDANTIC = 71
    COMPUTE_32F_FAST_16F = 74
    COMPUTE_32F_FAST_16BF = 75
    COMPUTE_32F_FAST_TF32 = 77


_CT = ComputeType
_HALF_32F = (_CT.COMPUTE_32F, _CT.COMPUTE_32F_PEDANTIC)
# What cuBLASLt runs for each operand dtype (nvmath 1.0's `is_supported` table, less the
# FP8/complex rows). Keyed by (operand dtype, bias dtype is float32 while operands are half).
_VALID_COMPUTE_TYPES: dict[tuple[str, bool], tuple[ComputeType, ...]] = {
    ("float16", False): (*_HALF_32F, _CT.COMPUTE_16F, _CT.COMPUTE_16F_PEDANTIC),
    # float32 bias with half operands runs with a float32 epilog (see _dense.py): a 16-bit
    # accumulator cannot feed it.
    ("float16", True): _HALF_32F,
    ("bfloat16", False): _HALF_32F,
    ("bfloat16", True): _HALF_32F,
    ("float32", False): (
        *_HALF_32F,
        _CT.COMPUTE_32F_FAST_TF32,
        _CT.COMPUTE_32F_FAST_16F,
        _CT.COMPUTE_32F_FAST_16BF,
    ),
    # float64 never reaches cuBLASLt: it runs on XLA's path everywhere (documented).
    ("float64", False): (_CT.COMPUTE_64F, _CT.COMPUTE_64F_PEDANTIC),
}

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
HALF_DTYPES = ("float16", "bfloat16")


def valid_compute_types(dtype: str, f32_bias: bool) -> tuple[ComputeType, ...]:
    return _VALID_COMPUTE_TYPES[(dtype, f32_bias)]


def known_sizes(*sizes) -> bool:
    """Whether every size is a number, not a symbolic dimension (``jax.export``'s shape
    polymorphism), which a size rule cannot compare and a cuBLASLt plan cannot take."""
    return all(isinstance(size, int) for size in sizes)


def default_compute_type(dtype: str) -> ComputeType:
    """32-bit accumulation for half and single precision, 64-bit for double."""
    return _CT.COMPUTE_64F if dtype == "float64" else _CT.COMPUTE_32F


def epilog_name(activation: Activation | None, has_bias: bool, with_aux: bool) -> str:
    """The ``cublasLtEpilogue_t`` name (without prefix), e.g. ``"RELU_AUX_BIAS"``."""
    if activation is None:
        return "BIAS" if has_bias else "DEFAULT"
    parts = [activation.name]
    if with_aux:
        parts.append("AUX")
    if has_bias:
        parts.append("BIAS")
    return "_".join(parts)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def aux_padded_width(activation: Activation | str, n: int) -> int:
    """Length of the aux's last axis for ``n`` output features.

    cuBLASLt writes D as an (N x M) column-major matrix, so each row of ``y`` is one
    column of D and one row of the aux:
      * ReLU: a bit-mask, bit ``j % 8`` of byte ``j // 8`` is ``z[j] > 0``; the row holds
        ``n`` bits padded to a multiple of 128 bits (cuBLASLt's leading-dimension rule),
        stored as uint8, so the width is ``round_up(n, 128) // 8`` bytes.
      * GELU: the pre-activation ``z``, padded to a multiple of 8 elements.
    The padding's contents are unspecified.
    """
    columns = aux_columns(activation, n)
    return columns // 8 if Activation(activation) is Activation.RELU else columns


def aux_columns(activation: Activation | str, n: int) -> int:
    """The most columns a fused call's D may have (its rows padded for cuBLASLt) while the
    aux keeps the layout of ``n`` columns (``aux_padded_width``): cuBLASLt lays the aux out
    by D's width, round_up(width, 8) values of z (GELU) or round_up(width, 128) bits (ReLU)
    to a row."""
    return _round_up(n, 128 if Activation(activation) is Activation.RELU else 8)


def aux_dtype(activation: Activation, epilog_dtype: np.dtype) -> np.dtype:
    """uint8 bits for ReLU; GELU keeps ``z`` in the epilog's (D's) dtype."""
    return np.dtype(np.uint8) if activation is Activation.RELU else np.dtype(epilog_dtype)


class EpilogSpec(NamedTuple):
    """Everything that fixes one cuBLASLt problem, in the GPU's column-major terms.

    ``m``, ``n``, ``k`` are the GEMM's sizes: the layer's, x (m, k) and kernel (k, n),
    with N and K padded to whole 16-byte rows where the call pads its operands (a half
    N of 1024 or more in a forward without aux to 128-byte rows: ``_primitive._padded_rows``).
    Three problems:

    * ``"forward"``: D[n, m] = act(A[n, k] @ B[k, m] + bias[n]) with A = kernel (row-major
      (k, n)) and B = x (row-major (m, k)): no transposes, and the bias runs along D's rows.
    * ``"wgrad"``: D[n, k] = A[n, m] @ B[k, m]^T with A = dz (row-major (m, n)) and B = x,
      so D is the row-major (k, n) kernel gradient; with the ``BGRADA`` epilog the same
      kernel also writes dbias[n] = sum_m A[n, m] (A reduced over the GEMM's inner
      dimension) into the bias pointer, in D's dtype.
    * ``"dgrad"``: D[k, m] = dgelu(A[k, n] @ B[n, m], aux) with A = the layer's kernel
      (row-major (k, n), read transposed) and B = dz (row-major (m, n)), so D is the
      row-major (m, k) input gradient multiplied by GELU's derivative at the aux: the
      previous GELU layer's pre-activation in that layer's forward aux layout (row-major
      (m, round_up(k, 8)), D's dtype). Epilog ``"DGELU"``: it turns this layer's dz into
      the previous layer's. No bias.

    A forward problem may be batched over ``members`` (an ensemble: ``vmap`` over stacked
    weights): one strided-batched GEMM whose member ``e`` reads x[e], kernel[e] and
    bias[e] and writes D[e] and aux[e], each operand's members contiguous, except the
    operands named in ``shared`` (comma-separated among "x", "kernel", "bias"), which every
    member reads whole (batch stride 0).
    """

    m: int
    n: int
    k: int
    epilog: str  # cublasLtEpilogue_t name, e.g. "GELU_AUX_BIAS"
    compute_type: str  # ComputeType name
    ab_dtype: str  # dtype of x and kernel (of x and dz for "wgrad", of dz and kernel for "dgrad")
    bias_dtype: str | None  # None without bias (for "wgrad": the dbias output's dtype)
    d_dtype: str  # dtype of D (and of the GELU aux)
    problem: str = "forward"  # or "wgrad", "dgrad"
    members: int = 1  # the batch of a "forward" problem
    shared: str = ""  # operands the members share, e.g. "x" or "kernel,bias"

    def is_shared(self, operand: str) -> bool:
        """Whether every member reads ``operand`` ("x", "kernel" or "bias") whole."""
        return operand in self.shared.split(",")

    @property
    def has_aux(self) -> bool:
        return "AUX" in self.epilog

    @property
    def activation(self) -> Activation | None:
        for act in Activation:
            if self.epilog.startswith(act.name):
                return act
        return None


def buffer_elements(s: EpilogSpec) -> tuple[int, int, int, int, int]:
    """Elements of A, B, D, the bias and the aux of problem ``s`` (see EpilogSpec), all
    members' (0 for one the problem lacks): the buffers the custom call must be handed."""
    if s.problem == "wgrad":  # A = dz, B = x, D = dkernel, the bias the dbias output
        return s.m * s.n, s.m * s.k, s.k * s.n, s.n if s.bias_dtype else 0, 0
    if s.problem == "dgrad":  # A = kernel, B = dz, D = dx, the aux the previous GELU's z
        return s.k * s.n, s.m * s.n, s.m * s.k, 0, s.m * aux_padded_width(Activation.GELU, s.k)
    aux = s.m * aux_padded_width(s.activation, s.n) if s.has_aux else 0  # ReLU: bytes
    sizes = (s.k * s.n, s.m * s.k, s.m * s.n, s.n if s.bias_dtype else 0, aux)
    counts = [1 if s.is_shared(o) else s.members for o in ("kernel", "x", "d", "bias", "aux")]
    return tuple(size * count for size, count in zip(sizes, counts))
