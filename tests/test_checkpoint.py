"""Checkpoints (conduit_jax/checkpoint.py): bit-exact round trips that keep delivering the same batches, restore onto
another shard count (checked against a plane built there from the same items), incremental steps, asynchronous saves
under concurrent ingest, a save killed by SIGKILL, retention, and refusal of missing / corrupted / mismatching
checkpoints. ``CONDUIT_CHECKPOINT_BENCH=1`` also runs the ~1 GB measurement and prints its figures."""

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conduit_jax import (
    ConduitError,
    ConfigError,
    ExperienceDataPlane,
    ExperienceSpec,
    checkpoint,
    default_mesh,
    limits,
    replay,
    samplers,
    sumtree,
)
from conduit_jax.checkpoint import CheckpointError
from conduit_jax.errors import ConduitWarning

SPEC = {
    "obs": {"x": jax.ShapeDtypeStruct((3,), jnp.float32), "b": jax.ShapeDtypeStruct((2,), jnp.bfloat16)},
    "g": jax.ShapeDtypeStruct((), jnp.int32),
    "terminated": jax.ShapeDtypeStruct((), jnp.bool_),
    "truncated": jax.ShapeDtypeStruct((), jnp.bool_),
}
CAPACITY = 128
# orbax leaves the other reads of a failed restore behind as coroutines whose errors surface at garbage collection
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*coroutine:pytest.PytestUnraisableExceptionWarning")
KINDS = ["uniform", "fifo", "prioritized", "sequences"]


def batch(start, n):
    g = np.arange(start, start + n, dtype=np.int32)
    return {"obs": {"x": np.stack([g * 0.5, -g, g + 0.25], 1).astype(np.float32),
                    "b": np.stack([g, g * 2], 1).astype(jnp.bfloat16)},
            "g": g, "terminated": g % 11 == 10, "truncated": g % 13 == 12}


def sampler_of(kind):
    return {"uniform": lambda: samplers.uniform(16), "fifo": lambda: samplers.fifo(16),
            "prioritized": lambda: samplers.prioritized(16, alpha=0.7, beta=0.5, max_times_sampled=4),
            "sequences": lambda: samplers.sequences(16, 3, 8)}[kind]()


def make(kind, mesh, seed=3):
    return ExperienceDataPlane(SPEC, CAPACITY, sampler_of(kind), mesh=mesh, seed=seed)


def feed(plane, kind):
    """Ingest past the ring's end (the ring wraps), sample, and for prioritized planes update priorities. Returns the
    calls made ("ingest", start) / ("sample",), so a reference plane can replay them. Every ingest holds 40 items (one
    compiled ingest kernel per plane)."""
    calls = []

    def ingest(start):
        plane.ingest(batch(start, 40))
        calls.append(("ingest", start))

    if kind == "fifo":
        for start in (0, 40):
            ingest(start)
        for _ in range(4):
            plane.sample()
            calls.append(("sample",))
        for start in (80, 120):  # 160 items: slots of the first 32 are rewritten (they were delivered)
            ingest(start)
        plane.sample()
        return calls
    for start in range(0, 200, 40):  # 200 items > capacity 128
        ingest(start)
    for i in range(3):
        delivery = plane.sample()
        if kind == "prioritized":
            plane.update_priorities(delivery.ids, np.linspace(0.1, 4.0, 16) * (i + 1))
    return calls


def host_leaves(state):
    flat, _ = jax.tree_util.tree_flatten_with_path(jax.device_get(state))
    return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in flat]


def assert_same_state(a, b):
    la, lb = host_leaves(a), host_leaves(b)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert np.array_equal(x, y), f"state leaf {path} differs"


def assert_same_delivery(d1, d2):
    for x, y in zip(jax.tree_util.tree_leaves(jax.device_get(d1)), jax.tree_util.tree_leaves(jax.device_get(d2))):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def item_view(plane):
    """Item g -> (packed row, sampler values of g) for every stored item, derived from the documented layout (item g
    at shard g % S, slot (g // S) % (capacity / S), held in that slot's ring row), so planes with different shard
    counts can be compared."""
    state = jax.device_get(plane.state)
    shards, shard_cap = plane.num_shards, plane.capacity // plane.num_shards
    counts = state.storage.laps.astype(np.int64) * shard_cap + state.storage.cursor
    total = int(counts.sum())
    items = np.arange(max(0, total - plane.capacity), total)
    at = (items % shards) * shard_cap + (items // shards) % shard_cap
    row_at = (items % shards) * shard_cap + plane.config.ring_row((items // shards) % shard_cap)
    view = {"total": total, "rows": np.asarray(state.storage.rows)[row_at]}
    sampler = state.sampler
    if isinstance(sampler, samplers.PriorityState):
        leaves = np.asarray(sampler.levels[-1])
        per_shard = leaves.shape[0] // shards
        view["leaves"] = leaves[(items % shards) * per_shard + (items // shards) % shard_cap]
        view["max_priority"] = float(sampler.max_priority)
        if sampler.times_sampled is not None:
            view["times"] = np.asarray(sampler.times_sampled)[at]
        # every node is the float32 sum of its children
        for upper, lower in zip(sampler.levels[:-1], sampler.levels[1:]):
            np.testing.assert_allclose(np.asarray(upper), np.asarray(lower).reshape(-1, sumtree.ARITY).sum(-1),
                                       rtol=1e-6)
    return view


def assert_same_items(a, b):
    va, vb = item_view(a), item_view(b)
    assert va["total"] == vb["total"]
    assert np.array_equal(va["rows"], vb["rows"])
    for key in ("leaves", "max_priority", "times"):
        if key in va:
            assert np.array_equal(va[key], vb[key]), key


# -- round trips -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bit_exact_and_keeps_delivering_the_same_batches(kind, mesh, tmp_path):
    plane = make(kind, mesh)
    feed(plane, kind)
    handle = checkpoint.save(plane, tmp_path, block=True)
    assert handle.step == 0 and handle.kind == "full" and handle.total_s >= handle.blocked_s >= 0
    restored = ExperienceDataPlane.restore(tmp_path, mesh=mesh)
    assert restored.spec == plane.spec and restored.capacity == plane.capacity
    assert restored.sampler.params == plane.sampler.params and restored.limiter.params == plane.limiter.params
    assert_same_state(plane.state, restored.state)
    others = []
    if mesh.size == 8 and kind == "prioritized":  # same shard count, other devices and mesh shape: a plain reshard
        from jax.sharding import AxisType
        other = jax.make_mesh((2, 4), ("host", "local"), axis_types=(AxisType.Auto, AxisType.Auto),
                              devices=jax.devices()[::-1])
        others.append(ExperienceDataPlane.restore(tmp_path, mesh=other))
        assert others[0].state.storage.rows.sharding.mesh.axis_names == ("host", "local")
        assert_same_state(plane.state, others[0].state)
    for _ in range(3):  # the random streams, queue heads and priorities continue where they were
        expected = plane.sample()
        for p in (restored, *others):
            assert_same_delivery(expected, p.sample())
    for p in (plane, restored):
        p.ingest(batch(1000, 40))
    assert_same_delivery(plane.sample(), restored.sample())
    assert_same_state(plane.state, restored.state)


@pytest.mark.parametrize("kind", KINDS)
def test_restore_onto_other_shard_counts_equals_a_plane_built_there(kind, tmp_path):
    """8 -> 4 -> 1 shards: every stored item keeps its bytes and its priority, and the storage equals that of a plane
    built on the new mesh from the same items; a queue delivers the same next items."""
    original = make(kind, default_mesh(8))
    calls = feed(original, kind)
    checkpoint.save(original, tmp_path / "s8", block=True)
    four = ExperienceDataPlane.restore(tmp_path / "s8", mesh=default_mesh(4))
    checkpoint.save(four, tmp_path / "s4", block=True)
    one = ExperienceDataPlane.restore(tmp_path / "s4", mesh=default_mesh(1))
    for restored in (four, one):
        assert_same_items(original, restored)  # rows, priorities and the sum trees above them
        if kind in ("fifo", "sequences"):  # queue head; window eligibility (it depends on the items alone)
            reference = make(kind, restored.mesh)
            for call in calls:
                if call[0] == "ingest":
                    reference.ingest(batch(call[1], 40))
                elif kind == "fifo":
                    reference.sample()
            ref, got = jax.device_get(reference.state), jax.device_get(restored.state)
            for field in ("rows", "cursor", "laps", "next_shard"):
                assert np.array_equal(getattr(ref.storage, field), getattr(got.storage, field)), field
            if kind == "sequences":
                assert np.array_equal(ref.sampler.levels[-1], got.sampler.levels[-1])
            else:  # the original delivered one more batch after its last ingest than the reference replayed
                shard_cap = CAPACITY // restored.num_shards
                assert (int(ref.sampler.head) + 16 // restored.num_shards) % shard_cap == int(got.sampler.head)
                assert int(ref.sampler.pending) - 16 == int(got.sampler.pending)
    if kind == "fifo":  # the same next items (within a batch the order is shard-major, so compare sorted)
        for _ in range(2):
            expected = np.sort(jax.device_get(original.sample().data["g"]))
            for restored in (four, one):
                assert np.array_equal(np.sort(jax.device_get(restored.sample().data["g"])), expected)
    else:
        total = item_view(original)["total"]
        for restored in (four, one):
            delivered = np.asarray(jax.device_get(restored.sample().data["g"])).reshape(-1)
            assert ((delivered >= total - CAPACITY) & (delivered < total)).all()


def test_version_1_rings_in_slot_order_are_read_and_converted(tmp_path, monkeypatch):
    """A format-version-1 checkpoint of a sequences plane (its rings kept in slot order, time-major) restores, on the
    same and on other shard counts, to the plane this version builds from the same calls (rings stream-major)."""
    original = make("sequences", default_mesh(2))  # 4 of the 8 envs interleaved in each shard's ring
    with monkeypatch.context() as old:  # the version-1 layout: every ring in slot order
        old.setattr(replay.ReplayConfig, "streams_per_shard", property(lambda config: 1))
        old.setattr(checkpoint, "FORMAT_VERSION", 1)
        calls = feed(original, "sequences")
        checkpoint.save(original, tmp_path / "v1", block=True)
    for shards in (2, 4, 1):  # the same shard count (converted on the device), and re-laid out on the host
        restored = ExperienceDataPlane.restore(tmp_path / "v1", mesh=default_mesh(shards))
        expected = make("sequences", default_mesh(shards))
        for call in calls:
            if call[0] == "ingest":
                expected.ingest(batch(call[1], 40))
        assert_same_items(expected, restored)
        assert np.array_equal(jax.device_get(expected.state.storage.rows), jax.device_get(restored.state.storage.rows))
        g = np.asarray(jax.device_get(restored.sample().data["g"]))
        np.testing.assert_array_equal(g[:, 1:], g[:, :-1] + 8)  # a window: consecutive steps of one of 8 envs


FRAME_SPEC = {"frame": jax.ShapeDtypeStruct((6, 5), jnp.uint8), "g": jax.ShapeDtypeStruct((), jnp.int32),
              "terminated": jax.ShapeDtypeStruct((), jnp.bool_), "truncated": jax.ShapeDtypeStruct((), jnp.bool_)}


def frame_batch(start, n):
    g = np.arange(start, start + n, dtype=np.int32)
    return {"frame": ((g[:, None, None] * 7 + np.arange(30).reshape(6, 5)) % 256).astype(np.uint8), "g": g,
            "terminated": g % 11 == 10, "truncated": g % 13 == 12}


def frame_plane(kind, shards):
    sampler = samplers.uniform(16) if kind == "uniform" else samplers.sequences(16, 3, 8)
    return ExperienceDataPlane(FRAME_SPEC, CAPACITY, sampler, mesh=default_mesh(shards), seed=3)


@pytest.mark.parametrize("kind", ["uniform", "sequences"])
def test_byte_rings_round_trip_increment_and_relayout(kind, tmp_path):
    """A layout made mostly of bytes keeps a uint8 ring: full and incremental steps restore it bit-exactly on the same
    shard count, and re-laid out on others it holds the rows of a plane built there from the same items."""
    plane = frame_plane(kind, 2)
    assert plane.state.storage.rows.dtype == np.uint8
    plane.ingest(frame_batch(0, 40))
    checkpoint.save(plane, tmp_path, incremental=True, block=True)
    for start in (40, 80, 120):  # 160 items: the ring wraps
        plane.ingest(frame_batch(start, 40))
        assert checkpoint.save(plane, tmp_path, incremental=True, block=True).kind == "incremental"
    restored = ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(2))
    assert_same_state(plane.state, restored.state)
    assert_same_delivery(plane.sample(), restored.sample())
    for shards in (4, 1):
        expected = frame_plane(kind, shards)
        for start in range(0, 160, 40):
            expected.ingest(frame_batch(start, 40))
        assert_same_items(expected, ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(shards)))


def test_version_2_byte_rings_saved_as_words_are_read_and_converted(tmp_path, monkeypatch):
    """Before format version 3 every ring was uint32 words. A version-2 chain of a byte layout (a full step and an
    increment), continued by this version's increments, restores on the same and on other shard counts to the plane
    this version builds from the same calls."""
    plane = frame_plane("sequences", 2)
    with monkeypatch.context() as old:
        old.setattr(type(plane.config.layout), "ring_dtype", property(lambda layout: np.dtype(np.uint32)))
        old.setattr(checkpoint, "FORMAT_VERSION", 2)
        plane = frame_plane("sequences", 2)
        assert plane.state.storage.rows.dtype == np.uint32
        for start in (0, 40):
            plane.ingest(frame_batch(start, 40))
            checkpoint.save(plane, tmp_path, incremental=True, block=True)
    continued = ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(2))
    assert continued.state.storage.rows.dtype == np.uint8
    for start in (80, 120):  # version-3 increments on the version-2 chain
        continued.ingest(frame_batch(start, 40))
        assert checkpoint.save(continued, tmp_path, incremental=True, block=True).kind == "incremental"
    for shards in (2, 4, 1):
        expected = frame_plane("sequences", shards)
        for start in range(0, 160, 40):
            expected.ingest(frame_batch(start, 40))
        restored = ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(shards))
        assert np.array_equal(jax.device_get(expected.state.storage.rows), jax.device_get(restored.state.storage.rows))
        assert_same_items(expected, restored)
    middle = ExperienceDataPlane.restore(tmp_path, step=1, mesh=default_mesh(2))  # the version-2 chain alone
    reference = frame_plane("sequences", 2)
    for start in (0, 40):
        reference.ingest(frame_batch(start, 40))
    assert_same_state(reference.state, middle.state)


def test_memory_kinds_of_a_plan_and_a_replan_survive_the_checkpoint(tmp_path):
    """A plane placed by a plan (ring in pinned_host memory) saves and restores onto that plan bit for bit; after a
    replan (other memory kinds, same shard count) incremental saves still build on the earlier steps."""
    import dataclasses

    from conduit_jax import placement

    def make_plan(storage_kind):
        base = placement.plan(ExperienceSpec.from_structs(SPEC), CAPACITY, placement.emulated_cpu(),
                              placement.Workload(batch_size=16, sampler="prioritized"))
        return dataclasses.replace(base, placement=dataclasses.replace(base.placement, storage=storage_kind))

    pinned, device = make_plan("pinned_host"), make_plan("device")
    plane = ExperienceDataPlane(SPEC, CAPACITY, sampler_of("prioritized"), plan=pinned)
    feed(plane, "prioritized")
    checkpoint.save(plane, tmp_path, incremental=True, block=True)
    assert checkpoint.metadata(tmp_path)["plan"]["memory"]["storage"] == "pinned_host"
    restored = ExperienceDataPlane.restore(tmp_path, plan=pinned)
    assert restored.state.storage.rows.sharding.memory_kind == "pinned_host"
    assert_same_state(plane.state, restored.state)
    plane.replan(device)
    plane.ingest(batch(500, 40))
    handle = checkpoint.save(plane, tmp_path, incremental=True, block=True)
    assert handle.kind == "incremental"
    onto_device = ExperienceDataPlane.restore(tmp_path, plan=device)
    assert onto_device.state.storage.rows.sharding.memory_kind == "device"
    assert_same_state(plane.state, onto_device.state)
    assert_same_delivery(plane.sample(), onto_device.sample())


# -- incremental ------------------------------------------------------------------------------------------------------
def test_incremental_steps_hold_only_new_rows_and_reassemble(mesh, tmp_path):
    plane = make("prioritized", mesh)
    plane.ingest(batch(0, 40))
    first = checkpoint.save(plane, tmp_path, incremental=True, block=True)
    assert first.kind == "full"  # nothing to build on yet
    plane.ingest(batch(40, 40))
    second = checkpoint.save(plane, tmp_path, incremental=True, block=True)
    assert second.kind == "incremental" and second.base_step == first.step
    # the 40 new rows travel as 40 (1 shard) or 8 x 5 (8 shards); everything else is the same
    assert second.bytes == first.bytes - (CAPACITY - 40) * plane.config.layout.row_bytes
    at_second = host_leaves(plane.state)
    delivery = plane.sample()
    plane.update_priorities(delivery.ids, np.full(16, 2.5))
    plane.ingest(batch(80, 40))
    plane.ingest(batch(120, 40))  # 160 items: the ring wraps
    third = checkpoint.save(plane, tmp_path, incremental=True, block=True)
    assert third.kind == "incremental" and third.base_step == second.step
    restored = ExperienceDataPlane.restore(tmp_path, mesh=mesh)
    assert_same_state(plane.state, restored.state)
    other = default_mesh(1 if plane.num_shards == 8 else 8)  # the chain re-laid out for another shard count
    assert_same_items(restored, ExperienceDataPlane.restore(tmp_path, mesh=other))
    assert_same_delivery(plane.sample(), restored.sample())
    middle = ExperienceDataPlane.restore(tmp_path, step=second.step, mesh=mesh)
    assert [p for p, _ in at_second] == [p for p, _ in host_leaves(middle.state)]
    for (path, x), (_, y) in zip(at_second, host_leaves(middle.state)):
        assert np.array_equal(x, y), path
    # a restored plane continues the chain
    restored.ingest(batch(160, 40))
    fourth = checkpoint.save(restored, tmp_path, incremental=True, block=True)
    assert fourth.kind == "incremental" and fourth.base_step == third.step
    assert_same_state(restored.state, ExperienceDataPlane.restore(tmp_path, mesh=mesh).state)
    # once a shard has been rewritten all the way round, an increment would be a full copy: it is one
    for start in range(200, 360, 40):
        restored.ingest(batch(start, 40))
    assert checkpoint.save(restored, tmp_path, incremental=True, block=True).kind == "full"


@pytest.mark.parametrize("shards", [1, 2])
def test_increments_of_a_stream_major_ring(shards, tmp_path):
    """A sequences plane keeps 8 / 4 envs interleaved per ring, stored stream-major: increments extract their rows
    and apply them through the slot-to-row map, on the same shard count and re-laid out for another one."""
    plane = make("sequences", default_mesh(shards))
    plane.ingest(batch(0, 40))
    checkpoint.save(plane, tmp_path, incremental=True, block=True)
    for start in (40, 80, 120):  # 160 items: the ring wraps
        plane.ingest(batch(start, 40))
        assert checkpoint.save(plane, tmp_path, incremental=True, block=True).kind == "incremental"
    assert_same_state(plane.state, ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(shards)).state)
    assert_same_items(plane, ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(4)))


def test_retention_keeps_the_newest_steps_and_the_bases_they_need(tmp_path):
    plane = make("uniform", default_mesh(1))
    plane.ingest(batch(0, 40))
    for _ in range(4):
        checkpoint.save(plane, tmp_path, max_to_keep=2, block=True)
    assert checkpoint.all_steps(tmp_path) == [2, 3]
    for i in range(3):  # 4 full, 5..6 increments of it
        plane.ingest(batch(40 + 40 * i, 40))
        checkpoint.save(plane, tmp_path, max_to_keep=2, incremental=i > 0, block=True)
    assert checkpoint.all_steps(tmp_path) == [4, 5, 6]  # the newest two, 5 and 6, need their base 4
    checkpoint.save(plane, tmp_path, max_to_keep=2, block=True)  # 7 full: keeps 6 (and its chain 5, 4) and 7
    assert checkpoint.all_steps(tmp_path) == [4, 5, 6, 7]
    checkpoint.save(plane, tmp_path, max_to_keep=2, block=True)
    assert checkpoint.all_steps(tmp_path) == [7, 8]
    with pytest.raises(CheckpointError, match=r"no finished step 2; the directory has steps \[7, 8\]"):
        ExperienceDataPlane.restore(tmp_path, step=2, mesh=default_mesh(1))
    with pytest.raises(ConfigError, match="steps only increase"):
        checkpoint.save(plane, tmp_path, step=5)


# -- asynchronous saves ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("copy", ["host", "device"])
def test_async_save_holds_the_state_at_the_call_while_ingest_and_sample_go_on(copy, tmp_path, monkeypatch):
    """``host``: the CPU path (memcpy under the lock); ``device``: the accelerator path (a jitted copy on the device,
    brought to the host by the background thread), forced here on CPU devices."""
    monkeypatch.setattr(checkpoint, "_SNAPSHOT_ON_HOST", copy == "host")
    plane = make("prioritized", default_mesh(8))
    feed(plane, "prioritized")
    expected = host_leaves(plane.state)
    handle = checkpoint.save(plane, tmp_path)  # returns before the step is written
    for i in range(4):  # these donate the live buffers the save must not be holding
        plane.ingest(batch(1000 + 40 * i, 40))
        plane.update_priorities(plane.sample().ids, np.full(16, 3.0))
    handle.wait()
    assert handle.done() and handle.total_s is not None and handle.blocked_s < handle.total_s
    restored = host_leaves(ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(8)).state)
    for (path, x), (_, y) in zip(expected, restored):
        assert np.array_equal(x, y), path


def test_saves_taken_while_another_thread_ingests_are_consistent_snapshots(tmp_path):
    """Each step is one consistent state: every stored slot holds exactly the item its shard's counter says."""
    plane = ExperienceDataPlane(SPEC, 256, samplers.uniform(8), mesh=default_mesh(1))
    plane.ingest(batch(0, 8))
    stop = threading.Event()

    def producer():
        g = 8
        while not stop.is_set():
            plane.ingest(batch(g, 8))
            g += 8

    thread = threading.Thread(target=producer)
    thread.start()
    try:
        handles = []
        for _ in range(3):
            time.sleep(0.05)
            handles.append(checkpoint.save(plane, tmp_path, max_to_keep=None))
        for h in handles:
            h.wait()
    finally:
        stop.set()
        thread.join()
    totals = []
    for h in handles:
        restored = ExperienceDataPlane.restore(tmp_path, step=h.step, mesh=default_mesh(1))
        view = item_view(restored)
        offset = restored.config.layout.slots[restored.spec.names.index("g")].offset
        stored_g = view["rows"][:, offset].view(np.int32)
        assert np.array_equal(stored_g, np.arange(max(0, view["total"] - 256), view["total"]))
        totals.append(view["total"])
    assert totals == sorted(totals)


KILL_CHILD = textwrap.dedent("""
    import json, sys, time
    import jax, jax.numpy as jnp, numpy as np
    from conduit_jax import ExperienceDataPlane, checkpoint, default_mesh, samplers
    directory, expected = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)
    plane = ExperienceDataPlane({"obs": jax.ShapeDtypeStruct((256,), jnp.float32)}, 1 << 16, samplers.uniform(8),
                                mesh=default_mesh(1))
    plane.ingest({"obs": rng.standard_normal((1 << 16, 256), np.float32)})
    assert plane.engine.staging.count > 0  # acknowledged items still staged on the host: the save writes them first
    checkpoint.save(plane, directory, block=True)
    crcs = {name: checkpoint._crc32(np.asarray(leaf))
            for name, leaf in checkpoint.named_leaves(jax.device_get(plane.state)).items()}
    with open(expected, "w") as f:
        json.dump(crcs, f)
    plane.ingest({"obs": rng.standard_normal((1 << 15, 256), np.float32)})
    print("SAVING", flush=True)
    checkpoint.save(plane, directory, compress=True)  # zstd: slow enough to be caught mid-write
    time.sleep(120)
""")


def test_a_save_killed_mid_write_leaves_the_previous_step_restorable(tmp_path):
    directory, expected = tmp_path / "ckpt", tmp_path / "expected.json"
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(directory), str(expected)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert child.stdout.readline().strip() == "SAVING"
        deadline, caught = time.monotonic() + 60, False
        while time.monotonic() < deadline and child.poll() is None:
            if any(name.startswith("1.orbax-checkpoint-tmp") for name in os.listdir(directory)):
                os.kill(child.pid, signal.SIGKILL)
                caught = True
                break
            time.sleep(0.001)
        assert caught, "the child's second save was not caught in progress"
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL
        assert checkpoint.all_steps(directory) == [0]  # the interrupted step 1 is not a checkpoint
        timings = {}
        restored = ExperienceDataPlane.restore(directory, mesh=default_mesh(1), timings=timings)
        crcs = {name: checkpoint._crc32(np.asarray(leaf))
                for name, leaf in checkpoint.named_leaves(jax.device_get(restored.state)).items()}
        assert crcs == json.loads(expected.read_text())
        assert timings["total"] >= timings["read"] > 0
        del restored
        small = make("uniform", default_mesh(1))
        small.ingest(batch(0, 16))
        assert checkpoint.save(small, directory, block=True).step == 1  # the next save cleans the leftovers
        assert not [n for n in os.listdir(directory) if "tmp" in n]
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
        child.stdout.close()
        shutil.rmtree(directory, ignore_errors=True)


# -- refusals ----------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    plane = make("prioritized", default_mesh(1))
    feed(plane, "prioritized")
    directory = tmp_path_factory.mktemp("saved")
    checkpoint.save(plane, directory, block=True)
    return plane, directory


@pytest.fixture
def saved(saved_once, tmp_path):
    """A prioritized plane on one device and a private copy of its checkpoint (step 0), free to damage."""
    plane, directory = saved_once
    shutil.copytree(directory, tmp_path / "copy")
    return plane, tmp_path / "copy"


def _array_files(directory):
    files = []
    for root, _, names in os.walk(os.path.join(directory, "0", "arrays")):
        files += [os.path.join(root, n) for n in names if os.path.basename(root) == "d"]
    return sorted(files, key=os.path.getsize)


def test_missing_checkpoints_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such directory"):
        ExperienceDataPlane.restore(tmp_path / "nowhere")
    (tmp_path / "a-file").write_text("not a checkpoint")
    plane = ExperienceDataPlane(SPEC, 16, samplers.uniform(8), mesh=default_mesh(1))
    for call in (lambda: plane.save(tmp_path / "a-file", block=True),
                 lambda: ExperienceDataPlane.restore(tmp_path / "a-file")):
        with pytest.raises(CheckpointError, match="a-file is a file, not a directory"):
            call()
    assert (tmp_path / "a-file").read_text() == "not a checkpoint"
    with pytest.raises(CheckpointError, match="no finished checkpoint"):
        ExperienceDataPlane.restore(tmp_path)
    (tmp_path / "3.orbax-checkpoint-tmp-123").mkdir()
    with pytest.raises(CheckpointError, match=r"unfinished saves of steps \[3\]"):
        ExperienceDataPlane.restore(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no arrays"])
def test_corrupted_or_partial_arrays_are_refused(saved, damage):
    _, directory = saved
    target = _array_files(directory)[-1]  # the largest data file: it holds the storage rows
    size = os.path.getsize(target)
    if damage == "no arrays":
        shutil.rmtree(os.path.join(directory, "0", "arrays"))
    elif damage == "truncate":
        os.truncate(target, size // 2)
    elif damage == "flip":
        with open(target, "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.remove(target)
    with pytest.raises(CheckpointError, match="partial or corrupted|corrupted"):
        ExperienceDataPlane.restore(directory, mesh=default_mesh(1))
    gc.collect()  # let orbax's abandoned reads go now (see pytestmark)


def test_corrupted_or_foreign_metadata_is_refused(saved):
    _, directory = saved
    meta_file = os.path.join(directory, "0", "meta", "metadata")
    with open(meta_file) as f:
        original = f.read()
    meta = json.loads(original)
    with open(meta_file, "w") as f:
        f.write(original[: len(original) // 2])
    with pytest.raises(CheckpointError, match="metadata of step 0 cannot be read"):
        ExperienceDataPlane.restore(directory, mesh=default_mesh(1))
    for change, message in ((("format_version", 99), "format version 99"),
                            (("format", "something else"), "not a Conduit-JAX plane checkpoint")):
        with open(meta_file, "w") as f:
            json.dump({**meta, change[0]: change[1]}, f)
        with pytest.raises(CheckpointError, match=message):
            ExperienceDataPlane.restore(directory, mesh=default_mesh(1))
    # the metadata is covered by its own checksum: a leaf's dtype or name edited, a count changed, is refused
    leaf = meta["spec"]["leaves"][0]
    other = "float32" if leaf["dtype"] == "int32" else "int32"  # same size: the bytes would be reinterpreted
    edits = [{**meta, "spec": {**meta["spec"], "leaves": [{**leaf, "dtype": other}, *meta["spec"]["leaves"][1:]]}},
             {**meta, "spec": {**meta["spec"], "leaves": [{**leaf, "name": "renamed"}, *meta["spec"]["leaves"][1:]]}},
             {**meta, "row_words": 3}, {**meta, "meta_crc32": meta["meta_crc32"] + 1}]
    edits.append({key: value for key, value in meta.items() if key != "meta_crc32"})
    for edited in edits:
        with open(meta_file, "w") as f:
            json.dump(edited, f)
        with pytest.raises(CheckpointError, match="metadata of step 0 does not match its recorded checksum"):
            ExperienceDataPlane.restore(directory, mesh=default_mesh(1))

    def signed(changed):  # past the checksum (as if saved so): the checks behind it still hold
        return {**changed, "meta_crc32": checkpoint.metadata_checksum(changed)}

    bad_crc = {**meta, "arrays": {**meta["arrays"], "storage.cursor": {**meta["arrays"]["storage.cursor"],
                                                                      "crc32": 1}}}
    for changed, message in (({**meta, "row_words": 3}, "rows have 3 words"),
                             (bad_crc, r"\['storage.cursor'\] of step 0 do not match their recorded digests"),
                             ({**meta, "schedule": {"name": "overlap", "depth": -5, "defer": 0}},
                              "recorded schedule .* cannot be rebuilt .*depth must be an int >= 1, got -5")):
        with open(meta_file, "w") as f:
            json.dump(signed(changed), f)
        with pytest.raises(CheckpointError, match=message):
            ExperienceDataPlane.restore(directory, mesh=default_mesh(1))


def test_mismatching_expectations_are_refused_with_what_differs(saved):
    plane, directory = saved
    mesh = default_mesh(1)
    other_spec = {**SPEC, "g": jax.ShapeDtypeStruct((2,), jnp.int32)}
    with pytest.raises(CheckpointError, match=r"spec .* not the given .*g: int32\[2\]"):
        ExperienceDataPlane.restore(directory, mesh=mesh, spec=other_spec)
    with pytest.raises(CheckpointError, match="capacity 128, not the given 256"):
        ExperienceDataPlane.restore(directory, mesh=mesh, capacity=256)
    with pytest.raises(CheckpointError, match=r"sampler prioritized\(.*alpha=0.7.*\), not the given prioritized\("
                                              r".*alpha=0.6"):
        ExperienceDataPlane.restore(directory, mesh=mesh, sampler=samplers.prioritized(16, alpha=0.6, beta=0.5,
                                                                              max_times_sampled=4))
    with pytest.raises(CheckpointError, match="limiter min_size"):
        ExperienceDataPlane.restore(directory, mesh=mesh, limiter=limits.min_size(5))
    ok = ExperienceDataPlane.restore(directory, mesh=mesh, spec=SPEC, capacity=CAPACITY, sampler=sampler_of("prioritized"),
                            limiter=limits.min_size(1))
    assert_same_state(plane.state, ok.state)
    for error in (CheckpointError, ConduitError, ValueError):
        assert issubclass(CheckpointError, error)


def test_a_beta_schedule_needs_the_sampler_passed_explicitly(tmp_path):
    def schedule(step):
        return jnp.minimum(1.0, 0.4 + step * 1e-3)

    plane = ExperienceDataPlane(SPEC, CAPACITY, samplers.prioritized(16, beta=schedule), mesh=default_mesh(1))
    plane.ingest(batch(0, 40))
    plane.sample()
    checkpoint.save(plane, tmp_path, block=True)
    with pytest.raises(CheckpointError, match="beta schedule"):
        ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(1))
    restored = ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(1), sampler=samplers.prioritized(16, beta=schedule))
    assert_same_delivery(plane.sample(), restored.sample())


def test_the_whole_configuration_comes_back(tmp_path):
    """Spec with tuple / list / nested dict nodes and bfloat16 leaves, staleness, a ratio limiter and cast."""
    spec = ExperienceSpec.from_structs({
        "pair": (jax.ShapeDtypeStruct((2,), jnp.bfloat16), [jax.ShapeDtypeStruct((), jnp.uint8),
                                                           jax.ShapeDtypeStruct((3,), jnp.int16)]),
        "policy_version": jax.ShapeDtypeStruct((), jnp.int32),
    })
    limiter = limits.sample_to_insert_ratio(2.0, min_size=8, error_buffer=20.0)
    plane = ExperienceDataPlane(spec, 64, samplers.uniform(8), limiter=limiter, staleness=limits.Staleness(2),
                                mesh=default_mesh(1), cast=True)
    items = {"pair": (np.ones((16, 2), jnp.bfloat16), [np.arange(16, dtype=np.uint8), np.ones((16, 3), np.int16)]),
             "policy_version": np.arange(16, dtype=np.int64)}
    plane.ingest(items)
    plane.set_policy_version(3)
    plane.sample()
    checkpoint.save(plane, tmp_path, block=True)
    meta = checkpoint.metadata(tmp_path)
    assert meta["spec"]["leaves"][0] == {"name": "pair/[0]", "shape": [2], "dtype": "bfloat16"}
    restored = ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(1))
    assert restored.spec == plane.spec and restored.cast
    assert restored.limiter.name == limiter.name and restored.config.staleness == limits.Staleness(2)
    assert_same_state(plane.state, restored.state)
    assert_same_delivery(plane.sample(), restored.sample())


def test_prefetched_batches_outside_the_state_are_reported_and_the_schedule_comes_back(tmp_path):
    from conduit_jax import schedule

    # a queue's prefetched batches have left the queue: a checkpoint taken under them cannot hold them
    plane = ExperienceDataPlane(SPEC, CAPACITY, samplers.fifo(16), schedule=schedule.overlap(2),
                                mesh=default_mesh(1))
    plane.ingest(batch(0, 40))
    plane.deliver()  # leaves batches in flight: drawn from the sampler, held on the host
    with pytest.warns(ConduitWarning, match="prefetched batches"):
        checkpoint.save(plane, tmp_path, block=True)
    restored = ExperienceDataPlane.restore(tmp_path, mesh=default_mesh(1))
    assert restored.schedule == plane.schedule


def test_metadata_is_plain_json_and_nothing_is_pickled(saved):
    _, directory = saved
    with open(checkpoint.__file__) as f:
        source = f.read()
    for module in ("pickle", "cloudpickle", "dill", "msgpack"):
        assert f"import {module}" not in source
    with open(os.path.join(directory, "0", "meta", "metadata")) as f:
        meta = json.load(f)
    assert meta["format"] == "conduit-jax-plane" and meta["sampler"]["name"] == "prioritized"


def test_plane_save_applies_deferred_updates_and_refuses_in_flight_queue_batches(tmp_path):
    """The plane's own save(): queued (deferred) priority updates land in the checkpoint; a FIFO with prefetched
    batches in flight is refused rather than losing them."""
    import conduit_jax as cj

    spec = cj.ExperienceSpec.from_example({"x": np.int32(0)})
    plane = cj.ExperienceDataPlane(spec, 32, cj.samplers.prioritized(4), schedule=cj.schedule.deferred(3),
                                   mesh=cj.default_mesh(1))
    plane.ingest({"x": np.arange(16, dtype=np.int32)})
    delivery = plane.deliver()
    plane.update_priorities(delivery.ids, np.full(4, 100.0, np.float32))
    assert plane.host_side()["deferred_updates"] == 4
    plane.save(tmp_path / "per", block=True)
    assert plane.host_side()["deferred_updates"] == 0
    restored = cj.ExperienceDataPlane.restore(tmp_path / "per", mesh=cj.default_mesh(1))
    assert float(restored.state.sampler.max_priority) == 100.0

    queue = cj.ExperienceDataPlane(spec, 32, cj.samplers.fifo(4), schedule=cj.schedule.overlap(2),
                                   mesh=cj.default_mesh(1))
    queue.ingest({"x": np.arange(16, dtype=np.int32)})
    queue.deliver()
    with pytest.raises(cj.ConfigError, match="in flight"):
        queue.save(tmp_path / "fifo")


def test_a_checkpoint_without_the_smallest_mass_tree_restores_it_from_the_leaves(tmp_path, monkeypatch):
    """A buffer-normalised prioritized plane saved before its sampler kept the smallest-mass tree (simulated: the
    save leaves the tree's leaves out, arrays and signed metadata alike) restores with the tree rebuilt from the sum
    tree's leaves: the whole state bit for bit, and the same weights."""
    from conduit_jax import ExperienceDataPlane as Plane
    from conduit_jax import samplers as sampler_lib

    spec = {"g": jax.ShapeDtypeStruct((), np.int32)}
    plane = Plane(spec, 64, sampler_lib.prioritized(8, alpha=0.7, normalise="buffer"), mesh=default_mesh(1))
    plane.ingest({"g": np.arange(80, dtype=np.int32)})
    delivery = plane.sample()
    plane.update_priorities(delivery.ids, np.linspace(0.01, 9.0, 8, dtype=np.float32))
    named = checkpoint.named_leaves
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "named_leaves", lambda tree: {name: leaf for name, leaf in named(tree).items()
                                                                if not name.startswith("sampler.smallest.")})
        plane.save(str(tmp_path / "ck"), block=True)
    saved = json.loads((tmp_path / "ck" / "0" / "meta" / "metadata").read_text())["arrays"]
    assert "sampler.levels.0" in saved and not [name for name in saved if name.startswith("sampler.smallest.")]
    restored = Plane.restore(str(tmp_path / "ck"), mesh=default_mesh(1))
    for a, b in zip(jax.tree_util.tree_leaves(plane.engine.state), jax.tree_util.tree_leaves(restored.engine.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(plane.sample().weights), np.asarray(restored.sample().weights))
