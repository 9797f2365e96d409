"""How the fused primitives split over several devices: by rows, with whole weights.

XLA's partitioner cannot see into a custom call: left alone, it would gather every operand
onto every device and run the whole GEMM on each. So each primitive's lowering goes through
``jax.experimental.custom_partitioning`` with one rule for all of them: an operand's rows
(the GEMM's M: a batch of tokens) stay split the way they arrive, and everything else
(the kernel, the bias, a GEMM's K and N) is gathered whole onto each device. Each device
then runs the primitive on its own rows, and results that sum over the rows (the kernel
and bias gradients) are summed over the devices that split them (``psum``).

That is data parallelism (and FSDP, whose weights are gathered before use anyway) at the
fused kernel's speed. Weights split along N or K (tensor parallelism) are gathered, so
such a layer computes correctly but without splitting its weights. Rows that do not
divide evenly over their devices are gathered too. On a single device, and inside
``shard_map`` (where every device already holds its own block), the primitive lowers
directly: custom_partitioning adds nothing there.

Under explicit sharding an array's type names its sharding: ``typed`` gives the
primitives' results the types this rule makes, and ``like`` gives each gradient its
primal's type.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

try:  # jit hands a lowering its devices only for the primitives in this set (private)
    from jax._src.dispatch import prim_requires_devices_during_lowering as _NEEDS_DEVICES
except ImportError:  # a jax without it: the primitives lower whole (XLA gathers; correct)
    _NEEDS_DEVICES = None

__all__ = ["Rows", "explicit_whole", "like", "partitioned_lowering", "typed"]


class Rows(NamedTuple):
    """Which operands and results carry the GEMM's rows (M) in their first dimension.

    ``summed`` results are sums over the rows; ``rule(nargs, nouts)`` is the Shardy rule
    for that many operands and results, in custom_partitioning's einsum-like notation,
    with "m" for the rows.
    """

    args: tuple[int, ...]
    results: tuple[int, ...]
    summed: tuple[int, ...]
    rule: callable


def partitioned_lowering(primitive, direct, rows: Rows):
    """A lowering rule for ``primitive``: ``direct`` on one device, else split by ``rows``.

    ``direct(ctx, *args, **params)`` lowers the primitive on whole (or per-device) arrays.
    On several devices the primitive is bound again inside custom_partitioning with
    ``partitioned=True``, which sends that inner bind to ``direct``.
    """
    if _NEEDS_DEVICES is None:
        return direct
    # custom_partitioning needs the devices, and it appears only at lowering, so the
    # primitive asks for them (as jax's own wrappers of custom_partitioning do).
    _NEEDS_DEVICES.add(primitive)

    def lowering(ctx, *args, partitioned: bool = False, **params):
        if partitioned:
            return direct(ctx, *args, **params)
        fn = _partitioned(primitive, params, rows, len(args), len(ctx.avals_out))
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    return lowering


def _partitioned(primitive, params: dict, rows: Rows, nargs: int, nouts: int):
    def local(*args):
        return primitive.bind(*args, partitioned=True, **params)

    fn = custom_partitioning(local)

    def partition(mesh, arg_shapes, result_shapes):
        axes = _row_axes(mesh, arg_shapes, rows)
        arg_shardings = tuple(
            _sharding(mesh, s.ndim, axes if i in rows.args else None) for i, s in enumerate(arg_shapes)
        )
        out_shardings = _out_shardings(mesh, result_shapes, rows, axes)

        def lower(*args):
            outs = local(*args)
            if axes is None:
                return outs
            return [jax.lax.psum(o, axes) if i in rows.summed else o for i, o in enumerate(outs)]

        return mesh, lower, out_shardings, arg_shardings

    def infer(mesh, arg_shapes, result_shapes):  # the GSPMD partitioner's question
        return _out_shardings(mesh, result_shapes, rows, _row_axes(mesh, arg_shapes, rows))

    rule = rows.rule(nargs, nouts)
    factors = rule.replace("->", " ").replace(",", " ").split()
    whole = [f for i, f in enumerate(factors) if f != "m" and f not in factors[:i]]  # in rule order
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,  # for Shardy: only the rows "m" may stay split
        need_replication_factors=tuple(whole),
    )
    return fn


def _row_axes(mesh, arg_shapes, rows: Rows) -> tuple[str, ...] | None:
    """The mesh axes that split the rows of every row operand alike, if they divide M."""
    found = None
    for i in rows.args:
        sharding = arg_shapes[i].sharding
        if not isinstance(sharding, NamedSharding):
            return None
        axes = _first_axes(sharding)
        if found is not None and axes != found:
            return None
        found = axes
    if not found:
        return None
    m = arg_shapes[rows.args[0]].shape[0]
    if m % math.prod(mesh.shape[a] for a in found):
        return None
    return found


def _first_axes(sharding: NamedSharding) -> tuple[str, ...]:
    """The mesh axes that split the first dimension (none: ())."""
    entry = sharding.spec[0] if len(sharding.spec) else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _sharding(mesh, ndim: int, axes) -> NamedSharding:
    spec = [None] * ndim
    if axes:
        spec[0] = axes if len(axes) > 1 else axes[0]
    return NamedSharding(mesh, PartitionSpec(*spec))


def _out_shardings(mesh, result_shapes, rows: Rows, axes):
    return [_sharding(mesh, s.ndim, axes if i in rows.results else None) for i, s in enumerate(result_shapes)]


# ------------------------------------------------ types under explicit sharding


def typed(shape, dtype, rows_like=None, mesh_of=None) -> jax.core.ShapedArray:
    """An abstract result: split along its first dimension as ``rows_like``'s first
    dimension is (the primitives' rule), or whole, on ``mesh_of``'s mesh, where that mesh
    is explicit (an array's type then names its sharding); elsewhere a plain ShapedArray."""
    sharding = getattr(rows_like if rows_like is not None else mesh_of, "sharding", None)
    if not _explicit(sharding):
        return jax.core.ShapedArray(shape, dtype)  # (as before explicit sharding existed)
    axes = _first_axes(sharding) if rows_like is not None and shape else None
    return jax.core.ShapedArray(shape, dtype, sharding=_sharding(sharding.mesh, len(shape), axes))


def like(value, primal):
    """``value`` (a cotangent) resharded to ``primal``'s type where explicit sharding says
    they differ (e.g. a kernel gradient, whole from the GEMM, for a kernel split along N)."""
    want = getattr(jax.typeof(primal), "sharding", None)
    have = getattr(jax.typeof(value), "sharding", None)
    if not _explicit(want) or not isinstance(have, NamedSharding) or tuple(want.spec) == tuple(have.spec):
        return value
    return jax.sharding.reshard(value, want)


def explicit_whole(array, ndim: int) -> NamedSharding | None:
    """A whole (unsplit) ``ndim``-d sharding on ``array``'s mesh where that mesh's sharding
    is explicit (a sum over split rows must say how its result is split), else None."""
    sharding = getattr(jax.typeof(array), "sharding", None)
    return _sharding(sharding.mesh, ndim, None) if _explicit(sharding) else None


def _explicit(sharding) -> bool:
    """Whether ``sharding`` is a NamedSharding on a mesh with an explicit axis."""
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    mesh = getattr(sharding, "mesh", None) if isinstance(sharding, NamedSharding) else None
    return any(t == explicit for t in getattr(mesh, "axis_types", ()))
