"""One decorator for state types: a frozen dataclass registered as a pytree.

Fields declared with ``static_field()`` are part of the tree structure (hashable, compile-time) rather than leaves.
"""

import dataclasses

import jax


def static_field(**kwargs):
    return dataclasses.field(metadata={"static": True}, **kwargs)


def state_dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls)


def replace(obj, **changes):
    return dataclasses.replace(obj, **changes)
