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
    python examples/train_transformer_mlp.py --size large --fp8   # + FP8: ours and Flax's
    python examples/train_transformer_mlp.py --size large --devices 8   # data parallel, 8 devices

``--fp8`` trains four models step by step in turn (interleaved, with a progress bar):
``nn.Dense`` and ``FusedMLP`` in bfloat16, ``FusedMLP(fp8=DelayedScaling())`` and
``nn.Dense(dot_general_cls=Fp8DirectDotGeneralOp)`` (Flax's FP8), and draws their loss
curves into one PNG (``--plot``). Their FP8 scaling state lives in Flax's
``_overwrite_with_gradient`` collection; the train step overwrites it with its gradient,
as Flax's ``TrainState`` does. On a CPU the FP8 layers run emulated: no FP8 kernel runs.

``--devices N`` trains data-parallel on the first N devices: each device gets ``--batch``
sequences (the step's batch is N times that), parameters and optimizer state are
replicated, and the gradients are summed by XLA. The table then also shows tokens per
second per device, to compare with the same command on one device.

Needs the examples' extra: pip install -e ".[examples]".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jax_epilog import fp8
from jax_epilog.linen import OVERWRITE_WITH_GRADIENT, FusedDense, FusedMLP

SIZES = {
    # d_model, blocks, batch, seq (tokens per step = batch * seq), default steps
    "small": {"d_model": 128, "blocks": 2, "batch": 8, "seq": 64, "steps": 40},
    "large": {"d_model": 1024, "blocks": 4, "batch": 8, "seq": 1024, "steps": 50},
}
LAYERS = {"mlp": "FusedMLP", "fused": "FusedDense", "dense": "nn.Dense"}
# --fp8: the bfloat16 pair and the FP8 pair, trained in turn.
FP8_LAYERS = {"dense": "nn.Dense", "mlp": "FusedMLP", "mlp_fp8": "FusedMLP FP8", "flax_fp8": "Flax FP8"}
NAMES = LAYERS | FP8_LAYERS


class MLPBlock(nn.Module):
    """Pre-LayerNorm feed-forward block with a residual connection."""

    d_model: int
    layers: str = "fused"  # a key of LAYERS
    dtype: jnp.dtype = jnp.bfloat16
    implementation: str = "auto"

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=self.dtype, name="ln")(x)
        if self.layers in ("mlp", "mlp_fp8"):  # the same parameters as "fused", under the same names
            recipe = fp8.DelayedScaling() if self.layers == "mlp_fp8" else None
            h = FusedMLP(
                (4 * self.d_model, self.d_model), ("gelu", None), layer_names=("fc_in", "fc_out"),
                dtype=self.dtype, implementation=self.implementation, fp8=recipe, name="mlp",
            )(h)  # fmt: skip
        elif self.layers == "fused":
            dense = functools.partial(FusedDense, dtype=self.dtype, implementation=self.implementation)
            h = dense(4 * self.d_model, activation="gelu", name="fc_in")(h)
            h = dense(self.d_model, name="fc_out")(h)
        else:  # "dense", or "flax_fp8": Flax's FP8 dot
            dot = fp8_ops.Fp8DirectDotGeneralOp if self.layers == "flax_fp8" else None
            dense = functools.partial(nn.Dense, dtype=self.dtype, dot_general_cls=dot)
            h = jax.nn.gelu(dense(4 * self.d_model, name="fc_in")(h), approximate=True)
            h = dense(self.d_model, name="fc_out")(h)
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
        choices=["all", *NAMES],
        default="all",
        help="train one model, or all (default: FusedMLP, FusedDense and nn.Dense; with --fp8 "
        "nn.Dense, FusedMLP, FusedMLP FP8 and Flax FP8)",
    )
    parser.add_argument("--fp8", action="store_true", help="the FP8 comparison (see above)")
    parser.add_argument(
        "--devices", type=int, default=1, help="data parallel over this many devices (default 1; see above)"
    )
    parser.add_argument(
        "--no-donate",
        dest="donate",
        action="store_false",
        help="do not donate the parameters and optimizer state to the train step (by default "
        "they are donated, so XLA reuses their buffers)",
    )
    parser.add_argument(
        "--plot", default="train_transformer_mlp_fp8.png", help="--fp8's loss curves (PNG; '' for none)"
    )
    args = parser.parse_args(argv)
    for name, value in SIZES[args.size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.steps <= args.warmup:
        parser.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if not 1 <= args.devices <= jax.device_count():
        parser.error(f"--devices {args.devices}: this machine has {jax.device_count()} devices")
    return args


def placements(args):
    """(batch's, parameters') shardings for ``--devices``; (None, None) on one device."""
    if args.devices == 1:
        return None, None
    mesh = jax.make_mesh(
        (args.devices,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[: args.devices]
    )
    return NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())


@dataclasses.dataclass
class Run:
    """One model ready to train: its jitted ``train_step(variables, opt_state, x, y) ->
    (variables, opt_state, loss)``, its current state and ``batch(step) -> (x, y)``. The
    step donates the state it is given (as a training loop should: XLA then writes the new
    state into the old one's buffers, at the same addresses every step), so ``step``
    carries the state from call to call; the arrays a caller held before are gone."""

    train_step: Callable
    variables: dict
    opt_state: Any
    batch: Callable

    def step(self, x, y) -> jax.Array:
        """One train step on (x, y); returns its loss (not waited for)."""
        self.variables, self.opt_state, loss = self.train_step(self.variables, self.opt_state, x, y)
        return loss

    def lower(self, x, y):
        return self.train_step.lower(self.variables, self.opt_state, x, y)


def setup(args, layers: str) -> Run:
    """One model (``layers``: a key of LAYERS) ready to train."""
    model = MLPStack(args.d_model, args.blocks, layers=layers, implementation=args.implementation)
    init_key, teacher_key, data_key = jax.random.split(jax.random.key(args.seed), 3)
    teacher = make_teacher(teacher_key, args.d_model)
    shape = (args.batch * args.devices, args.seq, args.d_model)
    rows, replicated = placements(args)

    @functools.partial(jax.jit, out_shardings=rows)
    def batch(step):
        x = jax.random.normal(jax.random.fold_in(data_key, step), shape, jnp.float32)
        return x, teacher(x)

    tx = optax.adam(args.lr)

    def loss_fn(variables, x, y):
        return jnp.mean((model.apply(variables, x) - y) ** 2)

    @functools.partial(jax.jit, donate_argnums=(0, 1) if args.donate else ())
    def train_step(variables, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(variables, x, y)
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        new = {"params": optax.apply_updates(variables["params"], updates)}
        if OVERWRITE_WITH_GRADIENT in grads:  # FP8 state: its gradient is its next value
            new[OVERWRITE_WITH_GRADIENT] = grads[OVERWRITE_WITH_GRADIENT]
        return new, opt_state, loss

    # Every model starts from the same values: FusedMLP's are FusedDense's, nested.
    sample = jnp.zeros((1, 1, args.d_model), jnp.float32)
    base = model.clone(layers="fused" if layers in ("mlp", "mlp_fp8") else "dense").init(init_key, sample)
    variables = nest_mlp_params(base) if layers in ("mlp", "mlp_fp8") else base
    if layers in ("mlp_fp8", "flax_fp8"):  # the same parameters, and a fresh FP8 state
        state = model.init(init_key, sample)[OVERWRITE_WITH_GRADIENT]
        variables = {"params": variables["params"], OVERWRITE_WITH_GRADIENT: state}
    if replicated is not None:
        variables = jax.device_put(variables, replicated)
    return Run(train_step, variables, tx.init(variables["params"]), batch)


def _timed_step(run: Run, step: int) -> tuple[float, float]:
    """(loss, seconds) of train step ``step``: its batch made first, the step waited for."""
    x, y = jax.block_until_ready(run.batch(step))
    start = time.perf_counter()
    loss = jax.block_until_ready(run.step(x, y))
    return float(loss), time.perf_counter() - start


def _summary(args, layers: str, losses, times) -> dict:
    step_s = statistics.median(times[args.warmup :])
    return {
        "layer": NAMES[layers], "losses": losses, "step_ms": 1e3 * step_s,
        "last_mean_loss": statistics.mean(losses[-5:]),
        "tokens_per_s": args.batch * args.devices * args.seq / step_s, "compile_s": times[0],
    }  # fmt: skip


def train(args, layers: str, prepared: Run | None = None) -> dict:
    """Trains one model (``layers``: a key of LAYERS) for ``args.steps`` steps; returns its
    losses and step times. ``prepared``: what ``setup(args, layers)`` returned (it then
    holds the trained state), for a caller that times the compiled step afterwards."""
    run = prepared or setup(args, layers)
    losses, times = zip(*(_timed_step(run, step) for step in range(args.steps)))
    return _summary(args, layers, list(losses), list(times))


def train_in_turn(args, keys, prepared=None) -> dict:
    """Trains the models ``keys`` step by step in turn (each step of every model before the
    next step of any: the GPU's drift touches them alike), with a progress bar."""
    from tqdm import tqdm

    runs = {key: (prepared or {}).get(key) or setup(args, key) for key in keys}
    losses, times = {key: [] for key in keys}, {key: [] for key in keys}
    for step in tqdm(range(args.steps), desc="training in turn", unit="step"):
        for key, run in runs.items():
            loss, seconds = _timed_step(run, step)
            losses[key].append(loss)
            times[key].append(seconds)
    return {key: _summary(args, key, losses[key], times[key]) for key in keys}


def plot_losses(results: dict, keys, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for key in keys:
        r = results[key]
        ax.plot(r["losses"], label=f"{r['layer']} ({r['tokens_per_s']:,.0f} tokens/s)")
    ax.set(xlabel="step", ylabel="loss (MSE)", yscale="log", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"loss curves: {path}")


def main(argv=None, prepared=None) -> dict:
    """Trains the selected models; returns {"config": ..., key: {...} per model trained} and,
    on a GPU, "speedup": {key: ...} over nn.Dense. ``prepared``: {key: ``setup(args, key)``}
    for models already set up."""
    args = parse_args(argv)
    tokens = args.batch * args.devices * args.seq
    device = jax.devices()[0]
    where = f"{args.devices} x " if args.devices > 1 else ""
    print(
        f"{where}{device.platform} ({device.device_kind}): d_model {args.d_model}, {args.blocks} blocks, "
        f"{tokens} tokens/step ({args.batch * args.devices}x{args.seq}), bfloat16 compute, float32 params, "
        f"{args.steps} steps (median of the last {args.steps - args.warmup})"
    )
    keys = ("size", "d_model", "blocks", "batch", "seq", "steps", "implementation", "fp8", "devices")
    results = {"config": {k: getattr(args, k) for k in keys}}
    table = FP8_LAYERS if args.fp8 else LAYERS
    chosen = [key for key in table if args.layers in ("all", key)]
    if args.fp8:
        results |= train_in_turn(args, chosen, prepared)
    else:
        for key in chosen:
            results[key] = train(args, key, (prepared or {}).get(key))

    per_device = f"{'tokens/s/device':>17}" if args.devices > 1 else ""
    print(
        f"{'layer':<14}{'first loss':>12}{'final loss':>12}{'last 5 mean':>13}{'step (median)':>16}"
        f"{'tokens/s':>14}{per_device}"
    )
    for key in chosen:
        r = results[key]
        r["tokens_per_s_per_device"] = r["tokens_per_s"] / args.devices
        print(
            f"{r['layer']:<14}{r['losses'][0]:>12.4f}{r['losses'][-1]:>12.4f}{r['last_mean_loss']:>13.4f}"
            f"{r['step_ms']:>13.2f} ms{r['tokens_per_s']:>14,.0f}"
            + (f"{r['tokens_per_s_per_device']:>17,.0f}" if args.devices > 1 else "")
        )
    if args.fp8 and args.plot:
        plot_losses(results, chosen, args.plot, f"{args.size}: d_model {args.d_model}, {device.device_kind}")
    if device.platform != "gpu":
        fp8_note = " (the FP8 layers emulated: no FP8 kernel ran)" if args.fp8 else ""
        print(
            f"No cuBLASLt kernel ran: on a CPU every layer runs its XLA path{fp8_note}, so no speed-up is shown."
        )
    elif "dense" in results:
        results["speedup"] = {}
        for key in chosen:
            if key != "dense":
                speedup = results["dense"]["step_ms"] / results[key]["step_ms"]
                results["speedup"][key] = speedup
                print(f"{NAMES[key]} step time speed-up over nn.Dense: {speedup:.2f}x")
    return results


if __name__ == "__main__":
    main()
