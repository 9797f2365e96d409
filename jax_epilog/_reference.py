"""Pure-JAX math of the fused layer: the CPU path and the test oracle.

Numerics follow cuBLASLt's epilog: the product is accumulated in the compute type,
bias and activation are applied in the epilog's precision (float32 for 32-bit compute
types) and the result is rounded once to the output dtype. The aux has exactly the
padded layout the GPU kernel writes (``_epilogs.aux_padded_width``). Each activation's
math is one entry of ``_FUNCTIONS``; how its aux is stored comes from the epilog table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ._epilogs import ACTIVATIONS, HALF_DTYPES, Activation, ComputeType, aux_dtype, aux_padded_width
from ._padding import pad_to
from ._typing import explicit_product, resharded_like

__all__ = [
    "activate",
    "dense",
    "derivative_compute_type",
    "gelu_input_grad",
    "input_grad",
    "output_grad",
    "pack_relu_mask",
    "plain",
    "plain_preactivation",
    "unpack_relu_mask",
    "weight_grad",
]

_FUNCTIONS = {
    Activation.RELU: jax.nn.relu,
    Activation.GELU: functools.partial(jax.nn.gelu, approximate=True),  # cuBLASLt's GELU
}


def activate(z: jax.Array, activation: Activation | None) -> jax.Array:
    return z if activation is None else _FUNCTIONS[activation](z)


def pack_relu_mask(z: jax.Array) -> jax.Array:
    """(..., n) pre-activation -> (..., round_up(n, 128) // 8) uint8, bit j%8 of byte j//8."""
    width = aux_padded_width(Activation.RELU, z.shape[-1])
    return jnp.packbits(pad_to(z > 0, width * 8), axis=-1, bitorder="little")


def unpack_relu_mask(mask: jax.Array, n: int) -> jax.Array:
    """The bool array ``z > 0`` of shape (..., n) from a ReLU layer's aux (its bit-mask).

    Args:
      mask: the uint8 aux of ``fused_dense(..., activation="relu", return_aux=True)``.
      n: the layer's output features N.
    """
    if np.dtype(mask.dtype) != np.uint8:
        raise TypeError(
            f"unpack_relu_mask: mask has dtype {np.dtype(mask.dtype).name}; it takes the uint8 "
            "bit-mask a ReLU layer returns as its aux (a GELU layer's aux is z itself, no mask)."
        )
    if not 0 <= n <= mask.shape[-1] * 8:
        raise ValueError(
            f"unpack_relu_mask: n={n} does not fit a mask of shape {mask.shape} "
            f"(allowed: 0 <= n <= {mask.shape[-1] * 8}, its bits per row)."
        )
    if mask.size == 0:  # jnp.unpackbits cannot reshape an empty array
        return jnp.zeros((*mask.shape[:-1], n), bool)
    return jnp.unpackbits(mask, axis=-1, count=n, bitorder="little").astype(bool)


def _epilog_dtype(ab_dtype: np.dtype, compute_type: ComputeType | None) -> np.dtype:
    if ab_dtype == np.float64:
        return np.dtype(np.float64)
    if compute_type in (ComputeType.COMPUTE_16F, ComputeType.COMPUTE_16F_PEDANTIC):
        return np.dtype(np.float16)
    return np.dtype(np.float32)


# COMPUTE_32F_FAST_16F / _16BF / _TF32 allow cuBLASLt to convert float32 operands to
# float16, bfloat16 or TF32 (float32's exponent, 10 mantissa bits) for its tensor cores,
# accumulating in float32; it may also keep more bits. Where no GPU runs the GEMM (the CPU
# path), the reference rounds the operands so (to nearest): the least precise result the
# compute type allows. On a GPU the reference's own GEMMs run at XLA's DEFAULT precision.
_FAST_FORMATS = {
    ComputeType.COMPUTE_32F_FAST_16F: jnp.float16,
    ComputeType.COMPUTE_32F_FAST_16BF: jnp.bfloat16,
    ComputeType.COMPUTE_32F_FAST_TF32: None,  # no dtype: reduce_precision
}


def _fast_operands(a: jax.Array, b: jax.Array, compute_type: ComputeType) -> tuple[jax.Array, jax.Array]:
    """A GEMM's float32 operands as a ``COMPUTE_32F_FAST_*`` GEMM may read them (see above)."""
    half = _FAST_FORMATS[compute_type]

    def rounded(*operands):
        if half is None:
            return tuple(jax.lax.reduce_precision(o, exponent_bits=8, mantissa_bits=10) for o in operands)
        return tuple(o.astype(half).astype(o.dtype) for o in operands)  # (reduce_precision: no subnormals)

    same = lambda *operands: operands
    return jax.lax.platform_dependent(a, b, cuda=same, rocm=same, default=rounded)


def derivative_compute_type(compute_type: ComputeType) -> ComputeType | None:
    """The compute type of the math the fused primitives are differentiated through: None
    (``_matmul``'s plain GEMMs, in the operands' dtype, as XLA's autodiff runs them),
    except that a ``_FAST`` type keeps the rounding it allows (TF32 on the GPU)."""
    return compute_type if compute_type in _FAST_FORMATS else None


def _matmul(
    a: jax.Array,
    b: jax.Array,
    contract: tuple[tuple[int, ...], tuple[int, ...]],
    compute_type: ComputeType | None,
    out_dtype=None,
) -> jax.Array:
    """``a`` and ``b`` contracted over the dimensions ``contract`` names (``a``'s, then
    ``b``'s), accumulated as ``compute_type`` does; in the accumulator's dtype, or in
    ``out_dtype`` when given. ``compute_type=None``: as in ``plain``, in the operands'
    dtype (the math the fused primitives are differentiated through: its transposed GEMMs
    stay in that dtype, as in XLA's own autodiff).

    Half operands with the default COMPUTE_32F and a result in their own dtype ask XLA for
    that dtype directly, as its autodiff of the plain expression does: its GEMMs still
    accumulate in float32 and round at the end, but write half the bytes (asked for a
    float32 product to cast after, XLA writes it in float32 and converts it in a kernel of
    its own, or picks a slower GEMM). XLA may then sum split-K partial products in the
    output dtype, as in its own backward; COMPUTE_32F_PEDANTIC keeps the float32 product.

    Under explicit sharding a product says how it is split (as the dimensions it keeps
    are): one summed over a split dimension (the rows in the kernel gradient, N in dx)
    must."""
    out_sharding = explicit_product(a, b, contract)
    dims = (contract, ((), ()))
    if compute_type is None:
        product = jax.lax.dot_general(
            a, b, dims, precision=_plain_precision(a.dtype), out_sharding=out_sharding
        )
        return product if out_dtype is None else product.astype(out_dtype)
    fast = compute_type in _FAST_FORMATS
    if fast:
        a, b = _fast_operands(a, b, compute_type)
    direct = (
        out_dtype is not None
        and np.dtype(out_dtype) == np.dtype(a.dtype)
        and np.dtype(a.dtype).name in HALF_DTYPES
        and compute_type is ComputeType.COMPUTE_32F
    )
    product = jax.lax.dot_general(
        a,
        b,
        dims,
        precision=jax.lax.Precision.DEFAULT if fast or direct else jax.lax.Precision.HIGHEST,
        preferred_element_type=a.dtype if direct else _epilog_dtype(np.dtype(a.dtype), compute_type),
        out_sharding=out_sharding,
    )
    return product if out_dtype is None else product.astype(out_dtype)


def plain(
    x: jax.Array, kernel: jax.Array, bias: jax.Array | None, activation: Activation | None, tf32: bool
) -> jax.Array:
    """``act(x @ kernel + bias)`` as users write it, for XLA to compile (and differentiate)
    its own way: XLA's rounding (after the matmul, the bias and the activation for half
    dtypes), float32 products in full precision unless ``tf32``. Result in x's dtype."""
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)  # (a NumPy float64 x is float32 without x64)
    return activate(plain_preactivation(x, kernel, bias, tf32), activation).astype(dtype)


def plain_preactivation(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, tf32: bool) -> jax.Array:
    """``x @ kernel + bias`` of ``plain``, before the activation (x's dtype, or float32
    with a float32 bias). Half dtypes keep the default precision (XLA accumulates them in
    float32 anyway), so the program is the one users write, down to its HLO; float32 asks
    for full precision unless ``tf32`` (XLA's default on the GPU is TF32). Under explicit
    sharding the product is split as the dimensions it keeps are (``explicit_product``):
    a row-parallel layer (K split) would otherwise be ambiguous, which jax refuses."""
    out_sharding = explicit_product(x, kernel, ((x.ndim - 1,), (0,)))
    z = jnp.matmul(x, kernel, precision=_plain_precision(x.dtype, tf32), out_sharding=out_sharding)
    return z if bias is None else z + bias


def _plain_precision(dtype, tf32: bool = False) -> jax.lax.Precision:
    """``plain``'s GEMM precision: full for float32 and float64 unless ``tf32``; XLA's
    default for half dtypes (which it accumulates in float32 anyway)."""
    full = not tf32 and np.dtype(dtype).itemsize >= 4
    return jax.lax.Precision.HIGHEST if full else jax.lax.Precision.DEFAULT


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None,
    activation: Activation | None,
    compute_type: ComputeType,
    d_dtype: np.dtype,
    with_aux: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """Returns ``(d, aux)``: ``d = act(x @ kernel + bias)`` in ``d_dtype``; aux or None.

    ``x`` is (..., k), ``kernel`` (k, n), ``bias`` (n,) or None.
    """
    z = _matmul(x, kernel, ((x.ndim - 1,), (0,)), compute_type)
    if bias is not None:  # (compute_type None: added as in plain, a float32 bias promoting z)
        z = z + (bias if compute_type is None else bias.astype(z.dtype))
    d = activate(z, activation).astype(d_dtype)
    aux = None
    if with_aux and activation is not None:
        if ACTIVATIONS[activation].aux_bits:
            aux = pack_relu_mask(z)
        else:
            aux = pad_to(
                z.astype(aux_dtype(activation, d_dtype)), aux_padded_width(activation, kernel.shape[1])
            )
    return d, aux


def output_grad(
    aux: jax.Array | None,
    dy: jax.Array,
    dz_extra: jax.Array | None,
    activation: Activation | None,
    compute_type: ComputeType,
    operand_dtype: np.dtype,
) -> jax.Array:
    """``dz = dy * act'(z)`` from the forward's aux, in ``operand_dtype`` (the GEMMs' input).

    ``dy`` is (..., n); ``aux`` the ReLU bit-mask or the GELU input; ``dz_extra`` a
    cotangent of the GELU aux's first n columns, or None. dz is formed in the epilog's
    precision and rounded once. At ``z == 0`` ReLU's derivative is 0 (the mask holds
    ``z > 0``), as for ``jax.nn.relu``.
    """
    n = dy.shape[-1]
    acc = _epilog_dtype(np.dtype(operand_dtype), compute_type)
    dz = dy.astype(acc)
    if activation is not None and ACTIVATIONS[activation].aux_bits:  # the derivative is 0 or 1
        dz = jnp.where(unpack_relu_mask(aux, n), dz, jnp.zeros((), acc))
    elif activation is not None:  # the aux is z
        z = resharded_like(aux[..., :n].astype(acc), dy)  # (typed as dy: a whole aux beside split columns)
        dz = jax.vjp(lambda z: activate(z, activation), z)[1](dz)[0]
    if dz_extra is not None:
        dz = dz + dz_extra.astype(acc)
    return dz.astype(operand_dtype)


def input_grad(dz: jax.Array, kernel: jax.Array, compute_type: ComputeType) -> jax.Array:
    """``dx = dz @ kernel^T`` for dz of shape (..., n), accumulated like the forward."""
    return _matmul(dz, kernel, ((dz.ndim - 1,), (1,)), compute_type, kernel.dtype)


def gelu_input_grad(dz: jax.Array, kernel: jax.Array, aux: jax.Array, compute_type: ComputeType) -> jax.Array:
    """``(dz @ kernel^T) * gelu'(z)`` in the aux's dtype, with ``aux`` the previous layer's
    GELU aux (its input z, padded): the dz of the layer before this one, as the GPU's
    ``dgrad`` problem forms it in one GEMM with the DGELU epilog. The product stays in the
    accumulator until it is multiplied by the derivative, then rounds once."""
    dh = _matmul(dz, kernel, ((dz.ndim - 1,), (1,)), compute_type)
    return output_grad(aux, dh, None, Activation.GELU, compute_type, aux.dtype)


def weight_grad(
    x: jax.Array, dz: jax.Array, compute_type: ComputeType, d_dtype: np.dtype, with_bias: bool
) -> tuple[jax.Array, jax.Array | None]:
    """``(x^T @ dz, dz's sum over the rows or None)`` in ``d_dtype``, the rows being every
    leading dimension of x (..., k) and dz (..., n): what the GPU's ``wgrad`` problem
    computes with one GEMM and its bias-gradient epilog (BGRADA)."""
    rows = tuple(range(x.ndim - 1))
    dkernel = _matmul(x, dz, (rows, rows), compute_type, d_dtype)
    if not with_bias:
        return dkernel, None
    acc = _epilog_dtype(np.dtype(dz.dtype), compute_type)
    return dkernel, jnp.sum(dz.astype(acc), axis=rows).astype(d_dtype)
