"""Samplers over the sharded rings: uniform (chi-square), FIFO (exactly once, in order, no overwrite), epochs (each
item once per epoch), and where the delivered batch lives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from scipy import stats

from conduit_jax import (CapacityError, ConfigError, ExperienceDataPlane, ExperienceSpec, NotEnoughDataError,
                         samplers)

SPEC = ExperienceSpec.from_example({"g": np.int32(0), "v": np.zeros((2,), np.float32)})
P_MIN = 1e-3  # chi-square tolerance: a correct sampler fails one fixed-seed test with probability 0.1%


def items(start, n):
    g = np.arange(start, start + n, dtype=np.int32)
    return {"g": g, "v": np.stack([g * 0.5, -g], axis=1).astype(np.float32)}


def host(x):
    return np.asarray(jax.device_get(x))


def expected_id(g, shards, shard_capacity):
    """(global row, generation) of the g-th item ever ingested: shard g % S, slot (g // S) % (capacity / S)."""
    g = np.asarray(g)
    lap_slot = g // shards
    return np.stack([(g % shards) * shard_capacity + lap_slot % shard_capacity, lap_slot // shard_capacity + 1], -1)


def check_delivery(plane, delivery):
    """Data and ids agree: every delivered item's data is item g's, and its id is (row, generation) of item g."""
    g, v, ids = host(delivery.data["g"]), host(delivery.data["v"]), host(delivery.ids)
    np.testing.assert_array_equal(v, items(0, int(g.max()) + 1)["v"][g])
    np.testing.assert_array_equal(ids, expected_id(g, plane.num_shards, plane.config.shard_capacity))
    return g


# -- uniform ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("any_mesh, ingested", [
    ("1dev", 64), ("8dev", 64), ("1dev", 45), ("8dev", 45), ("2x4", 45), ("8dev", 77),
], indirect=["any_mesh"], ids=lambda v: str(v))
def test_uniform_is_uniform_over_the_whole_buffer(any_mesh, ingested, front):
    """Chi-square over every valid item: 40,960 draws over a 64-slot buffer on 1, 8 and 2x4 shards; 45 items is not a
    multiple of the shard count, 77 items have wrapped the rings (only the newest 64 are valid)."""
    capacity, batch, calls = 64, 1024, 40
    plane = front(SPEC, capacity, samplers.uniform(batch), mesh=any_mesh, seed=1234)
    plane.ingest(items(0, ingested))
    valid = np.arange(max(0, ingested - capacity), ingested)
    counts = np.zeros(ingested, np.int64)
    for _ in range(calls):
        g = check_delivery(plane, plane.sample())
        counts += np.bincount(g, minlength=ingested)
    assert counts.sum() == batch * calls
    assert not counts[:valid[0]].any(), "an overwritten item was delivered"
    result = stats.chisquare(counts[valid])
    assert result.pvalue > P_MIN, f"draws are not uniform: chi2={result.statistic:.1f}, p={result.pvalue:.2e}"


def test_uniform_stream_is_reproducible_and_seeded():
    mesh = jax.make_mesh((1,), ("shard",))

    def draws(seed):
        plane = ExperienceDataPlane(SPEC, 16, samplers.uniform(32), mesh=mesh, seed=seed)
        plane.ingest(items(0, 16))
        return [host(plane.sample().data["g"]) for _ in range(3)]

    first, again, other = draws(7), draws(7), draws(8)  # (the 2nd and 3rd planes reuse no compiled kernel)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))
    assert not np.array_equal(first[0], first[1])  # the stream advances between calls


# -- FIFO -------------------------------------------------------------------------------------------------------------
def fifo_session(mesh, front=ExperienceDataPlane):
    """20 items, 1 batch of 16, 12 items, 1 batch, then 32 more items (the rings wrap) and 2 batches: 64 items in all.
    A batch of 16 is 2 rows per shard on 8 shards, so a batch mixes several rows of every shard."""
    plane = front(SPEC, 32, samplers.fifo(16), mesh=mesh)
    batches = []
    plane.ingest(items(0, 20))
    batches.append(plane.sample())
    plane.ingest(items(20, 12))
    batches.append(plane.sample())
    with pytest.raises(NotEnoughDataError):
        plane.sample()
    plane.ingest(items(32, 32))
    batches += [plane.sample() for _ in range(2)]
    assert not plane.can_sample()
    return plane, batches


def test_fifo_delivers_every_item_exactly_once(mesh, front):
    plane, batches = fifo_session(mesh, front)
    delivered = []
    for i, delivery in enumerate(batches):
        g = check_delivery(plane, delivery)  # ids name the live generation of the item's row
        assert sorted(g.tolist()) == list(range(16 * i, 16 * i + 16)), "a batch is not the next 16 items"
        delivered += g.tolist()
    assert sorted(delivered) == list(range(64))


def test_fifo_delivers_in_insertion_order(mesh):
    """Batch i holds items [16i, 16i+16); inside the batch each shard's block is in insertion order (shard-major:
    shard s contributes items g with g % S == s, oldest first), which on one shard is plain insertion order."""
    plane, batches = fifo_session(mesh)
    shards = plane.num_shards
    for i, delivery in enumerate(batches):
        want = np.arange(16 * i, 16 * i + 16).reshape(16 // shards, shards).T.reshape(-1)
        np.testing.assert_array_equal(host(delivery.data["g"]), want)
        np.testing.assert_array_equal(host(delivery.data["v"]), items(0, 64)["v"][want])
        np.testing.assert_array_equal(host(delivery.ids), expected_id(want, plane.num_shards,
                                                                      plane.config.shard_capacity))


def test_fifo_refuses_to_overwrite_undelivered_items(mesh, state_snapshot):
    plane = ExperienceDataPlane(SPEC, 16, samplers.fifo(8), mesh=mesh)
    plane.ingest(items(0, 12))
    check = state_snapshot(plane)
    for n in (5, 16, 40):  # 12 + n > 16; 40 is also larger than the capacity
        with pytest.raises(CapacityError) as info:
            plane.ingest(items(12, n))
        msg = str(info.value)
        assert "12 undelivered" in msg and f"{12 + n - 16} of them" in msg and "at most 4" in msg
        check()
    assert not plane.can_ingest(5) and plane.can_ingest(4)
    plane.ingest(items(12, 4))  # exactly full
    assert sorted(host(plane.sample().data["g"]).tolist()) == list(range(8))
    plane.ingest(items(16, 8))  # the 8 delivered slots may be reused now
    with pytest.raises(CapacityError):
        plane.ingest(items(24, 1))
    assert plane.stats()["deliverable"] == 16
    got = sorted(host(plane.sample().data["g"]).tolist() + host(plane.sample().data["g"]).tolist())
    assert got == list(range(8, 24))


def test_fifo_needs_a_full_batch(mesh, state_snapshot):
    plane = ExperienceDataPlane(SPEC, 16, samplers.fifo(8), mesh=mesh)
    plane.ingest(items(0, 7))
    check = state_snapshot(plane)
    with pytest.raises(NotEnoughDataError, match=r"at least 8 undelivered items.*has 7"):
        plane.sample()
    check()
    assert not plane.can_sample()
    plane.ingest(items(7, 1))
    assert plane.can_sample()
    assert sorted(host(plane.sample().data["g"]).tolist()) == list(range(8))


# -- epochs -----------------------------------------------------------------------------------------------------------
def test_epochs_every_item_once_per_epoch(mesh, front):
    plane = front(SPEC, 64, samplers.epochs(8), mesh=mesh, seed=3)
    plane.ingest(items(0, 32))
    orders = []
    for _ in range(3):
        epoch = np.concatenate([check_delivery(plane, plane.sample()) for _ in range(4)])
        assert sorted(epoch.tolist()) == list(range(32)), "an epoch did not deliver each item exactly once"
        orders.append(epoch)
    assert not np.array_equal(orders[0], np.arange(32)), "the first epoch is not shuffled"
    for a in range(3):
        for b in range(a + 1, 3):
            assert not np.array_equal(orders[a], orders[b]), f"epochs {a} and {b} have the same shuffle"

    # an ingest in the middle of an epoch starts a new one over everything stored now
    first_half = np.concatenate([check_delivery(plane, plane.sample()) for _ in range(2)])
    assert len(set(first_half.tolist())) == 16
    plane.ingest(items(32, 16))
    epoch = np.concatenate([check_delivery(plane, plane.sample()) for _ in range(6)])
    assert sorted(epoch.tolist()) == list(range(48))
    nxt = np.concatenate([check_delivery(plane, plane.sample()) for _ in range(6)])
    assert sorted(nxt.tolist()) == list(range(48)) and not np.array_equal(nxt, epoch)


def test_epochs_of_a_size_not_a_multiple_of_the_batch_leave_the_remainder_out(mesh):
    """20 items, batches of 8 (and 20 is not a multiple of 8 shards either): an epoch is 20 // 8 = 2 minibatches of
    16 distinct items; the 4 left out are left out of that epoch only (rounding the epoch's minibatch count up
    instead would deliver a third batch that repeats 4 of them). Over 8 epochs every item is delivered: an item is
    left out of all 8 with probability 20 * 0.2 ** 8 = 5e-5 for a correct sampler (seeded: deterministic)."""
    plane = ExperienceDataPlane(SPEC, 64, samplers.epochs(8), mesh=mesh, seed=5)
    plane.ingest(items(0, 20))
    epochs = [np.concatenate([check_delivery(plane, plane.sample()) for _ in range(2)]) for _ in range(8)]
    for i, epoch in enumerate(epochs):
        assert len(set(epoch.tolist())) == 16, f"epoch {i} delivered an item twice: {sorted(epoch.tolist())}"
    assert len({tuple(sorted(epoch.tolist())) for epoch in epochs}) > 1, "every epoch left out the same items"
    assert set(np.concatenate(epochs).tolist()) == set(range(20))


def test_epochs_need_a_batch_of_items(mesh, state_snapshot):
    plane = ExperienceDataPlane(SPEC, 16, samplers.epochs(8), mesh=mesh)
    plane.ingest(items(0, 5))
    check = state_snapshot(plane)
    with pytest.raises(NotEnoughDataError, match="at least 8"):
        plane.sample()
    check()


@jax.jit
def _feistel_prefix(n, key):
    """feistel_permute of [0, n) computed in a fixed 1024-wide array (one compile for every n <= 1024)."""
    iota = jnp.arange(1024, dtype=jnp.int32)
    return samplers.feistel_permute(jnp.where(iota < n, iota, 0), n, key)


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 45, 64, 100, 1000])
def test_feistel_permute_is_a_bijection(n):
    perms = [np.asarray(_feistel_prefix(jnp.int32(n), samplers.seed_key(seed)))[:n] for seed in (0, 1)]
    for perm in perms:
        assert sorted(perm.tolist()) == list(range(n))
    if n >= 8:  # 8! permutations: two keys colliding would be a broken key schedule
        assert not np.array_equal(perms[0], perms[1])


@jax.jit
def _feistel_under_keys(n, keys):
    """feistel_permute of [0, n) (n <= 128) under each key, in one program: [len(keys), 128]."""
    iota = jnp.arange(128, dtype=jnp.int32)
    return jax.vmap(lambda key: samplers.feistel_permute(jnp.where(iota < n, iota, 0), n, key))(keys)


@pytest.mark.parametrize("n", [5, 20, 100])
def test_feistel_permute_sends_every_item_everywhere(n):
    """Over 2,000 keys, every item lands at every position under some key. n - 1 needs an odd number of bits (3, 5, 7)
    here, where the network's halves differ: halves rounded down instead of up still permute, but never move the top
    bit (for 20 items, [0, 16) and [16, 20) are shuffled apart: every epoch leaves out the same 4). Not a chi-square: a 4-round Feistel network with
    cycle walking is close to but measurably not uniform (n = 20 over 16,000 keys: p = 1e-20); a uniform shuffle
    leaves a given cell empty with probability (1 - 1/n) ** 2000 <= e ** -20."""
    keys = samplers.mix32(jnp.arange(2000, dtype=jnp.uint32))  # one program for every n
    perms = np.asarray(_feistel_under_keys(jnp.int32(n), keys))[:, :n]
    counts = np.zeros((n, n), np.int64)
    np.add.at(counts, (perms, np.broadcast_to(np.arange(n), perms.shape)), 1)
    assert (np.sort(perms, axis=1) == np.arange(n)).all()  # each key permutes
    assert (counts > 0).all(), f"{(counts == 0).sum()} (item, position) pairs never occur"


# -- constructor checks -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [samplers.uniform, samplers.fifo, samplers.epochs], ids=lambda f: f.__name__)
@pytest.mark.parametrize("bad", [0, -8, 2.5, True, "8", None])
def test_sampler_batch_size_must_be_positive_int(make, bad):
    with pytest.raises(ConfigError, match=rf"samplers\.{make.__name__}\(\): batch_size must be a positive int"):
        make(bad)


# -- where the batch lives ---------------------------------------------------------------------------------------------
def _sharded_over(leaf, mesh, axes):
    """The leaf's leading (batch) axis is split over ``axes`` of ``mesh``, every other axis is whole."""
    sharding = leaf.sharding
    assert isinstance(sharding, NamedSharding) and sharding.mesh == mesh
    assert sharding.is_equivalent_to(NamedSharding(mesh, P(axes)), leaf.ndim)
    if mesh.size > 1:  # on one device P() and P(axes) are the same placement
        lead = sharding.spec[0] if len(sharding.spec) else None
        assert lead is not None and ((lead,) if isinstance(lead, str) else tuple(lead)) == tuple(axes), sharding.spec
    rows = leaf.shape[0] // mesh.size
    for shard in leaf.addressable_shards:
        assert shard.data.shape == (rows, *leaf.shape[1:])


@pytest.mark.parametrize("make", [samplers.uniform, samplers.fifo, samplers.epochs], ids=lambda f: f.__name__)
def test_delivery_is_sharded_over_the_mesh_axes(any_mesh, make):
    plane = ExperienceDataPlane(SPEC, 32, make(16), mesh=any_mesh)
    expected = plane.shardings  # replay.shardings, written as XLA writes one-device outputs (functional.configure)

    def state_shardings_match():
        flat_state = jax.tree_util.tree_leaves_with_path(plane.state)
        flat_expected = jax.tree_util.tree_leaves(expected, is_leaf=lambda x: isinstance(x, NamedSharding))
        assert len(flat_state) == len(flat_expected)
        for (path, leaf), sharding in zip(flat_state, flat_expected):
            assert leaf.sharding == sharding, f"state leaf {jax.tree_util.keystr(path)}: {leaf.sharding}"

    state_shardings_match()
    plane.ingest(items(0, 32))
    state_shardings_match()
    delivery = plane.sample()
    state_shardings_match()
    axes = tuple(any_mesh.axis_names)
    for leaf in jax.tree_util.tree_leaves(delivery.data) + [delivery.ids]:
        assert leaf.shape[0] == 16
        _sharded_over(leaf, any_mesh, axes)
    assert delivery.weights is None


# -- several batches in one step ----------------------------------------------------------------------------------
SEQ_SPEC = {"g": jax.ShapeDtypeStruct((), np.int32), "terminated": jax.ShapeDtypeStruct((), np.bool_),
            "truncated": jax.ShapeDtypeStruct((), np.bool_)}


@pytest.mark.parametrize("kind", ["uniform", "epochs", "fifo", "sequences"])
def test_batches_at_once_are_the_draws_of_successive_steps(mesh, kind):
    """sample_fn(batches=k) returns exactly what k successive sample_fn() steps return (data, ids, mask), stacked on
    a leading axis, and the same state after."""
    make = {"uniform": lambda: samplers.uniform(8), "epochs": lambda: samplers.epochs(8),
            "fifo": lambda: samplers.fifo(8), "sequences": lambda: samplers.sequences(8, 3, 8, pad=True)}[kind]
    spec = SEQ_SPEC if kind == "sequences" else SPEC
    plane = ExperienceDataPlane(spec, 64, make(), mesh=mesh, seed=3)
    g = np.arange(48, dtype=np.int32)
    plane.ingest({"g": g, "terminated": g % 7 == 6, "truncated": g % 11 == 10} if kind == "sequences" else items(0, 48))
    state, k = plane.state, 4
    one, many = jax.jit(plane.sample_fn()), jax.jit(plane.sample_fn(batches=k))
    steps = []
    for _ in range(k):
        state, delivery = one(state)
        steps.append(jax.device_get(delivery))
    final, together = many(plane.state)
    together = jax.device_get(together)
    for field in ("data", "ids", "mask"):
        for got, *want in zip(jax.tree_util.tree_leaves(getattr(together, field)),
                              *[jax.tree_util.tree_leaves(getattr(d, field)) for d in steps]):
            np.testing.assert_array_equal(got, np.stack(want), err_msg=field)
    assert (kind == "sequences") == (together.mask is not None)
    for a, b in zip(jax.tree_util.tree_leaves(jax.device_get((final.sampler, final.limiter))),
                    jax.tree_util.tree_leaves(jax.device_get((state.sampler, state.limiter)))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_batches_must_be_a_positive_count_and_not_for_weighted_samplers(bad):
    plane = ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=jax.make_mesh((1,), ("shard",)))
    with pytest.raises(ConfigError, match="batches must be an int >= 1"):
        plane.sample_fn(batches=bad)
    weighted = ExperienceDataPlane(SPEC, 64, samplers.prioritized(8), mesh=jax.make_mesh((1,), ("shard",)))
    with pytest.raises(ConfigError, match="importance weights"):
        weighted.sample_fn(batches=2)


@pytest.mark.parametrize("bad", ["no", 1, 0, None])
def test_sequences_pad_must_be_a_bool(bad):
    with pytest.raises(ConfigError, match=r"samplers\.sequences\(\): pad must be a bool"):
        samplers.sequences(8, 4, 1, pad=bad)


def test_sequences_end_keys_must_not_be_a_bare_str():
    """A str would be iterated into one-letter keys ('t', 'e', ...): it is refused, naming end_keys."""
    with pytest.raises(ConfigError, match=r"samplers\.sequences\(\): end_keys must be a tuple .*\('terminated',\)"):
        samplers.sequences(8, 4, 1, end_keys="terminated")
    assert samplers.sequences(8, 4, 1, end_keys=["terminated"]).needs == ("terminated",)  # a list is fine


@pytest.mark.parametrize("name, params, words", [
    ("uniform", {"bogus": 1}, r"the uniform sampler takes the parameters \['batch_size'\]: unknown parameters "
                              r"\['bogus'\]"),
    ("uniform", {}, r"missing parameters \['batch_size'\]"),
    ("uniform", None, "params must be a mapping"),
    ("sequences", {"batch_size": 8}, r"missing parameters \['length', 'streams'\]"),
    ("bogus", {}, "unknown sampler 'bogus'"),
], ids=str)
def test_from_params_refuses_what_no_sampler_takes(name, params, words):
    with pytest.raises(ConfigError, match=rf"samplers\.from_params\(\): .*{words}"):
        samplers.from_params(name, params)


@pytest.mark.parametrize("sampler", [samplers.uniform(8), samplers.prioritized(8, alpha=0.5),
                                     samplers.sequences(8, 4, 2, pad=True, end_keys=("done",))],
                         ids=lambda s: s.name)
def test_from_params_rebuilds_a_sampler(sampler):
    assert samplers.from_params(sampler.name, dict(sampler.params)).params == sampler.params


@pytest.mark.parametrize("kwargs, argument", [({"eps": -1.0}, "eps"), ({"eps": float("nan")}, "eps"),
                                              ({"beta": -5.0}, "beta"), ({"beta": "x"}, "beta")], ids=str)
@pytest.mark.parametrize("pad", [True, False])
def test_sequences_checks_eps_and_beta_on_every_path(kwargs, argument, pad):
    """The index-free padded path uses neither, but a checkpoint records them: checked as on the indexed path."""
    with pytest.raises(ConfigError, match=rf"samplers\.sequences\(\): {argument} must be a finite number"):
        samplers.sequences(8, 4, 1, pad=pad, **kwargs)
