"""Probe: is one Pallas pass over an FP8 layer's output gradient faster than XLA's passes?

    python -m benchmarks.probes.fused_dz [--out DIR]

Backs docs/decisions.md#fp8-fused-dz (``jax_epilog/fp8/_fused_dz.py``). Per shape of dz
(the FP8 example's and benchmark rows' widths) and kind (GELU, none), the kernel with each
tile in BLOCKS against XLA's program for the same outputs, the library's own
(``fp8_output_grad``'s reference): dz = dy * act'(z) rounded to dy's dtype, its column sums
and amax, its E5M2 copy under a known scale; with ``+T`` also that copy's transpose (which
the kernel-gradient GEMM reads). Median µs per call, the contenders of a shape timed in
turns in one process; a tile Triton cannot compile says so. Each kernel's outputs are
checked against XLA's on the same GPU: the share of E5M2 values that differ (with GELU
about 1.5% sit one step apart: XLA's GPU program does not round as the emulation does, see
the decisions entry), the transpose, and the column sums' largest error relative to their
largest value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import listing_main, time_jax_interleaved
from jax_epilog.fp8 import _fused_dz
from jax_epilog.primitives.fp8_output_grad import reference

SHAPES = [(8192, 4096), (8192, 1024), (8192, 16384)]
BLOCKS = [(64, 128), (128, 128), (128, 64), (64, 64), (32, 128), (128, 256)]


def xla_passes(kind: str, transposed: bool):
    def run(dy, z, scale):
        q, sums, amax = reference(*((dy, scale) if kind == "none" else (dy, z, scale)), kind=kind)
        return (q, q.T, sums, amax) if transposed else (q, sums, amax)

    return jax.jit(run)


def kernel(kind: str, block, transposed: bool, interpret: bool = False):
    def run(dy, z, scale):
        other = z if kind == "gelu" else None
        out = _fused_dz.fused_dz(
            dy, other, scale, kind=kind, block=block, transposed=transposed, interpret=interpret
        )
        return tuple(o for o in out if o is not None)

    return jax.jit(run)


def check(got, want) -> str:
    """The kernel's outputs against XLA's, in one line."""
    apart = float(np.mean(np.asarray(got[0], np.float32) != np.asarray(want[0], np.float32)))
    note = f"apart {apart:.2e}"
    if len(got) == 4:
        same = np.array_equal(np.asarray(got[1], np.float32), np.asarray(got[0], np.float32).T)
        note += f", transpose {'ok' if same else 'WRONG'}"
    sums = np.asarray(want[-2])
    return note + f", sums err {float(np.abs(np.asarray(got[-2]) - sums).max() / np.abs(sums).max()):.1e}"


def _shape_lines(m, n, kind, transposed):
    keys = jax.random.split(jax.random.key(m + n), 2)
    dy = jax.random.normal(keys[0], (m, n), jnp.bfloat16)
    z = jax.random.normal(keys[1], (m, n), jnp.bfloat16) * 2
    scale = jnp.abs(dy).max().astype(jnp.float32) / 40000
    label = f"{m}x{n} {kind}{' +T' if transposed else ''}"
    xla = xla_passes(kind, transposed)
    want = jax.block_until_ready(xla(dy, z, scale))
    cases, notes = {"xla passes": (xla, (dy, z, scale))}, {}
    for block in BLOCKS:
        f = kernel(kind, block, transposed)
        try:
            got = jax.block_until_ready(f(dy, z, scale))
        except Exception as exc:  # noqa: BLE001 -- a tile Triton refuses is a finding
            yield f"{label} block {block}: failed: {type(exc).__name__}: {str(exc)[:200]}"
            continue
        cases[f"block {block}"], notes[f"block {block}"] = (f, (dy, z, scale)), check(got, want)
    times = dict(zip(cases, time_jax_interleaved(*cases.values())))
    for name, us in times.items():
        yield f"{label:22s} {name:18s} {us:8.1f} µs  {times['xla passes'] / us:5.2f}x  {notes.get(name, '')}"


def lines():
    yield f"# {jax.devices()[0].device_kind}, jax {jax.__version__}"
    for m, n in SHAPES:
        for kind in ("gelu", "none"):
            for transposed in (False, True):
                yield from _shape_lines(m, n, kind, transposed)


def main(argv=None):
    return listing_main(argv, __doc__, "fused_dz", lines)


if __name__ == "__main__":
    main()
