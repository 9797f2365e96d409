"""Probe: is one Pallas pass over an FP8 layer's output gradient faster than XLA's passes?

    python -m benchmarks.probes.fused_dz [--out DIR]

For ``jax_epilog/fp8/_fused_dz.py`` (not yet used by the library): per shape of dz (the
FP8 example's and benchmark rows' hidden and output widths) and kind (GELU, none), the
kernel with each tile in BLOCKS against XLA's program for the same outputs, written as the
library writes them: dz = dy * act'(z) rounded to dy's dtype, its column sums and amax, its
E5M2 copy under a known scale and that copy's transpose. Median µs per call, all
contenders of a shape timed in turns in one process; a tile Triton cannot compile says so.
Each kernel's outputs are checked against XLA's: the share of E5M2 values that differ
(GELU's slope cancels in its tail, so a few may be one step apart) and the column sums'
largest error relative to their largest magnitude.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import listing_main, time_jax_interleaved
from jax_epilog.fp8 import E5M2, _dense, _fused_dz, _quant

SHAPES = [(8192, 4096), (8192, 1024), (8192, 16384)]
BLOCKS = [(64, 128), (128, 128), (128, 64), (64, 64), (32, 128), (128, 256)]


def xla_passes(kind: str):
    def run(dy, z, scale):
        if kind == "gelu":
            dz = (dy.astype(jnp.float32) * _dense.gelu_slope(z.astype(jnp.float32))).astype(dy.dtype)
        else:
            dz = dy
        q = _quant.quantize(dz, E5M2, scale)
        sums = jnp.sum(dz, axis=0, dtype=jnp.float32)
        return q, q.T, sums, jnp.max(jnp.abs(dz)).astype(jnp.float32)

    return jax.jit(run)


def kernel(kind: str, block, interpret: bool = False):
    def run(dy, z, scale):
        other = z if kind == "gelu" else None
        return tuple(_fused_dz.fused_dz(dy, other, scale, kind=kind, block=block, interpret=interpret))

    return jax.jit(run)


def _check(got, want) -> str:
    apart = float(np.mean(np.asarray(got[0], np.float32) != np.asarray(want[0], np.float32)))
    transposed = bool(np.array_equal(np.asarray(got[1], np.float32), np.asarray(got[0], np.float32).T))
    sums = np.asarray(want[2])
    error = float(np.abs(np.asarray(got[2]) - sums).max() / np.abs(sums).max())
    return f"apart {apart:.2e}, transpose {'ok' if transposed else 'WRONG'}, sums err {error:.1e}"


def lines():
    yield f"# {jax.devices()[0].device_kind}, jax {jax.__version__}"
    for m, n in SHAPES:
        keys = jax.random.split(jax.random.key(m + n), 2)
        dy = jax.random.normal(keys[0], (m, n), jnp.bfloat16)
        z = jax.random.normal(keys[1], (m, n), jnp.bfloat16) * 2
        scale = jnp.abs(dy).max().astype(jnp.float32) / 40000
        for kind in ("gelu", "none"):
            xla = xla_passes(kind)
            want = jax.block_until_ready(xla(dy, z, scale))
            cases, notes = {"xla passes": (xla, (dy, z, scale))}, {}
            for block in BLOCKS:
                f = kernel(kind, block)
                try:
                    got = jax.block_until_ready(f(dy, z, scale))
                except Exception as exc:  # noqa: BLE001 -- a tile Triton refuses is a finding
                    yield f"{m}x{n} {kind} block {block}: failed: {type(exc).__name__}: {str(exc)[:200]}"
                    continue
                cases[f"block {block}"] = (f, (dy, z, scale))
                notes[f"block {block}"] = _check(got, want)
            times = dict(zip(cases, time_jax_interleaved(*cases.values())))
            for name, us in times.items():
                ratio = times["xla passes"] / us
                yield f"{m}x{n} {kind:4s} {name:18s} {us:8.1f} µs  {ratio:5.2f}x  {notes.get(name, '')}"


def main(argv=None):
    return listing_main(argv, __doc__, "fused_dz", lines)


if __name__ == "__main__":
    main()
