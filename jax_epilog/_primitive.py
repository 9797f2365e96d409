"""The primitives behind fused_dense: abstract evaluation, per-platform lowering, batching.

``fused_matmul_p`` is the forward (GEMM + bias + activation, optionally the aux);
``fused_weight_grad_p`` the backward's kernel-gradient GEMM with the bias gradient fused
into its epilog (cuBLASLt's BGRADA); ``fused_gelu_input_grad_p`` a layer's input-gradient
GEMM with the previous GELU layer's derivative fused into its epilog (cuBLASLt's DGELU).

On CUDA the primitive lowers to our FFI custom call when nvmath-python is importable and
cuBLASLt accepts the problem (checked by planning it at lowering time, so a refusal never
reaches a running program). Everywhere else, and for whatever the fast path cannot take
(float64, empty dimensions, a refused problem), it lowers to ``_reference.dense``: the same
outputs in the same aux layout. Falling back on a GPU is announced once with a warning.
Each primitive takes its rows with their leading dimensions (x of shape (batch, seq, K));
over several devices every lowering first splits it by rows, and by N where it can
(``_sharding``; each primitive's ``Layout`` says where its M and N are), and on CUDA each
device folds its block's rows into M around the call (``_with_rows_folded``). Each
primitive differentiates through its reference math (for derivatives of a gradient).
Batched weights (an ensemble) bind ``members_p`` for the forward, which splits the
members over the devices that hold them (explicit sharding included), each device's
members one batched cuBLASLt GEMM; the gradient primitives batch as their reference math:
XLA's batched GEMMs.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from . import _ffi, _reference
from ._epilogs import (
    Activation,
    ComputeType,
    EpilogSpec,
    aux_columns,
    aux_dtype,
    aux_padded_width,
    epilog_name,
    known_sizes,
)
from ._reference import pad_to
from ._sharding import (
    Layout,
    partitioned_lowering,
    shaped_like,
    typed,
    vary_alike,
    whole_leading,
)

__all__ = [
    "FastPathWarning",
    "MembersLoopWarning",
    "aligned_rows",
    "fast_rows",
    "fused_gelu_input_grad",
    "fused_matmul",
    "fused_weight_grad",
    "padded_layer",
    "pads_n",
]


class FastPathWarning(RuntimeWarning):
    """The fused cuBLASLt path could not be used on a GPU; XLA's unfused path ran instead."""


class MembersLoopWarning(RuntimeWarning):
    """cuBLASLt refused to batch an ensemble's members on a GPU: each member runs its own
    fused call instead, in a loop (or XLA's path, where cuBLASLt refuses that one too,
    with a FastPathWarning)."""


fused_matmul_p = Primitive("jax_epilog_fused_matmul")
fused_matmul_p.multiple_results = True


def fused_matmul(x, kernel, bias, *, activation, with_aux, compute_type, d_dtype, out_dtype):
    """(..., k) x, (k, n) kernel, (n,) bias or None -> [y] or [y, aux], each (..., width):
    x's leading dimensions (at least one) are the GEMM's rows."""
    operands = (x, kernel) if bias is None else (x, kernel, bias)
    return fused_matmul_p.bind(
        *vary_alike(*operands),
        activation=activation,
        with_aux=with_aux and activation is not None,
        compute_type=compute_type,
        d_dtype=np.dtype(d_dtype),
        out_dtype=np.dtype(out_dtype),
    )


def _abstract_eval(*args, activation, with_aux, compute_type, d_dtype, out_dtype, partitioned=False):
    del compute_type, partitioned
    x, kernel = args[:2]
    lead, n = x.shape[:-1], kernel.shape[1]
    results = [((*lead, n), out_dtype)]
    if with_aux:
        results.append(((*lead, aux_padded_width(activation, n)), aux_dtype(activation, d_dtype)))
    return typed(_layout(args, activation=activation, with_aux=with_aux), args, results)


def _layout(args, *, activation, with_aux, **params) -> Layout:
    """Over several devices: x's rows (M: its leading dimensions, each split as it comes)
    split as they come, y and the aux split alike; N split as the kernel's is (the bias and
    y alike, with or without an aux), the aux with it where it is unpadded and, for ReLU's
    bits, each device's N a multiple of 8."""
    del params
    has_bias, n, row_dims = len(args) == 3, args[1].shape[1], args[0].ndim - 1
    m = _row_factors(row_dims)

    def rule(n_factor, aux_factor=None):
        operands = f"{m} k, k {n_factor}" + f", {n_factor}" * has_bias
        return f"{operands} -> {m} {n_factor}" + (f", {m} {aux_factor}" if aux_factor else "")

    operand_cols = {1: 1, 2: 0} if has_bias else {1: 1}
    if not with_aux:
        return Layout(((0,), (0,)), (), (operand_cols, {0: 1}), rule("n"), whole=("k",), row_dims=row_dims)
    rows, cols = ((0,), (0, 1)), (operand_cols, {0: 1, 1: 1})
    relu = Activation(activation) is Activation.RELU
    if n % (128 if relu else 8):  # a padded aux cannot be cut along N: it stays whole
        return Layout(rows, (), cols, rule("n", "a"), whole=("k", "a"), packed=((1, 0),), row_dims=row_dims)
    if not relu:  # GELU: the aux is z itself, one factor for both
        return Layout(rows, (), cols, rule("n", "n"), whole=("k",), row_dims=row_dims)
    # ReLU: the aux holds N/8 bytes, so N is the compound of the aux's bytes and 8 bits.
    return Layout(
        rows, (), cols, rule("(a bits)", "a"), whole=("k", "bits"), factor_sizes=(("bits", 8),), packed=((1, 8),),
        row_dims=row_dims,
    )  # fmt: skip


def _row_factors(row_dims: int) -> str:
    """M in a Shardy rule: "m", or one factor a leading dimension ("m0 m1")."""
    return " ".join(f"m{i}" for i in range(row_dims)) if row_dims > 1 else "m"


fused_matmul_p.def_abstract_eval(_abstract_eval)


def _reference_impl(x, kernel, *bias, activation, with_aux, compute_type, d_dtype, out_dtype):
    d, aux = _reference.dense(
        x, kernel, bias[0] if bias else None, activation, compute_type, d_dtype, with_aux
    )
    outs = [d.astype(out_dtype)]
    return outs + [aux] if with_aux else outs


def _impl_of(primitive: Primitive):
    """Eager calls run the primitive jitted, compiled once per parameter set (also under
    ``jax.disable_jit()``, whose jit would bind the primitive again: endlessly)."""

    @functools.cache
    def jitted(params: tuple) -> callable:
        return jax.jit(functools.partial(primitive.bind, **dict(params)))

    def impl(*args, **params):
        with jax.disable_jit(False):
            return jitted(tuple(sorted(params.items())))(*args)

    return impl


def _jvp_of_reference(primitive: Primitive, reference):
    """Differentiation rule for ``primitive``: its own value, with the tangents of
    ``reference``, its math in plain XLA ops (which reverse mode can transpose), so that a
    gradient made of the fused primitives can be differentiated again (grad of grad,
    ``jax.hessian``). The tangents' GEMMs run as XLA's autodiff of the plain expression
    runs them (``compute_type=None``: in the operands' dtype; with the compute type's
    float32 products, their transposes became float32 GEMMs, 5x slower than XLA's second
    derivatives at 8192x1024->4096 on the H200), except that float32 GEMMs a ``_FAST``
    compute type lets round their operands keep it (TF32 on the GPU, as the "xla"
    implementation's). Such derivatives recompute what the tangents need (z for the
    activation's derivative) from the primals. Returns the rule's tangents alone (for
    ``members_p``'s rule)."""

    def tangents_of(primals, tangents, **params):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        compute_type = _reference.derivative_compute_type(params["compute_type"])
        as_xla = functools.partial(reference, **(params | {"compute_type": compute_type}))
        return jax.jvp(as_xla, list(primals), tangents)[1]

    def jvp(primals, tangents, **params):
        return primitive.bind(*primals, **params), tangents_of(primals, tangents, **params)

    ad.primitive_jvps[primitive] = jvp
    return tangents_of


fused_matmul_p.def_impl(_impl_of(fused_matmul_p))
_forward_tangents = _jvp_of_reference(fused_matmul_p, _reference_impl)
_reference_lowering = mlir.lower_fun(_reference_impl, multiple_results=True)
mlir.register_lowering(fused_matmul_p, partitioned_lowering(fused_matmul_p, _reference_lowering, _layout))


def spec_of(x_aval, kernel_aval, bias_aval, activation, with_aux, compute_type, d_dtype):
    return EpilogSpec(
        m=int(x_aval.shape[0]),
        n=int(kernel_aval.shape[1]),
        k=int(x_aval.shape[1]),
        epilog=epilog_name(activation, bias_aval is not None, with_aux),
        compute_type=ComputeType(compute_type).name,
        ab_dtype=np.dtype(x_aval.dtype).name,
        bias_dtype=None if bias_aval is None else np.dtype(bias_aval.dtype).name,
        d_dtype=np.dtype(d_dtype).name,
    )


@functools.cache
def _warn_once(reason: str, instead: str = "using XLA's unfused path on the GPU", category=FastPathWarning) -> None:
    warnings.warn(f"jax_epilog: {instead}: {reason}", category, stacklevel=2)


def _fast_path_refusal(spec: EpilogSpec) -> str | None:
    """Why the cuBLASLt path cannot serve ``spec`` (None when it can); plans if it can."""
    try:
        from . import _nvmath
    except ImportError as exc:
        return f"nvmath-python/cupy are not importable ({exc}); install jax_epilog[cuda12|cuda13]"
    try:
        _nvmath.get_plan(spec, _nvmath.current_device(), autotune=True)
    except _nvmath.PlanningError as exc:
        return str(exc)
    return None


def _symbolic(*avals) -> bool:
    """Whether a shape has a symbolic dimension (``jax.export``'s shape polymorphism)."""
    return not known_sizes(*(d for a in avals for d in a.shape))


def _lower_fused_or_reference(ctx, args, spec, reference, params, fused):
    """Lower ``fused`` (which emits our custom call for ``spec``) when cuBLASLt takes
    ``spec``; else ``reference``: silently for ``spec=None`` (a documented XLA case:
    float64, an empty dimension), with one FastPathWarning for a refusal or for symbolic
    shapes (a plan needs its sizes)."""
    if _symbolic(*ctx.avals_in):
        _warn_once("symbolic shapes (jax.export's shape polymorphism): a cuBLASLt plan needs sizes")
        return reference(ctx, *args, **params)
    if spec is not None:
        refusal = _fast_path_refusal(spec)
        if refusal is None:
            return mlir.lower_fun(fused, multiple_results=True)(ctx, *args)
        _warn_once(refusal)
    return reference(ctx, *args, **params)


def _results(avals) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def _forward_spec(avals, *, activation, with_aux, compute_type, d_dtype, out_dtype) -> EpilogSpec | None:
    """The cuBLASLt problem of a fused_matmul_p call on ``avals`` (x, kernel[, bias]), or
    None where XLA computes it (see _lower_fused_or_reference); unpadded: its callers pad
    it (``_padded_rows``) once they know its members."""
    del out_dtype
    if _symbolic(*avals):
        return None
    x_aval, k_aval = avals[:2]
    # One row with a float32 D beside half operands (a float32 bias): cuBLASLt 13.1 plans it,
    # then refuses every launch (CUBLAS_STATUS_INVALID_VALUE, measured on the H200), so XLA
    # computes it.
    one_row_f32_d = x_aval.shape[0] == 1 and np.dtype(d_dtype) != np.dtype(x_aval.dtype)
    empty = 0 in (*x_aval.shape, k_aval.shape[1])
    if np.dtype(x_aval.dtype) == np.float64 or empty or one_row_f32_d:
        return None
    b_aval = avals[2] if len(avals) > 2 else None
    return spec_of(x_aval, k_aval, b_aval, activation, with_aux, compute_type, d_dtype)


# cuBLASLt's fast kernels need every matrix's rows 16 bytes apart: a row width (K or N,
# the leading dimensions of its column-major matrices; M is none) that is not a multiple
# of 8 half or 4 single elements measured 0.08-0.87x XLA at 8192 rows (benchmarks/README.md
# (ag)). So a large fused call zero-pads those widths up to such a multiple and slices its
# results back: zero columns of x and rows of the kernel add nothing to a product, and the
# extra columns they make are dropped. The aux needs neither: its rows are padded already
# (to 8 elements for GELU, 128 bits for ReLU). Padding costs a copy of each padded operand
# and result (XLA ops beside the call). On an H100 (2026-12-05 (ah),
# benchmarks/probes/row_padding.py) the padded call ran 2.1-18x faster than the unpadded
# one from 1024 rows and M*N*K = 2**32 up (1.2-2.4x XLA's jit), and 0.80-1.06x at M*N*K
# of 2**30 and less (1000x1000->1003, 256x784->100), where both lost to XLA or tied. So
# calls with at least _PAD_MIN_ROWS rows and M*N*K (times the members) of _PAD_MIN_WORK
# pad; fewer rows read the kernel, which padding copies, for little arithmetic.
# A forward without an aux pads N further, to _WIDE_ROW_BYTES: cuBLASLt's kernels at 4104
# columns (4097 padded to 16 bytes) were about 20 µs slower than at 4224, which ran as fast
# as 4096, and 128-byte rows took the padded GELU forward from 194 to 174 µs at
# 8192x1024->4097, 364-370 to 319 at 8192x1024->8193 and 509-513 to 493 at 8192x4096->4100
# in two processes (H100, 2026-12-06 (al), benchmarks/probes/pad_width.py); at 1025 and
# 2049 columns it changed nothing. Narrower N keeps 16 bytes (the wider rows would add more
# than 1/16 of the columns, unmeasured), as do float32 operands (unmeasured) and a forward
# with an aux: the GELU aux's layout is round_up(N, 8) wide.
# _ROW_BYTES = 1 turns the padding off (for probes).
_ROW_BYTES = 16
_WIDE_ROW_BYTES = 128
_WIDE_MIN_N = 1024
_PAD_MIN_ROWS = 1024
_PAD_MIN_WORK = 2**32


def _row_width(width: int, dtype, row_bytes: int | None = None) -> int:
    """``width`` rounded up to whole ``row_bytes`` (default ``_ROW_BYTES``) of ``dtype``:
    the width a fused call's matrices have for a row of ``width`` elements."""
    multiple = max(1, (row_bytes or _ROW_BYTES) // np.dtype(dtype).itemsize)
    return -(-width // multiple) * multiple


def _row_widths(m: int, n: int, k: int, dtype, members: int = 1) -> tuple[int, int]:
    """(N, K) as a fused call on this problem has them: padded for cuBLASLt's fast kernels
    where the problem is large enough to gain, else as they are."""
    if not _pads(m, n, k, members):
        return n, k
    return _row_width(n, dtype), _row_width(k, dtype)


def _padded_rows(spec: EpilogSpec) -> EpilogSpec:
    """``spec`` with its row widths (N and K) as the fused call has them (``_row_widths``;
    a padded N of at least ``_WIDE_MIN_N`` half-precision columns in a forward without aux:
    rows of at least ``_WIDE_ROW_BYTES``). An aux keeps the layer's layout: the width it
    is laid out by (a forward's N, a dgrad's K) pads no further than ``aux_columns`` (with
    16-byte rows it never does; wider ``_ROW_BYTES``, as probes set, would make cuBLASLt
    write or read the aux by a wider row than its buffer has)."""
    n, k = _row_widths(spec.m, spec.n, spec.k, spec.ab_dtype, spec.members)
    half = np.dtype(spec.ab_dtype).itemsize == 2
    if n != spec.n and half and spec.n >= _WIDE_MIN_N and spec.problem == "forward" and not spec.has_aux:
        n = max(n, _row_width(spec.n, spec.ab_dtype, _WIDE_ROW_BYTES))
    if spec.problem == "forward" and spec.has_aux:
        n = min(n, aux_columns(spec.activation, spec.n))
    elif spec.problem == "dgrad":
        k = min(k, aux_columns(Activation.GELU, spec.k))
    return spec._replace(n=n, k=k)


def _pads(m: int, n: int, k: int, members: int = 1) -> bool:
    """Whether a fused call on this problem is large enough to pad its rows."""
    return m >= _PAD_MIN_ROWS and m * n * k * members >= _PAD_MIN_WORK


def fast_rows(m: int, n: int, k: int, dtype) -> bool:
    """Whether a fused call on ``dtype``'s (m, k) x and (k, n) kernel gets rows 16 bytes
    apart: K and N are whole rows already, or the problem is large enough to be padded."""
    return aligned_rows(n, k, dtype) or _pads(m, n, k)


def aligned_rows(n: int, k: int, dtype) -> bool:
    """Whether ``dtype``'s (m, k) x and (k, n) kernel have rows 16 bytes apart as they are."""
    return _row_width(n, dtype) == n and _row_width(k, dtype) == k


def pads_n(m: int, n: int, k: int, dtype) -> bool:
    """Whether a fused call on ``dtype``'s (m, k) x and (k, n) kernel pads N."""
    return _row_widths(m, n, k, dtype)[0] != n


def padded_layer(x, kernel, bias):
    """(x, kernel, bias) padded with zeros to whole 16-byte rows where a fused call on them
    would pad (``_padded_rows``: large problems, K or N unaligned), else as given."""
    (k, n), m = kernel.shape, math.prod(x.shape[:-1])
    if not known_sizes(m, n, k):
        return x, kernel, bias
    n_rows, k_rows = _row_widths(m, n, k, x.dtype)
    return pad_to(x, k_rows), pad_to(kernel, k_rows, n_rows), None if bias is None else pad_to(bias, n_rows)


def on_padded_rows(f, x, kernel, bias):
    """``f(x, kernel, bias)`` on the operands ``padded_layer`` pads, its result cut back to
    N columns (as given, and uncut, where nothing pads)."""
    return f(*padded_layer(x, kernel, bias))[..., : kernel.shape[1]]


def _cut_to(value, *sizes):
    """``value``'s leading block of ``sizes`` in its last dimensions (undoes ``pad_to``)."""
    lead = value.ndim - len(sizes)
    if value.shape[lead:] == tuple(sizes):
        return value
    return value[(Ellipsis, *(slice(0, size) for size in sizes))]


def _padded_forward_operands(spec: EpilogSpec, x, kernel, *bias):
    """A forward's operands (members leading where they have them), padded to ``spec``."""
    return (pad_to(x, spec.k), pad_to(kernel, spec.k, spec.n), *(pad_to(b, spec.n) for b in bias))


def _with_rows_folded(lowering, layout_of):
    """``lowering`` (for operands and results whose rows are one dimension) for those whose
    rows span several (``Layout.row_dims`` of ``layout_of(avals_in, **params)``, after any
    member dimensions): each device folds the rows of the blocks it holds (a reshape),
    lowers, and unfolds its results."""

    def lower(ctx, *args, **params):
        layout = layout_of(ctx.avals_in, **params)
        count = layout.row_dims
        if count == 1:
            return lowering(ctx, *args, **params)

        def folded(aval, start):
            shape = aval.shape
            if start is None:
                return aval
            rows = math.prod(shape[start : start + count])
            return jax.core.ShapedArray((*shape[:start], rows, *shape[start + count :]), aval.dtype)

        def reshaped(value, have, want):
            if have.shape == want.shape:
                return value
            sub = ctx.replace(avals_in=[have], avals_out=[want])
            return mlir.lower_fun(lambda v: [v.reshape(want.shape)], multiple_results=True)(sub, value)[0]

        ins = [jax.core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_in]
        outs = [jax.core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_out]
        flat_in = [folded(a, layout.rows_at(0, i)) for i, a in enumerate(ins)]
        flat_outs = [folded(a, layout.rows_at(1, i)) for i, a in enumerate(outs)]
        flat_args = [reshaped(v, a, f) for v, a, f in zip(args, ins, flat_in)]
        results = lowering(ctx.replace(avals_in=flat_in, avals_out=flat_outs), *flat_args, **params)
        return [reshaped(r, f, a) for r, f, a in zip(results, flat_outs, outs)]

    return lower


def _cuda_lowering(ctx, x, kernel, *bias, **params):
    spec = _forward_spec(ctx.avals_in, **params)
    if spec is not None:
        spec = _padded_rows(spec)

    def fused(x, kernel, *bias):
        # D (padded rows) in the epilog's dtype, then the aux as the primitive returns it.
        results = [jax.ShapeDtypeStruct((spec.m, spec.n), params["d_dtype"]), *_results(ctx.avals_out[1:])]
        d, *aux = _ffi.call(_padded_forward_operands(spec, x, kernel, *bias), results, spec)
        d = _cut_to(d, kernel.shape[1])
        return [d.astype(params["out_dtype"]), *aux]  # a no-op cast unless the epilog ran in float32

    return _lower_fused_or_reference(ctx, (x, kernel, *bias), spec, _reference_lowering, params, fused)


mlir.register_lowering(
    fused_matmul_p,
    partitioned_lowering(fused_matmul_p, _with_rows_folded(_cuda_lowering, _layout), _layout),
    platform="cuda",
)
# The custom call's handler, registered now: a program holding it may come from
# elsewhere (``jax.export``) and never be lowered in this process.
_ffi.ensure_registered()


def _batch(args, dims, **params):
    x, kernel, *bias = args
    x_dim, k_dim, *b_dims = dims
    not_mapped = None  # batching.not_mapped
    if k_dim is not_mapped and all(d is not_mapped for d in b_dims):
        # Shared weights: the batch is one more leading dimension of the rows, one call.
        outs = fused_matmul_p.bind(jnp.moveaxis(x, x_dim, 0), kernel, *bias, **params)
        return outs, [0] * len(outs)
    # Batched weights (an ensemble): members_p (on a GPU one batched GEMM), whose members
    # split over devices stay split, under explicit sharding too (typed by its layout).
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    batched = tuple(d is not None for d in dims)
    outs = members_p.bind(*moved, inner_params=tuple(sorted(params.items())), batched=batched, depth=1)
    return outs, [0] * len(outs)


batching.primitive_batchers[fused_matmul_p] = _batch


# ------------------------------------------------------------------ kernel and bias gradient

fused_weight_grad_p = Primitive("jax_epilog_fused_weight_grad")
fused_weight_grad_p.multiple_results = True


def fused_weight_grad(x, dz, *, compute_type, d_dtype):
    """(..., k) x and (..., n) dz -> [x^T @ dz, dz summed over the rows], both in
    ``d_dtype``, from one GEMM; the rows are every leading dimension."""
    return fused_weight_grad_p.bind(*vary_alike(x, dz), compute_type=compute_type, d_dtype=np.dtype(d_dtype))


def _wgrad_abstract_eval(x, dz, *, compute_type, d_dtype, partitioned=False):
    del compute_type, partitioned
    k, n = x.shape[-1], dz.shape[-1]
    return typed(_wgrad_layout((x, dz)), (x, dz), [((k, n), d_dtype), ((n,), d_dtype)])


def _wgrad_layout(args, **params) -> Layout:
    """Over several devices: x's and dz's rows split alike, both gradients summed over them;
    N split as dz's is, and the gradients alike."""
    del params
    row_dims = args[0].ndim - 1
    m = _row_factors(row_dims)
    rule = f"{m} k, {m} n -> k n, n"
    return Layout(((0, 1), ()), (0, 1), ({1: 1}, {0: 1, 1: 0}), rule, whole=("k",), row_dims=row_dims)


def _wgrad_reference_impl(x, dz, *, compute_type, d_dtype):
    return list(_reference.weight_grad(x, dz, compute_type, d_dtype, with_bias=True))


fused_weight_grad_p.def_abstract_eval(_wgrad_abstract_eval)
fused_weight_grad_p.def_impl(_impl_of(fused_weight_grad_p))
_jvp_of_reference(fused_weight_grad_p, _wgrad_reference_impl)
_wgrad_reference_lowering = mlir.lower_fun(_wgrad_reference_impl, multiple_results=True)
mlir.register_lowering(
    fused_weight_grad_p, partitioned_lowering(fused_weight_grad_p, _wgrad_reference_lowering, _wgrad_layout)
)


def _wgrad_cuda_lowering(ctx, x, dz, *, compute_type, d_dtype):
    x_aval, dz_aval = ctx.avals_in
    (m, k), n = x_aval.shape, dz_aval.shape[1]
    params = {"compute_type": compute_type, "d_dtype": d_dtype}
    spec = None
    # K = 1: cuBLASLt 13.1 plans a BGRADA GEMM with one output row but then refuses to
    # run it (CUBLAS_STATUS_INVALID_VALUE, measured on the H200), so XLA computes it.
    runs = np.dtype(x_aval.dtype) != np.float64 and 0 not in (m, k, n) and k != 1
    if not _symbolic(*ctx.avals_in) and runs:
        dt = np.dtype(d_dtype).name
        spec = _padded_rows(EpilogSpec(
            m=int(m), n=int(n), k=int(k), epilog="BGRADA",
            compute_type=ComputeType(compute_type).name, ab_dtype=np.dtype(x_aval.dtype).name,
            bias_dtype=dt, d_dtype=dt, problem="wgrad",
        ))  # fmt: skip

    def fused(x, dz):
        results = [jax.ShapeDtypeStruct((spec.k, spec.n), d_dtype), jax.ShapeDtypeStruct((spec.n,), d_dtype)]
        dkernel, dbias = _ffi.call((pad_to(x, spec.k), pad_to(dz, spec.n)), results, spec)
        return [_cut_to(dkernel, k, n), _cut_to(dbias, n)]

    return _lower_fused_or_reference(ctx, (x, dz), spec, _wgrad_reference_lowering, params, fused)


mlir.register_lowering(
    fused_weight_grad_p,
    partitioned_lowering(
        fused_weight_grad_p, _with_rows_folded(_wgrad_cuda_lowering, _wgrad_layout), _wgrad_layout
    ),
    platform="cuda",
)


def _batched_reference(reference):
    """A batching rule: ``reference`` (a primitive's math in XLA's ops) under ``vmap``:
    XLA's batched GEMM, for gradients whose batch members each have their own weights."""

    def rule(args, dims, **params):
        outs = jax.vmap(functools.partial(reference, **params), in_axes=tuple(dims))(*args)
        return outs, [0] * len(outs)

    return rule


# Each batch member has its own gradient (an ensemble's, or per-example gradients): XLA's
# batched GEMM and reduction, not a loop of BGRADA calls. For one layer XLA's GEMM and
# reduction measured faster than BGRADA (126 against 142 µs at 8192x1024->4096), and the
# members loop added about 40 µs a member (benchmarks/README.md (ac)). Batched, an
# ensemble's "cublaslt" gradients read XLA / fused 1.01-1.05× (ReLU) and 0.75-0.87×
# (GELU) at 8192 rows on an H100 ((ae)); "auto" differentiates with XLA's program.
batching.primitive_batchers[fused_weight_grad_p] = _batched_reference(_wgrad_reference_impl)


# ------------------------------------------------- input gradient through a previous GELU

fused_gelu_input_grad_p = Primitive("jax_epilog_fused_gelu_input_grad")
fused_gelu_input_grad_p.multiple_results = True


def fused_gelu_input_grad(dz, kernel, aux, *, compute_type):
    """(..., n) dz, (k, n) kernel, (..., round_up(k, 8)) GELU aux -> [(dz @ kernel^T) *
    gelu'(z)], (..., k) in the aux's dtype, from one GEMM (``_reference.gelu_input_grad``)."""
    return fused_gelu_input_grad_p.bind(*vary_alike(dz, kernel, aux), compute_type=compute_type)


def _igrad_abstract_eval(dz, kernel, aux, *, compute_type, partitioned=False):
    del compute_type, partitioned
    args = (dz, kernel, aux)
    return typed(_igrad_layout(args), args, [((*dz.shape[:-1], kernel.shape[0]), aux.dtype)])


def _igrad_layout(args, **params) -> Layout:
    """Over several devices: dz's and the aux's rows split alike, and the result's with them;
    N (summed over here, before the GELU derivative) and K whole."""
    del params
    row_dims = args[0].ndim - 1
    m = _row_factors(row_dims)
    rule = f"{m} n, k n, {m} a -> {m} k"
    return Layout(((0, 2), (0,)), (), ({}, {}), rule, whole=("n", "k", "a"), row_dims=row_dims)


def _igrad_reference_impl(dz, kernel, aux, *, compute_type):
    return [_reference.gelu_input_grad(dz, kernel, aux, compute_type)]


fused_gelu_input_grad_p.def_abstract_eval(_igrad_abstract_eval)
fused_gelu_input_grad_p.def_impl(_impl_of(fused_gelu_input_grad_p))
_jvp_of_reference(fused_gelu_input_grad_p, _igrad_reference_impl)
_igrad_reference_lowering = mlir.lower_fun(_igrad_reference_impl, multiple_results=True)
mlir.register_lowering(
    fused_gelu_input_grad_p,
    partitioned_lowering(fused_gelu_input_grad_p, _igrad_reference_lowering, _igrad_layout),
)


def _igrad_cuda_lowering(ctx, dz, kernel, aux, *, compute_type):
    dz_aval, k_aval, aux_aval = ctx.avals_in
    (m, n), k = dz_aval.shape, k_aval.shape[0]
    spec = None
    params = {"compute_type": compute_type}
    # n = 1 is a GEMM with an inner dimension of 1, which nvmath refuses for DGELU epilogs;
    # m = 1 (one row) cuBLASLt 13.1 plans, then refuses at every launch (measured on the
    # H200). XLA computes both.
    runs = np.dtype(dz_aval.dtype) != np.float64 and 0 not in (m, k, n) and 1 not in (m, n)
    if not _symbolic(*ctx.avals_in) and runs:
        spec = _padded_rows(EpilogSpec(
            m=int(m), n=int(n), k=int(k), epilog="DGELU",
            compute_type=ComputeType(compute_type).name, ab_dtype=np.dtype(dz_aval.dtype).name,
            bias_dtype=None, d_dtype=np.dtype(aux_aval.dtype).name, problem="dgrad",
        ))  # fmt: skip

    def fused(dz, kernel, aux):
        # (the aux's rows, round_up(k, 8) wide, are padded already)
        results = [jax.ShapeDtypeStruct((spec.m, spec.k), aux.dtype)]
        (d,) = _ffi.call((pad_to(dz, spec.n), pad_to(kernel, spec.k, spec.n), aux), results, spec)
        return [_cut_to(d, k)]

    return _lower_fused_or_reference(ctx, (dz, kernel, aux), spec, _igrad_reference_lowering, params, fused)


mlir.register_lowering(
    fused_gelu_input_grad_p,
    partitioned_lowering(
        fused_gelu_input_grad_p, _with_rows_folded(_igrad_cuda_lowering, _igrad_layout), _igrad_layout
    ),
    platform="cuda",
)


def _igrad_batch(args, dims, **params):
    dz, kernel, aux = args
    dz_dim, k_dim, aux_dim = dims
    if k_dim is not None:  # batched kernels: XLA's batched GEMM (as the weight gradient's)
        return _batched_reference(_igrad_reference_impl)(args, dims, **params)
    # A shared kernel: the batch is one more leading dimension of the rows, one call.
    size = dz.shape[dz_dim] if dz_dim is not None else aux.shape[aux_dim]
    dz, aux = (
        jnp.broadcast_to(a, (size, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        for a, d in ((dz, dz_dim), (aux, aux_dim))
    )
    return fused_gelu_input_grad_p.bind(dz, kernel, aux, **params), [0]


batching.primitive_batchers[fused_gelu_input_grad_p] = _igrad_batch


# ------------------------------------------------------------------ ensembles

# ``members_p`` binds the forward (``fused_matmul_p``, with ``inner_params``) for every
# member of an ensemble.
members_p = Primitive("jax_epilog_members")
members_p.multiple_results = True


def _member_loop(*operands, inner_params, batched, depth, partitioned=False):
    """``members_p``: the forward bound once per member of the ``batched`` operands (their
    first ``depth`` dimensions), in a lax.map loop (on a GPU the forward instead lowers
    to one batched GEMM: ``_members_cuda_lowering``). Over several devices its lowering
    splits the members as they arrive (then the rows and N, as the forward's layout does),
    each device looping over its own: vmap over an ensemble's weights, whose loop XLA
    would otherwise gather onto every device."""
    del partitioned
    lead = next(o.shape[:depth] for o, b in zip(operands, batched) if b)
    size = math.prod(lead)
    stacked = [
        whole_leading(o, depth).reshape(size, *o.shape[depth:]) if b else jnp.broadcast_to(o, (size, *o.shape))
        for o, b in zip(operands, batched)
    ]
    outs = jax.lax.map(lambda ops: fused_matmul_p.bind(*ops, **dict(inner_params)), stacked)
    return [o.reshape(*lead, *o.shape[1:]) for o in outs]


def _one_member(avals, batched, depth):
    return [shaped_like(a, a.shape[depth:], a.dtype) if b else a for a, b in zip(avals, batched)]


def _members_abstract_eval(*avals, inner_params, batched, depth, partitioned=False):
    del partitioned
    lead = next(a.shape[:depth] for a, b in zip(avals, batched) if b)
    outs, _ = fused_matmul_p.abstract_eval(*_one_member(avals, batched, depth), **dict(inner_params))
    layout = _members_layout(avals, inner_params=inner_params, batched=batched, depth=depth)
    return typed(layout, avals, [((*lead, *o.shape), o.dtype) for o in outs])


def _members_layout(avals, *, inner_params, batched, depth) -> Layout:
    one = _one_member(avals, batched, depth)
    return _layout(one, **dict(inner_params)).over_members(batched, depth)


def _members_jvp(primals, tangents, *, inner_params, batched, depth, partitioned=False):
    """The members' values from ``members_p`` (split as they are), their tangents from
    the forward's own rule batched over the members (XLA's ops, which XLA splits itself)."""
    del partitioned
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    axes = [0 if b else None for b in batched]
    one = functools.partial(_forward_tangents, **dict(inner_params))
    for _ in range(depth):
        one = jax.vmap(one, in_axes=(axes, axes))
    out_tangents = one(list(primals), tangents)
    outs = members_p.bind(*primals, inner_params=inner_params, batched=batched, depth=depth)
    return outs, out_tangents


def _members_batch(args, dims, *, inner_params, batched, depth, partitioned=False):
    """A vmap of an ensemble. A new axis on the operands that hold the forward's rows only
    (whether members' or shared) becomes one more leading dimension of those rows, where no
    result sums over them: one ``members_p`` call, each dimension split as it arrives (a
    per-example model over an ensemble). Any other becomes an outer member dimension (an
    ensemble of ensembles), the operands it or the members leave out broadcast along it:
    each stays split as it arrives."""
    del partitioned
    params = {"inner_params": inner_params}
    unmapped = [
        jax.core.ShapedArray(np.delete(a.shape, [d] if d is not None else []), a.dtype)
        for a, d in zip(args, dims)
    ]
    one = _one_member(unmapped, batched, depth)
    layout = _layout(one, **dict(inner_params))
    rows, results = layout.rows[0], len(fused_matmul_p.abstract_eval(*one, **dict(inner_params))[0])
    new_rows_only = all((d is not None) == (i in rows) for i, d in enumerate(dims))
    if new_rows_only and not layout.summed and len(layout.rows[1]) == results:
        (row_operand,) = rows  # (x: its rows are the forward's only ones)
        a, d, b = args[row_operand], dims[row_operand], batched[row_operand]
        moved = list(args)  # the new axis leads the rows (after any member dimensions)
        moved[row_operand] = jnp.moveaxis(a, d, depth if b else 0)
        outs = members_p.bind(*moved, **params, batched=batched, depth=depth)  # (*members, new, rows..., ...)
        return outs, [depth] * len(outs)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    lead = next(a.shape[:depth] for a, b in zip(unmapped, batched) if b)
    deeper = []
    for a, d, b in zip(args, dims, batched):
        if d is not None:
            a = jnp.moveaxis(a, d, 0)
            if not b:  # the same for every member
                a = jnp.expand_dims(a, tuple(range(1, depth + 1)))
                a = jnp.broadcast_to(a, (size, *lead, *a.shape[depth + 1 :]))
        elif b:  # the same for every outer member
            a = jnp.broadcast_to(a, (size, *a.shape))
        deeper.append(a)
    batched = tuple(b or d is not None for b, d in zip(batched, dims))
    outs = members_p.bind(*deeper, **params, batched=batched, depth=depth + 1)
    return outs, [0] * len(outs)


def _members_cuda_lowering(ctx, *operands, inner_params, batched, depth, partitioned=False):
    """``members_p`` on a GPU. An ensemble's forward (x or the kernel per member) is one
    strided-batched cuBLASLt GEMM with the epilog, which
    reads every member's operands and writes its results in place, where the loop slices
    each member's operands out and stacks its results: at 8192x1024->4096 (bf16, ReLU) the
    loop took 146 µs a member, the batched GEMM 103, one layer alone about 104
    (benchmarks/README.md (ac), (ad)). The loop stays for fewer than two members, for
    members that share x and the kernel, and for a batch cuBLASLt refuses (it warns once;
    each member then runs its own fused call, or XLA's where that one is refused)."""
    del partitioned
    params = dict(inner_params)
    loop = mlir.lower_fun(
        functools.partial(_member_loop, inner_params=inner_params, batched=batched, depth=depth),
        multiple_results=True,
    )
    lead = next(a.shape[:depth] for a, b in zip(ctx.avals_in, batched) if b)
    spec = None
    # (nvmath batches by x and the kernel: with both shared, only the bias differs)
    if (batched[0] or batched[1]) and not _symbolic(*ctx.avals_in):
        spec = _forward_spec(_one_member(ctx.avals_in, batched, depth), **params)
    if spec is None or math.prod(lead) < 2:
        return loop(ctx, *operands)  # (each member's call warns where it must)
    shared = ",".join(name for name, b in zip(("x", "kernel", "bias"), batched) if not b)
    spec = _padded_rows(spec._replace(members=math.prod(lead), shared=shared))
    refusal = _fast_path_refusal(spec)
    if refusal is not None:
        _warn_once(refusal, f"{spec.members} members run one fused call each, not one batched call", MembersLoopWarning)
        return loop(ctx, *operands)

    def batched_call(*ops):
        flat = [o.reshape(spec.members, *o.shape[depth:]) if b else o for o, b in zip(ops, batched)]
        results = [jax.ShapeDtypeStruct((spec.members, *a.shape[depth:]), a.dtype) for a in ctx.avals_out]
        # D (padded rows) in the epilog's dtype
        results[0] = jax.ShapeDtypeStruct((spec.members, spec.m, spec.n), params["d_dtype"])
        d, *aux = _ffi.call(_padded_forward_operands(spec, *flat), results, spec)
        outs = [_cut_to(d, ctx.avals_out[0].shape[-1]).astype(params["out_dtype"]), *aux]
        return [o.reshape(*lead, *o.shape[1:]) for o in outs]

    return mlir.lower_fun(batched_call, multiple_results=True)(ctx, *operands)


members_p.def_abstract_eval(_members_abstract_eval)
members_p.def_impl(_impl_of(members_p))
ad.primitive_jvps[members_p] = _members_jvp
batching.primitive_batchers[members_p] = _members_batch
mlir.register_lowering(
    members_p,
    partitioned_lowering(members_p, mlir.lower_fun(_member_loop, multiple_results=True), _members_layout),
)


mlir.register_lowering(
    members_p,
    partitioned_lowering(
        members_p, _with_rows_folded(_members_cuda_lowering, _members_layout), _members_layout
    ),
    platform="cuda",
)
