"""ExperienceSpec: the names, dtypes and per-item shapes of the experience a plane stores, and batch validation.

A spec is built once, from one example item or from a pytree of ``jax.ShapeDtypeStruct``; every batch that enters the
plane is checked against it before it touches state. A batch has a leading item axis on every leaf.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from conduit_jax.errors import PriorityError, SpecError

# Dtypes the packed row storage can hold. 64-bit types are not among them: with x64 off JAX narrows them silently.
SUPPORTED_DTYPES = tuple(
    np.dtype(d) for d in (np.bool_, np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.float16,
                          jnp.bfloat16, np.float32)
)
_WIDE_TO_NARROW = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32),
                   np.dtype(np.float64): np.dtype(np.float32)}
_DTYPE, _SHAPE = operator.attrgetter("dtype"), operator.attrgetter("shape")
MAX_KEPT_SHAPES = 256  # batch sizes a spec keeps the leaves' shapes for (a loop ingests the same few)


def leaf_name(path) -> str:
    """'obs/pixels' for the key path of a nested dict leaf; '[0]' parts for sequences."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(f"[{key.idx}]")
        else:
            parts.append(str(key))
    return "/".join(parts) or "<root>"


def _dtype_of(x) -> np.dtype:
    return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)


@dataclasses.dataclass(frozen=True)
class ExperienceSpec:
    """Per-item structure of experience: a pytree of ``jax.ShapeDtypeStruct`` without the item axis.

    Hashable and immutable, so it can be a static argument and a cache key.
    """

    treedef: Any
    names: tuple[str, ...]  # one per leaf, in tree-flatten order
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]

    # -- construction -----------------------------------------------------------------------------------------------
    @classmethod
    def from_structs(cls, structs) -> "ExperienceSpec":
        """From a pytree whose leaves have ``.shape`` and ``.dtype`` (``jax.ShapeDtypeStruct``, arrays)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(structs)
        if not flat:
            raise SpecError("ExperienceSpec: the item has no leaves; expected at least one array (e.g. {'obs': ...})")
        names, shapes, dtypes, problems = [], [], [], []
        for path, leaf in flat:
            name = leaf_name(path)
            dtype = _dtype_of(leaf)
            if dtype not in SUPPORTED_DTYPES:
                hint = (f"; cast it to {_WIDE_TO_NARROW[dtype]} (JAX runs with x64 off)" if dtype in _WIDE_TO_NARROW
                        else "")
                problems.append(f"leaf '{name}' has dtype {dtype}, expected one of "
                                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}{hint}")
            names.append(name)
            shapes.append(tuple(int(d) for d in np.shape(leaf)))
            dtypes.append(dtype)
        if problems:
            raise SpecError("ExperienceSpec: " + "; ".join(problems))
        return cls(treedef, tuple(names), tuple(shapes), tuple(dtypes))

    @classmethod
    def from_example(cls, item, *, cast: bool = False) -> "ExperienceSpec":
        """From one example item (no leading item axis). Python scalars become 0-d leaves.

        With ``cast=True`` 64-bit leaves are recorded as their 32-bit counterparts (batches are then cast at ingest).
        """
        def as_struct(x):
            dtype = _dtype_of(x)
            # plain Python scalars only: np.float64 subclasses float but is a 64-bit value that needs cast=True
            if type(x) is bool:
                dtype = np.dtype(np.bool_)
            elif type(x) is int:
                dtype = np.dtype(np.int32)
            elif type(x) is float:
                dtype = np.dtype(np.float32)
            if cast:
                dtype = _WIDE_TO_NARROW.get(dtype, dtype)
            return jax.ShapeDtypeStruct(np.shape(x), dtype)

        return cls.from_structs(jax.tree_util.tree_map(as_struct, item))

    # -- derived views --------------------------------------------------------------------------------------------
    @property
    def structs(self):
        """The spec as a pytree of ``jax.ShapeDtypeStruct`` (one item)."""
        return jax.tree_util.tree_unflatten(
            self.treedef, [jax.ShapeDtypeStruct(s, d) for s, d in zip(self.shapes, self.dtypes)])

    @property
    def item_bytes(self) -> int:
        """Raw bytes of one item, summed over leaves."""
        return sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in zip(self.shapes, self.dtypes))

    def batch_structs(self, n: int):
        """ShapeDtypeStructs of a batch of ``n`` items."""
        return jax.tree_util.tree_unflatten(
            self.treedef, [jax.ShapeDtypeStruct((n, *s), d) for s, d in zip(self.shapes, self.dtypes)])

    def __str__(self) -> str:
        leaves = ", ".join(f"{n}: {d}{list(s)}" for n, s, d in zip(self.names, self.shapes, self.dtypes))
        return f"ExperienceSpec({leaves})"

    # -- validation -----------------------------------------------------------------------------------------------
    def validate(self, batch, *, cast: bool = False, where: str = "ingest()") -> int:
        """Check keys, dtypes and trailing shapes of a batch with a leading item axis; return the item count.

        Every bad leaf is collected before one ``SpecError`` is raised, so a user fixes them all at once. With
        ``cast=True`` 64-bit leaves whose narrow type matches the spec are accepted (the plane casts them).
        """
        return self.checked_leaves(batch, cast=cast, where=where)[1]

    def checked_leaves(self, batch, *, cast: bool = False, where: str = "ingest()") -> tuple[list, int]:
        """``validate``, returning the batch's leaves (in the spec's order) too: a caller that copies them flattens
        the batch once."""
        try:
            leaves, treedef = jax.tree_util.tree_flatten(batch)  # paths only for a message: they cost on every call
        except Exception as exc:  # pragma: no cover - tree_flatten accepts nearly anything
            raise SpecError(f"{where}: the batch is not a pytree ({exc})") from None
        if treedef != self.treedef:
            got = {leaf_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(batch)[0]}
            want = set(self.names)
            parts = []
            if want - got:
                parts.append(f"missing leaves {sorted(want - got)}")
            if got - want:
                parts.append(f"unexpected leaves {sorted(got - want)}")
            if not parts:
                parts.append(f"structure {treedef} but the spec says {self.treedef}")
            raise SpecError(f"{where}: batch has " + " and ".join(parts) + f"; the spec is {self}")
        n = self._plain_count(leaves)
        if n:
            return leaves, n
        problems, counts = [], []
        for leaf, name, shape, dtype in zip(leaves, self.names, self.shapes, self.dtypes):
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype") or isinstance(leaf, jax.ShapeDtypeStruct):
                problems.append(f"leaf '{name}' is a {type(leaf).__name__}, expected an array with a leading item axis")
                continue
            if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
                problems.append(f"leaf '{name}' is a deleted jax.Array (donated to an earlier call?), expected an "
                                f"array with data")
                continue
            got_dtype = np.dtype(leaf.dtype)
            if got_dtype != dtype:
                if cast and _WIDE_TO_NARROW.get(got_dtype) == dtype:
                    misfit = _first_misfit(np.asarray(leaf), dtype)
                    if misfit is not None:
                        index, value = misfit
                        problems.append(f"leaf '{name}' at index {index} holds {value!r}, which {dtype} cannot hold "
                                        f"(cast=True narrows {got_dtype} to {dtype} only when every value fits)")
                elif got_dtype in _WIDE_TO_NARROW and _WIDE_TO_NARROW[got_dtype] == dtype:
                    problems.append(f"leaf '{name}' has dtype {got_dtype} but the spec says {dtype}: cast it "
                                    f"(x.astype(np.{dtype})) or build the plane with cast=True (x64 is off)")
                else:
                    problems.append(f"leaf '{name}' has dtype {got_dtype} but the spec says {dtype}")
            got_shape = tuple(leaf.shape)
            if len(got_shape) != len(shape) + 1 or got_shape[1:] != shape:
                problems.append(f"leaf '{name}' has shape {got_shape}; expected (n, {', '.join(map(str, shape))}"
                                f"{',' if len(shape) == 0 else ''}) with a leading item axis "
                                f"(trailing shape {shape})")
                continue
            counts.append(got_shape[0])
        if not problems and len(set(counts)) > 1:
            sizes = ", ".join(f"'{n}': {c}" for n, c in zip(self.names, counts))
            problems.append(f"leaves disagree on the number of items ({sizes})")
        if not problems and counts[0] == 0:
            problems.append("the batch is empty (0 items); send at least one item")
        if problems:
            raise SpecError(f"{where}: " + "; ".join(problems))
        return leaves, int(counts[0])

    def _plain_count(self, leaves) -> int:
        """The item count of ``leaves`` when every leaf is a NumPy array or a live (not donated) concrete
        ``jax.Array`` of the spec's dtype and trailing shape and all agree on a count of at least one, else 0
        (``validate``'s full checks then name what is wrong). The common case, checked with the least Python: it
        runs on every ingest: all-NumPy leaves are compared as lists, in C."""
        if list(map(type, leaves)) == self._numpy_types:
            if list(map(_DTYPE, leaves)) != self._dtype_list:
                return 0
            shapes = list(map(_SHAPE, leaves))
            n = shapes[0][0] if shapes[0] else 0
            return n if n and shapes == self._batch_shapes(n) else 0
        n = None
        for leaf, shape, dtype in zip(leaves, self.shapes, self.dtypes):
            if type(leaf) is not np.ndarray and not (isinstance(leaf, jax.Array) and not isinstance(
                    leaf, jax.core.Tracer) and not leaf.is_deleted()):
                return 0
            if leaf.dtype != dtype:
                return 0
            got = leaf.shape
            if len(got) != len(shape) + 1 or got[1:] != shape or got[0] != (got[0] if n is None else n):
                return 0
            n = got[0]
        return n or 0

    @functools.cached_property
    def _numpy_types(self) -> list:
        return [np.ndarray] * len(self.names)

    @functools.cached_property
    def _dtype_list(self) -> list:
        return list(self.dtypes)

    @functools.cached_property
    def _shapes_by_count(self) -> dict[int, list]:
        return {}

    def _batch_shapes(self, n: int) -> list[tuple]:
        """The leaves' shapes in a batch of ``n`` items (the first ``MAX_KEPT_SHAPES`` counts seen are kept)."""
        shapes = self._shapes_by_count.get(n)
        if shapes is None:
            shapes = [(n, *shape) for shape in self.shapes]
            if len(self._shapes_by_count) < MAX_KEPT_SHAPES:
                self._shapes_by_count[n] = shapes
        return shapes


def _first_misfit(values: np.ndarray, dtype: np.dtype):
    """``(index, value)`` of the first entry that narrowing ``values`` to ``dtype`` would change (an integer out of
    range; a finite float beyond float32's range), or None when all of them fit."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        bad = (values < info.min) | (values > info.max)
    else:
        bad = np.isfinite(values) & (np.abs(values) > np.finfo(dtype).max)
    if not bad.any():
        return None
    index = np.unravel_index(int(np.argmax(bad)), values.shape)
    return tuple(int(i) for i in index), values[index].item()


# ------------------------------------------------------------------------------------------------------------------
# priority updates (host side)
# ------------------------------------------------------------------------------------------------------------------
def checked_priorities(priorities, count: int, where: str = "update_priorities()") -> np.ndarray:
    """``priorities`` as float32[count] after checking them (shape, real numbers, finite, >= 0); else PriorityError."""
    prio_np = np.asarray(priorities)
    if prio_np.shape != (count,):
        raise PriorityError(f"{where}: priorities must have shape ({count},), one per id, got {list(prio_np.shape)}")
    if count == 0:
        raise PriorityError(f"{where}: ids is empty; pass at least one id")
    if prio_np.dtype.kind not in "iuf":  # real numbers (dtype kinds: cheaper than numpy's issubdtype)
        raise PriorityError(f"{where}: priorities must be real numbers, got dtype {prio_np.dtype}")
    prio_np = prio_np.astype(np.float32)
    bad = ~np.isfinite(prio_np) | (prio_np < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise PriorityError(f"{where}: priorities must be finite and >= 0; {int(bad.sum())} are not, the first at "
                            f"index {i} is {prio_np[i]}")
    return prio_np


def checked_priority_update(ids, priorities, capacity: int, where: str = "update_priorities()"):
    """(ids int32[m, 2], priorities float32[m]) after checking both against a buffer of ``capacity``; else
    PriorityError naming the bad entry."""
    ids_np = np.asarray(ids)
    if ids_np.ndim != 2 or ids_np.shape[1] != 2 or ids_np.dtype.kind not in "iu":
        raise PriorityError(f"{where}: ids must be an integer array of shape (m, 2) as in Delivery.ids, got "
                            f"{ids_np.dtype}{list(ids_np.shape)}")
    prio_np = checked_priorities(priorities, ids_np.shape[0], where)
    rows, generations = ids_np[:, 0], ids_np[:, 1]
    # checked before narrowing to int32: a wider generation of 2**32 + 1 would become 1 and name a live item
    unknown = (rows < 0) | (rows >= capacity) | (generations < 1) | (generations > np.iinfo(np.int32).max)
    if unknown.any():
        i = int(np.argmax(unknown))
        raise PriorityError(f"{where}: ids[{i}] = {ids_np[i].tolist()} is not an id of this plane (rows are in "
                            f"[0, {capacity}), generations in [1, 2**31 - 1])")
    return ids_np.astype(np.int32), prio_np
