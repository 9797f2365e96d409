"""Fp8Spec: a call's buffers in order, and which of them a plan's alignment covers."""

from jax_epilog._fp8_spec import Fp8Spec

E4, BF = "float8_e4m3fn", "bfloat16"


def test_call_pointers_put_q_and_p_first_and_the_rest_in_call_order():
    spec = Fp8Spec(10, 16, 32, "GELU_AUX_BIAS", E4, E4, E4, BF, BF, amax=1)
    assert spec.operands() == ("p", "q", "p_scale", "q_scale", "d_scale", "bias")
    assert spec.results() == ("d", "amax", "aux")
    ins, outs = [11, 12, 13, 14, 15, 16], [21, 22, 23]
    pointers = spec.call_pointers(ins, outs)
    assert pointers == (12, 11, 21, 13, 14, 15, 16, 22, 23)  # A = Q, B = P, D, then the rest
    assert spec.matrix_pointers(pointers) == (12, 11, 21, 16, 23)  # not the scales nor the amax


def test_a_dgelu_problem_reads_its_aux_and_a_16_bit_d_has_no_d_scale():
    spec = Fp8Spec(10, 16, 32, "DGELU", "float8_e5m2", E4, BF, None, BF, amax=0)
    assert spec.operands() == ("p", "q", "p_scale", "q_scale", "aux") and spec.results() == ("d",)
    assert spec.aux_in and not spec.aux_out and not spec.bias_in
    pointers = spec.call_pointers([1, 2, 3, 4, 5], [6])
    assert spec.matrix_pointers(pointers) == (2, 1, 6, 5)
