"""``python -m benchmarks.forward`` with the primitives lowered as before aa56a93: directly,
without the multi-device partitioning wrapper (an A/B of that change's cost on one GPU).

    python benchmarks/results/2026-12-03-h200-o-replay/direct_lowering.py ARGS...
"""

import runpy
import sys

from jax._src.dispatch import prim_requires_devices_during_lowering
from jax.interpreters import mlir

from jax_epilog import _primitive as p

for primitive, lowering in (
    (p.fused_matmul_p, p._cuda_lowering),
    (p.fused_weight_grad_p, p._wgrad_cuda_lowering),
    (p.fused_gelu_input_grad_p, p._igrad_cuda_lowering),
):
    mlir.register_lowering(primitive, lowering, platform="cuda")
    prim_requires_devices_during_lowering.discard(primitive)
sys.argv = ["benchmarks.forward", *sys.argv[1:]]
runpy.run_module("benchmarks.forward", run_name="__main__")
