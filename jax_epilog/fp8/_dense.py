"""One dense layer in FP8: E4M3 forward GEMM with the epilog, E5M2 gradients, and the
scaling state updated alongside (the forward's in the returned state, the gradient's in
the state's cotangent, Flax's ``_overwrite_with_gradient`` convention)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .._epilogs import Activation, epilog_name
from .._policy import get_policy
from .._typing import like
from ..primitives.fp8_gemm import fp8_matmul
from ..primitives.fp8_output_grad import fp8_output_grad
from ..primitives.fp8_output_grad import reference as output_grad_reference
from ._fused_dz import column_sums_and_amax, dz_of
from ._quant import Quantized, QuantizedTensor, quantize_tensor
from ._recipes import E4M3, E5M2, DenseState, TensorScale, next_scale, push_amax

__all__ = ["Backward", "Layer", "backward", "dense", "epilog_dtypes", "forward", "kind_of", "quantized_grad"]


class Layer(NamedTuple):
    """The static half of an FP8 layer call."""

    activation: Activation | None
    out_dtype: str  # y's dtype (x's), or "float8_e4m3fn" for an FP8 output
    x_dtype: str  # (the gradients' dtypes)
    kernel_dtype: str
    bias_dtype: str | None  # None: no bias

    @property
    def has_bias(self) -> bool:
        return self.bias_dtype is not None


def epilog_dtypes(out_dtype) -> tuple[np.dtype, np.dtype]:
    """(bias dtype, GELU aux dtype) cuBLASLt takes beside an FP8 GEMM writing ``out_dtype``:
    float16 beside float16, bfloat16 otherwise."""
    half = np.dtype("float16") if np.dtype(out_dtype) == np.float16 else np.dtype(jnp.bfloat16)
    return half, half


def _epilog(layer: Layer, with_aux: bool) -> str:
    """The forward's epilog; only GELU keeps an aux (ReLU's derivative comes from y > 0)."""
    return epilog_name(layer.activation, layer.has_bias, with_aux and layer.activation is Activation.GELU)


class Forward(NamedTuple):
    y: jax.Array  # (M, N), in out_dtype
    aux: jax.Array | None  # GELU's z (M, round_up(N, 8)) when asked for
    x: QuantizedTensor
    kernel: QuantizedTensor
    out_scale: jax.Array
    state: DenseState  # x, kernel and output updated


def forward(x, kernel, bias, state: DenseState, layer: Layer, with_aux: bool) -> Forward:
    """The layer's forward on 2-D x (or a Quantized x, used as it is)."""
    if isinstance(x, Quantized):
        qx = QuantizedTensor(x.data, x.scale, state.x)
    else:
        qx = quantize_tensor(x, state.x, E4M3, state)
    qk = quantize_tensor(kernel, state.kernel, E4M3, state)
    out_scale = jax.lax.stop_gradient(next_scale(state.output, E4M3, state.recipe))
    bias_dtype, aux_dtype = epilog_dtypes(layer.out_dtype)
    operands = [qx.data, qk.data, qx.scale, qk.scale]
    fp8_out = np.dtype(layer.out_dtype) == E4M3
    if fp8_out:
        operands.append(1.0 / out_scale)
    if layer.has_bias:
        operands.append(bias.astype(bias_dtype))
    epilog = _epilog(layer, with_aux)
    outs = fp8_matmul(
        *operands, problem="forward", epilog=epilog, d_dtype=layer.out_dtype,
        aux_dtype=aux_dtype if "AUX" in epilog else None, amax=fp8_out,
    )  # fmt: skip
    y, aux = outs[0], (outs[-1] if "AUX" in epilog else None)
    # cuBLASLt writes the amax of an FP8 output only: a 16-bit output's state stays as it is.
    output = push_amax(state.output, out_scale, outs[1]) if fp8_out else state.output
    new = dataclasses.replace(state, x=qx.state, kernel=qk.state, output=output)
    return Forward(y, aux, qx, qk, out_scale, new)


def kind_of(layer: Layer) -> str:
    """The ``_fused_dz.KINDS`` entry whose derivative dz takes for ``layer``."""
    return {Activation.GELU: "gelu", Activation.RELU: "relu"}.get(layer.activation, "none")


class Backward(NamedTuple):
    dx: jax.Array
    dkernel: jax.Array
    dbias: jax.Array | None
    grad: TensorScale  # the gradient's next scaling state


def quantized_grad(dy, y, aux, layer: Layer, state: DenseState, linked: bool = False):
    """(dz as E5M2 with its scale and the gradient's next state, the bias gradient) from
    the output's cotangent dy: dz = dy * act'(.) (GELU's derivative at the aux, ReLU's
    where y > 0; ``linked``: dy is dz already, the layer above applied the derivative).
    Delayed scaling knows dz's scale first: one pass (``fp8_output_grad``: one Pallas
    kernel on a GPU under ``Policy.fp8_fused_dz``, else XLA's passes, which reduce dz in
    its own dtype: a float32 copy would be written out). Current scaling reads dz's amax
    before quantizing it."""
    kind = "none" if linked else kind_of(layer)
    other = {"gelu": aux, "relu": y}.get(kind)
    if state.current:
        dz = dz_of(kind, dy, other)
        sums, seen = column_sums_and_amax(dz)
        qdz = quantize_tensor(dz, state.grad, E5M2, state, seen)
    else:
        scale = jax.lax.stop_gradient(next_scale(state.grad, E5M2, state.recipe))
        one_pass = fp8_output_grad if get_policy().fp8_fused_dz else output_grad_reference
        q, sums, seen = one_pass(dy, other, scale, kind=kind)
        qdz = QuantizedTensor(q, scale, push_amax(state.grad, scale, seen))
    return qdz, sums.astype(layer.bias_dtype) if layer.has_bias else None


def backward(
    qdz: QuantizedTensor, dbias, fwd_x: QuantizedTensor, fwd_kernel: QuantizedTensor, layer: Layer, aux=None
):
    """The layer's gradients from its quantized dz (``quantized_grad``): two FP8 GEMMs.
    ``aux``: the layer below's GELU input, whose derivative the input-gradient GEMM then
    applies (DGELU): dx is then that layer's dz."""
    (dx,) = fp8_matmul(
        qdz.data, fwd_kernel.data, qdz.scale, fwd_kernel.scale, *([] if aux is None else [aux]),
        problem="dgrad", epilog="DEFAULT" if aux is None else "DGELU", d_dtype=layer.x_dtype, amax=False,
    )  # fmt: skip
    # The GEMM writes a bfloat16 or float32 kernel gradient itself; others are cast from float32.
    direct = np.dtype(layer.kernel_dtype) in (np.dtype(jnp.bfloat16), np.dtype(np.float32))
    (dkernel,) = fp8_matmul(
        fwd_x.data, qdz.data, fwd_x.scale, qdz.scale, problem="wgrad", epilog="DEFAULT",
        d_dtype=layer.kernel_dtype if direct else jnp.float32, amax=False,
    )  # fmt: skip
    return Backward(dx, dkernel.astype(layer.kernel_dtype), dbias, qdz.state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def dense(x, kernel, bias, state: DenseState, layer: Layer):
    """(y, new state) for 2-D x; differentiable in x, kernel, bias and (as the next state)
    the state."""
    fwd = forward(x, kernel, bias, state, layer, with_aux=False)
    return fwd.y, fwd.state


def _dense_fwd(x, kernel, bias, state, layer):
    fwd = forward(x, kernel, bias, state, layer, with_aux=True)
    kept = fwd.y if layer.activation is Activation.RELU else None
    return (fwd.y, fwd.state), (fwd.aux, kept, fwd.x, fwd.kernel, fwd.state, bias)


def _dense_bwd(layer, residuals, cotangents):
    aux, y, qx, qk, new_state, bias = residuals
    qdz, dbias = quantized_grad(cotangents[0], y, aux, layer, new_state)
    g = backward(qdz, dbias, qx, qk, layer)
    # Each gradient typed as its primal (explicit sharding; summed over shard_map's axes):
    # an FP8 copy has its tensor's type.
    dbias = None if g.dbias is None else like(g.dbias, bias)
    return like(g.dx, qx.data), like(g.dkernel, qk.data), dbias, dataclasses.replace(new_state, grad=g.grad)


dense.defvjp(_dense_fwd, _dense_bwd)
