"""The only module that knows the XLA FFI C ABI: the ctypes handler and its registration.

XLA calls ``_handler`` with an ``XLA_FFI_CallFrame*``. The frame is decoded with fixed
offsets (XLA FFI API 0.1, 64-bit) as 8-byte words: a few header fields, each buffer's data
pointer, one attribute (``_key``), then ``XLA_FFI_Stream_Get``. Everything else about the
problem is decoded once per distinct ``_key`` (usually at lowering) and cached.

The handler declares the command-buffer trait, so XLA may capture it into a CUDA graph:
it launches exactly one ``cublasLtMatmul`` per call (outside capture, where a call repeats
with the same buffers, a replayed graph of that one GEMM: ``_nvmath.Plan.run``) and never
synchronises or allocates
(except when planning a problem it has not seen; see ``_nvmath._relaxed_capture``).

Every exception is caught and returned to XLA as an FFI error: a ctypes callback that
raised would return NULL, which XLA reads as success.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from typing import Any

import jax
import numpy as np

from ._epilogs import EpilogSpec, buffer_elements

__all__ = [
    "EXPORT_CHECKS", "TARGET_NAME", "call", "ensure_registered", "handler_stats", "spec_key", "trace_handler",
]  # fmt: skip

TARGET_NAME = "jax_epilog_fused_matmul"
# What ``jax.export`` must be told to allow a program holding the custom call: it has no
# compatibility guarantee beyond this version of jax_epilog (its attributes are this
# version's problem description).
EXPORT_CHECKS = (jax.export.DisabledSafetyCheck.custom_call(TARGET_NAME),)

_FFI_API_VERSION = (0, 1)
_COMMAND_BUFFER_COMPATIBLE = 1
_METADATA_EXTENSION = 1
_STAGE_EXECUTE = 3
_ATTR_SCALAR, _ATTR_STRING = 3, 4
_ERROR_INTERNAL = 13
_DTYPE_NAMES = {6: "uint8", 10: "float16", 11: "float32", 16: "bfloat16"}

# Word offsets (8 bytes each) in XLA_FFI_CallFrame: struct_size, extension_start, api,
# ctx, stage(+pad), XLA_FFI_Args {struct_size, ext, size, types, args} at 5..9,
# XLA_FFI_Rets likewise at 10..14, XLA_FFI_Attrs {.., size, types, names, attrs} at 15..20.
_F_EXT, _F_API, _F_CTX, _F_STAGE = 1, 2, 3, 4
_F_NARGS, _F_ARGS, _F_NRETS, _F_RETS = 7, 9, 12, 14
_F_NATTRS, _F_ATTR_TYPES, _F_ATTR_NAMES, _F_ATTRS = 17, 18, 19, 20
_B_DTYPE, _B_DATA = 2, 3  # word offsets in XLA_FFI_Buffer
_API_ERROR_CREATE, _API_STREAM_GET = 6, 10  # word offsets in XLA_FFI_Api
_KEY_ATTR = "_key"  # sorts before every lowercase name: XLA passes attributes sorted

# Every field the handler reads is an aligned 8-byte word (a pointer, size or int64;
# 4-byte enums are read as the low half of theirs), so memory is read as one huge array of
# words: _WORDS[address // 8] costs one subscript instead of a ctypes object per field
# (through a memoryview: ~30 ns a word, against ~40 ns for the ctypes array's own indexing).
_WORDS = memoryview((ctypes.c_uint64 * (1 << 59)).from_address(0)).cast("B").cast("Q")
_LOW32 = 0xFFFFFFFF

_u64 = ctypes.c_uint64
_i32 = ctypes.c_int32
_now = time.perf_counter_ns
# XLA_FFI_Stream_Get is trivial: call it without releasing the GIL (a release would make
# this thread wait for the GIL again, behind whatever Python code is running).
_STREAM_GET_FN = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_API_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
_HANDLER_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)


class _ErrorCreateArgs(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("extension_start", ctypes.c_void_p),
        ("message", ctypes.c_char_p),
        ("errc", ctypes.c_int),
    ]


def spec_key(spec: EpilogSpec) -> int:
    """A stable 63-bit key for a problem (the same in every process). A problem without
    members hashes the fields it had before ``members`` and ``shared`` existed, so that
    its key, and a program exported with it, stay as they were."""
    fields = tuple(spec) if spec.members > 1 else tuple(spec)[: EpilogSpec._fields.index("members")]
    digest = hashlib.blake2b(repr(fields).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def call(operands: tuple[jax.Array, ...], results: list[jax.ShapeDtypeStruct], spec: EpilogSpec):
    """Emit the custom call for ``spec``; returns the list of results.

    Operands and results by position: forward (x, kernel[, bias]) -> (D[, aux]), where
    ``spec.members > 1`` each with a leading members dimension except those in
    ``spec.shared``;
    wgrad (x, dz) -> (D = dkernel[, dbias]); dgrad (dz, kernel, aux) -> (D = dz of the
    previous layer).
    """
    _check_buffers(operands, results, spec)
    key = spec_key(spec)
    _handler.remember(key, spec)
    members = {}
    if spec.members > 1:  # a batched forward (an ensemble's members)
        members = {"members": np.int64(spec.members), "shared": spec.shared}
    return jax.ffi.ffi_call(TARGET_NAME, results)(
        *operands,
        _key=np.int64(key),
        problem=spec.problem,
        epilog=spec.epilog,
        compute_type=spec.compute_type,
        m=np.int64(spec.m),
        n=np.int64(spec.n),
        k=np.int64(spec.k),
        **members,
    )


# Which of buffer_elements' (A, B, D, bias, aux) each problem's operands and results are.
_BUFFERS = {
    "forward": ((1, 0, 3), (2, 4)),  # (x, kernel[, bias]) -> (D[, aux])
    "wgrad": ((1, 0), (2, 3)),  # (x, dz) -> (dkernel[, dbias])
    "dgrad": ((1, 0, 4), (2,)),  # (dz, kernel, aux) -> (dx,)
}


def _check_buffers(operands, results, spec: EpilogSpec) -> None:
    """Raise unless the buffers are exactly those ``spec``'s GEMM reads and writes.

    The handler trusts the problem it is keyed to and checks no buffer size at run time,
    so a lowering that handed it others would let cuBLASLt read or write out of bounds.
    """
    sizes = buffer_elements(spec)
    for role, buffers, wanted in zip(("operands", "results"), (operands, results), _BUFFERS[spec.problem]):
        got = [int(np.prod(b.shape)) for b in buffers]
        want = [sizes[i] for i in wanted][: len(got)]
        if got != want or any(sizes[i] for i in wanted[len(got) :]):
            raise RuntimeError(
                f"jax_epilog bug: the custom call for {spec} was given {role} of {got} elements, "
                f"where its GEMM needs {[sizes[i] for i in wanted if sizes[i]]}"
            )


# ----------------------------------------------------------------------------- handler


def _span(address: int) -> bytes:
    """An XLA_FFI_ByteSpan {const char* ptr; size_t len} as bytes."""
    return ctypes.string_at(_WORDS[address >> 3], _WORDS[(address >> 3) + 1])


class _Api:
    """The XLA_FFI_Api functions this handler calls, bound once per API table."""

    def __init__(self, api: int):
        self.error_create = _API_FN(_WORDS[(api >> 3) + _API_ERROR_CREATE])
        self.stream_get = _STREAM_GET_FN(_WORDS[(api >> 3) + _API_STREAM_GET])
        self._args = threading.local()

    def stream(self, ctx: int) -> int:
        args = getattr(self._args, "buf", None)
        if args is None:  # one XLA_FFI_Stream_Get_Args per thread, reused
            args = self._args.buf = (_u64 * 4)(32, 0, 0, 0)
        args[2] = ctx
        if self.stream_get(ctypes.addressof(args)):
            raise RuntimeError("XLA_FFI_Stream_Get failed")
        return args[3]

    def error(self, message: str) -> int:
        args = _ErrorCreateArgs(ctypes.sizeof(_ErrorCreateArgs), None, message.encode(), _ERROR_INTERNAL)
        return self.error_create(ctypes.addressof(args))


class _Handler:
    def __init__(self):
        self._apis: dict[int, _Api] = {}
        self._specs: dict[int, EpilogSpec] = {}  # _key -> problem
        self._plans: dict[tuple[int, int, int], Any] = {}  # (_key, stream, alignment) -> Plan
        self._key_index: int | None = None
        self._lock = threading.Lock()
        self._nvmath = None
        self.calls = 0  # executions, and host time spent in them: see handler_stats()
        self.busy_ns = 0
        self.resolved = 0  # (problem, stream, alignment) triples looked up or planned
        self.trace: list[tuple[int, ...]] | None = None  # per-call timestamps, when profiling
        self._pinned = threading.local()

    def remember(self, key: int, spec: EpilogSpec) -> None:
        """Known at lowering: saves decoding the attributes at the first call."""
        self._specs.setdefault(key, spec)

    def __call__(self, frame: int) -> int | None:
        start = _now()
        api = None
        try:
            mem = _WORDS
            f = frame >> 3
            ext = mem[f + _F_EXT]
            if ext:
                return self._metadata(ext)
            api = self._apis.get(mem[f + _F_API]) or self._bind_api(mem[f + _F_API])
            if not hasattr(self._pinned, "state"):
                self._pin_thread_state()
            if mem[f + _F_STAGE] & _LOW32 != _STAGE_EXECUTE:
                return None
            if self._key_index is None:
                self._key_index = self._find_key(mem[f + _F_NATTRS], mem[f + _F_ATTR_NAMES])
            scalar = mem[(mem[f + _F_ATTRS] >> 3) + self._key_index]  # XLA_FFI_Scalar {dtype, value*}
            key = mem[mem[(scalar >> 3) + 1] >> 3]
            decoded = _now() if self.trace is not None else 0
            stream = api.stream(mem[f + _F_CTX])
            streamed = _now() if self.trace is not None else 0
            args, rets = mem[f + _F_ARGS] >> 3, mem[f + _F_RETS] >> 3
            b = mem[(mem[args] >> 3) + _B_DATA]  # x, or dz for "dgrad"
            a = mem[(mem[args + 1] >> 3) + _B_DATA]  # the kernel, or dz for "wgrad"
            arg2 = mem[(mem[args + 2] >> 3) + _B_DATA] if mem[f + _F_NARGS] > 2 else 0
            d = mem[(mem[rets] >> 3) + _B_DATA]
            ret1 = mem[(mem[rets + 1] >> 3) + _B_DATA] if mem[f + _F_NRETS] > 1 else 0
            alignment = (self._nvmath or self._load_nvmath()).alignment_of(b, a, d, arg2, ret1)
            plan = self._plans.get((key, stream, alignment))
            if plan is None:
                plan = self._make_plan(key, stream, alignment, d, frame)
            looked_up = _now() if self.trace is not None else 0
            problem = plan.problem
            if problem == "forward":  # (x, kernel[, bias]) -> (D[, aux])
                plan.run(stream, a, b, arg2, d, ret1)
            elif problem == "wgrad":  # (x, dz) -> (dkernel, dbias)
                plan.run(stream, a, b, ret1, d, 0)
            else:  # "dgrad": (dz, kernel, aux) -> D; the aux is an input
                plan.run(stream, a, b, 0, d, arg2)
            end = _now()
            self.calls += 1
            self.busy_ns += end - start
            if self.trace is not None:
                self.trace.append((start, decoded, streamed, looked_up, end))
            return None
        except BaseException as exc:  # noqa: BLE001 -- must never propagate into XLA
            message = f"jax_epilog: fused matmul failed: {type(exc).__name__}: {exc}"
            try:
                return (api or self._any_api()).error(message)
            except BaseException:  # noqa: BLE001
                return None

    def _pin_thread_state(self) -> None:
        """Keep this thread's Python thread state alive between calls.

        ctypes enters a callback on a thread unknown to Python with PyGILState_Ensure and
        leaves with PyGILState_Release, which creates and destroys a thread state on every
        call. One extra Ensure, never released, keeps it: later calls only take the GIL.
        (With jax 0.11 on the H200 the handler was measured to run on the thread that
        dispatched the jitted call, which already has one; other runtimes may differ.)
        """
        self._pinned.state = ctypes.pythonapi.PyGILState_Ensure()

    def _load_nvmath(self):
        """nvmath-python's side, imported at the first call (registration does not need it;
        ``_nvmath`` makes no CUDA call at import, so this may run under graph capture)."""
        from . import _nvmath  # the GPU path's only entry into nvmath

        self._nvmath = _nvmath
        return _nvmath

    def _any_api(self) -> _Api:
        return next(iter(self._apis.values()))

    def _bind_api(self, api_ptr: int) -> _Api:
        api = self._apis[api_ptr] = _Api(api_ptr)
        return api

    @staticmethod
    def _metadata(ext: int) -> None:
        """Answer XLA's metadata query: API version and the command-buffer trait."""
        if _WORDS[(ext >> 3) + 1] & _LOW32 != _METADATA_EXTENSION:
            return
        meta = _WORDS[(ext >> 3) + 3]  # XLA_FFI_Metadata_Extension.metadata
        _u64.from_address(meta + 8).value = 24  # api_version.struct_size
        _i32.from_address(meta + 24).value = _FFI_API_VERSION[0]
        _i32.from_address(meta + 28).value = _FFI_API_VERSION[1]
        ctypes.c_uint32.from_address(meta + 32).value = _COMMAND_BUFFER_COMPATIBLE
        return

    @staticmethod
    def _find_key(nattrs: int, names: int) -> int:
        for i in range(nattrs):
            if _span(_WORDS[(names >> 3) + i]).decode() == _KEY_ATTR:
                return i
        raise RuntimeError(f"custom call has no {_KEY_ATTR!r} attribute")

    @staticmethod
    def _decode_attrs(frame: int) -> dict[str, Any]:
        """All attributes by name (slow path: once per problem, in a new process)."""
        f = frame >> 3
        names, attrs = _WORDS[f + _F_ATTR_NAMES] >> 3, _WORDS[f + _F_ATTRS] >> 3
        types = _WORDS[f + _F_ATTR_TYPES]
        decoded = {}
        for i in range(_WORDS[f + _F_NATTRS]):
            name = _span(_WORDS[names + i]).decode()
            kind = _i32.from_address(types + 4 * i).value
            value = _WORDS[attrs + i]
            if kind == _ATTR_STRING:
                decoded[name] = _span(value).decode()
            elif kind == _ATTR_SCALAR:  # every scalar attribute here is an int64
                decoded[name] = _WORDS[_WORDS[(value >> 3) + 1] >> 3]
        return decoded

    @staticmethod
    def _buffer_dtypes(frame: int, count_word: int, ptrs_word: int) -> list[str]:
        f = frame >> 3
        ptrs = _WORDS[f + ptrs_word] >> 3
        return [
            _DTYPE_NAMES[_WORDS[(_WORDS[ptrs + i] >> 3) + _B_DTYPE] & _LOW32]
            for i in range(_WORDS[f + count_word])
        ]

    def _make_plan(self, key, stream, alignment, d, frame):
        with self._lock:
            spec = self._specs.get(key)
            if spec is None:
                a = self._decode_attrs(frame)
                ins = self._buffer_dtypes(frame, _F_NARGS, _F_ARGS)
                outs = self._buffer_dtypes(frame, _F_NRETS, _F_RETS)
                problem = a.get("problem", "forward")
                if problem == "wgrad":
                    bias_dtype = outs[1] if len(outs) > 1 else None
                elif problem == "dgrad":
                    bias_dtype = None  # the third operand is the aux
                else:
                    bias_dtype = ins[2] if len(ins) > 2 else None
                spec = EpilogSpec(
                    m=a["m"], n=a["n"], k=a["k"], epilog=a["epilog"],
                    compute_type=a["compute_type"], ab_dtype=ins[0],
                    bias_dtype=bias_dtype, d_dtype=outs[0], problem=problem,
                    members=a.get("members", 1), shared=a.get("shared", ""),
                )  # fmt: skip
                if spec_key(spec) != key:
                    raise RuntimeError(f"decoded problem {spec} does not match its key")
                self._specs[key] = spec
            if alignment == 0:
                raise RuntimeError("operand addresses are not 16-byte aligned")
            plan = self._nvmath.get_plan(spec, self._nvmath.device_of(d), alignment)
            self._plans[(key, stream, alignment)] = plan
            self.resolved += 1
            return plan


_handler = _Handler()
_handler_fn = _HANDLER_FN(_handler)
_registered = False
_register_lock = threading.Lock()


def handler_stats() -> tuple[int, int, int]:
    """(executions so far, host nanoseconds spent in them, (problem, stream, alignment) resolved)."""
    return _handler.calls, _handler.busy_ns, _handler.resolved


def trace_handler(enable: bool) -> list[tuple[int, ...]] | None:
    """Start (or stop, returning them) per-call timestamps: (entry, attributes and buffers
    decoded, stream fetched, plan found, cuBLASLt calls returned), in perf_counter ns."""
    trace, _handler.trace = _handler.trace, ([] if enable else None)
    return trace


def ensure_registered() -> None:
    """Register the CUDA target with XLA, once: at import (``_primitive``), so that a
    program holding the custom call runs in any process that imported jax_epilog, one
    deserialized by ``jax.export`` included. Touches neither the GPU nor nvmath-python:
    XLA holds the registration until its CUDA backend starts, and the handler imports
    nvmath at its first call."""
    global _registered
    if _registered:
        return
    with _register_lock:
        if _registered:
            return
        capsule_new = ctypes.pythonapi.PyCapsule_New
        capsule_new.restype = ctypes.py_object
        capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        address = ctypes.cast(_handler_fn, ctypes.c_void_p).value
        jax.ffi.register_ffi_target(TARGET_NAME, capsule_new(address, None, None), platform="CUDA")
        _registered = True
