"""jax_epilog: cuBLASLt epilog fusion (matmul + bias + activation in one kernel) for JAX."""

from ._dense import fused_dense as fused_dense
from ._epilogs import Activation as Activation
from ._epilogs import ComputeType as ComputeType
from ._epilogs import aux_padded_width as aux_padded_width
from ._mlp import fused_mlp as fused_mlp
from ._policy import Policy as Policy
from ._policy import get_policy as get_policy
from ._policy import override_policy as override_policy
from ._reference import unpack_relu_mask as unpack_relu_mask
from ._warnings import FastPathWarning as FastPathWarning
from ._warnings import MembersLoopWarning as MembersLoopWarning
from .cuda.ffi import EXPORT_CHECKS as EXPORT_CHECKS

__version__ = "0.2.0"

__all__ = [
    "EXPORT_CHECKS",
    "Activation",
    "ComputeType",
    "FastPathWarning",
    "MembersLoopWarning",
    "Policy",
    "aux_padded_width",
    "fused_dense",
    "fused_mlp",
    "get_policy",
    "override_policy",
    "unpack_relu_mask",
]
