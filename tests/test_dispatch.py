"""``jax_epilog._dispatch``: the ``implementation="auto"`` rules of fused_dense and
fused_mlp, read from the traced programs (abstract operands: nothing runs), at the
policy's numbers and at changed ones. The values of "auto"'s paths: test_dense.py,
test_mlp.py."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
from helpers import FUSED, GELU_INPUT_GRAD, WEIGHT_GRAD, jaxpr_text

from jax_epilog import ComputeType, fused_dense, fused_mlp, override_policy
from jax_epilog._dispatch import dense_implementation, mlp_choice
from jax_epilog._epilogs import Activation


def _sds(dtype, *shapes):
    return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def _layer(dtype, m, k, n):
    return _sds(dtype, (m, k), (k, n), (n,))


def _fuses(f, *args) -> bool:
    return FUSED in jaxpr_text(f, *args)


# ----------------------------------------------------------------------- fused_dense


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_auto_fuses_large_forward_passes_only(activation):
    big = _layer(jnp.bfloat16, 4096, 1024, 4096)
    f = functools.partial(fused_dense, activation=activation)
    assert _fuses(f, *big)
    # Under reverse-mode differentiation "auto" is XLA's own expression and autodiff.
    grad = jax.grad(lambda x, w, b: jnp.sum(f(x, w, b), dtype=jnp.float32), argnums=(0, 1, 2))
    assert not _fuses(grad, *big) and WEIGHT_GRAD not in jaxpr_text(grad, *big)
    # No activation (XLA fuses the bias into its own GEMM), few rows, a small layer: XLA.
    assert not _fuses(functools.partial(fused_dense, activation=None), *big)
    assert not _fuses(f, *_layer(jnp.bfloat16, 512, 8192, 4096))
    assert not _fuses(f, *_layer(jnp.bfloat16, 2048, 256, 4096))
    # Float16 as bfloat16; float32 (full or TF32: a tie and a loss for GELU) stays XLA's.
    assert _fuses(f, *_layer(jnp.float16, 4096, 1024, 4096))
    assert not _fuses(f, *_layer(jnp.float32, 4096, 1024, 4096))
    tf32 = functools.partial(f, compute_type="COMPUTE_32F_FAST_TF32")
    assert not _fuses(tf32, *_layer(jnp.float32, 4096, 1024, 4096))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize(
    "m,k,n,fused",
    [
        (8192, 1024, 4096, True),
        (8191, 1024, 4096, True),  # M does not matter: no operand's rows are M wide
        (8192, 1032, 4104, True),  # multiples of 8 that are not of 16 or 128
        # Rows the call pads. Where N pads, only GELU fuses ("gelu"): ReLU runs XLA's
        # expression on the padded rows (docs/decisions.md#auto-relu-padded-n).
        (8192, 1024, 4097, "gelu"),
        (8192, 1020, 4096, True),
        (8192, 1023, 4097, "gelu"),
        (8192, 1024, 8193, "gelu"),
        (8192, 1024, 1025, "gelu"),
        (1023, 1024, 8200, False),  # fewer than 1024 rows
        (1024, 1024, 4096, False),  # M*N*K = 2**32 < 2**33, aligned
        # Below 2**33 "auto" runs XLA's expression on the rows a fused call would pad
        (1024, 1024, 4097, "padded"),
        (4096, 1024, 1025, "padded"),
        (8192, 1020, 1020, "padded"),
        (2048, 1020, 4100, "padded"),
        (1023, 1024, 4097, False),  # fewer than 1024 rows: not padded
        (1024, 1024, 1025, False),  # M*N*K < 2**32: not padded
    ],
)
def test_auto_fuses_large_layers_whatever_their_row_widths(m, k, n, fused, activation, dtype):
    """K and N need not be multiples of 8 for "auto" to fuse a large layer: the call pads
    them (test_padding.py); below the fused size floor "auto"'s forward and gradient are
    the user's program on rows padded likewise (and without padding, the user's program);
    "cublaslt" runs the fused kernel at every size."""
    if fused == "gelu":
        fused = True if activation == "gelu" else "padded"
    args = _layer(dtype, m, k, n)
    f = functools.partial(fused_dense, activation=activation)
    assert _fuses(f, *args) == (fused is True)
    rows = -(-k // 8) * 8, -(-n // 8) * 8
    if fused == "padded":
        assert f"[{rows[0]},{rows[1]}]" in jaxpr_text(f, *args)
        grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))
        assert f"[{rows[0]},{rows[1]}]" in jaxpr_text(grad, *args)
    elif fused is False:
        xla = functools.partial(f, implementation="xla")
        lowered = [jax.jit(lambda *a, g=g: g(*a)).lower(*args).as_text() for g in (f, xla)]
        assert lowered[0] == lowered[1]
    assert _fuses(functools.partial(f, implementation="cublaslt"), *args)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize(
    "m,k,n,padded",
    [
        (8192, 1024, 4097, True),
        (8192, 4097, 1024, True),
        (2048, 1024, 4097, True),
        (4096, 1024, 1025, True),
        (8192, 1024, 4096, False),  # aligned: XLA fuses the bias into its GEMM; a tie
        (1023, 1024, 4097, False),  # too small to pad
    ],
)
def test_auto_runs_an_unaligned_layer_without_activation_on_padded_rows(dtype, m, k, n, padded):
    """Without an activation "auto" never fuses; a half-precision layer large enough for
    a fused call to pad its rows runs XLA's expression on the padded operands, forward and
    gradient; any other layer is the user's program."""
    args = _layer(dtype, m, k, n)
    f = functools.partial(fused_dense, activation=None)
    grad = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    assert not _fuses(f, *args) and not _fuses(grad, *args)
    if padded and dtype != jnp.float32:  # (float32: not measured, the user's program)
        rows = f"[{-(-k // 8) * 8},{-(-n // 8) * 8}]"
        assert rows in jaxpr_text(f, *args) and rows in jaxpr_text(grad, *args)
    else:
        xla = functools.partial(f, implementation="xla")
        lowered = [jax.jit(lambda *a, g=g: g(*a)).lower(*args).as_text() for g in (f, xla)]
        assert lowered[0] == lowered[1]


@pytest.mark.parametrize("argnums", [(0, 1, 2), (1, 2), (0,), (1,)])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_auto_gradient_of_a_fused_layer_is_the_users_program(activation, argnums):
    """Where "auto" fuses the forward, jax.grad lowers to exactly the program of the user's
    expression, whichever arguments are differentiated (a constant one adds no work)."""
    big = _layer(jnp.bfloat16, 4096, 1024, 4096)
    act = {"relu": jax.nn.relu, "gelu": functools.partial(jax.nn.gelu, approximate=True)}[activation]
    ours = lambda x, w, b: jnp.sum(fused_dense(x, w, b, activation=activation) ** 2)
    users = lambda x, w, b: jnp.sum(act(x @ w + b) ** 2)
    assert _fuses(functools.partial(fused_dense, activation=activation), *big)
    text = [
        jax.jit(jax.grad(f, argnums=argnums)).lower(*big).as_text(debug_info=False) for f in (ours, users)
    ]
    assert text[0] == text[1]


def test_auto_keeps_the_op_where_xla_cannot_reproduce_it():
    """The aux and 16-bit accumulation exist only in the op: "auto" runs it at any size."""
    args = _layer(jnp.float16, 3, 5, 7)
    assert _fuses(functools.partial(fused_dense, activation="relu", return_aux=True), *args)
    assert _fuses(functools.partial(fused_dense, compute_type="COMPUTE_16F"), *args)


def test_auto_takes_xlas_program_for_symbolic_sizes():
    """A symbolic dimension (jax.export's shape polymorphism) cannot be compared with a
    rule's numbers: XLA's expression, unpadded, and no link."""
    (batch,) = jax.export.symbolic_shape("b")
    ct = ComputeType.COMPUTE_32F
    assert dense_implementation("auto", Activation.GELU, "bfloat16", ct, False, batch, 4096, 1024) == "xla"
    assert (
        dense_implementation("auto", Activation.GELU, "bfloat16", ct, False, 8192, 4096, 1024)
        == "fused forward"
    )
    assert dense_implementation("auto", None, "bfloat16", ct, False, 8192, 4097, 1024) == "xla on padded rows"
    assert (
        dense_implementation("auto", Activation.GELU, "bfloat16", ct, True, batch, 4096, 1024) == "cublaslt"
    )
    assert dense_implementation("xla", Activation.GELU, "bfloat16", ct, False, 8192, 4096, 1024) == "xla"
    assert mlp_choice("auto", [Activation.GELU, None], "bfloat16", batch, [1024, 4096, 1024]) == (
        False,
        (False, False),
        False,
    )
    assert mlp_choice("auto", [Activation.GELU, None], "bfloat16", 8192, [1024, 4096, 1024]).link


# ---------------------------------------------------------------- the policy's numbers


def test_auto_dtypes_and_the_size_floors_decide_what_fuses():
    """``auto_dtypes``, ``auto_min_rows`` and ``auto_min_work``, changed, change which
    layers "auto" fuses."""
    f = functools.partial(fused_dense, activation="gelu")
    big32, small = _layer(jnp.float32, 4096, 1024, 4096), _layer(jnp.bfloat16, 1024, 1024, 4096)
    assert not _fuses(f, *big32) and not _fuses(f, *small)  # float32; M*N*K = 2**32
    with override_policy(auto_dtypes=("float32",)):
        assert _fuses(f, *big32) and not _fuses(f, *_layer(jnp.bfloat16, 4096, 1024, 4096))
    with override_policy(auto_min_work=2**32):
        assert _fuses(f, *small)
    with override_policy(auto_min_rows=4097):
        assert not _fuses(f, *_layer(jnp.bfloat16, 4096, 1024, 4096))


def test_auto_fuse_relu_padded_n_lets_a_relu_layer_whose_n_pads_fuse():
    relu = functools.partial(fused_dense, activation="relu")
    args = _layer(jnp.bfloat16, 8192, 1024, 4097)
    assert not _fuses(relu, *args)
    with override_policy(auto_fuse_relu_padded_n=True):
        assert _fuses(relu, *args)


# ------------------------------------------------------------------------- fused_mlp


def _block(rows, widths, dtype=jnp.bfloat16, k=1024):
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
    dims = [k, *widths]
    return sds(rows, k), [(sds(k, n), sds(n)) for k, n in itertools.pairwise(dims)]


def _grad_ops(activations, x, layers, implementation="auto"):
    mlp = functools.partial(fused_mlp, activations=activations, implementation=implementation)
    return jaxpr_text(
        jax.grad(lambda x, layers: jnp.sum(mlp(x, layers).astype(jnp.float32)), argnums=(0, 1)), x, layers
    )


@pytest.mark.parametrize("rows", [16, 8191, 8192])
@pytest.mark.parametrize("implementation", ["auto", "cublaslt", "xla"])
def test_a_gelu_feeding_a_layer_is_differentiated_in_that_layers_gemm(implementation, rows):
    """With "cublaslt" always; with "auto" from ``link_min_rows`` (8192) rows."""
    x, layers = _block(rows, (24, 8), k=8)
    linked = GELU_INPUT_GRAD in _grad_ops(("gelu", None), x, layers, implementation)
    assert linked == (implementation == "cublaslt" or (implementation == "auto" and rows >= 8192))


def test_link_min_rows_decides_where_auto_links():
    x, layers = _block(16, (24, 8), k=8)
    assert GELU_INPUT_GRAD not in _grad_ops(("gelu", None), x, layers)
    with override_policy(link_min_rows=16):
        assert GELU_INPUT_GRAD in _grad_ops(("gelu", None), x, layers)
    x64, layers64 = _block(16, (24, 8), jnp.float64, k=8)
    with override_policy(link_min_rows=16, auto_dtypes=("float64",)):  # float64 never links
        assert GELU_INPUT_GRAD not in _grad_ops(("gelu", None), x64, layers64)


def test_auto_link_fuses_large_gelu_layers_and_relu_layers_feeding_a_layer():
    """In the linked path "auto" runs the fused kernel for large GELU layers and for large
    ReLU layers whose output the next layer's GEMM reads; a last ReLU layer, whose
    consumer is unknown, and a layer without activation run XLA's expression."""
    x, layers = _block(8192, (4096, 1024, 1024, 1024))
    mlp = functools.partial(fused_mlp, activations=("gelu", "relu", None, "relu"))
    assert jaxpr_text(mlp, x, layers).count(FUSED) == 2  # the GELU and first ReLU
    assert GELU_INPUT_GRAD in _grad_ops(("gelu", "relu", None, "relu"), x, layers)
    assert _fuses(lambda x, w, b: fused_dense(x, w, b, activation="relu"), x, *layers[0])


@pytest.mark.parametrize(
    "rows,widths,activations,fused",
    [
        (8192, (4096, 1024), ("relu", None), 1),  # the measured block: its ReLU layer
        (8192, (4096, 1024, 1024), ("relu", "relu", None), 2),
        (2048, (4096, 1024), ("relu", None), 1),  # M*N*K = 2**33: large enough
        (8192, (1024, 4096), (None, "relu"), 0),  # a last ReLU layer: XLA's autodiff
        (256, (4096, 1024), ("relu", None), 0),  # too few rows for the fused forward
        (8192, (4096, 1024), ("gelu", None), None),  # GELU links instead (DGELU)
    ],
)
def test_auto_differentiates_large_relu_layers_feeding_a_layer_through_their_mask(
    rows, widths, activations, fused
):
    """Under jax.grad the "auto" stack of fused_dense calls keeps XLA's autodiff, except for
    a large ReLU layer whose output feeds the next layer: that one runs as "cublaslt" (fused
    forward, backward from its mask; docs/decisions.md#mlp-relu)."""
    ops = _grad_ops(activations, *_block(rows, widths))
    if fused is None:
        assert GELU_INPUT_GRAD in ops
    else:
        # fused_dense's "auto" forward under jax.grad is XLA's expression: only a layer
        # differentiated as "cublaslt" leaves a fused_matmul in the gradient's program.
        assert ops.count(FUSED) == fused


@pytest.mark.parametrize(
    "rows,d,dtype,activations,stacked",
    [
        (512, 1024, "bfloat16", ("relu", None), True),
        (1000, 768, "bfloat16", ("gelu", None), True),  # a GELU feeding a layer: no link here
        (1024, 1024, "bfloat16", ("gelu", "relu", None), True),
        (1281, 1024, "bfloat16", ("gelu", None), True),
        (1536, 768, "bfloat16", ("relu", None), True),
        (1000, 1024, "float16", ("relu", None), True),
        (1536, 1024, "float16", ("gelu", "relu", None), True),
        (511, 1024, "bfloat16", ("relu", None), False),
        (1537, 1024, "bfloat16", ("gelu", None), False),
        (1537, 1024, "float16", ("relu", None), False),
        (512, 512, "bfloat16", ("relu", None), False),  # M*N*K = 2**29: too small
        (1024, 512, "bfloat16", ("relu", None), False),  # 2**30
        (1024, 512, "float16", ("relu", None), False),
        (1000, 1024, "float32", ("gelu", None), False),  # not measured: fused_dense's rule
        (1000, 1024, "bfloat16", ("relu",), False),  # one layer is fused_dense's call
    ],
)
def test_auto_runs_every_layer_of_a_mid_size_half_precision_block_as_cublaslt(
    rows, d, dtype, activations, stacked
):
    """With "auto" a bfloat16 or float16 block on ``stack_rows`` (512-1536) rows with a
    layer of M*N*K >= ``stack_min_work`` (2**31) is the stack of "cublaslt" calls
    (measured faster than XLA there); elsewhere at these sizes it is XLA's autodiff."""
    dims = [d, *(4 * d if i % 2 == 0 else d for i in range(len(activations)))]
    x, layers = _block(rows, dims[1:], jnp.dtype(dtype), k=d)
    ops = _grad_ops(activations, x, layers)
    assert ops.count(FUSED) == (len(activations) if stacked else 0)
    assert GELU_INPUT_GRAD not in ops
    # the stack's kernel and bias gradients are "cublaslt"'s: BGRADA except for ReLU layers
    assert ops.count(WEIGHT_GRAD) == (sum(act != "relu" for act in activations) if stacked else 0)


def test_stack_rows_and_stack_min_work_decide_where_auto_stacks():
    x, layers = _block(2048, (4096, 1024))
    assert _grad_ops(("relu", None), x, layers).count(FUSED) == 1  # a large ReLU layer feeding one
    with override_policy(stack_rows=(2048, 4096)):
        assert _grad_ops(("relu", None), x, layers).count(FUSED) == 2
    x, layers = _block(1024, (1024, 1024))  # M*N*K = 2**30
    assert _grad_ops(("gelu", None), x, layers).count(FUSED) == 0
    with override_policy(stack_min_work=2**30):
        assert _grad_ops(("gelu", None), x, layers).count(FUSED) == 2


@pytest.mark.parametrize(
    "rows,widths,activations,fused",
    [
        (8192, (4100, 1024), ("gelu", None), True),  # links (DGELU), every call padded
        (8192, (4096, 1020), ("relu", None), True),  # a large ReLU layer feeding a layer
        (8192, (4097, 1024, 1024), ("relu", "relu", None), True),
        (8192, (4097, 100), ("gelu", None), False),  # the DGELU link 8192x4097x100 < 2**32: not padded
        (1024, (4092, 1024), ("relu", None), False),  # a mid-size block, too small to pad
    ],
)
def test_auto_rules_need_rows_the_calls_can_pad(rows, widths, activations, fused):
    """Each of "auto"'s cuBLASLt rules needs every layer's K and N multiples of 8, or the
    layer large enough (1024 rows, M*N*K >= 2**32) for its calls to pad them; the same
    blocks with aligned widths always link, fuse or stack."""
    assert ("jax_epilog_" in _grad_ops(activations, *_block(rows, widths))) == fused
    assert "jax_epilog_" in _grad_ops(activations, *_block(rows, tuple(w + (-w) % 8 for w in widths)))
