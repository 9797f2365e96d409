"""``jax_epilog._typing``: the type helpers under explicit sharding and inside
``shard_map`` (what they make of whole programs: test_partition.py)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_epilog._typing import explicit_product, is_explicit, mesh_axes, named, sharding_of, varying

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 CPU devices (conftest.py sets XLA_FLAGS)")


def _mesh(axis_type):
    return jax.make_mesh((2, 2), ("a", "b"), axis_types=(axis_type,) * 2, devices=CPUS[:4])


def test_varying_reads_whichever_attribute_this_jax_types_manual_axes_by():
    """jax has named the manual axes a value differs over in several ways across releases."""
    for name in ("mat", "manual_axis_type", "manual_type"):
        assert varying(SimpleNamespace(**{name: SimpleNamespace(varying={"a"})})) == {"a"}
    assert varying(SimpleNamespace(vma={"a", "b"})) == {"a", "b"}
    assert varying(SimpleNamespace()) == frozenset()
    assert varying(jax.typeof(jnp.ones(3))) == frozenset()  # outside shard_map


def test_shardings_from_each_dimensions_mesh_axes():
    mesh = _mesh(AxisType.Explicit)
    sharding = sharding_of(mesh, 3, {2: ("a", "b")})
    assert sharding.spec == P(None, None, ("a", "b"))
    assert [mesh_axes(sharding, d) for d in range(4)] == [(), (), ("a", "b"), ()]
    assert sharding_of(mesh, 2, {0: ("b",)}).spec == P("b", None)
    assert named(mesh, [("b",), ()]).spec == P("b", None)
    assert is_explicit(sharding) and not is_explicit(NamedSharding(_mesh(AxisType.Auto), P("a")))
    assert not is_explicit(None) and not is_explicit(jax.devices("cpu")[0])


def test_explicit_product_is_split_as_the_dimensions_it_keeps():
    """A product under explicit sharding is split as its kept dimensions are: x's rows,
    then the kernel's columns, except where the kernel's columns share a mesh axis with
    x's rows (whole there); outside explicit sharding, None (XLA decides)."""
    mesh = _mesh(AxisType.Explicit)
    x = jax.device_put(jnp.ones((4, 6)), NamedSharding(mesh, P("a", "b")))  # rows over "a", K over "b"
    w = jax.device_put(jnp.ones((6, 8)), NamedSharding(mesh, P("b", "a")))  # K over "b", N over "a"
    contract = ((1,), (0,))
    assert explicit_product(x, w, contract).spec == P("a", None)  # N's "a" is taken by the rows
    w = jax.device_put(jnp.ones((6, 8)), NamedSharding(mesh, P(None, "b")))
    assert explicit_product(x, w, contract).spec == P("a", "b")
    auto = _mesh(AxisType.Auto)
    xs = jax.device_put(jnp.ones((4, 6)), NamedSharding(auto, P("a")))
    assert explicit_product(xs, jnp.ones((6, 8)), contract) is None
