"""The only module that knows the XLA FFI C ABI: the ctypes handler and its registration.

XLA calls ``_handler`` with an ``XLA_FFI_CallFrame*``. The frame is decoded with fixed
offsets (XLA FFI API 0.1, 64-bit): one bulk read of the frame header, one read of each
buffer's data pointer, one attribute (``_key``) and ``XLA_FFI_Stream_Get``. Everything
else about the problem is decoded once per distinct ``_key`` and cached.

The handler declares the command-buffer trait, so XLA may capture it into a CUDA graph:
it launches exactly one ``cublasLtMatmul`` per call and never synchronises or allocates
(except when planning a problem it has not seen; see ``_nvmath._relaxed_capture``).

Every exception is caught and returned to XLA as an FFI error: a ctypes callback that
raised would return NULL, which XLA reads as success.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
import threading
from typing import Any

import jax
import numpy as np

from ._epilogs import EpilogSpec

__all__ = ["TARGET_NAME", "call", "ensure_registered", "spec_key"]

TARGET_NAME = "jax_epilog_fused_matmul"

_FFI_API_VERSION = (0, 1)
_COMMAND_BUFFER_COMPATIBLE = 1
_METADATA_EXTENSION = 1
_STAGE_EXECUTE = 3
_ATTR_SCALAR, _ATTR_STRING = 3, 4
_ERROR_INTERNAL = 13
_DTYPE_NAMES = {6: "uint8", 10: "float16", 11: "float32", 16: "bfloat16"}

# XLA_FFI_CallFrame up to and including attrs (168 bytes): struct_size, extension_start,
# api, ctx, stage(+pad), then XLA_FFI_Args / XLA_FFI_Rets {size_, ext, size, types, ptrs}
# and XLA_FFI_Attrs {size_, ext, size, types, names, attrs}.
_FRAME = struct.Struct("<QQQQi4x QQqQQ QQqQQ QQqQQQ")
_BUFFER_DTYPE, _BUFFER_DATA = 16, 24  # offsets in XLA_FFI_Buffer
_API_ERROR_CREATE, _API_STREAM_GET = 48, 80  # offsets in XLA_FFI_Api
_KEY_ATTR = "_key"  # sorts before every lowercase name: XLA passes attributes sorted

_u64 = ctypes.c_uint64
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32
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
    """A stable 63-bit key for a problem (the same in every process)."""
    digest = hashlib.blake2b(repr(tuple(spec)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def call(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, spec: EpilogSpec, aux_shape):
    """Emit the custom call: returns (D, aux or None). x is (m, k), kernel (k, n)."""
    key = spec_key(spec)
    _handler.remember(key, spec)
    results = [jax.ShapeDtypeStruct((spec.m, spec.n), np.dtype(spec.d_dtype))]
    if aux_shape is not None:
        results.append(jax.ShapeDtypeStruct(*aux_shape))
    operands = (x, kernel) if bias is None else (x, kernel, bias)
    outs = jax.ffi.ffi_call(TARGET_NAME, results)(
        *operands,
        _key=np.int64(key),
        epilog=spec.epilog,
        compute_type=spec.compute_type,
        m=np.int64(spec.m),
        n=np.int64(spec.n),
        k=np.int64(spec.k),
    )
    return outs[0], (outs[1] if aux_shape is not None else None)


# ----------------------------------------------------------------------------- handler


def _ptr(address: int) -> int:
    return _u64.from_address(address).value


def _span(address: int) -> bytes:
    """An XLA_FFI_ByteSpan {const char* ptr; size_t len} as bytes."""
    return ctypes.string_at(_ptr(address), _ptr(address + 8))


class _Api:
    """The XLA_FFI_Api functions this handler calls, bound once per API table."""

    def __init__(self, api: int):
        self.error_create = _API_FN(_ptr(api + _API_ERROR_CREATE))
        self.stream_get = _API_FN(_ptr(api + _API_STREAM_GET))

    def stream(self, ctx: int) -> int:
        args = (_u64 * 4)(32, 0, ctx, 0)  # XLA_FFI_Stream_Get_Args
        err = self.stream_get(ctypes.addressof(args))
        if err:
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

    def remember(self, key: int, spec: EpilogSpec) -> None:
        """Known at lowering: saves decoding the attributes at the first call."""
        self._specs.setdefault(key, spec)

    def __call__(self, frame: int) -> int | None:
        api = None
        try:
            (_, ext, api_ptr, ctx, stage, _, _, nargs, _, args, _, _, nrets, _, rets,
             _, _, nattrs, attr_types, attr_names, attrs) = _FRAME.unpack(
                ctypes.string_at(frame, _FRAME.size))  # fmt: skip
            if ext:
                return self._metadata(ext)
            api = self._apis.get(api_ptr) or self._bind_api(api_ptr)
            if stage != _STAGE_EXECUTE:
                return None
            if self._key_index is None:
                self._key_index = self._find_key(nattrs, attr_names)
            scalar = _ptr(attrs + 8 * self._key_index)
            key = _i64.from_address(_ptr(scalar + 8)).value
            stream = api.stream(ctx)
            bufs = struct.unpack_from(f"<{nargs}Q", ctypes.string_at(args, 8 * nargs))
            outs = struct.unpack_from(f"<{nrets}Q", ctypes.string_at(rets, 8 * nrets))
            x = _ptr(bufs[0] + _BUFFER_DATA)
            w = _ptr(bufs[1] + _BUFFER_DATA)
            bias = _ptr(bufs[2] + _BUFFER_DATA) if nargs > 2 else 0
            d = _ptr(outs[0] + _BUFFER_DATA)
            aux = _ptr(outs[1] + _BUFFER_DATA) if nrets > 1 else 0
            alignment = self._nvmath.alignment_of(x, w, d, bias, aux)
            plan = self._plans.get((key, stream, alignment))
            if plan is None:
                plan = self._make_plan(key, stream, alignment, d, frame, nattrs, attr_types,
                                       attr_names, attrs, bufs, outs)  # fmt: skip
            plan.run(stream, w, x, bias, d, aux)
            return None
        except BaseException as exc:  # noqa: BLE001 -- must never propagate into XLA
            message = f"jax_epilog: fused matmul failed: {type(exc).__name__}: {exc}"
            try:
                return (api or self._any_api()).error(message)
            except BaseException:  # noqa: BLE001
                return None

    def _any_api(self) -> _Api:
        return next(iter(self._apis.values()))

    def _bind_api(self, api_ptr: int) -> _Api:
        api = self._apis[api_ptr] = _Api(api_ptr)
        return api

    @staticmethod
    def _metadata(ext: int) -> None:
        """Answer XLA's metadata query: API version and the command-buffer trait."""
        if _i32.from_address(ext + 8).value != _METADATA_EXTENSION:
            return None
        meta = _ptr(ext + 24)  # XLA_FFI_Metadata_Extension.metadata
        _u64.from_address(meta + 8).value = 24  # api_version.struct_size
        _i32.from_address(meta + 24).value = _FFI_API_VERSION[0]
        _i32.from_address(meta + 28).value = _FFI_API_VERSION[1]
        ctypes.c_uint32.from_address(meta + 32).value = _COMMAND_BUFFER_COMPATIBLE
        return None

    @staticmethod
    def _find_key(nattrs: int, names: int) -> int:
        for i in range(nattrs):
            if _span(_ptr(names + 8 * i)).decode() == _KEY_ATTR:
                return i
        raise RuntimeError(f"custom call has no {_KEY_ATTR!r} attribute")

    def _decode_attrs(self, nattrs, types, names, attrs) -> dict[str, Any]:
        decoded = {}
        for i in range(nattrs):
            name = _span(_ptr(names + 8 * i)).decode()
            kind = _i32.from_address(types + 4 * i).value
            value = _ptr(attrs + 8 * i)
            if kind == _ATTR_STRING:
                decoded[name] = _span(value).decode()
            elif kind == _ATTR_SCALAR:
                decoded[name] = _i64.from_address(_ptr(value + 8)).value
        return decoded

    def _make_plan(self, key, stream, alignment, d, frame, nattrs, types, names, attrs, bufs, outs):
        with self._lock:
            spec = self._specs.get(key)
            if spec is None:
                a = self._decode_attrs(nattrs, types, names, attrs)

                def dtype(buf):
                    return _DTYPE_NAMES[_i32.from_address(buf + _BUFFER_DTYPE).value]

                spec = EpilogSpec(
                    m=a["m"], n=a["n"], k=a["k"], epilog=a["epilog"],
                    compute_type=a["compute_type"], ab_dtype=dtype(bufs[0]),
                    bias_dtype=dtype(bufs[2]) if len(bufs) > 2 else None,
                    d_dtype=dtype(outs[0]),
                )  # fmt: skip
                if spec_key(spec) != key:
                    raise RuntimeError(f"decoded problem {spec} does not match its key")
                self._specs[key] = spec
            if alignment == 0:
                raise RuntimeError("operand addresses are not 16-byte aligned")
            plan = self._nvmath.get_plan(spec, self._nvmath.device_of(d), alignment)
            self._plans[(key, stream, alignment)] = plan
            return plan


_handler = _Handler()
_handler_fn = _HANDLER_FN(_handler)
_registered = False
_register_lock = threading.Lock()


def ensure_registered() -> None:
    """Register the CUDA target with XLA (once; call only after the backend is up)."""
    global _registered
    if _registered:
        return
    with _register_lock:
        if _registered:
            return
        from . import _nvmath  # the GPU path's only entry into nvmath

        _handler._nvmath = _nvmath
        capsule_new = ctypes.pythonapi.PyCapsule_New
        capsule_new.restype = ctypes.py_object
        capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        address = ctypes.cast(_handler_fn, ctypes.c_void_p).value
        jax.ffi.register_ffi_target(TARGET_NAME, capsule_new(address, None, None), platform="CUDA")
        _registered = True
