"""Prioritized replay through the plane: the marginal draw distribution is P(i) = (p_i + eps)^alpha / sum (chi-square,
1 and 8 shards, mass skewed onto one shard), batches are stratified, importance weights match a NumPy reference (fixed
beta and a schedule), new items get the largest priority seen, bad updates raise PriorityError and leave the state
bit-identical, stale ids are ignored and counted, and nothing recompiles.

Items are ``{"g": its global ingest index}``. Round-robin dealing puts item g at shard g % S, slot g // S, so its row id
is ``(g % S) * (capacity / S) + g // S`` (before the ring wraps).
"""

import jax
import numpy as np
import pytest
from scipy import stats

from conduit_jax import ConfigError, ExperienceDataPlane, NotEnoughDataError, PriorityError, samplers
from conduit_jax.replay import default_mesh

SPEC = {"g": jax.ShapeDtypeStruct((), np.int32)}
P_MIN = 1e-3  # chi-square tests reject below this p-value (fixed seeds: a pass is deterministic)


def make_plane(mesh, capacity, sampler, seed=0, front=ExperienceDataPlane):
    return front(SPEC, capacity, sampler, mesh=mesh, seed=seed)


def ingest_range(plane, start, stop):
    plane.ingest({"g": np.arange(start, stop, dtype=np.int32)})


def row_of(g, shards, capacity):
    shard_capacity = capacity // shards
    return (g % shards) * shard_capacity + (g // shards) % shard_capacity


def ids_of(g, shards, capacity, generation=1):
    g = np.asarray(g)
    return np.stack([row_of(g, shards, capacity), np.full(g.shape, generation)], axis=1).astype(np.int32)


def tree_leaves(plane):
    """The stored masses (p + eps)^alpha by global row id, read from every shard's sum tree."""
    leaves = np.asarray(jax.device_get(plane.state.sampler.levels[-1])).reshape(plane.num_shards, -1)
    return leaves[:, :plane.capacity // plane.num_shards].reshape(-1)


def per_law(priorities, alpha, eps):
    mass = np.power(np.asarray(priorities, np.float64) + eps, alpha)
    return mass / mass.sum()


def merged_chisquare(observed, expected, min_expected=5.0):
    """Chi-square of counts against expected counts, pooling the bins expected below ``min_expected`` into one."""
    observed, expected = np.asarray(observed, np.float64), np.asarray(expected, np.float64)
    small = expected < min_expected
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return stats.chisquare(observed, expected * observed.sum() / expected.sum())


def reference_weights(probability, n, beta):
    w = np.power(n * np.asarray(probability, np.float64), -beta)
    return w / w.max()


# -- the draw distribution ------------------------------------------------------------------------------------------
def test_marginal_distribution_matches_per_law_with_mass_skewed_onto_one_shard(mesh, front):
    capacity, batch, alpha, eps = 64, 64, 0.6, 0.05
    plane = make_plane(mesh, capacity, samplers.prioritized(batch, alpha=alpha, beta=0.4, eps=eps), seed=3,
                       front=front)
    shards = plane.num_shards
    ingest_range(plane, 0, capacity)
    rng = np.random.default_rng(0)
    g = np.arange(capacity)
    priority = rng.lognormal(0.0, 1.0, capacity)
    priority[g % 8 == 0] = 40 + 20 * rng.random(8)  # shard 0 of 8 holds ~60% of the mass
    priority[rng.choice(np.flatnonzero(g % 8), 6, replace=False)] = 0.0  # eps keeps them sampleable
    plane.update_priorities(ids_of(g, shards, capacity), priority)
    p_row = np.zeros(capacity)
    p_row[row_of(g, shards, capacity)] = per_law(priority, alpha, eps)
    if shards == 8:
        assert p_row[:capacity // 8].sum() > 0.5

    # a batch is stratified, draw j in [j, j+1) * mass / B: an item spanning L = B * P(i) strata contains at least
    # floor(L) - 1 whole strata and meets at most ceil(L) + 1, so that bounds its count in every batch (iid draws
    # would break it). Its marginal frequency is exactly P(i).
    strata = batch * p_row
    counts = np.zeros(capacity, np.int64)
    for _ in range(300):
        delivery = plane.sample()
        ids, data = np.asarray(delivery.ids), np.asarray(delivery.data["g"])
        np.testing.assert_array_equal(ids[:, 0], row_of(data, shards, capacity))
        assert (ids[:, 1] == 1).all()
        in_batch = np.bincount(ids[:, 0], minlength=capacity)
        assert (in_batch >= np.floor(strata) - 1).all() and (in_batch <= np.ceil(strata) + 1).all()
        counts += in_batch
    result = merged_chisquare(counts, p_row * counts.sum())
    assert result.pvalue > P_MIN, result
    assert (counts > 0).all()  # zero-priority items are still drawn (eps)


# -- importance weights ---------------------------------------------------------------------------------------------
def test_importance_weights_match_reference_on_partly_filled_buffer(mesh, front):
    """N is the number of stored items (40 of 64 slots), P(i) uses only stored items, weights are
    (N * P(i))^-beta / max over the batch, equal to the reference within float32 rounding (rtol 1e-5)."""
    capacity, stored, batch, alpha, beta, eps = 64, 40, 32, 0.7, 0.5, 1e-3
    plane = make_plane(mesh, capacity, samplers.prioritized(batch, alpha=alpha, beta=beta, eps=eps), seed=1,
                       front=front)
    shards = plane.num_shards
    ingest_range(plane, 0, stored)
    rng = np.random.default_rng(1)
    priority = 10.0 ** rng.uniform(-3, 2, stored)
    plane.update_priorities(ids_of(np.arange(stored), shards, capacity), priority)
    p_row = np.zeros(capacity)
    p_row[row_of(np.arange(stored), shards, capacity)] = per_law(priority, alpha, eps)
    for _ in range(5):
        delivery = plane.sample()
        rows = np.asarray(delivery.ids)[:, 0]
        assert (p_row[rows] > 0).all()  # only stored items
        weights = np.asarray(delivery.weights)
        assert weights.dtype == np.float32 and (weights > 0).all() and (weights <= 1).all()
        assert weights.max() >= 1 - 2**-23  # w / max(w): the largest is 1 up to the rounding of the division
        np.testing.assert_allclose(weights, reference_weights(p_row[rows], stored, beta), rtol=1e-5)


def test_beta_schedule_is_evaluated_at_the_sample_step(mesh):
    optax = pytest.importorskip("optax")
    capacity, batch, alpha = 32, 16, 1.0
    schedule = optax.linear_schedule(0.0, 1.0, transition_steps=4)  # beta = step / 4, then 1
    plane = make_plane(mesh, capacity, samplers.prioritized(batch, alpha=alpha, beta=schedule, eps=1e-6), seed=2)
    shards = plane.num_shards
    ingest_range(plane, 0, capacity)
    priority = np.arange(1, capacity + 1, dtype=np.float64)
    plane.update_priorities(ids_of(np.arange(capacity), shards, capacity), priority)
    p_row = np.zeros(capacity)
    p_row[row_of(np.arange(capacity), shards, capacity)] = per_law(priority, alpha, 1e-6)
    for step in range(6):
        delivery = plane.sample()
        rows = np.asarray(delivery.ids)[:, 0]
        beta = min(step / 4, 1.0)
        np.testing.assert_allclose(delivery.weights, reference_weights(p_row[rows], capacity, beta), rtol=1e-5,
                                   err_msg=f"step {step}")
        assert len(np.unique(rows)) > 1  # the batch holds different priorities, so beta is visible in the weights


# -- max priority for new items -------------------------------------------------------------------------------------
def test_new_items_get_the_largest_priority_seen(mesh):
    capacity, alpha, eps = 32, 0.6, 1e-6
    plane = make_plane(mesh, capacity, samplers.prioritized(8, alpha=alpha, eps=eps))
    shards = plane.num_shards
    mass = lambda p: np.float32(np.power(p + eps, alpha))  # noqa: E731
    ingest_range(plane, 0, 8)
    leaves = tree_leaves(plane)
    np.testing.assert_allclose(leaves[row_of(np.arange(8), shards, capacity)], mass(1.0), rtol=1e-6)  # initial max 1

    plane.update_priorities(ids_of([0, 1, 2], shards, capacity), [0.5, 7.5, 3.0])
    plane.update_priorities(ids_of([3], shards, capacity), [2.0])  # lower than the max: the max stays 7.5
    assert float(plane.state.sampler.max_priority) == 7.5
    ingest_range(plane, 8, 16)
    leaves = tree_leaves(plane)
    np.testing.assert_allclose(leaves[row_of(np.arange(8, 16), shards, capacity)], mass(7.5), rtol=1e-6)
    np.testing.assert_allclose(leaves[row_of(np.arange(4), shards, capacity)], mass(np.array([0.5, 7.5, 3.0, 2.0])),
                               rtol=1e-6)
    np.testing.assert_allclose(leaves[row_of(np.arange(4, 8), shards, capacity)], mass(1.0), rtol=1e-6)

    # an ignored (stale) update never raises the max
    ingest_range(plane, 16, 16 + capacity)  # every slot rewritten: the generation-1 ids are stale
    plane.update_priorities(ids_of([0, 5], shards, capacity), [1000.0, 1000.0])
    assert plane.stats()["priority_updates_ignored"] == 2
    assert float(plane.state.sampler.max_priority) == 7.5


@pytest.mark.parametrize("alpha", [0.6, 8.0])
def test_zero_priority_item_stays_sampleable_and_updatable(alpha):
    """eps > 0 "keeps every live item sampleable" (ConfigError text of samplers.prioritized): a priority of 0 must
    leave the item a positive mass, and a later update must apply to it. With alpha = 8, (0 + 1e-6)^8 = 1e-48 is
    below the smallest float32 (even subnormal), so the leaf becomes 0: the item is never drawn again and every later
    update is ignored as if the item had been overwritten (update() treats a zero leaf as not live)."""

    plane = make_plane(default_mesh(1), 8, samplers.prioritized(8, alpha=alpha, eps=1e-6))
    ingest_range(plane, 0, 8)
    plane.update_priorities([[0, 1]], [0.0])
    assert tree_leaves(plane)[0] > 0, "a zero priority made the item unsampleable"
    plane.update_priorities([[0, 1]], [1.0])
    assert plane.stats()["priority_updates_ignored"] == 0
    assert tree_leaves(plane)[0] == tree_leaves(plane)[1]


# -- rejected updates -----------------------------------------------------------------------------------------------
CAPACITY = 16


@pytest.fixture(scope="module")
def filled_plane(module_mesh):
    plane = make_plane(module_mesh, CAPACITY, samplers.prioritized(8, alpha=0.6, beta=0.4))
    ingest_range(plane, 0, CAPACITY)
    ids = np.asarray(plane.sample().ids)
    plane.update_priorities(ids, np.linspace(0.1, 2.0, len(ids)))  # compiles the update kernel for m = 8
    return plane, ids


def _bad_updates():
    good = np.array([[0, 1], [5, 1], [15, 1]], np.int32)
    ok = np.array([0.5, 1.0, 2.0], np.float32)
    return {
        "nan": (good, [0.5, np.nan, 2.0], "finite"),
        "inf": (good, [0.5, 1.0, np.inf], "finite"),
        "minus_inf": (good, [-np.inf, 1.0, 2.0], "finite"),
        "negative": (good, [0.5, -1e-3, 2.0], ">= 0"),
        "ids_float": (good.astype(np.float32), ok, "integer"),
        "ids_bool": (np.ones((3, 2), bool), ok, "integer"),
        "ids_1d": (good[:, 0], ok, "shape"),
        "ids_3_cols": (np.concatenate([good, good[:, :1]], axis=1), ok, "shape"),
        "ids_3d": (good[:, :, None], ok, "shape"),
        "row_too_large": (np.array([[0, 1], [CAPACITY, 1], [3, 1]]), ok, "not an id"),
        "row_negative": (np.array([[0, 1], [-1, 1], [3, 1]]), ok, "not an id"),
        "row_huge_uint": (np.array([[0, 1], [2**32 - 1, 1], [3, 1]], np.uint32), ok, "not an id"),
        "generation_0": (np.array([[0, 1], [1, 0], [3, 1]]), ok, r"generations in \[1, 2\*\*31 - 1\]"),
        "generation_negative": (np.array([[0, -1], [1, 1], [3, 1]]), ok, r"generations in \[1, 2\*\*31 - 1\]"),
        "empty": (np.zeros((0, 2), np.int32), np.zeros((0,), np.float32), "empty"),
        "too_many_priorities": (good, [0.5, 1.0, 2.0, 3.0], "one per id"),
        "too_few_priorities": (good, [0.5], "one per id"),
        "priorities_2d": (good, ok[:, None], "one per id"),
        "priorities_scalar": (good, 1.0, "one per id"),
        "priorities_strings": (good, ["a", "b", "c"], "real numbers"),
        "priorities_complex": (good, ok + 1j, "real numbers"),
    }


BAD = _bad_updates()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_update_raises_and_leaves_state_bit_identical(filled_plane, state_snapshot, case):
    plane, _ = filled_plane
    ids, priorities, message = BAD[case]
    check = state_snapshot(plane)
    ignored = plane.stats()["priority_updates_ignored"]
    compiled = plane.compile_counts()
    with pytest.raises(PriorityError, match=message):
        plane.update_priorities(ids, priorities)
    check()
    assert plane.stats()["priority_updates_ignored"] == ignored
    assert plane.compile_counts() == compiled  # rejected on the host: nothing was traced


def test_priority_error_is_a_value_error():
    assert issubclass(PriorityError, ValueError)


def test_update_needs_a_prioritized_sampler():

    spec = {"g": SPEC["g"], "terminated": jax.ShapeDtypeStruct((), np.bool_),
            "truncated": jax.ShapeDtypeStruct((), np.bool_)}
    for sampler in (samplers.uniform(4), samplers.sequences(4, 2, 1)):  # sequences without alpha: no priorities
        plane = ExperienceDataPlane(spec, 8, sampler, mesh=default_mesh(1))
        with pytest.raises(ConfigError, match="no priorities"):
            plane.update_priorities([[0, 1]], [1.0])


@pytest.mark.parametrize("kwargs, names", [
    ({"alpha": -0.1}, "alpha"), ({"eps": 0.0}, "eps"), ({"eps": -1.0}, "eps"), ({"beta": -0.5}, "beta"),
    ({"beta": "high"}, "beta"), ({"batch_size": 0}, "batch_size"), ({"alpha": float("inf")}, "alpha"),
    ({"beta": float("inf")}, "beta"), ({"eps": float("inf")}, "eps"), ({"alpha": float("nan")}, "alpha"),
    ({"alpha": "x"}, "alpha"), ({"alpha": True}, "alpha"), ({"max_times_sampled": True}, "max_times_sampled")])
def test_bad_prioritized_config(kwargs, names):
    with pytest.raises(ConfigError, match=rf"samplers.prioritized\(\): {names} must be"):
        samplers.prioritized(**{"batch_size": 8, **kwargs})
    if "batch_size" not in kwargs:  # the windowed sampler checks the same arguments
        with pytest.raises(ConfigError, match=rf"samplers.sequences\(\): {names} must be"):
            samplers.sequences(8, 2, 1, **{"alpha": 0.6, **kwargs})


@pytest.mark.parametrize("shards", [1, 8])
def test_priorities_at_the_float32_extremes_keep_the_sum_tree_finite(shards):
    """alpha = 1 and half the items at float32's maximum: without a cap the tree's total overflows (every weight NaN,
    every draw row 0). With it the huge items share the mass evenly, weights stay in (0, 1], nothing else is drawn."""
    capacity = 64
    plane = make_plane(default_mesh(shards), capacity, samplers.prioritized(32, alpha=1.0, beta=1.0))
    ingest_range(plane, 0, capacity)
    g = np.arange(capacity)
    huge = g % 2 == 0
    plane.update_priorities(ids_of(g, shards, capacity),
                            np.where(huge, np.finfo(np.float32).max, np.float32(1e-30)).astype(np.float32))
    leaves = tree_leaves(plane)
    assert np.isfinite(leaves).all() and leaves.max() == np.float32(samplers.max_mass(capacity))
    counts = np.zeros(capacity, np.int64)
    for _ in range(40):
        delivery = plane.sample()
        weights = np.asarray(delivery.weights)
        assert np.isfinite(weights).all() and (weights > 0).all() and (weights <= 1).all()
        counts += np.bincount(np.asarray(delivery.data["g"]), minlength=capacity)
    assert counts[~huge].sum() == 0  # the others' mass (1e-30 + eps) is 1e-36 of the total: never drawn in 1,280
    assert stats.chisquare(counts[huge]).pvalue > P_MIN  # equal capped masses: uniform over the huge items


def test_an_id_wider_than_int32_is_refused_before_narrowing(mesh):
    plane = make_plane(mesh, 16, samplers.prioritized(8))
    ingest_range(plane, 0, 16)
    before = tree_leaves(plane).copy()
    wide = np.array([[0, 2**32 + 1]], np.int64)  # narrowed to int32 this would be generation 1: the live item 0
    with pytest.raises(PriorityError, match=r"ids\[0\] = \[0, 4294967297\] is not an id of this plane"):
        plane.update_priorities(wide, [5.0])
    np.testing.assert_array_equal(tree_leaves(plane), before)


# -- stale ids ------------------------------------------------------------------------------------------------------
def test_update_of_overwritten_item_is_ignored_and_counted(mesh):
    capacity, alpha, eps = 16, 0.6, 1e-6
    plane = make_plane(mesh, capacity, samplers.prioritized(8, alpha=alpha, eps=eps))
    shards = plane.num_shards
    ingest_range(plane, 0, capacity)
    old = np.arange(capacity)
    plane.update_priorities(ids_of(old, shards, capacity), np.linspace(0.1, 3.0, capacity))
    assert plane.stats()["priority_updates_ignored"] == 0

    # 8 more items overwrite slot 0 of every shard (8 shards) or slots 0..7 (1 shard): either way items 0..7
    ingest_range(plane, capacity, capacity + 8)
    stale, live = old[:8], old[8:]
    np.testing.assert_array_equal(row_of(np.arange(capacity, capacity + 8), shards, capacity),
                                  row_of(stale, shards, capacity))
    new_rows = row_of(stale, shards, capacity)
    before = tree_leaves(plane)
    max_before = float(plane.state.sampler.max_priority)
    np.testing.assert_allclose(before[new_rows], np.power(3.0 + eps, alpha), rtol=1e-6)

    # stale only (a duplicate included): nothing changes, every entry counted
    stale_ids = ids_of(np.append(stale, stale[0]), shards, capacity)
    plane.update_priorities(stale_ids, np.full(len(stale_ids), 50.0))
    assert plane.stats()["priority_updates_ignored"] == 9
    np.testing.assert_array_equal(tree_leaves(plane), before)
    assert float(plane.state.sampler.max_priority) == max_before

    # mixed: live ids apply, stale ones are skipped and counted
    plane.update_priorities(ids_of(old, shards, capacity), np.full(capacity, 0.25))
    assert plane.stats()["priority_updates_ignored"] == 17
    after = tree_leaves(plane)
    np.testing.assert_array_equal(after[new_rows], before[new_rows])
    np.testing.assert_allclose(after[row_of(live, shards, capacity)], np.power(0.25 + eps, alpha), rtol=1e-6)

    # the new items' own ids (generation 2) do apply
    plane.update_priorities(ids_of(np.arange(capacity, capacity + 8), shards, capacity, generation=2),
                            np.full(8, 0.5))
    assert plane.stats()["priority_updates_ignored"] == 17
    np.testing.assert_allclose(tree_leaves(plane)[new_rows], np.power(0.5 + eps, alpha), rtol=1e-6)
    # an id from the future (generation 3 of a slot written twice) names no item yet
    plane.update_priorities(ids_of([capacity], shards, capacity, generation=3), [9.0])
    assert plane.stats()["priority_updates_ignored"] == 18


def test_ids_from_deliveries_round_trip(mesh):
    """Ids exactly as delivered update exactly the delivered items (row and generation after the ring wrapped)."""
    capacity, alpha, eps = 32, 1.0, 1e-6
    plane = make_plane(mesh, capacity, samplers.prioritized(16, alpha=alpha, eps=eps), seed=7)
    shards = plane.num_shards
    ingest_range(plane, 0, capacity + 24)  # wraps: generations 1 and 2
    delivery = plane.sample()
    ids, g = np.asarray(delivery.ids), np.asarray(delivery.data["g"])
    np.testing.assert_array_equal(ids[:, 0], row_of(g, shards, capacity))
    np.testing.assert_array_equal(ids[:, 1], 1 + g // capacity)
    priority = np.asarray(g, np.float64) / 10  # duplicates of one item carry one value
    plane.update_priorities(ids, priority)
    assert plane.stats()["priority_updates_ignored"] == 0
    np.testing.assert_allclose(tree_leaves(plane)[ids[:, 0]], priority + eps, rtol=1e-6)


# -- compilation ----------------------------------------------------------------------------------------------------
def test_no_recompilation_across_samples_updates_and_ingests(mesh):
    plane = make_plane(mesh, 64, samplers.prioritized(16, alpha=0.6, beta=lambda step: 0.4 + 0.001 * step))
    rng = np.random.default_rng(0)
    for step in range(6):
        ingest_range(plane, 8 * step, 8 * step + 8)
        delivery = plane.sample()
        ids = np.asarray(delivery.ids)[: 9 + step % 4]  # 9..12 ids: one padded bucket of 16
        plane.update_priorities(ids, rng.random(len(ids)) * 10)
    sizes = plane.engine.kernel_cache_sizes()
    assert all(size <= 1 for size in sizes.values()), sizes
    # one write bucket and one update bucket, whichever kernel carried them (staged ingests ride the draws)
    buckets = {part for name in sizes for part in name.split("+") if part.startswith(("ingest[", "update["))}
    assert len({b for b in buckets if b.startswith("ingest[")}) == 1, sizes
    assert len({b for b in buckets if b.startswith("update[")}) == 1, sizes
    # an update given before rows were staged rides the kernel that writes them (engine._dispatch: one pass over
    # the sum tree), never a kernel of its own in this loop
    assert [name for name in sizes if name.startswith("update[") and "+ingest[" in name], sizes
    assert not [name for name in sizes if name.startswith("update[") and "ingest[" not in name], sizes


# -- float32 safety through the plane -------------------------------------------------------------------------------
def test_many_updates_never_yield_empty_or_zero_priority_draws(mesh):
    """300 updates of 64 distinct ids with priorities over 16 orders of magnitude (10% exact zeros) on a buffer with
    empty slots in every shard: every draw is a stored item of the current generation with positive stored mass, and
    the stored masses equal (p + eps)^alpha of the last update (float32 pow, rtol 1e-6)."""
    capacity, stored, alpha, eps = 1000, 604, 0.6, 1e-6
    plane = make_plane(mesh, capacity, samplers.prioritized(64, alpha=alpha, beta=0.4, eps=eps), seed=5)
    shards = plane.num_shards
    ingest_range(plane, 0, stored)
    rng = np.random.default_rng(11)
    last = np.ones(stored)
    for _ in range(300):
        g = rng.choice(stored, 64, replace=False)
        priority = 10.0 ** rng.uniform(-8, 8, 64)
        priority[rng.random(64) < 0.1] = 0.0
        plane.update_priorities(ids_of(g, shards, capacity), priority)
        last[g] = priority
    leaves = tree_leaves(plane)
    valid = np.zeros(capacity, bool)
    valid[row_of(np.arange(stored), shards, capacity)] = True
    assert not leaves[~valid].any()
    np.testing.assert_allclose(leaves[row_of(np.arange(stored), shards, capacity)],
                               np.power(last + eps, alpha), rtol=1e-6)
    for _ in range(50):
        delivery = plane.sample()
        ids, g = np.asarray(delivery.ids), np.asarray(delivery.data["g"])
        assert valid[ids[:, 0]].all() and (ids[:, 1] == 1).all() and (g < stored).all()
        np.testing.assert_array_equal(ids[:, 0], row_of(g, shards, capacity))
        assert (leaves[ids[:, 0]] > 0).all()
        assert np.isfinite(np.asarray(delivery.weights)).all()


@pytest.mark.parametrize("shards", [1, 8])
def test_max_times_sampled_delivers_each_item_that_often_then_refuses(status_reads, shards):
    """Every item is delivered exactly max_times_sampled times (draws past its budget are masked out), then the plane
    has nothing left to draw and says so; a new item makes it sampleable again. The shell learns that the index ran
    dry from the sample kernels themselves: the status kernel runs once, when the plane knows nothing yet (at the
    first staged ingest)."""
    spec = {"id": jax.ShapeDtypeStruct((), np.int32)}
    plane = ExperienceDataPlane(spec, 16, samplers.prioritized(8, max_times_sampled=2), mesh=default_mesh(shards))
    reads = status_reads(plane)
    plane.ingest({"id": np.arange(16, dtype=np.int32)})
    delivered = np.zeros(17, int)
    for _ in range(200):
        if not plane.can_sample():
            break
        delivery = plane.sample()
        np.add.at(delivered, np.asarray(delivery.data["id"])[np.asarray(delivery.mask)], 1)
    assert delivered[:16].tolist() == [2] * 16
    with pytest.raises(NotEnoughDataError):
        plane.sample()
    plane.ingest({"id": np.array([16], np.int32)})  # overwrites item 0 with a fresh item
    assert plane.can_sample()
    delivery = plane.sample()
    assert set(np.asarray(delivery.data["id"])[np.asarray(delivery.mask)].tolist()) == {16}
    assert len(reads) == 1


# -- an update and an ingest in one pass over the sum tree ------------------------------------------------------------
@pytest.mark.parametrize("order", ["update_before", "then_update"])
@pytest.mark.parametrize("sampler", ["prioritized", "sequences"])
def test_an_update_and_an_ingest_in_one_kernel_equal_the_two_in_turn(mesh, sampler, order):
    """``replay.ingest(..., update_before=...)`` / ``(..., then_update=...)`` (one pass over the sum tree: the
    sampler's ``update_then_insert`` / ``insert_then_update``) leave bit for bit the state that ``update`` and then
    ``ingest`` (resp. the reverse) leave, with some updated items overwritten by the write (their updates ignored
    after it, applied and then overwritten before it) and new items taking the largest priority seen by then."""
    from conduit_jax import replay

    if sampler == "prioritized":
        plane = make_plane(mesh, 64, samplers.prioritized(8, alpha=0.7))
        ingest_range(plane, 0, 56)
        batch = {"g": jax.numpy.arange(56, 72, dtype=jax.numpy.int32)}
    else:  # windows of 3 steps of 8 streams, episodes of 5 steps
        spec = dict(SPEC, terminated=jax.ShapeDtypeStruct((), np.bool_), truncated=jax.ShapeDtypeStruct((), np.bool_))
        plane = ExperienceDataPlane(spec, 64, samplers.sequences(8, 3, streams=8, alpha=0.7), mesh=mesh)
        g = np.arange(72, dtype=np.int32)
        items = {"g": g, "terminated": (g // 8) % 5 == 4, "truncated": np.zeros(72, bool)}
        plane.ingest({k: v[:56] for k, v in items.items()})
        batch = {k: jax.numpy.asarray(v[56:]) for k, v in items.items()}
    config, state = plane.config, plane.engine.state
    shards = plane.num_shards
    g = np.array([0, 3, 8, 17, 30, 41, 50, 55], np.int64)  # 0..7: overwritten by the 16 new items (56..71)
    ids = np.stack([row_of(g, shards, 64), ids_of(g, shards, 64)[:, 1]], axis=1).astype(np.int32)
    priorities = np.linspace(0.5, 40.0, len(g)).astype(np.float32)
    update = (jax.numpy.asarray(ids), jax.numpy.asarray(priorities), jax.numpy.ones(len(g), bool))
    if order == "update_before":
        one = jax.jit(lambda st: replay.ingest(config, st, batch, 16, update_before=update))(state)
        two = jax.jit(lambda st: replay.ingest(config, st.replace(sampler=replay.update(config, st, *update)), batch,
                                               16))(state)
    else:
        one = jax.jit(lambda st: replay.ingest(config, st, batch, 16, then_update=update))(state)
        written = jax.jit(lambda st: replay.ingest(config, st, batch, 16))(state)
        two = written.replace(sampler=jax.jit(lambda st: replay.update(config, st, *update))(written))
    for a, b in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(two)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if sampler == "prioritized":  # g 0 and 3 are overwritten: updated and rewritten, or ignored after the write
        assert int(one.sampler.ignored_updates) == (0 if order == "update_before" else 2)


# -- the smallest-mass tree (normalise="buffer") ----------------------------------------------------------------------
def test_the_smallest_mass_tree_always_equals_one_rebuilt_from_the_leaves(mesh):
    """Through inserts that wrap the ring, updates (zeros included) and draws, every node of the kept
    smallest-mass tree equals the one rebuilt from the final leaves, bit for bit; its roots hold each shard's
    smallest positive leaf, so the weights are (P / P_min)^-beta over every stored item; a relayout rebuilds it."""
    from conduit_jax import sumtree

    plane = make_plane(mesh, 96, samplers.prioritized(16, alpha=0.8, beta=0.5, normalise="buffer"), seed=4)
    rng = np.random.default_rng(9)
    for step in range(12):
        ingest_range(plane, 11 * step, 11 * step + 11)
        delivery = plane.sample()
        priorities = rng.random(16) * 10.0 ** rng.integers(-3, 3, 16)
        priorities[rng.random(16) < 0.2] = 0.0
        plane.update_priorities(delivery.ids, priorities)
    state = plane.engine.state.sampler
    leaves = np.asarray(state.levels[-1])
    rebuilt = sumtree.from_leaves(leaves, len(state.levels), combine=sumtree.smallest_positive)[:-1]
    for kept, want in zip(state.smallest, rebuilt):
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(want))
    shards = plane.num_shards
    per_shard = leaves.reshape(shards, -1)
    np.testing.assert_array_equal(np.asarray(state.smallest[0]), [row[row > 0].min() for row in per_shard])
    delivery = plane.sample()
    masses = leaves[np.asarray(delivery.ids)[:, 0] % (96 // shards) + (np.asarray(delivery.ids)[:, 0] //
                                                                          (96 // shards)) * per_shard.shape[1]]
    np.testing.assert_allclose(np.asarray(delivery.weights), (masses / leaves[leaves > 0].min()) ** -0.5, rtol=2e-6)
    # a checkpoint saved before the tree was kept lacks it: the relayout rule rebuilds it from the leaves
    named = {f"levels.{i}": np.asarray(level) for i, level in enumerate(state.levels)}
    target = dict(named, **{f"smallest.{i}": np.asarray(level) for i, level in enumerate(state.smallest)})
    total = int(plane.engine.stats()["items_inserted"])
    moves = samplers.ItemMoves(np.arange(max(0, total - 96), total), total, shards, shards, 96)
    out = plane.sampler.relayout(named, moves, target)
    for i, level in enumerate(state.smallest):
        np.testing.assert_array_equal(out[f"smallest.{i}"], np.asarray(level))
