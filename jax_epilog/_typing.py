"""Types under explicit sharding and inside ``shard_map``: the helpers every module shares.

Under explicit sharding an array's type names its sharding: a product says how it is
split, and every gradient takes its primal's type (``like``). Inside ``shard_map`` a value
is typed by the manual mesh axes it differs over (``varying``), and a primitive's operands
are cast to differ over the same ones (``vary_alike``), as jax casts its own primitives'.
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

__all__ = [
    "explicit_product", "is_explicit", "like", "mesh_axes", "named", "resharded_like", "shaped_like",
    "sharding_of", "vary_alike", "varying", "whole_leading",
]  # fmt: skip


def shaped_like(template, shape, dtype, sharding=None) -> jax.core.ShapedArray:
    """A ShapedArray of ``shape`` and ``dtype`` that differs over the same manual axes as
    ``template`` (an abstract value), split as ``sharding`` says (explicit sharding) or
    not at all."""
    if not varying(template):
        return jax.core.ShapedArray(shape, dtype, sharding=sharding)
    if sharding is None:
        sharding = NamedSharding(template.sharding.mesh, PartitionSpec())
    return template.update(shape=shape, dtype=dtype, weak_type=False, sharding=sharding)


def varying(aval) -> frozenset:
    """The manual (``shard_map``) mesh axes over which a value of type ``aval`` differs
    from device to device: jax types values by them inside ``shard_map``, where a value
    the same on every device must be declared so (``out_specs``) and an operand the same on
    every device gets its gradient summed over them. (The attribute's name has changed
    across jax releases; empty wherever none is found, as outside ``shard_map``.)"""
    for name in ("mat", "manual_axis_type", "manual_type"):
        if (mat := getattr(aval, name, None)) is not None:
            return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def vary_alike(*operands) -> list:
    """``operands`` cast to differ over the same manual axes (their union), as jax casts
    the operands of its own primitives inside ``shard_map`` (a change of type: no data
    moves), so that a primitive's results can take their type (``typed``)."""
    kinds = [varying(jax.typeof(o)) for o in operands]
    union = frozenset().union(*kinds)
    return [
        o if kind == union else jax.lax.pcast(o, tuple(union - kind), to="varying")
        for o, kind in zip(operands, kinds)
    ]


def like(value, primal):
    """``value`` (a cotangent) given ``primal``'s type: summed over the manual axes it
    differs over and ``primal`` does not (inside ``shard_map``: a kernel the same on every
    device gets every device's part of its gradient), then ``resharded_like`` it."""
    extra = varying(jax.typeof(value)) - varying(jax.typeof(primal))
    if extra:
        value = jax.lax.psum(value, tuple(extra))
    return resharded_like(value, primal)


def resharded_like(value, other):
    """``value`` resharded to ``other``'s type where explicit sharding says they differ
    (e.g. a kernel gradient, whole from a GEMM that gathered a kernel split along N over
    the rows' axes)."""
    want = getattr(jax.typeof(other), "sharding", None)
    have = getattr(jax.typeof(value), "sharding", None)
    if not is_explicit(want) or not isinstance(have, NamedSharding) or tuple(want.spec) == tuple(have.spec):
        return value
    return jax.sharding.reshard(value, want)


def explicit_product(a, b, contract) -> NamedSharding | None:
    """Under explicit sharding, how the product of ``a`` and ``b`` contracted over the
    dimensions ``contract`` names (a tuple of ``a``'s, one of ``b``'s) is split: as the
    dimensions it keeps are (``a``'s, then ``b``'s), except that those of ``b``'s that
    share mesh axes with ``a``'s stay whole. A product summed over a split dimension must
    say so; elsewhere None."""
    sa, sb = (getattr(jax.typeof(v), "sharding", None) for v in (a, b))
    if not (is_explicit(sa) and is_explicit(sb)):
        return None
    first = [axes for d, axes in enumerate(_spec_entries(a)) if d not in contract[0]]
    taken = {axis for axes in first for axis in axes}
    kept = (axes for d, axes in enumerate(_spec_entries(b)) if d not in contract[1])
    second = [() if set(axes) & taken else axes for axes in kept]
    return named(sa.mesh, (*first, *second))


def whole_leading(x, count: int):
    """``x`` with its first ``count`` dimensions whole where explicit sharding splits them
    (``lax.map`` refuses to loop over a split dimension); elsewhere ``x``."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    entries = _spec_entries(x) if is_explicit(sharding) else ()
    if not any(entries[:count]):
        return x
    return jax.sharding.reshard(x, named(sharding.mesh, (*((),) * count, *entries[count:])))


def _spec_entries(x) -> tuple[tuple[str, ...], ...]:
    """Each dimension's mesh axes in ``x``'s explicit type."""
    sharding = jax.typeof(x).sharding
    return tuple(mesh_axes(sharding, d) for d in range(x.ndim))


def named(mesh, entries) -> NamedSharding:
    """``sharding_of`` from each dimension's mesh axes (() where whole)."""
    return sharding_of(mesh, len(entries), {d: axes for d, axes in enumerate(entries) if axes})


def mesh_axes(sharding: NamedSharding, dim: int) -> tuple[str, ...]:
    """The mesh axes that split dimension ``dim`` (none: ())."""
    entry = sharding.spec[dim] if len(sharding.spec) > dim else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def sharding_of(mesh, ndim: int, dims: dict[int, tuple[str, ...]]) -> NamedSharding:
    spec = [None] * ndim
    for dim, axes in dims.items():
        spec[dim] = axes if len(axes) > 1 else axes[0]
    return NamedSharding(mesh, PartitionSpec(*spec))


def is_explicit(sharding) -> bool:
    """Whether ``sharding`` is a NamedSharding on a mesh with an explicit axis."""
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    mesh = getattr(sharding, "mesh", None) if isinstance(sharding, NamedSharding) else None
    return any(t == explicit for t in getattr(mesh, "axis_types", ()))
