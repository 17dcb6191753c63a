"""One decorator for state types: a frozen dataclass registered as a pytree.

Fields declared with ``static_field()`` are part of the tree structure (hashable, compile-time) rather than leaves.
"""

import dataclasses
import functools

import jax


def static_field(**kwargs):
    return dataclasses.field(metadata={"static": True}, **kwargs)


def state_dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    return jax.tree_util.register_dataclass(cls)


@functools.cache
def _field_names(cls) -> frozenset:
    return frozenset(field.name for field in dataclasses.fields(cls))


def replace(obj, **changes):
    """``dataclasses.replace`` for the state types: the fields are copied instead of re-running the frozen
    ``__init__`` (a class with a ``__post_init__`` still goes through it). 0.6 us instead of 3 us; the shell swaps a
    state's storage twice per kernel call."""
    if hasattr(obj, "__post_init__"):
        return dataclasses.replace(obj, **changes)
    unknown = changes.keys() - _field_names(type(obj))
    if unknown:
        raise TypeError(f"replace(): {type(obj).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new
