"""Sum tree: descents against a flat NumPy cumsum search, zero-mass leaves never returned (overshooting and negative
targets included), every internal node the float32 sum of its current children, and a float32 soak of 10^6 updates
spanning 40 orders of magnitude after which no draw lands on an empty or zero-priority slot."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from conduit_jax import sumtree

# leaf counts that are not powers of the arity (plus the edge cases 1 and a power itself)
SIZES_16 = [1, 5, 16, 17, 257, 1000, 4097]

set_leaves = jax.jit(sumtree.set_leaves, static_argnames="arity")
descend = jax.jit(sumtree.descend, static_argnames="arity")


def build(values, arity, rng=None):
    """A tree whose leaves are ``values``, written through ``set_leaves`` in three shuffled batches of unique slots
    (padded to one shape, the padding marked invalid)."""
    n = len(values)
    levels = sumtree.init(n, arity=arity)
    order = np.arange(n) if rng is None else rng.permutation(n)
    batch = -(-n // 3)
    for start in range(0, n, batch):
        slots = np.zeros(batch, np.int32)
        part = order[start:start + batch]
        slots[:len(part)] = part
        levels = set_leaves(levels, jnp.asarray(slots), jnp.asarray(values[slots], jnp.float32),
                            jnp.arange(batch) < len(part), arity=arity)
    return levels


def reference_descend(leaves, targets):
    """The flat reference: the first leaf whose cumulative mass exceeds the target (it always has positive mass);
    targets at or above the total give the last positive leaf, negative targets the first positive leaf."""
    cum = np.cumsum(leaves.astype(np.float64))
    positive = np.flatnonzero(leaves > 0)
    out = np.searchsorted(cum, np.maximum(targets.astype(np.float64), 0.0), side="right")
    return np.where(out >= len(leaves), positive[-1], out)


def check_nodes_are_sums_of_children(levels, arity):
    """Every internal node equals the float32 sum of its *current* children: within the rounding of one K-term float32
    sum (any summation order), never an accumulated history of deltas; and positive exactly when a child is."""
    levels = [np.asarray(level, np.float64) for level in jax.device_get(levels)]
    for depth, (parent, children) in enumerate(zip(levels[:-1], levels[1:])):
        blocks = children.reshape(-1, arity)
        exact = blocks.sum(axis=1)
        bound = (arity - 1) * np.finfo(np.float32).eps * exact + np.finfo(np.float32).tiny
        worst = int(np.argmax(np.abs(parent - exact) - bound))
        assert (np.abs(parent - exact) <= bound).all(), \
            f"level {depth} node {worst}: {parent[worst]} vs children sum {exact[worst]}"
        np.testing.assert_array_equal(parent > 0, (blocks > 0).any(axis=1), err_msg=f"level {depth}")


# -- shapes ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, arity, depth", [(1, 16, 1), (2, 16, 1), (16, 16, 1), (17, 16, 2), (256, 16, 2),
                                             (257, 16, 3), (4096, 16, 3), (4097, 16, 4), (10**6, 16, 5),
                                             (5, 2, 3), (8, 2, 3), (9, 4, 2)])
def test_depth_and_level_shapes(n, arity, depth):
    assert sumtree.depth(n, arity) == depth
    assert arity**depth >= n and (depth == 1 or arity ** (depth - 1) < n)
    levels = sumtree.init(n, num_shards=3, arity=arity)
    assert [level.shape for level in levels] == [(3 * arity**level,) for level in range(depth + 1)]
    assert all(level.dtype == jnp.float32 and not level.any() for level in levels)


# -- descent vs the flat reference ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arity, n", [(16, n) for n in SIZES_16] + [(4, 7), (4, 70), (2, 13)])
def test_descend_matches_flat_cumsum_search(arity, n):
    """Integer masses keep every partial sum exact in float32, so the tree descent must agree with the flat search
    exactly, boundaries included (a target equal to a cumulative sum belongs to the next positive leaf)."""
    rng = np.random.default_rng(n * 31 + arity)
    leaves = rng.integers(1, 100, n).astype(np.float32)
    leaves[rng.random(n) < 0.35] = 0.0  # zero-mass leaves, runs of them included
    leaves[rng.integers(0, n)] = 7.0  # at least one positive leaf
    levels = build(leaves, arity, rng=rng)
    total = float(leaves.sum())
    assert float(sumtree.total(levels)) == total
    cum = np.cumsum(leaves)
    targets = np.concatenate([
        rng.random(2000) * total,  # uniform draws
        cum[:-1], cum[:-1] - 0.5, [0.0, -0.0],  # every boundary, and just below it
        [total, np.nextafter(np.float32(total), np.float32(np.inf)), total * 1.5, np.inf],  # overshoot
        [-1e-7, -1.0, -np.inf],  # negative remainders
    ]).astype(np.float32)
    slot, mass = descend(levels, jnp.asarray(targets), arity=arity)
    slot, mass = np.asarray(slot), np.asarray(mass)
    np.testing.assert_array_equal(slot, reference_descend(leaves, targets))
    np.testing.assert_array_equal(mass, leaves[slot])
    assert (mass > 0).all()


@pytest.mark.parametrize("positive_slots", [[0], [4096], [4096 + 17], [0, 4999], [1234, 1235], [15, 16, 255, 256]])
def test_isolated_positive_leaves_are_the_only_ones_returned(positive_slots):
    """A sparse tree (5000 leaves of a 16**4 tree) with mass only at a few slots, of wildly different sizes: every
    target, overshooting and negative ones included, lands on one of them."""
    n = 5000
    leaves = np.zeros(n, np.float32)
    leaves[positive_slots] = 10.0 ** (-30.0 + 12.0 * np.arange(len(positive_slots)))  # 1e-30 .. 1e6
    levels = build(leaves, 16)
    total = np.float32(sumtree.total(levels))
    rng = np.random.default_rng(len(positive_slots))
    targets = np.concatenate([rng.random(1000) * total, [total, total * 2, np.inf, -1.0, -np.inf, 0.0]]).astype(
        np.float32)
    slot, mass = descend(levels, jnp.asarray(targets))
    assert set(np.asarray(slot).tolist()) <= set(positive_slots)
    assert (np.asarray(mass) > 0).all()


def stacked_pick(block, target):
    """``pick`` as float32 NumPy, the formulation it replaced: running sums stacked, the child counted at once, the
    remainder from ``cum[child] - mass``."""
    cum = np.cumsum(block, axis=-1, dtype=np.float32)  # sequential: child_sums' order
    total = cum[..., -1]
    target = np.clip(target, np.float32(0), np.nextafter(total, np.float32(0))).astype(np.float32)
    child = np.minimum((cum <= target[..., None]).sum(axis=-1), block.shape[-1] - 1)
    mass = np.take_along_axis(block, child[..., None], axis=-1)[..., 0]
    before = np.take_along_axis(cum, child[..., None], axis=-1)[..., 0] - mass
    return child, np.clip(target - before, np.float32(0), mass), mass


def test_pick_is_bit_identical_to_the_stacked_formulation():
    """Blocks with zeros, empty blocks, masses over 60 orders of magnitude; targets inside, at and past the total,
    negative and infinite: the chain of selects gives the same child, remainder and mass, bit for bit."""
    rng = np.random.default_rng(7)
    n = 20000
    block = (rng.random((n, 16)) * 10.0 ** rng.integers(-30, 30, (n, 16))).astype(np.float32)
    block[rng.random((n, 16)) < 0.4] = 0
    block[:100] = 0
    total = np.cumsum(block, axis=-1, dtype=np.float32)[:, -1]
    target = (total * rng.uniform(-0.1, 1.1, n)).astype(np.float32)
    target[:300:3] = total[:300:3]
    target[1:300:3] = np.inf
    target[2:300:3] = -np.inf
    got = jax.jit(sumtree.pick)(jnp.asarray(block), jnp.asarray(target))
    for name, g, want in zip(("child", "remainder", "mass"), got, stacked_pick(block, target)):
        np.testing.assert_array_equal(np.asarray(g), want, err_msg=name)


def test_descend_keeps_target_shape():
    levels = build(np.arange(1, 21, dtype=np.float32), 16)
    slot, mass = descend(levels, jnp.asarray([[0.5, 1.5, 3.5], [209.9, 210.0, -3.0]], jnp.float32))
    np.testing.assert_array_equal(slot, [[0, 1, 2], [19, 19, 0]])
    np.testing.assert_array_equal(mass, [[1, 2, 3], [20, 20, 1]])


# -- set_leaves -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arity, n", [(16, 1000), (16, 17), (4, 70)])
def test_nodes_equal_float32_sum_of_children_after_random_updates(arity, n):
    rng = np.random.default_rng(n)
    levels = sumtree.init(n, arity=arity)
    expected = np.zeros(n, np.float32)
    m = 2 * n  # one shape for every call: duplicates are certain
    for step in range(40):
        slots = rng.integers(0, n, m).astype(np.int32)
        values = (10.0 ** rng.uniform(-20, 20, m)).astype(np.float32)
        values[rng.random(m) < 0.2] = 0.0
        valid = rng.random(m) < 0.8
        levels = set_leaves(levels, jnp.asarray(slots), jnp.asarray(values), jnp.asarray(valid), arity=arity)
        got = np.asarray(levels[-1][:n])
        written = np.zeros(n, bool)
        written[slots[valid]] = True
        matched = np.zeros(n, bool)  # conflicting duplicates: one of the slot's valid values wins
        np.logical_or.at(matched, slots, valid & (got[slots] == values))
        np.testing.assert_array_equal(matched, written, err_msg=f"step {step}")
        np.testing.assert_array_equal(got[~written], expected[~written])  # untouched leaves keep their values
        expected = got
        check_nodes_are_sums_of_children(levels, arity)
    np.testing.assert_array_equal(np.asarray(levels[-1][:n]), expected)
    assert not np.asarray(levels[-1][n:]).any()  # slots past the ring are never written


@pytest.mark.parametrize("arity, n", [(16, 1000), (16, 4097), (4, 37)])
def test_from_leaves_equals_the_tree_set_leaves_builds(arity, n):
    """A tree rebuilt from its leaf level in one pass per level is bit for bit the one that per-leaf updates build
    (both add children in child_sums' order)."""
    rng = np.random.default_rng(n)
    values = (10.0 ** rng.uniform(-10, 10, n)).astype(np.float32)
    values[rng.random(n) < 0.3] = 0.0
    built = build(values, arity, rng)
    rebuilt = jax.jit(functools.partial(sumtree.from_leaves, num_levels=len(built), arity=arity))(built[-1])
    for a, b in zip(jax.device_get(rebuilt), jax.device_get(built)):
        np.testing.assert_array_equal(a, b)


def test_duplicate_slots_take_one_of_their_values():
    levels = sumtree.init(40)
    slots = jnp.asarray([3, 3, 3, 9, 9], jnp.int32)
    values = jnp.asarray([1.0, 2.0, 4.0, 8.0, 16.0], jnp.float32)
    levels = set_leaves(levels, slots, values, jnp.ones(5, bool))
    leaves = np.asarray(levels[-1])
    assert leaves[3] in (1.0, 2.0, 4.0) and leaves[9] in (8.0, 16.0)
    check_nodes_are_sums_of_children(levels, 16)
    assert float(sumtree.total(levels)) == leaves[3] + leaves[9]


def test_invalid_entries_change_nothing():
    rng = np.random.default_rng(5)
    levels = build(rng.random(300).astype(np.float32), 16)
    before = jax.device_get(levels)
    after = set_leaves(levels, jnp.arange(64, dtype=jnp.int32), jnp.full((64,), 123.0),
                               jnp.zeros(64, bool))
    for old, new in zip(before, jax.device_get(after)):
        np.testing.assert_array_equal(old.view(np.uint32), new.view(np.uint32))


@pytest.mark.parametrize("first", [40, 4090])  # a run inside the ring, and one that wraps to slot 0
def test_writes_from_two_sources_and_one_refresh_equal_the_two_in_turn(first):
    """A run and scattered leaves written into the leaves (either order) and refreshed once give bit for bit the tree
    that set_run and set_leaves in turn give: every ancestor is the float32 sum of its children as they end up."""
    rng = np.random.default_rng(3)
    num_slots = 4096 - 3  # a ring shorter than the leaf level
    levels = build((rng.random(num_slots) * 4).astype(np.float32), 16)
    run = jnp.asarray(rng.random(9) * 7, jnp.float32), jnp.asarray(rng.random(9) < 0.8)
    slots = jnp.asarray(np.r_[rng.integers(0, num_slots, 14), first + 1, first + 1], jnp.int32)  # in the run, twice
    values, valid = jnp.asarray(rng.random(16) * 9, jnp.float32), jnp.asarray(rng.random(16) < 0.9)
    leaves, ranges = sumtree.write_run(levels[-1], jnp.int32(first), *run, num_slots)
    one = sumtree.refresh((*levels[:-1], sumtree.write_leaves(leaves, slots, values, valid)), ranges, (slots, valid))
    two = set_leaves(sumtree.set_run(levels, jnp.int32(first), *run, num_slots), slots, values, valid)
    leaves = sumtree.write_leaves(levels[-1], slots, values, valid)
    leaves, ranges = sumtree.write_run(leaves, jnp.int32(first), *run, num_slots)
    one_reversed = sumtree.refresh((*levels[:-1], leaves), ranges, (slots, valid))
    two_reversed = sumtree.set_run(set_leaves(levels, slots, values, valid), jnp.int32(first), *run, num_slots)
    for got, want in zip(one + one_reversed, two + two_reversed):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


# -- float32 soak ---------------------------------------------------------------------------------------------------
SOAK_LEAVES = 5000  # a 16**4-leaf tree; slots [5000, 65536) are empty and must never be drawn
SOAK_BATCH = 1024
# multipliers that are units mod 5000 = 2**3 * 5**4 (odd, not multiples of 5): a * i + b hits 1024 distinct slots
_UNITS = np.array([a for a in range(1, SOAK_LEAVES, 2) if a % 5], np.int32)


@jax.jit
def _soak(levels, leaves, key, steps):
    """``steps`` batches of 1024 distinct slots set to 10^U(-30, 10) (10% exact zeros, one batch in 16 all zeros);
    ``leaves`` is a plain array that receives the same writes (the reference)."""
    units = jnp.asarray(_UNITS)
    positions = lax.iota(jnp.int32, SOAK_BATCH)

    def body(i, carry):
        levels, leaves = carry
        k = jax.random.fold_in(key, i)
        k_unit, k_shift, k_value, k_zero = jax.random.split(k, 4)
        a = units[jax.random.randint(k_unit, (), 0, units.shape[0])]
        slots = (a * positions + jax.random.randint(k_shift, (), 0, SOAK_LEAVES)) % SOAK_LEAVES
        values = 10.0 ** jax.random.uniform(k_value, (SOAK_BATCH,), minval=-30.0, maxval=10.0)
        zero = (jax.random.uniform(k_zero, (SOAK_BATCH,)) < 0.1) | (i % 16 == 15)
        values = jnp.where(zero, 0.0, values).astype(jnp.float32)
        levels = sumtree.set_leaves(levels, slots, values, jnp.ones((SOAK_BATCH,), bool))
        return levels, leaves.at[slots].set(values)

    return lax.fori_loop(0, steps, body, (levels, leaves))


def _draw_checks(levels, leaves, seed, draws):
    """Uniform targets, stratified targets as the sampler makes them, and overshooting / negative ones: every draw is a
    stored slot with positive mass, and reports that mass."""
    total = np.float32(sumtree.total(levels))
    rng = np.random.default_rng(seed)
    strata = ((np.arange(draws, dtype=np.float32) + rng.random(draws, dtype=np.float32))
              * np.float32(total / draws)).astype(np.float32)
    targets = np.concatenate([rng.random(draws, dtype=np.float32) * total, strata,
                              [total, np.nextafter(total, np.inf), total * 4, -1.0, 0.0]]).astype(np.float32)
    slot, mass = descend(levels, jnp.asarray(targets))
    slot, mass = np.asarray(slot), np.asarray(mass)
    assert (slot >= 0).all() and (slot < SOAK_LEAVES).all(), "a draw landed past the valid slots"
    assert (leaves[slot] > 0).all(), "a draw landed on a zero-priority leaf"
    np.testing.assert_array_equal(mass, leaves[slot])
    return slot


def _soak_and_check(steps, seed):
    levels = sumtree.init(SOAK_LEAVES)
    leaves = jnp.zeros(levels[-1].shape, jnp.float32)
    levels, leaves = _soak(levels, leaves, jax.random.key(seed), steps)
    np.testing.assert_array_equal(np.asarray(levels[-1]), np.asarray(leaves))  # writes landed where they should
    leaves = np.asarray(leaves)
    assert (leaves == 0).sum() > SOAK_LEAVES // 20 and not leaves[SOAK_LEAVES:].any()
    check_nodes_are_sums_of_children(levels, sumtree.ARITY)
    slot = _draw_checks(levels, leaves, seed, draws=1 << 16)
    # the draws follow the masses: the heaviest leaves (10^9..10^10 range) carry most of the total and get most draws
    heavy = leaves >= np.sort(leaves)[-50]
    share = leaves[heavy].sum(dtype=np.float64) / leaves.sum(dtype=np.float64)
    assert abs(np.mean(heavy[slot]) - share) < 0.02


def test_float32_soak_million_updates_never_draws_empty_or_zero_slots():
    _soak_and_check(steps=1000, seed=0)  # 1,024,000 updates


@pytest.mark.slow
def test_float32_soak_ten_million_updates():
    _soak_and_check(steps=10_000, seed=1)


@pytest.mark.parametrize("num_slots,k", [(1000, 64), (100, 64), (37, 16), (16, 16), (5000, 1)])
def test_set_run_equals_set_leaves_on_consecutive_slots(num_slots, k):
    """The contiguous-run fast path gives the same tree as the general path, wrapping runs included."""
    rng = np.random.default_rng(num_slots + k)
    levels = sumtree.init(num_slots)
    levels = sumtree.set_leaves(levels, jnp.arange(num_slots), jnp.asarray(rng.random(num_slots), jnp.float32),
                                jnp.ones(num_slots, bool))
    run = jax.jit(functools.partial(sumtree.set_run, num_slots=num_slots))
    general = jax.jit(sumtree.set_leaves)
    for first in [0, num_slots - 1, num_slots - max(k // 2, 1), int(rng.integers(num_slots))]:
        values = jnp.asarray(rng.random(k) * (rng.random(k) > 0.3), jnp.float32)
        valid = jnp.asarray(rng.random(k) > 0.2)
        slots = (first + jnp.arange(k)) % num_slots
        fast = run(levels, jnp.int32(first), values, valid)
        slow = general(levels, slots, values, valid)
        np.testing.assert_array_equal(np.asarray(fast[-1]), np.asarray(slow[-1]))
        for a, b in zip(fast[:-1], slow[:-1]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6)
        levels = fast
