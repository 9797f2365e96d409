"""The only module that imports nvmath-python: planning, the plan cache and the GEMM launch.

A plan is an nvmath ``Matmul`` planned once per (problem, device, pointer alignment). Its
cuBLASLt descriptors, layouts and chosen algorithm are reused by ``Plan.run``, which does
only what a steady-state call must: point the descriptor at this call's bias and aux
buffers and launch ``cublasLtMatmul`` on the caller's stream with the caller's buffers (or
replay a captured graph of it: ``replay``). In the steady state ``run`` allocates and
synchronises nothing, and under CUDA-graph capture it only calls ``cublasLtMatmul``.

``Plan.run`` reaches below nvmath's public API (``Matmul.execute`` validates operands and
allocates per call, which costs tens of µs of host time). The private attributes it needs
are listed in ``_MATMUL_INTERNALS`` and checked when a plan is made, so an nvmath release
that renames them fails loudly, at planning, with a message that says so.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import cupy as cp
import numpy as np
import nvmath
from cuda.bindings import runtime as cudart

try:
    from cuda.core import Device as _CoreDevice
except ImportError:  # cuda-core before 0.4
    from cuda.core.experimental import Device as _CoreDevice
from nvmath.bindings import cublas, cublasLt
from nvmath.internal.typemaps import NAME_TO_DATA_TYPE
from nvmath.linalg._internal import matmul_pref_ifc
from nvmath.linalg._internal.matmul_desc_ifc import MatmulDescInterface
from nvmath.linalg.advanced import Matmul, MatmulComputeType, MatmulEpilog, MatmulOptions

from .._epilogs import EpilogSpec
from .._fp8_spec import Fp8Spec
from .._policy import get_policy
from . import operands, tuning
from .replay import Replayer

__all__ = ["NVMATH_VERSION", "Plan", "PlanningError", "alignment_of", "current_device", "get_plan", "plans"]

NVMATH_VERSION = nvmath.__version__

# nvmath Matmul internals that Plan relies on (nvmath-python 1.0).
_MATMUL_INTERNALS = (
    "mm_desc",
    "a_layout_ptr",
    "b_layout_ptr",
    "c_layout_ptr",
    "d_layout_ptr",
    "alpha",
    "beta",
)
# The operand alignments a plan can promise cuBLASLt, best first: XLA guarantees 16 bytes
# and usually gives 256.
_ALIGNMENTS = (256, 16)
_ATTR = cublasLt.MatmulDescAttribute
# The pointers a call sets in the descriptor, after A, B and D, in Plan.run's order.
_POINTER_ATTRS = (_ATTR.BIAS_POINTER, _ATTR.EPILOGUE_AUX_POINTER)
_FP8_POINTERS = {  # an FP8 call's buffers by Fp8Spec name: where each goes
    "q_scale": _ATTR.A_SCALE_POINTER,
    "p_scale": _ATTR.B_SCALE_POINTER,
    "d_scale": _ATTR.D_SCALE_POINTER,
    "bias": _ATTR.BIAS_POINTER,
    "dbias": _ATTR.BIAS_POINTER,
    "aux": _ATTR.EPILOGUE_AUX_POINTER,
    "amax": _ATTR.AMAX_D_POINTER,
}


class PlanningError(RuntimeError):
    """cuBLASLt cannot run this problem (no algorithm, or an unsupported combination)."""


def _check(err) -> None:
    status = err[0] if isinstance(err, tuple) else err
    if status != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA runtime error {status!r}")


def current_device() -> int:
    return cp.cuda.runtime.getDevice()


def device_of(ptr: int) -> int:
    """The CUDA device that owns a device pointer."""
    err, attrs = cudart.cudaPointerGetAttributes(ptr)
    _check(err)
    return int(attrs.device)


def alignment_of(*ptrs: int) -> int:
    """The largest plan alignment that all non-null pointers satisfy (0: none does)."""
    combined = 0
    for p in ptrs:
        combined |= p
    return next((alignment for alignment in _ALIGNMENTS if combined % alignment == 0), 0)


@contextlib.contextmanager
def _relaxed_capture():
    """Allow allocations while this thread may be capturing a CUDA graph: a plan for a new
    device or alignment is made inside the FFI handler, which XLA may call while capturing
    a command buffer. Planning enqueues no work on the captured stream."""
    err, previous = cudart.cudaThreadExchangeStreamCaptureMode(
        cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
    )
    _check(err)
    try:
        yield
    finally:
        cudart.cudaThreadExchangeStreamCaptureMode(previous)


_handles: dict[int, int] = {}


def _handle(device_id: int) -> int:
    """One cuBLASLt handle per device for the life of the process (nvmath's own handles are
    per thread and die with their thread; the FFI handler runs on XLA's threads)."""
    if device_id not in _handles:
        with cp.cuda.Device(device_id):
            _handles[device_id] = cublasLt.create()
    return _handles[device_id]


def _fp8_matmul(spec: Fp8Spec, device_id: int) -> _Fp8Matmul:
    capability = int(cp.cuda.Device(device_id).compute_capability)
    if capability < 89:  # one message for every problem: one warning
        raise PlanningError(
            f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper, Blackwell); this GPU "
            f"has {capability // 10}.{capability % 10}: FP8 layers run emulated in XLA (float32 GEMMs)"
        )
    with cp.cuda.Device(device_id):
        _CoreDevice(device_id).set_current()
        try:
            return _Fp8Matmul(spec, device_id)
        except Exception as exc:
            raise PlanningError(f"cuBLASLt cannot describe {spec}: {exc}") from exc


def _planned_matmul(spec: EpilogSpec, device_id: int, alignment: int, handle: int) -> Matmul:
    """nvmath's Matmul for ``spec``, planned with its epilog on views of the right layout.

    cuda.core wants each thread to mark the device current once before nvmath plans there;
    the FFI handler may plan on a worker thread of XLA's that never did. The context made
    current is the device's primary one, which XLA uses too.
    """
    a, b, c, epilog_inputs = operands.planning_views(spec, device_id, alignment)
    options = MatmulOptions(compute_type=MatmulComputeType[spec.compute_type], handle=handle)
    epilog = None if spec.epilog == "DEFAULT" else MatmulEpilog[spec.epilog]
    with cp.cuda.Device(device_id):  # (restores the thread's device on exit)
        _CoreDevice(device_id).set_current()
        try:
            mm = Matmul(a, b, c=c, beta=0.0 if c is not None else None, options=options)
            mm.plan(epilog=epilog, epilog_inputs=epilog_inputs)
        except Exception as exc:  # nvmath raises several types for a refused problem
            raise PlanningError(f"cuBLASLt cannot plan {spec}: {exc}") from exc
    missing = [name for name in _MATMUL_INTERNALS if not hasattr(mm, name)]
    if missing:
        raise RuntimeError(
            f"nvmath-python {NVMATH_VERSION} no longer has Matmul.{missing}: jax_epilog's "
            "fast path (jax_epilog/cuda/plan.py) needs updating for this nvmath release."
        )
    return mm


class _Fp8Matmul:
    """The descriptor and layouts of one FP8 GEMM (``Fp8Spec``), made with cuBLASLt's own
    calls: nvmath's ``Matmul`` plans FP8 only on operands of packages that have FP8 dtypes,
    and XLA's buffers arrive as bare pointers. The pointer attributes point at a scratch
    allocation while the heuristics choose (they choose by which pointers are set), and at
    the call's buffers at every call."""

    def __init__(self, spec: Fp8Spec, device_id: int):
        dtype = lambda name: int(NAME_TO_DATA_TYPE[name])
        self.mm_desc = cublasLt.matmul_desc_create(int(MatmulComputeType.COMPUTE_32F), dtype("float32"))
        ifc = MatmulDescInterface(self.mm_desc)
        ifc.transa, ifc.transb = int(cublas.Operation.T), int(cublas.Operation.N)
        ifc.epilogue = int(cublasLt.Epilogue[spec.epilog])
        ifc.fast_accum = spec.fast_accum
        with cp.cuda.Device(device_id):
            self._scratch = cp.cuda.alloc(1024)
        for i, attribute in enumerate(pointer_attributes(spec)):
            setattr(ifc, attribute.name.lower(), self._scratch.ptr + 64 * i)
        if spec.bias_dtype:
            ifc.bias_data_type = dtype(spec.bias_dtype)
        if spec.aux_out or spec.aux_in:
            ifc.epilogue_aux_ld = spec.aux_ld
            if spec.aux_dtype:
                ifc.epilogue_aux_data_type = dtype(spec.aux_dtype)
        # C is never read (beta = 0) but must have a 16-bit type beside an FP8 D.
        c_dtype = "bfloat16" if spec.d_fp8 else spec.d_dtype
        m, n, k = spec.m, spec.n, spec.k
        self.a_layout_ptr = cublasLt.matrix_layout_create(dtype(spec.q_dtype), k, n, k)
        self.b_layout_ptr = cublasLt.matrix_layout_create(dtype(spec.p_dtype), k, m, k)
        self.c_layout_ptr = cublasLt.matrix_layout_create(dtype(c_dtype), n, m, n)
        self.d_layout_ptr = cublasLt.matrix_layout_create(dtype(spec.d_dtype), n, m, n)
        self.alpha, self.beta = np.ones(1, np.float32), np.zeros(1, np.float32)

    def __del__(self):
        for name in ("a_layout_ptr", "b_layout_ptr", "c_layout_ptr", "d_layout_ptr"):
            if getattr(self, name, None):
                cublasLt.matrix_layout_destroy(getattr(self, name))
        if getattr(self, "mm_desc", None):
            cublasLt.matmul_desc_destroy(self.mm_desc)


def pointer_attributes(spec) -> tuple:
    """The descriptor attributes a call of ``spec`` points at its buffers, in the order of
    ``Plan.run``'s pointers after (a, b, d)."""
    if spec.problem != "fp8":
        return _POINTER_ATTRS
    return tuple(_FP8_POINTERS[name] for name in (*spec.operands(), *spec.results())[2:] if name != "d")


class Plan:
    """A planned fused GEMM for one problem, device and pointer alignment."""

    def __init__(self, spec: EpilogSpec, device_id: int, alignment: int, autotune: bool = False, choice=None):
        """``autotune``: time cuBLASLt's best few algorithms and keep the fastest; else
        heuristic candidate ``choice`` (another plan's tuned choice), else its first."""
        if spec.members > 1 and spec.problem != "forward":
            raise PlanningError(f"only forward problems batch over members: {spec}")
        self.spec, self.device_id, self.alignment, self.problem = spec, device_id, alignment, spec.problem
        self._handle = _handle(device_id)
        if spec.problem == "fp8":
            self._mm = _fp8_matmul(spec, device_id)
        else:
            self._mm = _planned_matmul(spec, device_id, alignment, self._handle)  # owns the descriptors
        mm = self._mm
        self._desc = mm.mm_desc
        self._layouts = (mm.a_layout_ptr, mm.b_layout_ptr, mm.c_layout_ptr, mm.d_layout_ptr)
        self._alpha, self._beta = mm.alpha.ctypes.data, mm.beta.ctypes.data
        self._attrs = [int(a) for a in pointer_attributes(spec)]
        # C is never read (beta = 0). Beside an FP8 D it has another type (the bias's), and
        # cuBLASLt refuses C = D there: C is then null.
        self._c_is_d = not getattr(spec, "d_fp8", False)
        self._ptr_buf = np.zeros(len(self._attrs), dtype=np.uint64)  # the pointers cuBLASLt reads
        self._last = [None] * len(self._attrs)
        self._lock = threading.Lock()
        self.tuning: list[float] | None = None  # µs per candidate, when autotuned
        self._choose(autotune, choice)
        self._replayer = Replayer(device_id, self._issue, self._lock)

    def _choose(self, autotune: bool, choice: int | None) -> None:
        count = get_policy().tuning_candidates if autotune or choice is not None else 1
        self._heuristic = heuristic = self._candidates(count)
        best = choice if choice is not None and choice < len(heuristic) else 0
        if autotune:
            workspace = int(np.max(heuristic["workspace_size"])) + 16  # one workspace for every candidate
            self.tuning = tuning.time_candidates(self, len(heuristic), workspace)
            self._last = [None] * len(self._attrs)  # the descriptor pointed at scratch buffers
            best = int(np.argmin(self.tuning))
            if not np.isfinite(self.tuning[best]):  # planned, then refused at every launch
                raise PlanningError(
                    f"cuBLASLt refused to run each of its {len(heuristic)} algorithms for {self.spec}"
                )
        self.choice = best  # the heuristic candidate this plan runs
        # cuBLASLt reads the algorithm struct at every call: keep the object that owns it.
        self._algo_struct = heuristic[best]["algo"]
        self._algo = self._algo_struct.ctypes.data
        ws_size = int(np.max(heuristic[best]["workspace_size"]))
        if ws_size and self.spec.epilog != "DEFAULT":
            ws_size += 16  # as nvmath does: cuBLASLt epilogs may write past the stated size
        with cp.cuda.Device(self.device_id):
            self._workspace = cp.cuda.alloc(ws_size) if ws_size else None
        self._ws_ptr, self._ws_size = (self._workspace.ptr if ws_size else 0), ws_size

    def _candidates(self, count: int):
        """cuBLASLt's ``count`` best heuristic algorithms for operands aligned to
        ``self.alignment`` bytes (at least one, or PlanningError).

        nvmath leaves D's alignment preference at cuBLASLt's default (256 bytes); XLA's
        buffers are only guaranteed 16, so every operand's alignment is stated here.
        Split-K partial sums stay in the compute type unless the policy allows otherwise:
        reducing them in D's type can cost half an ulp of the partial sums.
        """
        policy = get_policy()
        schemes = (
            cublasLt.ReductionScheme.MASK
            if policy.splitk_any_reduction
            else cublasLt.ReductionScheme.COMPUTE_TYPE
        )
        pref = cublasLt.matmul_preference_create()
        try:
            ifc = matmul_pref_ifc.MatmulPreferenceInterface(pref)
            ifc.max_workspace_bytes = policy.heuristic_workspace
            ifc.reduction_scheme_mask = int(schemes)
            for operand in "abcd":
                setattr(ifc, f"min_alignment_{operand}_bytes", self.alignment)
            result = cublasLt.MatmulHeuristicResult(count)
            found = np.zeros(1, dtype=np.int32)
            cublasLt.matmul_algo_get_heuristic(
                self._handle, self._desc, *self._layouts, pref, count, result.ptr, found.ctypes.data
            )
        except Exception as exc:
            raise PlanningError(f"cuBLASLt heuristics failed for {self.spec}: {exc}") from exc
        finally:
            cublasLt.matmul_preference_destroy(pref)
        if found[0] < 1:
            raise PlanningError(f"cuBLASLt found no algorithm for {self.spec}")
        return result[: found[0]]

    def run(self, stream: int, a: int, b: int, d: int, *pointers: int) -> None:
        """One fused GEMM on ``stream``: A and B are inputs, D an output, and ``pointers``
        those of ``pointer_attributes(spec)`` (0: unchanged). For EpilogSpec problems they
        are (bias, aux): the bias (forward) or the dbias output (wgrad), and the aux, an
        output (forward) or dgrad's input."""
        if not self._replayer.launch((stream, a, b, d, *pointers)):
            with self._lock:
                self._issue(stream, a, b, d, *pointers)

    def launch_candidate(self, index: int, stream: int, pointers, ws_ptr: int, ws_size: int) -> None:
        """Heuristic candidate ``index`` on ``pointers`` = (a, b, d, *the rest) (autotuning)."""
        with self._lock:
            self._issue(
                stream,
                *pointers,
                algo=self._heuristic[index]["algo"].ctypes.data,
                workspace=(ws_ptr, ws_size),
            )

    def _issue(self, stream, a, b, d, *pointers, algo=None, workspace=None) -> None:
        """``cublasLtMatmul`` with this call's pointers (the caller holds the lock: the
        descriptor is shared)."""
        for slot, pointer in enumerate(pointers):
            if pointer and pointer != self._last[slot]:
                self._set_pointer(slot, self._attrs[slot], pointer)
        a_layout, b_layout, c_layout, d_layout = self._layouts
        ws_ptr, ws_size = workspace or (self._ws_ptr, self._ws_size)
        cublasLt.matmul(
            self._handle, self._desc, self._alpha, a, a_layout, b, b_layout,
            self._beta, d if self._c_is_d else 0, c_layout, d, d_layout, algo or self._algo, ws_ptr,
            ws_size, stream,
        )  # fmt: skip

    def _set_pointer(self, slot: int, attribute: int, value: int) -> None:
        self._ptr_buf[slot] = value
        cublasLt.matmul_desc_set_attribute(self._desc, attribute, self._ptr_buf.ctypes.data + 8 * slot, 8)
        self._last[slot] = value

    @property
    def replay_stats(self) -> tuple[int, int, bool]:
        """(graphs kept, graphs dropped to make room, whether the plan still replays)."""
        return self._replayer.stats


_plans: dict[tuple[EpilogSpec, int, int], Plan] = {}
_plans_lock = threading.Lock()
# The tuner's choice per problem, alignment and GPU model. Plans made without tuning take
# it (those the FFI handler makes for the other devices of a multi-GPU program), so that no
# device runs a slower algorithm than the rest, which would all wait for it.
_tuned: dict[tuple[EpilogSpec, int, str], int] = {}


@functools.cache
def _model(device_id: int) -> str:
    return str(cp.cuda.runtime.getDeviceProperties(device_id)["name"])


def get_plan(spec: EpilogSpec, device_id: int, alignment: int = 256, autotune: bool = False) -> Plan:
    """The cached plan, made on first use (raises PlanningError if cuBLASLt refuses).

    ``autotune`` (at lowering only, never inside the FFI handler, which XLA may call while
    capturing a CUDA graph): time the candidates, unless ``Policy.autotune`` is off.
    """
    key = (spec, device_id, alignment)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    with _plans_lock, _relaxed_capture():
        plan = _plans.get(key)
        if plan is None:
            tune = autotune and get_policy().autotune
            tuned_key = (spec, alignment, _model(device_id))
            plan = _plans[key] = Plan(
                spec, device_id, alignment, autotune=tune, choice=None if tune else _tuned.get(tuned_key)
            )
            if plan.tuning is not None:
                _tuned[tuned_key] = plan.choice
    return plan


def plans() -> list[Plan]:
    """Every plan made in this process (for benchmarks and diagnostics)."""
    return list(_plans.values())
