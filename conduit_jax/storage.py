"""Sharded ring storage: the state pytree and the pure per-shard kernels that write and read it.

Layout. Every item is stored as one packed row of uint32 words: each leaf's bytes are bitcast to words (1- and 2-byte
types share a word, padded per leaf) and the leaves are laid side by side. Sampling a batch is then one random row
access per item instead of one per leaf; on CPU a random row costs ~130-150 ns of DRAM latency, so this halves or
better the cost of small-row sampling. ``unpack`` turns rows back into the spec's pytree inside the consumer's jit.
A layout made mostly of 1-byte leaves (image frames) keeps the same bytes in a uint8 ring (``RowLayout.ring_dtype``)
so that its frames are gathered as bytes without a conversion; packed rows in transit are uint32 words either way.

Sharding. ``rows`` is ``uint32[capacity, row_words]`` (or those bytes) split on the capacity axis over the shard axes
of a mesh; each shard is an independent ring of ``capacity // shards`` slots with its own ``cursor`` and ``laps``.
Items are dealt round robin: the g-th item ever ingested goes to shard ``g % shards``, at that shard's cursor. Two
facts follow that the samplers rely on:
  * shard item counts differ by at most one, and while nothing has wrapped the valid items of the whole buffer are
    exactly the ranks ``r < size`` under ``r -> (shard r % S, slot r // S)``; once full every slot is valid. So a
    uniform draw over ranks is a uniform draw over items with no prefix sums and no collective.
  * the generation of slot j (how many times it has been written) is ``laps + (j < cursor)``; an item id is
    ``(global row, generation)`` and is live only while that generation is current, so ids never need per-slot state.

Slots and rows. A slot is an item's place in its shard's arrival order (the ids, cursors and sampler indices all count
slots). With one stream per shard a slot is its row. A ring that interleaves several streams (environments of a
sequences sampler, ingested time-major) stores each stream's steps in consecutive rows instead (``ring_row``): a
window of consecutive steps is then one sequential read rather than one DRAM access per step. Only code that touches
``rows`` maps slots to rows.

Memory. A ring placed in host memory (a plan's ``pinned_host`` storage) is read and written where it lives
(``where_rows_live``): every gather from ``rows`` and every write into it runs as a host computation (XLA's host
offloading: ``jax.experimental.compute_on("device_host")``), so only the gathered batch crosses to device memory and
only the ingested block crosses to the host; the ring itself never moves. On XLA:CPU both kinds are the same DRAM and
the annotation changes nothing; on GPU and TPU XLA runs the region on the host CPU over the pinned buffer and copies
its (batch-sized) result to the device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.compute_on import compute_on

from conduit_jax._pytree import state_dataclass
from conduit_jax.spec import ExperienceSpec


# ------------------------------------------------------------------------------------------------------------------
# Row layout: pack a pytree batch into uint32 rows and back.
# ------------------------------------------------------------------------------------------------------------------
class LeafSlot(NamedTuple):
    offset: int  # first word of this leaf in the row
    words: int  # words the leaf occupies
    elems: int  # elements per item
    per_word: int  # elements per word: 1 (4-byte types), 2 (2-byte), 4 (1-byte)


class RowLayout(NamedTuple):
    spec: ExperienceSpec
    slots: tuple[LeafSlot, ...]
    row_words: int

    @classmethod
    def of(cls, spec: ExperienceSpec) -> "RowLayout":
        slots, offset = [], 0
        for shape, dtype in zip(spec.shapes, spec.dtypes):
            elems = int(np.prod(shape, dtype=np.int64))
            per_word = 4 // dtype.itemsize
            words = -(-elems // per_word)
            slots.append(LeafSlot(offset, words, elems, per_word))
            offset += words
        return cls(spec, tuple(slots), max(offset, 1))

    @property
    def row_bytes(self) -> int:
        return 4 * self.row_words

    @property
    def ring_dtype(self) -> np.dtype:
        """The element type the ring stores its rows in: uint8 when 1-byte leaves make at least half of a row (image
        frames), else uint32. The bytes are the same either way. XLA:CPU reads a 1-byte leaf out of uint32 words by a
        shift and a mask per byte, which slowed a frame gather; from a uint8 ring it is a plain copy. A 4-byte leaf
        read from a uint8 ring pays that price instead, so it is paid by whichever kind of leaf is the minority."""
        byte_elems = sum(slot.elems for slot in self.slots if slot.per_word == 4)
        return np.dtype(np.uint8) if 2 * byte_elems >= self.row_bytes else np.dtype(np.uint32)

    @property
    def ring_width(self) -> int:
        """Elements of ``ring_dtype`` per row."""
        return self.row_bytes // self.ring_dtype.itemsize

    def to_ring(self, rows):
        """Packed rows (uint32[..., row_words], jax or NumPy) in the ring's element type: a NumPy view costs nothing;
        on the device it is a conversion pass (the host path hands the kernel a uint8 view instead)."""
        if rows.dtype == self.ring_dtype:
            return rows
        if isinstance(rows, np.ndarray):
            return rows.view(self.ring_dtype)
        return lax.bitcast_convert_type(rows, jnp.uint8).reshape(*rows.shape[:-1], self.row_bytes)

    def to_words(self, rows):
        """Rows read from the ring (``ring_dtype``) as packed uint32 words, as ``unpack`` takes them."""
        if rows.dtype == np.uint32:
            return rows
        if isinstance(rows, np.ndarray):
            return np.ascontiguousarray(rows).view(np.uint32)
        return lax.bitcast_convert_type(rows.reshape(*rows.shape[:-1], self.row_words, 4), jnp.uint32)

    def pack(self, batch) -> jax.Array:
        """Pytree batch with leading axis n -> uint32[n, row_words]. Pure, jit-friendly."""
        return self._pack(batch, bytes_out=False)

    def pack_ring(self, batch) -> jax.Array:
        """``pack`` into the ring's element type directly: for a byte ring every leaf goes to bytes, so frames are
        copied as they are instead of being combined into words and split again."""
        return self._pack(batch, bytes_out=self.ring_dtype == np.uint8)

    def _pack(self, batch, bytes_out: bool) -> jax.Array:
        leaves = jax.tree_util.tree_leaves(batch)
        n = leaves[0].shape[0]
        parts = []
        for leaf, slot, dtype in zip(leaves, self.slots, self.spec.dtypes):
            if slot.elems == 0:
                continue
            x = jnp.asarray(leaf)
            if x.dtype != dtype:  # 64-bit input admitted by cast=True
                x = x.astype(dtype)
            x = x.reshape(n, slot.elems)
            if bytes_out:  # unsigned bytes before padding (see below), each leaf padded to its words
                x = x.astype(jnp.uint8) if dtype == np.bool_ else lax.bitcast_convert_type(x, jnp.uint8)
                x = x.reshape(n, -1)
                parts.append(jnp.pad(x, ((0, 0), (0, 4 * slot.words - x.shape[1]))))
                continue
            if slot.per_word == 1:
                parts.append(lax.bitcast_convert_type(x, jnp.uint32))
                continue
            # move to unsigned bits before padding: XLA:CPU's pad canonicalises bfloat16 NaN payloads
            x = x.astype(jnp.uint8) if dtype == np.bool_ else lax.bitcast_convert_type(
                x, jnp.uint8 if slot.per_word == 4 else jnp.uint16)
            pad = slot.words * slot.per_word - slot.elems
            if pad:
                x = jnp.pad(x, ((0, 0), (0, pad)))
            parts.append(lax.bitcast_convert_type(x.reshape(n, slot.words, slot.per_word), jnp.uint32))
        if not parts:
            return jnp.zeros((n, 4), jnp.uint8) if bytes_out else jnp.zeros((n, 1), jnp.uint32)
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)

    def pack_host(self, leaves, start: int, count: int, rows: int, out: Optional[np.ndarray] = None) -> np.ndarray:
        """NumPy twin of ``pack`` for host batches: items [start, start+count) of each leaf into uint32[rows,
        row_words] (rows past ``count`` are padding the kernel masks), ``out`` when given (64-byte aligned, see
        ``aligned_empty``), else a fresh array. One array crosses to the device instead of one per leaf, and the
        caller's buffers are never aliased. A caller that packs into the same array again and again (the staging
        area) builds its ``HostRows`` once instead."""
        out = aligned_empty((rows, self.row_words)) if out is None else out
        target = HostRows(self, out)
        target.zero_padding(0, count)
        target.write(leaves, start, count, 0)
        return out

    def unpack(self, rows: jax.Array):
        """uint32[..., row_words] -> the spec's pytree with leading axes ``rows.shape[:-1]``."""
        leaves = [self._unpack_leaf(rows, i) for i in range(len(self.slots))]
        return jax.tree_util.tree_unflatten(self.spec.treedef, leaves)

    def gather_leaves(self, rows: jax.Array, at: jax.Array):
        """The spec's pytree for the items in rows ``at`` (any shape), each leaf gathered from its own elements only:
        the slice fuses into the gather, so every byte is copied once (no packed intermediate)."""
        return where_rows_live(lambda rows, at: jax.tree_util.tree_unflatten(
            self.spec.treedef, [self._gather_leaf(rows, i, at) for i in range(len(self.slots))]), rows, at)

    def read_leaf(self, rows: jax.Array, name: str, at: jax.Array) -> jax.Array:
        """Leaf ``name`` of the items in rows ``at`` of a shard's ring, reading only that leaf's elements."""
        index = self.spec.names.index(name)
        return where_rows_live(lambda rows, at: self._gather_leaf(rows, index, at), rows, at)

    def _gather_leaf(self, rows: jax.Array, index: int, at: jax.Array) -> jax.Array:
        slot, shape, dtype = self.slots[index], self.spec.shapes[index], self.spec.dtypes[index]
        if rows.dtype == np.uint8:  # a byte ring: each leaf is gathered as its own bytes
            size = 4 // slot.per_word
            first = 4 * slot.offset
            x = _take(lax.slice_in_dim(rows, first, first + slot.elems * size, axis=1), at)
            if dtype == np.bool_:
                x = x.astype(jnp.bool_)
            elif size > 1:
                x = lax.bitcast_convert_type(x.reshape(*at.shape, slot.elems, size), dtype)
            elif dtype != np.uint8:
                x = lax.bitcast_convert_type(x, dtype)
            return x.reshape(*at.shape, *shape)
        if slot.per_word == 1:
            words = lax.slice_in_dim(rows, slot.offset, slot.offset + slot.words, axis=1)
            return self._unpack_leaf(_take(words, at), index, offset=0)
        # 1- and 2-byte leaves are gathered from the ring viewed as elements of their own width: gathering their
        # words and splitting those inside the gather made XLA:CPU copy byte by byte, far slower for frames
        elements = lax.bitcast_convert_type(rows, jnp.uint8 if slot.per_word == 4 else jnp.uint16)
        elements = elements.reshape(rows.shape[0], rows.shape[1] * slot.per_word)
        first = slot.offset * slot.per_word
        x = _take(lax.slice_in_dim(elements, first, first + slot.elems, axis=1), at)
        x = x.astype(jnp.bool_) if dtype == np.bool_ else lax.bitcast_convert_type(x, dtype)
        return x.reshape(*at.shape, *shape)

    def _unpack_leaf(self, rows: jax.Array, index: int, offset: Optional[int] = None) -> jax.Array:
        slot, shape, dtype = self.slots[index], self.spec.shapes[index], self.spec.dtypes[index]
        lead = rows.shape[:-1]
        start = slot.offset if offset is None else offset
        words = lax.slice_in_dim(rows, start, start + slot.words, axis=rows.ndim - 1)
        x = lax.bitcast_convert_type(words, jnp.uint8 if dtype == np.bool_ else dtype)
        if slot.per_word != 1:
            x = x.reshape(*lead, slot.words * slot.per_word)
            if x.shape[-1] != slot.elems:
                x = x[..., :slot.elems]
        x = x.reshape(*lead, *shape)
        return x.astype(jnp.bool_) if dtype == np.bool_ else x


PACK_BLOCK_BYTES = 512 << 10  # HostRows.write copies rows in blocks of this size (half of one core's 1 MiB L2 here)


class HostRows:
    """Packed rows in host memory (``array``: uint32[rows, row_words], NumPy) with a writable NumPy view of each
    leaf's elements in them, built once: packing a host batch is then one strided copy per leaf, ``write``, with no
    per-call conversions (a view per call cost more than the copy for a batch of a few dozen items).

    ``write`` copies only the leaves' bytes; the bytes ``pack`` pads with zeros (after a leaf that ends inside a
    word) are left as they are, so they must be zero already: ``zeroed`` arrays keep them so for good, and
    ``zero_padding`` clears them in an array that held something else."""

    def __init__(self, layout: RowLayout, array: np.ndarray):
        self.layout, self.array = layout, array
        self.ring = layout.to_ring(array)  # the same bytes in the ring's element type, as a kernel takes them
        self.block_rows = max(1, PACK_BLOCK_BYTES // layout.row_bytes)
        rows, raw = array.shape[0], array.view(np.uint8)
        self.leaves, self.padding = [], []
        for slot, shape, dtype in zip(layout.slots, layout.spec.shapes, layout.spec.dtypes):
            first = 4 * slot.offset
            if slot.elems == 0:
                self.leaves.append(None)
                continue
            strides = [dtype.itemsize]
            for size in reversed(shape[1:]):
                strides.insert(0, strides[0] * size)
            self.leaves.append(np.ndarray((rows, *shape), dtype, buffer=raw, offset=first,
                                          strides=(layout.row_bytes, *strides[:len(shape)])))
            used = first + slot.elems * dtype.itemsize
            if used < 4 * (slot.offset + slot.words):
                self.padding.append(raw[:, used:4 * (slot.offset + slot.words)])

    @classmethod
    def zeroed(cls, layout: RowLayout, rows: int) -> "HostRows":
        """Fresh, 64-byte-aligned rows (``aligned_empty``), all bytes zero."""
        array = aligned_empty((rows, layout.row_words))
        array.fill(0)
        return cls(layout, array)

    def zero_padding(self, at: int, count: int) -> None:
        """Zero the padding bytes of rows [at, at + count)."""
        for padding in self.padding:
            padding[at:at + count] = 0

    def write(self, leaves, start: int, count: int, at: int) -> None:
        """Items [start, start + count) of ``leaves`` (a checked batch's leaves: NumPy or device arrays, in the
        spec's dtypes or 64-bit ones that ``cast=True`` admitted, which the copy narrows) into rows [at, at + count),
        bytes as ``pack`` lays them out (NaN payloads included).

        Rows are written in blocks of ``PACK_BLOCK_BYTES``, every leaf of a block before the next: leaf by leaf
        over a large batch, each leaf's strided writes fetched every row again from L3 or DRAM."""
        step = self.block_rows
        blocks = ((0, count),) if count <= step else [(low, min(count, low + step)) for low in range(0, count, step)]
        for low, high in blocks:
            for view, leaf in zip(self.leaves, leaves):
                if view is not None:
                    # a device array is read to the host whole (JAX keeps that copy): slicing it first would be a
                    # device computation per leaf and block
                    view[at + low:at + high] = (leaf if type(leaf) is np.ndarray else np.asarray(leaf))[
                        start + low:start + high]


def aligned_empty(shape) -> np.ndarray:
    """An uninitialised uint32 array whose data starts on a 64-byte boundary: JAX's CPU client then uses the NumPy
    memory in place instead of copying it, so whoever writes it again must first know that every computation that
    read it has finished."""
    size = int(np.prod(shape))
    raw = np.empty(size + 16, np.uint32)
    offset = (-raw.ctypes.data % 64) // 4
    return raw[offset:offset + size].reshape(shape)


# ------------------------------------------------------------------------------------------------------------------
# State
# ------------------------------------------------------------------------------------------------------------------
@state_dataclass
class StorageState:
    rows: jax.Array  # uint32[capacity, row_words] (uint8[capacity, row_bytes]: RowLayout.ring_dtype), sharded on axis 0
    cursor: jax.Array  # int32[shards]: next slot each shard writes
    laps: jax.Array  # int32[shards]: completed passes of each shard's ring
    next_shard: jax.Array  # int32[]: the shard that receives the next ingested item (round robin)


def init(layout: RowLayout, capacity: int, num_shards: int) -> StorageState:
    """Empty storage. Works under ``jax.eval_shape`` so a plan can be sized without allocating."""
    return StorageState(
        rows=jnp.zeros((capacity, layout.ring_width), layout.ring_dtype),
        cursor=jnp.zeros((num_shards,), jnp.int32),
        laps=jnp.zeros((num_shards,), jnp.int32),
        next_shard=jnp.zeros((), jnp.int32),
    )


# ------------------------------------------------------------------------------------------------------------------
# Per-shard kernels (called inside shard_map; `rows` is this shard's [shard_capacity, row_words] block)
# ------------------------------------------------------------------------------------------------------------------
def shard_count(cursor, laps, shard_capacity: int):
    """Valid items in a shard: the whole ring once it has wrapped."""
    return jnp.where(laps > 0, shard_capacity, cursor)


def slot_generation(cursor, laps, slot):
    """How many times ``slot`` has been written: the generation an id for it must carry to be live."""
    return laps + (slot < cursor).astype(jnp.int32)


def deal(batch, next_shard, n, shard_index, num_shards: int):
    """This shard's items of a round-robin deal: rows ``r, r+S, r+2S, ...`` of a batch padded to ``S*k`` rows.

    Returns (items [k, ...], count of valid ones). Item g of the batch goes to shard ``(next_shard + g) % S``.
    """
    first = (shard_index - next_shard) % num_shards
    count = jnp.clip((n - first + num_shards - 1) // num_shards, 0, None)
    if num_shards == 1:
        return batch, count

    def take(leaf):
        k = leaf.shape[0] // num_shards
        return lax.dynamic_index_in_dim(leaf.reshape(k, num_shards, *leaf.shape[1:]), first, axis=1, keepdims=False)

    return jax.tree_util.tree_map(take, batch), count


def streams_per_shard(streams: int, num_shards: int) -> int:
    """Streams interleaved in each shard's ring when ``streams`` streams are dealt over ``num_shards`` shards."""
    return max(1, streams // num_shards)


def ring_row(slots, streams: int, shard_capacity: int):
    """The row of a shard's ring that holds ``slots`` (jax or NumPy integers). With ``streams`` interleaved streams
    per shard (slot ``t * streams + e`` is step t of stream e), stream e owns rows ``[e * steps, (e + 1) * steps)``
    and its step t is row ``e * steps + t % steps``, where ``steps = shard_capacity // streams``."""
    if streams == 1:
        return slots
    return (slots % streams) * (shard_capacity // streams) + slots // streams


ROW_COPY_MIN_BYTES = 1024  # byte rings with rows this wide are written row by row (see write); narrower ones scatter


def write(rows, cursor, laps, block, count, streams: int = 1):
    """Write the first ``count`` rows of ``block`` at slots from ``cursor`` on, wrapping around the ring: (rows,
    cursor, laps). ``streams``: see ``ring_row``.

    One row scatter into the donated ring (wide rows of a byte ring: a loop of row copies, see below): item i goes to
    the row of slot ``(cursor + i) % capacity``, and the padding rows past ``count`` get an out-of-range index, which
    the scatter drops, so they never touch stored items. No branch: a conditional around the write (fits / wraps) made
    XLA:CPU copy the taken branch's result and cost more than the scatter itself, and a masked dynamic-update-slice
    reads the old rows back only to keep them.

    A ring in host memory is written in place on the host (``where_rows_live``): only ``block`` crosses.
    """
    capacity = rows.shape[0]
    rows = where_rows_live(functools.partial(_write, streams=streams), rows, cursor, block, count, to_device=False)
    end = cursor + count
    return rows, end % capacity, laps + (end >= capacity).astype(jnp.int32)


def _write(rows, cursor, block, count, streams: int):
    capacity, k = rows.shape[0], block.shape[0]
    assert k <= capacity, "the shell splits batches larger than a shard's ring"
    if rows.dtype == jnp.uint8 and rows.shape[1] >= ROW_COPY_MIN_BYTES:
        # XLA:CPU scatters a uint8 ring byte by byte (slower than the same rows as uint32 words); a loop
        # of whole-row copies runs at the speed of the word scatter and writes only the ``count`` valid rows
        def copy_row(i, rows):
            row = ring_row((cursor + i) % capacity, streams, capacity)
            return lax.dynamic_update_slice_in_dim(rows, lax.dynamic_slice_in_dim(block, i, 1), row, axis=0)

        rows = lax.fori_loop(0, count, copy_row, rows)
    else:
        iota = lax.iota(jnp.int32, k)
        target = jnp.where(iota < count, ring_row((cursor + iota) % capacity, streams, capacity), capacity)
        rows = rows.at[target].set(block, mode="drop", unique_indices=True)
    return rows


def gather(rows, slots):
    """rows[slots] for in-range slots (the samplers guarantee the range), gathered where the rows live."""
    return where_rows_live(_take, rows, slots)


def _take(rows, slots):
    return rows.at[slots].get(mode="promise_in_bounds")


def in_host_memory(x) -> bool:
    """Inside a trace: whether ``x`` lives in host memory (a leaf placed in ``pinned_host``)."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def where_rows_live(fn, rows, *args, to_device: bool = True):
    """``fn(rows, *args)``, computed where ``rows`` lives. For a ring in device memory that is just the call. For a
    ring in host memory the arguments are moved to the host, ``fn`` runs as a host computation over the ring in place,
    and (``to_device``) its result is moved to device memory: what crosses is ``args`` and the result, never the
    ring. A write passes ``to_device=False``: the new ring stays in host memory, and a donated ring is updated in
    place."""
    if not in_host_memory(rows):
        return fn(rows, *args)
    args = jax.device_put(args, jax.memory.Space.Host)
    with compute_on("device_host"):
        out = fn(rows, *args)
    return jax.device_put(out, jax.memory.Space.Device) if to_device else out
