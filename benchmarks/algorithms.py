"""How much the algorithm choice matters: cuBLASLt's heuristic candidates timed one by one.

    python -m benchmarks.algorithms
    python -m benchmarks.algorithms --tuning [M K N] [EPILOG ...]
    python -m benchmarks.algorithms --sustained [M K N] [EPILOG ...]

For each epilog of the forward (and the backward's kernel-gradient GEMM, with and without
the BGRADA bias-gradient epilog) at two transformer shapes, this plans the problem as
jax_epilog does (``_nvmath.Plan``, heuristic first choice), then times on the GPU (CUDA
events around a CUDA graph of 40 launches, median of 5, bf16 operands ~ N(0, 1)): the
heuristic's first choice, the best of its top 8, the same with any split-K reduction scheme
and 1 GiB of workspace allowed, and nvmath's own first choice. The last line per shape
times XLA's GEMMs for the backward (jitted, back to back). This measurement is why plans
made at lowering time are autotuned (``_nvmath.Plan._time_candidates``). Results:
benchmarks/results/*/algorithms.txt.

``--tuning`` checks the autotuner itself at one shape (default 8192x4096->16384): every
candidate it considered, with the time it measured at planning (scratch operands, best of
2 rounds, each a CUDA graph of 5-50 launches) beside the time measured here (as above),
and which one it chose against the fastest here; then the candidates nvmath-python's own
``Matmul.plan`` found (its preferences, not ours), timed the same way. Epilog ``DGELU`` is
the backward's input-gradient problem (``fused_mlp``'s link): M K N name the layer whose
input gradient it is (x (M, K) -> N), so ``--tuning 8192 4096 1024 DGELU`` is the
transformer MLP block's second layer.

``--sustained`` asks whether a graph of a few launches ranks the candidates as a long run
does: jitted programs of large GEMMs held the H200 at its power limit (700 W, SM clock down
from 1980 to ~1425 MHz, seen with nvidia-smi), where a tile shape that spends less energy
per multiply-add could win. Each candidate is timed in a graph and in long back-to-back
runs, then fused_dense and XLA's jit in long runs of calls. (These raw launches drew ~480 W
at 8192x4096->16384, not the programs' 690 W.) For diagnosis only: at
8192x4096->16384 it stalled twice on the H200 (the GPU at ~260 W for minutes; cause not
found, benchmarks/results/2026-12-03-h200-k-power/), so run it under ``timeout``.
"""

from __future__ import annotations

import sys

import cupy as cp
import jax
import jax.numpy as jnp
import numpy as np
from nvmath.bindings import cublasLt
from nvmath.linalg._internal import matmul_pref_ifc

from benchmarks.forward import layer_operands, single_layers
from benchmarks.timing import Settings, WallClock, measure, measure_interleaved
from jax_epilog import _nvmath
from jax_epilog._epilogs import Activation, EpilogSpec, aux_padded_width

SHAPES = [(8192, 1024, 4096), (8192, 4096, 1024)]
EPILOGS = ["RELU_BIAS", "RELU_AUX_BIAS", "GELU_BIAS", "GELU_AUX_BIAS", "BGRADA", "DEFAULT_WGRAD"]


def candidates(plan, count, any_reduction=False, workspace=64 << 20):
    pref = cublasLt.matmul_preference_create()
    ifc = matmul_pref_ifc.MatmulPreferenceInterface(pref)
    ifc.max_workspace_bytes = workspace
    if not any_reduction:
        ifc.reduction_scheme_mask = cublasLt.ReductionScheme.COMPUTE_TYPE
    for operand in "abcd":
        setattr(ifc, f"min_alignment_{operand}_bytes", 256)
    result = cublasLt.MatmulHeuristicResult(count)
    found = np.zeros(1, np.int32)
    cublasLt.matmul_algo_get_heuristic(
        plan._handle, plan._desc, *plan._layouts, pref, count, result.ptr, found.ctypes.data
    )
    cublasLt.matmul_preference_destroy(pref)
    return result[: found[0]]


class Timer:
    def __init__(self):
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.keep = []  # operands and algorithm structs, alive until the end

    def buffer(self, nbytes: int) -> int:
        """bfloat16 values ~ N(0, 1): the GPU's clocks, so the timings, depend on the values."""
        data = cp.cuda.alloc(nbytes + 16)
        _nvmath.fill_normal(data, nbytes // 2 + 8, "bfloat16")
        self.keep.append(data)
        return data.ptr

    def gpu_us(self, launch, n=40) -> float:
        """Median of 5 timings of ``n`` launches captured in one CUDA graph (GPU time only:
        launched one by one, a small GEMM would be timed at the host's launch rate)."""
        return _nvmath.graph_us(self.stream, launch, n, samples=5)

    def time_algorithm(self, plan, record, pointers) -> float:
        return self.gpu_us(self.launcher(plan, record, pointers))

    def sustained_us(self, launch, burst_us: float, warm_ms=60.0, time_ms=140.0) -> float:
        """GPU µs per launch in a long back-to-back run (launched from the host: every
        problem here takes longer on the GPU than a launch on the host), after ``warm_ms``
        of the same work, as in a training loop rather than a graph of ~40 launches."""
        for _ in range(max(1, int(warm_ms * 1e3 / burst_us))):
            launch()
        runs = max(5, int(time_ms * 1e3 / burst_us))
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(self.stream)
        for _ in range(runs):
            launch()
        end.record(self.stream)
        end.synchronize()
        return cp.cuda.get_elapsed_time(start, end) * 1e3 / runs

    def launcher(self, plan, record, pointers):
        """A function that launches ``plan``'s problem with algorithm ``record``."""
        a, b, bias, d, aux = pointers
        ws_size = int(np.max(record["workspace_size"])) + 16
        workspace = cp.cuda.alloc(ws_size)
        algo = record["algo"]
        self.keep += [workspace, algo]
        layouts = plan._layouts
        for value, attr, slot in ((bias, plan._bias_attr, 0), (aux, plan._aux_attr, 1)):
            if value:
                plan._ptr_buf[slot] = value
                cublasLt.matmul_desc_set_attribute(plan._desc, attr, plan._ptr_buf.ctypes.data + 8 * slot, 8)
                plan._last[slot] = value  # so the plan's own calls know what the descriptor holds

        def launch():
            cublasLt.matmul(
                plan._handle, plan._desc, plan._alpha, a, layouts[0], b, layouts[1], plan._beta,
                d, layouts[2], d, layouts[3], algo.ctypes.data, workspace.ptr, ws_size, self.stream.ptr,
            )  # fmt: skip

        return launch


def jax_us(f, *args, n=50) -> float:
    """Median µs per call of 5 batches of ``n`` back-to-back jitted calls (host clock)."""
    settings = Settings(samples=5, min_calls=n, sample_s=0.0)
    return measure(lambda i: f(*args), WallClock(), settings).us


def _forward_pointers(timer, spec):
    m, n, k, buf = spec.m, spec.n, spec.k, timer.buffer
    return (buf(k * n * 2), buf(m * k * 2), buf(n * 2), buf(m * n * 2), buf(m * n * 2) if spec.has_aux else 0)


def _dgrad_pointers(timer, spec):
    """kernel (k, n), dz (m, n), no bias, dh (m, k), the GELU input (m, round_up(k, 8))."""
    m, n, k, buf = spec.m, spec.n, spec.k, timer.buffer
    width = aux_padded_width(Activation.GELU, k)
    return (buf(k * n * 2), buf(m * n * 2), 0, buf(m * k * 2), buf(m * width * 2))


def tuning(m, k, n, epilogs):
    timer = Timer()
    for name in epilogs:
        dgrad = name == "DGELU"
        bias = None if dgrad else "bfloat16"
        problem = "dgrad" if dgrad else "forward"
        spec = EpilogSpec(m, n, k, name, "COMPUTE_32F", "bfloat16", bias, "bfloat16", problem)
        tuned = _nvmath.Plan(spec, 0, 256, autotune=True)
        ptrs = (_dgrad_pointers if dgrad else _forward_pointers)(timer, spec)
        records = candidates(tuned, _nvmath._CANDIDATES)
        here = [timer.time_algorithm(tuned, c, ptrs) for c in records]
        chosen = int(np.argmin(tuned.tuning))
        print(
            f"{m}x{k}->{n} {name}: chose candidate {chosen} ({here[chosen]:.1f} µs here), fastest here "
            f"{int(np.argmin(here))} ({min(here):.1f} µs), heuristic first {here[0]:.1f} µs",
            flush=True,
        )
        for i, (planning, measured) in enumerate(zip(tuned.tuning, here)):
            print(f"  candidate {i:2d}: at planning {planning:8.1f} µs, here {measured:8.1f} µs", flush=True)
        theirs = [timer.time_algorithm(tuned, a, ptrs) for a in tuned._mm.algorithms_buffer]
        print(
            f"  nvmath's own {len(theirs)} candidates, here: " + ", ".join(f"{t:.1f}" for t in theirs),
            flush=True,
        )
    x, w, b = layer_operands(m, k, n, seed=0)
    relu = jax_us(jax.jit(lambda x, w, b: jax.nn.relu(x @ w + b)), x, w, b)
    gelu = jax_us(jax.jit(lambda x, w, b: jax.nn.gelu(x @ w + b)), x, w, b)
    print(
        f"{m}x{k}->{n} XLA jit (back to back, host clock): relu {relu:.1f} µs, gelu {gelu:.1f} µs", flush=True
    )


def sustained(m, k, n, epilogs, rounds=3):
    """Each autotuning candidate timed in a graph (as the tuner does) and in long runs
    (median of ``rounds``, the candidates in turn, the GPU kept busy throughout), then
    fused_dense and XLA's jit the same way (host clock)."""
    timer = Timer()
    for name in epilogs:
        spec = EpilogSpec(m, n, k, name, "COMPUTE_32F", "bfloat16", "bfloat16", "bfloat16", "forward")
        tuned = _nvmath.Plan(spec, 0, 256, autotune=True)
        print(f"{m}x{k}->{n} {name}: planned", file=sys.stderr, flush=True)
        ptrs = _forward_pointers(timer, spec)
        launches = [timer.launcher(tuned, c, ptrs) for c in candidates(tuned, _nvmath._CANDIDATES)]
        burst = [timer.gpu_us(launch) for launch in launches]
        print(f"{m}x{k}->{n} {name}: graphs timed", file=sys.stderr, flush=True)
        runs = [[] for _ in launches]
        for round_ in range(rounds):
            for i, launch in enumerate(launches):
                runs[i].append(timer.sustained_us(launch, burst[i]))
            print(
                f"  round {round_}: " + ", ".join(f"{r[-1]:.1f}" for r in runs), file=sys.stderr, flush=True
            )
        long = [float(np.median(r)) for r in runs]
        chosen = int(np.argmin(tuned.tuning))
        print(
            f"{m}x{k}->{n} {name}: tuner chose {chosen} (graph {burst[chosen]:.1f}, long runs {long[chosen]:.1f} µs); "
            f"fastest in graphs {int(np.argmin(burst))} ({min(burst):.1f}), in long runs {int(np.argmin(long))} "
            f"({min(long):.1f})",
            flush=True,
        )
        for i, (planning, g, lr) in enumerate(zip(tuned.tuning, burst, long)):
            print(
                f"  candidate {i:2d}: at planning {planning:8.1f}, graph {g:8.1f}, long runs {lr:8.1f} µs "
                f"(rounds {', '.join(f'{t:.1f}' for t in runs[i])})",
                flush=True,
            )
    x, w, b = layer_operands(m, k, n, seed=0)
    for act in sorted({"relu" if e.startswith("RELU") else "gelu" for e in epilogs}):
        layers = single_layers(act)
        programs = {"fused_dense": jax.jit(layers["fused"]), "xla": jax.jit(layers["xla"])}
        calls = max(20, int(0.15e6 / min(burst)))  # ~150 ms a sample, as the long runs
        settings = Settings(samples=5, min_calls=calls, sample_s=0.0, warmup=calls // 2)
        timings = measure_interleaved(
            [(lambda i, p=p: p(x, w, b), WallClock()) for p in programs.values()], settings
        )
        print(
            f"{m}x{k}->{n} {act} long runs (host clock, {calls} calls a sample): "
            + ", ".join(f"{name} {t.us:.1f} µs" for name, t in zip(programs, timings)),
            flush=True,
        )


def main():
    if "--sustained" in sys.argv:
        args = sys.argv[sys.argv.index("--sustained") + 1 :]
        shape = [int(a) for a in args if a.isdigit()] or [8192, 4096, 16384]
        sustained(*shape, [a for a in args if not a.isdigit()] or ["RELU_BIAS", "GELU_BIAS"])
        return
    if "--tuning" in sys.argv:
        args = sys.argv[sys.argv.index("--tuning") + 1 :]
        shape = [int(a) for a in args if a.isdigit()] or [8192, 4096, 16384]
        tuning(*shape, [a for a in args if not a.isdigit()] or ["RELU_BIAS", "GELU_BIAS"])
        return
    timer = Timer()
    for m, k, n in SHAPES:
        for name in EPILOGS:
            problem = "wgrad" if name in ("BGRADA", "DEFAULT_WGRAD") else "forward"
            epilog = "DEFAULT" if name == "DEFAULT_WGRAD" else name
            bias_dtype = None if epilog == "DEFAULT" else "bfloat16"
            spec = EpilogSpec(m, n, k, epilog, "COMPUTE_32F", "bfloat16", bias_dtype, "bfloat16", problem)
            plan = _nvmath.Plan(spec, 0, 256)
            buf = timer.buffer
            if problem == "forward":
                ptrs = _forward_pointers(timer, spec)
            else:
                ptrs = (buf(m * n * 2), buf(m * k * 2), buf(n * 2) if bias_dtype else 0, buf(k * n * 2), 0)
            ours = [timer.time_algorithm(plan, c, ptrs) for c in candidates(plan, 8)]
            wide = [timer.time_algorithm(plan, c, ptrs) for c in candidates(plan, 8, True, 1 << 30)]
            nv = timer.time_algorithm(plan, plan._mm.algorithms_buffer[0], ptrs)
            print(
                f"{m}x{k}->{n} {name:14s} ours(top1) {ours[0]:7.1f} best-of-{len(ours)} {min(ours):7.1f} "
                f"(idx {int(np.argmin(ours))}) any-reduction top1 {wide[0]:7.1f} best {min(wide):7.1f}  "
                f"nvmath-top1 {nv:7.1f}  TF/s best {2 * m * n * k / min(ours) / 1e6:.0f}",
                flush=True,
            )
        x = jnp.ones((m, k), jnp.bfloat16) * 0.01
        dz = jnp.ones((m, n), jnp.bfloat16) * 0.01
        w = jnp.ones((k, n), jnp.bfloat16)
        print(
            f"{m}x{k}->{n} XLA wgrad x.T@dz {jax_us(jax.jit(lambda x, dz: x.T @ dz), x, dz):.1f}  "
            f"wgrad+sum {jax_us(jax.jit(lambda x, dz: (x.T @ dz, dz.sum(0))), x, dz):.1f}  "
            f"dgrad dz@w.T {jax_us(jax.jit(lambda dz, w: dz @ w.T), dz, w):.1f}  "
            f"fwd plain x@w {jax_us(jax.jit(lambda x, w: x @ w), x, w):.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
