"""What every primitive shares: one ``register`` that writes its rules, and the lowering
helpers its CUDA rule is built from.

A primitive is described by its results (shapes and dtypes), its ``Layout`` (where M and
N sit, for the sharding rule and the explicit-sharding types), its reference math in jnp
(the CPU lowering, the eager impl's fallback, and its derivatives) and a CUDA lowering. On
CUDA the lowering emits our custom call when cuBLASLt accepts the problem, checked by
planning it at lowering time so that a refusal never reaches a running program, and the
reference math otherwise (once announced with a ``FastPathWarning``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from .. import _reference
from .._epilogs import EpilogSpec, known_sizes
from .._partition import Layout, partitioned_lowering, typed
from .._warnings import warn_once
from ..cuda import ffi

__all__ = ["lower_fused_or_reference", "new_primitive", "register", "results_like", "row_factors", "symbolic"]


def new_primitive(name: str) -> Primitive:
    primitive = Primitive(f"jax_epilog_{name}")
    primitive.multiple_results = True
    return primitive


def register(
    primitive: Primitive,
    *,
    results: Callable[..., list[tuple[tuple[int, ...], object]]],
    layout: Callable[..., Layout],
    reference: Callable[..., list[jax.Array]],
    cuda: Callable[..., list],
    batch: Callable | None,
    jvp: Callable | None = None,
) -> Callable:
    """Register ``primitive``'s abstract eval, eager impl, JVP, batching and its CPU and
    CUDA lowerings (each through the sharding rule). Returns its tangents rule (None
    with ``jvp``).

    ``results(*avals, **params)``: [(shape, dtype)] of its results. ``layout(avals,
    **params)``: its Layout. ``reference(*args, **params)``: its math in jnp. ``cuda(ctx,
    *args, **params)``: its lowering on one device, rows folded into one dimension.
    ``batch``: its batching rule (None: vmap of the reference math). ``jvp``: its JVP rule
    (default: the reference math's tangents; see ``_jvp_of_reference``).
    """

    def abstract_eval(*avals, partitioned=False, **params):
        del partitioned
        return typed(layout(avals, **params), avals, results(*avals, **params))

    primitive.def_abstract_eval(abstract_eval)
    primitive.def_impl(_impl_of(primitive))
    tangents = None
    if jvp is None:
        tangents = _jvp_of_reference(primitive, reference)
    else:
        ad.primitive_jvps[primitive] = jvp
    batching.primitive_batchers[primitive] = batch or batched_reference(reference)
    cpu = mlir.lower_fun(reference, multiple_results=True)
    mlir.register_lowering(primitive, partitioned_lowering(primitive, cpu, layout))
    folded = _with_rows_folded(cuda, layout)
    mlir.register_lowering(primitive, partitioned_lowering(primitive, folded, layout), platform="cuda")
    return tangents


def _impl_of(primitive: Primitive):
    """Eager calls run the primitive jitted, compiled once per parameter set (also under
    ``jax.disable_jit()``, whose jit would bind the primitive again: endlessly)."""

    @functools.cache
    def jitted(params: tuple) -> Callable:
        return jax.jit(functools.partial(primitive.bind, **dict(params)))

    def impl(*args, **params):
        with jax.disable_jit(False):
            return jitted(tuple(sorted(params.items())))(*args)

    return impl


def _jvp_of_reference(primitive: Primitive, reference):
    """Differentiation rule for ``primitive``: its own value, with the tangents of
    ``reference``, its math in plain XLA ops (which reverse mode can transpose), so that a
    gradient made of the fused primitives differentiates again (grad of grad,
    ``jax.hessian``). The tangents' GEMMs run as XLA's autodiff of the plain expression
    runs them (in the operands' dtype), except that a ``_FAST`` compute type keeps the
    rounding it allows. Returns the tangents alone (for ``members_p``'s rule)."""

    def tangents_of(primals, tangents, **params):
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        compute_type = _reference.derivative_compute_type(params["compute_type"])
        as_xla = functools.partial(reference, **(params | {"compute_type": compute_type}))
        return jax.jvp(as_xla, list(primals), tangents)[1]

    def jvp(primals, tangents, **params):
        return primitive.bind(*primals, **params), tangents_of(primals, tangents, **params)

    ad.primitive_jvps[primitive] = jvp
    return tangents_of


def batched_reference(reference):
    """A batching rule: ``reference`` under ``vmap``, XLA's batched GEMMs (for gradients
    whose batch members each have their own weights)."""

    def rule(args, dims, **params):
        outs = jax.vmap(functools.partial(reference, **params), in_axes=tuple(dims))(*args)
        return outs, [0] * len(outs)

    return rule


def row_factors(row_dims: int) -> str:
    """M in a Shardy rule: "m", or one factor a leading dimension ("m0 m1")."""
    return " ".join(f"m{i}" for i in range(row_dims)) if row_dims > 1 else "m"


def symbolic(*avals) -> bool:
    """Whether a shape has a symbolic dimension (``jax.export``'s shape polymorphism)."""
    return not known_sizes(*(d for a in avals for d in a.shape))


def results_like(avals) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def lower_fused_or_reference(ctx, args, params, spec: EpilogSpec | None, fused, reference):
    """Lower ``fused`` (which emits our custom call for ``spec``) where the GPU path can run
    ``spec``; else ``reference`` (a jnp function): silently for ``spec=None`` (a documented
    XLA case: float64, an empty dimension), with one FastPathWarning for a refusal or for
    symbolic shapes (a plan needs its sizes)."""
    lower_reference = mlir.lower_fun(functools.partial(reference, **params), multiple_results=True)
    if symbolic(*ctx.avals_in):
        warn_once("symbolic shapes (jax.export's shape polymorphism): a cuBLASLt plan needs sizes")
        return lower_reference(ctx, *args)
    if spec is not None:
        refusal = ffi.prepare(spec)
        if refusal is None:
            return mlir.lower_fun(fused, multiple_results=True)(ctx, *args)
        warn_once(refusal)
    return lower_reference(ctx, *args)


def _with_rows_folded(lowering, layout_of):
    """``lowering`` (for operands and results whose rows are one dimension) for those whose
    rows span several (``Layout.row_dims``, after any member dimensions): each device folds
    the rows of the blocks it holds (a reshape), lowers, and unfolds its results."""

    def lower(ctx, *args, **params):
        layout = layout_of(ctx.avals_in, **params)
        count = layout.row_dims
        if count == 1:
            return lowering(ctx, *args, **params)

        def folded(aval, start):
            if start is None:
                return aval
            shape = aval.shape
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
