"""The fused primitives, one per module, each registered once by ``_base.register``.

``forward`` (GEMM + bias + activation, optionally the aux), ``weight_grad`` (kernel and
bias gradients, BGRADA), ``gelu_input_grad`` (an input gradient times the previous GELU's
derivative, DGELU) and ``members`` (an ensemble's forward as one batched GEMM).
"""

from .forward import fused_matmul
from .fp8_gemm import fp8_matmul
from .gelu_input_grad import fused_gelu_input_grad
from .members import members_p
from .weight_grad import fused_weight_grad

__all__ = ["fp8_matmul", "fused_gelu_input_grad", "fused_matmul", "fused_weight_grad", "members_p"]
