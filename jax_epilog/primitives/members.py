"""``members_p``: the forward for every member of an ensemble (``vmap`` over weights).

``members_p`` binds ``fused_matmul_p`` (with ``inner_params``) once per member of the
``batched`` operands (their first ``depth`` dimensions; an ensemble of ensembles has two).
Elsewhere that is a ``lax.map`` loop; on a GPU it is one strided-batched cuBLASLt GEMM with
the epilog, which reads every member's operands and writes its results in place, where a
loop would slice each member's operands out and stack its results. The loop stays for
fewer than two members, for members that share x and the kernel, and for a batch cuBLASLt
refuses (it warns once; each member then runs its own fused call, or XLA's). Over several
devices the members split as the weights arrive, then the rows and N as the forward's do.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import ad, mlir

from .._padding import cut_to, padded_spec
from .._partition import Layout
from .._typing import shaped_like, whole_leading
from .._warnings import MembersLoopWarning, warn_once
from ..cuda import ffi
from . import forward
from ._base import new_primitive, register, symbolic

__all__ = ["bind_members", "members_p"]

members_p = new_primitive("members")


def bind_members(args, dims, params):
    """The forward's batching rule for batched weights: ``members_p`` over the batch."""
    moved = [a if d is None else jnp.moveaxis(a, d, 0) for a, d in zip(args, dims)]
    batched = tuple(d is not None for d in dims)
    outs = members_p.bind(*moved, inner_params=tuple(sorted(params.items())), batched=batched, depth=1)
    return outs, [0] * len(outs)


def _member_loop(*operands, inner_params, batched, depth):
    """The members in a ``lax.map`` loop (each split dimension made whole first: ``lax.map``
    refuses to loop over one)."""
    lead = next(o.shape[:depth] for o, b in zip(operands, batched) if b)
    size = math.prod(lead)
    stacked = [
        whole_leading(o, depth).reshape(size, *o.shape[depth:])
        if b
        else jnp.broadcast_to(o, (size, *o.shape))
        for o, b in zip(operands, batched)
    ]
    outs = jax.lax.map(lambda ops: forward.fused_matmul_p.bind(*ops, **dict(inner_params)), stacked)
    return [o.reshape(*lead, *o.shape[1:]) for o in outs]


def _one_member(avals, batched, depth):
    return [shaped_like(a, a.shape[depth:], a.dtype) if b else a for a, b in zip(avals, batched)]


def _results(*avals, inner_params, batched, depth):
    lead = next(a.shape[:depth] for a, b in zip(avals, batched) if b)
    outs, _ = forward.fused_matmul_p.abstract_eval(*_one_member(avals, batched, depth), **dict(inner_params))
    return [((*lead, *o.shape), o.dtype) for o in outs]


def _layout(avals, *, inner_params, batched, depth) -> Layout:
    one = _one_member(avals, batched, depth)
    return forward.layout(one, **dict(inner_params)).over_members(batched, depth)


def _jvp(primals, tangents, *, inner_params, batched, depth, partitioned=False):
    """The members' values from ``members_p`` (split as they are), their tangents from the
    forward's own rule batched over the members (XLA's ops, which XLA splits itself)."""
    del partitioned
    tangents = [ad.instantiate_zeros(t) for t in tangents]
    axes = [0 if b else None for b in batched]
    one = functools.partial(forward.tangents, **dict(inner_params))
    for _ in range(depth):
        one = jax.vmap(one, in_axes=(axes, axes))
    outs = members_p.bind(*primals, inner_params=inner_params, batched=batched, depth=depth)
    return outs, one(list(primals), tangents)


def _batch(args, dims, *, inner_params, batched, depth, partitioned=False):
    """A vmap of an ensemble. A new axis on the operands that hold the forward's rows only
    (whether members' or shared) becomes one more leading dimension of those rows, where no
    result sums over them: one call (a per-example model over an ensemble). Any other
    becomes an outer member dimension (an ensemble of ensembles), the operands it or the
    members leave out broadcast along it."""
    del partitioned
    unmapped = [
        jax.core.ShapedArray(np.delete(a.shape, [d] if d is not None else []), a.dtype)
        for a, d in zip(args, dims)
    ]
    one = _one_member(unmapped, batched, depth)
    layout = forward.layout(one, **dict(inner_params))
    results = len(forward.fused_matmul_p.abstract_eval(*one, **dict(inner_params))[0])
    rows = layout.rows[0]
    new_rows_only = all((d is not None) == (i in rows) for i, d in enumerate(dims))
    if new_rows_only and not layout.summed and len(layout.rows[1]) == results:
        (row_operand,) = rows  # (x: its rows are the forward's only ones)
        moved = list(args)  # the new axis leads the rows (after any member dimensions)
        moved[row_operand] = jnp.moveaxis(
            args[row_operand], dims[row_operand], depth if batched[row_operand] else 0
        )
        outs = members_p.bind(*moved, inner_params=inner_params, batched=batched, depth=depth)
        return outs, [depth] * len(outs)
    return _deeper(args, dims, unmapped, inner_params, batched, depth)


def _deeper(args, dims, unmapped, inner_params, batched, depth):
    """The vmap's axis as a new outer member dimension."""
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
    outs = members_p.bind(*deeper, inner_params=inner_params, batched=batched, depth=depth + 1)
    return outs, [0] * len(outs)


def _cuda(ctx, *operands, inner_params, batched, depth):
    """One strided-batched GEMM for the members, or the loop (see the module docstring)."""
    params = dict(inner_params)
    loop = functools.partial(_member_loop, inner_params=inner_params, batched=batched, depth=depth)
    lower_loop = mlir.lower_fun(loop, multiple_results=True)
    lead = next(a.shape[:depth] for a, b in zip(ctx.avals_in, batched) if b)
    spec = None
    if (batched[0] or batched[1]) and not symbolic(*ctx.avals_in):  # (nvmath batches by x and the kernel)
        spec = forward.forward_spec(_one_member(ctx.avals_in, batched, depth), **params)
    if spec is None or math.prod(lead) < 2:
        return lower_loop(ctx, *operands)  # (each member's call warns where it must)
    shared = ",".join(name for name, b in zip(("x", "kernel", "bias"), batched) if not b)
    spec = padded_spec(spec._replace(members=math.prod(lead), shared=shared))
    refusal = ffi.prepare(spec)
    if refusal is not None:
        warn_once(
            refusal,
            f"{spec.members} members run one fused call each, not one batched call",
            MembersLoopWarning,
        )
        return lower_loop(ctx, *operands)

    def batched_call(*ops):
        flat = [o.reshape(spec.members, *o.shape[depth:]) if b else o for o, b in zip(ops, batched)]
        results = [jax.ShapeDtypeStruct((spec.members, *a.shape[depth:]), a.dtype) for a in ctx.avals_out]
        results[0] = jax.ShapeDtypeStruct((spec.members, spec.m, spec.n), params["d_dtype"])  # D: padded rows
        d, *aux = ffi.call(forward.padded_operands(spec, *flat), results, spec)
        outs = [cut_to(d, ctx.avals_out[0].shape[-1]).astype(params["out_dtype"]), *aux]
        return [o.reshape(*lead, *o.shape[1:]) for o in outs]

    return mlir.lower_fun(batched_call, multiple_results=True)(ctx, *operands)


register(
    members_p, results=_results, layout=_layout, reference=_member_loop, cuda=_cuda, batch=_batch, jvp=_jvp
)
