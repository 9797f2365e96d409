"""How tight two GPU tests can be (tests/test_gpu.py), measured on the device:

1. the seed layer (256x784->100, float16, float32 bias): how many outputs differ from the
   correctly rounded float32-bias value ``cast(act(x @ w + b))`` (XLA, float32 product), for
   the fused call and for a planted bug (the bias rounded to float16 before the add);
2. the DGELU input-gradient GEMM: its largest error against nvmath's own DGELU Matmul and
   against a float64 oracle, relative to the result's scale, per operand and aux dtype.

    python gpu_tolerances.py
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import jax_epilog

rng = np.random.default_rng()
print("1. seed layer, fraction of outputs != cast(act(x @ w + b)) in float32, and max |diff| in ulps")
for activation in ("relu", "gelu"):
    act = jax.nn.relu if activation == "relu" else functools.partial(jax.nn.gelu, approximate=True)
    for trial in range(3):
        x = jnp.asarray(rng.standard_normal((256, 784)), jnp.float16)
        w = jnp.asarray(rng.standard_normal((784, 100)) / np.sqrt(784), jnp.float16)
        b = jnp.asarray(rng.standard_normal(100), jnp.float32)
        y = jax.jit(functools.partial(jax_epilog.fused_dense, activation=activation, implementation="cublaslt"))(x, w, b)
        dot = jnp.dot(x, w, preferred_element_type=jnp.float32)
        exact = act(dot + b).astype(jnp.float16)
        planted = act(dot + b.astype(jnp.float16).astype(jnp.float32)).astype(jnp.float16)
        for name, got in (("fused", y), ("bias rounded", planted)):
            g, e = np.asarray(got, np.float32), np.asarray(exact, np.float32)
            ulp = np.spacing(np.abs(e).astype(np.float16)).astype(np.float32)
            print(f"  {activation} trial {trial} {name:13s} differ {np.mean(g != e):.4f}  max {np.max(np.abs(g - e) / ulp):.1f} ulp")

print("2. DGELU input gradient (300x133 dz, 101x133 kernel): max |err| / max(1, max|want|)")
import cupy as cp
from nvmath.linalg.advanced import Matmul, MatmulEpilog

from jax_epilog._primitive import fused_gelu_input_grad
from tests.test_gpu import _NP_DT, _device

m, n, k = 300, 133, 101
width = jax_epilog.aux_padded_width("gelu", k)
for dtype, aux_dtype in (("bfloat16", "bfloat16"), ("float16", "float16"), ("bfloat16", "float32"), ("float32", "float32")):
    worst_nv = worst_oracle = 0.0
    for trial in range(5):
        dz = jnp.asarray(rng.standard_normal((m, n)), dtype)
        w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(n), dtype)
        aux = jnp.asarray(rng.standard_normal((m, width)), aux_dtype)
        (got,) = jax.jit(functools.partial(fused_gelu_input_grad, compute_type=68))(dz, w, aux)
        a = _device(w, dtype, (k, n), (n, 1))
        bm = _device(dz, dtype, (n, m), (1, n))
        c = _device(np.zeros((m, k)), aux_dtype, (k, m), (1, k))
        gelu_aux = _device(aux, aux_dtype, (width, m), (1, width))
        with Matmul(a, bm, c=c, beta=0.0) as mm:
            mm.plan(epilog=MatmulEpilog.DGELU, epilog_inputs={"gelu_aux": gelu_aux})
            d_nv = mm.execute()
        bits = np.uint32 if aux_dtype == "float32" else np.uint16
        nv = cp.asnumpy(d_nv.view(bits)).view(_NP_DT[aux_dtype]).astype(np.float64).T
        z = np.asarray(aux, np.float64)[:, :k]
        dh = np.asarray(dz, np.float64) @ np.asarray(w, np.float64).T
        t = np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)
        dgelu = 0.5 * (1 + np.tanh(t)) + 0.5 * z * (1 - np.tanh(t) ** 2) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z**2)
        want = dh * dgelu
        g = np.asarray(got, np.float64)
        worst_nv = max(worst_nv, np.abs(g - nv).max() / max(1.0, np.abs(nv).max()))
        worst_oracle = max(worst_oracle, np.abs(g - want).max() / max(1.0, np.abs(want).max()))
    print(f"  {dtype:8s} aux {aux_dtype:8s} vs nvmath {worst_nv:.2e}  vs float64 oracle {worst_oracle:.2e}  (5 draws)")
