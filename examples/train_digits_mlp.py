"""Train an MLP of FusedDense layers on scikit-learn's handwritten digits (8x8 images, 10 classes).

The data ships with scikit-learn (no download): 1797 images, split 80/20 into train and test
with a fixed seed, features standardized on the training set. The model is
64 -> 256 (ReLU) -> 128 (ReLU) -> 10, each layer a ``jax_epilog.linen.FusedDense`` (matmul,
bias and ReLU in one cuBLASLt kernel on a GPU; plain JAX on a CPU), trained with Adam on
shuffled minibatches. ``--baseline`` trains the same model, from the same initial parameters,
with ``flax.linen.Dense`` followed by ``jax.nn.relu``.

    python examples/train_digits_mlp.py [--epochs 20] [--seed 0] [--baseline]

Needs the examples' extra: pip install -e ".[examples]" (flax, optax, scikit-learn, tqdm).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler
from tqdm import tqdm

from jax_epilog.linen import FusedDense


class MLP(nn.Module):
    """ReLU MLP. The layers are named, so the FusedDense and nn.Dense variants have the same
    parameter tree and draw the same initial parameters from the same key."""

    hidden: Sequence[int] = (256, 128)
    classes: int = 10
    fused: bool = True
    implementation: str = "cublaslt"  # FusedDense's; see --implementation

    @nn.compact
    def __call__(self, x):
        for i, features in enumerate(self.hidden):
            name = f"fc{i + 1}"
            if self.fused:
                x = FusedDense(features, activation="relu", implementation=self.implementation, name=name)(x)
            else:
                x = jax.nn.relu(nn.Dense(features, name=name)(x))
        if self.fused:
            return FusedDense(self.classes, implementation=self.implementation, name="head")(x)
        return nn.Dense(self.classes, name="head")(x)


def load_data(seed: int, test_size: float = 0.2):
    """Standardized float32 features and int32 labels: (x_train, y_train, x_test, y_test)."""
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data, digits.target, test_size=test_size, random_state=seed, stratify=digits.target
    )
    scaler = StandardScaler().fit(x_train)
    x_train, x_test = (scaler.transform(x).astype(np.float32) for x in (x_train, x_test))
    return x_train, y_train.astype(np.int32), x_test, y_test.astype(np.int32)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--epochs", type=int, default=20, help="passes over the training set (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the init and the shuffling")
    parser.add_argument("--batch-size", type=int, default=64, help="minibatch size (default 64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=[256, 128], help="hidden widths (default 256 128)"
    )
    parser.add_argument(
        "--baseline", action="store_true", help="use flax.linen.Dense + relu instead of FusedDense"
    )
    parser.add_argument(
        "--implementation",
        choices=("cublaslt", "auto", "xla"),
        default="cublaslt",
        help="FusedDense's implementation (default cublaslt: the fused kernel on a GPU; auto picks "
        "XLA's own path for training, where it measured faster)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Trains and evaluates; returns the per-epoch mean losses, accuracies and wall time."""
    args = parse_args(argv)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    layer = "nn.Dense" if args.baseline else "FusedDense"
    model = MLP(hidden=tuple(args.hidden), fused=not args.baseline, implementation=args.implementation)
    tx = optax.adam(args.lr)

    def loss_fn(params, x, y):
        logits = model.apply(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def predict(params, x):
        return jnp.argmax(model.apply(params, x), axis=-1)

    start = time.perf_counter()
    params = model.init(jax.random.key(args.seed), jnp.zeros((1, x_train.shape[1]), jnp.float32))
    opt_state = tx.init(params)
    shuffle = np.random.default_rng(args.seed)
    steps_per_epoch = len(x_train) // args.batch_size  # full batches only: one compiled shape
    epoch_losses = []
    with tqdm(
        total=args.epochs * steps_per_epoch, desc=f"{layer} MLP", unit="step", disable=args.no_progress
    ) as bar:
        for epoch in range(args.epochs):
            order = shuffle.permutation(len(x_train))
            losses = []
            for i in range(steps_per_epoch):
                idx = order[i * args.batch_size : (i + 1) * args.batch_size]
                params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
                losses.append(loss)
                bar.update(1)
            epoch_losses.append(float(jnp.mean(jnp.stack(losses))))
            bar.set_postfix(epoch=epoch + 1, loss=f"{epoch_losses[-1]:.4f}")
    test_accuracy = float(np.mean(np.asarray(predict(params, x_test)) == y_test))
    train_accuracy = float(np.mean(np.asarray(predict(params, x_train)) == y_train))
    seconds = time.perf_counter() - start
    print(
        f"{len(x_train)} train / {len(x_test)} test images on {jax.default_backend()}: "
        f"final loss {epoch_losses[-1]:.4f}, train accuracy {100 * train_accuracy:.1f}%"
    )
    print(f"test accuracy {100 * test_accuracy:.1f}% ({layer}, {args.epochs} epochs, {seconds:.1f} s)")
    return {
        "layer": layer,
        "losses": epoch_losses,
        "test_accuracy": test_accuracy,
        "train_accuracy": train_accuracy,
        "seconds": seconds,
    }


if __name__ == "__main__":
    main()
