"""The fused primitives, one per module, each registered once by ``_base.register``.

``forward`` (GEMM + bias + activation, optionally the aux), ``weight_grad`` (kernel and
bias gradients, BGRADA), ``gelu_input_grad`` (an input gradient times the previous GELU's
derivative, DGELU), ``members`` (an ensemble's forward as one batched GEMM) and
``fp8_gemm`` (one FP8 GEMM with per-tensor scales, its epilog and the amax of D) and
``fp8_output_grad`` (an FP8 layer's dz, its E5M2 copy, bias gradient and amax in one pass).
"""

from .forward import fused_matmul
from .fp8_gemm import fp8_matmul
from .fp8_output_grad import fp8_output_grad
from .gelu_input_grad import fused_gelu_input_grad
from .members import members_p
from .weight_grad import fused_weight_grad

__all__ = [
    "fp8_matmul",
    "fp8_output_grad",
    "fused_gelu_input_grad",
    "fused_matmul",
    "fused_weight_grad",
    "members_p",
]
