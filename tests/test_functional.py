"""The functional API inside jax.jit and lax.scan: a new user's Flashbax-style loop, invalid deliveries, the plane's
refusal under a trace, placements, bit-exact agreement with the plane and round trips through a checkpoint."""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import conduit_jax as cj
from conduit_jax import engine, limits, placement, replay, samplers

SPEC = {"g": jax.ShapeDtypeStruct((), jnp.int32), "obs": jax.ShapeDtypeStruct((3,), jnp.float32)}


def items(start, n):
    g = start + jnp.arange(n, dtype=jnp.int32)  # start may be traced (a scan's step), n is static
    return {"g": g, "obs": jnp.stack([g * 0.5, -g, g + 0.25], axis=1).astype(jnp.float32)}


def expected_ids(g, shards, shard_capacity):
    """(row, generation) of the g-th item ever ingested: round-robin dealing puts it at shard g % S, slot g // S."""
    g = np.asarray(g)
    lap_slot = g // shards
    return np.stack([(g % shards) * shard_capacity + lap_slot % shard_capacity, lap_slot // shard_capacity + 1], -1)


def host_leaves(state):
    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(jax.device_get(state))]


def assert_same_state(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(host_leaves(a), host_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


# -- the README loop --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["uniform", "prioritized"])
def test_a_new_users_scan_loop_with_12_items_a_step(mesh, sampler):
    """As the README writes it: ingest 12 items a step (not a multiple of 8 shards) and sample, in one lax.scan under
    jit with the state donated. Every delivery after the first ingest is valid and holds only stored items, whose ids
    are their (row, generation)."""
    capacity, batch, steps, per_step = 128, 16, 20, 12
    make = samplers.uniform if sampler == "uniform" else samplers.prioritized
    buffer = cj.make_buffer(SPEC, capacity, make(batch), mesh=mesh)
    state = buffer.init(seed=0)

    def step(state, t):
        state = buffer.ingest(state, items(t * per_step, per_step))
        state, delivery = buffer.sample(state)
        if delivery.weights is not None:  # the learner's new priorities, applied in the same program
            state = buffer.update(state, delivery.ids, jnp.abs(delivery.data["obs"][:, 0]) + 1.0)
        return state, (delivery.valid, delivery.ids, delivery.data["g"], delivery.data["obs"])

    run = jax.jit(lambda state: jax.lax.scan(step, state, jnp.arange(steps)), donate_argnums=0)
    state, (valid, ids, g, obs) = run(state)
    assert np.asarray(valid).all()
    g, ids = np.asarray(g), np.asarray(ids)
    for t in range(steps):
        inserted = (t + 1) * per_step
        assert ((g[t] >= max(0, inserted - capacity)) & (g[t] < inserted)).all(), f"step {t}: {g[t]}"
    np.testing.assert_array_equal(ids, expected_ids(g, buffer.config.num_shards, buffer.config.shard_capacity))
    np.testing.assert_array_equal(np.asarray(obs), np.asarray(items(0, steps * per_step)["obs"])[g])
    for leaf, sharding in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(buffer.shardings)):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)  # the carry keeps the state's placement
    plane = cj.ExperienceDataPlane(SPEC, capacity, make(batch), mesh=mesh, state=state)
    assert len(plane) == capacity and plane.stats()["items_inserted"] == steps * per_step


def test_the_scan_loop_compiles_once(mesh):
    buffer = cj.make_buffer(SPEC, 64, samplers.prioritized(8), mesh=mesh)

    def step(state, t):
        state = buffer.ingest(state, items(t * 5, 5))
        state, delivery = buffer.sample(state)
        return buffer.update(state, delivery.ids, jnp.ones(8)), delivery.valid

    run = jax.jit(lambda state: jax.lax.scan(step, state, jnp.arange(4)), donate_argnums=0)
    state, _ = run(buffer.init())
    compiles = collections.Counter()
    with engine.CompileScope(compiles, "loop"):
        for _ in range(3):
            state, valid = run(state)
    assert compiles["loop"] == 0 and run._cache_size() == 1  # the state comes back placed as it went in
    assert np.asarray(valid).all()


@pytest.mark.parametrize("n", [1, 13, 3 * 64 + 1])
def test_any_static_batch_size(n):
    """Sizes that are not multiples of the shard count, and batches larger than the ring (written in order, chunk by
    chunk): the buffer then holds exactly the newest ``capacity`` items."""
    capacity = 64
    buffer = cj.make_buffer(SPEC, capacity, samplers.uniform(64), mesh=cj.default_mesh(8))
    state = jax.jit(buffer.ingest, donate_argnums=0)(buffer.init(), items(0, n))
    plane = cj.ExperienceDataPlane(SPEC, capacity, samplers.uniform(64), mesh=cj.default_mesh(8), state=state)
    assert len(plane) == min(n, capacity)
    g = np.asarray(plane.sample().data["g"])
    assert ((g >= max(0, n - capacity)) & (g < n)).all()


# -- deliveries a state cannot make ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [samplers.uniform, samplers.prioritized, samplers.fifo, samplers.epochs],
                         ids=lambda m: m.__name__)
def test_an_empty_state_delivers_a_batch_flagged_invalid_and_changes_nothing(mesh, make):
    buffer = cj.make_buffer(SPEC, 32, make(8), mesh=mesh)
    state = buffer.init(seed=1)
    before = host_leaves(state)
    assert not bool(jax.jit(buffer.can_sample)(state))
    new_state, delivery = jax.jit(buffer.sample)(state)
    assert not bool(delivery.valid)
    assert (np.asarray(delivery.ids) == -1).all()
    if delivery.weights is not None:
        assert (np.asarray(delivery.weights) == 0).all()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, host_leaves(new_state)))
    state = jax.jit(buffer.ingest)(state, items(0, 8))
    assert bool(jax.jit(buffer.can_sample)(state))
    assert bool(jax.jit(buffer.sample)(state)[1].valid)


def test_a_rate_limiter_refusal_is_flagged_invalid():
    buffer = cj.make_buffer(SPEC, 64, samplers.uniform(8), limiter=limits.min_size(20), mesh=cj.default_mesh(1))
    ingest, sample = jax.jit(buffer.ingest), jax.jit(buffer.sample)
    state = ingest(buffer.init(), items(0, 19))
    assert not bool(sample(state)[1].valid)
    assert bool(sample(ingest(state, items(19, 1)))[1].valid)


def test_a_queue_delivers_each_item_once_then_flags_invalid(mesh):
    """20 items (on 8 shards, 2.5 rows): the 16 oldest in two batches, in order; then draws flagged invalid (ids -1),
    three in a row, that leave the state bit-identical; then the 4 left with 12 more, each once, in order, and an
    invalid draw again."""
    buffer = cj.make_buffer(SPEC, 32, samplers.fifo(8), mesh=mesh)
    shards = buffer.config.num_shards
    ingest, sample = jax.jit(buffer.ingest), jax.jit(buffer.sample)
    state = ingest(buffer.init(), items(0, 20))

    def owed(first):  # the next batch: items first..first+7, each shard's block in insertion order (shard-major)
        return np.arange(first, first + 8).reshape(8 // shards, shards).T.reshape(-1)

    def check_valid(delivery, first):
        assert bool(delivery.valid)
        np.testing.assert_array_equal(np.asarray(delivery.data["g"]), owed(first))
        np.testing.assert_array_equal(np.asarray(delivery.data["obs"]), np.asarray(items(0, 32)["obs"])[owed(first)])
        np.testing.assert_array_equal(np.asarray(delivery.ids),
                                      expected_ids(owed(first), shards, buffer.config.shard_capacity))

    def check_invalid(state):
        before = host_leaves(state)
        for _ in range(3):
            state, delivery = sample(state)
            assert not bool(delivery.valid) and (np.asarray(delivery.ids) == -1).all()
            assert all(a.tobytes() == b.tobytes() for a, b in zip(before, host_leaves(state)))
        return state

    for first in (0, 8):
        state, delivery = sample(state)
        check_valid(delivery, first)
    state = check_invalid(state)  # 4 undelivered items: fewer than a batch
    state = ingest(state, items(20, 12))
    for first in (16, 24):
        state, delivery = sample(state)
        check_valid(delivery, first)
    check_invalid(state)


def test_updates_inside_jit_skip_what_the_plane_would_refuse_and_apply_the_rest():
    """Nothing can be refused inside a trace: ids of an invalid delivery (-1), rows out of range, and NaN, infinite or
    negative priorities are skipped; the valid ones leave the state exactly as the plane's update of them alone."""
    sampler = samplers.prioritized(8)
    plane = cj.ExperienceDataPlane(SPEC, 32, sampler, mesh=cj.default_mesh(8))
    plane.ingest(jax.device_get(items(0, 24)))
    buffer = plane.buffer()
    good_ids = expected_ids(np.array([0, 5, 9]), 8, 4).astype(np.int32)
    bad_ids = np.array([[-1, -1], [40, 1], [3, 1], [4, 1], [6, 1]], np.int32)
    ids = np.concatenate([good_ids, bad_ids])
    priorities = np.array([2.0, 3.0, 4.0, 1.0, 1.0, np.nan, -1.0, np.inf], np.float32)
    functional = jax.jit(buffer.update)(plane.state, ids, priorities)
    plane.update_priorities(good_ids, priorities[:3])
    assert_same_state(functional, plane.state)


# -- the plane under a trace ------------------------------------------------------------------------------------------
def test_plane_calls_under_a_trace_raise_and_point_to_the_functional_api(state_snapshot):
    plane = cj.ExperienceDataPlane(SPEC, 32, samplers.prioritized(8), mesh=cj.default_mesh(1))
    plane.ingest(jax.device_get(items(0, 16)))
    check = state_snapshot(plane)
    calls = {
        "ingest()": lambda x: plane.ingest({"g": x.astype(jnp.int32), "obs": jnp.zeros((3, 3))}),
        "sample()": lambda x: plane.sample(),
        "deliver()": lambda x: plane.deliver(),
        "update_priorities()": lambda x: plane.update_priorities(jnp.zeros((3, 2), jnp.int32), x),
        "set_policy_version()": lambda x: plane.set_policy_version(1),
    }
    for name, call in calls.items():
        with pytest.raises(cj.ConfigError, match=re.escape(name) + r": called under a JAX trace.*functional API.*"
                                                                   r"plane.buffer\(\)"):
            jax.jit(call)(jnp.ones(3))
        with pytest.raises(cj.ConfigError, match="called under a JAX trace"):
            jax.lax.scan(lambda c, x: (call(x), None), 0, jnp.ones((2, 3)))
    check()
    assert len(plane) == 16  # no tracer was left in the plane


def test_sample_fn_flags_an_empty_plane_invalid():
    plane = cj.ExperienceDataPlane(SPEC, 32, samplers.uniform(8), mesh=cj.default_mesh(8))
    state, delivery = jax.jit(plane.sample_fn(), donate_argnums=0)(plane.state)
    plane.state = state
    assert not bool(delivery.valid) and (np.asarray(delivery.ids) == -1).all()


# -- placements -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage_kind", ["device", "unpinned_host", "pinned_host"])
def test_every_planned_memory_kind_works_inside_jit(storage_kind):
    base = placement.plan(cj.ExperienceSpec.from_structs(SPEC), 64, placement.emulated_cpu(),
                          placement.Workload(batch_size=8, sampler="prioritized"))
    plan = dataclasses.replace(base, placement=dataclasses.replace(base.placement, storage=storage_kind))
    buffer = cj.make_buffer(SPEC, 64, samplers.prioritized(8), plan=plan)

    def step(state, t):
        state = buffer.ingest(state, items(t * 6, 6))
        state, delivery = buffer.sample(state)
        return buffer.update(state, delivery.ids, jnp.ones(8)), delivery.data["g"]

    # unpinned host memory: JAX places a jit's results there only through out_shardings (see functional.py)
    out = {"out_shardings": (buffer.shardings, None)} if storage_kind == "unpinned_host" else {}
    state, g = jax.jit(lambda s: jax.lax.scan(step, s, jnp.arange(5)), donate_argnums=0, **out)(buffer.init())
    assert state.storage.rows.sharding.memory_kind == storage_kind
    assert (np.asarray(g) < 30).all()
    plane = cj.ExperienceDataPlane(SPEC, 64, samplers.prioritized(8), plan=plan, state=state)
    assert set(np.asarray(plane.sample().data["g"]).tolist()) <= set(range(30))


# -- one state for the plane, the functional API and checkpoints ------------------------------------------------------
@pytest.mark.parametrize("make", [samplers.uniform, samplers.prioritized], ids=lambda m: m.__name__)
def test_the_functional_api_and_the_plane_make_the_same_draws(mesh, make):
    plane = cj.ExperienceDataPlane(SPEC, 64, make(16), mesh=mesh, seed=7)
    buffer = cj.make_buffer(SPEC, 64, make(16), mesh=mesh)
    state = buffer.init(seed=7)
    assert_same_state(state, plane.state)
    ingest, sample, update = (jax.jit(f, donate_argnums=0) for f in (buffer.ingest, buffer.sample, buffer.update))
    for step in range(3):
        batch = items(20 * step, 20)
        plane.ingest(jax.device_get(batch))
        state = ingest(state, batch)
        delivery = plane.sample()
        state, ours = sample(state)
        for a, b in zip(jax.tree_util.tree_leaves(delivery), jax.tree_util.tree_leaves(ours._replace(valid=None))):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
        if ours.weights is not None:
            priorities = np.arange(16, dtype=np.float32) + step
            plane.update_priorities(delivery.ids, priorities)
            state = update(state, ours.ids, priorities)
    assert_same_state(state, plane.state)


def test_a_state_round_trips_plane_functional_plane_checkpoint_bit_exactly(tmp_path):
    sampler = samplers.prioritized(8)
    plane = cj.ExperienceDataPlane(SPEC, 64, sampler, mesh=cj.default_mesh(8), seed=3)
    plane.ingest(jax.device_get(items(0, 30)))
    buffer = plane.buffer()

    @functools.partial(jax.jit, donate_argnums=0)
    def learn(state):
        state = buffer.ingest(state, items(30, 12))
        state, delivery = buffer.sample(state)
        return buffer.update(state, delivery.ids, jnp.arange(8, dtype=jnp.float32) + 0.5)

    plane.state = learn(plane.state)
    plane.ingest(jax.device_get(items(42, 5)))
    plane.save(tmp_path, block=True)
    restored = cj.ExperienceDataPlane.restore(tmp_path, mesh=cj.default_mesh(8))
    assert_same_state(restored.state, plane.state)
    a, b = plane.sample(), restored.sample()  # the random stream continues exactly
    assert np.asarray(a.ids).tobytes() == np.asarray(b.ids).tobytes()
    assert_same_state(restored.state, plane.state)


def test_a_state_of_another_configuration_is_refused():
    buffer = cj.make_buffer(SPEC, 64, samplers.uniform(8), mesh=cj.default_mesh(1))
    with pytest.raises(cj.ConfigError, match="leaf .*storage.*must be"):
        cj.ExperienceDataPlane(SPEC, 128, samplers.uniform(8), mesh=cj.default_mesh(1), state=buffer.init())
    plane = cj.ExperienceDataPlane(SPEC, 64, samplers.prioritized(8), mesh=cj.default_mesh(1))
    with pytest.raises(cj.ConfigError, match="ReplayState of this buffer's configuration"):
        plane.state = buffer.init()
    assert len(plane) == 0


def test_the_readme_runs_top_to_bottom_as_written(tmp_path):
    """Every Python block of the README, in order, as one script in a fresh process (as a new user pastes them: the
    runtime set-up first, before JAX starts), on the 8-device test mesh; checkpoints go to a temporary folder."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    script = "\n".join(re.findall(r"```python\n(.*?)```", readme, flags=re.S))
    script = script.replace("/tmp/replay-ckpt", str(tmp_path / "replay")).replace("/tmp/plane-ckpt",
                                                                                 str(tmp_path / "plane"))
    (tmp_path / "readme.py").write_text(script)
    result = subprocess.run([sys.executable, "-W", "error::conduit_jax.ConduitWarning", str(tmp_path / "readme.py")],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[:2] == ["12000 True", "12000"]  # the Quickstart's two prints
    assert "(64, 8) P('shard',)" in lines  # the plane block's delivery, sharded on the batch axis


# -- retire, read, item ids, buffer-normalised weights ----------------------------------------------------------------
@pytest.mark.parametrize("shards", [1, 8])
def test_item_ids_read_and_retire(shards):
    """``item_ids`` names the g-th item as the delivery does, ``read`` returns what those rows hold, and a retired item
    is never drawn again: 16,384 draws after retiring 24 of 40 live items (3 of them overwritten since: ignored)."""
    from scipy import stats

    capacity = 32
    buffer = cj.make_buffer(SPEC, capacity, samplers.prioritized(64, alpha=0.0), mesh=cj.default_mesh(shards))
    state = jax.jit(buffer.ingest)(buffer.init(3), items(0, 40))  # items 8..39 live
    ids = buffer.item_ids(np.arange(40))
    np.testing.assert_array_equal(ids, expected_ids(np.arange(40), shards, capacity // shards))
    # the rows alone (a host's bookkeeping): the ids' first column, -1 for a negative item (no item)
    np.testing.assert_array_equal(replay.item_rows(buffer.config, np.r_[np.arange(40), -1]), np.r_[ids[:, 0], -1])
    data = jax.jit(buffer.read)(state, ids[8:, 0])
    np.testing.assert_array_equal(np.asarray(data["g"]), np.arange(8, 40))
    np.testing.assert_array_equal(np.asarray(data["obs"]), np.asarray(items(8, 32)["obs"]))
    gone = np.arange(5, 29)  # 5..7 were overwritten by 37..39: their ids name nothing now
    state = jax.jit(buffer.retire)(state, ids[gone])
    sample = jax.jit(buffer.sample)
    counts = np.zeros(40, np.int64)
    for _ in range(256):
        state, delivery = sample(state)
        counts += np.bincount(np.asarray(delivery.data["g"]), minlength=40)
    assert not counts[:29].any(), "a retired or overwritten item was drawn"
    assert stats.chisquare(counts[29:]).pvalue > 1e-3  # alpha 0: uniform over what is left
    with pytest.raises(cj.ConfigError, match="retire"):
        cj.make_buffer(SPEC, capacity, samplers.uniform(8), mesh=cj.default_mesh(1)).retire(state, ids[:2])


def test_retire_writes_only_the_named_leaves_and_keeps_the_tree_exact():
    """A prioritized buffer's retire touches the named items' leaves (now 0) and their ancestors only, O(m log n):
    the tree it leaves equals the tree rebuilt from its leaves (the O(capacity) way), bit for bit, and the other
    leaves keep their masses."""
    from conduit_jax import sumtree

    buffer = cj.make_buffer(SPEC, 5000, samplers.prioritized(64, alpha=0.6), mesh=cj.default_mesh(1))
    state = jax.jit(buffer.ingest)(buffer.init(0), items(0, 4000))
    ids = buffer.item_ids(np.arange(4000))
    rng = np.random.default_rng(2)
    state = jax.jit(buffer.update)(state, ids[:64 * 16:16], rng.random(64).astype(np.float32) * 10)
    before = np.asarray(state.sampler.levels[-1])
    gone = rng.choice(4000, 50, replace=False)
    state = jax.jit(buffer.retire)(state, ids[gone])
    levels = [np.asarray(level) for level in state.sampler.levels]
    kept = np.setdiff1d(np.arange(5000), gone)
    assert not levels[-1][gone].any() and np.array_equal(levels[-1][kept], before[kept])
    for got, want in zip(levels, sumtree.from_leaves(jnp.asarray(levels[-1]), len(levels))):
        np.testing.assert_array_equal(got, np.asarray(want))


def test_buffer_normalised_weights_divide_by_the_smallest_probability():
    """normalise="buffer": w_i = (p_i / p_min)^-beta over every stored item, whatever the batch drew."""
    buffer = cj.make_buffer(SPEC, 16, samplers.prioritized(8, alpha=1.0, beta=0.5, eps=1e-9, normalise="buffer"),
                            mesh=cj.default_mesh(1))
    state = jax.jit(buffer.ingest)(buffer.init(0), items(0, 16))
    ids = buffer.item_ids(np.arange(16))
    priorities = np.linspace(0.5, 8.0, 16).astype(np.float32)
    state = jax.jit(buffer.update)(state, ids, priorities)
    state, delivery = jax.jit(buffer.sample)(state)
    g = np.asarray(delivery.data["g"])
    np.testing.assert_allclose(np.asarray(delivery.weights), (priorities[g] / 0.5) ** -0.5, rtol=1e-5)
    with pytest.raises(cj.ConfigError, match="normalise"):
        samplers.prioritized(8, normalise="max")
