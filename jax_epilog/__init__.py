"""jax_epilog: cuBLASLt epilog fusion (matmul + bias + activation in one kernel) for JAX."""

from ._dense import fused_dense as fused_dense
from ._epilogs import Activation as Activation
from ._epilogs import ComputeType as ComputeType
from ._epilogs import aux_padded_width as aux_padded_width
from ._ffi import EXPORT_CHECKS as EXPORT_CHECKS
from ._mlp import fused_mlp as fused_mlp
from ._primitive import FastPathWarning as FastPathWarning
from ._primitive import MembersLoopWarning as MembersLoopWarning
from ._reference import unpack_relu_mask as unpack_relu_mask

__version__ = "0.1.0"

__all__ = [
    "EXPORT_CHECKS",
    "Activation",
    "ComputeType",
    "FastPathWarning",
    "MembersLoopWarning",
    "aux_padded_width",
    "fused_dense",
    "fused_mlp",
    "unpack_relu_mask",
]
