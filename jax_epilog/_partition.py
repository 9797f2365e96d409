"""How the fused primitives split over several devices: by rows, and by N where it can.

XLA's partitioner cannot see into a custom call: left alone, it would gather every operand
onto every device and run the whole GEMM on each. So each primitive's lowering goes through
``jax.experimental.custom_partitioning`` with one rule for all of them:

- an operand's rows (the GEMM's M: a batch of tokens) stay split the way they arrive,
  also where they span several dimensions (x of shape (batch, seq, K), and dz and the aux
  in the backward: ``Layout.row_dims``), each device folding its own block's;
- the output features (N) stay split where the kernel (or, for the kernel gradient, dz)
  arrives split along N over mesh axes that do not split the rows: tensor parallelism's
  column-parallel layer. Each device then computes its own block of columns, with no
  communication in the forward. The forward's aux splits with N, each device's share cut
  from its own (padded) aux; where it cannot (a padded aux, or ReLU's bits with a device's
  N no multiple of 8), each device computes every column, keeps its share of y and the
  whole aux. Either way y splits as it would without an aux, so the types agree;
- everything else (K, and N where it cannot split) is gathered whole onto each device.

An ensemble (``vmap`` over weights) binds ``members_p``, whose lowering splits the
members as the weights arrive (``Layout.over_members``: leading member dimensions, "e0"
(and "e1" for an ensemble of ensembles) in the rule), then each member's rows and N as
above: each device runs its own members' blocks (the forward in one batched call on a
GPU, anything else in a loop).

Each device runs the primitive on its own block, and results that sum over the rows (the
kernel and bias gradients) are summed over the devices that split them (``psum``). That
covers data parallelism, FSDP (whose weights, split over the axes that split the rows, are
gathered before use anyway) and column-parallel tensor parallelism at the fused kernel's
speed. Weights split along K (a row-parallel layer) are gathered: the epilog's bias and
activation need the whole sum. Rows or columns that do not divide evenly over their devices
are gathered too. On a single device, and inside ``shard_map`` (where every device already
holds its own block), the primitive lowers directly: custom_partitioning adds nothing there.

Under explicit sharding an array's type names its sharding: ``typed`` gives the
primitives' results the types this rule makes, and ``like`` gives each gradient its
primal's type. Every primitive takes its rows with their leading dimensions, so nothing
folds them before the rule sees how they are split. ``members_p`` is typed by the same
rule with its member dimensions in front, so an ensemble on an explicit mesh lowers as it
does elsewhere: whether its members are split, or replicated beside split rows or columns.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from ._typing import is_explicit, mesh_axes, shaped_like, sharding_of, varying

try:  # jit hands a lowering its devices only for the primitives in this set (private)
    from jax._src.dispatch import prim_requires_devices_during_lowering as _NEEDS_DEVICES
except ImportError:  # a jax without it: the primitives lower whole (XLA gathers; correct)
    _NEEDS_DEVICES = None
try:  # jax's own reading of an XLA sharding as mesh axes (private; see _decoded)
    from jax._src.sharding_impls import GSPMDSharding as _XlaSharding
    from jax._src.sharding_impls import parse_flatten_op_sharding as _parse_hlo_sharding
except ImportError:  # a jax without them: custom_partitioning decodes (and may raise there)
    _XlaSharding = _parse_hlo_sharding = None

__all__ = ["Layout", "partitioned_lowering", "typed"]


class Layout(NamedTuple):
    """Where a primitive's GEMM dimensions sit in its operands and results.

    ``rows``: (operands, results) whose first dimension is M. ``summed``: results that are
    sums over M. ``cols``: ({operand: its N dimension}, {result: its N dimension}); the
    first operand named decides how N splits, and an empty ``cols`` keeps N whole.
    ``packed``: ((result, N's columns per element of it), ...) for results in ``cols`` that
    split only where each device's N is a multiple of that (ReLU's aux: 8 bits a byte; 0:
    never, an aux with padding). ``rule``: the Shardy rule, in custom_partitioning's
    einsum-like notation with "m" for the rows and "n" (or a compound factor over it, sized
    by ``factor_sizes``) for N; factors ``whole`` never split. ``members``: operands with
    ``depth`` leading member dimensions ("e0", "e1", ... in the rule; ``over_members``),
    every result then has them too, and the dimensions above sit ``depth`` further along.
    ``row_dims``: how many leading dimensions (after any member dimensions) make up M in
    the operands and results in ``rows`` (x of shape (batch, seq, K): two, "m0 m1" in the
    rule; each may be split on its own); their other dimensions sit ``row_dims - 1``
    further along than the indices above, which count one. ``maxed``: results that are a
    maximum over M and N (an amax), reduced over the devices that split either (``pmax``:
    one all-reduce of a scalar).
    """

    rows: tuple[tuple[int, ...], tuple[int, ...]]
    summed: tuple[int, ...]
    cols: tuple[dict[int, int], dict[int, int]]
    rule: str
    whole: tuple[str, ...]
    factor_sizes: tuple[tuple[str, int], ...] = ()
    packed: tuple[tuple[int, int], ...] = ()
    members: tuple[int, ...] = ()
    depth: int = 0
    row_dims: int = 1
    maxed: tuple[int, ...] = ()

    def over_members(self, batched, depth: int = 1) -> Layout:
        """This layout for the primitive run once per member of an ensemble: the
        ``batched`` operands, and every result, stacked along ``depth`` new leading
        dimensions (an ensemble of ensembles has two)."""
        lead = " ".join(f"e{level}" for level in range(depth))
        operands, results = (side.split(",") for side in self.rule.split("->"))
        operands = [f"{lead} {o.strip()}" if b else o.strip() for o, b in zip(operands, batched, strict=True)]
        rule = f"{', '.join(operands)} -> {', '.join(f'{lead} {r.strip()}' for r in results)}"
        return self._replace(rule=rule, members=tuple(i for i, b in enumerate(batched) if b), depth=depth)

    def rows_at(self, side: int, i: int) -> int | None:
        """The dimension where M starts in operand (side 0) or result (side 1) ``i``
        (after its member dimensions); None where it has no rows."""
        return _offset(self, side, i) if i in self.rows[side] else None


class Split(NamedTuple):
    """The mesh axes that split each of M's dimensions and N for one call (() where
    whole), the results in ``Layout.cols`` that stay whole along N (the operands' N is then
    gathered: each device computes every column and keeps its own), and those that split
    each member dimension."""

    rows: tuple[tuple[str, ...], ...]
    cols: tuple[str, ...]
    whole: tuple[int, ...] = ()
    members: tuple[tuple[str, ...], ...] = ()

    @property
    def row_axes(self) -> tuple[str, ...]:
        """Every mesh axis that splits M."""
        return tuple(a for axes in self.rows for a in axes)


def partitioned_lowering(primitive, direct, layout_of):
    """A lowering rule for ``primitive``: ``direct`` on one device, else split as
    ``layout_of(operands' abstract values, **params)`` says.

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
        if partitioned or _inside_shard_map(ctx):
            return direct(ctx, *args, **params)
        layout = layout_of(ctx.avals_in, **params)
        fn = _partitioned(primitive, params, layout)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)

    return lowering


def _inside_shard_map(ctx) -> bool:
    """Whether this lowering is inside ``shard_map`` (some mesh axes manual). Over all of
    them each device holds its own block, and custom_partitioning would lower directly
    too; over some, it cannot read the operands' shardings (GSPMD aborted the process),
    so the primitive lowers directly there too, and XLA gathers its operands over the
    other axes."""
    return bool(getattr(ctx.module_context.axis_context, "manual_axes", ()))


def _partitioned(primitive, params: dict, layout: Layout):
    def local(*args):
        return primitive.bind(*args, partitioned=True, **params)

    fn = custom_partitioning(local)

    def partition(mesh, arg_shapes, result_shapes):
        split = _split(layout, mesh, [s.shape for s in arg_shapes], _decoded(mesh, arg_shapes))
        arg_shardings = tuple(
            sharding_of(mesh, s.ndim, _dims(layout, 0, i, split)) for i, s in enumerate(arg_shapes)
        )
        out_shardings = _out_shardings(layout, mesh, result_shapes, split)

        def lower(*args):
            outs = list(local(*args))
            for i, dim in layout.cols[1].items() if split.cols else ():
                if i not in split.whole:
                    dim += _offset(layout, 1, i) + _extra_rows(layout, 1, i)
                    share = result_shapes[i].shape[dim] // _size(mesh, split.cols)
                    outs[i] = _own_columns(outs[i], dim, share, split)
            maxed_over = split.row_axes + split.cols
            outs = [
                jax.lax.pmax(o, maxed_over) if i in layout.maxed and maxed_over else o
                for i, o in enumerate(outs)
            ]
            if not split.row_axes:
                return outs
            return [jax.lax.psum(o, split.row_axes) if i in layout.summed else o for i, o in enumerate(outs)]

        return mesh, lower, out_shardings, arg_shardings

    def infer(mesh, arg_shapes, result_shapes):  # the GSPMD partitioner's question
        split = _split(layout, mesh, [s.shape for s in arg_shapes], _decoded(mesh, arg_shapes))
        return _out_shardings(layout, mesh, result_shapes, split)

    factors = layout.rule.replace("->", " ").replace(",", " ").replace("(", " ").replace(")", " ").split()
    whole = [f for i, f in enumerate(factors) if f in layout.whole and f not in factors[:i]]  # rule order
    fn.def_partition(
        partition=partition,
        infer_sharding_from_operands=infer,
        sharding_rule=layout.rule,  # for Shardy: only "m" and N's factors may stay split
        need_replication_factors=tuple(whole),
        decode_shardings=_XlaSharding is None,  # else _decoded does, where it can
        **dict(layout.factor_sizes),
    )
    return fn


def _decoded(mesh, shapes) -> list:
    """Each operand's sharding as a NamedSharding on ``mesh``, or None where jax cannot
    read it as one (the rule then takes that operand as unsplit: gathered).

    XLA may split an array over part of a mesh axis (a ReLU aux whose bits dy's columns
    split finer than a byte: N = 128 over 32 devices puts each byte on 16 devices, each
    held by 2), or over the mesh's devices in another order (rows whose blocks a
    transpose permuted). custom_partitioning's own decoding raised there (an
    IndivisibleError, an AssertionError), on operands and results alike, before the rule
    was asked; the rule reads only the operands' shardings, so it decodes those itself."""
    decoded = []
    for shape in shapes:
        sharding = shape.sharding
        if _XlaSharding is not None and isinstance(sharding, _XlaSharding) and not mesh.empty:
            try:
                spec = _parse_hlo_sharding(sharding._to_xla_hlo_sharding(shape.ndim), mesh)[0]
            except Exception:  # noqa: BLE001 -- its failures vary (ValueError, AssertionError, KeyError)
                sharding = None
            else:
                sharding = NamedSharding(mesh, PartitionSpec(*spec))
        decoded.append(sharding)
    return decoded


def _split(layout: Layout, mesh, shapes, shardings) -> Split:
    """The mesh axes that split each member dimension (as the first batched operand whose
    dimension is split has them, if they divide it and leave the outer ones' alone: the
    others are resharded to match); those that split the first row operand's rows, if they
    leave the members' alone and divide M (likewise); those that split N in the deciding
    operand, if they leave both alone and divide N; the packed results that cannot split."""

    def axes(i: int, dim: int, taken: tuple[str, ...]) -> tuple[str, ...]:
        found = mesh_axes(shardings[i], dim) if isinstance(shardings[i], NamedSharding) else ()
        return () if set(found) & set(taken) or shapes[i][dim] % _size(mesh, found) else found

    members, taken = [], ()
    for level in range(layout.depth):
        members.append(next((found for i in layout.members if (found := axes(i, level, taken))), ()))
        taken += members[-1]
    members = tuple(members)
    first = layout.rows[0][0]
    rows = []
    for level in range(layout.row_dims):
        rows.append(axes(first, _offset(layout, 0, first) + level, taken))
        taken += rows[-1]
    rows = tuple(rows)
    if not layout.cols[0]:
        return Split(rows, (), members=members)
    i, dim = next(iter(layout.cols[0].items()))
    dim += _offset(layout, 0, i) + _extra_rows(layout, 0, i)
    cols = axes(i, dim, taken)
    if not cols:
        return Split(rows, (), members=members)
    share = shapes[i][dim] // _size(mesh, cols)
    return Split(rows, cols, tuple(r for r, per in layout.packed if not per or share % per), members)


def _offset(layout: Layout, side: int, i: int) -> int:
    """How many member dimensions operand (side 0) or result (side 1) ``i`` leads with."""
    return layout.depth if side == 1 or i in layout.members else 0


def _extra_rows(layout: Layout, side: int, i: int) -> int:
    """How many more dimensions than one M takes in operand (side 0) or result (side 1) ``i``."""
    return layout.row_dims - 1 if i in layout.rows[side] else 0


def _own_columns(result, dim: int, share: int, split: Split):
    """This device's ``share`` of a result's columns (dimension ``dim``): the block at its
    index along the split's axes where it computed every column, else the first ``share``
    of its own (a device's aux can be padded beyond its share)."""
    if split.whole:
        start = jax.lax.axis_index(split.cols) * share
        return jax.lax.dynamic_slice_in_dim(result, start, share, axis=dim)
    return jax.lax.slice_in_dim(result, 0, share, axis=dim) if result.shape[dim] != share else result


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _dims(layout: Layout, side: int, i: int, split: Split) -> dict[int, tuple[str, ...]]:
    """{dimension: mesh axes} of operand (side 0) or result (side 1) ``i`` under ``split``."""
    dims = {}
    offset = _offset(layout, side, i)
    for level, axes in enumerate(split.members[:offset]):
        if axes:
            dims[level] = axes
    if i in layout.rows[side]:
        for level, axes in enumerate(split.rows):
            if axes:
                dims[offset + level] = axes
    # A result that stays whole along N has every device compute every column.
    whole = bool(split.whole) if side == 0 else i in split.whole
    if i in layout.cols[side] and split.cols and not whole:
        dims[layout.cols[side][i] + offset + _extra_rows(layout, side, i)] = split.cols
    return dims


def _out_shardings(layout: Layout, mesh, result_shapes, split: Split):
    return [sharding_of(mesh, s.ndim, _dims(layout, 1, i, split)) for i, s in enumerate(result_shapes)]


# ------------------------------------------------ types under explicit sharding


def typed(layout: Layout, args, results) -> list[jax.core.ShapedArray]:
    """A primitive's abstract results ``[(shape, dtype), ...]`` for operands ``args``: split
    as the rule splits them (``layout``), on the operands' mesh where that mesh is explicit
    (an array's type then names its sharding); elsewhere plain ShapedArrays. Inside
    ``shard_map`` each result differs over the manual axes its operands differ over
    (``vary_alike`` made them the same)."""
    shardings = [getattr(a, "sharding", None) for a in args]
    explicit = next((s for s in shardings if is_explicit(s)), None)
    template = max(args, key=lambda a: len(varying(a)))
    if explicit is None:
        return [shaped_like(template, shape, dtype) for shape, dtype in results]
    mesh = explicit.mesh
    split = _split(layout, mesh, [a.shape for a in args], shardings)
    return [
        shaped_like(template, shape, dtype, sharding_of(mesh, len(shape), _dims(layout, 1, i, split)))
        for i, (shape, dtype) in enumerate(results)
    ]
