"""Cost model: the predicted time of one learner iteration's experience path for a given placement.

Every term is bytes over a link (latency + bytes / bandwidth, the bandwidth shared when a node's devices use one link
at once) or a count of latency-bound operations (random rows, dispatches). Terms, per learner iteration:

  ingest    producer host -> storage shards (replicated to every shard as ``replay.ingest`` does, or local to the
            producer's node), then the in-place ring write, plus one call;
  sample    one call of the sample kernel (launch, multi-device overhead) and the index work: a hash for uniform /
            epochs / FIFO; for prioritized and sequence replay, the all-gather of shard masses and one [16]-block read
            per tree level per draw in the index's memory;
  gather    reading the batch's rows where the ring lives: random rows in device memory, or a host-side gather plus a
            copy of the gathered rows over PCIe when the ring is in host memory (free on XLA:CPU, where host and device
            kinds are one DRAM and the move inside jit is elided);
  delivery  the exchange that leaves the batch sharded over the learner's data-parallel devices: the reduce-scatter of
            global draws (every shard gathers the whole batch, masked, as ``replay.sample`` does), a node-local
            reduce-scatter plus a small cross-node exchange when sampling is node-local first, nothing for shard-local
            queues; plus a copy to the learner devices when storage is not co-located with them;
  update    priority updates: ids to every shard, one block rewrite per tree level per id.

What this machine taught (ARCHITECTURE.md, and ``benchmarks/bench_placement.py``, whose predictions and
measurements are in ``benchmarks/results/placement.jsonl``): on XLA:CPU the dispatch terms dominate small batches (a
call's fixed floor plus a cost per kernel: ``topology.CPU_TIMING``), random rows cost about a DRAM latency each, and
the emulated multi-device mesh adds a cost per device to every call on a host with few cores, so one shard beats
eight there. On GPUs the same formulas are dominated by link bandwidths instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Optional

from conduit_jax.placement.topology import MEMORY_KINDS, PlacementError, Topology, id_ranges

SAMPLERS = ("uniform", "prioritized", "fifo", "epochs", "sequences")
PRIORITY_SAMPLERS = ("prioritized", "sequences")
GLOBAL_DRAW_SAMPLERS = ("uniform", "prioritized", "epochs", "sequences")
ROUTES = ("global", "node-local-first", "shard-local")
INGEST_ROUTES = ("replicated", "producer-local")
PARTS = ("storage", "index", "control")
TREE_ARITY = 16  # sumtree.ARITY
ID_BYTES = 12  # a delivered row travels with its (row, generation) id and, for prioritized draws, a probability
CONTROL_BYTES = 64  # cursors, laps and the replicated scalars of one shard (nominal)
# Kernels per sum-tree level (pick / take_along_axis / gather of the next block; for updates: gather the K children,
# sum, scatter), fit to the development host's prioritized samples and updates against uniform ones
# (``benchmarks/bench_placement.py``).
SAMPLE_KERNELS_PER_LEVEL = 5
UPDATE_KERNELS_PER_LEVEL = 4
UPDATE_ARRAYS = 3  # ids, priorities, valid: three host -> device puts per update
INGEST_KERNELS = 6  # per shard: deal, pack/select, dynamic-update-slice, slots, sampler and limiter bookkeeping


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the learner asks of the plane.

    batch_size: items per delivered batch (global, over the learner's data-parallel axis); batches_per_step: batches
    one learner step consumes. ingest_rate: items/s from all producers together; step_time: the learner's compute per
    step (s), so one iteration ingests ``ingest_rate * step_time`` items. learner_devices: device ids of the
    data-parallel axis (empty: every device); device_reserve: bytes each learner device keeps free for model,
    optimizer and activations; host_reserve: bytes each node's DRAM keeps free. sampler: one of SAMPLERS; window:
    steps per delivered sequence; times_sampled: the sampler keeps a per-item delivery count (max_times_sampled).
    producer_nodes: nodes whose actors ingest (empty: the learners' nodes); prefetch: delivered batches staged on
    the learner devices. local_draws: let the planner consider shard-local draws for uniform sampling (each shard
    draws B/S of its own items: the same distribution up to one item per shard, since round-robin dealing keeps shard
    counts equal; ``replay.sample`` draws globally today, so this needs a sampler that does it).
    """

    batch_size: int = 256
    batches_per_step: int = 1
    ingest_rate: float = 0.0
    step_time: float = 0.01
    learner_devices: tuple[int, ...] = ()
    device_reserve: int = 0
    host_reserve: int = 0
    sampler: str = "uniform"
    window: int = 1
    times_sampled: bool = False
    producer_nodes: tuple[int, ...] = ()
    prefetch: int = 2
    local_draws: bool = False

    def __post_init__(self):
        problems = []
        for name, what in (("learner_devices", "device ids"), ("producer_nodes", "node ids")):
            value = getattr(self, name)
            ids = _ids(value)
            if ids is None:
                problems.append(f"{name} must be a sequence of {what} (ints >= 0), got {value!r}")
            else:
                object.__setattr__(self, name, ids)
                if name == "learner_devices" and len(set(ids)) != len(ids):
                    problems.append(f"learner_devices has duplicates: {ids}")
        for name in ("batch_size", "batches_per_step", "window"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                problems.append(f"{name} must be an int >= 1, got {value!r}")
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            problems.append(f"prefetch must be an int >= 0 (batches), got {self.prefetch!r}")
        for name in ("ingest_rate", "step_time", "device_reserve", "host_reserve"):
            value = getattr(self, name)
            # NaN fails every comparison, inf prices the ingest at inf: both are refused
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                problems.append(f"{name} must be a finite number >= 0, got {value!r}")
        if not isinstance(self.sampler, str) or self.sampler not in SAMPLERS:
            problems.append(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        for name in ("times_sampled", "local_draws"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        if problems:
            raise PlacementError("Workload: " + "; ".join(problems))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["learner_devices"] = list(self.learner_devices)
        d["producer_nodes"] = list(self.producer_nodes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Workload":
        return cls(**{**d, "learner_devices": tuple(d.get("learner_devices", ())),
                      "producer_nodes": tuple(d.get("producer_nodes", ()))})


def _ids(value) -> Optional[tuple[int, ...]]:
    """A sequence of ids (ints >= 0, NumPy ints too) as a tuple, or None when it is not one."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        return None
    out = []
    for x in value:
        if isinstance(x, bool) or not hasattr(x, "__index__") or x.__index__() < 0:
            return None
        out.append(x.__index__())
    return tuple(out)


def check_producer_nodes(topology: Topology, workload: Workload, where: str) -> None:
    """Every producer node is a node of ``topology`` (an unknown one would be priced as a remote node)."""
    nodes = set(topology.nodes)
    unknown = [n for n in workload.producer_nodes if n not in nodes]
    if unknown:
        raise PlacementError(f"{where}: Workload.producer_nodes {list(workload.producer_nodes)} names nodes "
                             f"{unknown[:8]} that topology {topology.name!r} does not have; its nodes are "
                             f"{id_ranges(topology.nodes)}")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where each part of the state lives and how batches travel: what ``estimate`` prices and a Plan records."""

    device_ids: tuple[int, ...]  # storage shards, in mesh order (row-major over mesh_shape)
    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    storage: str = "device"
    index: str = "device"
    control: str = "device"
    sample_route: str = "global"
    ingest_route: str = "replicated"

    def __post_init__(self):
        if math.prod(self.mesh_shape) != len(self.device_ids):
            raise PlacementError(f"Placement: mesh_shape {self.mesh_shape} holds {math.prod(self.mesh_shape)} devices "
                                 f"but {len(self.device_ids)} device ids were given")
        for part in PARTS:
            if getattr(self, part) not in MEMORY_KINDS:
                raise PlacementError(f"Placement: {part} memory kind must be one of {MEMORY_KINDS}, got "
                                     f"{getattr(self, part)!r}")
        if self.sample_route not in ROUTES:
            raise PlacementError(f"Placement: sample_route must be one of {ROUTES}, got {self.sample_route!r}")
        if self.ingest_route not in INGEST_ROUTES:
            raise PlacementError(f"Placement: ingest_route must be one of {INGEST_ROUTES}, got {self.ingest_route!r}")

    @property
    def num_shards(self) -> int:
        return len(self.device_ids)

    def kind(self, part: str) -> str:
        return getattr(self, part)


@dataclasses.dataclass(frozen=True)
class Costs:
    """Predicted seconds per learner iteration, by stage; ``link_bytes`` the bytes each link class carries per
    iteration (for the busiest device; elided copies count 0)."""

    ingest: float
    sample: float
    gather: float
    delivery: float
    update: float
    link_bytes: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> float:
        """The experience path's time per iteration when nothing overlaps it (the synchronous schedule): what the
        planner minimises."""
        return self.ingest + self.sample + self.gather + self.delivery + self.update

    @property
    def delivery_latency(self) -> float:
        """One batch from request to learner-ready: what ``benchmarks/bench_placement.py`` measures."""
        return self.sample + self.gather + self.delivery

    def to_dict(self) -> dict:
        return {"ingest_s": self.ingest, "sample_s": self.sample, "gather_s": self.gather,
                "delivery_s": self.delivery, "update_s": self.update, "total_s": self.total,
                "link_bytes": {k: v for k, v in self.link_bytes}}

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        return cls(d["ingest_s"], d["sample_s"], d["gather_s"], d["delivery_s"], d["update_s"],
                   tuple((str(k), float(v)) for k, v in d.get("link_bytes", {}).items()))


# ------------------------------------------------------------------------------------------------------------------
# Sizes
# ------------------------------------------------------------------------------------------------------------------
def tree_depth(num_leaves: int, arity: int = TREE_ARITY) -> int:
    """sumtree.depth without importing JAX: levels below the root for ``num_leaves`` leaves."""
    depth, span = 1, arity
    while span < num_leaves:
        span *= arity
        depth += 1
    return depth


def tree_levels(shard_capacity: int) -> tuple[int, ...]:
    """Bytes of each level of one shard's sum tree, root first (sumtree.init)."""
    return tuple(4 * TREE_ARITY ** level for level in range(tree_depth(shard_capacity) + 1))


def part_bytes(row_bytes: int, capacity: int, shards: int, workload: Workload) -> dict[str, int]:
    """Bytes each shard keeps of each part: the ring rows, the sampler's index, the small counters."""
    shard_capacity = capacity // shards
    index = 0
    if workload.sampler in PRIORITY_SAMPLERS:
        index = 4 * sum(TREE_ARITY ** level for level in range(tree_depth(shard_capacity) + 1))
    if workload.times_sampled:
        index += 4 * shard_capacity
    return {"storage": shard_capacity * row_bytes, "index": index, "control": CONTROL_BYTES}


def staging_bytes(row_bytes: int, workload: Workload, learners: int) -> int:
    """Delivered batches staged on each learner device (prefetch depth x its slice of a batch)."""
    per_learner = -(-workload.batch_size // max(1, learners))
    return int(workload.prefetch) * per_learner * row_bytes * workload.window


# ------------------------------------------------------------------------------------------------------------------
# The model
# ------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Shards:
    """What the cost terms need to know about a set of shard devices (computed once per device set)."""

    count: int
    per_node: dict  # node -> shards there
    per_process_max: int
    nodes: tuple[int, ...]
    colocated: float  # fraction of shards that are learner devices
    learners: int
    learner_nodes: tuple[int, ...]
    learner_process_max: int


def shard_stats(topology: Topology, device_ids, learners) -> _Shards:
    devices = [topology.device(i) for i in device_ids]
    learner_devices = [topology.device(i) for i in learners]
    per_node = Counter(d.node for d in devices)
    per_process = Counter(d.process for d in devices)
    learner_set = set(learners)
    return _Shards(len(devices), dict(per_node), max(per_process.values()), tuple(sorted(per_node)),
                   sum(1 for i in device_ids if i in learner_set) / len(devices), len(learner_devices),
                   tuple(sorted({d.node for d in learner_devices})),
                   max(Counter(d.process for d in learner_devices).values()))


def reshard_time(topology: Topology, nbytes: int, source_ids, target_ids) -> float:
    """Seconds to move a batch of ``nbytes`` held on the devices ``source_ids`` to the devices ``target_ids``, its rows
    split evenly over the targets (e.g. LLM-RL rollouts from the generation devices to the learner's): each target
    receives its share over the link from the source that holds it (a device of its own: nothing to move; the same
    node: ``peer``; another node: ``network``), the targets of one node at once (their shared bandwidth)."""
    sources = [topology.device(i) for i in source_ids]
    targets = [topology.device(i) for i in target_ids]
    if not sources or not targets:
        raise PlacementError(f"reshard_time(): source_ids and target_ids must name devices, got {list(source_ids)} and "
                          f"{list(target_ids)}")
    share = nbytes / len(targets)
    per_node = Counter(t.node for t in targets)
    slowest = 0.0
    for k, target in enumerate(targets):
        source = sources[k * len(sources) // len(targets)]  # the rows a target gets sit on one source, in order
        if source.id == target.id:
            continue
        link = topology.link_class("peer" if source.node == target.node else "network")
        slowest = max(slowest, link.transfer_time(share, per_node[target.node]))
    return slowest


def estimate(topology: Topology, workload: Workload, placement: Placement, row_bytes: int, capacity: int,
             shards: Optional[_Shards] = None) -> Costs:
    """Predicted ``Costs`` of one learner iteration for ``placement`` (see the module docstring for the terms)."""
    learners = workload.learner_devices or tuple(d.id for d in topology.devices)
    if shards is None:  # a direct call (the planner checks once and passes its shard stats)
        check_producer_nodes(topology, workload, "estimate()")
    st = shards or shard_stats(topology, placement.device_ids, learners)
    t = topology.timing
    s = st.count
    k = max(st.per_node.values())  # shards on the busiest node: they contend for its shared links
    nodes = len(st.nodes)
    first = placement.device_ids[0]
    dev0 = topology.device(first)
    b, rb = workload.batch_size, row_bytes * workload.window
    sizes = part_bytes(row_bytes, capacity, s, workload)
    links: Counter = Counter()  # bytes per batch on each link class (busiest device)
    once: Counter = Counter()  # bytes per iteration (ingest, priority updates)

    def call(devices_per_process: int) -> float:
        """Dispatch of one jitted call spanning that many devices of one process."""
        if devices_per_process <= 1:
            return t.launch
        return t.launch + t.mesh_sync + devices_per_process * t.mesh_launch

    rounds = 1 if t.cores <= 0 else max(1, math.ceil(st.per_process_max / t.cores))  # shards a core runs in turn

    def memory(kind: str):
        mem = topology.memory(first, kind)
        if mem is None:
            raise PlacementError(f"estimate(): topology {topology.name!r} has no {kind!r} memory for device {first}")
        return mem

    def row_cost(kind: str, nbytes: float, resident: float) -> float:
        mem = memory(kind)
        latency = mem.row_time
        if t.cache_bytes and resident <= t.cache_bytes:
            latency = min(latency, t.cache_row_time)
        return latency + nbytes / mem.bandwidth

    def to_device(kind: str):
        """The link a kernel on the shard's device reads memory of ``kind`` over."""
        return topology.link(memory(kind), dev0)

    def collective(steps: int, nbytes: float, link_name: str = "peer", concurrent: int = 1) -> float:
        """One collective: a fixed cost, a link latency per algorithm step, the bytes each device sends."""
        link = topology.link_class(link_name if nodes > 1 or link_name != "network" else "peer")
        return t.collective + steps * link.latency + (nbytes / link.effective_bandwidth(concurrent) if nbytes
                                                      else 0.0)

    def descent(count: int, level_bytes, kernels_per_level: int) -> float:
        """``count`` walks of the sum tree: per level some kernels and one random [16]-block read per walk; a level
        small enough to stay in the last-level cache (next to the ring's traffic) reads at cache latency."""
        total = 0.0
        for nbytes in level_bytes:
            total += kernels_per_level * t.kernel
            total += count * row_cost(placement.index, 4 * TREE_ARITY, nbytes * k * 2) * rounds
        return total

    # -- how many rows each shard handles per batch -------------------------------------------------------------
    route = placement.sample_route
    if route == "global":
        draws = b
    elif route == "node-local-first":
        draws = -(-b // nodes)
    else:
        draws = -(-b // s)
    resident = sizes["storage"] * k  # what the node's cache would have to hold (one cache per node on CPU)

    # -- sample: one call + index work --------------------------------------------------------------------------
    sample = call(st.per_process_max) + t.kernel
    if route != "shard-local":  # ids (and probabilities) packed beside the rows, non-owned draws masked
        sample += 2 * t.kernel
    if workload.sampler == "epochs":
        sample += t.kernel
    levels = tree_levels(capacity // s) if workload.sampler in PRIORITY_SAMPLERS else ()
    if levels:
        if s > 1:  # all-gather of the shard masses: one small collective
            sample += collective(max(1, math.ceil(math.log2(s))), 0.0)
        sample += descent(draws, levels, SAMPLE_KERNELS_PER_LEVEL)
        if placement.index != "device":  # kernels move a host array to the device inside jit: the whole index
            link = to_device(placement.index)
            sample += link.transfer_time(sizes["index"], k)
            links[link.name] += 0 if link.elided else sizes["index"]

    # -- gather: the batch's rows where the ring lives ----------------------------------------------------------
    gather = draws * row_cost(placement.storage, rb, resident) * rounds
    if placement.storage != "device":
        link = to_device(placement.storage)
        if not link.elided:  # a host-side gather, then the gathered rows cross PCIe to the device
            gather += t.kernel + link.transfer_time(draws * rb, k)
            links[link.name] += draws * rb

    # -- delivery: the exchange to the learner's layout -------------------------------------------------------
    delivery = 0.0
    packed = draws * (rb + ID_BYTES)
    if route == "global" and s > 1:
        name = "network" if nodes > 1 else "peer"
        delivery += collective(s - 1, (s - 1) / s * packed, name, k if nodes > 1 else s)
        links[name] += (s - 1) / s * packed
    elif route == "node-local-first" and s > 1:
        if k > 1:
            delivery += collective(k - 1, (k - 1) / k * packed, "peer", k)
            links["peer"] += (k - 1) / k * packed
        if nodes > 1:  # node masses all-gathered; draws that fall on another node than the learner's cross it
            imbalance = math.sqrt(draws) * (rb + ID_BYTES) / max(1, k)
            delivery += collective(max(1, math.ceil(math.log2(nodes))), imbalance, "network", k)
            links["network"] += imbalance
    if st.colocated < 1.0 or st.learners != s:
        # the batch is sharded over the storage devices; the learner wants it over its own devices
        moving = b * rb * (1.0 - st.colocated * min(1.0, s / max(1, st.learners)))
        if moving > 0:
            cross_node = any(n not in st.per_node for n in st.learner_nodes)
            link = topology.link_class("network" if cross_node else "peer")
            per_source = moving / s
            delivery += call(st.learner_process_max) + link.transfer_time(per_source, min(s, k))
            links[link.name] += per_source

    # -- priority update: ids to every shard, a block rewrite per level per id ----------------------------------
    update = 0.0
    if levels:
        m = b * workload.batches_per_step
        targets = m if route == "global" else -(-m // nodes)
        host = topology.link_class("host_pinned")
        update = call(st.per_process_max) + UPDATE_ARRAYS * t.put + host.transfer_time(targets * ID_BYTES, k)
        update += descent(targets, levels, UPDATE_KERNELS_PER_LEVEL)
        if s > 1:  # the largest priority and the ignored count are reduced over the shards
            update += collective(max(1, math.ceil(math.log2(s))), 0.0)
        if placement.index != "device":  # moved in and back out
            link = to_device(placement.index)
            update += 2 * link.transfer_time(sizes["index"], k)
            once[link.name] += 0 if link.elided else 2 * sizes["index"]

    # -- ingest: producer host -> shards ------------------------------------------------------------------------
    ingest = 0.0
    items = workload.ingest_rate * workload.step_time
    if items > 0:
        producers = workload.producer_nodes or st.learner_nodes
        local = placement.ingest_route == "producer-local" and nodes > 1
        per_node_items = items / max(1, len(producers))
        received = per_node_items if local else items  # every shard receives the batch it deals from
        ingest += t.put * st.per_process_max  # one buffer per device the batch is replicated to
        if placement.storage == "device":
            # host batches are packed into one array and staged through pinned buffers (PjRt); aliased on CPU
            link = topology.link_class("host_pinned")
            ingest += link.transfer_time(received * row_bytes, k)
            once[link.name] += 0 if link.elided else received * row_bytes
        elif not to_device(placement.storage).elided:
            # the packed block is staged to the device like any kernel argument, then moved to the host ring's
            # memory for the in-place write (storage.where_rows_live): it crosses twice
            link = to_device(placement.storage)
            ingest += 2 * link.transfer_time(received * row_bytes, k)
            once[link.name] += 2 * received * row_bytes
        if nodes > 1:
            # replicated: each node receives the other nodes' items; local: only items of producer nodes that hold
            # no shard travel
            remote = items * (1 - 1 / nodes) if not local else per_node_items * sum(
                1 for n in producers if n not in st.per_node)
            if remote > 0:
                net = topology.link_class("network")
                ingest += net.latency + remote * row_bytes / net.effective_bandwidth(k) / max(1, k)
                once["network"] += remote * row_bytes / max(1, k)
        share = received / (k if local else s)
        # rings in host memory are written by a host memcpy, unless the backend runs the device kernel on them
        # in place (XLA:CPU: the move into jit is elided, the write is the same dynamic-update-slice)
        in_place = placement.storage == "device" or to_device(placement.storage).elided
        write_bw = t.write_bandwidth if in_place else memory(placement.storage).bandwidth
        ingest += call(st.per_process_max) + (INGEST_KERNELS * t.kernel + share * (
            t.write_row + row_bytes / write_bw)) * rounds

    n = workload.batches_per_step
    return Costs(ingest=ingest, sample=n * sample, gather=n * gather, delivery=n * delivery, update=update,
                 link_bytes=tuple(sorted((name, float(n * links[name] + once[name]))
                                         for name in set(links) | set(once) if n * links[name] + once[name] > 0)))
