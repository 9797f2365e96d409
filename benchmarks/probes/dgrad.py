"""Probe: which input-gradient epilog is worth a cross-layer backward (DRELU, DGELU, with BGRAD)?

    python -m benchmarks.probes.dgrad [--out DIR]

Backs ``fused_mlp``'s link (docs/decisions.md, mlp-link): in an MLP, layer l's input
gradient ``dh = dz_l @ W_l.T`` is the output cotangent of layer l-1, whose backward then
forms ``dz_{l-1} = dh * act'(z_{l-1})`` and ``db_{l-1} = dz_{l-1}.sum(0)``. cuBLASLt can do
all three in the dh GEMM's epilog, reading layer l-1's forward aux. This times, per shape
(bf16, M rows, dh of width P from an inner dimension N):

- ``xla_relu``, ``xla_gelu``: ``jax.jit`` of the three steps written in jnp (XLA's GEMM, then its fusion);
- ``xla_relu_nosum``, ``xla_gelu_nosum``: the same without ``db`` (to set against DRELU, DGELU);
- ``xla_gemm``: XLA's ``dz @ W.T`` alone;
- ``<epilog>``: nvmath-python's ``Matmul`` (planned, autotuned) with DEFAULT, DRELU,
  DRELU_BGRAD, DGELU or DGELU_BGRAD, GPU time between CUDA events over back-to-back executes
  (host-bound at the small shape: nvmath's execute costs tens of µs of host time);

and checks the epilog's outputs against float32 arithmetic on the same inputs.
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import time_jax_interleaved, write_results

SHAPES = [  # (M, P, N): dh (M, P) = dz (M, N) @ W.T with W (P, N)
    (8192, 4096, 1024),  # transformer MLP 1024 -> 4096 -> 1024: into the hidden layer
    (8192, 16384, 4096),  # 4096 -> 16384 -> 4096
    (8192, 1024, 4096),
    (256, 1024, 1024),  # the small chain's layers
]
REPEATS, ITERS = 7, 30
EPILOGS = ("DEFAULT", "DRELU", "DRELU_BGRAD", "DGELU", "DGELU_BGRAD")


def _gelu_grad(z, dh):
    return jax.vjp(lambda z: jax.nn.gelu(z, approximate=True), z)[1](dh)[0]


def xla_programs():
    def steps(act, with_sum):
        def f(dz, w, z):
            dh = (dz @ w.T).astype(jnp.float32)
            zf = z.astype(jnp.float32)
            dzp = dh * (zf > 0) if act == "relu" else _gelu_grad(zf, dh)
            return (dzp.astype(dz.dtype), dzp.sum(0).astype(dz.dtype)) if with_sum else dzp.astype(dz.dtype)

        return jax.jit(f)

    progs = {f"xla_{act}": steps(act, True) for act in ("relu", "gelu")}
    progs |= {f"xla_{act}_nosum": steps(act, False) for act in ("relu", "gelu")}
    return progs | {"xla_gemm": jax.jit(lambda dz, w, z: dz @ w.T)}


def _to_device(host: np.ndarray):
    """A C-ordered CuPy copy of ``host`` (bfloat16 goes over as raw bytes: CuPy has no
    bfloat16 kernels, only the dtype)."""
    import cupy as cp

    host = np.ascontiguousarray(host)
    raw = cp.asarray(host.view(np.uint8))
    return cp.ndarray(host.shape, host.dtype, raw.data)


def _to_host(dev) -> np.ndarray:
    """A C-contiguous CuPy array back as float32 NumPy."""
    import cupy as cp

    raw = cp.asnumpy(dev.view(cp.uint8) if dev.dtype.itemsize == 1 else dev.view(f"u{dev.dtype.itemsize}"))
    return raw.view(dev.dtype).astype(np.float32)


def execute_us(mm, repeats: int = REPEATS, iters: int = ITERS) -> float:
    """GPU µs per ``mm.execute()`` (an nvmath ``Matmul``): median over ``repeats`` runs of
    ``iters`` back-to-back executes between CUDA events on the current stream."""
    import cupy as cp

    stream = cp.cuda.get_current_stream()
    times = []
    for _ in range(repeats):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(iters):
            mm.execute()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / iters)
    return statistics.median(times)


def nvmath_time(m, p, n, epilog_name, dz, w, z):
    """(GPU µs per execute, relative error of dh, relative error of db) for one epilog."""
    import cupy as cp
    from nvmath.linalg.advanced import Matmul, MatmulEpilog

    dz, w, z = (np.asarray(v) for v in (dz, w, z))  # bfloat16 (ml_dtypes) on the host
    # Column-major D[p, m] = W[p, n] @ dz^T[n, m], i.e. the row-major (m, p) dh.
    a = _to_device(w)  # row-major (p, n)
    b = _to_device(dz).T  # (n, m), column-major
    c = cp.ndarray((m, p), dz.dtype).T  # pins D to column-major (p, m)
    inputs = None
    if epilog_name.startswith("DRELU"):
        aux = np.zeros((m, -(-p // 128) * 16), np.uint8)
        bits = np.packbits(z.astype(np.float32) > 0, axis=1, bitorder="little")
        aux[:, : bits.shape[1]] = bits
        inputs = {"relu_aux": _to_device(aux).T}
    elif epilog_name.startswith("DGELU"):
        aux = np.zeros((m, -(-p // 8) * 8), z.dtype)
        aux[:, :p] = z
        inputs = {"gelu_aux": _to_device(aux).T}
    epilog = None if epilog_name == "DEFAULT" else MatmulEpilog[epilog_name]
    mm = Matmul(a, b, c=c, beta=0.0)
    mm.plan(epilog=epilog, epilog_inputs=inputs)
    mm.autotune(iterations=5)
    out = mm.execute()
    d, db = (out[0], out[1][epilog_name.lower()]) if "BGRAD" in epilog_name else (out, None)
    us = execute_us(mm)
    mm.free()
    # float32 arithmetic on the same bfloat16 inputs
    dh = dz.astype(np.float32) @ w.astype(np.float32).T
    zf = z.astype(np.float32)
    if epilog_name.startswith("DRELU"):
        dh = dh * (zf > 0)
    elif epilog_name.startswith("DGELU"):
        dh = np.asarray(_gelu_grad(jnp.asarray(zf), jnp.asarray(dh)))
    err_d = float(np.max(np.abs(_to_host(d.T) - dh)) / np.max(np.abs(dh)))
    err_b = None
    if db is not None:
        ref_b = dh.sum(0)
        err_b = float(np.max(np.abs(_to_host(db.ravel()) - ref_b)) / np.max(np.abs(ref_b)))
    return us, err_d, err_b


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    progs = xla_programs()
    rows = []
    for m, p, n in SHAPES:
        rng = np.random.default_rng(0)
        dz = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((p, n)) / np.sqrt(n), jnp.bfloat16)
        z = jnp.asarray(rng.standard_normal((m, p)), jnp.bfloat16)
        times = time_jax_interleaved(*((f, (dz, w, z)) for f in progs.values()))
        row = {"shape": f"{m}x{n}->{p}", **dict(zip(progs, times))}
        for name in EPILOGS:
            try:
                us, err_d, err_b = nvmath_time(m, p, n, name, dz, w, z)
                row[name] = us
                row[name + "_err"] = (err_d, err_b)
            except Exception as exc:  # noqa: BLE001 -- a probe reports what cuBLASLt refused
                row[name] = None
                row[name + "_err"] = f"{type(exc).__name__}: {exc}"[:200]
        print(row, flush=True)
        rows.append(row)
    cols = [*progs, *EPILOGS]
    lines = ["| dz (M×N) → dh (M×P) | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in rows:
        cells = ["—" if r[c] is None else f"{r[c]:.1f}" for c in cols]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Relative errors (dh, db) against float32 arithmetic on the same inputs:")
    for r in rows:
        lines.append(f"- {r['shape']}: " + "; ".join(f"{e}: {r[e + '_err']}" for e in EPILOGS[1:]))
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_results(args.out, "dgrad", rows, table)


if __name__ == "__main__":
    main()
