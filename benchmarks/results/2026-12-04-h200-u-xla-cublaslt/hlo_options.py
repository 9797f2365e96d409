"""Is XLA's program with ``compiler_options={"xla_gpu_enable_cublaslt": True}`` the one that
``XLA_FLAGS=--xla_gpu_enable_cublaslt=true`` gives? Prints, per suite case, the GEMM kinds in
the optimized HLO and a hash of its text. Run it in processes with and without the flag:

    XLA_FLAGS=--xla_gpu_enable_cublaslt=true python hlo_options.py flag
    python hlo_options.py options
    python hlo_options.py default
"""

import hashlib
import re
import sys

import jax

from benchmarks import run

how = sys.argv[1]
options = {"xla_gpu_enable_cublaslt": True} if how == "options" else None
for case in run.plan(full=False):  # the --quick suite's cases
    x, w, b = (
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in (((case.m, case.k), case.dtype), ((case.k, case.n), case.dtype), ((case.n,), case.bias_dtype))
    )
    text = jax.jit(run.jax_program(case, "xla")).lower(x, w, b).compile(compiler_options=options).as_text()
    kinds = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text)))
    kinds += ["triton_gemm"] * ('"kind":"__triton_gemm"' in text or "__triton_gemm" in text)
    digest = hashlib.sha1(re.sub(r"\s+", " ", text).encode()).hexdigest()[:10]
    print(f"{how:8s} {case.shape:18s} {case.dtype:9s} {case.activation:5s} {case.mode:8s} {digest} {','.join(kinds)}", flush=True)
