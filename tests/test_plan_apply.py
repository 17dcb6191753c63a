"""A placement plan applied to a live plane: state lands where the plan says, kernels run there, replan keeps items."""

import dataclasses

import jax
import numpy as np
import pytest

import conduit_jax as cj
from conduit_jax import placement, samplers

SPEC = cj.ExperienceSpec.from_example({"obs": np.zeros((5,), np.float32), "act": np.int32(0)})


def make_plan(capacity, storage_kind, index_kind="device"):
    """The planner's plan for this machine's preset, with the memory kinds overridden (a plan is data)."""
    base = placement.plan(SPEC, capacity, placement.emulated_cpu(),
                          placement.Workload(batch_size=8, sampler="prioritized"))
    chosen = dataclasses.replace(base.placement, storage=storage_kind, index=index_kind)
    return dataclasses.replace(base, placement=chosen)


def kinds_of(plane):
    return {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(plane.state.storage)}


@pytest.mark.parametrize("storage_kind", ["device", "unpinned_host", "pinned_host"])
def test_plane_state_follows_the_plan_and_kernels_run_there(storage_kind):
    plan = make_plan(64, storage_kind)
    plane = cj.ExperienceDataPlane(SPEC, 64, samplers.prioritized(8), plan=plan)
    assert plane.state.storage.rows.sharding.memory_kind == storage_kind
    want = jax.tree_util.tree_leaves(plan.shardings(plane.config))
    for leaf, sharding in zip(jax.tree_util.tree_leaves(plane.state), want):
        assert leaf.sharding.memory_kind == sharding.memory_kind
    plane.ingest({"obs": np.ones((20, 5), np.float32), "act": np.arange(20, dtype=np.int32)})
    delivery = plane.sample()
    plane.update_priorities(delivery.ids, np.ones(8, np.float32))
    assert set(np.asarray(delivery.data["act"]).tolist()) <= set(range(20))
    for leaf, sharding in zip(jax.tree_util.tree_leaves(plane.state), want):  # kernels keep the placement
        assert leaf.sharding.memory_kind == sharding.memory_kind


def test_replan_between_memory_kinds_keeps_every_item_and_id():
    plane = cj.ExperienceDataPlane(SPEC, 64, samplers.fifo(8), plan=make_plan(64, "device"))
    plane.ingest({"obs": np.zeros((40, 5), np.float32), "act": np.arange(40, dtype=np.int32)})
    first = plane.sample()
    seen = [np.asarray(first.data["act"])]
    for kind in ("pinned_host", "unpinned_host", "device"):
        before = [np.asarray(x).copy() for x in jax.tree_util.tree_leaves(jax.device_get(plane.state))]
        plane.replan(make_plan(64, kind))
        assert plane.state.storage.rows.sharding.memory_kind == kind
        after = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(plane.state))]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(before, after))
        seen.append(np.asarray(plane.sample().data["act"]))
    delivered = np.concatenate(seen)
    assert sorted(delivered.tolist()) == list(range(32))  # 4 batches of 8, in order, none lost or repeated


def test_plan_for_another_capacity_or_shard_count_is_refused():
    with pytest.raises(cj.ConfigError, match="capacity"):
        cj.ExperienceDataPlane(SPEC, 128, samplers.uniform(8), plan=make_plan(64, "device"))
    plane = cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), plan=make_plan(64, "device"))
    with pytest.raises(cj.ConfigError, match="mesh or plan"):
        cj.ExperienceDataPlane(SPEC, 64, samplers.uniform(8), plan=make_plan(64, "device"), mesh=cj.default_mesh(1))
    assert plane.num_shards == 1
