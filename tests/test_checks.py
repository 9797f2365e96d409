"""``jax_epilog._checks``: every argument the ops cannot take raises at trace time, with a
message that names the function (and the layer), the bad value and what is allowed."""

from __future__ import annotations

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_epilog import ComputeType, fused_dense, fused_mlp
from jax_epilog._checks import reverse_mode_only

F32 = jnp.float32
S = jax.ShapeDtypeStruct
cublaslt = functools.partial(fused_dense, implementation="cublaslt")


def _arr(shape, dtype=F32):
    return jnp.ones(shape, dtype)


def _raises(exc, call, *needles):
    """``call()`` raises ``exc`` whose message contains every needle (in any order)."""
    with pytest.raises(exc, match=re.escape(needles[0])) as info:
        call()
    message = str(info.value)
    for needle in needles[1:]:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


@contextlib.contextmanager
def count_backend_compiles():
    """The XLA compilations inside the block (jax.monitoring events)."""
    from jax import monitoring

    events = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            events.append(kwargs)

    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        monitoring.unregister_event_duration_listener(listener)


# ------------------------------------------------------------------- shapes and dtypes


def test_error_k_mismatch():
    _raises(ValueError, lambda: fused_dense(_arr((3, 5)), _arr((6, 7))), "last dimension 5", "K=6", "(6, 7)")


def test_error_bias_shape():
    _raises(ValueError, lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), _arr((6,))), "(6,)", "(7,)")
    _raises(
        ValueError, lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), _arr((1, 7))), "(1, 7)", "(N,) = (7,)"
    )


@pytest.mark.parametrize("shape", [(5,), (5, 7, 1)], ids=["rank1", "rank3"])
def test_error_kernel_rank(shape):
    _raises(ValueError, lambda: fused_dense(_arr((3, 5)), _arr(shape)), f"got shape {shape}", "(K, N)")


def test_error_scalar_x():
    _raises(
        ValueError, lambda: fused_dense(jnp.asarray(1.0, F32), _arr((5, 7))), "scalar of shape ()", "(..., K)"
    )


@pytest.mark.parametrize("dtype", ["int32", "complex64", "bool", "uint8"])
def test_error_unsupported_x_dtype(dtype):
    _raises(
        TypeError,
        lambda: fused_dense(_arr((3, 5), dtype), _arr((5, 7), dtype)),
        f"dtype {dtype}", "float16", "bfloat16", "float32", "float64",
    )  # fmt: skip


def test_error_mixed_x_and_kernel_dtypes():
    _raises(
        TypeError,
        lambda: fused_dense(_arr((3, 5)), _arr((5, 7), jnp.float16)),
        "kernel dtype float16",
        "x dtype float32",
    )


@pytest.mark.parametrize(
    "x_dtype, b_dtype, allowed",
    [
        ("float32", "float16", "['float32']"),
        ("float32", "float64", "['float32']"),
        ("float64", "float32", "['float64']"),
        ("bfloat16", "float16", "['bfloat16', 'float32']"),
        ("float16", "bfloat16", "['float16', 'float32']"),
    ],
)
def test_error_bias_dtype(x_dtype, b_dtype, allowed):
    _raises(
        TypeError,
        lambda: fused_dense(_arr((3, 5), x_dtype), _arr((5, 7), x_dtype), _arr((7,), b_dtype)),
        f"bias dtype {b_dtype}",
        f"allowed: {allowed}",
    )


@pytest.mark.parametrize("which", ["x", "kernel", "bias"])
def test_error_python_list(which):
    args = {"x": _arr((3, 5)), "kernel": _arr((5, 7)), "bias": _arr((7,))}
    args[which] = np.asarray(args[which]).tolist()
    _raises(
        TypeError,
        lambda: fused_dense(args["x"], args["kernel"], args["bias"]),
        f"{which} must be",
        "JAX or NumPy array",
        "got list",
    )


# --------------------------------------------------------------------- activations


def test_error_unknown_activation():
    msg = _raises(
        ValueError,
        lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), activation="tanh"),
        "'tanh'",
        "'relu'",
        "'gelu'",
    )
    assert "None" in msg


@pytest.mark.parametrize("name", ["gelu_erf", "gelu_exact", "GELU"])
def test_error_exact_gelu_points_to_tanh_approximation(name):
    _raises(
        ValueError,
        lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), activation=name),
        repr(name), "'gelu'", "tanh approximation", "approximate=False",
    )  # fmt: skip


class _Nameless:
    def __call__(self, z):
        return z


@pytest.mark.parametrize(
    "function, hint",
    [
        (jax.nn.relu, "; pass 'relu'"),
        (jax.nn.gelu, "; pass 'gelu'"),
        (jnp.tanh, ""),  # no activation of that name: no hint
        (lambda z: z, ""),
        (functools.partial(jax.nn.gelu, approximate=True), "; pass 'gelu'"),
        (_Nameless(), ""),
    ],
    ids=["jax.nn.relu", "jax.nn.gelu", "tanh", "lambda", "partial-gelu", "nameless"],
)
def test_an_activation_function_is_refused_with_its_name_as_the_fix(function, hint):
    """``activation=jax.nn.relu`` is a TypeError saying to pass the name (the epilog
    applies a named activation; a function cannot be fused); no hint for a function of
    another name."""
    msg = _raises(
        TypeError,
        lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), activation=function),
        "fused_dense: activation must be a name, not a function",
        "allowed: (None, 'relu', 'gelu')",
    )
    assert ("; pass" in msg) == bool(hint) and hint in msg, msg


# -------------------------------------------------------------------- compute types


@pytest.mark.parametrize("value", ["COMPUTE_99F", "compute_32f", "", 3.0], ids=repr)
def test_error_unknown_compute_type(value):
    _raises(
        ValueError,
        lambda: fused_dense(_arr((3, 5)), _arr((5, 7)), compute_type=value),
        f"unknown compute_type {value!r}",
        "allowed for float32 operands: ['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC', 'COMPUTE_32F_FAST_TF32'",
    )


@pytest.mark.parametrize(
    "x_dtype, b_dtype, compute_type, allowed",
    [
        ("bfloat16", None, "COMPUTE_16F", "['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC']"),
        ("float16", None, "COMPUTE_32F_FAST_TF32", "['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC', 'COMPUTE_16F'"),
        ("float16", "float32", "COMPUTE_16F", "['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC']"),
        (
            "float32",
            None,
            "COMPUTE_16F",
            (
                "['COMPUTE_32F', 'COMPUTE_32F_PEDANTIC', 'COMPUTE_32F_FAST_TF32', 'COMPUTE_32F_FAST_16F', "
                "'COMPUTE_32F_FAST_16BF']"
            ),
        ),
        ("float64", None, "COMPUTE_32F", "['COMPUTE_64F', 'COMPUTE_64F_PEDANTIC']"),
    ],
)
def test_error_compute_type_invalid_for_dtype(x_dtype, b_dtype, compute_type, allowed):
    bias = None if b_dtype is None else _arr((7,), b_dtype)
    needles = [f"compute_type {compute_type} cannot run {x_dtype} operands", f"allowed: {allowed}"]
    if b_dtype == "float32":
        needles.append("with a float32 bias")
    for ct in (compute_type, ComputeType[compute_type]):
        _raises(
            ValueError,
            lambda ct=ct: fused_dense(_arr((3, 5), x_dtype), _arr((5, 7), x_dtype), bias, compute_type=ct),
            *needles,
        )


# -------------------------------------------------- implementation and return_aux


@pytest.mark.parametrize("bad", ["cuda", "XLA", None, 1])
def test_unknown_implementation_names_the_allowed_ones(bad):
    with pytest.raises(ValueError, match=r"unknown implementation .*allowed: \('auto', 'cublaslt', 'xla'\)"):
        fused_dense(_arr((3, 5)), _arr((5, 7)), implementation=bad)


@pytest.mark.parametrize("bad", ["no", 1, None])
def test_return_aux_must_be_a_bool(bad):
    with pytest.raises(TypeError, match=rf"return_aux must be True or False, got {bad!r}"):
        fused_dense(_arr((3, 5)), _arr((5, 7)), activation="relu", return_aux=bad)
    _, aux = fused_dense(_arr((3, 5)), _arr((5, 7)), activation="relu", return_aux=np.bool_(True))
    assert aux.dtype == np.uint8  # a NumPy bool is a bool


def test_xla_cannot_return_the_aux():
    with pytest.raises(
        ValueError, match=r"return_aux=True .*allowed with return_aux: \('auto', 'cublaslt'\)"
    ):
        fused_dense(_arr((3, 5)), _arr((5, 7)), activation="relu", return_aux=True, implementation="xla")


def test_xla_refuses_a_compute_type_it_cannot_reproduce():
    with pytest.raises(
        ValueError, match="implementation='xla' cannot accumulate as compute_type COMPUTE_16F"
    ):
        fused_dense(
            _arr((3, 5), "float16"), _arr((5, 7), "float16"), compute_type="COMPUTE_16F", implementation="xla"
        )


# --------------------------------------------------------------------- trace time


@pytest.mark.parametrize(
    "args, kwargs, exc, needle",
    [
        ((S((3, 5), F32), S((6, 7), F32)), {}, ValueError, "must equal kernel's first dimension K=6"),
        ((S((3, 5), F32), S((5, 7), F32), S((1, 7), F32)), {}, ValueError, "bias must have shape"),
        ((S((3, 5), jnp.int32), S((5, 7), jnp.int32)), {}, TypeError, "x has dtype int32"),
        ((S((3, 5), F32), S((5, 7), jnp.float16)), {}, TypeError, "kernel dtype float16"),
        ((S((3, 5), F32), S((5, 7), F32), S((7,), jnp.float16)), {}, TypeError, "bias dtype float16"),
        ((S((3, 5), F32), S((5, 7), F32)), {"activation": "tanh"}, ValueError, "unknown activation"),
        (
            (S((3, 5), jnp.bfloat16), S((5, 7), jnp.bfloat16)),
            {"compute_type": "COMPUTE_16F"},
            ValueError,
            "cannot run bfloat16",
        ),
        ((S((3, 5), F32), S((5,), F32)), {}, ValueError, "kernel must have shape (K, N)"),
    ],
    ids=["K", "bias-rank", "int32", "mixed", "bias-dtype", "activation", "compute-type", "kernel-rank"],
)
def test_errors_raise_at_trace_time(args, kwargs, exc, needle):
    """Nothing is compiled, let alone run, before an error: jit's lowering and
    eval_shape raise the same."""
    with count_backend_compiles() as compiles:
        with pytest.raises(exc, match=re.escape(needle)):
            jax.jit(functools.partial(cublaslt, **kwargs)).lower(*args)
        with pytest.raises(exc, match=re.escape(needle)):
            jax.eval_shape(lambda *a: cublaslt(*a, **kwargs), *args)
    assert not compiles


# -------------------------------------------------------------------- forward mode


@pytest.mark.parametrize("mode", ["jvp", "jacfwd"])
def test_forward_mode_through_the_op_names_fused_dense_and_the_fix(mode):
    """The fused op is differentiable in reverse mode only: ``jax.jvp`` (or ``jacfwd``)
    through implementation="cublaslt" raises a TypeError naming fused_dense and the
    implementations whose forward mode works, instead of JAX's generic message."""
    x, w, b = _arr((3, 5)), _arr((5, 7)), _arr((7,))
    layer = lambda x: cublaslt(x, w, b, activation="relu")
    with pytest.raises(TypeError) as info:
        jax.jvp(layer, (x,), (x,)) if mode == "jvp" else jax.jacfwd(layer)(x)
    message = str(info.value)
    assert message.startswith(
        "fused_dense: forward-mode autodiff (jax.jvp, jax.jacfwd) cannot run through the fused op"
    )
    assert "implementation='auto'" in message and "implementation='xla'" in message
    for implementation in ("auto", "xla"):  # the fix works
        fixed = functools.partial(fused_dense, activation="relu", implementation=implementation)
        jax.jvp(lambda x, fixed=fixed: fixed(x, w, b), (x,), (x,))


def test_forward_mode_through_a_linked_fused_mlp_names_fused_mlp_and_the_fix():
    x, w1, w2 = _arr((4, 3)), _arr((3, 5)), _arr((5, 2))
    with pytest.raises(TypeError) as info:
        jax.jvp(
            lambda x: fused_mlp(x, [(w1, None), (w2, None)], ("gelu", None), implementation="cublaslt"),
            (x,),
            (x,),
        )
    message = str(info.value)
    assert message.startswith("fused_mlp: forward-mode autodiff") and "implementation='xla'" in message


def test_reverse_mode_only_lets_other_type_errors_through():
    with pytest.raises(TypeError, match="^something else$"), reverse_mode_only("fused_dense"):
        raise TypeError("something else")


# ----------------------------------------------------------------------- fused_mlp


@pytest.mark.parametrize(
    "layers_fn,activations,error,match",
    [
        (lambda w1, b1, w2, b2: [(w1, b1), (w2, b2)], "gelu", TypeError, "activations must be a sequence"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w2, b2)], ["gelu"], ValueError, "2 layers and 1 activations"),
        (lambda w1, b1, w2, b2: [], [], ValueError, "at least one layer"),
        (lambda w1, b1, w2, b2: [w1, w2], ["gelu", None], TypeError, r"\(kernel, bias\) pairs"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w1, b1)], ["gelu", None], ValueError,
         r"layer 1: layer 0's output's last dimension 7 .* must equal kernel's first dimension K=5"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w2, b1)], ["gelu", None], ValueError,
         r"layer 1: bias must have shape \(N,\) = \(3,\)"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w2, b2)], ["gelu", "swish"], ValueError,
         "layer 1: unknown activation 'swish'"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w2, b2)], [jax.nn.gelu, None], TypeError,
         "layer 0: activation must be a name, not a function"),
        (lambda w1, b1, w2, b2: [(w1, b1), (w2.astype(jnp.float16), b2)], ["gelu", None], TypeError,
         "layer 1: kernel dtype float16 differs from layer 0's output dtype float32"),
    ],
    ids=["activation-string", "lengths", "empty", "not-pairs", "k-mismatch", "bias-shape", "activation",
         "activation-function", "dtype"],
)  # fmt: skip
def test_fused_mlp_bad_arguments_raise_naming_the_layer(layers_fn, activations, error, match):
    w1, b1, w2, b2 = _arr((5, 7)), _arr((7,)), _arr((7, 3)), _arr((3,))
    with pytest.raises(error, match=match):
        fused_mlp(_arr((4, 5)), layers_fn(w1, b1, w2, b2), activations)


def test_fused_mlp_bad_implementation_and_compute_type_raise():
    x, layers = _arr((4, 5), jnp.bfloat16), [(_arr((5, 3), jnp.bfloat16), None)]
    with pytest.raises(ValueError, match="fused_mlp: layer 0: unknown implementation 'fast'"):
        fused_mlp(x, layers, ["gelu"], implementation="fast")
    with pytest.raises(
        ValueError, match="fused_mlp: layer 0: compute_type COMPUTE_32F_FAST_TF32 cannot run bfloat16"
    ):
        fused_mlp(x, layers, ["gelu"], compute_type="COMPUTE_32F_FAST_TF32")
    with pytest.raises(TypeError, match="fused_mlp: x must be a JAX or NumPy array"):
        fused_mlp([[1.0]], layers, ["gelu"])
