"""The fully jitted learners of ``experiments/jitted.py`` (env step, ingest, sample, priority update and learner step
in one ``lax.scan`` over Conduit's functional buffer) run end to end, and a second call compiles nothing."""

import jax
import numpy as np
import pytest

from experiments import jitted

NUM_ENVS = 8


def _dqn(prioritized: bool, devices: int = 1) -> jitted.DQNConfig:
    # 40 iterations x 8 envs = 320 env steps, learning from 128 on: 25 updates of 32 from a ring that never wraps
    return jitted.DQNConfig(num_envs=NUM_ENVS, total_env_steps=320, learning_starts=128, capacity=1024,
                            batch_size=32, hidden=16, target_period=10, prioritized=prioritized, devices=devices,
                            record_ids=True)


def _run_twice(train):
    """Two calls of the jitted train; the second must reuse the first's executable."""
    carry, metrics = jax.block_until_ready(train(jax.random.key(0)))
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    again = jax.block_until_ready(train(jax.random.key(1)))
    assert train._cache_size() == 1, "the second call of the jitted train recompiled"
    assert not compiles, compiles
    del again
    return carry, jax.device_get(metrics)


def _stored_rows(n_items: int, capacity: int, shards: int) -> set[int]:
    """Global rows holding the first ``n_items`` items (no wrap): rank r is dealt to shard r % S, slot r // S."""
    per_shard = capacity // shards
    return {(r % shards) * per_shard + r // shards for r in range(n_items)}


@pytest.mark.parametrize("prioritized", [False, True], ids=["uniform", "per"])
def test_dqn_runs_end_to_end_with_conduit(prioritized):
    config = _dqn(prioritized)
    train = jitted.make_train(config, "conduit")
    carry, m = _run_twice(train)
    buffer = train.parts.buffer
    iterations = config.iterations
    assert np.isfinite(m["loss"]).all() and np.isfinite(m["episode_return"]).all()
    updated = m["updated"][:, 0]
    first = config.learning_starts // NUM_ENVS - 1  # the iteration whose env steps reach learning_starts
    assert not updated[:first].any() and updated[first:].all()
    assert int(carry.learner.step) == iterations - first
    # every env step went into the buffer, one ingest of NUM_ENVS per iteration
    assert int(buffer.size(carry.replay)) == iterations * NUM_ENVS
    ids = m["ids"][:, 0]  # [iterations, B, 2]
    assert (ids[~updated] == -1).all()
    for t in np.flatnonzero(updated):  # a draw only names items stored before it (this ring never wraps)
        rows, generation = ids[t, :, 0], ids[t, :, 1]
        assert (generation == 1).all()
        assert set(rows.tolist()) <= _stored_rows((t + 1) * NUM_ENVS, config.capacity, 1)
    summary = jitted.summarize(m, train.parts)
    assert summary["env_steps"] == iterations * NUM_ENVS and summary["updates"] == iterations - first
    assert summary["finite"]


def test_dqn_per_priorities_change_the_draws():
    """With priorities from |TD error| the sampler's tree holds the learner's priorities, not the initial maximum."""
    config = _dqn(True)
    train = jitted.make_train(config, "conduit")
    carry, _ = jax.block_until_ready(train(jax.random.key(0)))
    leaves = np.asarray(carry.replay.sampler.levels[-1]).ravel()[:config.iterations * NUM_ENVS]
    assert np.isfinite(leaves).all() and (leaves > 0).all()
    assert len(np.unique(leaves)) > 10  # updated priorities differ item by item


def test_ppo_runs_end_to_end_with_epochs_on_the_8_device_mesh():
    config = jitted.PPOConfig(num_envs=NUM_ENVS, num_steps=32, total_env_steps=512, epochs=2, num_minibatches=4,
                              hidden=16, devices=8)
    train = jitted.make_train(config, "conduit")
    carry, m = _run_twice(train)
    assert np.isfinite(m["loss"]).all() and m["updated"].all()
    assert int(train.parts.buffer.size(carry.replay)) == config.rollout_size
    # each epoch delivers every row of the rollout exactly once (ingest starts a fresh epoch)
    ids = m["ids"].reshape(config.iterations, config.epochs, config.rollout_size, 2)
    every_row = np.arange(config.rollout_size)
    for it in range(config.iterations):
        for epoch in range(config.epochs):
            np.testing.assert_array_equal(np.sort(ids[it, epoch, :, 0]), every_row)
            assert (ids[it, epoch, :, 1] == it + 1).all()  # the rollout of this iteration: ring lap it + 1


def test_make_train_rejects_bad_arguments():
    with pytest.raises(ValueError, match="buffer_kind"):
        jitted.make_train(_dqn(False), "reverb")
    with pytest.raises(ValueError, match="Flashbax has no sampling without replacement"):
        jitted.make_train(jitted.PPOConfig(), "flashbax")
    with pytest.raises(ValueError, match="gate"):
        jitted.make_train(jitted.DQNConfig(gate="sometimes"))
