"""Topology: the devices, memories and links a plan places experience on.

A topology is data (frozen dataclasses of numbers and strings, JSON round-trip). It describes:
  * devices, each on a node (a host) and driven by a process;
  * memory spaces of three kinds: ``device`` (one per device: HBM, or DRAM on the CPU backend), and per node
    ``pinned_host`` and ``unpinned_host``; each has a usable capacity, a streaming bandwidth and the time of one
    latency-bound random row read, and lives in a physical *pool* (a node's DRAM holds both host kinds, and on the CPU
    backend the device memories too) whose capacity bounds everything in it together;
  * link classes (bandwidth one way, latency per transfer, and the aggregate bandwidth a node's devices share):
    ``local`` (a device reading its own memory), ``peer`` (another device's memory on the same node: NVLink, PCIe
    peer-to-peer, or a memcpy on CPU), ``host_pinned`` / ``host_pageable`` (host memory to a device of that node: PCIe),
    ``network`` (any memory on another node). ``Topology.link(memory, device)`` resolves the link between every memory
    and every device; ``Topology.links()`` enumerates them all;
  * the dispatch costs of the runtime on this kind of machine (``Timing``): on XLA:CPU these dominate small-batch
    latency (ARCHITECTURE.md, "Kernel design on CPU").

``Topology.detect()`` reads the running JAX backend and probes this machine (bounded to a few hundred ms); the presets
(``emulated_cpu``, ``h200``, ``dgx_h100``, ``pcie_8gpu``, ``cluster``) are built from public hardware figures, each
cited where it is set.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import time
from typing import Iterator, Optional

from conduit_jax import memory
from conduit_jax.errors import ConfigError

MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")
LINK_CLASSES = ("local", "peer", "host_pinned", "host_pageable", "network")

KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
GiB = 1 << 30
US, NS = 1e-6, 1e-9


class PlacementError(ConfigError):
    """A placement request cannot be met (capacity, topology or workload), or a plan does not match the devices it is
    applied to. The message names the constraint, by how much it fails, and what would fit. A ``ConfigError``: bad
    arguments of the placement functions (a preset's sizes, a workload's fields, a topology file) raise it too."""


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(where: str, name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum`` (a Python or NumPy int, not a bool or a float), else a PlacementError."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise PlacementError(f"{where}: {name} must be an int >= {minimum}, got {value!r}")
    value = value.__index__()
    if value < minimum:
        raise PlacementError(f"{where}: {name} must be an int >= {minimum}, got {value}")
    return value


def check_bytes(where: str, name: str, value, minimum: int = 1) -> int:
    """A memory size: an int or a finite number of bytes >= ``minimum``, as an int."""
    if hasattr(value, "__index__") and not isinstance(value, bool):
        value = value.__index__()
    if not _is_number(value) or not math.isfinite(value) or value < minimum:
        raise PlacementError(f"{where}: {name} must be a finite number of bytes >= {minimum}, got {value!r}")
    return int(value)


def check_rate(where: str, name: str, value, minimum: float = 0.0, strict: bool = True) -> float:
    """A bandwidth or time: a finite number > ``minimum`` (>= when not ``strict``)."""
    ok = _is_number(value) and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        raise PlacementError(f"{where}: {name} must be a finite number {'>' if strict else '>='} {minimum:g}, got "
                             f"{value!r}")
    return float(value)


# ------------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Link:
    """One link class. ``bandwidth`` is one device's share one way when nobody else uses the link (bytes/s);
    ``aggregate`` the bandwidth all devices of a node share on it (0: each device has its own); ``latency`` the fixed
    cost of one transfer (s). ``elided``: a copy over this link inside a jitted call costs nothing (XLA:CPU aliases
    host and device memory; checked in the compiled HLO: no copy op)."""

    name: str
    bandwidth: float
    latency: float
    aggregate: float = 0.0
    elided: bool = False

    def effective_bandwidth(self, concurrent: int = 1) -> float:
        """Per-device bandwidth when ``concurrent`` devices of a node use this link at once (contention)."""
        if self.aggregate <= 0 or concurrent <= 1:
            return self.bandwidth
        return min(self.bandwidth, self.aggregate / concurrent)

    def transfer_time(self, nbytes: float, concurrent: int = 1) -> float:
        if nbytes <= 0 or self.elided:
            return 0.0
        return self.latency + nbytes / self.effective_bandwidth(concurrent)


@dataclasses.dataclass(frozen=True)
class MemorySpace:
    """A memory: ``kind`` one of MEMORY_KINDS; ``device`` the owning device id for kind ``device``, -1 for host memory
    (shared by the node's devices). ``capacity`` is what this kind may use (bytes); ``pool`` names the physical memory
    it shares with others (capacities in ``Topology.pools``). ``row_time`` is one latency-bound random row read (s):
    DRAM latency over the memory-level parallelism a gather reaches on this memory."""

    name: str
    kind: str
    node: int
    device: int
    capacity: int
    pool: str
    bandwidth: float
    row_time: float


@dataclasses.dataclass(frozen=True)
class Device:
    id: int
    node: int
    process: int
    platform: str
    model: str


@dataclasses.dataclass(frozen=True)
class Timing:
    """What one jitted call costs besides moving bytes, on this kind of machine.

    launch: floor of one jitted call (s). kernel: each extra top-level kernel of a call. mesh_launch: added per device
    of a multi-device call driven by one process; mesh_sync: added once when a call spans more than one device.
    collective: fixed cost of one collective (each algorithm step adds its link's latency). write_bandwidth and
    write_row: an ingest writes each row in place at that bandwidth plus a fixed time per row (deal, pack, masked
    dynamic-update-slice). put: one small host -> device array transfer outside jit.
    cores: parallel workers for per-shard work in one process (0: every device runs in parallel, as GPUs do).
    cache_bytes / cache_row_time: a last-level cache that serves random rows of a buffer that fits in it faster.
    """

    launch: float
    kernel: float
    mesh_launch: float
    mesh_sync: float
    collective: float
    write_bandwidth: float
    write_row: float = 0.0
    put: float = 0.0
    cores: int = 0
    cache_bytes: int = 0
    cache_row_time: float = 0.0


def parse_json(text, where: str, what: str):
    """``json.loads(text)``, or a ``PlacementError`` naming ``where`` when ``text`` is not a JSON string."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise PlacementError(f"{where}: text must be a JSON string, got {type(text).__name__}")
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise PlacementError(f"{where}: malformed {what}: not JSON ({exc})") from None


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str
    devices: tuple[Device, ...]
    memories: tuple[MemorySpace, ...]
    pools: tuple[tuple[str, int], ...]  # (pool name, capacity in bytes)
    links: tuple[Link, ...]  # one per link class in LINK_CLASSES that exists here
    timing: Timing
    source: str = ""  # where the figures come from: a preset's citation or "detected on <host>"
    probe: tuple[tuple[str, float], ...] = ()  # what detect() measured (name, value): kept for the record

    def __post_init__(self):
        ids = [d.id for d in self.devices]
        if len(set(ids)) != len(ids):
            raise PlacementError(f"Topology {self.name!r}: device ids must be unique, got {ids}")
        if not self.devices:
            raise PlacementError(f"Topology {self.name!r}: no devices")
        for mem in self.memories:
            if mem.kind not in MEMORY_KINDS:
                raise PlacementError(f"Topology {self.name!r}: memory {mem.name!r} has kind {mem.kind!r}, expected "
                                     f"one of {MEMORY_KINDS}")
        # indexes (not fields): device id -> device memory, node -> host memories, link class -> link
        object.__setattr__(self, "_device_by_id", {d.id: d for d in self.devices})
        object.__setattr__(self, "_device_memory", {m.device: m for m in self.memories if m.kind == "device"})
        object.__setattr__(self, "_host_memory", {(m.node, m.kind): m for m in self.memories if m.kind != "device"})
        object.__setattr__(self, "_link", {link.name: link for link in self.links})
        object.__setattr__(self, "_pool", dict(self.pools))
        missing = [d.id for d in self.devices if d.id not in self._device_memory]
        if missing:
            raise PlacementError(f"Topology {self.name!r}: devices {missing[:8]} have no 'device' memory")
        # the figures the cost model divides by or adds up: a zero, negative or non-finite one would price a plan at
        # inf or NaN, or let it use memory that does not exist
        where = f"Topology {self.name!r}"
        for mem in self.memories:
            check_bytes(f"{where}: memory {mem.name!r}", "capacity", mem.capacity, minimum=0)
            check_rate(f"{where}: memory {mem.name!r}", "bandwidth", mem.bandwidth)
            check_rate(f"{where}: memory {mem.name!r}", "row_time", mem.row_time, strict=False)
        for pool, capacity in self.pools:
            check_bytes(f"{where}: pool {pool!r}", "capacity", capacity, minimum=0)
        for link in self.links:
            check_rate(f"{where}: link {link.name!r}", "bandwidth", link.bandwidth)
            check_rate(f"{where}: link {link.name!r}", "latency", link.latency, strict=False)
            check_rate(f"{where}: link {link.name!r}", "aggregate", link.aggregate, strict=False)
        for field in dataclasses.fields(Timing):
            value = getattr(self.timing, field.name)
            if field.name == "write_bandwidth":
                check_rate(f"{where}: timing", field.name, value)
            elif field.name in ("cores", "cache_bytes"):
                check_int(f"{where}: timing", field.name, value, minimum=0)
            else:
                check_rate(f"{where}: timing", field.name, value, strict=False)

    # -- lookups -------------------------------------------------------------------------------------------------
    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({d.node for d in self.devices}))

    @property
    def kinds(self) -> tuple[str, ...]:
        """Memory kinds present, fastest first."""
        present = {m.kind for m in self.memories}
        return tuple(k for k in MEMORY_KINDS if k in present)

    def device(self, device_id: int) -> Device:
        try:
            return self._device_by_id[device_id]
        except KeyError:
            raise PlacementError(f"Topology {self.name!r} has no device {device_id}; its devices are "
                                 f"{id_ranges([d.id for d in self.devices])}") from None

    def memory(self, device_id: int, kind: str) -> Optional[MemorySpace]:
        """The memory of ``kind`` that ``device_id`` addresses: its own device memory, or its node's host memory."""
        if kind == "device":
            return self._device_memory.get(device_id)
        return self._host_memory.get((self.device(device_id).node, kind))

    def pool_capacity(self, pool: str) -> int:
        return self._pool.get(pool, 0)

    def link_class(self, name: str) -> Link:
        return self._link[name]

    def link(self, memory: MemorySpace, device: Device) -> Link:
        """The link a device reads ``memory`` over."""
        if memory.node != device.node:
            return self._link["network"]
        if memory.kind == "device":
            return self._link["local"] if memory.device == device.id else self._link["peer"]
        return self._link["host_pinned" if memory.kind == "pinned_host" else "host_pageable"]

    def links_between(self) -> Iterator[tuple[MemorySpace, Device, Link]]:
        """Every (memory, device, link): the full matrix, generated (a 1,024-GPU cluster has 1.3M pairs)."""
        for memory in self.memories:
            for device in self.devices:
                yield memory, device, self.link(memory, device)

    # -- JSON ------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": "conduit-topology/1",
            "name": self.name,
            "source": self.source,
            "timing": dataclasses.asdict(self.timing),
            "pools": [list(p) for p in self.pools],
            "links": [dataclasses.asdict(link) for link in self.links],
            # compact columns: a 1,024-GPU cluster stays a few hundred KB
            "devices": {f.name: [getattr(d, f.name) for d in self.devices] for f in dataclasses.fields(Device)},
            "memories": {f.name: [getattr(m, f.name) for m in self.memories]
                         for f in dataclasses.fields(MemorySpace)},
            "probe": [list(p) for p in self.probe],
        }

    def to_json(self, indent: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> "Topology":
        if not isinstance(data, dict):
            raise PlacementError(f"Topology.from_json(): expected a JSON object with format 'conduit-topology/1', "
                                 f"got {type(data).__name__}")
        if data.get("format") != "conduit-topology/1":
            raise PlacementError(f"Topology.from_json(): format must be 'conduit-topology/1', got "
                                 f"{data.get('format')!r}")
        try:
            def rows(columns, typ):
                names = [f.name for f in dataclasses.fields(typ)]
                return tuple(typ(*values) for values in zip(*(columns[n] for n in names)))

            return cls(
                name=data["name"], source=data.get("source", ""),
                timing=Timing(**data["timing"]),
                pools=tuple((str(p), int(c)) for p, c in data["pools"]),
                links=tuple(Link(**link) for link in data["links"]),
                devices=rows(data["devices"], Device),
                memories=rows(data["memories"], MemorySpace),
                probe=tuple((str(k), float(v)) for k, v in data.get("probe", ())),
            )
        except PlacementError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlacementError(f"Topology.from_json(): malformed topology ({type(exc).__name__}: {exc})") from None

    @classmethod
    def from_json(cls, text: str) -> "Topology":
        return cls.from_dict(parse_json(text, "Topology.from_json()", "topology"))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.to_json(indent=1))

    @classmethod
    def load(cls, preset_or_path: str) -> "Topology":
        """A preset name (see ``PRESETS``; ``cluster:NODES[:NODE_PRESET[:GBPS]]``), ``detect``, or a JSON file."""
        if not isinstance(preset_or_path, (str, os.PathLike)):
            raise PlacementError(f"Topology.load(): preset_or_path must be a preset name or the path of a topology "
                                 f"JSON file, got {type(preset_or_path).__name__} {preset_or_path!r}")
        name = os.fspath(preset_or_path).strip()
        if name == "detect":
            return cls.detect()
        head, *args = name.split(":")
        if head in PRESETS:
            try:
                return PRESETS[head](*(_preset_arg(a) for a in args))
            except (TypeError, PlacementError) as exc:  # too many arguments, or values the preset refuses
                raise PlacementError(f"Topology.load({name!r}): bad preset arguments ({exc})") from None
        if os.path.isdir(name):
            raise PlacementError(f"Topology.load({name!r}): a directory, not a preset or a topology JSON file")
        if os.path.exists(name):
            try:
                with open(name, "rb") as f:
                    text = f.read()
            except OSError as exc:
                raise PlacementError(f"Topology.load({name!r}): cannot read the file: {exc.strerror}") from None
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise PlacementError(f"Topology.load({name!r}): not a topology JSON file (not JSON: {exc})") from None
            try:
                return cls.from_dict(data)
            except PlacementError as exc:
                raise PlacementError(f"Topology.load({name!r}): "
                                     f"{str(exc).removeprefix('Topology.from_json(): ')}") from None
        raise PlacementError(f"Topology.load({name!r}): neither a preset ({', '.join(PRESETS)}, detect) nor a "
                             f"JSON file")

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def uniform_nodes(cls, name: str, *, nodes: int, devices_per_node: int, platform: str, model: str,
                      device_memory: int, device_bandwidth: float, device_row_time: float,
                      host_memory: int, pinned_limit: int, host_bandwidth: float, host_row_time: float,
                      links: dict[str, Link], timing: Timing, device_in_host_pool: bool = False,
                      processes_per_node: int = 1, source: str = "") -> "Topology":
        """Identical nodes of identical devices (every preset; also the random topologies of the tests)."""
        where = f"Topology {name!r}"
        nodes = check_int(where, "nodes", nodes)
        devices_per_node = check_int(where, "devices_per_node", devices_per_node)
        processes_per_node = check_int(where, "processes_per_node", processes_per_node)
        device_memory = check_bytes(where, "device_memory", device_memory)
        host_memory = check_bytes(where, "host_memory", host_memory)
        pinned_limit = check_bytes(where, "pinned_limit", pinned_limit, minimum=0)
        for arg, value in (("device_bandwidth", device_bandwidth), ("host_bandwidth", host_bandwidth)):
            check_rate(where, arg, value)
        for arg, value in (("device_row_time", device_row_time), ("host_row_time", host_row_time)):
            check_rate(where, arg, value, strict=False)
        devices, memories, pools = [], [], []
        per_process = max(1, devices_per_node // max(1, processes_per_node))
        for node in range(nodes):
            dram = f"n{node}/dram"
            pools.append((dram, int(host_memory)))
            for local in range(devices_per_node):
                dev_id = node * devices_per_node + local
                devices.append(Device(dev_id, node, node * processes_per_node + local // per_process, platform, model))
                pool = dram if device_in_host_pool else f"n{node}/d{local}/mem"
                if not device_in_host_pool:
                    pools.append((pool, int(device_memory)))
                memories.append(MemorySpace(f"n{node}/d{local}/device", "device", node, dev_id, int(device_memory),
                                            pool, device_bandwidth, device_row_time))
            memories.append(MemorySpace(f"n{node}/pinned_host", "pinned_host", node, -1,
                                        int(min(pinned_limit, host_memory)), dram, host_bandwidth, host_row_time))
            memories.append(MemorySpace(f"n{node}/unpinned_host", "unpinned_host", node, -1, int(host_memory), dram,
                                        host_bandwidth, host_row_time))
        link_list = tuple(dataclasses.replace(links[c], name=c) for c in LINK_CLASSES if c in links)
        return cls(name, tuple(devices), tuple(memories), tuple(pools), link_list, timing, source=source)

    @classmethod
    def detect(cls, probe_budget_s: float = 0.3) -> "Topology":
        """This process's JAX backend: devices, their memory kinds, capacities and a bounded probe of this machine."""
        return _detect(probe_budget_s)

    # -- presets (classmethods delegate to the module functions below) --------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "Topology":
        return cls.load(name)


def _preset_arg(text: str):
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def id_ranges(ids) -> str:
    """The ids as a short text: a range (0..7) when they are consecutive, else the list."""
    ids = sorted(ids)
    if len(ids) > 4 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    return str(ids)


# ------------------------------------------------------------------------------------------------------------------
# This host: a preset fit to the 2-core development machine (ARCHITECTURE.md, "Kernel design on CPU", and the
# placement sweep in benchmarks/bench_placement.py, whose measurements are in benchmarks/results/placement.jsonl).
# detect() re-measures what it can on whatever machine it runs.
# ------------------------------------------------------------------------------------------------------------------
CPU_TIMING = Timing(
    launch=7.5 * US,        # a scalar jit's floor (ARCHITECTURE.md); detect() measures it
    kernel=2.0 * US,        # each top-level fusion or thunk (ARCHITECTURE.md)
    # The emulated mesh on 2 cores, fit to the placement sweep (benchmarks/bench_placement.py): a shard-local gather
    # over S devices costs a fixed part plus a part per device, far above one device's gather; a psum_scatter of the
    # batch adds a fixed part plus one per ring step (the "peer" link below).
    mesh_launch=45 * US,
    mesh_sync=70 * US,
    collective=43 * US,
    write_bandwidth=3 * GB,  # XLA:CPU's dynamic-update-slice (ARCHITECTURE.md)
    write_row=50 * NS,      # replay.ingest of host-packed 96 B rows varied widely from run to run (any memory
    #                         kind); this sits in the middle of that range
    put=10 * US,            # device_put of a small NumPy array; aliased, so size does not matter
    cores=2,
    cache_bytes=32 << 20,   # L3 of this EPYC host (lscpu)
    cache_row_time=15 * NS,
)
# One random 96 B row from a 100 MB ring inside a gather, in a process with 8 emulated devices: below one DRAM
# latency, since the loads of a gather overlap (a few misses in flight); ARCHITECTURE.md's per-row figure is the
# per-leaf case with more kernels around it. A process with one CPU device gathers faster.
CPU_ROW_TIME = 60 * NS
CPU_MEMCPY = 8 * GB         # np.copyto of 64 MB on this host (benchmarks/common.MemcpyMeter measures it in each run)


def _cpu_links(memcpy: float) -> dict[str, Link]:
    # On XLA:CPU all three kinds are the same DRAM: moving a pinned_host array to 'device' inside jit is elided (no
    # copy op in the compiled HLO), while an eager device_put between kinds is a real memcpy (both ways).
    return {
        "local": Link("local", memcpy, 0.0),
        "peer": Link("peer", memcpy, 24 * US, aggregate=memcpy),  # one ring step of an emulated collective
        "host_pinned": Link("host_pinned", memcpy, 0.0, aggregate=memcpy, elided=True),
        "host_pageable": Link("host_pageable", memcpy, 0.0, aggregate=memcpy, elided=True),
        "network": Link("network", 1.25 * GB, 50 * US),  # loopback gloo between local processes: a guess, untested
    }


def _meminfo() -> tuple[int, int]:
    """(MemTotal, free host memory for this process) in bytes (``memory.host_free``: MemAvailable, or less under a
    cgroup or address-space limit)."""
    return memory.host_total(), memory.host_free()[0]


def emulated_cpu(devices: int = 8, *, host_memory: Optional[int] = None, device_memory: Optional[int] = None,
                 pinned_limit: Optional[int] = None) -> Topology:
    """The emulated CPU mesh this project tests on (``--xla_force_host_platform_device_count``): every memory kind is
    the host's DRAM, so one pool bounds them all. Host memory defaults to this machine's MemAvailable."""
    devices = check_int("emulated_cpu()", "devices", devices)
    host = check_bytes("emulated_cpu()", "host_memory", host_memory) if host_memory is not None else \
        int(_meminfo()[1])
    if device_memory is not None:
        device_memory = check_bytes("emulated_cpu()", "device_memory", device_memory)
    if pinned_limit is not None:
        pinned_limit = check_bytes("emulated_cpu()", "pinned_limit", pinned_limit, minimum=0)
    return Topology.uniform_nodes(
        f"emulated_cpu:{devices}", nodes=1, devices_per_node=devices, platform="cpu", model="cpu",
        device_memory=int(device_memory if device_memory is not None else host), device_bandwidth=CPU_MEMCPY,
        device_row_time=CPU_ROW_TIME, host_memory=host, pinned_limit=int(pinned_limit if pinned_limit is not None
                                                                            else host),
        host_bandwidth=CPU_MEMCPY, host_row_time=CPU_ROW_TIME, links=_cpu_links(CPU_MEMCPY), timing=CPU_TIMING,
        device_in_host_pool=True,
        source="measured on the 2-core development host (ARCHITECTURE.md; benchmarks/bench_placement.py)")


# ------------------------------------------------------------------------------------------------------------------
# GPU presets. Figures are public datasheet numbers; derived ones say how they were derived.
# ------------------------------------------------------------------------------------------------------------------
# Dispatch on a GPU host: one XLA executable launch is ~10 us of host work (CUDA kernel launch ~3-5 us each, plus PjRt
# argument handling); a process driving 8 local GPUs launches on one thread per device, ~1 us each plus a ~5 us
# barrier; one NCCL collective over NVLink is ~10 us of fixed cost (NCCL tests, small messages) plus ~2 us per ring
# step. Rows are read by thousands of threads at once: a random 64 B sector costs bytes/bandwidth at ~40% efficiency,
# not the ~600 ns HBM latency.
GPU_TIMING = Timing(launch=10 * US, kernel=2 * US, mesh_launch=1 * US, mesh_sync=5 * US, collective=8 * US,
                    write_bandwidth=500 * GB, put=10 * US, cores=0)
# PCIe Gen5 x16: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s per direction (PCI-SIG); pinned DMA reaches ~55 GB/s, a
# pageable copy goes through a staging buffer at about half that (CUDA best-practices guide: "pinned memory ...
# highest bandwidth"). Latency of one cudaMemcpyAsync: ~5 us pinned, ~10 us pageable.
PCIE5_PINNED = Link("host_pinned", 55 * GB, 5 * US)
PCIE5_PAGEABLE = Link("host_pageable", 25 * GB, 10 * US)
# Host side of a GPU node: DDR5 server memory, ~100 ns random latency and ~4 outstanding misses for a gather thread.
HOST_ROW_TIME = 25 * NS
HOST_BANDWIDTH = 200 * GB


def _gpu_row_time(bandwidth: float) -> float:
    return 64 / (0.4 * bandwidth)


def h200(host_memory: int = 512 * GiB) -> Topology:
    """One H200 in a PCIe Gen5 server. NVIDIA H200 datasheet: 141 GB HBM3e at 4.8 TB/s; PCIe Gen5 128 GB/s (both
    directions). Host memory is not part of the GPU's datasheet: 512 GiB is an assumption (pass another)."""
    host_memory = check_bytes("h200()", "host_memory", host_memory)
    bw = 4.8 * TB
    return Topology.uniform_nodes(
        "h200", nodes=1, devices_per_node=1, platform="gpu", model="NVIDIA H200", device_memory=int(141 * GB),
        device_bandwidth=bw, device_row_time=_gpu_row_time(bw), host_memory=host_memory,
        pinned_limit=host_memory // 2, host_bandwidth=HOST_BANDWIDTH, host_row_time=HOST_ROW_TIME,
        links={"local": Link("local", bw, 0.0), "peer": Link("peer", bw, 0.0), "host_pinned": PCIE5_PINNED,
               "host_pageable": PCIE5_PAGEABLE, "network": Link("network", 400 / 8 * GB, 5 * US)},
        timing=GPU_TIMING, source="NVIDIA H200 datasheet (141 GB HBM3e, 4.8 TB/s, PCIe Gen5)")


def dgx_h100() -> Topology:
    """NVIDIA DGX H100 (DGX H100 datasheet): 8x H100 SXM 80 GB (H100 datasheet: HBM3 3.35 TB/s), 4x NVSwitch giving
    each GPU 900 GB/s of NVLink bandwidth (both directions: 450 GB/s each way), 2 TB of system memory, each GPU on a
    PCIe Gen5 x16 link through a PCIe switch shared with a second GPU (4 switch uplinks to the 2 CPUs), 8x ConnectX-7
    400 Gb/s for the compute fabric (one NIC per GPU)."""
    bw = 3.35 * TB
    return Topology.uniform_nodes(
        "dgx_h100", nodes=1, devices_per_node=8, platform="gpu", model="NVIDIA H100 SXM5 80GB",
        device_memory=int(80 * GB), device_bandwidth=bw, device_row_time=_gpu_row_time(bw), host_memory=int(2 * TB),
        pinned_limit=int(1 * TB), host_bandwidth=2 * HOST_BANDWIDTH, host_row_time=HOST_ROW_TIME,
        links={"local": Link("local", bw, 0.0),
               "peer": Link("peer", 450 * GB, 2 * US),  # NVSwitch: full bandwidth between any pair, no sharing
               "host_pinned": dataclasses.replace(PCIE5_PINNED, aggregate=4 * 55 * GB),
               "host_pageable": dataclasses.replace(PCIE5_PAGEABLE, aggregate=4 * 25 * GB),
               "network": Link("network", 50 * GB, 5 * US, aggregate=400 * GB)},  # 8 x 400 Gb/s NDR, 1 per GPU
        timing=GPU_TIMING, source="NVIDIA DGX H100 and H100 datasheets (80 GB HBM3 3.35 TB/s, NVLink 900 GB/s)")


def pcie_8gpu() -> Topology:
    """Eight H100 PCIe 80 GB (H100 PCIe datasheet: HBM2e 2.0 TB/s, PCIe Gen5 128 GB/s) in a server without NVLink
    bridges: peer copies go over PCIe through the switches and the CPU root complex (~25 GB/s per GPU, ~100 GB/s for the
    box: typical p2pBandwidthLatencyTest figures for Gen5 servers), two GPUs per x16 switch uplink."""
    bw = 2.0 * TB
    return Topology.uniform_nodes(
        "pcie_8gpu", nodes=1, devices_per_node=8, platform="gpu", model="NVIDIA H100 PCIe 80GB",
        device_memory=int(80 * GB), device_bandwidth=bw, device_row_time=_gpu_row_time(bw), host_memory=int(1 * TB),
        pinned_limit=int(512 * GB), host_bandwidth=HOST_BANDWIDTH, host_row_time=HOST_ROW_TIME,
        links={"local": Link("local", bw, 0.0),
               "peer": Link("peer", 25 * GB, 10 * US, aggregate=100 * GB),
               "host_pinned": dataclasses.replace(PCIE5_PINNED, aggregate=4 * 55 * GB),
               "host_pageable": dataclasses.replace(PCIE5_PAGEABLE, aggregate=4 * 25 * GB),
               "network": Link("network", 25 * GB, 5 * US, aggregate=100 * GB)},  # 2 x 400 Gb/s NICs
        timing=GPU_TIMING, source="NVIDIA H100 PCIe datasheet (80 GB HBM2e 2.0 TB/s, PCIe Gen5); no NVLink")


NODE_PRESETS = {"dgx_h100": dgx_h100, "pcie_8gpu": pcie_8gpu, "h200": h200}


def cluster(nodes: int = 128, node_preset: str = "dgx_h100", network_gbps: float = 3200) -> Topology:
    """``nodes`` identical nodes (``node_preset``) joined by a fabric of ``network_gbps`` Gb/s per node (default: 8 x
    400 Gb/s InfiniBand NDR, one ConnectX-7 per GPU as in a DGX H100 SuperPOD), ~5 us RDMA latency. 128 x 8 = 1,024
    GPUs by default."""
    if not isinstance(node_preset, str) or node_preset not in NODE_PRESETS:
        raise PlacementError(f"cluster(): node_preset must be one of {sorted(NODE_PRESETS)}, got {node_preset!r}")
    nodes = check_int("cluster()", "nodes", nodes)
    network_gbps = check_rate("cluster()", "network_gbps (Gb/s per node)", network_gbps)
    node = NODE_PRESETS[node_preset]()
    per_node = len(node.devices)
    first = node.memories[0]
    host = node.memory(0, "unpinned_host")
    pinned = node.memory(0, "pinned_host")
    links = {link.name: link for link in node.links}
    node_bw = network_gbps / 8 * GB
    links["network"] = Link("network", node_bw / per_node, 5 * US, aggregate=node_bw)
    return Topology.uniform_nodes(
        f"cluster:{nodes}:{node_preset}:{network_gbps:g}", nodes=nodes, devices_per_node=per_node,
        platform=node.devices[0].platform, model=node.devices[0].model, device_memory=first.capacity,
        device_bandwidth=first.bandwidth, device_row_time=first.row_time, host_memory=host.capacity,
        pinned_limit=pinned.capacity, host_bandwidth=host.bandwidth, host_row_time=host.row_time, links=links,
        timing=node.timing, source=f"{nodes} x ({node.source}); fabric {network_gbps:g} Gb/s per node")


PRESETS = {"emulated_cpu": emulated_cpu, "cpu": emulated_cpu, "h200": h200, "dgx_h100": dgx_h100,
           "pcie_8gpu": pcie_8gpu, "cluster": cluster}


# ------------------------------------------------------------------------------------------------------------------
# detect(): the running backend plus a bounded probe
# ------------------------------------------------------------------------------------------------------------------
def _median_time(fn, n: int, deadline: float, blocks: int = 3) -> Optional[float]:
    """The least of ``blocks`` block medians of ``n`` calls in all (after a warm-up): on a shared host other
    processes only ever add time, so the quietest block is the best estimate of the call itself."""
    import jax

    jax.block_until_ready(fn())  # compile
    for _ in range(max(1, n // 4)):  # wake the runtime's worker threads (they sleep when idle)
        if time.perf_counter() > deadline:
            break
        jax.block_until_ready(fn())
    medians = []
    per_block = max(3, n // blocks)
    for _ in range(blocks):
        times = []
        for _ in range(per_block):
            if time.perf_counter() > deadline and len(times) >= 3:
                break
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - start)
        times.sort()
        medians.append(times[len(times) // 2])
        if time.perf_counter() > deadline:
            break
    return min(medians) if medians else None


def _probe(device, kinds, budget_s: float) -> dict[str, float]:
    """Measure on ``device``, most useful first: the launch floor, the time of a random row in a gather (a 48 MiB ring,
    bigger than this host's last-level cache, indices from the samplers' hash), then eager copy bandwidth between
    memory kinds. Each stage runs only while the budget lasts; what is not measured keeps its preset value."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import SingleDeviceSharding

    from conduit_jax.samplers import mix32

    out: dict[str, float] = {}
    start = time.perf_counter()
    deadline = start + budget_s

    def until(share: float) -> float:
        return min(deadline, time.perf_counter() + share * budget_s)

    scalar = jax.device_put(np.zeros((), np.int32), device)
    bump = jax.jit(lambda x: x + 1)
    out["launch_s"] = _median_time(lambda: bump(scalar), 60, until(0.07))

    if deadline - time.perf_counter() > 0.5 * budget_s:
        rows_n, words, batch = (48 << 20) // 96, 24, 1024
        # written contents (never-touched zero pages all map one cached page); device_put of aligned NumPy aliases
        host = np.arange(rows_n * words, dtype=np.uint32).reshape(rows_n, words)
        ring = jax.device_put(host, SingleDeviceSharding(device))

        def gather(ring, c):
            i = mix32(mix32(c) + lax.iota(jnp.uint32, batch) * jnp.uint32(0x632BE5AB)) % jnp.uint32(rows_n)
            return ring.at[i.astype(jnp.int32)].get(mode="promise_in_bounds")

        g = jax.jit(gather)
        counters = [jax.device_put(np.uint32(i), device) for i in range(32)]  # committed: no transfer per call
        counter = iter(range(1 << 30))
        t = _median_time(lambda: g(ring, counters[next(counter) % 32]), 45, until(0.3))
        if t and out.get("launch_s"):  # the call's floor and the hash kernel are subtracted
            out["row_time_s"] = max(1 * NS, (t - out["launch_s"] - CPU_TIMING.kernel) / batch)
        del ring, host

    # eager copies between memory kinds (device_put outside jit is a real copy): 1 MiB, device -> kind and back
    nbytes = 1 << 20
    src = jax.device_put(np.ones((nbytes // 4,), np.uint32), SingleDeviceSharding(device, memory_kind="device"))
    back = SingleDeviceSharding(device, memory_kind="device")
    for kind in kinds:
        if kind == "device" or deadline - time.perf_counter() < 0.1 * budget_s:
            continue
        target = SingleDeviceSharding(device, memory_kind=kind)
        t = _median_time(lambda target=target: jax.device_put(src, target), 5, until(0.05))
        if t:
            out[f"copy_device_to_{kind}_Bps"] = nbytes / t
        moved = jax.device_put(src, target)
        t = _median_time(lambda moved=moved: jax.device_put(moved, back), 5, until(0.05))
        if t:
            out[f"copy_{kind}_to_device_Bps"] = nbytes / t
    out["probe_s"] = time.perf_counter() - start
    return out


def _plausible(measured: Optional[float], preset: float, factor: float = 2.0) -> float:
    if measured is None or not preset / factor <= measured <= preset * factor:
        return preset
    return measured


def _detect(probe_budget_s: float) -> Topology:
    import jax

    devices = jax.devices()
    local = jax.local_devices()
    first = local[0]
    platform = first.platform
    kinds = [m.kind for m in first.addressable_memories()]
    kinds = [k for k in MEMORY_KINDS if k in kinds] or ["device"]
    total, avail = _meminfo()
    cores = os.cpu_count() or 1
    probe = _probe(first, kinds, probe_budget_s) if probe_budget_s > 0 else {}

    if platform == "cpu":
        base_timing, row_time, dev_bw, host_bw = CPU_TIMING, CPU_ROW_TIME, CPU_MEMCPY, CPU_MEMCPY
        device_capacity, device_in_pool = avail, True
    else:
        base_timing, dev_bw, host_bw = GPU_TIMING, 2 * TB, HOST_BANDWIDTH
        row_time = _gpu_row_time(dev_bw)
        stats = first.memory_stats() or {}
        limit = stats.get("bytes_limit") or stats.get("bytes_reservable_limit") or 0
        device_capacity = max(0, int(limit) - int(stats.get("bytes_in_use", 0))) if limit else 16 * GiB
        device_in_pool = False
    # a probe of a few hundred ms on a shared host is noisy: a reading more than 2x off the preset is taken for noise
    launch = _plausible(probe.get("launch_s"), base_timing.launch)
    timing = dataclasses.replace(base_timing, launch=launch, cores=cores if platform == "cpu" else 0)
    if platform == "cpu":
        row_time = _plausible(probe.get("row_time_s"), row_time)
        copy = [v for k, v in probe.items() if k.startswith("copy_")]
        if copy:
            host_bw = dev_bw = _plausible(sorted(copy)[len(copy) // 2], CPU_MEMCPY)
        links = _cpu_links(dev_bw)
    else:
        pinned_bw = probe.get("copy_pinned_host_to_device_Bps", PCIE5_PINNED.bandwidth)
        pageable_bw = probe.get("copy_unpinned_host_to_device_Bps", PCIE5_PAGEABLE.bandwidth)
        links = {"local": Link("local", dev_bw, 0.0), "peer": Link("peer", 100 * GB, 5 * US),
                 "host_pinned": dataclasses.replace(PCIE5_PINNED, bandwidth=pinned_bw),
                 "host_pageable": dataclasses.replace(PCIE5_PAGEABLE, bandwidth=pageable_bw),
                 "network": Link("network", 12.5 * GB, 10 * US)}
        row_time = _plausible(probe.get("row_time_s"), row_time)

    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    devs, memories, pools = [], [], []
    for process in sorted(by_process):
        node = process  # one process per host is JAX's multi-host convention
        dram = f"n{node}/dram"
        pools.append((dram, int(avail)))
        for d in by_process[process]:
            devs.append(Device(int(d.id), node, int(process), platform, str(d.device_kind)))
            pool = dram if device_in_pool else f"n{node}/d{d.id}/mem"
            if not device_in_pool:
                pools.append((pool, int(device_capacity)))
            memories.append(MemorySpace(f"n{node}/d{d.id}/device", "device", node, int(d.id), int(device_capacity),
                                        pool, dev_bw, row_time))
        for kind in kinds:
            if kind == "device":
                continue
            cap = avail if kind == "unpinned_host" or platform == "cpu" else avail // 2
            memories.append(MemorySpace(f"n{node}/{kind}", kind, node, -1, int(cap), dram, host_bw,
                                        row_time if platform == "cpu" else HOST_ROW_TIME))
    link_list = tuple(dataclasses.replace(links[c], name=c) for c in LINK_CLASSES)
    name = f"detected:{platform}:{len(devices)}"
    source = (f"detected: {len(devices)} {platform} device(s) ({first.device_kind}), {len(by_process)} process(es), "
              f"host {total / GiB:.1f} GiB ({avail / GiB:.1f} available), {cores} cores")
    return Topology(name, tuple(devs), tuple(memories), tuple(pools), link_list, timing, source=source,
                    probe=tuple(sorted((k, float(v)) for k, v in probe.items() if v is not None)))
