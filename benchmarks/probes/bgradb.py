"""Probe: does BGRADB fold the bias gradient into the kernel-gradient GEMM where BGRADA does not?

    python -m benchmarks.probes.bgradb [--out DIR]

The backward's kernel-gradient GEMM with the bias gradient in its epilog can be posed two
ways in cuBLASLt's column-major terms (x is (M, K), dz is (M, N), both row-major, bf16):

- ``BGRADA``: D[N, K] = dz^T[N, M] @ x[M, K], the row-major (K, N) kernel gradient as
  jax_epilog plans it (``EpilogSpec`` problem "wgrad"); the epilog reduces A = dz^T.
  On the H200 cuBLASLt 13.1 runs that reduction as a kernel of its own after the GEMM
  (``globalKernelBgradAB_v2``, 30.5 µs at 8192x1024->4096: the 2026-12-02 (f) profile).
- ``BGRADB``: D[K, N] = x^T[K, M] @ dz[M, N], the epilog reduces B = dz. D is the
  row-major (N, K) *transposed* kernel gradient (a transpose more for Flax's layout).

Each is timed against the same GEMM without an epilog (nvmath-python ``Matmul`` planned and
autotuned, CUDA events over back-to-back ``execute()``, median of 7 × 30: GPU-bound here,
the GEMMs take longer than an execute's host time), with XLA's ``x.T @ dz`` and
``(x.T @ dz, dz.sum(0))`` as the peers, and the bias gradient checked against float32 sums.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.forward import time_jax_interleaved, write_results
from benchmarks.probes.dgrad import _to_device, _to_host, execute_us

SHAPES = [(8192, 1024, 4096), (8192, 4096, 16384), (8192, 4096, 1024)]  # (M, K, N)
VARIANTS = ("DEFAULT_A", "BGRADA", "DEFAULT_B", "BGRADB")


def nvmath_time(variant: str, x: np.ndarray, dz: np.ndarray):
    """(GPU µs per execute, relative error of the bias gradient or None)."""
    import cupy as cp
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    k, n = x.shape[1], dz.shape[1]
    if variant.endswith("A"):  # D[n, k] = dz^T @ x: column-major (n, k) = row-major (k, n)
        a, b, c = _to_device(dz).T, _to_device(x), cp.ndarray((k, n), x.dtype).T
    else:  # D[k, n] = x^T @ dz: column-major (k, n) = row-major (n, k)
        a, b, c = _to_device(x).T, _to_device(dz), cp.ndarray((n, k), x.dtype).T
    epilog = None if variant.startswith("DEFAULT") else MatmulEpilog[variant]
    mm = Matmul(a, b, c=c, beta=0.0)
    mm.plan(epilog=epilog)
    mm.autotune(iterations=5)
    out = mm.execute()
    db = out[1][variant.lower()] if epilog is not None else None
    us = execute_us(mm)
    mm.free()
    err = None
    if db is not None:
        want = dz.astype(np.float32).sum(0)
        err = float(np.max(np.abs(_to_host(cp.ascontiguousarray(db.ravel())) - want)) / np.max(np.abs(want)))
    return us, err


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    wgrad = jax.jit(lambda x, dz: x.T @ dz)
    wgrad_sum = jax.jit(lambda x, dz: (x.T @ dz, dz.astype(jnp.float32).sum(0).astype(dz.dtype)))
    rows = []
    for m, k, n in SHAPES:
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        dz = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        xla_us, xla_sum_us = time_jax_interleaved((wgrad, (x, dz)), (wgrad_sum, (x, dz)))
        row = {"shape": f"{m}x{k}->{n}", "xla_us": xla_us, "xla_sum_us": xla_sum_us}
        for variant in VARIANTS:
            try:
                us, err = nvmath_time(variant, np.asarray(x), np.asarray(dz))
                row[variant] = us
                row[f"{variant}_err"] = err
            except Exception as exc:  # noqa: BLE001 -- a refused variant is a result too
                row[variant] = None
                row[f"{variant}_err"] = f"{type(exc).__name__}: {exc}"[:160]
        rows.append(row)
        print(row, flush=True)
    lines = [
        "| M×K→N (bf16) | XLA x.T @ dz | + dz.sum(0) | DEFAULT (D[N,K]) | BGRADA | DEFAULT (D[K,N]) | BGRADB | db error A / B |",
        "|---|---|---|---|---|---|---|---|",
    ]
    f = lambda v: "—" if v is None else f"{v:.1f}"
    for r in rows:
        errs = " / ".join(str(r[f"{v}_err"]) if not isinstance(r[f"{v}_err"], float) else f"{r[f'{v}_err']:.1e}"
                          for v in ("BGRADA", "BGRADB"))  # fmt: skip
        lines.append(
            f"| {r['shape']} | {f(r['xla_us'])} | {f(r['xla_sum_us'])} | "
            + " | ".join(f(r[v]) for v in VARIANTS)
            + f" | {errs} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_results(args.out, "bgradb", rows, table)


if __name__ == "__main__":
    main()
