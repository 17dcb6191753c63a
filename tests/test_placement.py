"""Placement: topology presets and detection, the cost model, the capacity-constrained planner, applying a plan."""

import collections
import dataclasses
import json
import math
import re
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conduit_jax import ExperienceDataPlane, samplers
from conduit_jax.errors import ConduitError, ConfigError
from conduit_jax.placement import (MEMORY_KINDS, Link, Placement, PlacementError, Plan, Topology, Workload,
                                   cli_main, cluster, dgx_h100, emulated_cpu, estimate, h200, part_bytes, part_of,
                                   parse_spec, pcie_8gpu, plan, with_part_in)
from conduit_jax.placement.cost import staging_bytes
from conduit_jax.placement.topology import CPU_TIMING, GB, GPU_TIMING, MB, US

SPEC = {"obs": jax.ShapeDtypeStruct((5,), jnp.float32), "act": jax.ShapeDtypeStruct((), jnp.int32),
        "done": jax.ShapeDtypeStruct((), jnp.bool_)}  # 5 + 1 + 1 words = 28 B rows


# ------------------------------------------------------------------------------------------------------------------
# topology
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [emulated_cpu, h200, dgx_h100, pcie_8gpu, lambda: cluster(2, "dgx_h100", 800)])
def test_presets_have_every_kind_and_a_link_between_every_memory_and_device(make):
    topo = make()
    assert topo.kinds == MEMORY_KINDS
    pairs = list(topo.links_between())
    assert len(pairs) == len(topo.memories) * len(topo.devices)
    for memory, device, link in pairs:
        assert link.bandwidth > 0 and link.latency >= 0
        if memory.node != device.node:
            assert link.name == "network"
        elif memory.kind == "device":
            assert link.name == ("local" if memory.device == device.id else "peer")
        else:
            assert link.name == ("host_pinned" if memory.kind == "pinned_host" else "host_pageable")
    assert topo.source


def test_preset_figures():
    assert h200().memory(0, "device").capacity == 141 * 10**9
    assert h200().memory(0, "device").bandwidth == pytest.approx(4.8e12)
    dgx = dgx_h100()
    assert len(dgx.devices) == 8 and dgx.link_class("peer").bandwidth == pytest.approx(450e9)
    assert dgx.link_class("host_pinned").aggregate > dgx.link_class("host_pinned").bandwidth  # contended per node
    assert pcie_8gpu().link_class("peer").bandwidth < dgx.link_class("peer").bandwidth  # no NVLink
    big = cluster()
    assert len(big.devices) == 1024 and len(big.nodes) == 128
    assert big.link_class("network").aggregate == pytest.approx(3200 / 8 * GB)
    assert Topology.load("cluster:4:pcie_8gpu:400").name == "cluster:4:pcie_8gpu:400"
    with pytest.raises(PlacementError, match="node_preset"):
        cluster(2, "nope")


def test_link_contention():
    link = Link("x", 10.0, 0.0, aggregate=20.0)
    assert link.effective_bandwidth(1) == 10.0 and link.effective_bandwidth(4) == 5.0
    assert Link("y", 10.0, 1.0, elided=True).transfer_time(1e9) == 0.0


@pytest.mark.parametrize("make", [emulated_cpu, dgx_h100, lambda: cluster(3, "h200", 100)])
def test_topology_json_round_trip(make, tmp_path):
    topo = make()
    again = Topology.from_json(topo.to_json())
    assert again == topo and again.to_json() == topo.to_json()
    path = tmp_path / "topo.json"
    topo.save(str(path))
    assert Topology.load(str(path)) == topo
    with pytest.raises(PlacementError, match="format"):
        Topology.from_json(json.dumps({"format": "other"}))


def test_detect_on_this_machine():
    topo = Topology.detect()
    assert topo.kinds == ("device", "pinned_host", "unpinned_host")
    assert len(topo.devices) == jax.device_count() == 8
    assert all(m.capacity > 0 for m in topo.memories)
    probe = dict(topo.probe)
    assert "launch_s" in probe and probe["probe_s"] < 2.0  # bounded (~0.3 s budget; generous for a shared host)
    assert Topology.from_json(topo.to_json()) == topo
    result = plan(SPEC, 1024, topo, Workload(batch_size=32, learner_devices=(0,)))
    assert result.num_shards == 1 and result.memory == {"storage": "device", "index": "device", "control": "device"}


# ------------------------------------------------------------------------------------------------------------------
# cost model
# ------------------------------------------------------------------------------------------------------------------
def test_cost_model_directions():
    work = Workload(batch_size=4096, sampler="uniform", learner_devices=(0,))
    on_h200 = h200()
    one = Placement((0,), (1,), ("shard",))
    device = estimate(on_h200, work, one, 4096, 1_000_000)
    pinned = estimate(on_h200, work, dataclasses.replace(one, storage="pinned_host"), 4096, 1_000_000)
    pageable = estimate(on_h200, work, dataclasses.replace(one, storage="unpinned_host"), 4096, 1_000_000)
    assert device.gather < pinned.gather < pageable.gather  # HBM, then pinned DMA, then a pageable copy
    # on the emulated CPU mesh every extra device costs more than it saves
    cpu = emulated_cpu(8)
    costs = [estimate(cpu, Workload(batch_size=256, learner_devices=tuple(range(s))),
                      Placement(tuple(range(s)), (s,), ("shard",)), 96, 1 << 20).delivery_latency for s in (1, 2, 4, 8)]
    assert costs == sorted(costs)
    assert costs[0] == pytest.approx(32e-6, rel=0.3)  # measured 27-37 us (benchmarks/bench_placement.py)
    # a shared link slows down when every device of the node uses it at once
    dgx = dgx_h100()
    link = dgx.link_class("host_pinned")
    assert link.transfer_time(1e8, 8) > link.transfer_time(1e8, 1)


def test_part_bytes_match_the_real_state():
    plane = ExperienceDataPlane(SPEC, 4096, samplers.prioritized(16), mesh=jax.make_mesh(
        (2,), ("shard",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2]))
    import functools

    from conduit_jax import replay

    abstract = jax.eval_shape(functools.partial(replay.init, plane.config, 0))
    index = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(abstract.sampler)
                if leaf.ndim)
    sizes = part_bytes(28, 4096, 2, Workload(sampler="prioritized"))
    assert sizes["index"] * 2 == index
    assert sizes["storage"] * 2 == abstract.storage.rows.size * 4


# ------------------------------------------------------------------------------------------------------------------
# planner
# ------------------------------------------------------------------------------------------------------------------
def test_plan_is_deterministic_and_round_trips():
    work = Workload(batch_size=256, sampler="prioritized", ingest_rate=1e5, device_reserve=20 * 10**9)
    a = plan(SPEC, 1_000_000, dgx_h100(), work)
    b = plan(SPEC, 1_000_000, dgx_h100(), work)
    assert a == b and a.to_json() == b.to_json()
    again = Plan.from_json(a.to_json())
    assert again == a and again.to_json() == a.to_json()
    text = a.explain()
    for word in ("storage", "index", "control", "hot/cold", "route", "predicted", "decisions"):
        assert word in text
    with pytest.raises(PlacementError, match="format"):
        Plan.from_json(json.dumps({"format": "x"}))


def test_plan_on_this_host_picks_one_shard_in_device_memory():
    """ARCHITECTURE.md: on the 2-core host the emulated mesh is slower than one device; one shard unless capacity
    demands more."""
    result = plan(SPEC, 100_000, emulated_cpu(8), Workload(batch_size=256, learner_devices=(0,)))
    assert result.num_shards == 1 and result.device_ids == (0,)
    assert result.memory == {"storage": "device", "index": "device", "control": "device"}
    assert ("hot", "device", 100_000) in result.hot_cold


def test_spill_to_pinned_host_when_the_learner_needs_the_device():
    work = Workload(batch_size=256, sampler="prioritized", learner_devices=(0,), device_reserve=130 * 10**9)
    result = plan(84 * 84 * 4, 1_000_000, h200(), work)  # 28 GB of frames, 11 GB free after the reserve
    assert result.memory["storage"] == "pinned_host" and result.memory["index"] == "device"
    assert ("cold", "pinned_host", 1_000_000) in result.hot_cold
    assert "spilled" in result.explain()


def test_capacity_forces_more_shards_and_colocation_when_it_fits():
    # 300 GB of rows: no single 80 GB GPU holds it, the eight of a DGX do
    result = plan(3000, 100_000_000, dgx_h100(), Workload(batch_size=8192, sampler="uniform"))
    assert result.memory["storage"] in ("device", "pinned_host")
    if result.memory["storage"] == "device":
        assert result.num_shards >= 4
    # Global draws (replay.sample) make every shard gather the whole batch and reduce-scatter it: as many bytes as
    # copying it from one shard, so sharding buys capacity, not speed. Shard-local draws make co-location pay.
    frames = Workload(batch_size=8192, sampler="uniform")
    assert plan(84 * 84 * 4, 200_000, dgx_h100(), frames).num_shards == 1
    local = plan(84 * 84 * 4, 200_000, dgx_h100(), dataclasses.replace(frames, local_draws=True))
    assert local.num_shards == 8 and local.memory["storage"] == "device"
    assert local.placement.sample_route == "shard-local"
    assert "co-located" in dict(local.route)["delivery"]


def test_multi_node_keeps_ingest_and_sampling_local():
    work = Workload(batch_size=32 * 256, sampler="prioritized", ingest_rate=1e6, device_reserve=40 * 10**9)
    result = plan(400, 32_000_000, cluster(4, "dgx_h100", 3200), work)
    assert result.axis_names == ("node", "local") and result.mesh_shape[0] == 4
    assert result.placement.sample_route == "node-local-first"
    assert result.placement.ingest_route == "producer-local"


def test_the_1024_gpu_cluster_plans():  # its time is measured in benchmarks/bench_placement.py, not here
    work = Workload(batch_size=1024 * 256, sampler="prioritized", ingest_rate=1e7, device_reserve=40 * 10**9)
    result = plan(400, 1024 * 1_000_000, cluster(), work)
    assert result.mesh_shape[0] == 128 and np.prod(result.mesh_shape) == result.num_shards
    assert result.memory["index"] == "device"


def test_infeasible_says_which_constraint_by_how_much_and_what_fits():
    work = Workload(batch_size=256, device_reserve=10 * 10**9)
    with pytest.raises(PlacementError) as info:
        plan(4000, 1_000_000_000, dgx_h100(), work)  # 4 TB of rows; the box has 8 x 70 GB + 2 TB
    message = str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ConduitError)
    assert "short by" in message and "What would fit: capacity <=" in message and "dgx_h100" in message
    fit = int(re.search(r"capacity <= ([\d,]+)", message).group(1).replace(",", ""))
    assert 0 < fit < 1_000_000_000
    assert plan(4000, fit, dgx_h100(), work).capacity == fit  # what it says fits, fits
    with pytest.raises(PlacementError, match="multiple of the shard count"):
        plan(SPEC, 7, cluster(3, "h200", 100), Workload(batch_size=3))
    with pytest.raises(PlacementError, match="no device 99"):
        plan(SPEC, 64, dgx_h100(), Workload(learner_devices=(99,)))
    with pytest.raises(PlacementError, match="batch_size"):
        Workload(batch_size=0)
    with pytest.raises(PlacementError, match="capacity"):
        plan(SPEC, 0, dgx_h100())
    with pytest.raises(PlacementError, match=r"capacity must be an int in \[1, 2,147,483,647\]"):
        plan(SPEC, 2**31, h200())  # what a plane refuses (int32 row ids), the planner refuses too


def _check_capacity(topo: Topology, result: Plan) -> None:
    """Recompute, independently of the planner, what the plan puts in every memory and pool."""
    work = result.workload
    p = result.placement
    learners = work.learner_devices or tuple(d.id for d in topo.devices)
    sizes = part_bytes(result.row_bytes, result.capacity, p.num_shards, work)
    used = defaultdict(int)
    for device_id in p.device_ids:
        for part in ("storage", "index", "control"):
            used[topo.memory(device_id, p.kind(part)).name] += sizes[part]
    staging = staging_bytes(result.row_bytes, work, len(learners))
    for device_id in learners:
        used[topo.memory(device_id, "device").name] += staging + work.device_reserve
    pools = defaultdict(int)
    host_pools = {m.pool for m in topo.memories if m.kind != "device"}
    for mem in topo.memories:
        if used[mem.name]:
            assert used[mem.name] <= mem.capacity, (mem.name, used[mem.name], mem.capacity)
        pools[mem.pool] += used[mem.name]
    for pool, bytes_used in pools.items():
        assert bytes_used <= topo.pool_capacity(pool) - (work.host_reserve if pool in host_pools else 0), pool
    for _, used_bytes, available in result.usage:
        assert used_bytes <= available


@st.composite
def _problems(draw):
    nodes = draw(st.integers(1, 3))
    per_node = draw(st.sampled_from([1, 2, 3, 4, 8]))
    gpu = draw(st.booleans())
    unit = draw(st.sampled_from([MB, GB]))
    device_memory = int(draw(st.floats(0.5, 100)) * unit)
    host_memory = int(draw(st.floats(0.5, 400)) * unit)
    pinned = int(host_memory * draw(st.floats(0.05, 1.0)))
    links = {"local": Link("local", 1e12, 0.0), "peer": Link("peer", draw(st.floats(1e9, 1e12)), 2 * US,
                                                              aggregate=draw(st.sampled_from([0.0, 1e11]))),
             "host_pinned": Link("host_pinned", draw(st.floats(1e9, 1e11)), 5 * US, aggregate=1e11),
             "host_pageable": Link("host_pageable", 1e10, 10 * US), "network": Link("network", 1e10, 5 * US)}
    topo = Topology.uniform_nodes(
        "random", nodes=nodes, devices_per_node=per_node, platform="gpu" if gpu else "cpu", model="x",
        device_memory=device_memory, device_bandwidth=1e12, device_row_time=1e-10, host_memory=host_memory,
        pinned_limit=pinned, host_bandwidth=1e11, host_row_time=2e-8, links=links,
        timing=GPU_TIMING if gpu else CPU_TIMING, device_in_host_pool=not gpu)
    n_devices = nodes * per_node
    learners = draw(st.sampled_from([(), tuple(range(min(n_devices, draw(st.integers(1, n_devices)))))]))
    work = Workload(batch_size=draw(st.sampled_from([8, 64, 256, 4096])),
                    batches_per_step=draw(st.integers(1, 4)),
                    sampler=draw(st.sampled_from(["uniform", "prioritized", "fifo", "epochs", "sequences"])),
                    window=draw(st.sampled_from([1, 8])), times_sampled=draw(st.booleans()),
                    ingest_rate=draw(st.sampled_from([0.0, 1e4, 1e6])), learner_devices=learners,
                    device_reserve=int(device_memory * draw(st.sampled_from([0.0, 0.5, 0.99]))),
                    host_reserve=int(host_memory * draw(st.sampled_from([0.0, 0.3]))))
    row_bytes = draw(st.sampled_from([4, 28, 400, 4096, 28224]))
    capacity = draw(st.sampled_from([8, 1000, 24_000, 10**6, 10**8])) * draw(st.sampled_from([1, 3]))
    return topo, work, row_bytes, capacity


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_problems())
def test_capacity_is_never_exceeded(problem):
    topo, work, row_bytes, capacity = problem
    try:
        result = plan(row_bytes, capacity, topo, work)
    except PlacementError as exc:
        message = str(exc)
        assert "multiple of the shard count" in message or "short by" in message, message
        found = re.search(r"capacity <= ([\d,]+)", message)
        if found:  # what the message says would fit does fit
            fit = int(found.group(1).replace(",", ""))
            _check_capacity(topo, plan(row_bytes, fit, topo, work))
        return
    _check_capacity(topo, result)
    assert capacity % result.num_shards == 0
    assert Plan.from_json(result.to_json()) == result


# ------------------------------------------------------------------------------------------------------------------
# applying a plan to a real ReplayState
# ------------------------------------------------------------------------------------------------------------------
ROW = 28
CAPACITY = 4096  # 112 KB of rows; a prioritized index of 17.5 KB per shard


def _tight_cpu(device_memory, pinned_limit=None):
    return emulated_cpu(8, device_memory=device_memory, pinned_limit=pinned_limit)


def _tight_gpu_like():
    """Eight devices with their own (tiny) memories and almost no host memory: capacity needs several shards."""
    links = {"local": Link("local", 8e9, 0.0), "peer": Link("peer", 8e9, 1e-6), "host_pinned": Link("host_pinned",
             8e9, 1e-6), "host_pageable": Link("host_pageable", 8e9, 1e-6), "network": Link("network", 1e9, 1e-5)}
    return Topology.uniform_nodes("tight", nodes=1, devices_per_node=8, platform="cpu", model="cpu",
                                  device_memory=48_000, device_bandwidth=8e9, device_row_time=1e-7,
                                  host_memory=20_000, pinned_limit=20_000, host_bandwidth=8e9, host_row_time=1e-7,
                                  links=links, timing=GPU_TIMING)


@pytest.mark.parametrize("topology, expected", [
    (lambda: _tight_cpu(64_000), {"storage": "pinned_host", "index": "device"}),
    (lambda: _tight_cpu(1_000), {"storage": "pinned_host", "index": "pinned_host"}),
    (lambda: _tight_cpu(64_000, pinned_limit=64_000), {"storage": "unpinned_host", "index": "device"}),
    (_tight_gpu_like, {"storage": "device", "index": "device"}),
])
def test_plan_shardings_applied_to_a_real_state(topology, expected):
    topo = topology()
    result = plan(SPEC, CAPACITY, topo, Workload(batch_size=8, sampler="prioritized"))
    assert {k: result.memory[k] for k in expected} == expected
    if topo.name == "tight":
        assert result.num_shards >= 4  # 112 KB of rows cannot sit on fewer 48 KB devices
    mesh = result.mesh()
    plane = ExperienceDataPlane(SPEC, CAPACITY, samplers.prioritized(8), mesh=mesh)
    plane.ingest({"obs": np.ones((64, 5), np.float32), "act": np.arange(64, dtype=np.int32),
                  "done": np.zeros(64, bool)})
    before = jax.device_get(plane.state)
    shardings = result.shardings(plane.config)
    state = jax.device_put(plane.state, shardings)
    flat, _ = jax.tree_util.tree_flatten_with_path(state)
    kinds_seen = set()
    for (path, leaf), sharding in zip(flat, jax.tree_util.tree_leaves(shardings)):
        kind = result.memory[part_of(path, leaf)]
        assert leaf.sharding.memory_kind == kind == sharding.memory_kind, jax.tree_util.keystr(path)
        assert leaf.sharding == sharding
        kinds_seen.add((part_of(path, leaf), kind))
    assert ("storage", result.memory["storage"]) in kinds_seen and ("index", result.memory["index"]) in kinds_seen
    for old, new in zip(jax.tree_util.tree_leaves(before), jax.tree_util.tree_leaves(jax.device_get(state))):
        np.testing.assert_array_equal(old, new)
    # the pytree form gives the same shardings
    by_state = result.shardings(plane.state)
    assert jax.tree_util.tree_leaves(by_state) == jax.tree_util.tree_leaves(shardings)


def test_plan_refuses_a_foreign_mesh():
    result = plan(SPEC, CAPACITY, _tight_gpu_like(), Workload(batch_size=8))
    plane = ExperienceDataPlane(SPEC, CAPACITY, samplers.uniform(8), mesh=jax.make_mesh(
        (1,), ("shard",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1]))
    with pytest.raises(PlacementError, match="plan.mesh()"):
        result.shardings(plane.config)
    gpu_plan = plan(SPEC, 1024, cluster(2, "dgx_h100", 800), Workload(batch_size=16))
    with pytest.raises(PlacementError, match="not among"):
        gpu_plan.mesh()


# ------------------------------------------------------------------------------------------------------------------
# conduit plan
# ------------------------------------------------------------------------------------------------------------------
def test_cli(capsys):
    assert cli_main(["--topology", "dgx_h100", "--spec", "obs:uint8:84x84x4,act:int32,rew:float32",
                     "--capacity", "1000000", "--batch-size", "256", "--sampler", "prioritized",
                     "--reserve", "40GB"]) == 0
    out = capsys.readouterr().out
    assert "Plan on dgx_h100" in out and "storage" in out
    assert cli_main(["--topology", "cluster:2", "--spec", "400", "--capacity", "160000", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["format"] == "conduit-plan/1" and data["mesh"]["axis_names"] == ["node", "local"]
    assert cli_main(["--topology", "h200", "--spec", "28224", "--capacity", "100000000"]) == 2
    assert "short by" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # an unknown topology is refused while parsing
        cli_main(["--topology", "nope", "--spec", "4", "--capacity", "8"])
    assert exit_info.value.code == 2
    assert "argument --topology: 'nope': neither a preset" in capsys.readouterr().err


@pytest.mark.parametrize("text, names", [
    ("obs:float32:8x", "expected a shape like 84x84x4"),
    ("obs:float33:8", "dtype 'float33' is not one of"),
    ("obs:float32:0", "the shape must be positive ints"),
    ("obs", "expected name:dtype[:shape]"),
    ('{"obs": 3}', "expected a JSON object"),
    ("@/no/such/spec.json", "cannot read '/no/such/spec.json'"),
    ("obs:uint8:\u00b2", "expected a shape like 84x84x4"),  # '²'.isdigit() is True, int('²') fails
    ("\u00b2", "expected name:dtype[:shape]"),
    ("a:int32,a:float32", "leaf names must be unique, got 'a' more than once"),
    ('{"a": [[2], "int32"], "a": [[3], "int32"]}', "leaf names must be unique, got 'a' more than once"),
])
def test_a_malformed_spec_names_the_flag_and_the_fault(text, names):
    with pytest.raises(PlacementError, match=r"^--spec: .*" + re.escape(names)):
        parse_spec(text)
    with pytest.raises(SystemExit) as exit_info:  # argparse refuses it while parsing: nothing heavy has run
        cli_main(["--spec", text, "--capacity", "8"])
    assert exit_info.value.code == 2


# ------------------------------------------------------------------------------------------------------------------
# bad input: every entry point refuses it with a ConfigError naming the argument
# ------------------------------------------------------------------------------------------------------------------
def test_placement_errors_are_config_errors():
    assert issubclass(PlacementError, ConfigError) and issubclass(PlacementError, ConduitError)


@pytest.mark.parametrize("fields, name", [
    (dict(learner_devices=("a",)), "learner_devices"),
    (dict(learner_devices=5), "learner_devices"),
    (dict(learner_devices=(1.5,)), "learner_devices"),
    (dict(learner_devices=(-1,)), "learner_devices"),
    (dict(learner_devices=(0, 0)), "learner_devices has duplicates"),
    (dict(producer_nodes=("x",)), "producer_nodes"),
    (dict(producer_nodes=3), "producer_nodes"),
    (dict(ingest_rate=math.inf), "ingest_rate must be a finite number >= 0, got inf"),
    (dict(ingest_rate=math.nan), "ingest_rate"),
    (dict(step_time=math.inf), "step_time"),
    (dict(device_reserve=math.inf), "device_reserve"),
    (dict(host_reserve=math.nan), "host_reserve"),
    (dict(prefetch=math.inf), "prefetch must be an int >= 0"),
    (dict(prefetch=1.5), "prefetch"),
    (dict(prefetch=-1), "prefetch"),
    (dict(times_sampled="no"), "times_sampled must be a bool"),
    (dict(local_draws=1), "local_draws"),
    (dict(sampler=["uniform"]), "sampler"),
])
def test_workload_refuses_bad_fields(fields, name):
    with pytest.raises(ConfigError, match=r"^Workload: .*" + re.escape(name)):
        Workload(batch_size=8, **fields)


def test_workload_takes_id_sequences():
    work = Workload(learner_devices=[np.int64(1), 2], producer_nodes=range(2))
    assert work.learner_devices == (1, 2) and work.producer_nodes == (0, 1)
    assert Workload.from_dict(json.loads(json.dumps(work.to_dict()))) == work


def test_plan_and_estimate_refuse_unknown_producer_nodes():
    work = Workload(batch_size=8, producer_nodes=(99,), ingest_rate=1e4)
    with pytest.raises(ConfigError, match=r"^plan\(\): Workload.producer_nodes \[99\] .*its nodes are \[0\]"):
        plan(SPEC, 64, emulated_cpu(8), work)
    with pytest.raises(ConfigError, match=r"^estimate\(\): Workload.producer_nodes"):
        estimate(emulated_cpu(8), work, Placement((0,), (1,), ("shard",)), ROW, 64)
    assert plan(SPEC, 64, cluster(2, "h200", 100), dataclasses.replace(work, producer_nodes=(1,))).num_shards >= 1


@pytest.mark.parametrize("make, name", [
    (lambda: emulated_cpu(2.5), "emulated_cpu(): devices must be an int >= 1, got 2.5"),
    (lambda: emulated_cpu(0), "emulated_cpu(): devices"),
    (lambda: emulated_cpu(True), "emulated_cpu(): devices"),
    (lambda: emulated_cpu(8, host_memory=-1), "emulated_cpu(): host_memory must be a finite number of bytes >= 1"),
    (lambda: emulated_cpu(8, host_memory=math.inf), "emulated_cpu(): host_memory"),
    (lambda: emulated_cpu(8, host_memory="1GB"), "emulated_cpu(): host_memory"),
    (lambda: emulated_cpu(8, device_memory=0), "emulated_cpu(): device_memory"),
    (lambda: emulated_cpu(8, pinned_limit=-1), "emulated_cpu(): pinned_limit"),
    (lambda: h200(host_memory=-1), "h200(): host_memory"),
    (lambda: h200(host_memory=math.nan), "h200(): host_memory"),
    (lambda: cluster(2, network_gbps=math.nan), "cluster(): network_gbps"),
    (lambda: cluster(2, network_gbps="x"), "cluster(): network_gbps"),
    (lambda: cluster(2, network_gbps=0), "cluster(): network_gbps"),
    (lambda: cluster(2, network_gbps=math.inf), "cluster(): network_gbps"),
    (lambda: cluster(1.5), "cluster(): nodes"),
    (lambda: cluster(2, node_preset=None), "cluster(): node_preset"),
])
def test_presets_refuse_bad_sizes(make, name):
    with pytest.raises(ConfigError, match="^" + re.escape(name)):
        make()


@pytest.mark.parametrize("edit, name", [
    (lambda d: d["memories"]["capacity"].__setitem__(0, -1), "memory 'n0/d0/device': capacity"),
    (lambda d: d["memories"]["bandwidth"].__setitem__(0, 0.0), "memory 'n0/d0/device': bandwidth"),
    (lambda d: d["pools"][0].__setitem__(1, -5), "pool 'n0/dram': capacity"),
    (lambda d: d["links"][1].__setitem__("bandwidth", math.nan), "link 'peer': bandwidth"),
    (lambda d: d["timing"].__setitem__("write_bandwidth", 0.0), "timing: write_bandwidth"),
])
def test_a_topology_refuses_figures_that_price_at_inf_or_nan(edit, name):
    data = emulated_cpu(2).to_dict()
    edit(data)
    with pytest.raises(ConfigError, match=r"^Topology 'emulated_cpu:2': " + re.escape(name)):
        Topology.from_dict(data)


@pytest.mark.parametrize("load, name", [
    (lambda tmp: Topology.load(123), "Topology.load(): preset_or_path must be a preset name or the path"),
    (lambda tmp: Topology.load(str(tmp / "hostname")), "hostname'): not a topology JSON file (not JSON"),
    (lambda tmp: Topology.load(str(tmp)), "'): a directory, not a preset or a topology JSON file"),
    (lambda tmp: Topology.load(str(tmp / "list.json")), "list.json'): expected a JSON object"),
    (lambda tmp: Topology.load("bogus"), "Topology.load('bogus'): neither a preset"),
    (lambda tmp: Topology.from_json("not json"), "Topology.from_json(): malformed topology: not JSON"),
    (lambda tmp: Topology.from_json("[]"), "Topology.from_json(): expected a JSON object"),
    (lambda tmp: Topology.from_json(None), "Topology.from_json(): text must be a JSON string"),
    (lambda tmp: Plan.from_json("not json"), "Plan.from_json(): malformed plan: not JSON"),
    (lambda tmp: Plan.from_json("[]"), "Plan.from_json(): expected a JSON object"),
])
def test_loading_refuses_what_is_not_a_topology_or_a_plan(load, name, tmp_path):
    (tmp_path / "hostname").write_text("myhost\n")
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ConfigError, match=re.escape(name)):
        load(tmp_path)


@pytest.mark.parametrize("devices", ["x", 5, ["x"]])
def test_plan_mesh_refuses_devices_that_are_not_devices(devices):
    result = plan(SPEC, 64, emulated_cpu(1), Workload(batch_size=8))
    with pytest.raises(ConfigError, match=r"^Plan.mesh\(\): devices must be a sequence of jax.Device"):
        result.mesh(devices=devices)
    assert result.mesh(devices=jax.devices()[:1]).devices.flat[0] == jax.devices()[0]


_Shardings = collections.namedtuple("_Shardings", "rows cursor")


@pytest.mark.parametrize("part, kind, name", [
    ("bogus", "device", "with_part_in(): part must be one of ('storage', 'index', 'control'), got 'bogus'"),
    ("strorage", "device", "part must be one of"),
    ("storage", "bogus_kind", "with_part_in(): memory_kind must be one of ('device', 'pinned_host', "
                              "'unpinned_host'), got 'bogus_kind'"),
])
def test_with_part_in_refuses_unknown_parts_and_kinds(part, kind, name):
    mesh = jax.make_mesh((1,), ("shard",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    shardings = _Shardings(*(jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) for _ in range(2)))
    with pytest.raises(ConfigError, match=re.escape(name)):
        with_part_in(shardings, part, kind)
    with pytest.raises(ConfigError, match=r"shardings must be a pytree of jax.sharding.NamedSharding"):
        with_part_in(["x"], "storage", "device")
    moved = with_part_in(shardings, "storage", "pinned_host")
    assert moved.rows.memory_kind == "pinned_host" and moved.cursor == shardings.cursor
