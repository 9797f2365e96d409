"""Probe: which FP8 problems does cuBLASLt run in the library's layout, and are they right?

    python -m benchmarks.probes.fp8_epilogs [--out DIR]

Backs docs/decisions.md#fp8-epilogs. Each problem is planned as the library plans it
(``Fp8Spec``: P (M, K) and Q (N, K) both K-contiguous, "TN"), autotuned (every candidate
launched once), run once on random FP8 operands with non-unit scales, and compared with a
float64 NumPy emulation of the same arithmetic: D's largest error relative to its largest
value, amax against max|y|, and the GELU aux against z. Problems: the forward's epilogs
(DEFAULT, BIAS, RELU_BIAS, GELU_BIAS, GELU_AUX_BIAS) writing bfloat16, float16 or E4M3 (with
D's scale and amax; amax beside a 16-bit D too), at M = 1000 and 1001; the input gradient
E5M2 dz x E4M3 kernel with DEFAULT, DGELU and DGELU_BGRAD; the kernel gradient E4M3 x^T x
E5M2 dz^T into float32 and bfloat16, with DEFAULT, BGRADA and BGRADB.
"""

from __future__ import annotations

import cupy as cp
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import listing_main
from jax_epilog._fp8_spec import Fp8Spec
from jax_epilog.cuda.plan import Plan, current_device

E4, E5, BF, F16, F32 = "float8_e4m3fn", "float8_e5m2", "bfloat16", "float16", "float32"


def specs():
    """(name, Fp8Spec) of every problem tried."""
    m, n, k = 1000, 768, 512
    for d in (BF, F16, E4):
        half = F16 if d == F16 else BF
        for epilog in ("DEFAULT", "BIAS", "RELU_BIAS", "GELU_BIAS", "GELU_AUX_BIAS"):
            bias = half if "BIAS" in epilog else None
            aux = half if "AUX" in epilog else None
            for amax in (0, 1):
                yield (
                    f"forward {epilog} d={d} amax={amax}",
                    Fp8Spec(m, n, k, epilog, E4, E4, d, bias, aux, amax, 1),
                )
    yield "forward GELU_AUX_BIAS m=1001", Fp8Spec(m + 1, n, k, "GELU_AUX_BIAS", E4, E4, E4, BF, BF, 1, 1)
    for epilog, bias in (("DEFAULT", None), ("DGELU", None), ("DGELU_BGRAD", BF)):
        aux = BF if "DGELU" in epilog else None
        yield f"dgrad {epilog}", Fp8Spec(m, n, k, epilog, E5, E4, BF, bias, aux, 0)
    for d in (F32, BF):
        for epilog in ("DEFAULT", "BGRADA", "BGRADB"):
            bias = d if "BGRAD" in epilog else None
            yield f"wgrad {epilog} d={d}", Fp8Spec(k, n, 1008, epilog, E4, E5, d, bias, None, 0)


def _upload(a: np.ndarray) -> cp.ndarray:
    out = cp.empty(a.nbytes, cp.uint8)
    out.set(np.ascontiguousarray(a).view(np.uint8).reshape(-1))
    return out


def _emulated(spec: Fp8Spec, host: dict) -> dict:
    """float64 D (before any cast), z, and dbias candidates, from the host operands."""
    acc = host["p"].astype(np.float64) @ host["q"].astype(np.float64).T
    acc *= float(host["p_scale"][0]) * float(host["q_scale"][0])
    z = acc + host["bias"].astype(np.float64) if spec.bias_in else acc
    if spec.epilog.startswith("DGELU"):
        slope = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))
        aux = host["aux"][:, : spec.n].astype(np.float32)
        y = acc * np.asarray(slope(jnp.asarray(aux.reshape(-1)))).reshape(aux.shape)
    elif spec.epilog.startswith("GELU"):
        y = np.asarray(jax.nn.gelu(jnp.asarray(z), approximate=True), np.float64)
    else:
        y = np.maximum(z, 0) if spec.epilog.startswith("RELU") else z
    return {"y": y, "z": z}


def attempt(spec: Fp8Spec, rng) -> str:
    host = {
        "p": rng.standard_normal((spec.m, spec.k)).astype(spec.p_dtype),
        "q": rng.standard_normal((spec.n, spec.k)).astype(spec.q_dtype),
        "p_scale": np.array([0.5], np.float32), "q_scale": np.array([1 / np.sqrt(spec.k)], np.float32),
        "d_scale": np.array([4.0], np.float32),
        "bias": rng.standard_normal(spec.n).astype(spec.bias_dtype or BF),
        "aux": rng.standard_normal((spec.m, spec.aux_ld)).astype(spec.aux_dtype or BF),
    }  # fmt: skip
    try:
        plan = Plan(spec, current_device(), 256, autotune=True)
    except Exception as exc:  # noqa: BLE001 -- a probe reports what cuBLASLt refused
        return "REFUSED " + str(exc).splitlines()[0][-150:]
    dtypes = {"d": spec.d_dtype, "amax": F32, "aux": spec.aux_dtype or spec.d_dtype, "dbias": spec.bias_dtype}
    sizes = spec.elements()
    dev = {name: _upload(host[name]) for name in spec.operands()}
    dev |= {r: cp.zeros(sizes[r] * np.dtype(dtypes[r]).itemsize, cp.uint8) for r in spec.results()}
    ptrs = spec.call_pointers(
        [dev[n].data.ptr for n in spec.operands()], [dev[n].data.ptr for n in spec.results()]
    )
    stream = cp.cuda.Stream(non_blocking=True)
    try:
        plan.run(stream.ptr, *ptrs)
        stream.synchronize()
    except Exception as exc:  # noqa: BLE001
        return "FAILED AT LAUNCH " + str(exc).splitlines()[0][:150]
    want = _emulated(spec, host)
    got = dev["d"].get().view(np.dtype(spec.d_dtype)).reshape(spec.m, spec.n).astype(np.float64)
    ref = want["y"] * (4.0 if spec.d_fp8 else 1.0)
    line = f"ran (candidate {plan.choice}); D error {np.abs(got - ref).max() / np.abs(ref).max():.2g}"
    if spec.amax:
        line += f"; amax {float(dev['amax'].get().view(np.float32)[0]):.5g} vs {np.abs(want['y']).max():.5g}"
    if spec.aux_out:
        aux = dev["aux"].get().view(np.dtype(dtypes["aux"])).reshape(spec.m, spec.aux_ld)[:, : spec.n]
        line += f"; aux error {np.abs(aux.astype(np.float64) - want['z']).max():.2g}"
    if "dbias" in spec.results():
        dbias = dev["dbias"].get().view(np.dtype(spec.bias_dtype)).astype(np.float64)
        # the bias gradient: the epilog's output summed over the rows of whichever side it has
        sums = [ref.sum(axis) for axis in (0, 1) if ref.shape[1 - axis] == dbias.size]
        err = min(np.abs(dbias - s).max() / np.abs(s).max() for s in sums) if sums else np.inf
        line += f"; dbias error {err:.2g}"
    return line


def main(argv=None):
    def lines():
        yield f"# {cp.cuda.runtime.getDeviceProperties(current_device())['name'].decode()}"
        rng = np.random.default_rng(0)
        for name, spec in specs():
            yield f"{name:40s} {attempt(spec, rng)}"

    listing_main(argv, __doc__, "fp8_epilogs", lines)


if __name__ == "__main__":
    main()
