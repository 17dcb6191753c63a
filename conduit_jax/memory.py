"""What a replay state needs in each memory, what this machine has free, and the check between the two that runs
before anything is allocated.

Without it, a capacity that cannot fit is found out by XLA on first use: ``RESOURCE_EXHAUSTED`` on one device, and on
an emulated multi-device CPU mesh a rendezvous timeout that aborts the process. ``check_fits`` raises a
``CapacityError`` instead, naming what is short, the largest capacity that fits and what else to change.

Where the bytes live: each leaf's ``NamedSharding`` gives the bytes on every device (``shard_shape``) and the memory
kind. On a GPU or TPU, ``device`` memory is each device's own (what its allocator reports free), and the two host
kinds share the host's DRAM. On XLA:CPU every kind of every device is the host's DRAM: one pool.

The host's free memory is the least of what bounds this process: MemAvailable, the cgroup's limit (v2 ``memory.max``
or v1 ``memory.limit_in_bytes``, less what the cgroup uses) and the address-space limit (``RLIMIT_AS``, less what the
process has mapped).
"""

from __future__ import annotations

import collections
import os
import resource
from typing import Optional

from conduit_jax.errors import CapacityError

HOST = "host DRAM"  # the name of the host's pool in needs() and free()


def needs(abstract_state, shardings, already=None) -> dict[str, int]:
    """Bytes the state needs in each memory: ``"<device> device"`` for each accelerator's own memory, ``HOST`` for
    host DRAM (every kind on XLA:CPU). ``already``: the shardings the state has now (a move): leaves that stay where
    they are need nothing new."""
    import jax

    out: collections.Counter = collections.Counter()
    leaves, targets = jax.tree_util.tree_leaves(abstract_state), jax.tree_util.tree_leaves(shardings)
    sources = [None] * len(targets) if already is None else jax.tree_util.tree_leaves(already)
    for leaf, sharding, source in zip(leaves, targets, sources):
        if source is not None and source == sharding:
            continue
        per_device = int(leaf.dtype.itemsize)
        for d in sharding.shard_shape(leaf.shape):
            per_device *= int(d)
        kind = getattr(sharding, "memory_kind", None) or "device"
        for device in sharding.device_set:
            out[HOST if device.platform == "cpu" or kind != "device" else f"{device} device"] += per_device
    return dict(out)


def free(devices) -> dict[str, tuple[int, str]]:
    """Free bytes in each memory the ``devices`` use, with what bounds it: ``{memory: (bytes, why)}``."""
    out = {HOST: host_free()}
    for device in devices:
        if device.platform == "cpu":
            continue
        stats = device.memory_stats() or {}
        if "bytes_limit" in stats:
            out[f"{device} device"] = (int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)),
                                       "the allocator's limit less its use")
    return out


def host_total() -> int:
    """The host's DRAM in bytes (MemTotal)."""
    info = _meminfo()
    if "MemTotal" in info:
        return info["MemTotal"]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


def host_free() -> tuple[int, str]:
    """Free host memory for this process and what bounds it (see the module docstring)."""
    bounds = []
    info = _meminfo()
    if "MemAvailable" in info:
        bounds.append((info["MemAvailable"], "MemAvailable"))
    else:
        try:
            bounds.append((os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), "free pages"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            pass
    cgroup = _cgroup_free()
    if cgroup is not None:
        bounds.append((cgroup, "the cgroup's memory limit"))
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit != resource.RLIM_INFINITY:
        bounds.append((limit - _status_bytes("VmSize"), "the address-space limit (ulimit -v)"))
    if not bounds:  # pragma: no cover - not Linux
        return 1 << 62, "unknown"
    return min(bounds)


def check_fits(abstract_state, shardings, capacity: int, multiple: int, where: str, already=None) -> None:
    """Raise ``CapacityError`` if the state does not fit the memory it is placed in. ``multiple``: what a capacity
    must be a multiple of (the shard count), for the capacity it suggests. ``already``: the state's shardings now,
    for a move (a leaf that moves is copied before its old buffer is freed, so its new place needs its bytes)."""
    need = needs(abstract_state, shardings, already)
    have = free(_devices(shardings))
    for memory, bytes_needed in sorted(need.items()):
        if memory not in have:
            continue
        available, why = have[memory]
        if bytes_needed <= available:
            continue
        fits = int(capacity * available / bytes_needed) // multiple * multiple
        hint = (f"capacity <= {fits:,} fits" if fits > 0 else "no capacity fits")
        host_tier = ("" if memory == HOST else
                     "; or keep the ring in host memory: placement.plan(spec, capacity, "
                     "placement.Topology.detect()) spills it to pinned_host when device memory is short")
        raise CapacityError(f"{where}: the state of capacity {capacity:,} needs {format_bytes(bytes_needed)} in "
                            f"{memory} but {format_bytes(max(available, 0))} is free (bounded by {why}); {hint}"
                            f"{host_tier}, or free memory. Nothing was allocated.")


def _devices(shardings):
    import jax

    return {device for sharding in jax.tree_util.tree_leaves(shardings) for device in sharding.device_set}


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def _status_bytes(key: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_free() -> Optional[int]:
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                text = f.read().strip()
            if text == "max" or int(text) >= 1 << 60:
                return None
            with open(usage_file) as f:
                return int(text) - int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units, one decimal: ``34.9 GB``."""
    n = float(n)
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
