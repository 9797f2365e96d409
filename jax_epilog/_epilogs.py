"""The epilog table: activations, operand dtypes, compute types and the aux layout.

Pure data and arithmetic: no nvmath, nothing that touches a GPU, so validation, the CPU
path and the GPU path share one truth. A new activation is a row of ``ACTIVATIONS`` (plus
its math in ``_reference``); a new operand dtype a row of ``COMPUTE_TYPES``.
"""

from __future__ import annotations

import enum
import math
from typing import NamedTuple

import ml_dtypes  # noqa: F401 -- registers bfloat16 (and float8) with NumPy
import numpy as np

__all__ = [
    "ACTIVATIONS",
    "Activation",
    "ActivationRow",
    "ComputeType",
    "EpilogSpec",
    "aux_columns",
    "aux_dtype",
    "aux_padded_width",
    "buffer_bytes",
    "buffer_elements",
    "check_buffers",
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


class ActivationRow(NamedTuple):
    """How cuBLASLt's epilog handles one activation.

    ``aux_bits``: the aux holds one bit per output (``z > 0``, packed eight to a uint8)
    instead of ``z`` itself in the epilog's dtype. ``aux_multiple``: cuBLASLt's aux rows
    hold a multiple of this many columns. ``links``: ``fused_mlp`` may multiply by the
    derivative inside the next layer's input-gradient GEMM (cuBLASLt's ``D<NAME>`` epilog,
    reading this aux); ReLU's DRELU measured slower than XLA's ops, so it does not link.
    """

    aux_bits: bool
    aux_multiple: int
    links: bool


ACTIVATIONS: dict[Activation, ActivationRow] = {
    Activation.RELU: ActivationRow(aux_bits=True, aux_multiple=128, links=False),
    Activation.GELU: ActivationRow(aux_bits=False, aux_multiple=8, links=True),
}


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
_32F = (_CT.COMPUTE_32F, _CT.COMPUTE_32F_PEDANTIC)
_FAST = (_CT.COMPUTE_32F_FAST_TF32, _CT.COMPUTE_32F_FAST_16F, _CT.COMPUTE_32F_FAST_16BF)


class DtypeRow(NamedTuple):
    """One operand dtype: the compute types cuBLASLt runs it with (the first is the
    default), and those allowed beside a float32 bias (half dtypes only: a 16-bit
    accumulator cannot feed a float32 epilog). ``fused``: cuBLASLt has epilogs for it
    (float64 runs on XLA's path everywhere)."""

    compute_types: tuple[ComputeType, ...]
    with_f32_bias: tuple[ComputeType, ...] = ()
    fused: bool = True


# nvmath 1.0's supported table, less the FP8 and complex rows.
COMPUTE_TYPES: dict[str, DtypeRow] = {
    "float16": DtypeRow((*_32F, _CT.COMPUTE_16F, _CT.COMPUTE_16F_PEDANTIC), _32F),
    "bfloat16": DtypeRow(_32F, _32F),
    "float32": DtypeRow((*_32F, *_FAST)),
    "float64": DtypeRow((_CT.COMPUTE_64F, _CT.COMPUTE_64F_PEDANTIC), fused=False),
}
SUPPORTED_DTYPES = tuple(COMPUTE_TYPES)
# The compute types XLA's plain expression reproduces (with Precision.HIGHEST or DEFAULT).
XLA_COMPUTE_TYPES = (*_32F, _CT.COMPUTE_32F_FAST_TF32, _CT.COMPUTE_64F, _CT.COMPUTE_64F_PEDANTIC)
HALF_DTYPES = tuple(name for name in COMPUTE_TYPES if COMPUTE_TYPES[name].with_f32_bias)


def valid_compute_types(dtype: str, f32_bias: bool) -> tuple[ComputeType, ...]:
    row = COMPUTE_TYPES[dtype]
    return row.with_f32_bias if f32_bias else row.compute_types


def default_compute_type(dtype: str) -> ComputeType:
    """32-bit accumulation for half and single precision, 64-bit for double."""
    return COMPUTE_TYPES[dtype].compute_types[0]


def known_sizes(*sizes) -> bool:
    """Whether every size is a number, not a symbolic dimension (``jax.export``'s shape
    polymorphism), which a size rule cannot compare and a cuBLASLt plan cannot take."""
    return all(isinstance(size, int) for size in sizes)


def epilog_name(activation: Activation | None, has_bias: bool, with_aux: bool) -> str:
    """The ``cublasLtEpilogue_t`` name (without prefix), e.g. ``"RELU_AUX_BIAS"``."""
    if activation is None:
        return "BIAS" if has_bias else "DEFAULT"
    parts = [activation.name, *(["AUX"] if with_aux else []), *(["BIAS"] if has_bias else [])]
    return "_".join(parts)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def aux_columns(activation: Activation | str, n: int) -> int:
    """Columns in a row of the aux for ``n`` outputs: cuBLASLt lays the aux out by D's
    width, rounded up to ``aux_multiple``; also the widest a fused call's D may be padded
    to while its aux keeps this layout."""
    return _round_up(n, ACTIVATIONS[Activation(activation)].aux_multiple)


def aux_padded_width(activation: Activation | str, n: int) -> int:
    """Length of the aux's last axis for ``n`` output features.

    Each row of ``y`` is one row of the aux:
      * ReLU: a bit-mask, bit ``j % 8`` of byte ``j // 8`` is ``z[j] > 0``; ``n`` bits
        padded to a multiple of 128, stored as uint8: ``round_up(n, 128) // 8`` bytes.
      * GELU: the pre-activation ``z``, padded to a multiple of 8 elements.
    The padding's contents are unspecified.
    """
    columns = aux_columns(activation, n)
    return columns // 8 if ACTIVATIONS[Activation(activation)].aux_bits else columns


def aux_dtype(activation: Activation, epilog_dtype) -> np.dtype:
    """uint8 bits, or ``z`` in the epilog's (D's) dtype."""
    return np.dtype(np.uint8) if ACTIVATIONS[activation].aux_bits else np.dtype(epilog_dtype)


class EpilogSpec(NamedTuple):
    """Everything that fixes one cuBLASLt problem, in the GPU's column-major terms.

    ``m``, ``n``, ``k`` are the layer's sizes: x (m, k) and kernel (k, n), with N and K
    padded to whole rows where the call pads its operands (``_padding.padded_spec``).
    Three problems:

    * ``"forward"``: D[n, m] = act(A[n, k] @ B[k, m] + bias[n]) with A = kernel (row-major
      (k, n)) and B = x (row-major (m, k)): no transposes, and the bias runs along D's rows.
    * ``"wgrad"``: D[n, k] = A[n, m] @ B[k, m]^T with A = dz (row-major (m, n)) and B = x:
      the row-major (k, n) kernel gradient; the ``BGRADA`` epilog also writes
      dbias[n] = sum_m A[n, m] into the bias pointer, in D's dtype.
    * ``"dgrad"``: D[k, m] = dgelu(A[k, n] @ B[n, m], aux) with A = the kernel (read
      transposed) and B = dz: the row-major (m, k) input gradient times GELU's derivative
      at the aux, the previous GELU layer's pre-activation in its forward aux layout
      (row-major (m, round_up(k, 8)), D's dtype). Epilog ``"DGELU"``, no bias.

    A forward problem may be batched over ``members`` (an ensemble: ``vmap`` over stacked
    weights): one strided-batched GEMM whose member ``e`` reads x[e], kernel[e], bias[e]
    and writes D[e] and aux[e], except the operands named in ``shared`` (comma-separated
    among "x", "kernel", "bias"), which every member reads whole (batch stride 0).
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
        return next((act for act in Activation if self.epilog.startswith(act.name)), None)

    @property
    def aux_bits(self) -> bool:
        """Whether the aux is a bit-mask (one byte per eight outputs)."""
        return self.problem == "forward" and self.has_aux and ACTIVATIONS[self.activation].aux_bits

    def call_pointers(self, ins, outs) -> tuple[int, ...]:
        """The GEMM's (A, B, D, bias, aux) from a call's operand and result pointers: the
        bias is the forward's input or wgrad's dbias output, the aux the forward's output
        or dgrad's input."""
        arg2, ret1 = (ins[2] if len(ins) > 2 else 0), (outs[1] if len(outs) > 1 else 0)
        if self.problem == "forward":  # (x, kernel[, bias]) -> (D[, aux])
            return ins[1], ins[0], outs[0], arg2, ret1
        if self.problem == "wgrad":  # (x, dz) -> (dkernel, dbias)
            return ins[1], ins[0], outs[0], ret1, 0
        return ins[1], ins[0], outs[0], 0, arg2  # dgrad: (dz, kernel, aux) -> D

    def matrix_pointers(self, pointers) -> tuple[int, ...]:
        """The pointers whose alignment a plan promises cuBLASLt: all of them."""
        return tuple(pointers)


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


def buffer_bytes(s: EpilogSpec) -> tuple[int, int, int, int, int]:
    """Bytes of A, B, D, the bias and the aux of problem ``s``, all members'."""
    ab, d = np.dtype(s.ab_dtype).itemsize, np.dtype(s.d_dtype).itemsize
    bias = np.dtype(s.bias_dtype).itemsize if s.bias_dtype else 0
    aux = 1 if s.aux_bits else d  # bits, or z in D's dtype
    return tuple(count * size for count, size in zip(buffer_elements(s), (ab, ab, d, bias, aux)))


# Which of buffer_elements' (A, B, D, bias, aux) each problem's operands and results are.
_BUFFERS = {
    "forward": ((1, 0, 3), (2, 4)),  # (x, kernel[, bias]) -> (D[, aux])
    "wgrad": ((1, 0), (2, 3)),  # (x, dz) -> (dkernel[, dbias])
    "dgrad": ((1, 0, 4), (2,)),  # (dz, kernel, aux) -> (dx,)
}


def check_buffers(operand_shapes, result_shapes, spec: EpilogSpec) -> None:
    """Raise unless a custom call's buffers (by shape) are exactly those ``spec``'s GEMM
    reads and writes: the FFI handler trusts its problem and checks no size at run time."""
    sizes = buffer_elements(spec)
    for role, buffers, wanted in zip(
        ("operands", "results"), (operand_shapes, result_shapes), _BUFFERS[spec.problem]
    ):
        got = [math.prod(shape) for shape in buffers]
        want = [sizes[i] for i in wanted][: len(got)]
        if got != want or any(sizes[i] for i in wanted[len(got) :]):
            raise RuntimeError(
                f"jax_epilog bug: the custom call for {spec} was given {role} of {got} elements, "
                f"where its GEMM needs {[sizes[i] for i in wanted if sizes[i]]}"
            )
