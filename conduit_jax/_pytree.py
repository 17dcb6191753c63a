"""State types and how they cross a jit boundary.

``state_dataclass``: a frozen dataclass registered as a pytree. Fields declared with ``static_field()`` are part of the
tree structure (hashable, compile-time) rather than leaves. ``LeafBundle``: a state pytree as its large leaves plus one
vector of its small ones, the form the shell's kernels take and return.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec


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
    ``__init__`` (a class with a ``__post_init__`` still goes through it), which costs less than the checks the
    frozen ``__init__`` repeats; the shell swaps a state's storage twice per kernel call."""
    if hasattr(obj, "__post_init__"):
        return dataclasses.replace(obj, **changes)
    unknown = changes.keys() - _field_names(type(obj))
    if unknown:
        raise TypeError(f"replace(): {type(obj).__name__} has no field(s) {sorted(unknown)}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


SMALL_LEAF_ELEMENTS = 64  # a leaf of at most this many 4-byte elements travels in a LeafBundle's vector


class LeafBundle:
    """A state pytree as ``(large, small)``: its large leaves as they are (a tuple, in flattening order) and all its
    small ones (counters, cursors, keys) bitcast into one ``uint32`` vector, the form in which a state crosses a jit
    boundary.

    Each array that goes into or comes out of a jitted call costs its dispatch a few microseconds on XLA:CPU
    (argument handling, donation bookkeeping, a new output array, the deallocation of the donated one), and the replay
    state holds 5-9 scalars beside its ring and trees, so bundling them takes that cost off every call of the sample
    and ingest kernels. The pure core never sees the bundle: a kernel
    ``join``s it into the state first and ``split``s its result.

    A leaf is small when its elements are 4 bytes wide, it has at most ``SMALL_LEAF_ELEMENTS`` of them, and its
    sharding is replicated in the mesh's default memory, so the vector can carry it without changing where it lives.
    ``shardings``: the tree's shardings (``NamedSharding`` leaves); ``abstract``: its shapes and dtypes (e.g. from
    ``jax.eval_shape``); ``small_elements``: the most elements a small leaf has (a state with tables of a few KB,
    which every kernel then copies whole, may bundle them too: cheaper than an array each).
    """

    def __init__(self, abstract, shardings, small_elements: int = SMALL_LEAF_ELEMENTS):
        leaves, self.treedef = jax.tree_util.tree_flatten(abstract)
        self.shardings = shardings
        sharding_leaves = self.treedef.flatten_up_to(shardings)
        mesh = sharding_leaves[0].mesh
        default_kind = mesh.devices.flat[0].default_memory().kind
        self.small_sharding = NamedSharding(mesh, PartitionSpec(), memory_kind=default_kind)
        self._explicit = jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)
        self.is_small = tuple(np.dtype(leaf.dtype).itemsize == 4 and int(np.prod(leaf.shape)) <= small_elements
                              and sharding.is_fully_replicated and sharding.memory_kind in (None, default_kind)
                              for leaf, sharding in zip(leaves, sharding_leaves))
        small_shardings = tuple(s for s, small in zip(sharding_leaves, self.is_small) if small)
        self._small_leaves = tuple((tuple(leaf.shape), np.dtype(leaf.dtype), sharding) for leaf, sharding, small
                                   in zip(leaves, sharding_leaves, self.is_small) if small)
        self.large_shardings = tuple(s for s, small in zip(sharding_leaves, self.is_small) if not small)
        self._unbundled = jax.jit(self._unbundle, out_shardings=small_shardings)
        self._bundled = jax.jit(lambda *small: self._bundle(small), out_shardings=self.small_sharding)

    def count_large(self, leaves: int) -> int:
        """How many of the first ``leaves`` leaves (in flattening order) are large."""
        return sum(not small for small in self.is_small[:leaves])

    # -- inside a jit -----------------------------------------------------------------------------------------------
    def split(self, tree):
        """``(large leaves, uint32 vector of the small ones)``."""
        large, small = self._partition(tree)
        return large, self._bundle(small)

    def join(self, large, vector):
        """The tree that ``split`` took apart."""
        return self._merge(large, self._unbundle(vector))

    # -- on the host --------------------------------------------------------------------------------------------------
    def from_tree(self, tree):
        """``split`` for a tree of live arrays: the large leaves are the same arrays, the vector is new."""
        large, small = self._partition(tree)
        return large, self._bundled(*small)

    def to_tree(self, large, vector):
        """``join`` for live arrays: the large leaves are the same arrays, the small ones new, in their shardings."""
        return self._merge(large, self._unbundled(vector))

    # -- both -------------------------------------------------------------------------------------------------------
    def _partition(self, tree):
        leaves = self.treedef.flatten_up_to(tree)
        return (tuple(leaf for leaf, small in zip(leaves, self.is_small) if not small),
                [leaf for leaf, small in zip(leaves, self.is_small) if small])

    def _merge(self, large, small):
        small_leaves, large_leaves = iter(small), iter(large)
        return self.treedef.unflatten([next(small_leaves) if small else next(large_leaves)
                                       for small in self.is_small])

    def _bundle(self, small_leaves):
        words = [self._typed(lax.bitcast_convert_type(jnp.asarray(leaf), jnp.uint32).reshape(-1), self.small_sharding)
                 for leaf in small_leaves]
        return jnp.concatenate(words) if words else jnp.zeros((0,), jnp.uint32)

    def _unbundle(self, vector):
        out, at = [], 0
        for shape, dtype, sharding in self._small_leaves:
            size = int(np.prod(shape))
            leaf = lax.bitcast_convert_type(vector[at:at + size], dtype).reshape(shape)
            out.append(self._typed(leaf, sharding))
            at += size
        return tuple(out)

    def _typed(self, x, sharding):
        """On a mesh of explicit axes values carry their sharding in their type (a one-device shard's cursor is
        P('shard'), and the operands of a concatenate must agree): ``x`` retyped to ``sharding``. On other meshes
        nothing to do."""
        return jax.sharding.reshard(x, sharding) if self._explicit else x
