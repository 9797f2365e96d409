"""Autotuning: time cuBLASLt's heuristic candidates for a plan and pick the fastest.

cuBLASLt's first heuristic choice is not always its fastest, so a plan made at lowering
times up to ``Policy.tuning_candidates`` of them on scratch operands of the real sizes,
filled like a layer's. Each candidate runs back to back inside one CUDA graph, as in XLA's
command buffers (launched one by one from Python, small GEMMs would be timed by the host's
launch cost). A large GEMM drives the GPU into its power limit within one round, so the
GPU first runs about ``tuning_warm_us`` of work, then two rounds time every candidate, the
second in reverse order: drift that is linear in time adds the same to every candidate's
mean. Uses CuPy only; the plan launches the GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable

import cupy as cp
import numpy as np
from cuda.bindings import runtime as cudart

from .._epilogs import EpilogSpec, buffer_bytes
from .._fp8_spec import Fp8Spec
from .._policy import get_policy

__all__ = ["CAPTURE_RELAXED", "fill_normal", "graph_us", "time_candidates"]

# Our own graphs do not restrict what other threads may do meanwhile.
CAPTURE_RELAXED = int(cudart.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed)
_TILE = 1 << 20  # random values drawn on the host; the rest of an operand repeats them


def fill_normal(memptr: cp.cuda.MemoryPointer, count: int, dtype: str, scale: float = 1.0) -> None:
    """Write ``count`` values ~ N(0, scale²) of ``dtype`` (any NumPy or ml_dtypes name) at
    ``memptr`` on the current stream: a tile drawn on the host, repeated on the GPU."""
    tile = (np.random.default_rng(0).standard_normal(min(count, _TILE)) * scale).astype(np.dtype(dtype))
    out = cp.ndarray(count * tile.itemsize, cp.uint8, memptr)
    out[: tile.nbytes].set(tile.view(np.uint8))
    filled = tile.nbytes
    while filled < out.size:  # double the filled prefix until the operand is full
        step = min(filled, out.size - filled)
        out[filled : filled + step] = out[:step]
        filled += step


def graph_us(stream: cp.cuda.Stream, launch: Callable[[], None], runs: int, samples: int = 1) -> float:
    """GPU µs per ``launch()``: ``runs`` launches captured in one CUDA graph on ``stream``,
    launched once to warm up, then ``samples`` times between events (the median).

    ``launch`` runs once uncaptured first, so work the GPU refuses fails there, not inside
    the capture.
    """
    launch()
    stream.begin_capture(CAPTURE_RELAXED)
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


def _scratch(spec: EpilogSpec, workspace: int, stream: cp.cuda.Stream):
    """Scratch operands for ``spec``, filled as a layer's are: x, dz and z ~ N(0, 1), the
    kernel ~ N(0, 1/k). Returns (allocation, (a, b, d, bias, aux) pointers, workspace ptr)."""
    raw = buffer_bytes(spec)
    sizes = [-(-b // 256) * 256 for b in raw]
    offsets = np.cumsum([0, *sizes])
    scratch = cp.cuda.alloc(sum(sizes) + workspace)
    a_scale = 1 / np.sqrt(spec.k) if spec.problem != "wgrad" else 1.0  # the kernel, or dz
    with stream:
        fill_normal(
            scratch + int(offsets[0]), raw[0] // np.dtype(spec.ab_dtype).itemsize, spec.ab_dtype, a_scale
        )
        fill_normal(scratch + int(offsets[1]), raw[1] // np.dtype(spec.ab_dtype).itemsize, spec.ab_dtype)
        if spec.problem == "dgrad":  # its aux (an input) is a GELU input
            fill_normal(scratch + int(offsets[4]), raw[4] // np.dtype(spec.d_dtype).itemsize, spec.d_dtype)
        if spec.bias_dtype and spec.problem == "forward":
            fill_normal(
                scratch + int(offsets[3]), raw[3] // np.dtype(spec.bias_dtype).itemsize, spec.bias_dtype
            )
    stream.synchronize()
    a, b, d, bias, aux = (int(o) + scratch.ptr if size else 0 for o, size in zip(offsets[:5], sizes))
    return scratch, (a, b, d, bias, aux), scratch.ptr + int(offsets[5])


def _fp8_scratch(spec: Fp8Spec, workspace: int, stream: cp.cuda.Stream):
    """Scratch buffers for an FP8 problem: P and Q ~ N(0, 1) in FP8 with unit scales (the
    kernel's scale keeps the product near a layer's), the bias and a DGELU input ~ N(0, 1).
    Returns (allocation, Plan.run's pointers after the stream, workspace ptr)."""
    names = (*spec.operands(), *spec.results())
    dtypes = {"p": spec.p_dtype, "q": spec.q_dtype, "d": spec.d_dtype, "bias": spec.bias_dtype,
              "dbias": spec.bias_dtype, "aux": spec.aux_dtype or spec.d_dtype}  # fmt: skip
    counts = spec.elements()
    sizes = [-(-counts[n] * np.dtype(dtypes.get(n) or "float32").itemsize // 256) * 256 for n in names]
    offsets = np.cumsum([0, *sizes])
    scratch = cp.cuda.alloc(int(offsets[-1]) + workspace)
    ptr = {name: scratch.ptr + int(offset) for name, offset in zip(names, offsets)}
    with stream:
        for name in ("p", "q", *(["bias"] if spec.bias_in else []), *(["aux"] if spec.aux_in else [])):
            fill_normal(scratch + (ptr[name] - scratch.ptr), counts[name], dtypes[name])
        for name in ("p_scale", "q_scale", "d_scale"):
            if name in ptr:
                value = 1 / np.sqrt(spec.k) if name == "q_scale" else 1.0
                cp.ndarray(1, cp.float32, scratch + (ptr[name] - scratch.ptr)).fill(value)
    stream.synchronize()
    ins, outs = spec.operands(), spec.results()
    pointers = (ptr["q"], ptr["p"], ptr["d"], *(ptr[n] for n in ins[2:]), *(ptr[n] for n in outs[1:]))
    return scratch, pointers, scratch.ptr + int(offsets[-1])


def time_candidates(plan, count: int, workspace: int) -> list[float]:
    """GPU µs per call of each of ``plan``'s ``count`` candidate algorithms (inf for one
    that fails; ``[0, inf, ...]`` without memory for scratch operands, keeping the first).

    ``plan.launch_candidate(i, stream, pointers, workspace_ptr, workspace_size)`` runs
    candidate ``i``; ``plan.device_id`` and ``plan.spec`` say where and what.
    """
    policy, spec = get_policy(), plan.spec
    try:
        with cp.cuda.Device(plan.device_id):
            stream = cp.cuda.Stream(non_blocking=True)
            make = _fp8_scratch if spec.problem == "fp8" else _scratch
            scratch, pointers, ws_ptr = make(spec, workspace, stream)
    except cp.cuda.memory.OutOfMemoryError:
        return [0.0] + [float("inf")] * (count - 1)
    # Roughly 1 µs per 2**29 multiply-adds on a Hopper GPU; small problems get more runs.
    work = max(1, spec.members * spec.m * spec.n * spec.k)
    runs = int(np.clip(policy.tuning_graph_us * 2**29 / work, policy.tuning_min_runs, policy.tuning_max_runs))

    def timed(i: int) -> float:
        launch = lambda: plan.launch_candidate(i, stream.ptr, pointers, ws_ptr, workspace)
        try:
            return graph_us(stream, launch, runs)
        except Exception:  # noqa: BLE001 -- a candidate that fails is never chosen
            stream.synchronize()
            return float("inf")

    spent, graphs = 0.0, 0
    while spent < policy.tuning_warm_us and graphs < policy.tuning_warm_graphs:
        warm = timed(graphs % count) * runs
        spent, graphs = spent + (warm if np.isfinite(warm) else policy.tuning_warm_us), graphs + 1
    first = [timed(i) for i in range(count)]
    second = {i: timed(i) for i in reversed(range(count)) if np.isfinite(first[i])}
    del scratch
    return [(first[i] + second[i]) / 2 if i in second else float("inf") for i in range(count)]
