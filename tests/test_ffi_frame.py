"""The FFI handler decoding a call frame built by hand (CPU; no XLA, no GPU, no nvmath).

The frame follows XLA's FFI C API 0.1 (xla/ffi/api/c_api.h) as ``jax_epilog._ffi`` reads
it. On a GPU, test_gpu.py checks the same decoding against XLA's real frames; here every
branch of the handler runs in CI: the metadata query, the fast path, the first-call
attribute decoding, "wgrad"'s output bias, "dgrad"'s input aux, and errors returned to XLA instead of raised.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest

from jax_epilog import _ffi
from jax_epilog._epilogs import EpilogSpec

_U8, _F16, _F32, _BF16 = 6, 10, 11, 16
_SCALAR, _STRING = 3, 4
_EXECUTE, _INSTANTIATE = 3, 1
_STREAM = 0x5EA000
_API_FN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)

FORWARD = EpilogSpec(33, 65, 129, "RELU_AUX_BIAS", "COMPUTE_32F", "float16", "float32", "float32")
WGRAD = EpilogSpec(33, 65, 129, "BGRADA", "COMPUTE_32F", "float16", "float32", "float32", "wgrad")
DGRAD = EpilogSpec(33, 65, 129, "DGELU", "COMPUTE_32F", "bfloat16", None, "float32", "dgrad")
MEMBERS = FORWARD._replace(members=7, shared="x")  # an ensemble's forward, x shared


def _words(*values):
    return (ctypes.c_uint64 * len(values))(*values)


class _Api:
    """One XLA_FFI_Api table for every frame, as XLA has one: the handler binds a table's
    functions once, by its address (a table per frame, freed with it, could come back at
    an address the handler has bound to functions since freed). Each call reaches the
    frame being run."""

    def __init__(self):
        self.frame = None

        def stream_get(p):
            self.frame.stream_calls += 1
            ctypes.c_uint64.from_address(p + 24).value = _STREAM  # Stream_Get_Args.stream

        def error_create(p):
            message = ctypes.c_char_p.from_address(p + 16).value.decode()
            self.frame.errors.append(message)
            return 0xE0000 + len(self.frame.errors)

        self._fns = (_API_FN(error_create), _API_FN(stream_get))
        fn = [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]
        # XLA_FFI_Api: struct_size, ext, api_version (3 words), internal_api, Error_Create,
        # Error_GetMessage, Error_Destroy, Handler_Register, Stream_Get.
        self._table = _words(88, 0, 0, 0, 0, 0, fn[0], 0, 0, 0, fn[1])
        self.address = ctypes.addressof(self._table)


_API = _Api()


class Frame:
    """An XLA_FFI_CallFrame and everything it points to (kept alive by this object)."""

    def __init__(self, args, rets, attrs, *, stage=_EXECUTE, extension=0):
        self._keep = []
        self.errors: list[str] = []
        self.stream_calls = 0
        api = _API.address
        args_ptrs = [self._buffer(dtype, data) for dtype, data in args]
        rets_ptrs = [self._buffer(dtype, data) for dtype, data in rets]
        names, values, types = [], [], []
        for name, value in sorted(attrs.items()):
            names.append(self._span(name.encode()))
            if isinstance(value, str):
                types.append(_STRING)
                values.append(self._span(value.encode()))
            else:
                types.append(_SCALAR)
                scalar = self._keep_addr(_words(value))
                values.append(self._keep_addr(_words(7, scalar)))  # {S64, value*}
        self.frame = _words(
            176, extension, api, 0xC7C, stage,
            40, 0, len(args_ptrs), 0, self._array(args_ptrs),
            40, 0, len(rets_ptrs), 0, self._array(rets_ptrs),
            48, 0, len(names), self._keep_addr((ctypes.c_int32 * max(len(types), 1))(*types)),
            self._array(names), self._array(values), 0,
        )  # fmt: skip

    def _keep_addr(self, obj) -> int:
        self._keep.append(obj)
        return ctypes.addressof(obj)

    def _array(self, ptrs) -> int:
        return self._keep_addr(_words(*ptrs, 0))

    def _span(self, data: bytes) -> int:
        buf = ctypes.create_string_buffer(data)
        return self._keep_addr(_words(self._keep_addr(buf), len(data)))

    def _buffer(self, dtype, data) -> int:
        return self._keep_addr(_words(48, 0, dtype, data, 1, 0))  # XLA_FFI_Buffer

    def __call__(self, handler) -> int | None:
        _API.frame = self
        return handler(ctypes.addressof(self.frame))


class FakePlan:
    def __init__(self, spec, fail=False):
        self.spec = spec
        self.problem = spec.problem
        self.runs = []
        self._fail = fail

    def run(self, *pointers):
        if self._fail:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        self.runs.append(pointers)


def _alignment_of(*ptrs):
    combined = 0
    for p in ptrs:
        combined |= p
    return 256 if combined % 256 == 0 else 16 if combined % 16 == 0 else 0


@pytest.fixture
def handler():
    h = _ffi._Handler()
    h.plans = []

    def get_plan(spec, device, alignment):
        plan = FakePlan(spec, fail=spec.m == 1)
        h.plans.append((spec, device, alignment, plan))
        return plan

    h._nvmath = SimpleNamespace(
        get_plan=get_plan,
        device_of=lambda ptr: 0,
        alignment_of=_alignment_of,
    )
    return h


def _attrs(spec):
    attrs = {
        "_key": _ffi.spec_key(spec), "problem": spec.problem, "epilog": spec.epilog,
        "compute_type": spec.compute_type, "m": spec.m, "n": spec.n, "k": spec.k,
    }  # fmt: skip
    if spec.members > 1:  # (as _ffi.call writes them: only for a batched problem)
        attrs |= {"members": spec.members, "shared": spec.shared}
    return attrs


def _forward_frame(spec=FORWARD, x=0x10000, w=0x20000, b=0x30000, d=0x40000, aux=0x50000, **kw):
    return Frame(
        [(_F16, x), (_F16, w), (_F32, b)],
        [(_F32, d), (_U8, aux)],
        _attrs(spec),
        **kw,
    )


def test_metadata_query_declares_api_0_1_and_the_command_buffer_trait(handler):
    metadata = (ctypes.c_uint8 * 40)()
    ext = _words(32, 1, 0, ctypes.addressof(metadata))  # {struct_size, METADATA, next, metadata*}
    frame = _forward_frame(extension=ctypes.addressof(ext))
    assert frame(handler) is None
    words = (ctypes.c_int32 * 10).from_buffer(metadata)
    assert (words[6], words[7], words[8]) == (0, 1, 1)  # major, minor, traits
    assert handler.calls == 0 and not handler.plans


def test_fast_path_plans_once_then_launches_with_xlas_pointers(handler):
    handler.remember(_ffi.spec_key(FORWARD), FORWARD)
    frame = _forward_frame()
    assert frame(handler) is None
    assert frame(handler) is None
    [(spec, device, alignment, plan)] = handler.plans
    assert (spec, device, alignment) == (FORWARD, 0, 256)
    # run(stream, A = kernel, B = x, bias, D, aux)
    assert plan.runs == [(_STREAM, 0x20000, 0x10000, 0x30000, 0x40000, 0x50000)] * 2
    assert frame.stream_calls == 2 and not frame.errors
    assert handler.calls == 2 and handler.resolved == 1


def test_other_alignment_or_stage(handler):
    handler.remember(_ffi.spec_key(FORWARD), FORWARD)
    assert _forward_frame(stage=_INSTANTIATE)(handler) is None
    assert not handler.plans  # only the execute stage runs anything
    assert _forward_frame(x=0x10010)(handler) is None
    assert [p[2] for p in handler.plans] == [16]


def test_unknown_key_decodes_the_attributes_and_buffer_dtypes(handler):
    frame = _forward_frame()  # not remembered: as in a process that did not lower it
    assert frame(handler) is None, frame.errors
    [(spec, *_)] = handler.plans
    assert spec == FORWARD


@pytest.mark.parametrize("shared", ["x", "", "kernel,bias"])
def test_unknown_key_of_a_batched_forward_decodes_its_members(handler, shared):
    batched = MEMBERS._replace(shared=shared)
    frame = _forward_frame(batched)
    assert frame(handler) is None, frame.errors
    [(spec, _, _, plan)] = handler.plans
    assert spec == batched and spec.members == 7
    assert [spec.is_shared(o) for o in ("x", "kernel", "bias")] == [o in shared.split(",") for o in ("x", "kernel", "bias")]
    assert plan.runs == [(_STREAM, 0x20000, 0x10000, 0x30000, 0x40000, 0x50000)]


def test_a_problem_without_members_keeps_the_key_it_had_before_members_existed():
    """Programs exported before EpilogSpec gained ``members`` and ``shared`` carry this key."""
    assert _ffi.spec_key(FORWARD) == 872219303829478802


def test_wgrad_passes_the_second_result_as_the_bias_output(handler):
    frame = Frame([(_F16, 0x10000), (_F16, 0x20000)], [(_F32, 0x40000), (_F32, 0x60000)], _attrs(WGRAD))
    assert frame(handler) is None, frame.errors
    [(spec, _, _, plan)] = handler.plans
    assert spec == WGRAD
    assert plan.runs == [(_STREAM, 0x20000, 0x10000, 0x60000, 0x40000, 0)]


def test_dgrad_passes_the_third_operand_as_the_input_aux(handler):
    # (dz, kernel, aux) -> D, undecoded: the aux must not be taken for a bias
    frame = Frame([(_BF16, 0x10000), (_BF16, 0x20000), (_F32, 0x30000)], [(_F32, 0x40000)], _attrs(DGRAD))
    assert frame(handler) is None, frame.errors
    [(spec, _, _, plan)] = handler.plans
    assert spec == DGRAD
    assert plan.runs == [(_STREAM, 0x20000, 0x10000, 0, 0x40000, 0x30000)]


def test_failures_are_returned_to_xla_as_errors(handler):
    bad = FORWARD._replace(m=1)  # FakePlan.run raises for it
    frame = _forward_frame(bad)
    assert frame(handler) == 0xE0001
    assert frame.errors == ["jax_epilog: fused matmul failed: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"]

    attrs = _attrs(FORWARD) | {"m": 34}  # the attributes disagree with the key
    frame = Frame([(_F16, 0x10000), (_F16, 0x20000), (_F32, 0x30000)], [(_F32, 0x40000), (_U8, 0)], attrs)
    assert frame(handler) == 0xE0001
    assert "does not match its key" in frame.errors[0]

    handler.remember(_ffi.spec_key(FORWARD), FORWARD)
    frame = _forward_frame(x=0x10004)  # XLA promises 16 bytes
    assert frame(handler) == 0xE0001
    assert "not 16-byte aligned" in frame.errors[0]


def test_the_handler_imports_nvmath_at_its_first_call(monkeypatch):
    """Registration (at import) needs no nvmath: the handler imports it when XLA first
    calls it, and an import failure there is an error returned to XLA, not a crash."""
    import sys

    import jax_epilog

    monkeypatch.delattr(jax_epilog, "_nvmath", raising=False)
    monkeypatch.setitem(sys.modules, "jax_epilog._nvmath", None)  # as without nvmath-python
    handler = _ffi._Handler()
    frame = _forward_frame()
    assert frame(handler) == 0xE0001
    assert frame.errors[0].startswith("jax_epilog: fused matmul failed: ModuleNotFoundError")

    plans = []
    fake = SimpleNamespace(
        alignment_of=lambda *ptrs: 256,
        device_of=lambda ptr: 0,
        get_plan=lambda spec, device, alignment: plans.append(spec) or FakePlan(spec),
    )
    monkeypatch.setitem(sys.modules, "jax_epilog._nvmath", fake)
    assert _forward_frame()(handler) is None
    assert plans == [FORWARD] and handler._nvmath is fake


def test_importing_registers_the_target_without_nvmath_or_the_gpu():
    """A fresh interpreter: ``import jax_epilog`` registers the custom call's handler (so a
    deserialized program can run) and imports neither nvmath-python nor cupy, nor starts
    a JAX backend."""
    import subprocess
    import sys

    code = (
        "import sys, jax_epilog\n"
        "from jax._src import xla_bridge\n"
        "assert jax_epilog._ffi._registered\n"
        "assert not {'nvmath', 'cupy', 'jax_epilog._nvmath'} & set(sys.modules), sorted(sys.modules)\n"
        "assert not xla_bridge._backends, xla_bridge._backends\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def _shapes(*shapes):
    return [SimpleNamespace(shape=shape) for shape in shapes]


def test_a_call_takes_exactly_the_buffers_its_problem_reads_and_writes():
    """``_ffi.call`` checks, while lowering, that each operand and result has the elements
    its problem's GEMM reads or writes (``buffer_elements``): the handler checks no size at
    run time, so any other buffer would be read or written out of bounds."""
    m, n, k = FORWARD.m, FORWARD.n, FORWARD.k
    fits = {  # (operands, results); ReLU's aux: round_up(65, 128) / 8 bytes; GELU's: round_up(129, 8)
        FORWARD: ([(m, k), (k, n), (n,)], [(m, n), (m, 16)]),
        FORWARD._replace(epilog="RELU", bias_dtype=None): ([(m, k), (k, n)], [(m, n)]),
        WGRAD: ([(m, k), (m, n)], [(k, n), (n,)]),
        DGRAD: ([(m, n), (k, n), (m, 136)], [(m, k)]),
        MEMBERS: ([(m, k), (7, k, n), (7, n)], [(7, m, n), (7, m, 16)]),
    }
    for spec, (operands, results) in fits.items():
        _ffi._check_buffers(_shapes(*operands), _shapes(*results), spec)
    misfits = [  # (spec, operands, results, the wrong role)
        (FORWARD, [(m, k), (k, n), (n,)], [(m, n), (m, 24)], "results"),  # an aux a row wider
        (FORWARD, [(m, k), (k, n)], [(m, n), (m, 16)], "operands"),  # the bias missing
        (FORWARD._replace(n=96), [(m, k), (k, 96), (96,)], [(m, 96), (m, 16)], None),  # fits: 96 bits pad to 128
        (FORWARD._replace(n=136), [(m, k), (k, 136), (136,)], [(m, 136), (m, 16)], "results"),  # 136 bits need 32 bytes
        (WGRAD, [(m, k), (m, n)], [(k, n)], "results"),  # the bias gradient missing
        (DGRAD, [(m, n), (k, n), (m, 160)], [(m, k)], "operands"),  # an aux padded past K's 8
        (MEMBERS, [(7, m, k), (7, k, n), (7, n)], [(7, m, n), (7, m, 16)], "operands"),  # x not shared
    ]
    for spec, operands, results, role in misfits:
        if role is None:
            _ffi._check_buffers(_shapes(*operands), _shapes(*results), spec)
            continue
        with pytest.raises(RuntimeError, match=f"given {role} of"):
            _ffi._check_buffers(_shapes(*operands), _shapes(*results), spec)
