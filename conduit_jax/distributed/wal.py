"""A shard's write-ahead log of acknowledged ingests: what a restarted shard replays on top of its last checkpoint.

A ``DistributedPlane`` shard (``ray_plane.ShardServer``) appends every batch it has ingested to its log before it
acknowledges the ingest, so an acknowledged item survives a crash of the shard's process: the restarted shard
restores its newest checkpoint (which holds the first ``R`` items it ever inserted) and replays the logged batches
from item ``R`` on, in order. By default the log is written with plain ``write`` calls: the bytes are in the
operating system's page cache when the call returns, which outlives the process (``kill -9``, a Python crash, Ray
restarting the actor) but not a crash or power loss of the host. With ``fsync=True`` each append also waits for
``fsync`` (and a new segment for an ``fsync`` of its directory), so an acknowledged batch is on the disk itself and
survives the host too, at the cost of one disk flush per ingest (``benchmarks/bench_wal.py`` measures both).

Layout: ``<directory>/<start>.log`` segments, ``start`` the shard's inserted count (items) when the segment was
opened, zero-padded. A record is a 24-byte header (magic ``CWAL``, item count, the inserted count before the batch,
CRC-32 of the payload, payload bytes) and the payload: each leaf of the batch in spec order, C-contiguous, in the
spec's dtype. A checkpoint starts a new segment (``rotate`` at the inserted count it covers); once it is on disk the
segments it covers are deleted (``drop_before``). A torn last record (the process died inside ``write``) was never
acknowledged and is ignored on replay.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Iterator
import jax
import numpy as np

_HEADER = struct.Struct("<4sIQIQ")  # magic, items, inserted before the batch, crc32 of the payload, payload bytes
_MAGIC = b"CWAL"
_SUFFIX = ".log"


class IngestLog:
    """The write-ahead log of one shard, in ``directory`` (created). ``spec``: the shard's ``ExperienceSpec``.
    ``fsync``: flush every append to the disk before it returns (see the module docstring)."""

    def __init__(self, directory: str, spec, *, fsync: bool = False):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self.fsync = bool(fsync)
        self._treedef, self._dtypes, self._item_shapes = spec.treedef, spec.dtypes, spec.shapes
        self._item_bytes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                            for shape, dtype in zip(spec.shapes, spec.dtypes)]
        self._file = None
        self.appended_bytes = 0  # payload and headers written by this process

    # -- segments -------------------------------------------------------------------------------------------------
    def segments(self) -> list[int]:
        """Start counts of the segments on disk, oldest first."""
        starts = []
        for name in os.listdir(self.directory):
            if name.endswith(_SUFFIX) and name[:-len(_SUFFIX)].isdigit():
                starts.append(int(name[:-len(_SUFFIX)]))
        return sorted(starts)

    def _path(self, start: int) -> str:
        return os.path.join(self.directory, f"{start:015d}{_SUFFIX}")

    def rotate(self, start: int) -> None:
        """Close the current segment and append from now on to a new one starting at inserted count ``start``."""
        self.close()
        self._file = open(self._path(start), "ab", buffering=0)
        if self.fsync:  # the new file's directory entry must reach the disk too, or a host crash can lose the file
            directory = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)

    def drop_before(self, covered: int) -> None:
        """Delete the segments a checkpoint holding the first ``covered`` items makes unnecessary: every segment whose
        successor starts at or before ``covered`` (its records all precede it)."""
        starts = self.segments()
        for start, following in zip(starts, starts[1:]):
            if following <= covered:
                os.remove(self._path(start))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- records --------------------------------------------------------------------------------------------------
    def append(self, inserted_before: int, batch, n: int) -> None:
        """Log a batch of ``n`` items (already checked against the spec) that the shard has just ingested; returns
        once the bytes are with the operating system (with ``fsync``: on the disk)."""
        leaves = jax.tree_util.tree_leaves(batch)
        payload = b"".join(np.ascontiguousarray(np.asarray(leaf), dtype=dtype).tobytes()
                           for leaf, dtype in zip(leaves, self._dtypes))
        record = _HEADER.pack(_MAGIC, n, inserted_before, zlib.crc32(payload), len(payload)) + payload
        if self._file is None:
            self.rotate(inserted_before)
        self._file.write(record)  # one write: a crash leaves it whole or torn, never interleaved
        if self.fsync:
            os.fsync(self._file.fileno())
        self.appended_bytes += len(record)

    def replay(self, start: int) -> Iterator[tuple[int, object, int]]:
        """``(inserted_before, batch, n)`` for every logged batch from inserted count ``start`` on, in order (the
        batch a pytree of NumPy arrays shaped as the spec); stops at a gap, a torn or damaged record, or the end."""
        expected = start
        for segment in self.segments():
            with open(self._path(segment), "rb") as f:
                data = f.read()
            offset = 0
            while offset + _HEADER.size <= len(data):
                magic, n, before, crc, size = _HEADER.unpack_from(data, offset)
                payload = data[offset + _HEADER.size:offset + _HEADER.size + size]
                if magic != _MAGIC or len(payload) != size or zlib.crc32(payload) != crc or \
                        size != n * sum(self._item_bytes):
                    return  # torn (never acknowledged) or damaged: nothing after it can be trusted
                offset += _HEADER.size + size
                if before + n <= expected:
                    continue  # already in the checkpoint
                if before != expected:
                    return  # a gap: the items in between are not in the log
                yield before, self._unpack(payload, n), n
                expected = before + n

    def _unpack(self, payload: bytes, n: int):
        leaves, offset = [], 0
        for shape, dtype, item_bytes in zip(self._item_shapes, self._dtypes, self._item_bytes):
            size = n * item_bytes
            leaves.append(np.frombuffer(payload[offset:offset + size], dtype=dtype).reshape((n, *shape)))
            offset += size
        return jax.tree_util.tree_unflatten(self._treedef, leaves)
