"""Exploration: ReLU's backward from the forward's output y (y > 0) instead of its bit-mask."""
import json, os, sys
import jax, jax.numpy as jnp, numpy as np
from benchmarks.forward import time_jax_interleaved
from benchmarks.training import layer_inputs
from jax_epilog import fused_dense, unpack_relu_mask

out = sys.argv[1]
shapes = [(8192, 1024, 4096), (8192, 4096, 1024)] if jax.default_backend() == "gpu" else [(64, 48, 40)]
f32 = jnp.float32

def fused(x, w, b):
    return fused_dense(x, w, b, activation="relu", implementation="cublaslt")

def grads(x, w, b, dz):
    dx = jnp.matmul(dz, w.T, preferred_element_type=f32).astype(x.dtype)
    dw = jnp.matmul(x.T, dz, preferred_element_type=f32).astype(w.dtype)
    return dx, dw, jnp.sum(dz.astype(f32), axis=0).astype(b.dtype)

@jax.custom_vjp
def from_y(x, w, b):
    return fused(x, w, b)
def _y_fwd(x, w, b):
    y = fused(x, w, b)
    return y, (x, w, b, y)
def _y_bwd(res, dy):
    x, w, b, y = res
    return grads(x, w, b, jnp.where(y > 0, dy, jnp.zeros((), dy.dtype)))
from_y.defvjp(_y_fwd, _y_bwd)

@jax.custom_vjp
def from_mask(x, w, b):
    return fused(x, w, b)
def _m_fwd(x, w, b):
    y, mask = fused_dense(x, w, b, activation="relu", implementation="cublaslt", return_aux=True)
    return y, (x, w, b, mask)
def _m_bwd(res, dy):
    x, w, b, mask = res
    bits = unpack_relu_mask(mask, w.shape[1])
    return grads(x, w, b, jnp.where(bits, dy, jnp.zeros((), dy.dtype)))
from_mask.defvjp(_m_fwd, _m_bwd)

layers = {"xla": lambda x, w, b: jax.nn.relu(x @ w + b), "lib_cublaslt": fused, "mask": from_mask, "y": from_y}

def summed(f):
    return jax.jit(jax.grad(lambda x, w, b: jnp.sum(f(x, w, b), dtype=f32), argnums=(0, 1, 2)))

def with_output(f):  # training's view: the layer's output is used, its cotangent is an array
    def step(x, w, b, dy):
        y, vjp = jax.vjp(f, x, w, b)
        return (y, *vjp(dy))
    return jax.jit(step)

os.makedirs(out, exist_ok=True)
rows = []
for m, k, n in shapes:
    x, w, b = layer_inputs(m, k, n, np.random.default_rng(3))
    dy = jnp.asarray(np.random.default_rng(4).standard_normal((m, n)), jnp.bfloat16)
    ref = None
    for loss, make, args in (("sum", summed, (x, w, b)), ("dy", with_output, (x, w, b, dy))):
        progs = {name: make(f) for name, f in layers.items()}
        res = {name: jax.block_until_ready(p(*args)) for name, p in progs.items()}
        errs = {name: max(float(jnp.max(jnp.abs(a.astype(f32) - r.astype(f32)))) / (float(jnp.max(jnp.abs(r.astype(f32)))) + 1e-30)
                          for a, r in zip(res[name], res["xla"])) for name in progs}
        for name in ("mask", "y"):
            hlo = progs[name].lower(*args).compile().as_text()
            open(f"{out}/hlo-{loss}-{name}-{m}x{k}x{n}.txt", "w").write(hlo)
        times = time_jax_interleaved(*[(p, args) for p in progs.values()])
        row = {"shape": f"{m}x{k}->{n}", "loss": loss, **{f"{c}_us": t for c, t in zip(progs, times)},
               **{f"xla/{c}": times[0] / t for c, t in zip(progs, times)}, "rel_err": errs}
        rows.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows, open(f"{out}/relu_y.json", "w"), indent=1)
