"""``jax_epilog.cuda.ffi``: the FFI handler, fed call frames built by hand (CPU; no XLA, no
GPU, no nvmath), the custom call's attributes, the FFI API version check, ``prepare`` and
the opt-in ``recording``. The GPU-marked tests at the end run the handler under XLA.

The frames follow XLA's FFI C API (xla/ffi/api/c_api.h) as ``ffi`` reads it; every branch
of the handler runs here: the metadata query, the fast path, decoding a problem from the
attributes alone, "wgrad"'s output bias, "dgrad"'s input aux, and errors returned to XLA
instead of raised.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
import textwrap
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_python

import jax_epilog
from jax_epilog import fused_dense, fused_mlp
from jax_epilog._epilogs import EpilogSpec
from jax_epilog.cuda import ffi

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
    """One XLA_FFI_Api table of a given API version, for every frame, as XLA has one: the
    handler binds a table's functions once, by its address (a table per frame, freed with
    it, could come back at an address the handler has bound to functions since freed).
    Each call reaches the frame being run."""

    def __init__(self, version, stream_error=0):
        self.frame = None

        def stream_get(p):
            self.frame.stream_calls += 1
            ctypes.c_uint64.from_address(p + 24).value = _STREAM  # Stream_Get_Args.stream
            return stream_error  # (an XLA_FFI_Error*: NULL for success)

        def error_create(p):
            message = ctypes.c_char_p.from_address(p + 16).value.decode()
            self.frame.errors.append(message)
            return 0xE0000 + len(self.frame.errors)

        self._fns = (_API_FN(error_create), _API_FN(stream_get))
        fn = [ctypes.cast(f, ctypes.c_void_p).value for f in self._fns]
        major, minor = version
        # XLA_FFI_Api: struct_size, ext, api_version {struct_size, ext, major | minor << 32},
        # internal_api, Error_Create, Error_GetMessage, Error_Destroy, Handler_Register, Stream_Get.
        self._table = _words(88, 0, 24, 0, major | minor << 32, 0, fn[0], 0, 0, 0, fn[1])
        self.address = ctypes.addressof(self._table)


_API = _Api((0, 1))
_API_0_3 = _Api((0, 3))  # a later minor version: the same layout
_API_1_0 = _Api((1, 0))  # a major version this decoding does not fit
_API_NO_STREAM = _Api((0, 1), stream_error=0xBAD)  # whose XLA_FFI_Stream_Get fails


class Frame:
    """An XLA_FFI_CallFrame and everything it points to (kept alive by this object)."""

    def __init__(self, args, rets, attrs, *, stage=_EXECUTE, extension=0, api=_API, size=176):
        self._keep = []
        self.errors: list[str] = []
        self.stream_calls = 0
        self.api = api
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
            size, extension, api.address if api else 0, 0xC7C, stage,
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
        if self.api:
            self.api.frame = self
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


def _fake_plan_module(plans):
    """What the handler needs of ``cuda.plan``; each plan made is appended to ``plans``
    as (spec, device, alignment, plan). A plan of one row fails at every run."""

    def get_plan(spec, device, alignment):
        plan = FakePlan(spec, fail=spec.m == 1)
        plans.append((spec, device, alignment, plan))
        return plan

    return SimpleNamespace(get_plan=get_plan, device_of=lambda ptr: 0, alignment_of=_alignment_of)


@pytest.fixture
def handler():
    """A handler of its own, its plans made by ``_fake_plan_module`` (``handler.plans``)."""
    h = ffi._Handler()
    h.plans = []
    h._plan_module = _fake_plan_module(h.plans)
    return h


@pytest.fixture
def registered(monkeypatch):
    """The registered handler (the one ``_entry`` and ``recording`` reach), its state
    restored after the test; its plans as ``handler``'s."""
    h = ffi._handler
    for name in ("_apis", "_specs", "_plans"):
        monkeypatch.setattr(h, name, {})
    monkeypatch.setattr(h, "_key_index", None)
    monkeypatch.setattr(h, "plans", [], raising=False)
    monkeypatch.setattr(h, "_plan_module", _fake_plan_module(h.plans))
    return h


def _attrs(spec):
    """The custom call's attributes for ``spec``, as XLA hands them to the handler."""
    return {
        "_key": ffi._spec_key(spec), "m": spec.m, "n": spec.n, "k": spec.k, "epilog": spec.epilog,
        "compute_type": spec.compute_type, "ab_dtype": spec.ab_dtype, "bias_dtype": spec.bias_dtype or "",
        "d_dtype": spec.d_dtype, "problem": spec.problem, "members": spec.members, "shared": spec.shared,
    }  # fmt: skip


def _forward_frame(spec=FORWARD, x=0x10000, w=0x20000, b=0x30000, d=0x40000, aux=0x50000, **kw):
    return Frame([(_F16, x), (_F16, w), (_F32, b)], [(_F32, d), (_U8, aux)], _attrs(spec), **kw)


def _metadata_query(api=_API, extension_type=1):
    """A frame asking for the handler's metadata, and the metadata struct it fills in."""
    metadata = (ctypes.c_uint8 * 40)()
    ext = _words(
        32, extension_type, 0, ctypes.addressof(metadata)
    )  # {struct_size, METADATA, next, metadata*}
    frame = _forward_frame(extension=ctypes.addressof(ext), api=api)
    frame._keep += [metadata, ext]
    return frame, (ctypes.c_int32 * 10).from_buffer(metadata)


# ------------------------------------------------------------------------ the handler


def test_metadata_query_declares_api_0_1_and_the_command_buffer_trait(handler):
    frame, words = _metadata_query()
    assert frame(handler) is None
    assert (words[6], words[7], words[8]) == (0, 1, 1)  # major, minor, traits
    assert not handler.plans and frame.stream_calls == 0 and not frame.errors


def test_the_eager_entry_declares_no_trait(registered):
    """The second target (the same handler) keeps its calls out of XLA's command buffers."""
    frame, words = _metadata_query()
    assert frame(ffi._entry_eager) is None
    assert (words[6], words[7], words[8]) == (0, 1, 0)
    assert frame(ffi._entry) is None and words[8] == 1


def test_a_metadata_query_without_an_api_pointer_is_answered(handler):
    """XLA may query the metadata with no XLA_FFI_Api in the frame: answered all the same,
    and no API is bound."""
    frame, words = _metadata_query(api=None)
    assert frame(handler) is None
    assert (words[6], words[7], words[8]) == (0, 1, 1)
    assert handler.api_versions == [] and not handler.plans


def test_an_extension_of_another_type_is_left_alone(handler):
    frame, words = _metadata_query(extension_type=2)
    assert frame(handler) is None
    assert not any(words) and not handler.plans


def test_fast_path_plans_once_then_launches_with_xlas_pointers(handler):
    handler.remember(ffi._spec_key(FORWARD), FORWARD)
    frame = _forward_frame()
    assert frame(handler) is None
    assert frame(handler) is None
    [(spec, device, alignment, plan)] = handler.plans
    assert (spec, device, alignment) == (FORWARD, 0, 256)
    # run(stream, A = kernel, B = x, D, bias, aux)
    assert plan.runs == [(_STREAM, 0x20000, 0x10000, 0x40000, 0x30000, 0x50000)] * 2
    assert frame.stream_calls == 2 and not frame.errors
    assert handler.api_versions == [(0, 1)]


def test_other_alignment_or_stage(handler):
    handler.remember(ffi._spec_key(FORWARD), FORWARD)
    assert _forward_frame(stage=_INSTANTIATE)(handler) is None
    assert not handler.plans  # only the execute stage runs anything
    assert _forward_frame(x=0x10010)(handler) is None
    assert [p[2] for p in handler.plans] == [16]


def test_a_later_minor_api_version_is_served(handler):
    frame = _forward_frame(api=_API_0_3)
    assert frame(handler) is None, frame.errors
    assert len(handler.plans) == 1 and handler.api_versions == [(0, 3)]


@pytest.mark.parametrize("shared", ["x", "", "kernel,bias"])
def test_unknown_key_of_a_batched_forward_decodes_its_members(handler, shared):
    batched = MEMBERS._replace(shared=shared)
    frame = _forward_frame(batched)  # not remembered: as in a process that did not lower it
    assert frame(handler) is None, frame.errors
    [(spec, _, _, plan)] = handler.plans
    assert spec == batched and spec.members == 7
    assert [spec.is_shared(o) for o in ("x", "kernel", "bias")] == [
        o in shared.split(",") for o in ("x", "kernel", "bias")
    ]
    assert plan.runs == [(_STREAM, 0x20000, 0x10000, 0x40000, 0x30000, 0x50000)]


def test_wgrad_passes_the_second_result_as_the_bias_output(handler):
    frame = Frame([(_F16, 0x10000), (_F16, 0x20000)], [(_F32, 0x40000), (_F32, 0x60000)], _attrs(WGRAD))
    assert frame(handler) is None, frame.errors
    [(spec, _, _, plan)] = handler.plans
    assert spec == WGRAD
    assert plan.runs == [(_STREAM, 0x20000, 0x10000, 0x40000, 0x60000, 0)]


def test_dgrad_passes_the_third_operand_as_the_input_aux(handler):
    # (dz, kernel, aux) -> D, undecoded: the aux must not be taken for a bias
    frame = Frame([(_BF16, 0x10000), (_BF16, 0x20000), (_F32, 0x30000)], [(_F32, 0x40000)], _attrs(DGRAD))
    assert frame(handler) is None, frame.errors
    [(spec, _, _, plan)] = handler.plans
    assert spec == DGRAD and spec.bias_dtype is None
    assert plan.runs == [(_STREAM, 0x20000, 0x10000, 0x40000, 0, 0x30000)]


def test_failures_are_returned_to_xla_as_errors(handler):
    bad = FORWARD._replace(m=1)  # FakePlan.run raises for it
    frame = _forward_frame(bad)
    assert frame(handler) == 0xE0001
    assert frame.errors == ["jax_epilog: fused matmul failed: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED"]

    attrs = _attrs(FORWARD) | {"m": 34}  # the attributes disagree with the key
    frame = Frame([(_F16, 0x10000), (_F16, 0x20000), (_F32, 0x30000)], [(_F32, 0x40000), (_U8, 0)], attrs)
    assert frame(handler) == 0xE0001
    assert "does not match its key" in frame.errors[0]

    handler.remember(ffi._spec_key(FORWARD), FORWARD)
    frame = _forward_frame(x=0x10004)  # XLA promises 16 bytes
    assert frame(handler) == 0xE0001
    assert "not 16-byte aligned" in frame.errors[0]

    frame = _forward_frame(size=160)  # a frame that ends before the fields read
    assert frame(handler) == 0xE0001
    assert frame.errors == ["jax_epilog: a call frame of 160 bytes is too small"]


def test_a_stream_xla_cannot_give_is_an_error(handler):
    handler.remember(ffi._spec_key(FORWARD), FORWARD)
    frame = _forward_frame(api=_API_NO_STREAM)
    assert frame(handler) == 0xE0001
    assert frame.errors == ["jax_epilog: fused matmul failed: RuntimeError: XLA_FFI_Stream_Get failed"]
    assert not handler.plans


def test_a_frame_with_no_api_to_report_with_returns_without_raising(handler):
    """An execute call with no XLA_FFI_Api (and none bound before) has no way to create an
    error: the handler returns NULL rather than raise into XLA."""
    assert _forward_frame(api=None)(handler) is None
    assert not handler.plans


def test_a_call_without_a_key_attribute_is_an_error(handler):
    attrs = {name: value for name, value in _attrs(FORWARD).items() if name != "_key"}
    frame = Frame([(_F16, 0x10000), (_F16, 0x20000), (_F32, 0x30000)], [(_F32, 0x40000), (_U8, 0)], attrs)
    assert frame(handler) == 0xE0001
    assert "has no '_key' attribute" in frame.errors[0] and not handler.plans


def test_the_handler_imports_the_plan_module_at_its_first_call(monkeypatch):
    """Registration (at import) needs neither nvmath nor cupy: the handler imports
    ``cuda.plan`` when XLA first calls it, and an import failure there is an error
    returned to XLA, not a crash."""
    monkeypatch.delattr(jax_epilog.cuda, "plan", raising=False)
    monkeypatch.setitem(sys.modules, "jax_epilog.cuda.plan", None)  # as without nvmath-python
    handler = ffi._Handler()
    frame = _forward_frame()
    assert frame(handler) == 0xE0001
    assert frame.errors[0].startswith("jax_epilog: fused matmul failed: ModuleNotFoundError")

    plans = []
    fake = _fake_plan_module(plans)
    monkeypatch.setitem(sys.modules, "jax_epilog.cuda.plan", fake)
    assert _forward_frame()(handler) is None
    assert [spec for spec, *_ in plans] == [FORWARD] and handler._plan_module is fake


def test_importing_registers_the_target_without_nvmath_or_the_gpu():
    """A fresh interpreter: ``import jax_epilog`` registers the custom call's handler (so a
    deserialized program can run) and imports neither nvmath-python nor cupy (nor
    ``cuda.plan``), nor starts a JAX backend."""
    code = (
        "import sys, jax_epilog\n"
        "from jax._src import xla_bridge\n"
        "assert jax_epilog.cuda.ffi._registered\n"
        "assert not {'nvmath', 'cupy', 'jax_epilog.cuda.plan'} & set(sys.modules), sorted(sys.modules)\n"
        "assert not xla_bridge._backends, xla_bridge._backends\n"
    )
    done = run_python(code, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def test_registration_happens_once(monkeypatch):
    """Importing jax_epilog registered the target; registering again asks XLA for nothing."""
    asked = []
    monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda *args, **kwargs: asked.append(args))
    assert ffi._registered
    ffi.ensure_registered()
    assert not asked


def test_a_problems_key_is_stable_across_processes():
    """The key names a problem in an exported program: a digest of the problem (not
    Python's salted ``hash``), the same in every process; every field changes it."""
    assert ffi._spec_key(FORWARD) == 5638054714419830801
    keys = {ffi._spec_key(spec) for spec in (FORWARD, MEMBERS, MEMBERS._replace(shared=""), WGRAD, DGRAD)}
    assert len(keys) == 5 and all(0 <= key < 2**63 for key in keys)


# ------------------------------------------------------- the custom call's attributes


def _lowered_calls(monkeypatch, f, *args):
    """[(EpilogSpec, attributes)] of every custom call of ``f`` lowered for "cuda" (cuBLASLt
    accepting every problem), each attribute as the handler decodes it (str or int)."""
    specs = []
    monkeypatch.setattr(ffi, "prepare", lambda spec: None)
    call = ffi.call
    monkeypatch.setattr(
        ffi, "call", lambda operands, results, spec: specs.append(spec) or call(operands, results, spec)
    )
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    found = re.findall(rf"custom_call @{ffi.TARGET_NAME}\(.*mhlo.backend_config = \{{([^}}]*)\}}", text)
    attributes = []
    for config in found:
        pairs = (item.split(" = ", 1) for item in config.split(", "))
        attributes.append({n: v[1:-1] if v.startswith('"') else int(v.split(" : ")[0]) for n, v in pairs})
    assert len(attributes) == len(specs), text
    return list(zip(specs, attributes, strict=True))


def test_the_custom_calls_attributes_carry_the_whole_problem(monkeypatch, handler):
    """Every problem the lowerings emit (a forward with a float32 bias and its BGRADA
    weight gradient, a forward without bias, fused_mlp's DGELU, an ensemble's batched
    forward) carries each EpilogSpec field as an attribute (``bias_dtype`` "" for None),
    plus ``_key``; a frame with those attributes, for a problem the handler never saw,
    decodes to the same EpilogSpec."""
    h = jnp.ones((33, 40), jnp.float16)
    w, b, w2 = jnp.ones((40, 24), jnp.float16), jnp.ones((24,), jnp.float32), jnp.ones((24, 9), jnp.float16)

    def program(h, w, b, w2):
        dense = fused_dense(h, w, b, activation="gelu", implementation="cublaslt")
        linked = fused_mlp(h, [(w, None), (w2, None)], ["gelu", "relu"], implementation="cublaslt")
        members = jax.vmap(lambda w: fused_dense(h, w, activation="relu", implementation="cublaslt"))(
            jnp.stack([w, -w])
        )
        return (
            jnp.sum(dense.astype(jnp.float32))
            + jnp.sum(linked.astype(jnp.float32))
            + jnp.sum(members.astype(jnp.float32))
        )

    calls = _lowered_calls(monkeypatch, jax.grad(program, argnums=(0, 1, 2, 3)), h, w, b, w2)
    problems = {(spec.problem, spec.epilog, spec.bias_dtype, spec.members) for spec, _ in calls}
    assert {
        ("forward", "GELU_AUX_BIAS", "float32", 1), ("wgrad", "BGRADA", "float32", 1), ("forward", "GELU_AUX", None, 1),
        ("dgrad", "DGELU", None, 1), ("forward", "RELU_AUX", None, 2),
    } <= problems, problems  # fmt: skip
    for spec, attributes in calls:
        assert attributes == _attrs(spec)
        frame = Frame(
            [(_F16, 0x10000), (_F16, 0x20000), (_F32, 0x30000)], [(_F32, 0x40000), (_U8, 0x50000)], attributes
        )
        assert frame(handler) is None, frame.errors
        assert handler.plans[-1][0] == spec


def test_a_call_takes_exactly_the_buffers_its_problem_reads_and_writes():
    """``call`` checks the buffers' sizes against the problem while lowering (the handler
    checks none at run time): a kernel one column short is a bug, named."""
    x, w = jax.ShapeDtypeStruct((33, 129), jnp.float16), jax.ShapeDtypeStruct((129, 64), jnp.float16)
    results = [jax.ShapeDtypeStruct((33, 65), jnp.float32), jax.ShapeDtypeStruct((33, 16), jnp.uint8)]
    with pytest.raises(RuntimeError, match=r"jax_epilog bug: .* given operands of \[4257, 8256\] elements"):
        jax.jit(
            lambda x, w: ffi.call((x, w), results, FORWARD._replace(bias_dtype=None, epilog="RELU_AUX"))
        ).trace(x, w)


def test_export_refuses_the_custom_call_unless_export_checks_allow_it(monkeypatch):
    """jax.export guards against custom calls without compatibility guarantees: exporting
    a fused program for "cuda" raises, naming our target, unless ``EXPORT_CHECKS`` is
    passed; the exported module then holds the fused calls of the forward and of its
    gradient, also after a round trip through its serialization (running one elsewhere:
    the GPU test below)."""
    monkeypatch.setattr(ffi, "prepare", lambda spec: None)
    x, w, b = (
        jnp.ones((33, 129), jnp.bfloat16),
        jnp.ones((129, 65), jnp.bfloat16),
        jnp.ones((65,), jnp.bfloat16),
    )
    forward = jax.jit(functools.partial(fused_dense, activation="gelu", implementation="cublaslt"))
    grad = jax.jit(jax.grad(lambda *a: forward(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    with pytest.raises(ValueError, match=ffi.TARGET_NAME):
        jax.export.export(forward, platforms=("cuda",))(x, w, b)
    assert jax_epilog.EXPORT_CHECKS is ffi.EXPORT_CHECKS
    for f, count in ((forward, 1), (grad, 2)):  # the grad's forward and BGRADA GEMM
        exported = jax.export.export(f, platforms=("cuda",), disabled_checks=jax_epilog.EXPORT_CHECKS)(
            x, w, b
        )
        loaded = jax.export.deserialize(exported.serialize())  # (needs flatbuffers: the test extra)
        assert loaded.mlir_module().count(f"@{ffi.TARGET_NAME}(") == count and loaded.platforms == ("cuda",)


# ------------------------------------------------------------ the FFI API version


def test_api_refusal_accepts_every_minor_version_of_major_0_from_0_1():
    assert ffi.api_refusal((0, 1)) is None and ffi.api_refusal((0, 3)) is None
    for version in ((1, 0), (0, 0)):
        refusal = ffi.api_refusal(version)
        assert f"version {version[0]}.{version[1]}" in refusal and "decodes 0.1 and later 0.x" in refusal


def test_an_api_of_another_major_version_refuses_lowering_and_execution(registered, monkeypatch):
    """XLA queries the handler's metadata with its API table: one of version 1.0 is
    answered (the query must not fail), but ``prepare`` then refuses every problem,
    naming the version (lowering takes XLA's path with a warning), and an execute call
    that reaches the handler anyway returns an FFI error, never raising, never NULL."""
    frame, words = _metadata_query(api=_API_1_0)
    assert ffi._entry(ctypes.addressof(frame.frame)) is None
    assert (words[6], words[7]) == (0, 1)
    assert registered.api_versions == [(1, 0)]
    refusal = ffi.prepare(FORWARD)
    assert refusal is not None and "XLA's FFI API is version 1.0" in refusal
    registered.remember(ffi._spec_key(FORWARD), FORWARD)
    frame = _forward_frame(api=_API_1_0)
    assert frame(ffi._entry) == 0xE0001
    assert frame.errors == [f"jax_epilog: {refusal}"] and not registered.plans


def test_prepare_names_what_keeps_the_gpu_path_from_a_problem(monkeypatch):
    """Without nvmath-python or cupy, every problem is refused, saying so; else a plan
    cuBLASLt refuses gives its reason, and a plan made gives None (the plan module being
    a fake here)."""
    monkeypatch.setattr(ffi._handler, "_apis", {})
    monkeypatch.delattr(jax_epilog.cuda, "plan", raising=False)
    monkeypatch.setitem(sys.modules, "jax_epilog.cuda.plan", None)
    assert ffi.prepare(FORWARD).startswith("nvmath-python/cupy are not importable")

    class PlanningError(RuntimeError):
        pass

    asked = []

    def get_plan(spec, device, autotune):
        asked.append((spec, device, autotune))
        if spec.m == 1:
            raise PlanningError(f"cuBLASLt cannot plan {spec}")
        return object()

    fake = SimpleNamespace(PlanningError=PlanningError, get_plan=get_plan, current_device=lambda: 3)
    monkeypatch.setitem(sys.modules, "jax_epilog.cuda.plan", fake)
    assert ffi.prepare(FORWARD) is None
    assert ffi.prepare(FORWARD._replace(m=1)) == f"cuBLASLt cannot plan {FORWARD._replace(m=1)}"
    assert asked == [(FORWARD, 3, True), (FORWARD._replace(m=1), 3, True)]  # at lowering: autotuned


# ---------------------------------------------------------------------- recording


def test_recording_counts_executions_and_their_host_time_only_inside_the_block(registered):
    registered.remember(ffi._spec_key(FORWARD), FORWARD)
    frame = _forward_frame()
    assert frame(ffi._entry) is None  # outside: nothing to count into
    assert ffi._stats is None
    with ffi.recording() as stats:
        for _ in range(3):
            assert frame(ffi._entry) is None
        assert _forward_frame(stage=_INSTANTIATE)(ffi._entry) is None  # not an execution
        assert _metadata_query()[0](ffi._entry) is None  # nor a metadata query
        assert _forward_frame(x=0x10010)(ffi._entry) is None  # a new alignment: a new plan
    assert (stats.calls, stats.plans_resolved, stats.trace) == (4, 1, None)
    assert stats.busy_ns > 0
    assert frame(ffi._entry) is None  # after the block: counted nowhere
    assert (stats.calls, stats.plans_resolved) == (4, 1) and ffi._stats is None
    assert len(registered.plans) == 2
    plan = registered.plans[0][3]
    assert len(plan.runs) == 5  # every execution ran, counted or not


def test_recording_with_trace_keeps_each_executions_timestamps(registered):
    registered.remember(ffi._spec_key(FORWARD), FORWARD)
    frame = _forward_frame()
    with ffi.recording(trace=True) as stats:
        for _ in range(3):
            assert frame(ffi._entry) is None
        assert _forward_frame(stage=_INSTANTIATE)(ffi._entry) is None
    assert stats.calls == 3 and len(stats.trace) == 3
    assert all(start <= end for start, end in stats.trace)
    assert all(a[1] <= b[0] for a, b in zip(stats.trace, stats.trace[1:]))
    assert stats.busy_ns == sum(end - start for start, end in stats.trace)


def test_recording_blocks_nest_and_restore_the_outer_one(registered):
    registered.remember(ffi._spec_key(FORWARD), FORWARD)
    frame = _forward_frame()
    with ffi.recording() as outer:
        frame(ffi._entry)
        with ffi.recording(trace=True) as inner:
            frame(ffi._entry)
        frame(ffi._entry)
    assert (outer.calls, inner.calls, len(inner.trace)) == (2, 1, 1)


# ------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_runtime_failure_becomes_a_python_error_not_a_crash(rng, monkeypatch):
    from jax_epilog.cuda import plan

    def broken_run(self, *args):
        raise RuntimeError("injected failure")

    x, w, b = (
        jnp.asarray(a, jnp.float16)
        for a in (rng.standard_normal((41, 67)), rng.standard_normal((67, 23)) / 8, rng.standard_normal(23))
    )
    f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu", implementation="cublaslt"))
    f(x, w, b).block_until_ready()  # plans it
    monkeypatch.setattr(plan.Plan, "run", broken_run)
    g = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu", implementation="cublaslt") + 1)
    with pytest.raises(Exception, match="injected failure"):
        g(x, w, b).block_until_ready()


_WORKER_THREAD_PLAN = """
import threading
import jax, jax.numpy as jnp, numpy as np
from jax_epilog import fused_dense
from jax_epilog.cuda import plan

rng = np.random.default_rng({seed})
x = jnp.asarray(rng.standard_normal((72, 40)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((40, 56)) / np.sqrt(40), jnp.bfloat16)
b = jnp.asarray(rng.standard_normal(56), jnp.bfloat16)
f = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu", implementation="cublaslt"))
f.lower(x, w, b)  # plans at lowering, on this thread
plan._plans.clear()  # so that the handler plans anew when the program runs
threads, get_plan = [], plan.get_plan
plan.get_plan = lambda *a, **k: threads.append(threading.current_thread()) or get_plan(*a, **k)
y = np.asarray(f(x, w, b), np.float64)
z = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
want = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
assert threads and threading.main_thread() not in threads, threads
assert np.abs(y - want).max() <= 3e-2 * max(1.0, np.abs(want).max()), np.abs(y - want).max()
print("planned on", [t.name for t in threads])
"""


@pytest.mark.gpu
def test_the_handler_plans_on_a_pjrt_worker_thread(rng):
    """With PjRt's asynchronous dispatch (PJRT_GPU_ENABLE_ASYNC_DISPATCH=1, read when the
    client starts: hence a fresh process) the FFI handler runs on a worker thread of XLA's;
    a plan it makes there (none cached for the device and alignment) must run: it once
    failed with cuda.core's "Device 0 is not yet initialized"."""
    code = _WORKER_THREAD_PLAN.format(seed=int(rng.integers(1 << 31)))
    env = {**os.environ, "PJRT_GPU_ENABLE_ASYNC_DISPATCH": "1"}
    done = run_python(textwrap.dedent(code), env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


_EXPORTED_CALL = """
import sys
import jax, jax.numpy as jnp, numpy as np
import jax_epilog
from jax_epilog.cuda import ffi

def arrays(name):
    with np.load(sys.argv[1] + "/" + name + ".npz") as f:
        return [f[f"arr_{{i}}"] for i in range(len(f.files))]

inputs = [jnp.asarray(a, jnp.bfloat16) for a in arrays("inputs")]  # (bfloat16 values, saved as float32)
with ffi.recording() as stats:
    for name in ("forward", "grad", "ensemble"):
        exported = jax.export.deserialize(open(sys.argv[1] + "/" + name + ".bin", "rb").read())
        got = [np.asarray(r, np.float32) for r in jax.tree.leaves(exported.call(*inputs))]
        for g, r in zip(got, arrays(name), strict=True):
            scale = max(1.0, float(np.abs(r).max()))
            assert np.abs(g - r).max() <= {tol} * scale, (name, float(np.abs(g - r).max()), scale)
# the forward, the grad's forward and BGRADA, and the ensemble's batched forward
assert stats.calls == 4 and stats.plans_resolved == 4, (stats.calls, stats.plans_resolved)
assert not sys.modules["jax_epilog.cuda.plan"]._tuned, "a plan was tuned: something was lowered here"
print("handler calls", stats.calls)
"""


@pytest.mark.gpu
def test_an_exported_program_runs_in_a_process_that_never_lowered_it(rng, tmp_path):
    """jax.export of a program holding the fused custom call (allowed by EXPORT_CHECKS),
    serialized, then deserialized and called in a fresh process that only imported
    jax_epilog: the handler, registered at import, decodes each problem from the call's
    attributes (an ensemble's members too) and plans it, and the results match this
    process's."""
    pytest.importorskip("flatbuffers", reason="jax.export's serialization needs flatbuffers")
    draw = lambda *shape: jnp.asarray(
        rng.standard_normal(shape) / np.sqrt(shape[0] if len(shape) == 2 else 1), jnp.bfloat16
    )
    x, w, b = jnp.asarray(rng.standard_normal((40, 24)), jnp.bfloat16), draw(24, 72), draw(72)
    forward = jax.jit(lambda x, w, b: fused_dense(x, w, b, activation="gelu", implementation="cublaslt"))
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))
    layer = functools.partial(fused_dense, activation="relu", implementation="cublaslt")
    members = lambda x, w, b: jax.vmap(layer, in_axes=(None, 0, 0))(
        x, jnp.stack([w, -w]), jnp.stack([b, b / 2])
    )
    ensemble = jax.jit(members)  # two members sharing x: one batched call
    with pytest.raises(ValueError, match=ffi.TARGET_NAME):
        jax.export.export(forward)(x, w, b)  # jax.export's safety check, unless told otherwise
    assert "members = 2" in ensemble.lower(x, w, b).as_text()
    for name, f in (("forward", forward), ("grad", grad), ("ensemble", ensemble)):
        exported = jax.export.export(f, disabled_checks=jax_epilog.EXPORT_CHECKS)(x, w, b)
        assert f"@{ffi.TARGET_NAME}(" in exported.mlir_module()
        (tmp_path / f"{name}.bin").write_bytes(exported.serialize())
        np.savez(tmp_path / f"{name}.npz", *(np.asarray(r, np.float32) for r in jax.tree.leaves(f(x, w, b))))
    np.savez(tmp_path / "inputs.npz", *(np.asarray(a, np.float32) for a in (x, w, b)))
    done = run_python(_EXPORTED_CALL.format(tol=3e-2), str(tmp_path))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
