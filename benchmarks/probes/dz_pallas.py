"""Probe: can one Pallas (Triton) kernel form the backward's dz and bias gradient faster than XLA?

    python -m benchmarks.probes.dz_pallas [--out DIR] [--shape M N ...] [--interpret]

The backward of ``act(x @ w + b)`` needs ``dz = dy * act'(z)`` (from the forward's aux: the
ReLU bit-mask or the GELU input z) and ``db = dz.sum(0)``. In XLA's own fwd+bwd profile
(results/2026-12-02-h200-f-profile/kernels.md) that pass is a 28 µs reduction for ReLU and
a 78 µs ``dz + sum`` fusion for GELU at 8192x1024->4096, far from the ~14 µs / ~27 µs that
reading and writing those bytes take. This probe times, per (M, N), bf16, median of
interleaved samples (``benchmarks.forward.time_jax_interleaved``) of one jitted call that
runs the pass on ``SETS`` distinct input sets (so that the call's host cost, ~40-60 µs on
the device's host, is spread over them), µs per set:

- ``xla_dz``: ``_reference.output_grad`` alone (what the "cublaslt" backward runs);
- ``xla_dz_sum``: dz and its column sums in one jit (XLA's fusion choice);
- ``xla_sum``: the column sums alone (dz left to the GEMMs' prologue fusions);
- ``pallas_dz_sum bm x bn``: one Pallas kernel writing dz and per-block column sums (then
  XLA sums the few partial rows), for a few block sizes;
- ``pallas_sum bm x bn``: the same kernel without the dz store;

and checks each Pallas result against the XLA one (max |diff| relative to the largest
entry). The kernel works on whole blocks: inputs whose sides are not multiples of the block
are padded first (on the H200, Pallas's Triton lowering of jax 0.11.2 wrote wrong values
in partial blocks: results/2026-12-03-h200-n-backward/run1/dz.log).
"""

from __future__ import annotations

import argparse
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from benchmarks.forward import time_jax_interleaved, write_results
from jax_epilog import _reference
from jax_epilog._epilogs import Activation, ComputeType, aux_padded_width

SHAPES = [(8192, 4096), (8192, 1024), (8192, 16384)]  # (M, N) of the forward's output
CHECK_SHAPES = [(777, 1001), (1, 8), (130, 129)]
BLOCKS = [(32, 256), (64, 256), (32, 512), (64, 128)]
SETS = 8  # input sets per timed call
CT = ComputeType.COMPUTE_32F
_C = math.sqrt(2.0 / math.pi)
_A = 0.044715


def _gelu_grad(z):
    """d/dz of the tanh-approximated GELU."""
    t = jnp.tanh(_C * (z + _A * z * z * z))
    return 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _C * (1.0 + 3.0 * _A * z * z)


def _kernel(dy_ref, aux_ref, *out_refs, activation, bm, bn, store_dz):
    dy = dy_ref[...].astype(jnp.float32)
    if activation is Activation.GELU:
        dz = dy * _gelu_grad(aux_ref[...].astype(jnp.float32))
    else:  # bit j % 8 of byte j // 8 is z[:, j] > 0
        packed = aux_ref[...].astype(jnp.int32)  # (bm, bn // 8)
        shifts = jax.lax.broadcasted_iota(jnp.int32, (bm, bn // 8, 8), 2)
        bits = (jnp.broadcast_to(packed[:, :, None], (bm, bn // 8, 8)) >> shifts) & 1
        dz = jnp.where(bits.reshape(bm, bn) != 0, dy, 0.0)
    dz = dz.astype(dy_ref.dtype)
    if store_dz:
        out_refs[0][...] = dz
    out_refs[-1][...] = jnp.sum(dz.astype(jnp.float32), axis=0, keepdims=True)


def dz_and_sum(dy, aux, activation: Activation, bm: int, bn: int, store_dz=True, interpret=False):
    """(m, n) dy and the forward's aux -> (dz in dy's dtype or None, float32 column sums of dz)."""
    m, n = dy.shape
    grid = (pl.cdiv(m, bm), pl.cdiv(n, bn))
    if (m % bm, n % bn) != (0, 0):  # whole blocks only (see the module's docstring); dy's
        # zero padding makes dz zero there
        aux_cols = grid[1] * (bn // 8 if activation is Activation.RELU else bn)
        dy = jnp.pad(dy, [(0, grid[0] * bm - m), (0, grid[1] * bn - n)])
        aux = jnp.pad(aux, [(0, grid[0] * bm - m), (0, max(0, aux_cols - aux.shape[1]))])
        dz, db = dz_and_sum(dy, aux, activation, bm, bn, store_dz, interpret)
        return (None if dz is None else dz[:m, :n]), db[:n]
    aux_block = (bm, bn // 8) if activation is Activation.RELU else (bm, bn)
    block = pl.BlockSpec((bm, bn), lambda i, j: (i, j))
    out_specs = [pl.BlockSpec((1, bn), lambda i, j: (i, j))]
    out_shape = [jax.ShapeDtypeStruct((grid[0], n), jnp.float32)]
    if store_dz:
        out_specs.insert(0, block)
        out_shape.insert(0, jax.ShapeDtypeStruct((m, n), dy.dtype))
    outs = pl.pallas_call(
        functools.partial(_kernel, activation=activation, bm=bm, bn=bn, store_dz=store_dz),
        grid=grid,
        in_specs=[block, pl.BlockSpec(aux_block, lambda i, j: (i, j))],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
    )(dy, aux)
    return (outs[0] if store_dz else None), outs[-1].sum(0)


def _xla(kind: str, activation: Activation):
    def dz(dy, aux):
        return _reference.output_grad(aux, dy, None, activation, CT, dy.dtype)

    if kind == "xla_dz":
        return dz
    if kind == "xla_dz_sum":
        return lambda dy, aux: (dz(dy, aux), dz(dy, aux).astype(jnp.float32).sum(0))
    return lambda dy, aux: dz(dy, aux).astype(jnp.float32).sum(0)


def _over_sets(f):
    """One jitted call that applies ``f`` to each of a list of (dy, aux) sets."""
    return jax.jit(lambda sets: [f(dy, aux) for dy, aux in sets])


def _operands(m, n, activation, seed=0):
    rng = np.random.default_rng(seed)
    dy = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal((m, n), np.float32) * 2, jnp.bfloat16)
    if activation is Activation.RELU:
        aux = _reference.pack_relu_mask(z)
    else:
        aux = jnp.pad(z, [(0, 0), (0, aux_padded_width(activation, n) - n)])
    return dy, aux


def _err(got, want) -> float:
    got, want = (np.asarray(v, np.float32) for v in (got, want))
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def check(activation, bm, bn, interpret) -> list[str]:
    lines = []
    for m, n in CHECK_SHAPES:
        dy, aux = _operands(m, n, activation, seed=m + n)
        want_dz, want_db = jax.jit(_xla("xla_dz_sum", activation))(dy, aux)
        dz, db = jax.jit(
            functools.partial(dz_and_sum, activation=activation, bm=bm, bn=bn, interpret=interpret)
        )(dy, aux)
        lines.append(
            f"check {activation.value} {m}x{n} {bm}x{bn}: dz {_err(dz, want_dz):.2e} db {_err(db, want_db):.2e}"
        )
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--shape", nargs=2, type=int, action="append", metavar=("M", "N"))
    parser.add_argument("--interpret", action="store_true", help="Pallas interpreter (CPU), small shapes")
    args = parser.parse_args(argv)
    shapes = [tuple(s) for s in args.shape] if args.shape else [(256, 384)] if args.interpret else SHAPES
    blocks = BLOCKS[:1] if args.interpret else BLOCKS
    rows, lines = [], []
    for activation in (Activation.RELU, Activation.GELU):
        lines += check(activation, *blocks[0], args.interpret)
        print("\n".join(lines[-len(CHECK_SHAPES) :]), flush=True)
        for m, n in shapes:
            sets = [_operands(m, n, activation, seed=s) for s in range(SETS)]
            dy, aux = sets[0]
            cases = {k: _xla(k, activation) for k in ("xla_dz", "xla_dz_sum", "xla_sum")}
            _, want_db = jax.jit(cases["xla_dz_sum"])(dy, aux)
            errors = {}
            for bm, bn in blocks:
                for store in (True, False):
                    name = f"pallas_{'dz_sum' if store else 'sum'} {bm}x{bn}"
                    f = functools.partial(
                        dz_and_sum,
                        activation=activation,
                        bm=bm,
                        bn=bn,
                        store_dz=store,
                        interpret=args.interpret,
                    )
                    try:
                        errors[name] = _err(jax.jit(f)(dy, aux)[1], want_db)
                        cases[name] = f
                    except Exception as exc:  # noqa: BLE001 -- a block size the lowering refuses: say so, go on
                        lines.append(
                            f"{name} {activation.value} {m}x{n}: {type(exc).__name__}: {str(exc)[:200]}"
                        )
            times = time_jax_interleaved(*((_over_sets(f), (sets,)) for f in cases.values()))
            times = [t / SETS for t in times]
            gb = (dy.nbytes + aux.nbytes + dy.nbytes) / 1e9  # read dy and aux, write dz
            for (name, _), us in zip(cases.items(), times):
                row = {
                    "activation": activation.value,
                    "m": m,
                    "n": n,
                    "case": name,
                    "us": us,
                    "db_err": errors.get(name),
                }
                rows.append(row)
                lines.append(
                    f"{activation.value:4} {m}x{n} {name:22} {us:8.1f} µs"
                    f"  ({gb / us * 1e6 / 1e3:5.2f} TB/s for dy+aux+dz)"
                    + (f"  db err {errors[name]:.1e}" if name in errors else "")
                )
                print(lines[-1], flush=True)
    table = "\n".join(lines)
    if args.out:
        write_results(args.out, "dz_pallas", rows, "```\n" + table + "\n```\n")


if __name__ == "__main__":
    main()
