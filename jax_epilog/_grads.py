"""One layer's backward GEMMs, shared by ``fused_dense`` and ``fused_mlp``.

From a layer's input x and its dz: ``dx = dz @ kernel^T`` (XLA's GEMM), and the kernel
and bias gradients, from one cuBLASLt GEMM whose BGRADA epilog reduces dz, or from XLA's
GEMM and a reduction of its own (``Policy.relu_bgrad_epilog``: for ReLU, XLA fuses that
reduction with forming dz from the mask). The GEMMs run on the rows a fused forward pads
(K or N unaligned on a large layer) and cut their results back: XLA's kernels for
unaligned rows are slow too.
"""

from __future__ import annotations

from . import _reference
from ._epilogs import Activation
from ._padding import pad_to, padded_layer
from ._policy import get_policy
from .primitives import fused_weight_grad

__all__ = ["layer_grads"]


def layer_grads(x, dz, kernel, activation, ct, d_dtype, bias_dtype, fused=True, input_grad=True):
    """(dx or None, dkernel, dbias or None) of a layer, in the primals' dtypes; ``fused``:
    the bias gradient may come from the BGRADA epilog; ``input_grad``: form dx."""
    (k, n), (x_rows, kernel_rows, _) = kernel.shape, padded_layer(x, kernel, None)
    dz_rows = pad_to(dz, kernel_rows.shape[1])
    dx = _reference.input_grad(dz_rows, kernel_rows, ct)[..., :k] if input_grad else None
    dkernel, dbias = _weight_grads(x_rows, dz_rows, kernel_rows, activation, ct, d_dtype, bias_dtype, fused)
    return dx, dkernel[:k, :n], (None if dbias is None else dbias[:n])


def _weight_grads(x, dz, kernel, activation, ct, d_dtype, bias_dtype, fused: bool):
    """(dkernel, dbias or None), summed over the rows, in the kernel's and bias's dtypes.
    The bias gradient is in ``d_dtype`` (float32 beside a float32 bias) until cast."""
    if bias_dtype is None:
        dkernel, dbias = _reference.weight_grad(x, dz, ct, kernel.dtype, with_bias=False)
    elif fused and (activation is not Activation.RELU or get_policy().relu_bgrad_epilog):
        dkernel, dbias = fused_weight_grad(x, dz, compute_type=ct, d_dtype=d_dtype)
    else:
        dkernel, dbias = _reference.weight_grad(x, dz, ct, d_dtype, with_bias=True)
    return dkernel.astype(kernel.dtype), (None if dbias is None else dbias.astype(bias_dtype))
