"""_pytree.replace: the shell's field swap on state dataclasses behaves as dataclasses.replace."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conduit_jax._pytree import replace, state_dataclass


@state_dataclass
class Pair:
    a: jax.Array
    b: jax.Array


def test_replace_swaps_fields_and_leaves_the_original_as_it_was():
    old = Pair(jnp.zeros(2), jnp.ones(3))
    new = replace(old, b=None)
    assert type(new) is Pair and new.a is old.a and new.b is None and old.b.shape == (3,)
    assert new == dataclasses.replace(old, b=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.a = None
    back = replace(new, b=old.b)
    leaves, treedef = jax.tree_util.tree_flatten(back)
    assert treedef == jax.tree_util.tree_structure(old) and leaves[1] is old.b
    assert jax.jit(lambda p: replace(p, a=p.a + 1))(old).a.tolist() == [1.0, 1.0]


def test_replace_refuses_unknown_fields():
    with pytest.raises(TypeError, match=r"Pair has no field\(s\) \['c'\]"):
        replace(Pair(jnp.zeros(1), jnp.zeros(1)), c=1)


# -- LeafBundle: the form in which the shell's kernels take and return a state ---------------------------------------
@state_dataclass
class Counters:
    ring: jax.Array  # large: stays an array of its own
    cursor: jax.Array  # int32[shards]: small while replicated (one device), large when sharded
    key: jax.Array  # uint32[]
    level: jax.Array  # float32[]
    flag: jax.Array  # bool[]: 1-byte elements stay an array of their own
    wide: jax.Array  # int32[65]: more elements than a small leaf holds


def _counters(mesh, shards):
    from jax.sharding import NamedSharding, PartitionSpec as P

    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(mesh.axis_names[0]))
    shardings = Counters(ring=split, cursor=split, key=replicated, level=replicated, flag=replicated,
                         wide=replicated)
    nan_payload = np.array([0x7FC00123], np.uint32).view(np.float32)[0]  # a NaN with payload bits: kept bit for bit
    values = Counters(ring=jnp.arange(8 * 64, dtype=jnp.float32), cursor=jnp.arange(shards, dtype=jnp.int32) - 3,
                      key=jnp.uint32(0xDEADBEEF), level=jnp.float32(nan_payload), flag=jnp.bool_(True),
                      wide=jnp.arange(65, dtype=jnp.int32))
    return jax.device_put(values, shardings), shardings


def _bits(x):
    x = np.asarray(x)
    return x.reshape(-1).view(np.uint8) if x.dtype != np.bool_ else x


@pytest.mark.parametrize("devices", [1, 8])
def test_leaf_bundle_round_trips_bit_exactly_and_keeps_large_leaves_as_they_are(devices):
    from conduit_jax import default_mesh
    from conduit_jax._pytree import LeafBundle

    mesh = default_mesh(devices)
    state, shardings = _counters(mesh, devices)
    bundle = LeafBundle(jax.eval_shape(lambda: state), shardings)
    # ring, cursor, key, level, flag, wide: the per-shard cursor is small only while it is not split over devices
    assert bundle.is_small == (False, devices == 1, True, True, False, False)
    large, small = bundle.from_tree(state)
    expected_large = [state.ring, state.flag, state.wide] if devices == 1 else [state.ring, state.cursor,
                                                                                state.flag, state.wide]
    assert len(large) == len(expected_large) and all(a is b for a, b in zip(large, expected_large))
    assert small.dtype == jnp.uint32 and small.shape == (2 + (devices == 1),)
    back = bundle.to_tree(large, small)
    for name in ("ring", "cursor", "key", "level", "flag", "wide"):
        got, want = getattr(back, name), getattr(state, name)
        assert got.dtype == want.dtype and got.shape == want.shape and got.sharding == want.sharding, name
        np.testing.assert_array_equal(_bits(got), _bits(want), err_msg=name)

    @jax.jit
    def step(large, small):  # what a kernel does: join, compute on the tree, split its result
        tree = bundle.join(large, small)
        return bundle.split(replace(tree, key=tree.key + 1, cursor=tree.cursor + 1))

    stepped = bundle.to_tree(*step(large, small))
    assert int(stepped.key) == 0xDEADBEEF + 1
    np.testing.assert_array_equal(np.asarray(stepped.cursor), np.asarray(state.cursor) + 1)
    np.testing.assert_array_equal(_bits(stepped.level), _bits(state.level))


def test_leaf_bundle_of_a_tree_without_small_leaves():
    from jax.sharding import NamedSharding, PartitionSpec as P

    from conduit_jax import default_mesh
    from conduit_jax._pytree import LeafBundle

    mesh = default_mesh(1)
    tree = {"a": jnp.zeros((100,)), "b": jnp.zeros((), jnp.bool_)}
    bundle = LeafBundle(jax.eval_shape(lambda: tree), {"a": NamedSharding(mesh, P()), "b": NamedSharding(mesh, P())})
    large, small = bundle.from_tree(tree)
    assert small.shape == (0,) and len(large) == 2
    assert jax.tree_util.tree_structure(bundle.to_tree(large, small)) == jax.tree_util.tree_structure(tree)
