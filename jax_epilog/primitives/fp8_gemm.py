"""``fp8_matmul_p``: one FP8 GEMM with per-tensor scales, its epilog and the amax of D.

Three problems, each in its operands' natural layouts (the GPU lowering makes the
K-contiguous copies cuBLASLt needs on Hopper: transposes of FP8 data, one byte an element;
the kernel gradient is by default XLA's own FP8 GEMM, see ``_xla_wgrad``):

* ``"forward"``: x (M, K), kernel (K, N), x_scale, kernel_scale[, d_scale][, bias (N,)]
  -> y = act(x_scale * kernel_scale * x @ kernel + bias) (M, N)[, amax][, aux (M, round_up(N, 8))].
* ``"dgrad"``: dz (M, N), kernel (K, N), scales[, aux (M, round_up(K, 8))]
  -> dz @ kernel^T (times GELU's derivative at the aux, epilog ``DGELU``) (M, K)[, amax].
* ``"wgrad"``: x (M, K), dz (M, N), scales -> x^T @ dz (K, N).

``d_dtype`` FP8: y is written as ``saturate(y * d_scale)``; ``amax``: max|y| before that
scaling, from the epilog. The CPU lowering (and the GPU's fallback where cuBLASLt refuses)
is ``reference``: the same arithmetic in float32 (dequantize, GEMM, epilog, quantize).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir

from .. import _reference
from .._epilogs import Activation, aux_columns
from .._fp8_spec import FP8_DTYPES, FP8_ROW, Fp8Spec, scaled_operands
from .._padding import cut_to, pad_to
from .._partition import Layout
from .._policy import get_policy
from .._typing import vary_alike
from .._warnings import warn_once
from ..cuda import ffi
from ..fp8._quant import saturate
from ._base import lower_fused_or_reference, new_primitive, register, symbolic

__all__ = ["fp8_matmul", "fp8_matmul_p", "operand_names", "reference"]

fp8_matmul_p = new_primitive("fp8_matmul")


def operand_names(problem: str, epilog: str, d_dtype) -> tuple[str, ...]:
    """The primitive's operands: the problem's two matrices, then those of ``Fp8Spec``."""
    first = {"forward": ("x", "kernel"), "dgrad": ("dz", "kernel"), "wgrad": ("x", "dz")}[problem]
    return (*first, *scaled_operands(epilog, np.dtype(d_dtype).name))


def fp8_matmul(*operands, problem: str, epilog: str, d_dtype, aux_dtype=None, amax: bool = True):
    """Bind the primitive; operands as ``operand_names`` lists them. Returns its results:
    [d, amax if ``amax``, aux if the epilog writes one]."""
    aux_dtype = None if aux_dtype is None else np.dtype(aux_dtype)
    return fp8_matmul_p.bind(
        *vary_alike(*operands), problem=problem, epilog=epilog, d_dtype=np.dtype(d_dtype),
        aux_dtype=aux_dtype, amax=bool(amax),
    )  # fmt: skip


def _sizes(problem, a, b):
    """(M, N, K) of the product, in the layer's terms for the result's shape."""
    if problem == "forward":
        return a.shape[0], b.shape[1], a.shape[1]
    if problem == "dgrad":
        return a.shape[0], b.shape[0], a.shape[1]
    return a.shape[1], b.shape[1], a.shape[0]


def _results(*avals, problem, epilog, d_dtype, aux_dtype, amax):
    m, n, _ = _sizes(problem, avals[0], avals[1])
    out = [((m, n), d_dtype)]
    if amax:
        out.append(((), np.dtype(np.float32)))
    if "AUX" in epilog:
        out.append(((m, aux_columns(Activation.GELU, n)), aux_dtype))
    return out


def _layout(avals, *, problem, epilog, d_dtype, aux_dtype, amax) -> Layout:
    names = operand_names(problem, epilog, d_dtype)
    n = _sizes(problem, avals[0], avals[1])[1]
    aux_rule = "m n" if n % 8 == 0 else "m a"  # (an aux with padding columns never splits)
    factors = {"x": "m k", "dz": "m n", "kernel": "k n", "bias": "n", "aux": "m a"}
    out = {"forward": "m n", "dgrad": "m k", "wgrad": "k n"}[problem]
    results = [out, *([""] if amax else []), *([aux_rule] if "AUX" in epilog else [])]
    rule = f"{', '.join(factors.get(name, '') for name in names)} -> {', '.join(results)}"
    maxed = (1,) if amax else ()
    if problem == "forward":
        aux = len(results) - 1 if "AUX" in epilog else None
        cols_in = {1: 1, **({names.index("bias"): 0} if "bias" in names else {})}
        cols_out = {0: 1, **({aux: 1} if aux is not None else {})}
        packed = ((aux, 8 if n % 8 == 0 else 0),) if aux is not None else ()
        rows = ((0,), (0, *(() if aux is None else (aux,))))
        return Layout(rows, (), (cols_in, cols_out), rule, whole=("k", "a"), packed=packed, maxed=maxed)
    if problem == "dgrad":
        rows = ((0, *((names.index("aux"),) if "aux" in names else ())), (0,))
        return Layout(rows, (), ({}, {}), rule, whole=("n", "k", "a"), maxed=maxed)
    return Layout(((0, 1), ()), (0,), ({1: 1}, {0: 1}), rule, whole=("k",), maxed=maxed)


def reference(*args, problem, epilog, d_dtype, aux_dtype, amax):
    """The GPU's arithmetic in float32: dequantized operands, one GEMM, the epilog, then
    D's scaling and saturating cast."""
    ops = dict(zip(operand_names(problem, epilog, d_dtype), args))
    a, b = (v.astype(jnp.float32) for v in args[:2])
    hi = jax.lax.Precision.HIGHEST
    if problem == "forward":
        acc = jnp.matmul(a, b, precision=hi)
    elif problem == "dgrad":
        acc = jnp.matmul(a, b.T, precision=hi)
    else:
        acc = jnp.matmul(a.T, b, precision=hi)
    acc = acc * (ops["p_scale"].astype(jnp.float32) * ops["q_scale"].astype(jnp.float32))
    return _epilog(acc, ops, epilog, d_dtype, aux_dtype, amax)


def _epilog(acc, ops, epilog, d_dtype, aux_dtype, amax):
    """cuBLASLt's epilog on the scaled float32 product ``acc``, in float32."""
    f32 = lambda v: v.astype(jnp.float32)
    if "aux" in ops:  # DGELU: times GELU's derivative at the previous layer's z
        z = f32(ops["aux"][:, : acc.shape[1]])
        y = acc * jax.grad(lambda v: jnp.sum(_reference.activate(v, Activation.GELU)))(z)
    else:
        z = acc + f32(ops["bias"]) if "bias" in ops else acc
        activation = next((act for act in Activation if epilog.startswith(act.name)), None)
        y = _reference.activate(z, activation)
    d_dtype = np.dtype(d_dtype)
    d = saturate(y * f32(ops["d_scale"]), d_dtype) if d_dtype.name in FP8_DTYPES else y.astype(d_dtype)
    out = [d]
    if amax:
        out.append(jnp.max(jnp.abs(y)))
    if "AUX" in epilog:
        width = aux_columns(Activation.GELU, z.shape[1])
        out.append(jnp.pad(z, ((0, 0), (0, width - z.shape[1]))).astype(aux_dtype))
    return out


def _round(size: int) -> int:
    return -(-size // FP8_ROW) * FP8_ROW


def _spec(avals, problem, epilog, d_dtype, aux_dtype, amax) -> Fp8Spec | None:
    """The padded problem (K and N multiples of 16; for ``wgrad`` K is the layer's rows), or
    None where XLA computes it: symbolic or empty sizes."""
    if symbolic(*avals) or 0 in avals[0].shape + avals[1].shape:
        return None
    m, n, k = (int(s) for s in _sizes(problem, avals[0], avals[1]))
    names = operand_names(problem, epilog, d_dtype)
    bias = np.dtype(avals[names.index("bias")].dtype).name if "bias" in names else None
    aux = np.dtype(aux_dtype).name if aux_dtype is not None else None
    if "aux" in names:
        aux = np.dtype(avals[names.index("aux")].dtype).name
    return Fp8Spec(
        m=m, n=_round(n), k=_round(k), epilog=epilog, p_dtype=np.dtype(avals[0].dtype).name,
        q_dtype=np.dtype(avals[1].dtype).name, d_dtype=np.dtype(d_dtype).name, bias_dtype=bias,
        aux_dtype=aux, amax=int(amax), fast_accum=int(problem in get_policy().fp8_fast_accum),
    )  # fmt: skip


def _cuda(ctx, *args, problem, epilog, d_dtype, aux_dtype, amax):
    """cuBLASLt's FP8 GEMM with its epilog; where cuBLASLt refuses that, the nearest problem
    it runs (``_alternatives``) with the rest in XLA, and one warning; else the emulation."""
    params = {"problem": problem, "epilog": epilog, "d_dtype": d_dtype, "aux_dtype": aux_dtype, "amax": amax}
    names = operand_names(problem, epilog, d_dtype)
    spec = _spec(ctx.avals_in, **params)
    m, n = ctx.avals_out[0].shape
    if spec is None:  # symbolic or empty sizes: XLA's documented cases
        return lower_fused_or_reference(ctx, args, params, None, None, reference)
    if problem == "wgrad" and get_policy().fp8_wgrad_in_xla:
        return mlir.lower_fun(functools.partial(_xla_wgrad, d_dtype=d_dtype), multiple_results=True)(
            ctx, *args
        )
    refusal = ffi.prepare(spec)
    if refusal is None:
        fused = lambda *values: _run(problem, dict(zip(names, values)), spec, m, n)
        return mlir.lower_fun(fused, multiple_results=True)(ctx, *args)
    for alt, note in _alternatives(spec):
        if ffi.prepare(alt) is None:
            warn_once(f"{refusal}; {note}")

            def partly(*values, alt=alt):
                ops = dict(zip(names, values))
                y = _run(problem, ops, alt, m, n)
                if alt.epilog == epilog and np.dtype(d_dtype).name in FP8_DTYPES:  # FP8 D in 16 bits
                    return _quantized(y, ops, d_dtype, amax)
                return _epilog(y[0].astype(jnp.float32), ops, epilog, d_dtype, aux_dtype, amax)

            return mlir.lower_fun(partly, multiple_results=True)(ctx, *args)
    warn_once(refusal)
    return mlir.lower_fun(functools.partial(reference, **params), multiple_results=True)(ctx, *args)


def _xla_wgrad(x, dz, x_scale, dz_scale, *, d_dtype):
    """x^T dz by XLA's own FP8 GEMM. The kernel gradient has no epilog to fuse but needs
    both operands transposed (Hopper's FP8 GEMM reads K-contiguous operands only, and here
    K is the rows): XLA transposes the FP8 bytes after its fusion decisions, whereas a
    transpose written into this lowering is moved by XLA into the passes that
    produce x and dz, which then run transposed (several times slower)."""
    acc = jax.lax.dot_general(x, dz, (((0,), (0,)), ((), ())), preferred_element_type=d_dtype)
    return [(acc.astype(jnp.float32) * (x_scale * dz_scale)).astype(d_dtype)]


def _alternatives(spec: Fp8Spec):
    """What to ask cuBLASLt for where it refuses ``spec``, nearest first: an FP8 D written
    in 16 bits (then scaled, cast and its amax taken in XLA); the plain FP8 GEMM, in float32
    then in bfloat16 (then the whole epilog in XLA)."""
    if spec.d_fp8:
        yield spec._replace(d_dtype=spec.bias_dtype or "bfloat16", amax=0), "its FP8 output is cast in XLA"
    for dtype in ("float32", "bfloat16"):
        plain = spec._replace(epilog="DEFAULT", d_dtype=dtype, bias_dtype=None, aux_dtype=None, amax=0)
        yield plain, "its epilog runs in XLA after cuBLASLt's FP8 GEMM"


def _run(problem, ops, spec: Fp8Spec, m: int, n: int):
    """``spec``'s custom call on the operands by name; its results cut to (m, n)."""
    results = [jax.ShapeDtypeStruct((spec.m, spec.n), spec.d_dtype)]
    if spec.amax:
        results.append(jax.ShapeDtypeStruct((), np.float32))
    if spec.aux_out:
        results.append(jax.ShapeDtypeStruct((spec.m, spec.aux_ld), spec.aux_dtype))
    outs = _gemm(problem, ops, spec, results)
    width = aux_columns(Activation.GELU, n)
    return [
        cut_to(outs[0], m, n),
        *outs[1 : 1 + spec.amax],
        *(cut_to(o, m, width) for o in outs[1 + spec.amax :]),
    ]


def _quantized(outs, ops, d_dtype, amax):
    """A 16-bit D (and its aux) as the FP8 D, its amax and the aux."""
    y = outs[0].astype(jnp.float32)
    d = saturate(y * ops["d_scale"].astype(jnp.float32), d_dtype)
    return [d, *([jnp.max(jnp.abs(y))] if amax else []), *outs[1:]]


def _gemm(problem, ops, spec: Fp8Spec, results):
    """The custom call for ``spec`` on the operands by name, padded and K-contiguous."""
    p, q = _gpu_operands(problem, ops, spec)
    names = (*spec.operands()[2:],)
    padded = {"bias": lambda v: pad_to(v, spec.n), "aux": lambda v: pad_to(v, spec.m, spec.aux_ld)}
    rest = [padded.get(name, lambda v: v)(ops[name]) for name in names]
    return ffi.call((p, q, *rest), results, spec, command_buffer=get_policy().fp8_command_buffers)


def _gpu_operands(problem, ops, spec: Fp8Spec):
    """P (M, K) and Q (N, K), K-contiguous, padded to the spec's sizes."""
    if problem == "forward":
        return pad_to(ops["x"], spec.m, spec.k), pad_to(ops["kernel"].T, spec.n, spec.k)
    if problem == "dgrad":
        return pad_to(ops["dz"], spec.m, spec.k), pad_to(ops["kernel"], spec.n, spec.k)
    return pad_to(ops["x"].T, spec.m, spec.k), pad_to(ops["dz"].T, spec.n, spec.k)


register(fp8_matmul_p, results=_results, layout=_layout, reference=reference, cuda=_cuda, batch=None)
