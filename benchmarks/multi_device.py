"""Several devices: the fused layers split over a mesh, against one device and XLA's layer.

    python -m benchmarks.multi_device [--rows 4096] [--devices N] [--no-fp8] [--out DIR]
    # on a CPU, virtual devices:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m benchmarks.multi_device --rows 64

Every split below, for every layer (``fused_dense`` ReLU and GELU, ``fused_mlp`` GELU then
none, in bfloat16; the FP8 GELU layer and block unless ``--no-fp8``), under
``AxisType.Auto`` and ``AxisType.Explicit``:

* **error**: the forward and every gradient of ``sum(sin(y))`` against the same program on
  one device, the largest difference over the largest value;
* **collectives**: those XLA put into the compiled forward and gradient programs, beside
  those of XLA's own ``act(x @ w + b)`` (the bfloat16 single layers) under the same
  shardings;
* **check**: where the rows are split, the forward gathers nothing (x stays split); in a
  column-parallel layer's forward, no collective at all (a column-then-row block's second
  layer has K split, which the rule gathers: noted, not failed); and the errors within
  5 % (bfloat16 rounds each device's partial sums; FP8 adds its own rounding).

Splits over N devices (N even; sizes must divide by N):

* ``rows``: x (M, K) split by rows over "data" (data parallel).
* ``batch+seq``: x (B, S, K) split over ("data", "seq") = (2, N/2).
* ``column``: the (first) kernel and bias split along N over "model"; in a block the
  second kernel along its K (Megatron's pairing).
* ``row``: x and the first kernel split along K over "model": the rule gathers K.
* ``uneven``: rows over "data", the program using all but the last row: gathered. (Under
  explicit sharding a split must be even: that case is left out.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_epilog as je
from jax_epilog import fp8

BF16 = jnp.bfloat16
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass(frozen=True)
class Split:
    name: str
    axes: Callable[[int], tuple[tuple[str, int], ...]]  # devices -> ((axis, size), ...)
    x: P
    kernels: tuple[P, P]  # the first and (in a block) second kernel
    bias: P  # the first bias
    sequence: bool = False  # x is (batch, sequence, K)
    cut: int = 0  # rows the program leaves out (an uneven split)
    check: str = ""  # "no gather in forward" | "no collective in forward"


SPLITS = (
    Split("rows", lambda n: (("data", n),), P("data"), (P(), P()), P(), check="no gather in forward"),
    Split(
        "batch+seq",
        lambda n: (("data", 2), ("seq", n // 2)),
        P("data", "seq"),
        (P(), P()),
        P(),
        sequence=True,
        check="no gather in forward",
    ),
    Split(
        "column",
        lambda n: (("model", n),),
        P(),
        (P(None, "model"), P("model", None)),
        P("model"),
        check="no collective in forward",
    ),
    Split("row", lambda n: (("model", n),), P(None, "model"), (P("model", None), P()), P()),
    Split("uneven", lambda n: (("data", n),), P("data"), (P(), P()), P(), cut=1),
)


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    block: bool  # two layers (fused_mlp)
    activation: str
    recipe: object = None  # an FP8 recipe, or None for bfloat16
    # "cublaslt": the fused primitives and their partitioning rule whatever the size ("auto"
    # would leave small layers to XLA's own ops); FP8 always runs the primitives
    implementation: str = "cublaslt"

    def __call__(self, x, params, states):
        """y, with the FP8 state's update discarded (the gradient carries the next state)."""
        how = {"fp8": states} if self.recipe is not None else {"implementation": self.implementation}
        if self.block:
            (w1, b1), (w2, b2) = params
            out = je.fused_mlp(x, [(w1, b1), (w2, b2)], [self.activation, None], **how)
        else:
            out = je.fused_dense(x, *params[0], activation=self.activation, **how)
        return out[0] if self.recipe is not None else out

    def states(self):
        if self.recipe is None:
            return None
        return tuple(fp8.init(self.recipe) for _ in range(2)) if self.block else fp8.init(self.recipe)


LAYERS = (
    Layer("dense relu", False, "relu"),
    Layer("dense gelu", False, "gelu"),
    Layer("mlp gelu", True, "gelu"),
    Layer("dense gelu fp8", False, "gelu", fp8.DelayedScaling()),
    Layer("mlp gelu fp8", True, "gelu", fp8.DelayedScaling()),
)


def _xla_dense(activation):
    act = jax.nn.relu if activation == "relu" else (lambda z: jax.nn.gelu(z, approximate=True))
    return lambda x, params, states: act(x @ params[0][0] + params[0][1])


def collectives(text: str) -> dict[str, int]:
    """How many of each collective a compiled program's HLO text runs (async pairs once)."""
    found = re.findall(r"\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(", text)
    return {op: found.count(op) for op in _COLLECTIVES if op in found}


def _operands(rows, k, n, split: Split, seed=0):
    rng = np.random.default_rng(seed)
    draw = lambda *shape, scale=1.0: jnp.asarray(scale * rng.standard_normal(shape), BF16)
    x = draw(rows, k) if not split.sequence else draw(2, rows // 2, k)
    params = (
        (draw(k, n, scale=k**-0.5), draw(n, scale=0.1)),
        (draw(n, k, scale=n**-0.5), draw(k, scale=0.1)),
    )
    return x, params


def _program(layer_fn, cut: int):
    def forward(x, params, states):
        return layer_fn(x[: x.shape[0] - cut] if cut else x, params, states)

    loss = lambda x, params, states: jnp.sum(jnp.sin(forward(x, params, states).astype(jnp.float32)))
    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _error(got, want) -> float:
    worst = 0.0
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        worst = max(worst, float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)))
    return worst


def run_case(split: Split, layer: Layer, mode: AxisType, devices, rows, k, n) -> dict:
    """One split x layer x axis type: errors against one device, collectives, the check."""
    axes = split.axes(len(devices))
    mesh = jax.make_mesh(
        tuple(s for _, s in axes), tuple(a for a, _ in axes), axis_types=(mode,) * len(axes), devices=devices
    )
    x, params = _operands(rows, k, n, split)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    (w1, b1), (w2, b2) = params
    sharded = (
        put(x, split.x),
        ((put(w1, split.kernels[0]), put(b1, split.bias)), (put(w2, split.kernels[1]), put(b2, P()))),
        jax.tree.map(lambda a: put(a, P()), layer.states()),
    )
    one = jax.devices()[0]
    whole = jax.device_put((x, params, layer.states()), one)
    record = {"split": split.name, "layer": layer.name, "axis_type": mode.name}
    if split.cut and mode == AxisType.Explicit:
        record["error"] = "n/a: explicit sharding types split evenly only"
        return record
    try:
        forward, grad = _program(layer, split.cut)
        record["forward error"] = _error(forward(*sharded), forward(*whole))
        record["gradient error"] = _error(grad(*sharded), grad(*whole))
        fwd_text = forward.lower(*sharded).compile().as_text()
        record["forward collectives"] = collectives(fwd_text)
        record["gradient collectives"] = collectives(grad.lower(*sharded).compile().as_text())
        record["check"] = _check(split.check, layer.block, record)
    except Exception as exc:  # noqa: BLE001 -- a case that fails is a finding, reported
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    if layer.recipe is None and not layer.block:
        try:
            _, xla_grad = _program(_xla_dense(layer.activation), split.cut)
            record["XLA gradient collectives"] = collectives(xla_grad.lower(*sharded).compile().as_text())
        except Exception as exc:  # noqa: BLE001 -- e.g. an ambiguous x @ w under explicit sharding
            record["XLA gradient collectives"] = f"{type(exc).__name__}"
    return record


def _check(rule: str, block: bool, record: dict) -> str:
    found = record["forward collectives"]
    failed, notes = [], []
    if rule == "no gather in forward" and "all-gather" in found:
        failed.append("the forward gathers")
    if rule == "no collective in forward" and found:
        if block:  # the row-parallel second layer: the rule's gather fallback, by design
            notes.append("second layer gathered (K split)")
        else:
            failed.append("the forward communicates")
    if max(record["forward error"], record["gradient error"]) > 0.05:
        failed.append("error over 5 %")
    return "FAILED: " + "; ".join(failed) if failed else "; ".join(["ok", *notes])


def measure(
    devices, rows, k, n, with_fp8=True, splits=None, layers=None, implementation="cublaslt"
) -> list[dict]:
    """Every case (``splits``, ``layers``: names to keep; ``implementation``: the bfloat16
    layers'), each printed as it is measured."""
    layers = [
        dataclasses.replace(x, implementation=implementation)
        for x in LAYERS
        if (with_fp8 or x.recipe is None) and (layers is None or x.name in layers)
    ]
    out = []
    for split in (s for s in SPLITS if splits is None or s.name in splits):
        for layer in layers:
            for mode in (AxisType.Auto, AxisType.Explicit):
                out.append(run_case(split, layer, mode, devices, rows, k, n))
                print(_line(out[-1]), flush=True)
    return out


def _counts(found) -> str:
    if isinstance(found, str) or found is None:
        return found or "—"
    return ", ".join(f"{op} {c}" for op, c in found.items()) or "none"


COLUMNS = (
    "split", "layer", "axis type", "forward error", "gradient error", "forward collectives",
    "gradient collectives", "XLA's gradient", "check",
)  # fmt: skip


def _cells(r: dict) -> list[str]:
    """One record's cells, in COLUMNS' order (a failed case: its error in the fourth)."""
    head = [r["split"], r["layer"], r["axis_type"]]
    if "error" in r:
        return [*head, f"ERROR {r['error']}"]
    return [
        *head, f"{r['forward error']:.1e}", f"{r['gradient error']:.1e}",
        _counts(r["forward collectives"]), _counts(r["gradient collectives"]),
        _counts(r.get("XLA gradient collectives")), r["check"],
    ]  # fmt: skip


def _line(r: dict) -> str:
    return " | ".join(c for c in _cells(r) if c)


def render(records: list[dict]) -> str:
    rows = [list(COLUMNS), ["---"] * len(COLUMNS)]
    rows += [cells + [""] * (len(COLUMNS) - len(cells)) for cells in map(_cells, records)]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=jax.device_count(), help="default: all")
    parser.add_argument("--rows", type=int, default=4096, help="M (default 4096)")
    parser.add_argument("--k", type=int, default=1024, help="K (default 1024)")
    parser.add_argument("--n", type=int, default=4096, help="N, the block's hidden width (default 4096)")
    parser.add_argument("--no-fp8", action="store_true", help="leave the FP8 layers out")
    parser.add_argument(
        "--implementation", default="cublaslt", choices=("cublaslt", "auto"),
        help="the bfloat16 layers' (default cublaslt: the fused path and its rule at every size)",
    )  # fmt: skip
    parser.add_argument("--out", help="folder for multi_device.json and multi_device.md")
    args = parser.parse_args(argv)
    if args.devices < 2 or args.devices % 2 or args.devices > jax.device_count():
        parser.error(f"--devices {args.devices}: an even number from 2 to {jax.device_count()}")
    devices = jax.devices()[: args.devices]
    records = measure(devices, args.rows, args.k, args.n, not args.no_fp8, implementation=args.implementation)
    title = f"{args.devices} x {devices[0].device_kind}, jax {jax.__version__}, M K N = {args.rows} {args.k} {args.n}"
    print(f"\n{title}\n{render(records)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "multi_device.json"), "w") as f:
            json.dump({"title": title, "records": records}, f, indent=1)
        with open(os.path.join(args.out, "multi_device.md"), "w") as f:
            f.write(f"{title}\n\n{render(records)}\n")
    return records


if __name__ == "__main__":
    main()
