"""``jax_epilog._policy``: the tuned numbers in one Policy, ``get_policy`` and
``override_policy``, and each rule's evidence in docs/decisions.md.

What each number decides is tested where it is used (test_dispatch.py: the "auto" rules;
test_padding.py: row padding; test_grads.py: ``relu_bgrad_epilog``; tests/cuda/: tuning
and replay); here, that an override reaches exactly the programs traced inside its block.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from helpers import run_python

import jax_epilog
from jax_epilog import Policy, _policy, get_policy, override_policy

DECISIONS = pathlib.Path(__file__).resolve().parent.parent / "docs" / "decisions.md"
FUSED = "jax_epilog_fused_matmul"


def test_the_defaults_are_in_force_outside_any_block():
    assert get_policy() == Policy()
    assert jax_epilog.Policy is Policy and jax_epilog.override_policy is override_policy


def test_override_changes_the_fields_inside_the_block_and_restores_them_after():
    before = get_policy()
    with override_policy(row_bytes=1, pad_min_rows=7) as inside:
        assert inside is get_policy()
        assert (inside.row_bytes, inside.pad_min_rows) == (1, 7)
        assert inside.pad_min_work == before.pad_min_work  # the others as they were
        with override_policy(pad_min_rows=3) as nested:
            assert (nested.row_bytes, nested.pad_min_rows) == (1, 3)
        assert get_policy() is inside
    assert get_policy() is before


def test_override_restores_the_policy_after_an_exception():
    before = get_policy()
    with pytest.raises(KeyError, match="inside"), override_policy(auto_min_rows=0, link_min_rows=0):
        assert get_policy().auto_min_rows == 0
        raise KeyError("inside")
    assert get_policy() is before


def test_an_unknown_field_raises_type_error_naming_it():
    before = get_policy()
    unknown = r"override_policy: unknown fields \['pad_min_row'\]; allowed: .*'pad_min_rows'"
    with pytest.raises(TypeError, match=unknown), override_policy(pad_min_row=0, row_bytes=1):
        pass
    assert get_policy() is before


def test_the_policy_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_policy().row_bytes = 1


def test_every_field_has_a_rule_and_evidence_in_decisions_md():
    """``Policy.rules()`` lists every field, each with its default, a one-line rule and a
    "docs/decisions.md#<anchor>" link whose anchor is a ``## <anchor>`` section there."""
    rules = Policy.rules()
    fields = dataclasses.fields(Policy)
    assert [name for name, *_ in rules] == [f.name for f in fields]
    headings = set(re.findall(r"^## (\S+)\s*$", DECISIONS.read_text(), flags=re.MULTILINE))
    for (name, default, rule, evidence), field in zip(rules, fields, strict=True):
        assert default == field.default and default == getattr(Policy(), name), name
        assert rule and "\n" not in rule, name
        anchor = evidence.removeprefix("docs/decisions.md#")
        assert evidence.startswith("docs/decisions.md#") and anchor in headings, (
            name,
            evidence,
            sorted(headings),
        )


def test_the_environment_switches_off_autotuning_and_replay(monkeypatch):
    """Each switch is on unless its variable is "0", read when jax_epilog is imported (in
    a fresh process: the defaults here are this process's)."""
    for value, on in ((None, True), ("1", True), ("", True), ("0", False)):
        if value is None:
            monkeypatch.delenv("JAX_EPILOG_AUTOTUNE", raising=False)
        else:
            monkeypatch.setenv("JAX_EPILOG_AUTOTUNE", value)
        assert _policy._env_flag("JAX_EPILOG_AUTOTUNE") is on, value
    code = "import jax_epilog as je; p = je.get_policy(); print(p.autotune, p.replay)"
    env = {**os.environ, "JAX_EPILOG_AUTOTUNE": "0", "JAX_EPILOG_REPLAY": "0"}
    done = run_python(code, env=env, timeout=120)
    assert done.stdout.split() == ["False", "False"], done.stderr[-2000:]


def _fuses(layer, *args) -> bool:
    """Whether ``layer`` traced now fuses: a new function each time, since JAX caches a
    function's trace by its identity (and the avals), not by the policy in force."""
    return FUSED in str(jax.make_jaxpr(lambda *a: layer(*a))(*args))


def test_a_changed_number_changes_the_program_traced_inside_the_block_only():
    """``auto_min_rows`` decides whether "auto" fuses a bfloat16 GELU layer of 1024 rows
    (M*N*K = 2**33): fused by default, not from 2048 rows on, while a function jitted
    before the block keeps the program it was traced with; and with both floors at 0 even
    a small layer fuses."""
    big = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1024, 1024), (1024, 8192), (8192,))]
    layer = functools.partial(jax_epilog.fused_dense, activation="gelu")
    assert _fuses(layer, *big)
    jitted_before = jax.jit(lambda *a: layer(*a))
    assert FUSED in str(jitted_before.trace(*big).jaxpr)
    with override_policy(auto_min_rows=2048):
        assert not _fuses(layer, *big)
        assert FUSED in str(jitted_before.trace(*big).jaxpr)  # traced before: its old program
    assert _fuses(layer, *big)
    small = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((24, 16), (16, 8), (8,))]
    assert not _fuses(layer, *small)
    with override_policy(auto_min_rows=0, auto_min_work=0):
        assert _fuses(layer, *small)


def test_a_function_traced_before_the_block_needs_its_cache_cleared():
    """JAX caches a function's trace whatever the policy: jitting the same function again
    inside the block returns the old program until ``jax.clear_caches()`` (documented)."""
    big = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((1024, 1024), (1024, 8192), (8192,))]
    layer = functools.partial(jax_epilog.fused_dense, activation="gelu")
    assert FUSED in str(jax.jit(layer).trace(*big).jaxpr)
    with override_policy(auto_min_rows=2048):
        assert FUSED in str(jax.jit(layer).trace(*big).jaxpr)  # a new jit, the same function: cached
        jax.clear_caches()
        assert FUSED not in str(jax.jit(layer).trace(*big).jaxpr)
    jax.clear_caches()
    assert FUSED in str(jax.jit(layer).trace(*big).jaxpr)
