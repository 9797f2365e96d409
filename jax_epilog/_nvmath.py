"""The only module that imports nvmath-python: planning, the plan cache and execution.

A plan is an nvmath ``Matmul`` planned once per (device, problem, pointer alignment). Its
cuBLASLt descriptors, layouts and chosen algorithm are then reused by ``Plan.run``, which
does only what a steady-state call must: point the descriptor at this call's bias and aux
buffers and launch ``cublasLtMatmul`` on the caller's stream with the caller's buffers, or,
for a stream and pointers it has seen before outside graph capture, launch the one-GEMM
CUDA graph it captured for them then (a cheaper launch). In the steady state ``run``
allocates nothing and synchronises nothing, and under CUDA-graph capture (XLA recording a
command buffer) it only calls ``cublasLtMatmul``.

``Plan.run`` reaches below nvmath's public API (``Matmul.execute`` validates operands and
allocates per call, which costs 30-60 µs of host time). The private attributes it needs
are listed in ``_MATMUL_INTERNALS`` and checked when a plan is made, so an nvmath release
that renames them fails loudly, at planning, with a message that says so.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from typing import Any

import cupy as cp
import ml_dtypes
import numpy as np
import nvmath
from cuda.bindings import runtime as cudart

try:
    from cuda.core import Device as _CoreDevice
except ImportError:  # cuda-core before 0.4
    from cuda.core.experimental import Device as _CoreDevice
from nvmath.bindings import cublasLt
from nvmath.linalg._internal import matmul_pref_ifc
from nvmath.linalg.advanced import Matmul, MatmulComputeType, MatmulEpilog, MatmulOptions

from ._epilogs import Activation, EpilogSpec, aux_padded_width, buffer_elements

__all__ = [
    "NVMATH_VERSION", "Plan", "PlanningError", "alignment_of", "current_device", "device_of", "fill_normal",
    "get_plan", "graph_us",
]  # fmt: skip

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
# and usually gives 256. (The planning views are offset to match, so nvmath's own
# heuristic query sees the same alignment as ours.)
_ALIGNMENTS = (256, 16)

# Autotuning: how many of cuBLASLt's heuristic candidates to time, and how: a warm-up of
# about _TUNING_WARM_US of GPU work (at most _TUNING_WARM_GRAPHS graphs), then two rounds
# over all candidates, the second in reverse order (a candidate's time is the mean of its
# two); per round, one CUDA graph of back-to-back runs, at least _TUNING_RUNS and enough for
# about _TUNING_GRAPH_US of work.
_CANDIDATES, _TUNING_RUNS, _TUNING_GRAPH_US = 16, 5, 200.0
_TUNING_WARM_US, _TUNING_WARM_GRAPHS = 100_000.0, 20
# What cuBLASLt's heuristic is asked for (Plan._choose_algorithm): split-K partial sums
# reduced in the compute type only, and at most this much workspace. A probe may widen
# either (benchmarks/probes/forced_algorithm.py --any-reduction, --workspace-mib).
_REDUCTION_SCHEMES = int(cublasLt.ReductionScheme.COMPUTE_TYPE)
_HEURISTIC_WORKSPACE = 64 << 20

# Our own tuning graphs do not restrict what other threads may do meanwhile.
_CAPTURE_RELAXED = int(cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)

# Replay: outside XLA's command buffers, a call whose stream and pointers a plan has seen
# _REPLAY_AFTER times is captured once into a one-GEMM CUDA graph, and later calls with
# the same stream and pointers launch that graph instead of calling cublasLtMatmul, whose
# host cost inside the handler was 15.7-17.5 µs on the H200. At most _REPLAY_GRAPHS per
# plan (the oldest goes first); a plan that has dropped that many stops making graphs (a
# program cycling through more pointer sets than that would capture at every call).
# A plan serves every layer of its shape, and a layer's pointers move with XLA's temporary
# buffers from call to call: the chain benchmark's 16-layer programs needed 108 graphs per
# plan on the H200, and with 64 every plan dropped 64 and stopped replaying (handler
# 12.0-15.4 µs per run against 5.7-9.0; benchmarks/README.md, 2026-12-03 (q)), hence 256.
# JAX_EPILOG_REPLAY=0 turns replay off.
_REPLAY_AFTER, _REPLAY_GRAPHS, _REPLAY_SEEN = 2, 256, 4096

_NP_DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}


class PlanningError(RuntimeError):
    """cuBLASLt cannot run this problem (no algorithm, or an unsupported combination)."""


def _check(err: Any) -> None:
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


@contextlib.contextmanager
def _relaxed_capture():
    """Allow allocations while this thread may be capturing a CUDA graph.

    Planning normally happens at lowering time, but a plan for a new device or pointer
    alignment is made inside the FFI handler, which XLA may call while capturing a command
    buffer. Relaxed mode lets cudaMalloc run there; planning enqueues no work on the
    captured stream.
    """
    err, previous = cudart.cudaThreadExchangeStreamCaptureMode(
        cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed
    )
    _check(err)
    try:
        yield
    finally:
        cudart.cudaThreadExchangeStreamCaptureMode(previous)


def _set_current(device_id: int) -> None:
    """Mark ``device_id`` current for cuda.core (nvmath's device layer) on this thread.

    cuda.core wants each thread to do so once before nvmath plans there. The FFI handler
    may plan on a thread of XLA's that never did: with PjRt's asynchronous dispatch
    (PJRT_GPU_ENABLE_ASYNC_DISPATCH=1) it runs on a worker thread, where planning failed
    with "Device 0 is not yet initialized" (H200, jax 0.11.2). The context made current is
    the device's primary one, which XLA uses too; callers do this inside cupy's device
    scope, which restores the thread's previous device on exit."""
    _CoreDevice(device_id).set_current()


_handles: dict[int, int] = {}


def _handle(device_id: int) -> int:
    # One cuBLASLt handle per device for the life of the process. nvmath's own handles are
    # per thread and die with their thread; the FFI handler runs on XLA's threads.
    if device_id not in _handles:
        with cp.cuda.Device(device_id):
            _handles[device_id] = cublasLt.create()
    return _handles[device_id]


def _members(spec: EpilogSpec, operand: str, shape, strides, dtype: str):
    """A forward operand's planning view (shape, dtype, element strides): its members'
    matrices one after another, or, shared by the members or without any, one matrix."""
    if spec.members == 1 or spec.is_shared(operand):
        return shape, dtype, strides
    return (spec.members, *shape), dtype, (math.prod(shape), *strides)


class _Views:
    """Operands for planning: correctly shaped and strided views of one small allocation.

    Planning reads shapes, strides, dtypes and addresses only, never the data, so the
    views need not be backed by memory of their full size.
    """

    def __init__(self, device_id: int, alignment: int):
        with cp.cuda.Device(device_id):
            self._base = cp.cuda.alloc(1024)
        self._ptr = self._base.ptr + alignment  # aligned to `alignment`, not more
        self._device_id = device_id

    def view(self, shape, dtype: str, strides_elems) -> cp.ndarray:
        dt = _NP_DTYPES[dtype]
        mem = cp.cuda.UnownedMemory(self._ptr, 1 << 40, self._base, self._device_id)
        return cp.ndarray(
            shape,
            dtype=dt,
            memptr=cp.cuda.MemoryPointer(mem, 0),
            strides=tuple(s * dt.itemsize for s in strides_elems),
        )


def fill_normal(memptr: cp.cuda.MemoryPointer, count: int, dtype: str, scale: float = 1.0) -> None:
    """Write ``count`` values ~ N(0, scale²) of ``dtype`` at ``memptr`` (current stream):
    autotuning times the candidates on operands like a layer's, in their own dtype."""
    values = cp.random.standard_normal(count, dtype=cp.float32) * np.float32(scale)
    if dtype == "bfloat16":  # CuPy has no bfloat16: keep the high half of each float32
        values = (values.view(cp.uint32) >> 16).astype(cp.uint16)
    else:
        values = values.astype(_NP_DTYPES[dtype])
    cp.ndarray(count, values.dtype, memptr)[...] = values


def graph_us(stream: cp.cuda.Stream, launch, runs: int, samples: int = 1) -> float:
    """GPU µs per ``launch()``: ``runs`` launches captured in one CUDA graph on ``stream``,
    launched once to warm up, then ``samples`` times between events (the median).

    ``launch`` runs once uncaptured first, so work the GPU refuses fails there, not inside
    the capture.
    """
    launch()
    stream.begin_capture(_CAPTURE_RELAXED)
    try:
        for _run in range(runs):
            launch()
    finally:
        graph = stream.end_capture()
    graph.launch(stream)
    times = []
    for _sample in range(samples):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        graph.launch(stream)
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / runs)
    return float(np.median(times))


class Plan:
    """A planned fused GEMM for one device, problem and pointer alignment."""

    def __init__(
        self, spec: EpilogSpec, device_id: int, alignment: int, autotune: bool = False, choice: int | None = None
    ):
        """``autotune``: time cuBLASLt's best few algorithms and keep the fastest; else
        heuristic candidate ``choice`` (another plan's tuned choice), else its first."""
        self.spec = spec
        self.device_id = device_id
        self.alignment = alignment
        m, n, k = spec.m, spec.n, spec.k
        views = _Views(device_id, alignment)
        c = None
        if spec.members > 1 and spec.problem != "forward":
            raise PlanningError(f"only forward problems batch over members: {spec}")
        if spec.problem == "wgrad":
            # Column-major D[n, k] = A[n, m] @ op(B) with A = dz (row-major (m, n)) and
            # op(B) = x (row-major (m, k), which nvmath passes as a row-ordered layout).
            # C fixes D's layout to column-major (n, k): the row-major (k, n) gradient.
            a = views.view((n, m), spec.ab_dtype, (1, n))
            b = views.view((m, k), spec.ab_dtype, (k, 1))
            c = views.view((n, k), spec.d_dtype, (1, n))
        elif spec.problem == "dgrad":
            # Column-major D[k, m] = A[k, n] @ B[n, m]: A is the row-major (k, n) kernel
            # (a row-ordered layout), B the row-major (m, n) dz, D the row-major (m, k) input
            # gradient, and the aux the previous layer's GELU input in its forward layout.
            a = views.view((k, n), spec.ab_dtype, (n, 1))
            b = views.view((n, m), spec.ab_dtype, (1, n))
            c = views.view((k, m), spec.d_dtype, (1, k))
            width = aux_padded_width(Activation.GELU, k)
            epilog_inputs = {"gelu_aux": views.view((width, m), spec.d_dtype, (1, width))}
        else:
            # Column-major D[n, m] = A[n, k] @ B[k, m]: A is the row-major (k, n) kernel,
            # B the row-major (m, k) x, D the row-major (m, n) output. Members (a batch)
            # lead, each a contiguous block; a shared operand keeps its 2-D view, which
            # nvmath broadcasts (batch stride 0).
            a = views.view(*_members(spec, "kernel", (n, k), (1, n), spec.ab_dtype))
            b = views.view(*_members(spec, "x", (k, m), (1, k), spec.ab_dtype))
            if spec.d_dtype != spec.ab_dtype:  # float32 epilog for half operands
                c = views.view(*_members(spec, "d", (n, m), (1, n), spec.d_dtype))
        options = MatmulOptions(
            compute_type=MatmulComputeType[spec.compute_type], handle=_handle(device_id)
        )
        if spec.problem != "dgrad":
            epilog_inputs = None
        if spec.bias_dtype is not None and spec.problem == "forward":
            # A bias of several members is (members, n, 1) to nvmath: a column each.
            bias = (n,), spec.bias_dtype, (1,)
            if spec.members > 1 and not spec.is_shared("bias"):
                bias = (spec.members, n, 1), spec.bias_dtype, (n, 1, 1)
            epilog_inputs = {"bias": views.view(*bias)}
        epilog = None if spec.epilog == "DEFAULT" else MatmulEpilog[spec.epilog]
        with cp.cuda.Device(device_id):  # (restores the thread's device on exit)
            _set_current(device_id)
            try:
                mm = Matmul(a, b, c=c, beta=0.0 if c is not None else None, options=options)
                mm.plan(epilog=epilog, epilog_inputs=epilog_inputs)
            except Exception as exc:  # nvmath raises several types for a refused problem
                raise PlanningError(f"cuBLASLt cannot plan {spec}: {exc}") from exc
        missing = [name for name in _MATMUL_INTERNALS if not hasattr(mm, name)]
        if missing:
            raise RuntimeError(
                f"nvmath-python {NVMATH_VERSION} no longer has Matmul.{missing}: jax_epilog's "
                "fast path (jax_epilog/_nvmath.py) needs updating for this nvmath release."
            )
        self._mm = mm  # owns the descriptors and layouts
        self._handle = options.handle
        self._desc = mm.mm_desc
        self._layouts = (mm.a_layout_ptr, mm.b_layout_ptr, mm.c_layout_ptr, mm.d_layout_ptr)
        self._alpha = mm.alpha.ctypes.data
        self._beta = mm.beta.ctypes.data
        # Host buffers holding the pointer values given to cublasLtMatmulDescSetAttribute.
        self._ptr_buf = np.zeros(2, dtype=np.uint64)
        self._bias_buf = self._ptr_buf.ctypes.data
        self._aux_buf = self._bias_buf + 8
        self._bias_attr = int(cublasLt.MatmulDescAttribute.BIAS_POINTER)
        self._aux_attr = int(cublasLt.MatmulDescAttribute.EPILOGUE_AUX_POINTER)
        self._last = [None, None]
        self._lock = threading.Lock()
        self._replay = os.environ.get("JAX_EPILOG_REPLAY", "1") != "0"
        self._graphs: dict[tuple[int, ...], cp.cuda.graph.Graph] = {}  # (stream, pointers) -> graph
        self._dropped = 0  # graphs dropped to make room
        self._seen: dict[tuple[int, ...], int] = {}
        self._streams: dict[int, cp.cuda.ExternalStream] = {}
        with cp.cuda.Device(device_id):
            self._capture_stream = cp.cuda.Stream(non_blocking=True)
        heuristic = self._choose_algorithm(_CANDIDATES if autotune or choice is not None else 1)
        self.tuning: list[float] | None = None  # µs per candidate, when autotuned
        best = choice if choice is not None and choice < len(heuristic) else 0
        if autotune:
            self.tuning = self._time_candidates(heuristic)
            best = int(np.argmin(self.tuning))
            if not np.isfinite(self.tuning[best]):
                # e.g. one-row problems with a float32 D beside half operands, or DGELU, on
                # the H200 (cuBLASLt 13.1): planned, then refused at every launch (measured)
                raise PlanningError(
                    f"cuBLASLt refused to run each of its {len(heuristic)} algorithms for {spec}"
                )
        self.choice = best  # the heuristic candidate this plan runs
        # cuBLASLt reads the algorithm struct at every call: keep the object that owns it
        # (as nvmath does with its cached_best_algorithm_struct).
        self._algo_struct = heuristic[best]["algo"]
        self._algo = self._algo_struct.ctypes.data
        ws_size = int(np.max(heuristic[best]["workspace_size"]))
        if ws_size and spec.epilog != "DEFAULT":
            ws_size += 16  # as nvmath does: cuBLASLt epilogs may write past the stated size
        with cp.cuda.Device(device_id):
            self._workspace = cp.cuda.alloc(ws_size) if ws_size else None
        self._ws_ptr = self._workspace.ptr if ws_size else 0
        self._ws_size = ws_size
        # How the FFI handler's buffers map onto run(): see _ffi._Handler.__call__.
        self.problem = spec.problem

    def _choose_algorithm(self, count: int):
        """cuBLASLt's ``count`` best heuristic algorithms for operands aligned to
        ``self.alignment`` bytes (at least one, or PlanningError).

        nvmath leaves D's alignment preference at cuBLASLt's default (256 bytes); XLA's
        buffers are only guaranteed 16, so the alignment of every operand is stated here.
        Split-K partial sums must stay in the compute type: cuBLASLt's default also allows
        reducing them in D's type, which on the H200 picked a float16 reduction for the
        seed layer (256x784->100) and cost 0.5 ulp of the partial sums (measured).
        """
        pref = cublasLt.matmul_preference_create()
        try:
            ifc = matmul_pref_ifc.MatmulPreferenceInterface(pref)
            ifc.max_workspace_bytes = _HEURISTIC_WORKSPACE
            ifc.reduction_scheme_mask = _REDUCTION_SCHEMES
            ifc.min_alignment_a_bytes = self.alignment
            ifc.min_alignment_b_bytes = self.alignment
            ifc.min_alignment_c_bytes = self.alignment
            ifc.min_alignment_d_bytes = self.alignment
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

    def _time_candidates(self, heuristic) -> list[float]:
        """GPU µs per call of each candidate algorithm on scratch operands of the real sizes.

        cuBLASLt's first heuristic choice was measured up to 20% slower than another of its
        top eight on the H200 (RELU_AUX_BIAS at 8192x1024->4096: 136 vs 110 µs), and the
        best was often the 5th-7th, so plans made at lowering time time up to 16. Scratch
        memory is freed afterwards; without room for it the heuristic's first choice stands.
        """
        raw = operand_bytes(self.spec)
        sizes = [-(-b // 256) * 256 for b in raw]
        ws_size = int(np.max(heuristic["workspace_size"])) + 16
        offsets = np.cumsum([0, *sizes])
        s = self.spec
        try:
            with cp.cuda.Device(self.device_id):
                scratch = cp.cuda.alloc(sum(sizes) + ws_size)
                stream = cp.cuda.Stream(non_blocking=True)
                ab = _NP_DTYPES[s.ab_dtype].itemsize
                with stream:  # operands like a layer's: x, dz and z ~ N(0, 1), kernel ~ N(0, 1/k)
                    a_scale = 1 / np.sqrt(s.k) if s.problem != "wgrad" else 1.0  # the kernel, or dz
                    fill_normal(scratch + int(offsets[0]), raw[0] // ab, s.ab_dtype, a_scale)
                    fill_normal(scratch + int(offsets[1]), raw[1] // ab, s.ab_dtype)
                    if s.problem == "dgrad":  # its aux (an input) is a GELU input
                        fill_normal(scratch + int(offsets[4]), raw[4] // _NP_DTYPES[s.d_dtype].itemsize, s.d_dtype)
                    if s.bias_dtype and s.problem == "forward":
                        count = raw[3] // _NP_DTYPES[s.bias_dtype].itemsize
                        fill_normal(scratch + int(offsets[3]), count, s.bias_dtype)
                stream.synchronize()
        except cp.cuda.memory.OutOfMemoryError:
            return [0.0] + [float("inf")] * (len(heuristic) - 1)
        offsets = offsets + scratch.ptr
        a, b, d, bias, aux = (int(o) if size else 0 for o, size in zip(offsets[:5], sizes))
        self._ws_ptr, self._ws_size = int(offsets[5]), ws_size  # one workspace fits them all
        # Roughly 1 µs per 2**29 multiply-adds on the H200; small problems get more runs.
        runs = int(np.clip(_TUNING_GRAPH_US * 2**29 / max(1, s.members * s.m * s.n * s.k), _TUNING_RUNS, 50))
        pointers = (a, b, bias, d, aux)

        def timed(i: int) -> float:
            self._algo = heuristic[i]["algo"].ctypes.data  # _matmul() launches self._algo
            try:
                return self._graph_us(stream, runs, pointers)
            except Exception:  # noqa: BLE001 -- a candidate that fails is never chosen
                stream.synchronize()
                return float("inf")

        # A large GEMM drives the GPU into its power limit within one round: on the H200 at
        # 8192x4096->16384 the candidates timed after the first two measured ~10% slower here
        # than in later graphs, and the tuner kept an early one that ran 3-6% slower inside
        # a jitted program than a later one (benchmarks/probes/forced_algorithm.py). So the
        # GPU first reaches its steady state, and the second round runs backwards: drift
        # that is linear in time then adds the same to every candidate's mean. Measured
        # there (bf16, fused and XLA's jit timed in turns): ReLU 0.94-1.01x XLA with the old
        # tuner's choice, 0.99-1.07x with this one's; in the benchmark suite's rounds
        # 0.95-0.98x before, 1.03-1.05x after, and GELU 1712 -> 1559-1597 µs per call.
        spent, graphs = 0.0, 0
        while spent < _TUNING_WARM_US and graphs < _TUNING_WARM_GRAPHS:
            warm = timed(graphs % len(heuristic)) * runs
            spent, graphs = spent + (warm if np.isfinite(warm) else _TUNING_WARM_US), graphs + 1
        order = list(range(len(heuristic)))
        first = {i: timed(i) for i in order}
        second = {i: timed(i) for i in reversed(order) if np.isfinite(first[i])}
        times = [(first[i] + second[i]) / 2 if i in second else float("inf") for i in order]
        self._last = [None, None]  # the descriptor points at freed scratch now
        del scratch  # (__init__ then sets the chosen algorithm and its own workspace)
        return times

    def _graph_us(self, stream: cp.cuda.Stream, runs: int, pointers: tuple[int, ...]) -> float:
        """GPU µs per run of the current algorithm (see ``graph_us``).

        Launched one by one from Python, a small GEMM's runs are spaced by the host's launch
        cost (measured on the H200 at 256x1024->1024: 11-16 µs per run for every candidate,
        whose GPU times were 4.1-5.9 µs), and the tuner then chose by noise. In a graph the
        runs follow each other on the GPU, as they do in XLA's command buffers.
        """
        return graph_us(stream, lambda: self._matmul(stream.ptr, *pointers), runs)

    def run(self, stream: int, a: int, b: int, bias: int, d: int, aux: int) -> None:
        """One fused GEMM on ``stream``: A = kernel, B = x, D and aux are outputs.

        A replayed graph writes exactly this call's buffers: it was captured with the same
        stream and pointers, and reads the buffers' contents when it runs. Under stream
        capture (XLA recording a command buffer) the GEMM is always issued directly.
        """
        key = (stream, a, b, bias, d, aux)
        graph = self._graphs.get(key)
        if graph is not None or self._replay:
            ext = self._streams.get(stream) or self._external(stream)
            if not ext.is_capturing():
                if graph is None:
                    graph = self._seen_again(key)
                if graph is not None:
                    graph.launch(ext)
                    return
        self._matmul(stream, a, b, bias, d, aux)

    @property
    def replay_stats(self) -> tuple[int, int, bool]:
        """(graphs kept, graphs dropped to make room, whether the plan still replays)."""
        return len(self._graphs), self._dropped, self._replay

    def _external(self, stream: int) -> cp.cuda.ExternalStream:
        if len(self._streams) >= _REPLAY_SEEN:
            self._streams.clear()
        ext = self._streams[stream] = cp.cuda.ExternalStream(stream, self.device_id)
        return ext

    def _seen_again(self, key: tuple[int, ...]) -> cp.cuda.graph.Graph | None:
        """Count a call's (stream, pointers); on the _REPLAY_AFTER-th, its graph."""
        with self._lock:
            graph = self._graphs.get(key)
            if graph is not None or not self._replay:
                return graph
            seen = self._seen.get(key, 0) + 1
            if seen < _REPLAY_AFTER:
                if len(self._seen) >= _REPLAY_SEEN:
                    self._seen.clear()
                self._seen[key] = seen
                return None
            self._seen.pop(key, None)
            try:
                graph = self._capture(key)
            except Exception:  # noqa: BLE001 -- an optimisation must never fail a call
                self._replay = False  # (the call goes on without it)
                return None
            if len(self._graphs) >= _REPLAY_GRAPHS:  # (an in-flight launch still completes)
                del self._graphs[next(iter(self._graphs))]
                self._dropped += 1
                if self._dropped >= _REPLAY_GRAPHS:  # thrashing: back to cublasLtMatmul
                    self._replay = False
                    self._graphs.clear()
                    return None
            self._graphs[key] = graph
            return graph

    def _capture(self, key: tuple[int, ...]) -> cp.cuda.graph.Graph:
        capture = self._capture_stream  # captured work does not run: any stream will do
        capture.begin_capture(_CAPTURE_RELAXED)
        try:
            self._matmul_locked(capture.ptr, *key[1:])
        finally:
            graph = capture.end_capture()
        return graph

    def _matmul(self, stream: int, a: int, b: int, bias: int, d: int, aux: int) -> None:
        """``cublasLtMatmul`` with this call's pointers (the descriptor is shared)."""
        with self._lock:
            self._matmul_locked(stream, a, b, bias, d, aux)

    def _matmul_locked(self, stream: int, a: int, b: int, bias: int, d: int, aux: int) -> None:
        a_layout, b_layout, c_layout, d_layout = self._layouts
        if bias and bias != self._last[0]:
            self._ptr_buf[0] = bias
            cublasLt.matmul_desc_set_attribute(self._desc, self._bias_attr, self._bias_buf, 8)
            self._last[0] = bias
        if aux and aux != self._last[1]:
            self._ptr_buf[1] = aux
            cublasLt.matmul_desc_set_attribute(self._desc, self._aux_attr, self._aux_buf, 8)
            self._last[1] = aux
        cublasLt.matmul(
            self._handle, self._desc, self._alpha, a, a_layout, b, b_layout,
            self._beta, d, c_layout, d, d_layout, self._algo,
            self._ws_ptr, self._ws_size, stream,
        )  # fmt: skip


def operand_bytes(s: EpilogSpec) -> tuple[int, ...]:
    """Bytes of A, B, D, bias and aux for problem ``s`` (see EpilogSpec), all members'."""
    ab, d = _NP_DTYPES[s.ab_dtype].itemsize, _NP_DTYPES[s.d_dtype].itemsize
    bias = _NP_DTYPES[s.bias_dtype].itemsize if s.bias_dtype else 0
    aux = 1 if s.problem == "forward" and s.activation is Activation.RELU else d  # bits, or z
    return tuple(count * size for count, size in zip(buffer_elements(s), (ab, ab, d, bias, aux)))


_plans: dict[tuple[EpilogSpec, int, int], Plan] = {}
_plans_lock = threading.Lock()
# The tuner's choice per problem, alignment and GPU model. Plans made without tuning take
# it: those the FFI handler makes for the other devices of a multi-GPU program (lowering
# tuned on the current device only), so that no device runs a slower algorithm than the
# rest, which would all wait for it.
_tuned: dict[tuple[EpilogSpec, int, str], int] = {}


@functools.cache
def _model(device_id: int) -> str:
    return str(cp.cuda.runtime.getDeviceProperties(device_id)["name"])


def get_plan(spec: EpilogSpec, device_id: int, alignment: int = 256, autotune: bool = False) -> Plan:
    """The cached plan, made on first use (raises PlanningError if cuBLASLt refuses).

    ``autotune`` (at lowering time only, never inside the FFI handler, which XLA may call
    while capturing a CUDA graph): time cuBLASLt's best few algorithms and keep the fastest,
    unless the environment sets JAX_EPILOG_AUTOTUNE=0.
    """
    key = (spec, device_id, alignment)
    plan = _plans.get(key)
    if plan is None:
        with _plans_lock:
            plan = _plans.get(key)
            if plan is None:
                with _relaxed_capture():
                    tune = autotune and os.environ.get("JAX_EPILOG_AUTOTUNE", "1") != "0"
                    tuned_key = (spec, alignment, _model(device_id))
                    choice = None if tune else _tuned.get(tuned_key)
                    plan = _plans[key] = Plan(spec, device_id, alignment, autotune=tune, choice=choice)
                    if plan.tuning is not None:
                        _tuned[tuned_key] = plan.choice
    return plan


def alignment_of(*ptrs: int) -> int:
    """The largest plan alignment that all non-null pointers satisfy (0: none does)."""
    combined = 0
    for p in ptrs:
        combined |= p
    for alignment in _ALIGNMENTS:
        if combined % alignment == 0:
            return alignment
    return 0
