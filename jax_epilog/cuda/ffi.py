"""The only module that knows the XLA FFI C ABI, and the only way into nvmath-python.

Lowering asks ``prepare`` whether the GPU can run a problem (it plans it, autotuned), then
emits the custom call with ``call``. XLA runs ``_Handler`` with an ``XLA_FFI_CallFrame*``,
decoded at fixed offsets (XLA FFI API major version 0, 64-bit) as 8-byte words: a few header
fields, each buffer's data pointer, one attribute (``_key``), then ``XLA_FFI_Stream_Get``.
The attributes describe the whole problem, so a program that comes from elsewhere
(``jax.export``) is decoded once per ``_key`` and cached.

The handler is registered twice. ``TARGET_NAME`` declares the command-buffer trait, so XLA
may capture the call into a CUDA graph: it launches exactly one ``cublasLtMatmul`` (or a
replayed graph of it) per call and never synchronises or allocates, except when planning a
problem it has not seen. ``EAGER_TARGET_NAME`` declares no trait: XLA runs such a call
outside its command buffers, which it then never re-records for it.

Every exception is caught and returned to XLA as an FFI error: a ctypes callback that
raised would return NULL, which XLA reads as success. An XLA whose FFI API this decoding
does not fit is noted when XLA queries the handler's metadata; lowering then takes XLA's
path with one warning, and a call that reaches the handler anyway returns an error.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np

from .._epilogs import EpilogSpec, check_buffers
from .._fp8_spec import Fp8Spec, check_fp8_buffers

__all__ = ["EAGER_TARGET_NAME", "EXPORT_CHECKS", "TARGET_NAME", "HandlerStats", "call", "ensure_registered",
           "prepare", "recording"]  # fmt: skip

TARGET_NAME = "jax_epilog_fused_matmul"
EAGER_TARGET_NAME = "jax_epilog_fused_matmul_eager"  # the same handler, outside command buffers
# What ``jax.export`` must be told to allow a program holding the custom calls: they have no
# compatibility guarantee beyond this version of jax_epilog.
EXPORT_CHECKS = tuple(
    jax.export.DisabledSafetyCheck.custom_call(name) for name in (TARGET_NAME, EAGER_TARGET_NAME)
)

_HANDLER_API_VERSION = (0, 1)  # declared in the metadata: the oldest API this decoding fits
_COMMAND_BUFFER_COMPATIBLE = 1
_METADATA_EXTENSION = 1
_STAGE_EXECUTE = 3
_ATTR_SCALAR, _ATTR_STRING = 3, 4
_ERROR_INTERNAL = 13
_FRAME_BYTES = 168  # the XLA_FFI_CallFrame fields read below end here

# Word offsets (8 bytes each) in XLA_FFI_CallFrame: struct_size, extension_start, api,
# ctx, stage(+pad), XLA_FFI_Args {struct_size, ext, size, types, args} at 5..9,
# XLA_FFI_Rets likewise at 10..14, XLA_FFI_Attrs {.., size, types, names, attrs} at 15..20.
_F_SIZE, _F_EXT, _F_API, _F_CTX, _F_STAGE = 0, 1, 2, 3, 4
_F_NARGS, _F_ARGS, _F_NRETS, _F_RETS = 7, 9, 12, 14
_F_NATTRS, _F_ATTR_TYPES, _F_ATTR_NAMES, _F_ATTRS = 17, 18, 19, 20
_B_DATA = 3  # word offset of the data pointer in XLA_FFI_Buffer
# Word offsets in XLA_FFI_Api: its version's {major, minor} int32 pair, Error_Create, Stream_Get.
_API_VERSION, _API_ERROR_CREATE, _API_STREAM_GET = 4, 6, 10
_KEY_ATTR = "_key"  # sorts before every lowercase name: XLA passes attributes sorted

# Every field read is an aligned 8-byte word (4-byte enums are read as the low half of
# theirs), so memory is read as one huge array of words: one subscript per field.
_WORDS = memoryview((ctypes.c_uint64 * (1 << 59)).from_address(0)).cast("B").cast("Q")
_LOW32 = 0xFFFFFFFF

_u64, _i32 = ctypes.c_uint64, ctypes.c_int32
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


def _spec_key(spec: EpilogSpec) -> int:
    """A stable 63-bit key for a problem (the same in every process)."""
    digest = hashlib.blake2b(repr(tuple(spec)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def api_refusal(version: tuple[int, int]) -> str | None:
    """Why this decoding cannot serve XLA's FFI API ``version`` (None where it can)."""
    if version[0] == _HANDLER_API_VERSION[0] and version[1] >= _HANDLER_API_VERSION[1]:
        return None
    return (
        f"XLA's FFI API is version {version[0]}.{version[1]}; jax_epilog's handler decodes "
        f"{_HANDLER_API_VERSION[0]}.{_HANDLER_API_VERSION[1]} and later {_HANDLER_API_VERSION[0]}.x"
    )


def prepare(spec: EpilogSpec) -> str | None:
    """At lowering: plan (and autotune) ``spec`` on the current device. Returns why the
    GPU path cannot run it, or None where it can."""
    for version in _handler.api_versions:
        if (refusal := api_refusal(version)) is not None:
            return refusal
    try:
        from . import plan
    except ImportError as exc:
        return f"nvmath-python/cupy are not importable ({exc}); install jax_epilog[cuda12] or [cuda13]"
    try:
        plan.get_plan(spec, plan.current_device(), autotune=True)
    except plan.PlanningError as exc:
        return str(exc)
    return None


def call(
    operands: tuple[jax.Array, ...],
    results: list[jax.ShapeDtypeStruct],
    spec: EpilogSpec | Fp8Spec,
    command_buffer: bool = True,
):
    """Emit the custom call for ``spec``; returns the list of results. ``command_buffer``:
    whether XLA may capture the call into its command buffers (``TARGET_NAME``) or must run
    it on its own (``EAGER_TARGET_NAME``).

    Operands and results by position: forward (x, kernel[, bias]) -> (D[, aux]), each with
    a leading members dimension where ``spec.members > 1``, except those in
    ``spec.shared``; wgrad (x, dz) -> (dkernel, dbias); dgrad (dz, kernel, aux) -> (D);
    an Fp8Spec's ``operands()`` -> ``results()``.
    """
    check = check_fp8_buffers if spec.problem == "fp8" else check_buffers
    check([o.shape for o in operands], [r.shape for r in results], spec)
    key = _spec_key(spec)
    _handler.remember(key, spec)
    attributes = {
        name: np.int64(value) if isinstance(value, int) else value for name, value in spec._asdict().items()
    }
    attributes |= {name: attributes[name] or "" for name in ("bias_dtype", "aux_dtype") if name in attributes}
    target = TARGET_NAME if command_buffer else EAGER_TARGET_NAME
    return jax.ffi.ffi_call(target, results)(*operands, _key=np.int64(key), **attributes)


# ----------------------------------------------------------------------------- handler


def _span(address: int) -> bytes:
    """An XLA_FFI_ByteSpan {const char* ptr; size_t len} as bytes."""
    return ctypes.string_at(_WORDS[address >> 3], _WORDS[(address >> 3) + 1])


def _buffer(list_address: int, i: int) -> int:
    """The data pointer of buffer ``i`` in an array of XLA_FFI_Buffer pointers."""
    return _WORDS[(_WORDS[(list_address >> 3) + i] >> 3) + _B_DATA]


class _Api:
    """The XLA_FFI_Api functions this handler calls, bound once per API table."""

    def __init__(self, api: int):
        word = _WORDS[(api >> 3) + _API_VERSION]
        self.version = (word & _LOW32, word >> 32)
        self.refusal = api_refusal(self.version)
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
        self._plans: dict[tuple[int, int, int], object] = {}  # (_key, stream, alignment) -> Plan
        self._key_index: int | None = None
        self._lock = threading.Lock()
        self._plan_module = None
        self._pinned = threading.local()

    @property
    def api_versions(self) -> list[tuple[int, int]]:
        """The FFI API versions XLA has handed the handler so far."""
        return [api.version for api in list(self._apis.values())]

    def remember(self, key: int, spec: EpilogSpec) -> None:
        """Known at lowering: saves decoding the attributes at the first call."""
        self._specs.setdefault(key, spec)

    def __call__(self, frame: int, traits: int = _COMMAND_BUFFER_COMPATIBLE) -> int | None:
        api = None
        try:
            f = frame >> 3
            if table := _WORDS[f + _F_API]:  # (XLA may send a metadata query without one)
                api = self._apis.get(table) or self._apis.setdefault(table, _Api(table))
            if _WORDS[f + _F_EXT]:  # answered whatever the API: lowering refuses an unfit one
                return self._metadata(_WORDS[f + _F_EXT], traits)
            if api.refusal is not None:
                return api.error(f"jax_epilog: {api.refusal}")
            if _WORDS[f + _F_SIZE] < _FRAME_BYTES:
                return api.error(f"jax_epilog: a call frame of {_WORDS[f + _F_SIZE]} bytes is too small")
            if _WORDS[f + _F_STAGE] & _LOW32 != _STAGE_EXECUTE:
                return None
            if (stats := _stats) is None:
                return self._execute(frame, api)
            start = _now()
            try:
                return self._execute(frame, api)
            finally:
                stats.count(start, _now())
        except BaseException as exc:  # noqa: BLE001 -- must never propagate into XLA
            message = f"jax_epilog: fused matmul failed: {type(exc).__name__}: {exc}"
            try:
                return (api or next(iter(self._apis.values()))).error(message)
            except BaseException:  # noqa: BLE001
                return None

    def _execute(self, frame: int, api: _Api) -> None:
        f = frame >> 3
        if not hasattr(self._pinned, "state"):
            self._pin_thread_state()
        if self._key_index is None:
            self._key_index = self._find_key(_WORDS[f + _F_NATTRS], _WORDS[f + _F_ATTR_NAMES])
        scalar = _WORDS[(_WORDS[f + _F_ATTRS] >> 3) + self._key_index]  # XLA_FFI_Scalar {dtype, value*}
        key = _WORDS[_WORDS[(scalar >> 3) + 1] >> 3]
        stream = api.stream(_WORDS[f + _F_CTX])
        args, rets = _WORDS[f + _F_ARGS], _WORDS[f + _F_RETS]
        ins = [_buffer(args, i) for i in range(_WORDS[f + _F_NARGS])]
        outs = [_buffer(rets, i) for i in range(_WORDS[f + _F_NRETS])]
        plans = self._plan_module or self._load_plans()
        spec = self._specs.get(key) or self._learn(key, frame)
        pointers = spec.call_pointers(ins, outs)
        alignment = plans.alignment_of(*spec.matrix_pointers(pointers))
        plan = self._plans.get((key, stream, alignment)) or self._make_plan(
            key, spec, stream, alignment, outs[0]
        )
        plan.run(stream, *pointers)

    def _pin_thread_state(self) -> None:
        """Keep this thread's Python thread state alive between calls: ctypes enters a
        callback on a thread unknown to Python with PyGILState_Ensure and leaves with
        PyGILState_Release, which would create and destroy a thread state at every call.
        One extra Ensure, never released, keeps it."""
        self._pinned.state = ctypes.pythonapi.PyGILState_Ensure()

    def _load_plans(self):
        """The plan module, imported at the first call (registration does not need it, and
        importing it makes no CUDA call, so this may run under graph capture)."""
        from . import plan

        self._plan_module = plan
        return plan

    @staticmethod
    def _metadata(ext: int, traits: int) -> None:
        """Answer XLA's metadata query: API version and the traits (command buffers or none)."""
        if _WORDS[(ext >> 3) + 1] & _LOW32 != _METADATA_EXTENSION:
            return
        meta = _WORDS[(ext >> 3) + 3]  # XLA_FFI_Metadata_Extension.metadata
        _u64.from_address(meta + 8).value = 24  # api_version.struct_size
        _i32.from_address(meta + 24).value = _HANDLER_API_VERSION[0]
        _i32.from_address(meta + 28).value = _HANDLER_API_VERSION[1]
        ctypes.c_uint32.from_address(meta + 32).value = traits

    @staticmethod
    def _find_key(nattrs: int, names: int) -> int:
        for i in range(nattrs):
            if _span(_WORDS[(names >> 3) + i]).decode() == _KEY_ATTR:
                return i
        raise RuntimeError(f"custom call has no {_KEY_ATTR!r} attribute")

    @staticmethod
    def _decode_spec(frame: int) -> EpilogSpec:
        """The problem from the call's attributes (once per problem, in a new process)."""
        f = frame >> 3
        names, attrs = _WORDS[f + _F_ATTR_NAMES] >> 3, _WORDS[f + _F_ATTRS] >> 3
        types = _WORDS[f + _F_ATTR_TYPES]
        decoded = {}
        for i in range(_WORDS[f + _F_NATTRS]):
            name, value = _span(_WORDS[names + i]).decode(), _WORDS[attrs + i]
            kind = _i32.from_address(types + 4 * i).value
            if kind == _ATTR_STRING:
                decoded[name] = _span(value).decode()
            elif kind == _ATTR_SCALAR:  # every scalar attribute here is an int64
                decoded[name] = _WORDS[_WORDS[(value >> 3) + 1] >> 3]
        for name in ("bias_dtype", "aux_dtype"):
            decoded[name] = decoded.get(name) or None
        kind = Fp8Spec if decoded["problem"] == "fp8" else EpilogSpec
        return kind(**{name: decoded[name] for name in kind._fields})

    def _learn(self, key: int, frame: int):
        """The problem of a call whose lowering this process did not see (``jax.export``)."""
        with self._lock:
            spec = self._specs.get(key)
            if spec is None:
                spec = self._decode_spec(frame)
                if _spec_key(spec) != key:
                    raise RuntimeError(f"decoded problem {spec} does not match its key")
                self._specs[key] = spec
            return spec

    def _make_plan(self, key, spec, stream, alignment, d):
        with self._lock:
            if alignment == 0:
                raise RuntimeError("operand addresses are not 16-byte aligned")
            plan = self._plan_module.get_plan(spec, self._plan_module.device_of(d), alignment)
            self._plans[(key, stream, alignment)] = plan
            if _stats is not None:
                _stats.plans_resolved += 1
            return plan


@dataclasses.dataclass
class HandlerStats:
    """What the handler did inside a ``recording`` block: executions, the host nanoseconds
    spent in them, plans looked up or made, and, when asked for, each execution's (entry,
    exit) ``perf_counter_ns`` timestamps."""

    calls: int = 0
    busy_ns: int = 0
    plans_resolved: int = 0
    trace: list[tuple[int, int]] | None = None

    def count(self, start: int, end: int) -> None:
        self.calls += 1
        self.busy_ns += end - start
        if self.trace is not None:
            self.trace.append((start, end))


_handler = _Handler()
_stats: HandlerStats | None = None
_now = time.perf_counter_ns


def _entry(frame: int) -> int | None:
    return _handler(frame)


def _entry_eager(frame: int) -> int | None:
    return _handler(frame, 0)


@contextlib.contextmanager
def recording(trace: bool = False) -> Iterator[HandlerStats]:
    """Count the handler's calls and their host time inside the block (an opt-in for
    benchmarks and diagnostics: outside it the handler counts nothing)."""
    global _stats
    previous, _stats = _stats, HandlerStats(trace=[] if trace else None)
    try:
        yield _stats
    finally:
        _stats = previous


_handler_fns = {TARGET_NAME: _HANDLER_FN(_entry), EAGER_TARGET_NAME: _HANDLER_FN(_entry_eager)}
_registered = False
_register_lock = threading.Lock()


def ensure_registered() -> None:
    """Register the CUDA targets with XLA, once: at import, so that a program holding the
    custom call runs in any process that imported jax_epilog, one deserialized by
    ``jax.export`` included. Touches neither the GPU nor nvmath-python: XLA holds the
    registration until its CUDA backend starts, and the handler imports nvmath at its
    first call."""
    global _registered
    with _register_lock:
        if _registered:
            return
        capsule_new = ctypes.pythonapi.PyCapsule_New
        capsule_new.restype = ctypes.py_object
        capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        for name, fn in _handler_fns.items():
            address = ctypes.cast(fn, ctypes.c_void_p).value
            jax.ffi.register_ffi_target(name, capsule_new(address, None, None), platform="CUDA")
        _registered = True
