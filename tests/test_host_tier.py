"""The host memory tier: a capacity that does not fit is refused before anything is allocated; a ring larger than the
device budget lives in host memory, is sampled correctly, and the cost model prices the bytes its kernels move.
(That the kernels move only batches, never the ring, is read from their HLO in test_kernel_hlo.py.)"""

import jax
import numpy as np
import pytest

from conduit_jax import CapacityError, ExperienceDataPlane, default_mesh, functional, memory, placement, samplers
from conduit_jax.engine import memory_moves
from conduit_jax.placement import with_part_in
from conduit_jax.placement.cost import Placement, Workload, estimate

WIDE = {"obs": jax.ShapeDtypeStruct((64,), np.float32), "action": jax.ShapeDtypeStruct((), np.int32)}


@pytest.mark.parametrize("devices", [1, 8])
def test_a_capacity_beyond_free_memory_is_refused_before_allocation(devices):
    capacity = 8 * (4 * memory.host_free()[0] // (8 * 260))  # four times what the host has free, in 260 B rows
    capacity = min(capacity, (2**31 - 1) // 8 * 8)
    for make in (ExperienceDataPlane, functional.make_buffer):
        with pytest.raises(CapacityError, match=r"needs .* in host DRAM but .* is free .*capacity <= [\d,]+ fits"):
            make(WIDE, capacity, samplers.uniform(256), mesh=default_mesh(devices))


def test_needs_counts_each_device_share_and_every_replica():
    config, shardings = functional.configure(WIDE, 1 << 12, samplers.prioritized(64), mesh=default_mesh(8))
    abstract = jax.eval_shape(lambda: functional.bind(config, shardings).init(0))
    need = memory.needs(abstract, shardings)
    assert list(need) == [memory.HOST]  # XLA:CPU: every kind of every device is the host's DRAM
    ring = (1 << 12) * 260
    nbytes = lambda leaf: int(np.prod(leaf.shape)) * leaf.dtype.itemsize  # noqa: E731
    replicated = sum(nbytes(leaf) for leaf, s in zip(jax.tree_util.tree_leaves(abstract),
                                                    jax.tree_util.tree_leaves(shardings)) if s.is_fully_replicated)
    sharded = sum(nbytes(leaf) for leaf, s in zip(jax.tree_util.tree_leaves(abstract),
                                                 jax.tree_util.tree_leaves(shardings)) if not s.is_fully_replicated)
    assert sharded >= ring and need[memory.HOST] == sharded + 8 * replicated
    # a move (place, replan) needs new room only for the leaves that move: here the ring alone
    moving = memory.needs(abstract, with_part_in(shardings, "storage", "pinned_host"), already=shardings)
    assert moving == {memory.HOST: (1 << 12) * config.layout.row_bytes}


def test_a_ring_beyond_the_device_budget_lives_in_host_memory_and_samples_correctly():
    capacity, budget = 1 << 13, 1 << 20  # 2.1 MB of rows, 1 MB of device memory
    plan = placement.plan(WIDE, capacity, placement.emulated_cpu(1, device_memory=budget),
                          placement.Workload(batch_size=64))
    assert plan.placement.storage == "pinned_host" and plan.placement.index == "device"
    assert "spilled" in plan.explain() and "gathered in place in pinned_host" in plan.explain()
    plane = ExperienceDataPlane(WIDE, capacity, samplers.uniform(64), plan=plan)
    assert plane.state.storage.rows.sharding.memory_kind == "pinned_host"
    n = capacity + 100  # wraps: the newest `capacity` items are kept
    obs = np.arange(n, dtype=np.float32)[:, None] + np.zeros((1, 64), np.float32)
    plane.ingest({"obs": obs, "action": np.arange(n, dtype=np.int32)})
    for _ in range(3):
        delivery = plane.sample()
        actions = np.asarray(delivery.data["action"])
        assert np.all(actions >= n - capacity)
        np.testing.assert_array_equal(np.asarray(delivery.data["obs"]), actions[:, None] + np.zeros((1, 64)))
        np.testing.assert_array_equal(np.asarray(delivery.ids)[:, 0], actions % capacity)
    assert plane.state.storage.rows.sharding.memory_kind == "pinned_host"


def test_the_planner_keeps_a_ring_beyond_hbm_in_pinned_host_and_says_why():
    plan = placement.plan(WIDE, 2**29 * 3 // 2, placement.h200())  # 209 GB of rows, 141 GB of HBM
    assert (plan.placement.storage, plan.placement.index) == ("pinned_host", "device")
    text = plan.explain()
    assert "spilled" in text and "only the batch's rows cross host_pinned" in text


def test_the_cost_model_prices_the_bytes_the_sample_kernel_moves():
    """On a GPU topology the planner predicts the host-to-device bytes of one sample over a pinned_host ring: the
    batch's rows. The kernel lowered for CUDA moves exactly its leaves' bytes (words, here: rows are their leaves)."""
    batch = 64
    plane = ExperienceDataPlane(WIDE, 1 << 12, samplers.uniform(batch), mesh=default_mesh(1))
    plane.place(with_part_in(plane.shardings, "storage", "pinned_host"))
    moved = memory_moves(plane.engine.lowered("sample", platform="cuda").as_text())
    to_device = sum(size for kind, size in moved if kind == "device")
    costs = estimate(placement.h200(), Workload(batch_size=batch), Placement((0,), (1,), ("shard",),
                                                                               storage="pinned_host"),
                     plane.config.layout.row_bytes, 1 << 12)
    assert dict(costs.link_bytes)["host_pinned"] == to_device == batch * plane.config.layout.row_bytes
