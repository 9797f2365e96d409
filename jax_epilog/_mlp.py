"""``fused_mlp``: a stack of dense layers whose backward fuses each GELU into the next GEMM.

A layer's input gradient ``dz_l @ kernel_l.T`` is the cotangent of the layer before it; when
that layer applies GELU, its own backward next multiplies by ``gelu'(z)`` and sums over the
batch for the bias gradient. Across single ``fused_dense`` calls that is a GEMM, then an
elementwise pass over the (M, N) cotangent. Here one custom_vjp sees both layers, so the GEMM
does the multiplication in its epilog (cuBLASLt's DGELU, reading the GELU layer's aux), and
only the bias gradient's reduction remains. Measured on the H200 (bf16): 114.6 µs for the
DGELU GEMM at 8192x1024->4096 against 170.0 µs for XLA's GEMM + elementwise (234.8 with
the reduction, which XLA fuses into the elementwise pass and slows); cuBLASLt's DRELU and
its DGELU_BGRAD / DRELU_BGRAD epilogs were slower than XLA's ops there (294-388 µs;
benchmarks/results/*/dgrad.md), so ReLU links and every bias gradient stay with XLA.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _reference
from ._dense import (
    _AUTO_DTYPES,
    _XLA_COMPUTE_TYPES,
    _auto_fuses,
    _check_array,
    _dtype_name,
    _implementation,
    check_layer,
    fused_dense,
    layer_grads,
)
from ._epilogs import Activation, ComputeType, aux_padded_width, known_sizes
from ._primitive import fast_rows, fused_gelu_input_grad, fused_matmul, on_padded_rows
from ._sharding import like

__all__ = ["fused_mlp"]

_OWNER = "fused_mlp"
# "auto" links layers (DGELU) from this many rows: an MLP block's fwd+bwd measured 1.06-1.09x
# XLA at 8192x1024->4096->1024 (five runs) and 0.99-1.00x at 8192x4096->16384->4096, but
# 0.90-0.96x at 2048, 1000, 512 and 256 rows (benchmarks/README.md, H200, bf16; float16
# GELU blocks 1.04x and 0.99x at the two 8192-row sizes, 2026-12-04 (x); float32 GELU
# blocks linked read 0.97x with full float32 and 0.87-0.88x with TF32 at 8192x1024, (y),
# so "auto" links only _AUTO_DTYPES); below it
# "auto" is the stack of fused_dense calls: XLA's expression at those sizes, except on the
# rows of _AUTO_STACK_ROWS.
_AUTO_LINK_MIN_ROWS = 8192
# "auto" runs every layer of a bfloat16 or float16 block on 512 to 1536 rows as "cublaslt"
# (the stack of fused_dense calls, unlinked). There XLA's forward is the slower (CUPTI,
# 1024x1024->4096->1024): its Triton GEMMs with bias and ReLU took 25.6 and 21.0 µs where
# cuBLASLt's epilog kernels took 16.8 and 14.2; for GELU its GEMM and GELU pass took 17.3 +
# 8.3 µs against the epilog kernel's 19.4. The block's fwd+bwd (bfloat16) measured
# 1.05-1.19x XLA (ReLU, four processes) and 1.02-1.17x (GELU, two) at 512x1024, 512x2048,
# 1000x1024 and 1024x1024 (and 1.08-1.12x at 1000x768, one process); at 2048 rows
# 0.98-1.01x; at 256 rows 1.00-1.09x, and below that XLA's program against itself scattered
# by up to 42%. Blocks this small read 0.92x (ReLU) at 512x512 and 0.96-1.03x at 1024x512,
# so the rule also asks that some layer have M*N*K >= 2**31 (H200; benchmarks/README.md,
# 2026-12-04 (w)). Then (x): bfloat16 at 1280 and 1536 rows read 1.07-1.20x (D = 768,
# 1024; one or two processes), 1.03x / 1.00x (ReLU / GELU) at 1536x2048, at 1792 rows
# 1.03x / 1.00x and at 2048 1.00x / 1.03x; float16 blocks read as bfloat16 ones:
# 1.05-1.17x (ReLU) and 1.00-1.15x (GELU) at 512-1536 rows with D <= 1024 and at 512x2048
# (one or two processes), 1.06x / 0.98x at 1536x2048, 0.98-1.07x at 1792 and 2048 rows,
# 0.93x (ReLU) at 1024x512, below the floor.
_AUTO_STACK_ROWS = (512, 1536)
_AUTO_STACK_MIN_MNK = 2**31


def fused_mlp(
    x: jax.Array,
    layers: Sequence[tuple[jax.Array, jax.Array | None]],
    activations: Sequence[str | Activation | None],
    *,
    compute_type=None,
    implementation: str = "auto",
) -> jax.Array:
    """A stack of ``fused_dense`` layers, differentiated as one: ``h_{i+1} = act_i(h_i @
    kernel_i + bias_i)`` from ``h_0 = x``; returns the last ``h``.

    Args:
      x: (..., K) array, as for ``fused_dense``.
      layers: a sequence of ``(kernel, bias)`` pairs (``bias`` may be None), each as
        ``fused_dense`` takes them; layer i's K is layer i-1's N.
      activations: one entry per layer: None, ``"relu"`` or ``"gelu"`` (tanh approximation).
      compute_type: as for ``fused_dense``, for every layer.
      implementation: ``"auto"`` (default), ``"cublaslt"`` or ``"xla"``, as for
        ``fused_dense``, for every layer.

    Returns:
      (..., N_last) array in ``x``'s dtype.

    The value equals stacking ``fused_dense`` calls with the same arguments, and so does
    the gradient, except in three places where this function sees what ``fused_dense``
    cannot: that a layer's output feeds another layer's GEMM (the first two), and that
    the layers run together in one program (the third):

    - A GELU layer feeding another layer, with ``"cublaslt"``, or with ``"auto"`` on 8192
      rows or more in bfloat16 or float16, every layer's rows aligned or padded (where it
      measured faster than XLA; fewer rows measured 0.90-0.96x; linked float32 blocks
      0.87-1.00x, 2026-12-04 (y)). "Aligned or padded": K and N multiples of 8, or a layer
      large enough for its calls to pad them (``fused_dense``'s docstring):
      the backward forms the GELU layer's ``dz`` in the next layer's input-gradient GEMM,
      with cuBLASLt's DGELU epilog on a GPU (the reference math of that GEMM elsewhere).
      The product then meets ``gelu'(z)`` in float32 before rounding once, where
      separate calls round it to x's dtype first.
    - A ReLU layer feeding another layer, with ``"auto"``, on a layer large enough for
      ``fused_dense``'s "auto" forward to fuse it (bfloat16 or float16, M >= 1024 rows,
      M*N*K >= 2**33):
      it runs as ``"cublaslt"`` does, the fused kernel keeping its bit-mask for the
      backward (XLA's GEMMs and reduction from it). In a ReLU block's fwd+bwd that
      measured 1.04-1.06x XLA's autodiff at 8192x1024->4096->1024 and 1.00-1.02x at
      8192x4096->16384->4096 and 2048x1024->4096->1024 (H200, bf16; benchmarks/README.md,
      2026-12-04 (v)); a lone ``fused_dense`` whose output a loss reads keeps XLA's
      autodiff, where the same backward measured 0.92-1.02x.
    - A block of two or more bfloat16 or float16 layers on 512 to 1536 rows, one of them
      with M*N*K >= 2**31 and every layer's rows aligned or padded, with ``"auto"``: every
      layer runs as ``"cublaslt"`` (forward and backward), where XLA's forward measured the
      slower (its Triton GEMMs, a separate GELU pass): the block's fwd+bwd read
      1.05-1.20x XLA's (ReLU) and 1.00-1.17x (GELU) at 512-1536 rows and D = 768, 1024
      (0.98-1.08x at D = 2048; H200; benchmarks/README.md, 2026-12-04 (w) and (x)).
      Float32 blocks keep ``fused_dense``'s rule (XLA's program): every layer on
      cuBLASLt read 0.97-1.01x XLA's fwd+bwd at 1024-8192 rows with full float32 and
      0.90-1.04x with TF32 (2026-12-04 (y)).

    In a linked block (the first case) forward passes follow ``fused_dense``'s rule per
    layer, except that with ``"auto"`` a ReLU layer that is the last one, or too small,
    runs XLA's expression (its backward reads ``h_{i+1} > 0``, the same as the mask except
    where a positive z rounds to zero in x's dtype), and a GELU layer that is not fused
    saves z (XLA's expressions on the padded rows of a layer whose calls pad K and N, as
    its backward's GEMMs below); with ``"cublaslt"``, every layer runs the fused kernel
    and keeps its aux.
    Every layer's kernel and bias gradients: as ``fused_dense`` with the same
    implementation (XLA's GEMM and reduction for ``"auto"``), and like its backward, on
    the padded rows of a layer whose calls pad K and N: the gradient of
    8192x1024->4097->1024 (GELU link) measured 2.28x XLA's with "auto", 1.17x before
    (H100, 2026-12-06 (aj)).

    Without a link (no GELU layer before the last one, ``"xla"``, float64, or ``"auto"``
    on fewer rows, in float32 or with rows neither aligned nor padded) ``fused_mlp`` is
    the stack of ``fused_dense`` calls, each with ``implementation``, except the ReLU
    layers of the second case and the blocks of the third, which run as ``"cublaslt"``.
    Forward mode then works where each call's implementation allows it (``"auto"``,
    ``"xla"``; not ``"cublaslt"``). With a link it
    is a ``jax.custom_vjp``: forward mode raises, but its gradient differentiates again in
    either mode (``jax.grad`` of a gradient, ``jax.hessian``).
    Raises TypeError/ValueError at trace time, naming the layer, for anything
    ``fused_dense`` would refuse and for ``layers``/``activations`` that do not pair up.
    """
    _check_array(x, "x", _OWNER)
    layers, activations = _pairs(layers, activations)
    shape = x.shape
    checked = []
    for i, ((kernel, bias), activation) in enumerate(zip(layers, activations)):
        source = "x" if i == 0 else f"layer {i - 1}'s output"
        act, dtype, ct, f32_bias = check_layer(
            f"{_OWNER}: layer {i}", shape, x, kernel, bias, activation, compute_type, source
        )
        impl = _implementation(implementation, ct, False, f"{_OWNER}: layer {i}")
        checked.append((act, ct, f32_bias))
        shape = (*shape[:-1], kernel.shape[1])

    m = math.prod(x.shape[:-1])
    ks = [x.shape[-1], *(kernel.shape[1] for kernel, _ in layers)]
    gelu_feeds_a_layer = any(act is Activation.GELU for act, _, _ in checked[:-1])
    # "auto"'s cuBLASLt rules below hold in the dtypes they were measured in, for calls on
    # rows 16 bytes apart (widths that are multiples of 8, or layers large enough for the
    # call to pad them: cuBLASLt's kernels for other rows are far slower, fast_rows), and
    # need the sizes (not symbolic ones: jax.export).
    auto = (
        impl == "auto" and dtype in _AUTO_DTYPES and known_sizes(m, *ks)
        and all(fast_rows(m, n, k, dtype) for k, n in itertools.pairwise(ks))
    )  # fmt: skip
    link = gelu_feeds_a_layer and (impl == "cublaslt" or (auto and m >= _AUTO_LINK_MIN_ROWS))
    # With "auto", the large layers (_auto_fuses) whose fused backward measured faster than
    # XLA's autodiff in a block: GELU layers (linked, above), and ReLU layers whose output a
    # GEMM reads: the next layer's. Their mask backward read 1.04-1.06x XLA's in a ReLU block
    # at 8192x1024->4096->1024 and 1.00-1.02x at 8192x4096->16384->4096 and 2048 rows
    # (benchmarks.probes.mlp_layers, benchmarks.training, 2026-12-04 (v)); where a loss reads
    # the layer directly it measured 0.92-1.02x, so fused_dense alone keeps XLA's autodiff.
    auto_fused = [
        auto
        and (act is Activation.GELU or (act is Activation.RELU and i < len(layers) - 1))
        and _auto_fuses(act, dtype, m, ks[i + 1], ks[i])
        for i, (act, _, _) in enumerate(checked)
    ]
    auto_stack = (
        auto and len(layers) > 1
        and _AUTO_STACK_ROWS[0] <= m <= _AUTO_STACK_ROWS[1]
        and max(m * k * n for k, n in itertools.pairwise(ks)) >= _AUTO_STACK_MIN_MNK
    )  # fmt: skip
    if dtype == "float64" or not link:
        h = x
        for (kernel, bias), (act, _, _), fused in zip(layers, checked, auto_fused):
            layer_impl = "cublaslt" if auto_stack or (fused and act is Activation.RELU) else impl
            h = fused_dense(
                h, kernel, bias, activation=act, compute_type=compute_type, implementation=layer_impl
            )
        return h

    configs = []
    for i, ((kernel, bias), (act, ct, f32_bias)) in enumerate(zip(layers, checked)):
        # Here a layer's forward also leaves the residuals of this backward: with "auto",
        # large GELU layers and large ReLU layers feeding a layer run the fused kernel and
        # keep its aux (z; the mask), the others XLA's expression (z; y > 0 for ReLU).
        fused_forward = impl == "cublaslt" or ct not in _XLA_COMPUTE_TYPES or auto_fused[i]
        configs.append(
            _Layer(
                activation=act,
                compute_type=ct,
                d_dtype="float32" if f32_bias else dtype,
                bias_dtype=None if bias is None else _dtype_name(bias),
                fused_forward=fused_forward,
            )
        )
    config = _Config(layers=tuple(configs), fused_wgrad=impl == "cublaslt")
    kernels = tuple(kernel for kernel, _ in layers)
    biases = tuple(bias for _, bias in layers)
    if x.ndim == 1:  # one row: the op takes it as (1, K)
        return _mlp(x[None], kernels, biases, config)[0]
    return _mlp(x, kernels, biases, config)  # (each device folds its own rows, however they are split)


def _pairs(layers, activations):
    if isinstance(activations, (str, Activation)) or not isinstance(activations, Sequence):
        raise TypeError(
            f"{_OWNER}: activations must be a sequence with one entry per layer (each None, "
            f"'relu' or 'gelu'), got {activations!r}."
        )
    if not isinstance(layers, Sequence) or not all(
        isinstance(layer, Sequence) and len(layer) == 2 for layer in layers
    ):
        raise TypeError(f"{_OWNER}: layers must be a sequence of (kernel, bias) pairs (bias may be None).")
    if len(layers) != len(activations) or not layers:
        raise ValueError(
            f"{_OWNER}: got {len(layers)} layers and {len(activations)} activations; "
            "pass one activation per layer, and at least one layer."
        )
    return list(layers), list(activations)


class _Layer(NamedTuple):
    activation: Activation | None
    compute_type: ComputeType
    d_dtype: str  # the epilog's dtype: x's, or float32 beside a float32 bias
    bias_dtype: str | None
    fused_forward: bool  # cuBLASLt's kernel and aux, or XLA's expression saving z


class _Config(NamedTuple):
    layers: tuple[_Layer, ...]
    fused_wgrad: bool  # kernel and bias gradients from one BGRADA GEMM ("cublaslt"; not ReLU's)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mlp(x, kernels, biases, config: _Config):
    return _mlp_fwd(x, kernels, biases, config)[0]


def _layer_forward(h, kernel, bias, layer: _Layer):
    """(output, aux or None): the aux in fused_dense's layout (ReLU bits or GELU input)."""
    act = layer.activation
    if layer.fused_forward:
        outs = fused_matmul(
            h, kernel, bias, activation=act, with_aux=act is not None,
            compute_type=layer.compute_type, d_dtype=layer.d_dtype, out_dtype=h.dtype,
        )  # fmt: skip
        return outs[0], (outs[1] if len(outs) > 1 else None)
    # XLA's expression, on the rows a fused call pads (K or N unaligned on a large layer),
    # cut back to N: XLA's GEMMs on unaligned rows are slow as well (_plain_on_padded_rows).
    tf32 = layer.compute_type is ComputeType.COMPUTE_32F_FAST_TF32
    z = on_padded_rows(lambda *operands: _reference.plain_preactivation(*operands, tf32), h, kernel, bias)
    y = _reference.activate(z, act).astype(h.dtype)
    if act is not Activation.GELU:
        return y, None  # ReLU's derivative is read from y > 0
    return y, _reference.pad_to(z.astype(layer.d_dtype), aux_padded_width(act, kernel.shape[1]))


def _mlp_fwd(x, kernels, biases, config: _Config):
    h, inputs, auxes = x, [], []
    for kernel, bias, layer in zip(kernels, biases, config.layers):
        inputs.append(h)
        h, aux = _layer_forward(h, kernel, bias, layer)
        auxes.append(aux)
    last = config.layers[-1]
    y = h if last.activation is Activation.RELU and auxes[-1] is None else None
    return h, (tuple(inputs), kernels, biases, tuple(auxes), y)  # (biases for their types)


def _output_grad(layer: _Layer, aux, y, dy, dtype):
    if layer.activation is Activation.RELU and aux is None:
        return jnp.where(y > 0, dy, jnp.zeros((), dy.dtype)).astype(dtype)
    return _reference.output_grad(aux, dy, None, layer.activation, layer.compute_type, dtype)


def _mlp_bwd(config: _Config, residuals, dy):
    inputs, kernels, biases, auxes, y_last = residuals
    layers = config.layers
    dkernels, dbiases = [], []
    dz = None  # the current layer's dz, when the layer above formed it
    for i in reversed(range(len(layers))):
        layer, h, kernel = layers[i], inputs[i], kernels[i]
        if dz is None:
            y = y_last if i == len(layers) - 1 else inputs[i + 1]
            dz = _output_grad(layer, auxes[i], y, dy, h.dtype)
        act, ct = layer.activation, layer.compute_type
        linked = i > 0 and layers[i - 1].activation is Activation.GELU  # DGELU in the dx GEMM's epilog
        dh, dkernel, dbias = layer_grads(
            h, dz, kernel, act, ct, layer.d_dtype, layer.bias_dtype, config.fused_wgrad, not linked
        )  # (XLA's GEMMs on padded rows where the layer is large and K or N unaligned)
        dkernels.append(like(dkernel, kernel))  # each its primal's type under explicit sharding
        dbiases.append(None if dbias is None else like(dbias, biases[i]))
        if linked:  # (the fused call pads its own rows)
            (dz_below,) = fused_gelu_input_grad(dz, kernel, auxes[i - 1], compute_type=ct)
            dz = dz_below.astype(h.dtype)
        else:
            dy, dz = dh, None
    return like(dy, inputs[0]), tuple(reversed(dkernels)), tuple(reversed(dbiases))


_mlp.defvjp(_mlp_fwd, _mlp_bwd)
