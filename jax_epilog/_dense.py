"""``fused_dense``: the public op, checked at trace time, differentiable through its aux."""

from __future__ import annotations

import enum
import functools
import math
from typing import NamedTuple

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero

from . import _reference
from ._epilogs import (
    HALF_DTYPES,
    SUPPORTED_DTYPES,
    Activation,
    ComputeType,
    default_compute_type,
    known_sizes,
    valid_compute_types,
)
from ._primitive import (
    aligned_rows,
    fast_rows,
    fused_matmul,
    fused_weight_grad,
    on_padded_rows,
    padded_layer,
    pads_n,
)
from ._sharding import like

__all__ = ["fused_dense"]

_ACTIVATIONS = (None, *(a.value for a in Activation))


def _check_array(value, name: str, owner: str = "fused_dense") -> None:
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{owner}: {name} must be a JAX or NumPy array, got {type(value).__name__}")


def check_layer(owner: str, x_shape, x, kernel, bias, activation, compute_type, x_name: str = "x"):
    """Validate one dense layer at trace time; returns (activation, dtype name, compute
    type, whether the bias is float32 beside half operands). Messages start with
    ``owner`` and call the input ``x_name``; ``x`` is anything with the input's dtype."""
    _check_array(kernel, "kernel", owner)
    if bias is not None:
        _check_array(bias, "bias", owner)
    act = _activation(activation, owner)
    dtype = _dtype_name(x)
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{owner}: {x_name} has dtype {dtype}; allowed: {SUPPORTED_DTYPES}.")
    if _dtype_name(kernel) != dtype:
        raise TypeError(
            f"{owner}: kernel dtype {_dtype_name(kernel)} differs from {x_name} dtype {dtype}; "
            "cast one of them so both match."
        )
    if len(x_shape) < 1:
        raise ValueError(f"{owner}: {x_name} must have shape (..., K), got a scalar of shape {x_shape}.")
    if kernel.ndim != 2:
        raise ValueError(f"{owner}: kernel must have shape (K, N), got shape {kernel.shape}.")
    k, n = kernel.shape
    if x_shape[-1] != k:
        raise ValueError(
            f"{owner}: {x_name}'s last dimension {x_shape[-1]} (shape {x_shape}) must equal "
            f"kernel's first dimension K={k} (shape {kernel.shape})."
        )
    f32_bias = False
    if bias is not None:
        if bias.shape != (n,):
            raise ValueError(f"{owner}: bias must have shape (N,) = ({n},), got shape {bias.shape}.")
        b_dtype = _dtype_name(bias)
        f32_bias = dtype in HALF_DTYPES and b_dtype == "float32"
        if b_dtype != dtype and not f32_bias:
            allowed = [dtype, "float32"] if dtype in HALF_DTYPES else [dtype]
            raise TypeError(
                f"{owner}: bias dtype {b_dtype} does not fit {dtype} operands; allowed: {allowed}."
            )
    return act, dtype, _compute_type(compute_type, dtype, f32_bias, owner), f32_bias


def _dtype_name(value) -> str:
    """The dtype JAX will compute in (NumPy float64 is float32 unless x64 is enabled)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(value.dtype)).name


def _activation(value, owner: str = "fused_dense") -> Activation | None:
    if value is None or isinstance(value, Activation):
        return value
    if isinstance(value, str) and value in _ACTIVATIONS:
        return Activation(value)
    hint = ""
    if isinstance(value, str) and "gelu" in value.lower():
        hint = (
            " cuBLASLt's only GELU is the tanh approximation (activation='gelu'); for the exact"
            " erf GELU apply jax.nn.gelu(y, approximate=False) to fused_dense(..., activation=None)."
        )
    raise ValueError(f"{owner}: unknown activation {value!r}; allowed: {_ACTIVATIONS}.{hint}")


def _compute_type(value, dtype: str, f32_bias: bool, owner: str = "fused_dense") -> ComputeType:
    valid = valid_compute_types(dtype, f32_bias)
    if value is None:
        return default_compute_type(dtype)
    name = value if isinstance(value, str) else getattr(value, "name", None)
    if not isinstance(value, (str, enum.Enum)) or name not in ComputeType.__members__:
        raise ValueError(
            f"{owner}: unknown compute_type {value!r}; pass a MatmulComputeType or its "
            f"name; allowed for {dtype} operands: {[c.name for c in valid]}."
        )
    ct = ComputeType[name]
    if ct not in valid:
        bias_note = " with a float32 bias" if f32_bias else ""
        raise ValueError(
            f"{owner}: compute_type {ct.name} cannot run {dtype} operands{bias_note}; "
            f"allowed: {[c.name for c in valid]}."
        )
    return ct


def fused_dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | Activation | None = None,
    compute_type=None,
    return_aux: bool = False,
    implementation: str = "auto",
):
    """``act(x @ kernel + bias)`` as one cuBLASLt kernel on NVIDIA GPUs.

    Args:
      x: (..., K) array; its leading dimensions are the GEMM's M.
      kernel: (K, N) array (Flax's layout), the same dtype as ``x``.
      bias: (N,) array or None, in ``x``'s dtype, or float32 when ``x`` is float16 or
        bfloat16.
      activation: None, ``"relu"`` or ``"gelu"``. ``"gelu"`` is the tanh approximation,
        ``jax.nn.gelu(z, approximate=True)``: cuBLASLt has no exact-erf GELU epilog.
      compute_type: a ``nvmath.linalg.advanced.MatmulComputeType`` (or
        ``jax_epilog.ComputeType``) member or its name. Default: ``COMPUTE_32F`` (float32
        accumulation) for float16, bfloat16 and float32; ``COMPUTE_64F`` for float64.
        float32 also accepts ``COMPUTE_32F_FAST_TF32`` (and ``_FAST_16F``/``_FAST_16BF``),
        float16 ``COMPUTE_16F``; each type also as its ``_PEDANTIC`` form where cuBLAS has one.
        The ``_FAST`` types let cuBLASLt round float32 operands to TF32, float16 or bfloat16
        (it may keep more bits); the op's CPU path rounds them so (to nearest). Where
        ``"auto"`` or ``"xla"`` run XLA's expression (``_TF32``), its DEFAULT precision
        decides: TF32 on a GPU, float32 on a CPU.
      return_aux: also return the epilog's auxiliary output, which the backward pass uses:
        for ReLU a uint8 bit-mask of shape (..., round_up(N, 128) // 8) where bit ``j % 8``
        of byte ``j // 8`` is ``z[..., j] > 0``; for GELU the pre-activation ``z`` of shape
        (..., round_up(N, 8)); None without activation. Padding contents are unspecified.
      implementation: ``"auto"`` (default), ``"cublaslt"`` or ``"xla"``.
        ``"cublaslt"``: the fused cuBLASLt kernel on a GPU, and the backward below.
        ``"xla"``: the plain expression ``act(x @ kernel + bias)``, compiled and
        differentiated by XLA as if jax_epilog were not there (half dtypes round after
        each step, as XLA does; ``compute_type`` only as XLA can follow it: COMPUTE_32F,
        COMPUTE_32F_FAST_TF32, COMPUTE_64F, or a ``_PEDANTIC`` form of the first or last).
        ``"auto"``: whichever measured faster on the H200 (benchmarks/README.md):
        cuBLASLt for the forward of large bfloat16 and float16 GELU and ReLU layers
        (M >= 1024 rows and M*N*K >= 2**33; not ReLU where N is not a multiple of 8,
        see below) and for anything the XLA expression cannot
        reproduce (``return_aux=True``, 16-bit compute types); XLA's own expression and
        autodiff otherwise (no activation, small layers, float32), and always for the
        backward pass, where XLA's own autodiff measured at least as fast as the backward
        below under ``jax.grad`` of a summed output and in MLP blocks. (Where a ReLU
        layer's output is formed and its cotangent is an array, ``jax.vjp`` with a given
        ``dy``, ``"cublaslt"`` measured 1.15-1.18x XLA at 8192x1024->4096 on an H100 and
        0.99-1.03x at the other shapes timed: benchmarks/README.md, 2026-12-06 (am).)
        On a CPU everything runs XLA (``"cublaslt"``: the reference math below, with the
        GPU kernel's aux layout).
        Where K or N is not a multiple of 8 elements (of 4 in float32), on 1024 rows or
        more with M*N*K >= 2**32, the GPU call pads them with zeros to whole 16-byte rows
        (a half-precision N of 1024 or more to 128-byte rows in a forward without aux)
        and cuts its results back: cuBLASLt's kernels for other rows measured up to 18x
        slower (H100, benchmarks/README.md). The values are the same sums. XLA's GEMMs
        are as slow on unaligned rows, so on such layers the backward's GEMMs run on the
        padded rows too: "cublaslt"'s, and "auto"'s, which differentiates XLA's
        expression on the padded operands, from the padding's size floor on (in
        bfloat16 and float16; below "auto"'s fused floor, without an activation, and
        for ReLU where N pads, the forward too is XLA's expression on the padded
        operands).

    Returns:
      ``y`` of shape (..., N) in ``x``'s dtype, or ``(y, aux)`` with ``return_aux=True``.

    Numerics of the fused op (``"cublaslt"``, and ``"auto"`` where it runs cuBLASLt): the
    product is accumulated in the compute type; bias and activation are applied to that
    accumulator and the result is rounded to ``x``'s dtype (the CPU path rounds once; on
    the H200 cuBLASLt's epilog was measured to round the accumulator to the output dtype
    before the bias and to use a fast tanh for GELU: about one unit in the last place of
    ``z``, ~5e-6 absolute for float32 GELU). A float32 bias with half operands keeps exact
    float32 semantics, ``cast(act(x @ kernel + bias))`` with the sum in float32: the GEMM
    writes a float32 D with the epilog fused (cuBLASLt refuses a float32 bias beside a half
    D) and XLA casts it; the GELU aux is then float32. Where ``"auto"`` and ``"xla"`` run
    XLA's expression, the numerics are that expression's: half dtypes round after the
    matmul (also before a float32 bias is added), the bias and the activation.

    float64 runs on XLA's path everywhere (cuBLASLt has no float64 epilogs), as do a
    problem with an empty dimension, a single row with a float32 bias beside half operands
    (cuBLASLt 13.1 plans it but fails every launch: measured on the H200), and a problem
    cuBLASLt refuses at planning or tuning (a warning says so, once).
    Raises TypeError/ValueError at trace time for anything else it cannot compute.

    Differentiation: reverse mode (``jax.grad``, ``jax.vjp``) in ``x``, ``kernel`` and
    ``bias``, each gradient in its primal's dtype. With ``"cublaslt"`` the forward saves
    only ``x``, ``kernel``, the bias (for its type) and the aux (one bit per output for
    ReLU); the backward forms ``dz = dy * act'(z)`` from it (ReLU's derivative at ``z == 0`` is 0, as for ``jax.nn.relu``), and
    ``dx = dz @ kernel.T`` is XLA's GEMM. With a bias and GELU or no activation, the kernel
    and bias gradients come from one cuBLASLt GEMM whose epilog reduces dz (BGRADA); with
    ReLU from XLA's GEMM and a reduction of its own, which XLA fuses with forming dz from
    the mask (fwd+bwd 0.92-1.00x XLA at 8192x1024->4096 against 0.83-0.94x with BGRADA;
    benchmarks/README.md, 2026-12-04 (u)). With ``return_aux=True`` the GELU
    aux is differentiable (it is ``z``); the ReLU mask is not. Forward mode (``jax.jvp``,
    ``jax.jacfwd``) works with ``"xla"`` and ``"auto"``, whose derivatives are always those
    of the plain expression (even where the value is the fused kernel's); the op itself
    (``"cublaslt"``, and ``"auto"`` with ``return_aux=True`` or a 16-bit compute type) is a
    ``jax.custom_vjp`` and raises. A gradient differentiates again with every
    implementation (``jax.grad`` of a gradient, ``jax.hessian``): the fused primitives'
    own derivatives are their reference math's.
    """
    _check_array(x, "x")
    act, dtype, ct, f32_bias = check_layer("fused_dense", x.shape, x, kernel, bias, activation, compute_type)
    if not isinstance(return_aux, (bool, np.bool_)):
        raise TypeError(f"fused_dense: return_aux must be True or False, got {return_aux!r}.")
    k, n = kernel.shape
    impl = _implementation(implementation, ct, return_aux)
    m = math.prod(x.shape[:-1])
    if impl == "auto":
        # What XLA's expression cannot compute runs on cuBLASLt; a large layer runs the fused
        # kernel's forward with XLA's derivatives; everything else is XLA's expression.
        if return_aux or ct not in _XLA_COMPUTE_TYPES:
            impl = "cublaslt"
        elif _auto_fuses_alone(act, dtype, m, n, k):
            impl = "fused forward"
        elif _auto_pads(dtype, m, n, k):
            impl = "xla on padded rows"
        else:
            impl = "xla"

    config = _Config(
        activation=act,
        compute_type=ct,
        d_dtype="float32" if f32_bias else dtype,
        bias_dtype=None if bias is None else _dtype_name(bias),
        return_aux=return_aux,
    )
    if impl == "xla":
        return _plain(x, kernel, bias, config)  # the user's expression, leading dimensions and all
    if impl == "xla on padded rows":
        return _with_xla_derivatives(x, kernel, bias, config, False)
    # x goes to the op with its leading dimensions (one row: (1, K)): each device folds its
    # own rows, however they are split (a reshape here would be partitioned first).
    rows = x if x.ndim > 1 else x[None]
    if impl == "fused forward":
        y, aux = _with_xla_derivatives(rows, kernel, bias, config, True), None
    else:
        y, aux = _dense(rows, kernel, bias, config)
    if x.ndim == 1:
        y, aux = y[0], (None if aux is None else aux[0])
    return (y, aux) if return_aux else y


_IMPLEMENTATIONS = ("auto", "cublaslt", "xla")
# The compute types XLA's plain expression reproduces (with Precision.HIGHEST / DEFAULT).
_XLA_COMPUTE_TYPES = (
    ComputeType.COMPUTE_32F,
    ComputeType.COMPUTE_32F_PEDANTIC,
    ComputeType.COMPUTE_32F_FAST_TF32,
    ComputeType.COMPUTE_64F,
    ComputeType.COMPUTE_64F_PEDANTIC,
)


def _implementation(value, ct: ComputeType, return_aux: bool, owner: str = "fused_dense") -> str:
    if value not in _IMPLEMENTATIONS:
        raise ValueError(f"{owner}: unknown implementation {value!r}; allowed: {_IMPLEMENTATIONS}.")
    if value == "xla" and return_aux:
        raise ValueError(
            "fused_dense: return_aux=True needs the epilog's aux, which implementation='xla' does "
            "not compute; allowed with return_aux: ('auto', 'cublaslt')."
        )
    if value == "xla" and ct not in _XLA_COMPUTE_TYPES:
        raise ValueError(
            f"{owner}: implementation='xla' cannot accumulate as compute_type {ct.name}; "
            f"allowed: {[c.name for c in _XLA_COMPUTE_TYPES]} (or implementation='cublaslt')."
        )
    return value


# The operand dtypes whose layers "auto" may run on cuBLASLt: those it measured faster in.
_AUTO_DTYPES = ("bfloat16", "float16")


def _auto_fuses(activation: Activation | None, dtype: str, m: int, n: int, k: int) -> bool:
    """The "auto" rule for a forward pass (benchmarks/README.md, H200, autotuned): GELU
    or ReLU on a large bfloat16 or float16 layer. GELU: XLA leaves it unfused and the
    fused kernel measured 1.10-1.61x XLA at the three 8192-row shapes (the suite's four
    runs of 2026-12-03 (l)). ReLU: XLA fuses bias + ReLU into its own GEMM, and the fused kernel
    measured 1.00-1.06x in the same runs (0.99-1.01x at 8192x4096->16384 timed as pairs;
    0.94-0.98x there before the autotuner warmed the GPU up): a tie at worst. Not without
    an activation, where XLA fuses the bias: 0.97-1.07x at the full suite's four 8192-row
    shapes (2026-12-04 (x)), a tie the rule has no reason to take.
    Not small layers (fewer than 1024 rows or M*N*K < 2**33): as single jitted calls they
    are bound by host time, and since the handler replays a captured graph (~6 µs per call
    instead of ~23) the fused call measured 0.79-1.15x XLA there over two runs, and
    0.79-1.31x over 40 small-batch cases (16-256 rows, five weight sizes:
    benchmarks/probes/small_batch.py), without a pattern a rule could follow (0.63-0.84x
    before). Inside XLA's command buffers small fused layers do win (16-layer chains), but
    an op cannot know at tracing whether XLA will capture it.
    Float16 measured as bfloat16 does (the full suite, 2026-12-04 (x): 0.99-1.55x XLA at
    the four 8192-row shapes, bfloat16 1.01-1.58x). Not float32: at 8192x1024->4096 the
    fused kernel tied XLA with full float32 (1.00x) and with TF32 lost for GELU (0.95x:
    cuBLASLt's TF32 GELU kernel took 318 µs, XLA's GEMM and GELU pass 301).
    K or N not a multiple of 8: such layers are large enough for the call to pad its rows
    (``_primitive.fast_rows``); unpadded, cuBLASLt's kernels for them measured 0.08-0.87x
    XLA, padded 1.38-2.43x at 8192 rows (H100, 2026-12-05 (ah)); but see
    ``_auto_fuses_alone``."""
    if not known_sizes(m, n, k):
        return False
    return (
        activation is not None and dtype in _AUTO_DTYPES and m >= 1024 and m * n * k >= 2**33
        and fast_rows(m, n, k, dtype)
    )  # fmt: skip


def _auto_fuses_alone(activation: Activation | None, dtype: str, m: int, n: int, k: int) -> bool:
    """The "auto" rule for ``fused_dense``'s forward: ``_auto_fuses``, except a ReLU layer
    whose N the call pads, which runs XLA's expression on the same padded rows
    (``_auto_pads``): the padded fused kernel took 1.08-1.09x as long as that at
    8192x1024->4097 in six processes, 1.04-1.06x at 8192x1024->8193 in three and
    1.13-1.18x at 8192x1024->1025 in two (H100, 2026-12-06 (ak), (al):
    benchmarks/probes/row_padding.py, pad_width.py), N padded to 16-byte rows. Since the
    fused forward pads N to 128-byte rows (``_primitive._WIDE_ROW_BYTES``) it took 1.01-1.02x
    as long at 8192x1024->4097 (two processes) and, at 128-byte rows in pad_width,
    0.96x at 8192x1024->8193: about a tie, which "auto" leaves to XLA's program. Where only
    K pads (8192x1020->4096) the two tied. GELU layers stay fused: with N padded to 128-byte
    rows XLA's padded expression took 1.09-1.12x as long as the fused kernel at
    8192x1024->4097 and 8192x1024->8193, and where K pads 1.08-1.39x. (``fused_mlp`` keeps
    the fused ReLU kernel where its mask serves the backward: ``_auto_fuses``.)"""
    if not _auto_fuses(activation, dtype, m, n, k):
        return False
    return not (activation is Activation.RELU and pads_n(m, n, k, dtype))


def _auto_pads(dtype: str, m: int, n: int, k: int) -> bool:
    """The "auto" rule for a bfloat16 or float16 layer whose K or N is not a multiple of 8
    and that a fused call would pad (1024 rows or more, M*N*K >= 2**32:
    ``_primitive.fast_rows``), where ``_auto_fuses_alone`` does not fuse it (below its size
    floor, without an activation, or ReLU where N pads): XLA's own expression on the padded
    operands, forward and derivatives (``_with_xla_derivatives``). XLA's kernels for
    unaligned rows are slow: fwd+bwd so padded read 1.93-1.96x XLA at 4096x1024->1025 and
    1.36-1.39x at 1024x1024->4097 (GELU, H200 and H100, 2026-12-05 (ai)); without an
    activation, on an H100 (2026-12-06 (ak)), the padded forward read 1.31-2.08x XLA at
    1024-8192 rows and fwd+bwd 1.30-2.68x, and with GELU or ReLU below the fused floor the
    padded forward 1.31-1.46x (where the padded fused kernel read 0.86-1.28x)."""
    if not known_sizes(m, n, k):
        return False
    return dtype in _AUTO_DTYPES and not aligned_rows(n, k, dtype) and fast_rows(m, n, k, dtype)


def _plain(x, kernel, bias, config: _Config):
    tf32 = config.compute_type is ComputeType.COMPUTE_32F_FAST_TF32
    return _reference.plain(x, kernel, bias, config.activation, tf32)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _with_xla_derivatives(x, kernel, bias, config: _Config, fused: bool):
    """The layer's value where only the value is needed: the fused kernel (``fused``) or
    XLA's own expression, both on padded rows where K or N is unaligned on a large layer
    (``_plain_on_padded_rows``). Differentiated, in either mode, the plain expression with
    its own derivatives, on those rows: under ``jax.grad`` XLA's autodiff (measured faster
    for fwd+bwd), and forward mode (``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) as for
    any jnp code."""
    if fused:
        return _forward(x, kernel, bias, config, with_aux=False)[0]
    return _plain_on_padded_rows(x, kernel, bias, config)


def _xd_jvp(config: _Config, fused: bool, primals, tangents):
    # Only the differentiated arguments enter the expression's jvp, so an argument held
    # constant adds no product with a zero tangent, and reverse mode lowers to the very
    # program of the user's expression under jax.grad (tests/test_implementation.py), or,
    # where K or N is unaligned, of that expression on padded rows.
    live = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]

    def plain(*active):
        args = list(primals)
        for i, a in zip(live, active):
            args[i] = a
        return _plain_on_padded_rows(*args, config)

    return jax.jvp(plain, [primals[i] for i in live], [tangents[i] for i in live])


def _plain_on_padded_rows(x, kernel, bias, config: _Config):
    """``_plain`` on the operands padded as the fused call pads them (K or N unaligned on
    a large layer), the result cut back to N columns: the same sums, while XLA's program
    and its autodiff run their GEMMs on aligned rows, as fast as on the next aligned
    shape. XLA's kernels for unaligned rows are slow too: 245-311 µs at 8192x1024->4097
    and 8192x1020->4096 against 107-170 at 8192x1024->4096 (H100, 2026-12-05 (ah))."""
    return on_padded_rows(functools.partial(_plain, config=config), x, kernel, bias)


_with_xla_derivatives.defjvp(_xd_jvp, symbolic_zeros=True)


class _Config(NamedTuple):
    """The static half of a call: hashable, so it can be a custom_vjp nondiff argument."""

    activation: Activation | None
    compute_type: ComputeType
    d_dtype: str
    bias_dtype: str | None
    return_aux: bool


def _forward(x, kernel, bias, config: _Config, with_aux: bool):
    outs = fused_matmul(
        x,
        kernel,
        bias,
        activation=config.activation,
        with_aux=with_aux,
        compute_type=config.compute_type,
        d_dtype=config.d_dtype,
        out_dtype=x.dtype,
    )
    return outs[0], (outs[1] if len(outs) > 1 else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense(x, kernel, bias, config: _Config):
    """(..., k) x -> (y, aux or None), differentiable in x, kernel and bias."""
    return _forward(x, kernel, bias, config, with_aux=config.return_aux)


def _dense_fwd(x, kernel, bias, config: _Config):
    # The backward needs the aux (never z itself for ReLU: one bit per output), so the
    # forward always asks the epilog for it when there is an activation.
    y, aux = _forward(x, kernel, bias, config, with_aux=True)
    return (y, aux if config.return_aux else None), (x, kernel, bias, aux)


def _dense_bwd(config: _Config, residuals, cotangents):
    x, kernel, bias, aux = residuals  # (the bias for its type only)
    dy, daux = cotangents
    ct = config.compute_type
    dz_extra = None
    if config.activation is Activation.GELU and config.return_aux:
        dz_extra = daux[..., : kernel.shape[1]]  # the GELU aux is z: its cotangent adds to dz
    dz = _reference.output_grad(aux, dy, dz_extra, config.activation, ct, x.dtype)
    dx, dkernel, dbias = layer_grads(
        x, dz, kernel, config.activation, ct, config.d_dtype, config.bias_dtype
    )
    # Under explicit sharding each gradient takes its primal's type (e.g. a kernel split
    # along N whose GEMM gathered it: FSDP, or an aux that cannot split).
    return like(dx, x), like(dkernel, kernel), (None if dbias is None else like(dbias, bias))


_dense.defvjp(_dense_fwd, _dense_bwd)


def layer_grads(x, dz, kernel, activation, ct, d_dtype, bias_dtype, fused=True, input_grad=True):
    """A layer's (dx or None, dkernel, dbias or None) from its input x and its dz: ``dx``
    from XLA's GEMM (unless not ``input_grad``), the others from ``_weight_grads``. The
    GEMMs run on the rows a fused forward pads (K or N unaligned on a large layer), their
    results cut back after: XLA's kernels for unaligned rows are slow too
    (``_plain_on_padded_rows``)."""
    (k, n), (x_rows, kernel_rows, _) = kernel.shape, padded_layer(x, kernel, None)
    dz_rows = _reference.pad_to(dz, kernel_rows.shape[1])
    dx = _reference.input_grad(dz_rows, kernel_rows, ct)[..., :k] if input_grad else None
    dkernel, dbias = _weight_grads(x_rows, dz_rows, kernel_rows, activation, ct, d_dtype, bias_dtype, fused)
    return dx, dkernel[:k, :n], (None if dbias is None else dbias[:n])


def _weight_grads(x, dz, kernel, activation, ct, d_dtype, bias_dtype, fused: bool = True):
    """A layer's (dkernel, dbias or None) from its input and dz (summed over their leading
    dimensions, the rows), in the kernel's and bias's dtypes. Without a bias, a plain
    GEMM. With one (in ``d_dtype``: float32 beside a float32 bias), ``fused``: one cuBLASLt
    GEMM whose epilog reduces dz (BGRADA), except for ReLU, whose are XLA's GEMM and a
    reduction of its own (measured faster: fused_dense's docstring); else XLA's."""
    if bias_dtype is None:
        dkernel, dbias = _reference.weight_grad(x, dz, ct, kernel.dtype, with_bias=False)
    elif fused and activation is not Activation.RELU:
        dkernel, dbias = fused_weight_grad(x, dz, compute_type=ct, d_dtype=d_dtype)
    else:
        dkernel, dbias = _reference.weight_grad(x, dz, ct, d_dtype, with_bias=True)
    return dkernel.astype(kernel.dtype), (None if dbias is None else dbias.astype(bias_dtype))
