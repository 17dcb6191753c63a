"""The compiled kernels never copy a whole ring or a whole sum-tree level.

On XLA:CPU a full copy of donated state is the silent performance bug: a conditional around the ring write, an
unchanged buffer returned from a jit, or a level read again after it was updated each made XLA copy megabytes per
call while every result stayed correct. These tests read the optimized HLO of each kernel the shell dispatches.
"""

import re

import jax
import numpy as np
import pytest

from conduit_jax import ExperienceDataPlane, default_mesh, samplers
from conduit_jax.plane import _replace

CAPACITY = 1 << 14
SPEC = {"obs": jax.ShapeDtypeStruct((6,), np.float32), "done": jax.ShapeDtypeStruct((), np.bool_)}


def batch(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"obs": rng.standard_normal((n, 6)).astype(np.float32), "done": rng.random(n) < 0.1}


def large_copies(hlo: str) -> list[str]:
    """``copy`` instructions whose result holds at least CAPACITY elements."""
    found = []
    for line in hlo.splitlines():
        match = re.search(r"= (\w+)\[([\d,]*)\]\S* copy\(", line)
        if match and match.group(2) and np.prod([int(d) for d in match.group(2).split(",")]) >= CAPACITY:
            found.append(line.strip()[:160])
    return found


@pytest.fixture(scope="module")
def plane():
    plane = ExperienceDataPlane(SPEC, CAPACITY, samplers.prioritized(32), mesh=default_mesh(1))
    plane.ingest(batch(1000))
    return plane


def test_ingest_writes_in_place(plane):
    block = plane.config.layout.pack_host(jax.tree_util.tree_leaves(batch(1000, 1)), 0, 1000, 1024)
    kernel = plane._ingest_kernel(1024, True)
    assert large_copies(kernel.lower(plane.state, block, np.int32(1000)).compile().as_text()) == []


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
def test_sequence_ingest_writes_the_tree_in_place(pad):
    """A sequences ingest zeroes the new rows' window starts and marks the windows they complete: two runs over the
    tree, one after the other, made XLA copy every level on each call."""
    spec = {**SPEC, "terminated": jax.ShapeDtypeStruct((), np.bool_), "truncated": jax.ShapeDtypeStruct((), np.bool_)}
    plane = ExperienceDataPlane(spec, CAPACITY, samplers.sequences(8, 4, streams=8, pad=pad), mesh=default_mesh(1))
    rng = np.random.default_rng(0)
    items = {**batch(512), "terminated": rng.random(512) < 0.05, "truncated": np.zeros(512, bool)}
    plane.ingest(items)
    block = plane.config.layout.pack_host(jax.tree_util.tree_leaves(items), 0, 512, 512)
    hlo = plane._ingest_kernel(512, True).lower(plane.state, block, np.int32(512)).compile().as_text()
    assert large_copies(hlo) == []


def test_sample_update_and_fused_kernels_copy_nothing_large(plane):
    state = plane.state
    rest = _replace(state, storage=None)
    ids = np.zeros((32, 2), np.int32)
    prio = np.ones((32,), np.float32)
    valid = np.ones((32,), bool)
    compiled = {
        "sample": plane._sample_kernel.lower(state.storage, rest),
        "update": plane._update_kernel.lower(state.storage, rest, ids, prio, valid),
        "update+sample": plane._update_sample_kernel.lower(state.storage, rest, ids, prio, valid),
    }
    for name, lowered in compiled.items():
        assert large_copies(lowered.compile().as_text()) == [], name


def test_the_check_finds_a_full_copy():
    # the same check on a kernel known to copy: returning an unchanged, undonated buffer
    ring = jax.numpy.zeros((CAPACITY, 4), np.uint32)
    hlo = jax.jit(lambda r: (r, r[0])).lower(ring).compile().as_text()
    assert large_copies(hlo) != []
