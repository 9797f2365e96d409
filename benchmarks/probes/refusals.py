"""Probe: which small problems does cuBLASLt plan but then refuse to launch?

    python -m benchmarks.probes.refusals

Jits each primitive alone (its arguments passed in, as XLA's buffers) for one-row and
few-row problems: the forward with a float32 D beside bf16 operands (a float32 bias), the
kernel-gradient GEMM (BGRADA) and the DGELU input-gradient GEMM. Prints "ok" or the error,
and the plans lowering made (epilog, pointer alignment, the autotuner's best µs: inf means
every candidate algorithm failed to launch). Run on the H200 with the primitives routing
nothing away (before the one-row rules in ``_primitive.py``): one row failed for the float32-D
forward and for DGELU, nothing else did (``results/2026-12-02-h200-h-mlp/one-row-refusals.txt``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_epilog import _nvmath
from jax_epilog._epilogs import Activation, ComputeType
from jax_epilog._primitive import fused_gelu_input_grad, fused_matmul, fused_weight_grad

CT = ComputeType.COMPUTE_32F
BF16 = jnp.bfloat16


def cases(rng):
    def arr(shape, dtype):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    for m, k, n in [(1, 6, 11), (1, 11, 1), (2, 6, 11), (4, 6, 11)]:
        for act in (None, Activation.GELU):
            yield (
                f"fwd {act and act.value} f32bias m{m}k{k}n{n}",
                lambda x, w, b, act=act: fused_matmul(
                    x, w, b, activation=act, with_aux=act is not None, compute_type=CT,
                    d_dtype="float32", out_dtype=BF16,
                ),
                (arr((m, k), BF16), arr((k, n), BF16), arr((n,), jnp.float32)),
            )  # fmt: skip
        for d in ("float32", "bfloat16"):
            yield (
                f"wgrad d={d} m{m}k{k}n{n}",
                lambda x, dz, d=d: fused_weight_grad(x, dz, compute_type=CT, d_dtype=d),
                (arr((m, k), BF16), arr((m, n), BF16)),
            )
    for m, n, k in [(1, 3, 1), (1, 3, 5), (4, 3, 1), (1, 16, 24), (2, 16, 24), (8, 16, 24)]:
        for aux_dtype in (BF16, jnp.float32):
            yield (
                f"dgelu aux={jnp.dtype(aux_dtype).name} m{m}n{n}k{k}",
                lambda dz, w, aux: fused_gelu_input_grad(dz, w, aux, compute_type=CT),
                (arr((m, n), BF16), arr((k, n), BF16), arr((m, -(-k // 8) * 8), aux_dtype)),
            )


def main():
    for name, f, args in cases(np.random.default_rng(0)):
        before = set(_nvmath._plans)
        try:
            jax.block_until_ready(jax.jit(f)(*args))
            result = "ok"
        except Exception as exc:  # noqa: BLE001 -- a probe reports what cuBLASLt refused
            result = "FAIL " + str(exc).split("\n")[0][40:110]
        plans = [
            (key[0].epilog, key[2], None if plan.tuning is None else round(min(plan.tuning), 1))
            for key, plan in _nvmath._plans.items()
            if key not in before
        ]
        print(f"{name:38s} {result:72s} {plans}", flush=True)


if __name__ == "__main__":
    main()
