"""_pytree.replace: the shell's field swap on state dataclasses behaves as dataclasses.replace."""

import dataclasses

import jax
import jax.numpy as jnp
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
