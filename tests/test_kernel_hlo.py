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

CAPACITY = 1 << 14
SPEC = {"obs": jax.ShapeDtypeStruct((6,), np.float32), "terminated": jax.ShapeDtypeStruct((), np.bool_),
        "truncated": jax.ShapeDtypeStruct((), np.bool_)}
SAMPLERS = {
    "uniform": lambda: samplers.uniform(32),
    "fifo": lambda: samplers.fifo(32),
    "epochs": lambda: samplers.epochs(32),
    "prioritized": lambda: samplers.prioritized(32, max_times_sampled=3),
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


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_no_kernel_copies_the_ring_or_a_tree_level(sampler):
    plane = ExperienceDataPlane(SPEC, CAPACITY, SAMPLERS[sampler](), mesh=default_mesh(1))
    plane.ingest(batch(1000))
    engine = plane.engine
    block = plane.config.layout.pack_host(jax.tree_util.tree_leaves(batch(1000, 1)), 0, 1000, 1024)
    lowered = {"ingest": engine.lowered("ingest", 1024, block, np.int32(1000)),
               "sample": engine.lowered("sample")}
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
               "sample": engine.lowered("sample")}
    for name, kernel in lowered.items():
        assert large_copies(kernel.compile().as_text()) == [], name


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
