"""Staged ingest: the host area where ingested items wait for the next kernel that runs anyway.

An ingest from host memory is a copy: ``StagingArea.stage`` packs the batch into packed rows after the rows already
waiting, one strided copy per leaf through views built once per area (``storage.HostRows``). The engine hands the
waiting rows to the next kernel it dispatches (a draw, a priority update, a flush), which writes them into the rings
before its own work, in the same dispatch: the write costs what a scatter costs inside a kernel that runs anyway, not
a kernel of its own. Until then the items count everywhere the host decides (size, rate limiter, queue capacity): the
engine keeps its status counters in step at ``stage``.

Reuse. JAX reads a 64-byte-aligned NumPy argument in place on CPU (and copies it to an accelerator while the kernel is
dispatched), so an area given to a kernel is packed again only once that kernel has finished, which its ``finished``
output (a scalar of its own, which outlives any later donation of the state) says. Meanwhile the next rows go into
another area: two when kernels finish in order, a third only while both are still being read.

Host code only (NumPy); the engine (``engine.py``) owns one area per buffer and decides when the rows are written.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from conduit_jax.errors import ConfigError
from conduit_jax.storage import HostRows, RowLayout

STAGING_BYTES = 8 << 20  # a staging area holds at most this many bytes of packed rows (at least one item per shard)
SPARE_AREAS = 2  # finished areas kept for reuse; a fresh one is zero-filled first (every page faulted in)


class StagingArea:
    """Packed rows waiting to be written: ``count`` items of at most ``rows``, in ingest order.

    ``area_rows`` (>= ``rows``): rows each host array has, so that a kernel's padded view of the waiting rows (the
    engine's padding rule) never reaches past it; rows past ``count`` are padding that the kernel drops."""

    def __init__(self, layout: RowLayout, rows: int, area_rows: int):
        self.layout, self.rows, self.area_rows = layout, int(rows), int(area_rows)
        self.count = 0
        self._area: Optional[HostRows] = None  # being filled
        self._given: list[tuple[HostRows, object]] = []  # (area, finished) handed to kernels, oldest first
        self.last: Optional[np.ndarray] = None  # the area most recently handed to a kernel

    @property
    def room(self) -> int:
        """Items that can still be staged before a flush."""
        return self.rows - self.count

    def stage(self, leaves, start: int, count: int) -> None:
        """Pack items ``[start, start + count)`` of ``leaves`` (a checked batch's leaves) after the waiting rows;
        ``count <= room``."""
        assert 0 < count <= self.room, (count, self.room)
        if self._area is None:
            self._area = self._free_area()
        self._area.write(leaves, start, count, self.count)
        self.count += count

    def block(self, rows: int) -> tuple[np.ndarray, int]:
        """The waiting rows as a kernel's argument: the area's first ``rows`` rows (padding included) in the ring's
        element type, and the item count. They stay staged until ``given`` (a kernel that raised took nothing)."""
        return self._area.ring[:rows], self.count

    def given(self, finished) -> None:
        """A kernel that writes the waiting rows has been dispatched: the area is empty again, and the host array
        it read is reused once ``finished`` (an output of that kernel) is ready."""
        self._given.append((self._area, finished))
        del self._given[:-(SPARE_AREAS + 1)]  # older ones are left to the garbage collector
        self.last, self._area, self.count = self._area.array, None, 0

    def _free_area(self) -> HostRows:
        """A host array no kernel is reading: the newest handed-over one whose kernel finished (the likeliest to be in
        cache), else a fresh one."""
        for index in range(len(self._given) - 1, -1, -1):
            area, finished = self._given[index]
            if finished.is_ready():
                del self._given[index]
                return area
        return HostRows.zeroed(self.layout, self.area_rows)


def staging_rows(layout: RowLayout, capacity: int, num_shards: int, limit_bytes: int = STAGING_BYTES) -> int:
    """Items a staging area holds: ``limit_bytes`` of packed rows, a multiple of the shard count, at most a ring."""
    rows = max(1, limit_bytes // layout.row_bytes) // num_shards * num_shards
    return min(capacity, max(num_shards, rows))


def checked_rows(rows, capacity: int, where: str) -> int:
    """``rows`` as a staging area's size; ConfigError naming it unless an int in [1, capacity]."""
    if not isinstance(rows, (int, np.integer)) or isinstance(rows, bool) or not 1 <= rows <= capacity:
        raise ConfigError(f"{where}: staging must be an int in [1, capacity={capacity}] (items the host staging area "
                          f"holds), got {rows!r}")
    return int(rows)
