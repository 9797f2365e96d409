"""Train a stack of GPT-style MLP blocks in bfloat16: FusedMLP, FusedDense and nn.Dense.

Each block is ``x + FusedDense(d)(FusedDense(4d, gelu)(LayerNorm(x)))``, the feed-forward half
of a transformer layer, with its matmul + bias + GELU fused into one cuBLASLt kernel on a
GPU; ``FusedMLP((4d, d), ("gelu", None))`` holds the same two layers and also fuses the
GELU's derivative into the second layer's input-gradient GEMM. Parameters are float32; the blocks compute in bfloat16 (``dtype=jnp.bfloat16``) while
the residual stream stays float32. The task is synthetic, next-token-like regression: each
position's input is a random "token" vector and the target is a fixed random function of it,
``x A + tanh(x B) C`` (the teacher). Both models start from the same parameters and see the
same batches; the script reports each one's loss and the median step time (measured with
``block_until_ready`` after warm-up steps) and tokens per second.

    python examples/train_transformer_mlp.py                 # small: a CPU, under a minute
    python examples/train_transformer_mlp.py --size large    # d_model 1024, 4 blocks, 8192 tokens/step

Needs the examples' extra: pip install -e ".[examples]".
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jax_epilog.linen import FusedDense, FusedMLP

SIZES = {
    # d_model, blocks, batch, seq (tokens per step = batch * seq), default steps
    "small": {"d_model": 128, "blocks": 2, "batch": 8, "seq": 64, "steps": 40},
    "large": {"d_model": 1024, "blocks": 4, "batch": 8, "seq": 1024, "steps": 50},
}
LAYERS = {"mlp": "FusedMLP", "fused": "FusedDense", "dense": "nn.Dense"}


class MLPBlock(nn.Module):
    """Pre-LayerNorm feed-forward block with a residual connection."""

    d_model: int
    layers: str = "fused"  # a key of LAYERS
    dtype: jnp.dtype = jnp.bfloat16
    implementation: str = "auto"

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=self.dtype, name="ln")(x)
        if self.layers == "mlp":  # the same parameters as "fused", under the same names
            h = FusedMLP(
                (4 * self.d_model, self.d_model), ("gelu", None), layer_names=("fc_in", "fc_out"),
                dtype=self.dtype, implementation=self.implementation, name="mlp",
            )(h)  # fmt: skip
        elif self.layers == "fused":
            dense = functools.partial(FusedDense, dtype=self.dtype, implementation=self.implementation)
            h = dense(4 * self.d_model, activation="gelu", name="fc_in")(h)
            h = dense(self.d_model, name="fc_out")(h)
        else:
            h = jax.nn.gelu(nn.Dense(4 * self.d_model, dtype=self.dtype, name="fc_in")(h), approximate=True)
            h = nn.Dense(self.d_model, dtype=self.dtype, name="fc_out")(h)
        return x + h.astype(x.dtype)  # float32 residual stream


class MLPStack(nn.Module):
    d_model: int
    blocks: int
    layers: str = "fused"
    dtype: jnp.dtype = jnp.bfloat16
    implementation: str = "auto"

    @nn.compact
    def __call__(self, x):
        for i in range(self.blocks):
            x = MLPBlock(self.d_model, self.layers, self.dtype, self.implementation, name=f"block{i}")(x)
        return nn.LayerNorm(dtype=jnp.float32, name="ln_f")(x)


def nest_mlp_params(params: dict) -> dict:
    """FusedDense blocks' parameters as FusedMLP blocks hold them: fc_in and fc_out under "mlp"."""
    out = {}
    for name, block in params["params"].items():
        if name.startswith("block"):
            block = dict(block)
            block["mlp"] = {key: block.pop(key) for key in ("fc_in", "fc_out")}
        out[name] = block
    return {"params": out}


def make_teacher(key, d_model: int):
    """A fixed random target function of one token: x A + tanh(x B) C, unit-scale outputs."""
    ka, kb, kc = jax.random.split(key, 3)
    a = jax.random.normal(ka, (d_model, d_model), jnp.float32) / math.sqrt(d_model)
    b = jax.random.normal(kb, (d_model, 2 * d_model), jnp.float32) * (2.0 / math.sqrt(d_model))
    c = jax.random.normal(kc, (2 * d_model, d_model), jnp.float32) / math.sqrt(2 * d_model)

    def teacher(x):
        return (x @ a + jnp.tanh(x @ b) @ c) / math.sqrt(2.0)

    return teacher


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="preset (default small)")
    parser.add_argument("--steps", type=int, help="training steps per model (default: 40 small, 50 large)")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the timing (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the init, the teacher and the data")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    parser.add_argument("--d-model", type=int, help="override the preset's d_model")
    parser.add_argument("--blocks", type=int, help="override the preset's number of blocks")
    parser.add_argument("--batch", type=int, help="override the preset's batch size")
    parser.add_argument("--seq", type=int, help="override the preset's sequence length")
    parser.add_argument(
        "--implementation",
        choices=("auto", "cublaslt", "xla"),
        default="auto",
        help="FusedMLP's and FusedDense's implementation (default auto: the fused kernels where "
        "they measured faster, XLA's own ops elsewhere; cublaslt: the fused kernels everywhere "
        "on a GPU; xla: never)",
    )
    parser.add_argument(
        "--layers",
        choices=["all", *LAYERS],
        default="all",
        help="train FusedMLP, FusedDense, nn.Dense or all three (default all)",
    )
    args = parser.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    return args


def setup(args, layers: str):
    """One model (``layers``: a key of LAYERS) ready to train: ``(train_step, params,
    opt_state, batch)``, where ``train_step(params, opt_state, x, y)`` is jitted and returns
    ``(params, opt_state, loss)`` and ``batch(step)`` returns that step's ``(x, y)``."""
    model = MLPStack(args.d_model, args.blocks, layers=layers, implementation=args.implementation)
    init_key, teacher_key, data_key = jax.random.split(jax.random.key(args.seed), 3)
    teacher = make_teacher(teacher_key, args.d_model)
    shape = (args.batch, args.seq, args.d_model)

    @jax.jit
    def batch(step):
        x = jax.random.normal(jax.random.fold_in(data_key, step), shape, jnp.float32)
        return x, teacher(x)

    tx = optax.adam(args.lr)

    def loss_fn(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # Every model starts from the same values: FusedMLP's are FusedDense's, nested.
    init_model = model if layers != "mlp" else model.clone(layers="fused")
    params = init_model.init(init_key, jnp.zeros((1, 1, args.d_model), jnp.float32))
    if layers == "mlp":
        params = nest_mlp_params(params)
    return train_step, params, tx.init(params), batch


def train(args, layers: str, prepared=None) -> dict:
    """Trains one model (``layers``: a key of LAYERS) for ``args.steps`` steps; returns its
    losses and step times. ``prepared``: what ``setup(args, layers)`` returned, for a
    caller that times the same (then compiled) train step afterwards."""
    train_step, params, opt_state, batch = prepared or setup(args, layers)
    losses, times = [], []
    for step in range(args.steps):
        x, y = jax.block_until_ready(batch(step))
        start = time.perf_counter()
        params, opt_state, loss = jax.block_until_ready(train_step(params, opt_state, x, y))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    step_s = statistics.median(times[args.warmup :])
    tokens = args.batch * args.seq
    return {
        "layer": LAYERS[layers],
        "losses": losses,
        "step_ms": 1e3 * step_s,
        "tokens_per_s": tokens / step_s,
        "compile_s": times[0],
    }


def main(argv=None, prepared=None) -> dict:
    """Trains the selected models; returns {"config": ..., "mlp": ..., "fused": ..., "dense": ...}
    (the models trained) and, on a GPU, "speedup": {"mlp": ..., "fused": ...} over nn.Dense.
    ``prepared``: {key of LAYERS: ``setup(args, key)``} for models already set up."""
    args = parse_args(argv)
    tokens = args.batch * args.seq
    device = jax.devices()[0]
    print(
        f"{device.platform} ({device.device_kind}): d_model {args.d_model}, {args.blocks} blocks, "
        f"{tokens} tokens/step ({args.batch}x{args.seq}), bfloat16 compute, float32 params, "
        f"{args.steps} steps (median of the last {args.steps - args.warmup})"
    )
    keys = ("size", "d_model", "blocks", "batch", "seq", "steps", "implementation")
    results = {"config": {k: getattr(args, k) for k in keys}}
    for key in LAYERS:
        if args.layers in ("all", key):
            results[key] = train(args, key, (prepared or {}).get(key))

    print(f"{'layer':<12}{'first loss':>12}{'final loss':>12}{'step (median)':>16}{'tokens/s':>14}")
    for key in LAYERS:
        if key in results:
            r = results[key]
            print(
                f"{r['layer']:<12}{r['losses'][0]:>12.4f}{r['losses'][-1]:>12.4f}"
                f"{r['step_ms']:>13.2f} ms{r['tokens_per_s']:>14,.0f}"
            )
    if device.platform != "gpu":
        print("No cuBLASLt kernel ran: on a CPU every layer runs its XLA path, so no speed-up is shown.")
    elif "dense" in results:
        results["speedup"] = {}
        for key in ("mlp", "fused"):
            if key in results:
                speedup = results["dense"]["step_ms"] / results[key]["step_ms"]
                results["speedup"][key] = speedup
                print(f"{LAYERS[key]} step time speed-up over nn.Dense: {speedup:.2f}x")
    return results


if __name__ == "__main__":
    main()
