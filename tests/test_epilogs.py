"""``jax_epilog._epilogs``: the epilog table (activations, compute types), the aux layout,
EpilogSpec and the buffers each problem's custom call must be handed."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_epilog
from jax_epilog import Activation, ComputeType
from jax_epilog._epilogs import (
    ACTIVATIONS,
    COMPUTE_TYPES,
    EpilogSpec,
    aux_columns,
    aux_dtype,
    buffer_bytes,
    buffer_elements,
    check_buffers,
    default_compute_type,
    epilog_name,
    known_sizes,
    valid_compute_types,
)

FORWARD = EpilogSpec(33, 65, 129, "RELU_AUX_BIAS", "COMPUTE_32F", "float16", "float32", "float32")
WGRAD = EpilogSpec(33, 65, 129, "BGRADA", "COMPUTE_32F", "float16", "float32", "float32", "wgrad")
DGRAD = EpilogSpec(33, 65, 129, "DGELU", "COMPUTE_32F", "bfloat16", None, "float32", "dgrad")
MEMBERS = FORWARD._replace(members=7, shared="x")  # an ensemble's forward, x shared


def _round_up(value, multiple):
    return -(-value // multiple) * multiple


@pytest.mark.parametrize("n", [0, 1, 7, 8, 100, 127, 128, 129, 257, 1000, 1025])
def test_aux_padded_width_formulas(n):
    """ReLU: N bits padded to a multiple of 128, in bytes; GELU: N values padded to 8.
    Names and members alike (``aux_padded_width`` once gave "relu" the GELU width)."""
    for relu in (Activation.RELU, "relu"):
        assert jax_epilog.aux_padded_width(relu, n) == _round_up(n, 128) // 8
        assert aux_columns(relu, n) == _round_up(n, 128)
    for gelu in (Activation.GELU, "gelu"):
        assert jax_epilog.aux_padded_width(gelu, n) == _round_up(n, 8) == aux_columns(gelu, n)


def test_the_aux_is_bits_for_relu_and_z_for_gelu():
    assert aux_dtype(Activation.RELU, np.float32) == np.uint8
    assert aux_dtype(Activation.GELU, np.float32) == np.float32
    assert aux_dtype(Activation.GELU, "bfloat16") == np.dtype("bfloat16")
    assert ACTIVATIONS[Activation.RELU].aux_bits and not ACTIVATIONS[Activation.GELU].aux_bits
    assert ACTIVATIONS[Activation.GELU].links and not ACTIVATIONS[Activation.RELU].links  # DGELU, no DRELU


@pytest.mark.parametrize(
    "activation, has_bias, with_aux, name",
    [
        (None, False, False, "DEFAULT"),
        (None, True, True, "BIAS"),  # no aux without an activation
        (Activation.RELU, False, False, "RELU"),
        (Activation.RELU, True, True, "RELU_AUX_BIAS"),
        (Activation.GELU, False, True, "GELU_AUX"),
        (Activation.GELU, True, False, "GELU_BIAS"),
    ],
)
def test_epilog_names(activation, has_bias, with_aux, name):
    assert epilog_name(activation, has_bias, with_aux) == name
    spec = FORWARD._replace(epilog=name)
    assert spec.activation is activation and spec.has_aux == ("AUX" in name)
    assert spec.aux_bits == (activation is Activation.RELU and "AUX" in name)


def test_compute_types_per_dtype():
    """The default first; beside a float32 bias only 32-bit accumulation (half dtypes)."""
    names = lambda cts: [ct.name for ct in cts]
    assert {d: default_compute_type(d).name for d in COMPUTE_TYPES} == {
        "float16": "COMPUTE_32F", "bfloat16": "COMPUTE_32F", "float32": "COMPUTE_32F", "float64": "COMPUTE_64F",
    }  # fmt: skip
    assert names(valid_compute_types("float16", False)) == [
        "COMPUTE_32F", "COMPUTE_32F_PEDANTIC", "COMPUTE_16F", "COMPUTE_16F_PEDANTIC",
    ]  # fmt: skip
    assert names(valid_compute_types("float16", True)) == ["COMPUTE_32F", "COMPUTE_32F_PEDANTIC"]
    assert names(valid_compute_types("bfloat16", True)) == ["COMPUTE_32F", "COMPUTE_32F_PEDANTIC"]
    assert "COMPUTE_32F_FAST_TF32" in names(valid_compute_types("float32", False))
    assert not COMPUTE_TYPES["float64"].fused and all(
        COMPUTE_TYPES[d].fused for d in ("float16", "bfloat16", "float32")
    )
    assert ComputeType.COMPUTE_32F == 68 and ComputeType["COMPUTE_32F_FAST_TF32"] == 77  # cublasComputeType_t


def test_known_sizes_refuses_symbolic_dimensions():
    (batch,) = jax.export.symbolic_shape("b")
    assert known_sizes(1, 2, 3) and known_sizes()
    assert not known_sizes(3, batch)


def test_an_ensembles_spec_names_the_operands_its_members_share():
    spec = FORWARD._replace(members=3, shared="x,bias")
    assert [spec.is_shared(o) for o in ("x", "kernel", "bias")] == [True, False, True]
    assert not any(FORWARD.is_shared(o) for o in ("x", "kernel", "bias"))
    assert not WGRAD.aux_bits and not DGRAD.has_aux  # (dgrad's aux is an input, no epilog AUX)


def test_buffer_sizes_of_each_problem():
    """(A, B, D, bias, aux) of each problem in elements and bytes, all members'."""
    m, n, k = 33, 65, 129
    assert buffer_elements(FORWARD) == (k * n, m * k, m * n, n, m * 16)
    assert buffer_bytes(FORWARD) == (
        2 * k * n,
        2 * m * k,
        4 * m * n,
        4 * n,
        m * 16,
    )  # D and bias float32; bits
    gelu = FORWARD._replace(epilog="GELU_AUX", bias_dtype=None)
    assert buffer_elements(gelu) == (k * n, m * k, m * n, 0, m * 72)
    assert buffer_bytes(gelu)[4] == 4 * m * 72  # z in D's dtype
    assert buffer_elements(WGRAD) == (m * n, m * k, k * n, n, 0)
    assert buffer_elements(WGRAD._replace(bias_dtype=None)) == (m * n, m * k, k * n, 0, 0)
    assert buffer_elements(DGRAD) == (k * n, m * n, m * k, 0, m * 136)
    assert buffer_elements(MEMBERS) == (7 * k * n, m * k, 7 * m * n, 7 * n, 7 * m * 16)  # x shared: once


def test_a_call_takes_exactly_the_buffers_its_problem_reads_and_writes():
    """``check_buffers`` passes exactly the buffers each problem's GEMM reads or writes
    (``buffer_elements``): the handler checks no size at run time, so any other buffer
    would be read or written out of bounds."""
    m, n, k = FORWARD.m, FORWARD.n, FORWARD.k
    fits = {  # (operands, results); ReLU's aux: round_up(65, 128) / 8 bytes; GELU's: round_up(129, 8)
        FORWARD: ([(m, k), (k, n), (n,)], [(m, n), (m, 16)]),
        FORWARD._replace(epilog="RELU", bias_dtype=None): ([(m, k), (k, n)], [(m, n)]),
        WGRAD: ([(m, k), (m, n)], [(k, n), (n,)]),
        DGRAD: ([(m, n), (k, n), (m, 136)], [(m, k)]),
        MEMBERS: ([(m, k), (7, k, n), (7, n)], [(7, m, n), (7, m, 16)]),
        FORWARD._replace(n=96): ([(m, k), (k, 96), (96,)], [(m, 96), (m, 16)]),  # 96 bits pad to 128
    }
    for spec, (operands, results) in fits.items():
        check_buffers(operands, results, spec)
    misfits = [  # (spec, operands, results, the wrong role)
        (FORWARD, [(m, k), (k, n), (n,)], [(m, n), (m, 24)], "results"),  # an aux a row wider
        (FORWARD, [(m, k), (k, n)], [(m, n), (m, 16)], "operands"),  # the bias missing
        (
            FORWARD._replace(n=136),
            [(m, k), (k, 136), (136,)],
            [(m, 136), (m, 16)],
            "results",
        ),  # 136 bits: 32 bytes
        (WGRAD, [(m, k), (m, n)], [(k, n)], "results"),  # the bias gradient missing
        (DGRAD, [(m, n), (k, n), (m, 160)], [(m, k)], "operands"),  # an aux padded past K's 8
        (MEMBERS, [(7, m, k), (7, k, n), (7, n)], [(7, m, n), (7, m, 16)], "operands"),  # x not shared
    ]
    for spec, operands, results, role in misfits:
        with pytest.raises(RuntimeError, match=f"jax_epilog bug: the custom call for .* was given {role} of"):
            check_buffers(operands, results, spec)
