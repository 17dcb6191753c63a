"""The placement planner: ``plan(spec, capacity, topology, workload) -> Plan``.

Search. The decisions are few and discrete, so the planner enumerates them all and prices each with ``cost.estimate``:
  * shard devices: the learner devices themselves (co-located), or ``k`` of them per node for ``k`` = the learners per
    node, then halving down to 1 (fewer shards: fewer multi-device dispatches, more memory per shard);
  * the memory kind of the ring rows ("storage") and of the sampler's index ("index"); the small counters ("control")
    always stay in device memory;
  * the sample route (global draws, node-local first on several nodes, shard-local for queues) and the ingest route
    (replicated to every shard as ``replay.ingest`` does, or local to the producer's node).
A candidate is feasible when every memory and every physical pool holds what is put in it after the reserves (learner
devices keep ``device_reserve`` free, each node's DRAM ``host_reserve``). The plan is the feasible candidate with the
least predicted experience-path time per iteration; ties go to less device memory, then to enumeration order, so the
same inputs give the same plan. A 1,024-GPU cluster is a few hundred candidates: well under a second.

A ``Plan`` is data (JSON round trip). Applying it: ``plan.mesh()`` builds the mesh, ``plan.shardings(config)`` gives one
``NamedSharding(mesh, PartitionSpec, memory_kind)`` per state leaf (``replay.partition_specs`` decides the spec, the
plan the memory kind), and ``jax.device_put(state, plan.shardings(config))`` moves a state there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections import defaultdict
from typing import Any, Optional, Sequence

from conduit_jax.memory import format_bytes as _bytes
from conduit_jax.placement import cost
from conduit_jax.placement.cost import (
    GLOBAL_DRAW_SAMPLERS,
    PARTS,
    Costs,
    Placement,
    Workload,
    estimate,
    part_bytes,
    shard_stats,
    staging_bytes,
)
from conduit_jax.placement.topology import GB, MEMORY_KINDS, US, PlacementError, Topology, parse_json

PLAN_FORMAT = "conduit-plan/1"


# ------------------------------------------------------------------------------------------------------------------
# Plan
# ------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """Where the state lives and why: what ``plan()`` returns.

    placement: shard devices, mesh, memory kind per part, routes. costs: predicted seconds per learner iteration.
    hot_cold: items resident in device memory ("hot": the whole ring when it fits, else the staged batches) and in
    host memory ("cold"). route: how a batch travels, in words. usage: (memory, bytes used, bytes available) for the
    busiest memory of each kind and each pool kind. reasons: (decision, choice, why) rows for ``explain()``.
    """

    placement: Placement
    costs: Costs
    row_bytes: int
    capacity: int
    workload: Workload
    topology: str
    hot_cold: tuple[tuple[str, str, int], ...]  # (tier, memory kind, items)
    route: tuple[tuple[str, str], ...]  # (stage, how)
    usage: tuple[tuple[str, int, int], ...]  # (memory or pool, used, available)
    part_bytes: tuple[tuple[str, int], ...]  # (part, bytes per shard)
    reasons: tuple[tuple[str, str, str], ...]  # (decision, choice, why)
    alternatives: tuple[tuple[str, float], ...] = ()  # the next best feasible placements: (what, predicted s)
    considered: int = 0
    feasible: int = 0

    # -- views --------------------------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.placement.mesh_shape

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self.placement.axis_names

    @property
    def device_ids(self) -> tuple[int, ...]:
        return self.placement.device_ids

    @property
    def num_shards(self) -> int:
        return self.placement.num_shards

    @property
    def memory(self) -> dict[str, str]:
        """Memory kind of each state part: {'storage': ..., 'index': ..., 'control': ...}."""
        return {part: self.placement.kind(part) for part in PARTS}

    # -- applying -----------------------------------------------------------------------------------------------
    def mesh(self, devices: Optional[Sequence[Any]] = None):
        """The plan's ``jax.sharding.Mesh`` (axis type Auto) over ``devices`` (default ``jax.devices()``), picked by
        id in the plan's order."""
        import jax
        import numpy as np
        from jax.sharding import AxisType, Mesh

        if devices is None:
            pool = list(jax.devices())
        else:
            if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
                raise PlacementError(f"Plan.mesh(): devices must be a sequence of jax.Device (e.g. jax.devices()), "
                                     f"got {type(devices).__name__} {devices!r}")
            pool = list(devices)
            wrong = [d for d in pool if not isinstance(d, jax.Device)]
            if wrong:
                raise PlacementError(f"Plan.mesh(): devices must be a sequence of jax.Device (e.g. jax.devices()), "
                                     f"got {type(wrong[0]).__name__} {wrong[0]!r} among them")
        by_id = {d.id: d for d in pool}
        missing = [i for i in self.device_ids if i not in by_id]
        if missing:
            raise PlacementError(f"Plan.mesh(): the plan shards over devices {list(self.device_ids)} but "
                                 f"{missing[:8]} are not among the {len(pool)} devices here; plan for this topology "
                                 f"(placement.Topology.detect()) or pass the devices")
        grid = np.empty(len(self.device_ids), dtype=object)
        for i, device_id in enumerate(self.device_ids):
            grid[i] = by_id[device_id]
        return Mesh(grid.reshape(self.mesh_shape), self.axis_names,
                    axis_types=(AxisType.Auto,) * len(self.axis_names))

    def shardings(self, target, mesh=None):
        """One ``NamedSharding(mesh, spec, memory_kind)`` per leaf of the replay state.

        ``target`` is a ``replay.ReplayConfig`` (its mesh must be this plan's: build the plane with
        ``mesh=plan.mesh()``) or a state pytree (``ReplayState``, or any pytree: 0-d leaves replicated, others sharded
        on their first axis over the plan's axes; ``mesh`` defaults to ``plan.mesh()``). The memory kind of each leaf
        is the plan's kind for its part (``part_of``)."""
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        if _is_replay_config(target):
            import functools

            from conduit_jax import replay

            self._check_mesh(target.mesh, "shardings(config)")
            mesh = target.mesh
            abstract = jax.eval_shape(functools.partial(replay.init, target, 0))
            specs = replay.partition_specs(target)
        else:
            mesh = self.mesh() if mesh is None else mesh
            self._check_mesh(mesh, "shardings(state)")
            abstract = target
            specs = jax.tree_util.tree_map(lambda leaf: P() if _ndim(leaf) == 0 else P(self.axis_names), target)
        kinds = self.memory
        flat, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
        if len(spec_leaves) != len(flat):
            raise PlacementError("Plan.shardings(): the state and its partition specs have different structures")
        out = [NamedSharding(mesh, spec, memory_kind=kinds[part_of(path, leaf)])
               for (path, leaf), spec in zip(flat, spec_leaves)]
        return jax.tree_util.tree_unflatten(treedef, out)

    def _check_mesh(self, mesh, where: str) -> None:
        ids = tuple(int(d.id) for d in mesh.devices.flat)
        if ids != self.device_ids or tuple(mesh.devices.shape) != self.mesh_shape:
            raise PlacementError(f"Plan.{where}: the mesh has devices {list(ids)} in shape {tuple(mesh.devices.shape)}"
                                 f" but the plan has {list(self.device_ids)} in shape {self.mesh_shape}; build it "
                                 f"with plan.mesh()")

    # -- JSON -------------------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        p = self.placement
        return {
            "format": PLAN_FORMAT,
            "topology": self.topology,
            "capacity": self.capacity,
            "row_bytes": self.row_bytes,
            "workload": self.workload.to_dict(),
            "mesh": {"shape": list(p.mesh_shape), "axis_names": list(p.axis_names), "device_ids": list(p.device_ids)},
            "memory": self.memory,
            "routes": {"sample": p.sample_route, "ingest": p.ingest_route},
            "hot_cold": [list(x) for x in self.hot_cold],
            "route": [list(x) for x in self.route],
            "costs": self.costs.to_dict(),
            "usage": [list(x) for x in self.usage],
            "part_bytes": dict(self.part_bytes),
            "reasons": [list(x) for x in self.reasons],
            "alternatives": [list(x) for x in self.alternatives],
            "considered": self.considered,
            "feasible": self.feasible,
        }

    def to_json(self, indent: Optional[int] = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        if not isinstance(d, dict):
            raise PlacementError(f"Plan.from_json(): expected a JSON object with format {PLAN_FORMAT!r}, got "
                                 f"{type(d).__name__}")
        if d.get("format") != PLAN_FORMAT:
            raise PlacementError(f"Plan.from_json(): format must be {PLAN_FORMAT!r}, got {d.get('format')!r}")
        try:
            mesh = d["mesh"]
            placement = Placement(tuple(mesh["device_ids"]), tuple(mesh["shape"]), tuple(mesh["axis_names"]),
                                  storage=d["memory"]["storage"], index=d["memory"]["index"],
                                  control=d["memory"]["control"], sample_route=d["routes"]["sample"],
                                  ingest_route=d["routes"]["ingest"])
            return cls(placement=placement, costs=Costs.from_dict(d["costs"]), row_bytes=int(d["row_bytes"]),
                       capacity=int(d["capacity"]), workload=Workload.from_dict(d["workload"]),
                       topology=d["topology"], hot_cold=tuple((a, b, int(c)) for a, b, c in d["hot_cold"]),
                       route=tuple((a, b) for a, b in d["route"]),
                       usage=tuple((a, int(b), int(c)) for a, b, c in d["usage"]),
                       part_bytes=tuple((k, int(v)) for k, v in d["part_bytes"].items()),
                       reasons=tuple((a, b, c) for a, b, c in d["reasons"]),
                       alternatives=tuple((a, float(b)) for a, b in d.get("alternatives", ())),
                       considered=int(d.get("considered", 0)), feasible=int(d.get("feasible", 0)))
        except PlacementError as exc:
            raise PlacementError(f"Plan.from_json(): malformed plan: {exc}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlacementError(f"Plan.from_json(): malformed plan ({type(exc).__name__}: {exc})") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(parse_json(text, "Plan.from_json()", "plan"))

    # -- explain -------------------------------------------------------------------------------------------------
    def explain(self) -> str:
        """A readable table: where each part lives, how a batch travels, the predicted costs, and why."""
        p, w, c = self.placement, self.workload, self.costs
        sizes = dict(self.part_bytes)
        lines = [(f"Plan on {self.topology}: {self.capacity:,} items x {self.row_bytes:,} B "
                 f"({_bytes(self.capacity * self.row_bytes)}), sampler {w.sampler}, batch {w.batch_size} x "
                 f"{w.batches_per_step} per step, {len(w.learner_devices) or 'all'} learner devices"),
                 (f"  mesh {p.mesh_shape} axes {p.axis_names} over devices {_ids(p.device_ids)} "
                 f"({p.num_shards} shard{'s' if p.num_shards > 1 else ''})"),
                 "",
                 f"  {'part':<9} {'memory':<14} {'per shard':>11} {'total':>11}  why"]
        why = {r[0]: r[2] for r in self.reasons}
        for part in PARTS:
            lines.append(f"  {part:<9} {p.kind(part):<14} {_bytes(sizes[part]):>11} "
                         f"{_bytes(sizes[part] * p.num_shards):>11}  {why.get(part, '')}")
        lines += ["", "  hot/cold: " + "; ".join(f"{tier} {items:,} items in {kind}" for tier, kind, items in
                                                  self.hot_cold), "", "  route:"]
        lines += [f"    {stage:<9} {how}" for stage, how in self.route]
        lines += ["", (f"  predicted per iteration: total {_us(c.total)} (ingest {_us(c.ingest)}, sample "
                      f"{_us(c.sample)}, gather {_us(c.gather)}, delivery {_us(c.delivery)}, update {_us(c.update)})")]
        if c.link_bytes:
            lines.append("    bytes per iteration (busiest device): " +
                         ", ".join(f"{k} {_bytes(v)}" for k, v in c.link_bytes))
        lines += ["", "  memory use (busiest of each kind):"]
        lines += [f"    {name:<22} {_bytes(used):>11} of {_bytes(avail):>11} ({100 * used / max(avail, 1):5.1f}%)"
                  for name, used, avail in self.usage]
        lines += ["", f"  decisions ({self.feasible} feasible of {self.considered} candidates):"]
        lines += [f"    {decision:<9} {choice:<22} {reason}" for decision, choice, reason in self.reasons
                  if decision not in PARTS]
        if self.alternatives:
            lines += ["", "  next best:"]
            lines += [f"    {_us(total):>10}  {what}" for what, total in self.alternatives]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _is_replay_config(x) -> bool:
    return all(hasattr(x, a) for a in ("layout", "sampler", "mesh", "axes", "capacity"))


def _ndim(leaf) -> int:
    return len(getattr(leaf, "shape", ()))


def part_of(path, leaf) -> str:
    """The state part a leaf belongs to: the ring rows are "storage", the sampler's arrays "index", every other leaf
    (cursors, laps, counters, scalars) "control"."""
    import jax

    key = jax.tree_util.keystr(path) if not isinstance(path, str) else path
    if key.startswith(".storage.rows") or key.endswith("rows"):
        return "storage"
    if key.startswith(".sampler") and _ndim(leaf) >= 1:
        return "index"
    return "control"


def with_part_in(shardings, part: str, memory_kind: str):
    """``shardings`` (one ``NamedSharding`` per state leaf) with the leaves of ``part`` ("storage", "index" or
    "control", see ``part_of``) in ``memory_kind`` and the rest as they were: e.g. the ring in pinned host memory and
    the index in device memory, for ``plane.place``."""
    import jax

    if not isinstance(part, str) or part not in PARTS:
        raise PlacementError(f"with_part_in(): part must be one of {PARTS}, got {part!r}")
    if not isinstance(memory_kind, str) or memory_kind not in MEMORY_KINDS:
        raise PlacementError(f"with_part_in(): memory_kind must be one of {MEMORY_KINDS}, got {memory_kind!r}")
    leaves = jax.tree_util.tree_leaves(shardings)
    wrong = [s for s in leaves if not isinstance(s, jax.sharding.Sharding)]
    if wrong or not leaves:
        raise PlacementError(f"with_part_in(): shardings must be a pytree of jax.sharding.NamedSharding (e.g. "
                             f"plane.shardings), got {type(wrong[0]).__name__ if wrong else 'no leaves'}")

    def move(path, s):
        if part_of(path, s) != part:
            return s
        try:
            return s.with_memory_kind(memory_kind)
        except ValueError:  # a kind these devices cannot address
            kinds = sorted({m.kind for d in s.device_set for m in d.addressable_memories()})
            raise PlacementError(f"with_part_in(): memory_kind {memory_kind!r} is not addressable by the "
                                 f"shardings' devices ({jax.tree_util.keystr(path)}); they address {kinds}") from None

    return jax.tree_util.tree_map_with_path(move, shardings)


# ------------------------------------------------------------------------------------------------------------------
# plan()
# ------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Candidate:
    placement: Placement
    costs: Costs
    order: int
    label: str


_KIND_RANK = {kind: i for i, kind in enumerate(MEMORY_KINDS)}


def _rank(c: _Candidate):
    """Least predicted time (to the picosecond, so float noise cannot reorder equal costs); on a tie the faster
    tiers (XLA:CPU, where every kind is one DRAM), then enumeration order."""
    p = c.placement
    return round(c.costs.total, 12), _KIND_RANK[p.storage] + _KIND_RANK[p.index], c.order


def row_bytes_of(spec) -> int:
    """Bytes of one packed row: an ``ExperienceSpec``, a pytree of ``ShapeDtypeStruct``, or an int (item bytes)."""
    if isinstance(spec, bool):
        raise PlacementError(f"plan(): spec must be an ExperienceSpec, a pytree of ShapeDtypeStruct or item bytes, "
                             f"got {spec!r}")
    if isinstance(spec, int):
        if spec < 1:
            raise PlacementError(f"plan(): item bytes must be >= 1, got {spec}")
        return 4 * -(-spec // 4)  # rows are uint32 words
    from conduit_jax.spec import ExperienceSpec
    from conduit_jax.storage import RowLayout

    spec = spec if isinstance(spec, ExperienceSpec) else ExperienceSpec.from_structs(spec)
    return RowLayout.of(spec).row_bytes


def plan(spec, capacity: int, topology: Topology, workload: Optional[Workload] = None) -> Plan:
    """The placement with the least predicted experience-path time per iteration that fits (see the module doc).

    Raises ``PlacementError`` naming the failing constraint, the shortfall, and what would fit."""
    workload = Workload() if workload is None else workload
    if not isinstance(topology, Topology):
        raise PlacementError(f"plan(): topology must be a placement.Topology (a preset, Topology.detect() or "
                             f"Topology.load(...)), got {type(topology).__name__}")
    if not isinstance(workload, Workload):
        raise PlacementError(f"plan(): workload must be a placement.Workload, got {type(workload).__name__}")
    from conduit_jax.replay import MAX_CAPACITY

    if not isinstance(capacity, int) or isinstance(capacity, bool) or not 1 <= capacity <= MAX_CAPACITY:
        raise PlacementError(f"plan(): capacity must be an int in [1, {MAX_CAPACITY:,}] (a plane's row ids are "
                             f"int32), got {capacity!r}")
    row_bytes = row_bytes_of(spec)
    search = _Search(topology, workload, row_bytes, capacity)
    return search.run()


class _Search:
    def __init__(self, topology: Topology, workload: Workload, row_bytes: int, capacity: int):
        self.topo, self.work, self.row_bytes, self.capacity = topology, workload, row_bytes, capacity
        self.learners = workload.learner_devices or tuple(d.id for d in topology.devices)
        for i in self.learners:
            topology.device(i)  # raises with the list of devices
        cost.check_producer_nodes(topology, workload, "plan()")
        self.learner_set = set(self.learners)
        self.kinds = topology.kinds
        # rings outside device memory are read in place by a host computation, which XLA runs over pinned host
        # memory (storage.where_rows_live); JAX 0.10 computes on an unpinned_host array as on device memory, so off
        # XLA:CPU (where every kind is one DRAM) the ring is kept in device or pinned_host memory
        on_cpu = all(d.platform == "cpu" for d in topology.devices)
        self.storage_kinds = tuple(k for k in self.kinds if on_cpu or k != "unpinned_host")
        self.staging = staging_bytes(row_bytes, workload, len(self.learners))
        # pools that hold host memory keep host_reserve free
        self.host_pools = {m.pool for m in topology.memories if m.kind != "device"}

    # -- candidate device sets ----------------------------------------------------------------------------------
    def device_sets(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[str, ...]]]:
        by_node: dict[int, list[int]] = defaultdict(list)
        for i in self.learners:
            by_node[self.topo.device(i).node].append(i)
        nodes = sorted(by_node)
        per_node = min(len(v) for v in by_node.values())
        ks = [per_node] + [2 ** e for e in range(int(math.log2(per_node)), -1, -1) if 2 ** e < per_node]
        sets = []
        for k in ks:
            ids = tuple(i for n in nodes for i in by_node[n][:k])
            if len(nodes) > 1:
                sets.append((f"{k} per node x {len(nodes)} nodes", ids, (len(nodes), k), ("node", "local")))
            else:
                sets.append((f"{k} shard{'s' if k > 1 else ''}", ids, (k,), ("shard",)))
        return sets

    # -- capacity -------------------------------------------------------------------------------------------------
    def usage(self, ids, storage: str, index: str, capacity: Optional[int] = None):
        """Bytes per memory and per pool, and the violations [(what, name, need, have)]."""
        capacity = self.capacity if capacity is None else capacity
        sizes = part_bytes(self.row_bytes, capacity, len(ids), self.work)
        topo = self.topo
        used: dict[str, int] = defaultdict(int)
        mems = {}
        for part, kind in (("storage", storage), ("index", index), ("control", "device")):
            if not sizes[part]:
                continue
            for i in ids:
                mem = topo.memory(i, kind)
                if mem is None:
                    return None, [(part, f"{kind} memory of device {i}", sizes[part], 0)]
                used[mem.name] += sizes[part]
                mems[mem.name] = mem
        for i in self.learners:
            mem = topo.memory(i, "device")
            used[mem.name] += self.staging
            mems[mem.name] = mem
        violations = []
        pool_used: dict[str, int] = defaultdict(int)
        reserve = self.work.device_reserve
        for name, mem in mems.items():
            held = reserve if mem.kind == "device" and mem.device in self.learner_set else 0
            if used[name] + held > mem.capacity:
                violations.append((mem.kind, name, used[name] + held, mem.capacity))
            pool_used[mem.pool] += used[name] + held
        for pool, bytes_used in pool_used.items():
            have = topo.pool_capacity(pool) - (self.work.host_reserve if pool in self.host_pools else 0)
            if bytes_used > have:
                violations.append(("pool", pool, bytes_used, max(have, 0)))
        return (used, mems, pool_used), violations

    # -- search -------------------------------------------------------------------------------------------------
    def run(self) -> Plan:
        topo, work = self.topo, self.work
        sets = self.device_sets()
        multi_node = len({topo.device(i).node for i in self.learners}) > 1
        if work.sampler == "fifo":
            routes = ["shard-local"]
        else:
            routes = ["global", "node-local-first"] if multi_node else ["global"]
            if work.local_draws and work.sampler == "uniform":
                routes.append("shard-local")
        ingest_routes = ["replicated", "producer-local"] if multi_node else ["replicated"]
        needs_index = part_bytes(self.row_bytes, self.capacity, 1, work)["index"] > 0
        index_kinds = self.kinds if needs_index else ("device",)

        candidates: list[_Candidate] = []
        rejected: list[tuple[str, Placement, list]] = []
        considered = 0
        order = 0
        for label, ids, shape, axes in sets:
            if self.capacity % len(ids) or work.batch_size % len(ids):  # the plane shards both evenly
                considered += 1
                rejected.append((label, Placement(ids, shape, axes),
                                 [("divisible", label, (self.capacity, work.batch_size), len(ids))]))
                continue
            stats = shard_stats(topo, ids, self.learners)
            for storage in self.storage_kinds:
                for index in index_kinds:
                    _, violations = self.usage(ids, storage, index)
                    base = Placement(ids, shape, axes, storage=storage, index=index)
                    if violations:
                        considered += len(routes) * len(ingest_routes)
                        rejected.append((label, base, violations))
                        continue
                    for route in routes:
                        for ingest in ingest_routes:
                            considered += 1
                            placement = dataclasses.replace(base, sample_route=route, ingest_route=ingest)
                            costs = estimate(topo, work, placement, self.row_bytes, self.capacity, stats)
                            candidates.append(_Candidate(placement, costs, order, label))
                            order += 1
        if not candidates:
            raise PlacementError(self.infeasible_message(sets, rejected))
        best = min(candidates, key=_rank)
        return self.build(best, candidates, rejected, considered)

    # -- the plan ---------------------------------------------------------------------------------------------------
    def build(self, best: _Candidate, candidates, rejected, considered) -> Plan:
        p, topo, work = best.placement, self.topo, self.work
        sizes = part_bytes(self.row_bytes, self.capacity, p.num_shards, work)
        (used, mems, pool_used), _ = self.usage(p.device_ids, p.storage, p.index)
        usage = []
        for kind in MEMORY_KINDS:
            named = [(n, b) for n, b in used.items() if mems[n].kind == kind]
            if named:
                name, b = max(named, key=lambda x: (x[1], x[0]))
                held = work.device_reserve if kind == "device" and mems[name].device in self.learner_set else 0
                usage.append((name + (" (+reserve)" if held else ""), b + held, mems[name].capacity))
        members = defaultdict(int)
        for mem in topo.memories:
            members[mem.pool] += 1
        shared = {k: v for k, v in pool_used.items() if members[k] > 1}  # a pool of one memory repeats its row
        if shared:
            pool, b = max(shared.items(), key=lambda x: (x[1] / max(1, topo.pool_capacity(x[0])), x[0]))
            have = topo.pool_capacity(pool) - (work.host_reserve if pool in self.host_pools else 0)
            usage.append((f"pool {pool}", b, have))
        staged_items = int(work.prefetch) * work.batch_size * work.window
        if p.storage == "device":
            hot_cold = (("hot", "device", self.capacity), ("cold", "none", 0))
        else:
            hot_cold = (("hot", "device", min(staged_items, self.capacity)), ("cold", p.storage, self.capacity))
        return Plan(placement=p, costs=best.costs, row_bytes=self.row_bytes, capacity=self.capacity, workload=work,
                    topology=topo.name, hot_cold=hot_cold, route=self.describe_route(p),
                    usage=tuple(usage), part_bytes=tuple((k, int(v)) for k, v in sizes.items()),
                    reasons=self.reasons(best, candidates, rejected, sizes),
                    alternatives=tuple((_describe(c.placement), c.costs.total)
                                       for c in sorted(candidates, key=_rank) if c is not best)[:5],
                    considered=considered, feasible=len(candidates))

    def describe_route(self, p: Placement) -> tuple[tuple[str, str], ...]:
        topo = self.topo
        dev = topo.device(p.device_ids[0])
        out = []
        if p.sample_route == "global":
            how = ("global draws over the whole buffer; every shard gathers the batch's rows it owns"
                   + (", one reduce-scatter deals the blocks" if p.num_shards > 1 else ""))
        elif p.sample_route == "node-local-first":
            how = ("node-local first: node masses all-gathered once, each node draws its share from its own shards "
                   "(reduce-scatter inside the node), only the imbalance crosses the network; needs the hierarchical "
                   "sampler of distributed/ (replay.sample draws globally)")
        elif self.work.sampler == "fifo":
            how = "shard-local: each shard reads its own next rows; no exchange"
        else:
            how = ("shard-local draws: each shard draws B/S of its own items and keeps them (uniform up to one item "
                   "per shard under round-robin dealing); needs a shard-local uniform sampler (replay.sample draws "
                   "globally)")
        out.append(("sample", how))
        if p.storage == "device":
            out.append(("gather", "random rows from the shard's own device memory"))
        else:
            link = topo.link(topo.memory(dev.id, p.storage), dev)
            if link.elided:
                out.append(("gather", (f"rows gathered in place in {p.storage} (a host computation); on XLA:CPU host "
                                      f"and device memory are one DRAM, so nothing crosses")))
            else:
                out.append(("gather", (f"rows gathered in place in {p.storage} (a host computation, compute_on "
                                      f"device_host); only the batch's rows cross {link.name} "
                                      f"({_bw(link.bandwidth)}) to the device, never the ring")))
        learners = set(self.learners)
        if set(p.device_ids) == learners:
            out.append(("delivery", ("co-located: the batch lands sharded over the learner's data-parallel devices, "
                                    "no copy")))
        else:
            out.append(("delivery", (f"batch copied from {p.num_shards} storage device(s) to {len(learners)} learner "
                                    f"devices")))
        if p.ingest_route == "producer-local":
            out.append(("ingest", "producer-local: each node's actors write to that node's shards only"))
        else:
            out.append(("ingest", ("each shard receives the ingested batch and writes its round-robin share at its "
                                  "own cursor")))
        return tuple(out)

    def reasons(self, best: _Candidate, candidates, rejected, sizes) -> tuple[tuple[str, str, str], ...]:
        p, topo, work = best.placement, self.topo, self.work
        total = best.costs.total
        out = []

        fields = ("storage", "index", "sample_route", "ingest_route")

        def rival(differs) -> str:
            """The best feasible candidate that differs from the plan in this decision only (else in this decision at
            least), as a cost comparison, or the constraint that kept such candidates out."""
            alts = [c for c in candidates if differs(c.placement)]
            only = [c for c in alts if sum(getattr(c.placement, f) != getattr(p, f) for f in fields) +
                    (c.placement.device_ids != p.device_ids) == 1]
            alts = only or alts
            if alts:
                alt = min(alts, key=_rank)
                delta = alt.costs.total - total
                pct = 100 * delta / total if total > 0 else 0.0
                return f"{_describe(alt.placement)} would cost {_us(alt.costs.total)} ({'+' if delta >= 0 else ''}" \
                       f"{pct:.0f}%)"
            bad = [(pl, v) for _, pl, v in rejected if differs(pl)]
            if bad:
                pl, v = bad[0]
                return f"{_describe(pl)} does not fit: {_violation(v[0])}"
            return "no alternative on this topology"

        dev_mem = topo.memory(p.device_ids[0], "device")
        free = dev_mem.capacity - (work.device_reserve if dev_mem.device in self.learner_set else 0)
        # storage
        if p.storage == "device":
            why = (f"fits: {_bytes(sizes['storage'])} per shard in {_bytes(free)} free device memory"
                   f"{' after the reserve' if work.device_reserve else ''}; gathers read local memory")
        else:
            link = topo.link(topo.memory(p.device_ids[0], p.storage), topo.device(p.device_ids[0]))
            why = (f"spilled: {_bytes(sizes['storage'])} per shard vs {_bytes(free)} free device memory; "
                   f"{p.storage} over {link.name}" + (" (copy elided on XLA:CPU)" if link.elided else
                                                      f" at {_bw(link.bandwidth)}"))
        out.append(("storage", p.storage, why + "; " + rival(lambda q: q.storage != p.storage)))
        # index
        if sizes["index"]:
            why = (f"priority index ({_bytes(sizes['index'])} per shard, "
                   f"{cost.tree_depth(self.capacity // p.num_shards)} levels read per draw) in the fastest tier that "
                   f"fits")
            out.append(("index", p.index, why + "; " + rival(lambda q: q.index != p.index)))
        else:
            out.append(("index", p.index, f"the {work.sampler} sampler keeps no per-item index (counters only)"))
        out.append(("control", p.control, "cursors, laps and counters: a few bytes read by every call"))
        # shards
        learners = len(self.learners)
        if set(p.device_ids) == set(self.learners):
            why = f"co-located with the {learners} learner devices"
        else:
            t = topo.timing
            why = (f"{p.num_shards} of the {learners} learner devices" +
                   (f": a multi-device call costs {_us(t.mesh_sync)} + {_us(t.mesh_launch)} per device here, more "
                    f"than parallel gathers save" if t.mesh_launch > 20 * US else ""))
        out.append(("shards", f"{p.num_shards} (mesh {'x'.join(map(str, p.mesh_shape))})",
                    why + "; " + rival(lambda q: q.num_shards != p.num_shards)))
        if work.sampler in GLOBAL_DRAW_SAMPLERS or p.sample_route != "shard-local":
            out.append(("sample", p.sample_route, rival(lambda q: q.sample_route != p.sample_route)))
        out.append(("ingest", p.ingest_route, rival(lambda q: q.ingest_route != p.ingest_route)))
        return tuple(out)

    # -- infeasible ---------------------------------------------------------------------------------------------
    def infeasible_message(self, sets, rejected) -> str:
        topo, work = self.topo, self.work
        head = (f"plan(): no placement of {self.capacity:,} items x {self.row_bytes:,} B "
                f"({_bytes(self.capacity * self.row_bytes)} of rows) fits on {topo.name!r}")
        if work.device_reserve:
            head += f" with {_bytes(work.device_reserve)} reserved on each learner device"
        misses = [r for r in rejected if r[2][0][0] != "divisible"]
        if not misses:
            counts = sorted({len(ids) for _, ids, _, _ in sets})
            s = counts[0]
            return (head + f": capacity ({self.capacity:,}) and batch size ({work.batch_size:,}) must each be a "
                    f"multiple of the shard count, one of {counts} here; e.g. capacity="
                    f"{max(s, self.capacity - self.capacity % s):,} and batch size "
                    f"{max(s, work.batch_size - work.batch_size % s):,}")
        # the closest miss: least relative shortfall of its worst constraint
        def shortfall(v):
            _, _, need, have = v
            return (need - have) / max(need, 1)

        _, pl, violations = min(misses, key=lambda r: (max(shortfall(v) for v in r[2]), r[1].num_shards))
        worst = max(violations, key=shortfall)
        parts = [head + ".",
                 f"Closest: {_describe(pl)}: {_violation(worst)}."]
        # what would fit: the largest capacity any candidate holds
        best_fit, best_desc = 0, ""
        for _, ids, shape, axes in sets:
            if work.batch_size % len(ids):
                continue
            for storage in self.storage_kinds:
                for index in self.kinds:
                    fit = self.max_capacity(ids, storage, index)
                    if fit > best_fit:
                        best_fit, best_desc = fit, _describe(Placement(ids, shape, axes, storage=storage,
                                                                       index=index))
        if best_fit:
            parts.append(f"What would fit: capacity <= {best_fit:,} items ({best_desc})"
                         + (", or a smaller device_reserve" if work.device_reserve else "")
                         + ", or a topology with more memory.")
        else:
            learners = len(self.learners)
            parts.append(f"Nothing fits at any capacity: each learner device must hold its reserve "
                         f"({_bytes(work.device_reserve)}) plus the staged batches ({_bytes(self.staging)}: prefetch "
                         f"{work.prefetch:g} x {-(-work.batch_size // learners):,} rows x "
                         f"{self.row_bytes * work.window:,} B), and each node's DRAM its host_reserve "
                         f"({_bytes(work.host_reserve)}); lower them or use a topology with more memory.")
        return " ".join(parts)

    def max_capacity(self, ids, storage: str, index: str) -> int:
        s = len(ids)
        if self.usage(ids, storage, index, s)[1]:
            return 0
        lo, hi = 1, max(2, self.capacity // s)  # in shard-capacity units; capacity itself does not fit
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            if self.usage(ids, storage, index, mid * s)[1]:
                hi = mid
            else:
                lo = mid
        return lo * s


def _violation(v) -> str:
    what, name, need, have = v
    if what == "divisible":
        return f"capacity {need[0]:,} or batch size {need[1]:,} is not a multiple of {have} shards"
    return f"{name} needs {_bytes(need)} but holds {_bytes(have)} (short by {_bytes(need - have)})"


def _describe(p: Placement) -> str:
    return (f"{p.num_shards} shard{'s' if p.num_shards > 1 else ''}, storage in {p.storage}, index in {p.index}"
            + ("" if p.sample_route == "global" else f", {p.sample_route} sampling")
            + ("" if p.ingest_route == "replicated" else f", {p.ingest_route} ingest"))


def _bw(bps: float) -> str:
    return f"{bps / GB:.0f} GB/s" if bps >= 10 * GB else f"{bps / GB:.1f} GB/s"


def _us(s: float) -> str:
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _ids(ids) -> str:
    ids = list(ids)
    if len(ids) > 4 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}..{ids[-1]}"
    return str(ids) if len(ids) <= 16 else f"{ids[:8]}... ({len(ids)})"


# ------------------------------------------------------------------------------------------------------------------
# conduit plan
# ------------------------------------------------------------------------------------------------------------------
_DTYPES = ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "float16", "bfloat16", "float32")


def parse_spec(text: str):
    """A spec from the command line: item bytes (``400``), compact leaves (``obs:uint8:84x84x4,act:int32,rew:float32``
    — name:dtype[:shape]), a JSON object ``{"obs": [[84, 84, 4], "uint8"], ...}``, or ``@file.json``. Returns the
    bytes (an int) or ``{name: jax.ShapeDtypeStruct}``; a malformed spec raises ``PlacementError`` naming ``--spec``."""
    leaves = spec_fields(text)
    if isinstance(leaves, int):
        return leaves
    import jax
    import jax.numpy as jnp
    import numpy as np

    return {name: jax.ShapeDtypeStruct(shape, jnp.bfloat16 if dtype == "bfloat16" else np.dtype(dtype))
            for name, (shape, dtype) in leaves.items()}


def spec_fields(text: str):
    """``parse_spec`` without JAX: the bytes (an int) or ``{name: (shape, dtype name)}``, every field checked (so a
    command line is refused before anything heavy is imported)."""
    if not isinstance(text, str):
        raise PlacementError(f"--spec: expected a string (item bytes, name:dtype[:shape],..., a JSON object or "
                             f"@file.json), got {type(text).__name__} {text!r}")
    text = text.strip()
    if text.startswith("@"):
        try:
            with open(text[1:]) as f:
                text = f.read().strip()
        except OSError as exc:
            raise PlacementError(f"--spec: cannot read {text[1:]!r}: {exc.strerror}") from None
    if _decimal(text):
        return int(text)

    def leaf(name, shape, dtype, what):
        if not isinstance(name, str) or not name:
            raise PlacementError(f"--spec: {what}: expected a leaf name, got {name!r}")
        if dtype not in _DTYPES:
            raise PlacementError(f"--spec: {what}: dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in shape):
            raise PlacementError(f"--spec: {what}: the shape must be positive ints, got {list(shape)!r}")
        return name, (tuple(shape), dtype)

    def unique(pairs):
        names = [name for name, _ in pairs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise PlacementError(f"--spec: leaf names must be unique, got {', '.join(map(repr, twice))} more than "
                                 f"once")
        return dict(pairs)

    if text.startswith("{"):
        try:
            data = json.loads(text, object_pairs_hook=lambda pairs: pairs)  # pairs: a repeated name is refused
            if not isinstance(data, list):
                raise TypeError(f"got {type(data).__name__}")
            return unique([leaf(name, list(shape), dtype, f"leaf {name!r}") for name, (shape, dtype) in data])
        except PlacementError:
            raise
        except (ValueError, TypeError, AttributeError) as exc:
            raise PlacementError(f'--spec: expected a JSON object {{"name": [[shape...], "dtype"], ...}}: '
                                 f"{exc}") from None
    leaves = []
    for item in text.split(","):
        fields = item.strip().split(":")
        if len(fields) not in (2, 3) or not fields[0]:
            raise PlacementError(f"--spec: expected name:dtype[:shape] (e.g. obs:uint8:84x84x4), a byte count or a "
                                 f"JSON object, got {item.strip()!r}")
        dims = fields[2].split("x") if len(fields) == 3 and fields[2] else []
        if not all(_decimal(d) for d in dims):
            raise PlacementError(f"--spec: leaf {fields[0]!r}: expected a shape like 84x84x4 (positive ints joined "
                                 f"by x), got {fields[2]!r}")
        leaves.append(leaf(fields[0], [int(d) for d in dims], fields[1], f"leaf {fields[0]!r}"))
    return unique(leaves)


def _decimal(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also accepts '²' and other digits ``int`` refuses."""
    return text.isascii() and text.isdigit()


def _spec_argument(text: str) -> str:
    """argparse ``type`` of ``--spec``: checked at parse time (one line naming the flag), kept as text."""
    try:
        spec_fields(text)
    except PlacementError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--spec: ")) from None
    return text


def _size(text: str) -> int:
    """argparse ``type`` of a memory size (``--reserve``, ``--host-reserve``): bytes >= 0, with a unit or not."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
             "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    unit = t[len(num):]
    try:
        value = float(num) * units[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a size like 10GB or 512MiB, got {text!r}") from None
    if not 0 <= value < math.inf:  # NaN fails it too
        raise argparse.ArgumentTypeError(f"expected a finite size >= 0 like 10GB or 512MiB, got {text!r}")
    return int(value)


def positive_int(text: str) -> int:
    """argparse ``type`` of a count (``--capacity``, ``--batch-size``, ...): an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _non_negative(text: str) -> float:
    """argparse ``type`` of a rate or a time (``--ingest-rate``, ``--step-time``): a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _topology_argument(text: str):
    """argparse ``type`` of ``--topology``: a preset or a JSON file is loaded while parsing (cheap, and a bad one is
    one line naming the flag); ``detect`` is kept as text and probed when the command runs."""
    if text.strip() == "detect":
        return text
    try:
        return Topology.load(text)
    except PlacementError as exc:
        prefix = f"Topology.load({text.strip()!r}): "
        message = str(exc)
        raise argparse.ArgumentTypeError(f"{text.strip()!r}: {message.removeprefix(prefix)}"
                                         if message.startswith(prefix) else message) from None


def build_parser(parser: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="conduit plan",
                                               description="plan where the experience plane's state lives")
    parser.add_argument("--topology", default="detect", type=_topology_argument,
                        help="a preset (emulated_cpu[:DEVICES], h200, dgx_h100, pcie_8gpu, "
                             "cluster[:NODES[:NODE_PRESET[:GBPS]]]), 'detect' (default: this machine), or a "
                             "topology JSON file")
    parser.add_argument("--spec", required=True, type=_spec_argument,
                        help="item bytes (400), name:dtype[:shape],... (obs:uint8:84x84x4,act:int32), a JSON object "
                             "or @file.json")
    parser.add_argument("--capacity", type=positive_int, required=True, help="items the plane holds")
    parser.add_argument("--batch-size", type=positive_int, default=256, help="items per delivered batch (default 256)")
    parser.add_argument("--batches-per-step", type=positive_int, default=1)
    parser.add_argument("--sampler", default="uniform", choices=cost.SAMPLERS)
    parser.add_argument("--window", type=positive_int, default=1, help="steps per sequence (sequences sampler)")
    parser.add_argument("--ingest-rate", type=_non_negative, default=0.0, help="items/s from all producers")
    parser.add_argument("--step-time", type=_non_negative, default=0.01,
                        help="learner compute per step in s (default 0.01)")
    parser.add_argument("--learners", type=positive_int, default=None, help="learner devices: the first N (default: all)")
    parser.add_argument("--reserve", type=_size, default=0, help="memory each learner device keeps free (e.g. 40GB)")
    parser.add_argument("--host-reserve", type=_size, default=0, help="memory each node's DRAM keeps free")
    parser.add_argument("--local-draws", action="store_true",
                        help="consider shard-local uniform draws (needs a sampler that does them)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def run_cli(args: argparse.Namespace) -> int:
    try:
        from conduit_jax.replay import MAX_CAPACITY

        if args.capacity > MAX_CAPACITY:
            raise PlacementError(f"--capacity must be at most {MAX_CAPACITY:,} (a plane's row ids are int32), got "
                                 f"{args.capacity:,}")
        topology = args.topology if isinstance(args.topology, Topology) else Topology.load(args.topology)
        spec = parse_spec(args.spec)
        learners = ()
        if args.learners is not None:
            ids = [d.id for d in topology.devices]
            if not 1 <= args.learners <= len(ids):
                raise PlacementError(f"--learners must be in [1, {len(ids)}] on {topology.name}, got {args.learners}")
            learners = tuple(ids[:args.learners])
        workload = Workload(batch_size=args.batch_size, batches_per_step=args.batches_per_step, sampler=args.sampler,
                            window=args.window, ingest_rate=args.ingest_rate, step_time=args.step_time,
                            learner_devices=learners, device_reserve=args.reserve, host_reserve=args.host_reserve,
                            local_draws=args.local_draws)
        result = plan(spec, args.capacity, topology, workload)
    except (PlacementError, ValueError, OSError) as exc:
        print(f"conduit plan: error: {exc}", file=sys.stderr)
        return 2
    print(result.to_json(indent=1) if args.json else result.explain())
    return 0


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """``conduit plan --topology PRESET|FILE --spec ... --capacity N [--batch-size B ...]``: print the plan."""
    return run_cli(build_parser().parse_args(argv))
