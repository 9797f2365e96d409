"""``fused_mlp`` in FP8: each hidden layer's epilog writes the next GEMM's E4M3 operand.

A hidden layer's GEMM applies bias and activation, scales the result by the output's
delayed scale and writes it as E4M3 straight into the buffer the next GEMM reads, with the
amax of what it wrote for the next step's scale, and (GELU) its input z in bfloat16 for the
backward: no activation or quantize kernel between the GEMMs. In the backward each dz is
formed (dy times the activation's derivative at the aux), reduced and quantized to E5M2
once for both of its layer's GEMMs (``_dense.quantized_grad``). cuBLASLt can apply GELU's
derivative in the next layer's input-gradient GEMM instead (DGELU epilog,
``Policy.fp8_dgelu``), but with FP8 operands it runs that epilog as a separate, slower
kernel: see docs/decisions.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax

from .._epilogs import Activation
from .._policy import get_policy
from .._typing import like
from ._dense import Forward, Layer, backward, forward, quantized_grad
from ._quant import Quantized

__all__ = ["mlp"]


class Block(NamedTuple):
    """The static half of an FP8 ``fused_mlp`` call: one Layer per layer."""

    layers: tuple[Layer, ...]


def _run(x, kernels, biases, states, block: Block, with_aux: bool) -> list[Forward]:
    """Every layer's forward; a hidden layer's output is the next one's Quantized x."""
    done: list[Forward] = []
    h = x
    for kernel, bias, state, layer in zip(kernels, biases, states, block.layers):
        if done:  # the previous epilog's E4M3 output: this layer's x, with its scale and state
            prev = done[-1]
            h = Quantized(prev.y, prev.out_scale)
            state = dataclasses.replace(state, x=prev.state.output)
        done.append(forward(h, kernel, bias, state, layer, with_aux))
    return done


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def mlp(x, kernels, biases, states, block: Block):
    """(y, new states) for 2-D x."""
    done = _run(x, kernels, biases, states, block, with_aux=False)
    return done[-1].y, tuple(f.state for f in done)


def _mlp_fwd(x, kernels, biases, states, block):
    done = _run(x, kernels, biases, states, block, with_aux=True)
    kept = [f.y if layer.activation is Activation.RELU else None for f, layer in zip(done, block.layers)]
    residuals = ([f.aux for f in done], kept, [f.x for f in done], [f.kernel for f in done],
                 [f.state for f in done], biases)  # fmt: skip
    return (done[-1].y, tuple(f.state for f in done)), residuals


def _mlp_bwd(block, residuals, cotangents):
    auxes, kept, xs, kernels, states, biases = residuals
    layers = block.layers
    dy, linked_above = cotangents[0], False
    grads, new_states = [], list(states)
    dgelu = get_policy().fp8_dgelu
    for i in reversed(range(len(layers))):
        layer, state = layers[i], states[i]
        # With the DGELU policy the layer below a GELU layer gets its dz from this layer's
        # input-gradient GEMM; otherwise dz's own pass applies the derivative.
        linked = dgelu and i > 0 and layers[i - 1].activation is Activation.GELU
        qdz, dbias = quantized_grad(dy, kept[i], auxes[i], layer, state, linked_above)
        g = backward(qdz, dbias, xs[i], kernels[i], layer, auxes[i - 1] if linked else None)
        # each typed as its primal (an FP8 copy has its tensor's type), as in _dense
        grads.append(
            (like(g.dkernel, kernels[i].data), None if g.dbias is None else like(g.dbias, biases[i]))
        )
        new_states[i] = dataclasses.replace(state, grad=g.grad)
        dy, linked_above = g.dx, linked
    dkernels, dbiases = zip(*reversed(grads))
    return like(g.dx, xs[0].data), tuple(dkernels), tuple(dbiases), tuple(new_states)


mlp.defvjp(_mlp_fwd, _mlp_bwd)
