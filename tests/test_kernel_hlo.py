"""The compiled kernels never copy a whole ring or a whole sum-tree level.

On XLA:CPU a full copy of donated state is the silent performance bug: a conditional around the ring write, an
unchanged buffer returned from a jit, a level read again after it was updated, or two runs over the sum tree in one
kernel each made XLA copy megabytes per call while every result stayed correct. These tests read the optimized HLO
of each kernel the shell dispatches, for every sampler.
"""

import re

import jax
import numpy as np
import pytest

from conduit_jax import ExperienceDataPlane, default_mesh, samplers
from conduit_jax.engine import memory_moves
from conduit_jax.placement import with_part_in

CAPACITY = 1 << 14
SPEC = {"obs": jax.ShapeDtypeStruct((6,), np.float32), "terminated": jax.ShapeDtypeStruct((), np.bool_),
        "truncated": jax.ShapeDtypeStruct((), np.bool_)}
SAMPLERS = {
    "uniform": lambda: samplers.uniform(32),
    "fifo": lambda: samplers.fifo(32),
    "epochs": lambda: samplers.epochs(32),
    "prioritized": lambda: samplers.prioritized(32, max_times_sampled=3),
    "prioritized_buffer": lambda: samplers.prioritized(32, normalise="buffer"),  # keeps the smallest-mass tree
    "sequences": lambda: samplers.sequences(8, 4, streams=8),
    "sequences_pad": lambda: samplers.sequences(8, 4, streams=8, pad=True),
    "sequences_prioritized": lambda: samplers.sequences(8, 4, streams=8, alpha=0.6),
}


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, 6)).astype(np.float32), "terminated": rng.random(n) < 0.05,
            "truncated": np.zeros(n, bool)}


def large_copies(hlo: str) -> list[str]:
    """``copy`` instructions whose result holds at least CAPACITY elements."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= (\w+)\[([\d,]*)\]\S* copy\(", line)
        if match and match.group(2) and np.prod([int(d) for d in match.group(2).split(",")]) >= CAPACITY:
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("sampler", [pytest.param(name, marks=pytest.mark.slow) if name == "sequences_prioritized"
                                     else name for name in SAMPLERS])
def test_no_kernel_copies_the_ring_or_a_tree_level(sampler):
    plane = ExperienceDataPlane(SPEC, CAPACITY, SAMPLERS[sampler](), mesh=default_mesh(1))
    plane.ingest(batch(1000))
    engine = plane.engine
    block = plane.config.layout.pack_host(jax.tree_util.tree_leaves(batch(1000, 1)), 0, 1000, 1024)
    lowered = {"ingest": engine.lowered("ingest", 1024, block, np.int32(1000)),
               "sample": engine.lowered("sample"),
               # staged rows written by the draw's kernel: the ring is written, then gathered from, in place
               "ingest+sample": engine.lowered("ingest+sample", 1024, block, np.int32(1000))}
    if plane.sampler.update is not None:
        update = np.zeros((32, 4), np.int32)  # 32 packed updates (id row, generation, priority bits, valid)
        lowered["update"] = engine.lowered("update", update)
        lowered["update+sample"] = engine.lowered("update+sample", update)
    for name, kernel in lowered.items():
        assert large_copies(kernel.compile().as_text()) == [], name


@pytest.mark.parametrize("sampler", ["uniform", "sequences"])
def test_byte_ring_kernels_do_not_copy_the_ring(sampler):
    """A layout of frames keeps a uint8 ring that ingest writes row by row (storage.write): the loop updates the
    donated ring in place."""
    spec = {"frame": jax.ShapeDtypeStruct((32, 36), np.uint8), "terminated": jax.ShapeDtypeStruct((), np.bool_),
            "truncated": jax.ShapeDtypeStruct((), np.bool_)}
    plane = ExperienceDataPlane(spec, CAPACITY, SAMPLERS[sampler](), mesh=default_mesh(1))
    layout = plane.config.layout
    assert layout.ring_dtype == np.uint8 and layout.row_bytes >= 1024
    rng = np.random.default_rng(0)
    frames = {"frame": rng.integers(0, 256, (64, 32, 36)).astype(np.uint8), "terminated": np.zeros(64, bool),
              "truncated": np.zeros(64, bool)}
    plane.ingest(frames)
    engine = plane.engine
    block = layout.to_ring(layout.pack_host(jax.tree_util.tree_leaves(frames), 0, 64, 64))
    lowered = {"ingest": engine.lowered("ingest", 64, block, np.int32(64)),
               "sample": engine.lowered("sample"),
               "ingest+sample": engine.lowered("ingest+sample", 64, block, np.int32(64))}
    for name, kernel in lowered.items():
        assert large_copies(kernel.compile().as_text()) == [], name


@pytest.mark.parametrize("sampler", ["prioritized", "sequences_prioritized"])
def test_updates_and_staged_rows_go_in_one_kernel_that_copies_no_level(sampler):
    """An ingest-sample-update loop: an update given before rows were staged is applied by the kernel that writes
    them, in one pass over the sum tree (two passes in one kernel made XLA:CPU copy every level twice); so is an
    update given after the rows (``pend(after_staged=True)``). Neither kernel copies a level."""
    plane = ExperienceDataPlane(SPEC, CAPACITY, SAMPLERS[sampler](), mesh=default_mesh(1))
    plane.ingest(batch(1000))
    for step in range(3):
        delivery = plane.sample()
        plane.update_priorities(delivery.ids, np.ones(delivery.ids.shape[0], np.float32))
        plane.ingest(batch(8, step))
    names = list(plane.compile_counts())
    assert [name for name in names if name.startswith("update[") and "+ingest[" in name], names
    assert not [name for name in names if name.startswith("update[") and "ingest" not in name], names
    engine, updates = plane.engine, np.zeros((32, 4), np.int32)
    block = plane.config.layout.pack_host(jax.tree_util.tree_leaves(batch(8, 9)), 0, 8, 8)
    for kernel, args in (("update+ingest", (updates, 8, block, 8)), ("ingest+update", (8, block, 8, updates))):
        assert large_copies(engine.lowered(kernel, *args).compile().as_text()) == [], kernel


def test_the_check_finds_a_full_copy():
    # the same check on a kernel known to copy: returning an unchanged, undonated buffer
    ring = jax.numpy.zeros((CAPACITY, 4), np.uint32)
    hlo = jax.jit(lambda r: (r, r[0])).lower(ring).compile().as_text()
    assert large_copies(hlo) != []


@pytest.mark.parametrize("sampler", ["prioritized", "sequences", "sequences_prioritized"])
def test_retiring_stale_items_does_not_copy_a_tree_level(sampler):
    """set_policy_version under a staleness bound rebuilds the priority tree from its leaves in one pass per level
    (refreshing every leaf's ancestors one by one took ~63 ms at 1M slots)."""
    from conduit_jax.limits import Staleness

    spec = dict(SPEC, version=jax.ShapeDtypeStruct((), np.int32))
    plane = ExperienceDataPlane(spec, CAPACITY, SAMPLERS[sampler](), staleness=Staleness(1, "version"),
                                mesh=default_mesh(1))
    plane.ingest(dict(batch(1000), version=np.zeros(1000, np.int32)))
    kernel = plane.engine.lowered("version", np.int32(3))
    assert large_copies(kernel.compile().as_text()) == []


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_kernels_take_the_state_counters_as_one_vector(sampler):
    """Every array through a jit boundary costs dispatch time, so the kernels take the state's scalars (cursor, key,
    counters, balances) bundled into one vector (_pytree.LeafBundle): the sample kernel's parameters are the large
    leaves and that vector."""
    plane = ExperienceDataPlane(SPEC, CAPACITY, SAMPLERS[sampler](), mesh=default_mesh(1))
    plane.ingest(batch(1000))
    leaves = jax.tree_util.tree_leaves(plane.state)
    bundle = plane.engine.bundle
    assert all(small for leaf, small in zip(leaves, bundle.is_small) if leaf.size == 1)
    large = sum(not small for small in bundle.is_small)
    hlo = plane.engine.lowered("sample").compile().as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    signature = entry[:entry.index("->")]
    assert signature.count(": ") == large + 1, signature[:300]


# ------------------------------------------------------------------------------------------------------------------
# A ring in host memory is read and written where it lives: only batches cross (issue 24)
# ------------------------------------------------------------------------------------------------------------------
# XLA:CPU lowers a memory-kind move to nothing (every kind is one DRAM), so the optimized HLO here cannot show one.
# The kernels are lowered for CUDA instead and read with ``engine.memory_moves``.
def batch_bytes(config) -> int:
    """Bytes of one delivered batch's data."""
    sampler = config.sampler
    return sampler.batch_size * sampler.window * sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
                                                     for s in jax.tree_util.tree_leaves(config.layout.spec.structs))


@pytest.mark.parametrize("sampler", ["uniform", "prioritized", "sequences"])
def test_a_host_ring_is_read_in_place(sampler):
    plane = ExperienceDataPlane(SPEC, CAPACITY, SAMPLERS[sampler](), mesh=default_mesh(1))
    plane.place(with_part_in(plane.shardings, "storage", "pinned_host"))  # the hot/cold split
    ring = plane.state.storage.rows
    assert ring.sharding.memory_kind == "pinned_host"
    engine = plane.engine
    block = plane.config.layout.pack_host(jax.tree_util.tree_leaves(batch(64, 1)), 0, 64, 64)
    kernels = {"sample": engine.lowered("sample", platform="cuda"),
               "ingest": engine.lowered("ingest", 64, block, np.int32(64), platform="cuda")}
    if plane.sampler.update is not None:
        update = np.zeros((32, 4), np.int32)
        kernels["update+sample"] = engine.lowered("update+sample", update, platform="cuda")
        kernels["update"] = engine.lowered("update", update, platform="cuda")
    for name, lowered in kernels.items():
        moved = memory_moves(lowered.as_text())
        assert all(size < ring.nbytes // 8 for _, size in moved), (name, moved)
        to_device = sum(size for kind, size in moved if kind == "device")
        to_host = sum(size for kind, size in moved if kind == "pinned_host")
        if name == "ingest":  # the block crosses to the host (and samplers that index the new items' flags read
            # those back from the ring: a few bytes per item)
            assert block.nbytes <= to_host + to_device <= 2 * block.nbytes, (to_device, to_host, block.nbytes)
        elif "sample" in name:  # the batch crosses to the device, at most 10% more than its own bytes
            assert 0 < to_device <= 1.1 * batch_bytes(plane.config) and to_host <= 1024, (to_device, to_host)
        else:
            assert to_device == 0, moved


def test_the_in_jit_sample_reads_a_host_ring_in_place():
    """The functional API's sample inside a learner's jit, over the whole state in pinned_host memory: the ring
    stays; the counters (a few bytes) cross, and the batch."""
    from conduit_jax import functional

    buffer = functional.make_buffer(SPEC, CAPACITY, samplers.uniform(32), mesh=default_mesh(1))
    pinned = jax.tree_util.tree_map(lambda s: s.with_memory_kind("pinned_host"), buffer.shardings)
    buffer = functional.bind(buffer.config, pinned)
    step = jax.jit(buffer.sample, donate_argnums=0)
    new_state, delivery = step(buffer.init(0))  # compiles and runs (an empty buffer: delivery.valid is False)
    assert not bool(delivery.valid) and new_state.storage.rows.sharding.memory_kind == "pinned_host"
    moved = memory_moves(step.trace(new_state).lower(lowering_platforms=("cuda",)).as_text())
    assert max(size for _, size in moved) < new_state.storage.rows.nbytes // 8, moved
    assert sum(size for kind, size in moved if kind == "device") <= 1.1 * batch_bytes(buffer.config) + 256, moved


def test_the_check_finds_a_moved_ring():
    # the same reading on a kernel known to move the ring: a pinned_host array put in device memory inside jit
    ring = jax.device_put(jax.numpy.zeros((CAPACITY, 4), np.uint32),
                          jax.sharding.NamedSharding(default_mesh(1), jax.sharding.PartitionSpec(),
                                                     memory_kind="pinned_host"))
    moved_whole = jax.jit(lambda r: jax.device_put(r, jax.memory.Space.Device)[:8])
    lowered = moved_whole.trace(ring).lower(lowering_platforms=("cuda",))
    assert ("device", ring.nbytes) in memory_moves(lowered.as_text())
