"""Sequence replay: every delivered window is consecutive retained steps of one environment, episode ends are respected
(pad=False) or masked (pad=True), windows start only every ``period`` steps, selection is uniform over the eligible
windows (chi-square) or prioritized, bad configurations are refused, and ``transforms.n_step`` on padded windows equals
a NumPy reference computed from the raw trajectories.

Trajectories are ``[steps, streams]`` arrays ingested time-major (env e of step t at position ``t * streams + e``).
Every item carries its env and per-env time ``t``, so a window names exactly which steps it holds. Geometry (S shards,
C = capacity / S slots each, stride = streams / S): env e lives in shard e % S, its step t at shard position
``t * stride + e // S``, i.e. slot ``pos % C`` of generation ``pos // C + 1``; a shard keeps the last
``R = capacity / streams`` steps of each of its envs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from conduit_jax import (ConfigError, ExperienceDataPlane, NotEnoughDataError, SpecError, samplers)
from conduit_jax.replay import default_mesh
from conduit_jax.transforms import n_step

STREAMS = 8
P_MIN = 1e-3  # chi-square tests reject below this p-value (fixed seeds: a pass is deterministic)
SPEC = {
    "env": jax.ShapeDtypeStruct((), np.int32),
    "t": jax.ShapeDtypeStruct((), np.int32),
    "obs": jax.ShapeDtypeStruct((2,), np.float32),
    "next_obs": jax.ShapeDtypeStruct((2,), np.float32),
    "reward": jax.ShapeDtypeStruct((), np.float32),
    "terminated": jax.ShapeDtypeStruct((), np.bool_),
    "truncated": jax.ShapeDtypeStruct((), np.bool_),
}


def trajectories(seed, steps, streams=STREAMS, p_terminated=0.1, p_truncated=0.08):
    """Random episodes: each step terminates with p_terminated, else truncates with p_truncated (never both)."""
    rng = np.random.default_rng(seed)
    u = rng.random((steps, streams))
    t, env = np.meshgrid(np.arange(steps), np.arange(streams), indexing="ij")
    obs = np.stack([env * 1000 + t, -t], axis=-1).astype(np.float32)
    return {
        "env": env.astype(np.int32), "t": t.astype(np.int32),
        "obs": obs, "next_obs": obs + np.float32(0.5),
        "reward": rng.normal(size=(steps, streams)).astype(np.float32),
        "terminated": u < p_terminated,
        "truncated": (u >= p_terminated) & (u < p_terminated + p_truncated),
    }


def ingest_steps(plane, traj, start, stop):
    plane.ingest({k: v[start:stop].reshape(-1, *v.shape[2:]) for k, v in traj.items()})


def ends_of(traj):
    return traj["terminated"] | traj["truncated"]


def window_starts(ids, plane):
    """(env, t0) of each window from its id (row of the start step, generation), by the ring geometry."""
    ids = np.asarray(ids)
    shards, shard_capacity = plane.num_shards, plane.capacity // plane.num_shards
    stride = plane.sampler.streams // shards
    shard, slot = ids[:, 0] // shard_capacity, ids[:, 0] % shard_capacity
    position = (ids[:, 1] - 1) * shard_capacity + slot
    return (position % stride) * shards + shard, position // stride


def eligible_windows(traj, done, plane, pad, period):
    """The reference set of (env, t0) that may start a window after ``done`` steps were ingested."""
    window, retained = plane.sampler.window, plane.capacity // plane.sampler.streams
    ends = ends_of(traj)
    out = set()
    for t0 in range(max(0, done - retained), done - window + 1):
        if t0 % period:
            continue
        for env in range(plane.sampler.streams):
            if pad or not ends[t0:t0 + window - 1, env].any():
                out.add((env, t0))
    return out


def check_windows(delivery, traj, done, plane, pad, period=1):
    """Every window is ``window`` consecutive retained steps of one env, starts at an eligible step, holds exactly the
    stored values of those steps, and (pad) carries the first-episode mask. Returns the (env, t0) of the batch."""
    window = plane.sampler.window
    data = jax.tree_util.tree_map(np.asarray, delivery.data)
    env, t0 = window_starts(delivery.ids, plane)
    steps = t0[:, None] + np.arange(window)[None, :]
    assert data["t"].shape == (plane.batch_size, window)
    np.testing.assert_array_equal(data["env"], np.broadcast_to(env[:, None], steps.shape), err_msg="env of a step")
    np.testing.assert_array_equal(data["t"], steps, err_msg="steps of a window are not consecutive from its id")
    assert (t0 >= done - plane.capacity // plane.sampler.streams).all(), "a window holds overwritten steps"
    assert (steps < done).all()
    assert (t0 % period == 0).all(), "a window starts off the period"
    for key, ref in traj.items():
        np.testing.assert_array_equal(data[key], ref[steps, env[:, None]], err_msg=key)
    ends = ends_of(traj)[steps, env[:, None]]
    if pad:
        first_episode = np.cumsum(ends, axis=1) - ends == 0
        np.testing.assert_array_equal(np.asarray(delivery.mask), first_episode)
    else:
        assert delivery.mask is None
        assert not ends[:, :-1].any(), "a window crosses an episode end"
    assert {(int(e), int(t)) for e, t in zip(env, t0)} <= eligible_windows(traj, done, plane, pad, period)
    return env, t0


def make_plane(mesh, capacity, sampler, seed=0, spec=SPEC):
    return ExperienceDataPlane(spec, capacity, sampler, mesh=mesh, seed=seed)


# -- windows ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
def test_windows_are_consecutive_retained_steps_of_one_env(mesh, pad):
    """Ingest in chunks of 1, 3 and 9 steps (each below R - window + 1 = 9 + 1 steps) through 4 laps of the ring and
    check every batch sampled along the way."""
    capacity, window = STREAMS * 12, 4
    plane = make_plane(mesh, capacity, samplers.sequences(32, window, STREAMS, pad=pad), seed=1)
    traj = trajectories(seed=2, steps=52)
    done, seen_masked, seen_end_at_last = 0, 0, 0
    for chunk in [1, 3, 9, 1, 9, 3, 9, 1, 3, 9, 1, 3]:
        ingest_steps(plane, traj, done, done + chunk)
        done += chunk
        if done < window:
            assert not plane.can_sample()
            continue
        for _ in range(2):
            delivery = plane.sample()
            env, t0 = check_windows(delivery, traj, done, plane, pad)
            ends = ends_of(traj)[t0[:, None] + np.arange(window), env[:, None]]
            seen_end_at_last += int(ends[:, -1].sum())
            if pad:
                seen_masked += int((~np.asarray(delivery.mask)).any(axis=1).sum())
    assert done == 52 and seen_end_at_last > 0
    assert seen_masked > 0 or not pad  # padded windows did run past episode ends


@pytest.mark.parametrize("schedule", [[5, 12, 12], [5, 24]], ids=["full_ring", "over_capacity"])
def test_ingest_of_a_full_ring_never_joins_overwritten_steps(mesh, schedule):
    """One ingest call that writes more than R - (window - 1) steps per env (a full ring: `capacity` items, or more,
    which the plane splits into calls of `capacity` items) must not make a window of steps overwritten in that same
    call. No episode ends here, so every retained window of 4 consecutive steps is eligible.

    Fails at 79df7f0: samplers.sequences.on_insert marks the window that ends at each new row eligible, and it zeroes
    the windows that start at new rows *before* that, so when row i's window start slot is rewritten by a later row of
    the same call (count > C - (window - 1) * stride rows in one shard) the stale start stays eligible and its window
    joins the newest step with the oldest ones, e.g. t = [14, 15, 16, 5]."""
    capacity, window = STREAMS * 12, 4
    plane = make_plane(mesh, capacity, samplers.sequences(32, window, STREAMS), seed=3)
    traj = trajectories(seed=4, steps=sum(schedule), p_terminated=0.0, p_truncated=0.0)
    done = 0
    for chunk in schedule:
        ingest_steps(plane, traj, done, done + chunk)
        done += chunk
        for _ in range(4):
            check_windows(plane.sample(), traj, done, plane, pad=False)


@pytest.mark.parametrize("pad, period, burn_in", [(False, 1, 0), (True, 3, 1), (True, 1, 1)],
                         ids=["nopad", "pad_period3_burnin1", "pad_burnin1"])
def test_uniform_over_eligible_windows(mesh, pad, period, burn_in):
    """A small ring (8 steps per env, windows of 3): every eligible window is drawn and the draws are uniform over
    them (chi-square over window starts, 200 batches of 32). ``pad_burnin1`` is the variant without an index (draws
    are arithmetic on the cursor), after the ring has wrapped."""
    capacity, length = STREAMS * 8, 3 - burn_in
    plane = make_plane(mesh, capacity, samplers.sequences(32, length, STREAMS, burn_in=burn_in, pad=pad,
                                                          period=period), seed=5)
    assert plane.sampler.window == 3
    traj = trajectories(seed=6, steps=21, p_terminated=0.12, p_truncated=0.1)
    for start, stop in [(0, 5), (5, 11), (11, 16), (16, 21)]:
        ingest_steps(plane, traj, start, stop)
    eligible = sorted(eligible_windows(traj, 21, plane, pad, period))
    assert len(eligible) >= 12
    index = {w: i for i, w in enumerate(eligible)}
    counts = np.zeros(len(eligible), np.int64)
    for _ in range(200):
        env, t0 = check_windows(plane.sample(), traj, 21, plane, pad, period)
        np.add.at(counts, [index[(int(e), int(t))] for e, t in zip(env, t0)], 1)
    assert (counts > 0).all(), "an eligible window was never drawn"
    result = stats.chisquare(counts)
    assert result.pvalue > P_MIN, result


def test_prioritized_windows_follow_their_priorities(mesh):
    """sequences(alpha=...): priorities attach to window ids; windows never updated keep the mass they got at insertion
    ((1 + eps)^alpha: the max priority then); draws follow (p + eps)^alpha (chi-square) and weights match the
    reference (N * P)^-beta / max (N cancels in the normalisation)."""
    capacity, window, alpha, beta, eps = STREAMS * 8, 2, 0.8, 0.6, 1e-6
    plane = make_plane(mesh, capacity, samplers.sequences(32, window, STREAMS, alpha=alpha, beta=beta, eps=eps),
                       seed=7)
    traj = trajectories(seed=8, steps=14)
    ingest_steps(plane, traj, 0, 7)
    ingest_steps(plane, traj, 7, 14)
    eligible = sorted(eligible_windows(traj, 14, plane, pad=False, period=1))
    index = {w: i for i, w in enumerate(eligible)}
    delivery = plane.sample()
    env, t0 = check_windows(delivery, traj, 14, plane, pad=False)
    rng = np.random.default_rng(9)
    priority = np.ones(len(eligible))  # the max priority when they were inserted
    chosen = np.array([index[(int(e), int(t))] for e, t in zip(env, t0)])
    new = rng.choice([0.0, 0.1, 3.0, 20.0], len(eligible))
    plane.update_priorities(delivery.ids, new[chosen])  # duplicates carry the same value
    assert plane.stats()["priority_updates_ignored"] == 0
    priority[chosen] = new[chosen]
    p = np.power(priority + eps, alpha)
    p /= p.sum()
    counts = np.zeros(len(eligible), np.int64)
    for _ in range(150):
        delivery = plane.sample()
        env, t0 = check_windows(delivery, traj, 14, plane, pad=False)
        chosen = np.array([index[(int(e), int(t))] for e, t in zip(env, t0)])
        np.add.at(counts, chosen, 1)
        w = np.power(p[chosen], -beta)
        np.testing.assert_allclose(delivery.weights, w / w.max(), rtol=1e-5)
    small = p * counts.sum() < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(p[~small], p[small].sum()) * counts.sum()
    result = stats.chisquare(observed, expected)
    assert result.pvalue > P_MIN, result


# -- refusals ---------------------------------------------------------------------------------------------------------
def test_streams_must_be_a_multiple_of_the_shards():
    with pytest.raises(ConfigError, match=r"streams \(4\) must be a multiple of the 8 shards"):
        make_plane(default_mesh(8), 64, samplers.sequences(8, 2, streams=4))
    make_plane(default_mesh(1), 64, samplers.sequences(8, 2, streams=4))  # one shard: any stream count


@pytest.mark.parametrize("change", ["missing", "int8", "shape"])
@pytest.mark.parametrize("key", ["terminated", "truncated"])
def test_episode_end_leaves_must_be_per_item_bools(key, change):
    spec = dict(SPEC)
    if change == "missing":
        del spec[key]
    else:
        spec[key] = jax.ShapeDtypeStruct((2,) if change == "shape" else (), np.bool_ if change == "shape" else np.int8)
    with pytest.raises(ConfigError, match=f"needs a per-item bool leaf '{key}'"):
        make_plane(default_mesh(1), 64, samplers.sequences(8, 2, STREAMS), spec=spec)


def test_custom_end_keys():
    spec = {"x": SPEC["t"], "done": jax.ShapeDtypeStruct((), np.bool_)}
    plane = make_plane(default_mesh(1), 16, samplers.sequences(4, 3, 1, end_keys=("done",)), spec=spec)
    plane.ingest({"x": np.arange(10, dtype=np.int32), "done": np.arange(10) == 4})
    starts = set()
    for _ in range(10):
        x = np.asarray(plane.sample().data["x"])
        assert (np.diff(x, axis=1) == 1).all() and not ((x[:, :-1] == 4).any())
        starts |= set(x[:, 0].tolist())
    assert starts == {0, 1, 2, 5, 6, 7}


def test_ingest_batch_must_hold_whole_steps(state_snapshot):
    plane = make_plane(default_mesh(1), 64, samplers.sequences(8, 2, STREAMS))
    traj = trajectories(seed=0, steps=3)
    ingest_steps(plane, traj, 0, 2)
    check = state_snapshot(plane)
    part = {k: v.reshape(-1, *v.shape[2:])[:12] for k, v in traj.items()}
    with pytest.raises(SpecError, match="multiple of 8 items; got 12"):
        plane.ingest(part)
    check()


@pytest.mark.parametrize("capacity, shards, message", [
    (16, 1, "at least 3 steps"),  # 2 steps per env for windows of 3
    (68, 1, "must be a multiple of 8"),  # 8.5 steps per env
    (16, 8, "at least 3 steps"),
])
def test_ring_must_hold_a_window_per_stream(capacity, shards, message):
    with pytest.raises(ConfigError, match=message):
        make_plane(default_mesh(shards), capacity, samplers.sequences(8, 3, STREAMS))


@pytest.mark.parametrize("kwargs", [
    {"length": 0}, {"length": 1.5}, {"streams": 0}, {"period": 0}, {"burn_in": -1}, {"end_keys": ()},
    {"end_keys": ("done", 3)}, {"batch_size": 0}, {"length": True},
])
def test_bad_sequence_arguments(kwargs):
    kwargs = {"batch_size": 8, "length": 2, "streams": 4, **kwargs}
    with pytest.raises(ConfigError):
        samplers.sequences(**kwargs)


def test_no_window_yet_raises_not_enough_data(mesh):
    plane = make_plane(mesh, STREAMS * 8, samplers.sequences(8, 3, STREAMS))
    traj = trajectories(seed=0, steps=6, p_terminated=0.0, p_truncated=0.0)
    ingest_steps(plane, traj, 0, 2)  # 2 steps: no window of 3 yet
    assert not plane.can_sample()
    with pytest.raises(NotEnoughDataError, match="eligible windows"):
        plane.sample()
    ingest_steps(plane, traj, 2, 3)
    assert plane.can_sample()
    env, t0 = check_windows(plane.sample(), traj, 3, plane, pad=False)
    assert (t0 == 0).all()


def test_padded_windows_need_a_window_of_every_stream(mesh):
    """The index-free sampler (pad=True, uniform) counts items: it refuses until every stream holds a whole window,
    says so in items, and then draws only windows of stored steps; its state holds no tree."""
    plane = make_plane(mesh, STREAMS * 8, samplers.sequences(8, 3, STREAMS, pad=True))
    assert not hasattr(plane.state.sampler, "levels")
    traj = trajectories(seed=0, steps=6, p_terminated=0.3, p_truncated=0.0)
    ingest_steps(plane, traj, 0, 2)
    assert not plane.can_sample()
    with pytest.raises(NotEnoughDataError, match=rf"at least {3 * STREAMS} stored items .*has {2 * STREAMS}"):
        plane.sample()
    ingest_steps(plane, traj, 2, 3)
    env, t0 = check_windows(plane.sample(), traj, 3, plane, pad=True)
    assert (t0 == 0).all()


def test_episodes_shorter_than_the_window_leave_nothing_to_sample():
    plane = make_plane(default_mesh(1), STREAMS * 8, samplers.sequences(8, 3, STREAMS))
    traj = trajectories(seed=0, steps=6, p_terminated=0.5, p_truncated=0.5)  # every step ends an episode
    ingest_steps(plane, traj, 0, 6)
    assert not plane.can_sample()
    with pytest.raises(NotEnoughDataError):
        plane.sample()


# -- n-step -----------------------------------------------------------------------------------------------------------
def reference_n_step(traj, env, t0, n, gamma):
    """n-step transitions from the raw per-env trajectories (float64)."""
    out = {k: [] for k in [*traj, "discount", "n_steps"]}
    for e, t in zip(env, t0):
        steps = np.arange(t, t + n)
        ends = ends_of(traj)[steps, e]
        m = int(np.argmax(ends)) + 1 if ends.any() else n
        last = t + m - 1
        for key, value in traj.items():
            out[key].append(value[t, e])
        out["reward"][-1] = sum(gamma**k * float(traj["reward"][t + k, e]) for k in range(m))
        out["next_obs"][-1] = traj["next_obs"][last, e]
        out["terminated"][-1] = traj["terminated"][last, e]
        out["truncated"][-1] = traj["truncated"][last, e]
        out["n_steps"].append(m)
        out["discount"].append(gamma**m * (1.0 - float(traj["terminated"][last, e])))
    return {k: np.asarray(v) for k, v in out.items()}


def test_n_step_equals_reference_on_hand_built_windows():
    """Three windows of n = 3: no end, a termination at step 1, a truncation at step 0 (then another episode)."""
    gamma = 0.5
    data = {
        "reward": jnp.asarray([[1.0, 2.0, 4.0], [1.0, 2.0, 4.0], [1.0, 2.0, 4.0]]),
        "terminated": jnp.asarray([[False, False, False], [False, True, False], [False, False, True]]),
        "truncated": jnp.asarray([[False, False, False], [False, False, False], [True, False, False]]),
        "next_obs": jnp.asarray([[10.0, 11.0, 12.0], [20.0, 21.0, 22.0], [30.0, 31.0, 32.0]]),
        "obs": jnp.asarray([[9.0, 10.0, 11.0], [19.0, 20.0, 21.0], [29.0, 30.0, 31.0]]),
    }
    mask = samplers.sequences(3, 3, 1, pad=True).mask(data)
    np.testing.assert_array_equal(mask, [[True] * 3, [True, True, False], [True, False, False]])
    out = n_step(data, mask, gamma)
    np.testing.assert_allclose(out["reward"], [1 + 1 + 1, 1 + 1, 1])
    np.testing.assert_allclose(out["discount"], [0.125, 0.0, 0.5])  # terminated: no bootstrap; truncated: gamma^1
    np.testing.assert_array_equal(out["next_obs"], [12.0, 21.0, 30.0])
    np.testing.assert_array_equal(out["obs"], [9.0, 19.0, 29.0])
    np.testing.assert_array_equal(out["terminated"], [False, True, False])  # of the last step used
    np.testing.assert_array_equal(out["truncated"], [False, False, True])
    np.testing.assert_array_equal(out["n_steps"], [3, 2, 1])


def test_n_step_on_sampled_windows_equals_reference(mesh):
    capacity, n, gamma = STREAMS * 16, 4, 0.9
    plane = make_plane(mesh, capacity, samplers.sequences(32, n, STREAMS, pad=True), seed=11)
    traj = trajectories(seed=12, steps=40, p_terminated=0.12, p_truncated=0.1)
    for start in range(0, 40, 10):
        ingest_steps(plane, traj, start, start + 10)
    transform = jax.jit(functools.partial(n_step, gamma=gamma))
    kinds = {"full": 0, "terminated": 0, "truncated": 0}
    for _ in range(20):
        delivery = plane.sample()
        env, t0 = check_windows(delivery, traj, 40, plane, pad=True)
        got = jax.tree_util.tree_map(np.asarray, transform(delivery.data, delivery.mask))
        want = reference_n_step(traj, env, t0, n, gamma)
        assert set(got) == set(want)
        np.testing.assert_allclose(got["reward"], want["reward"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got["discount"], want["discount"], rtol=1e-6, atol=0)
        np.testing.assert_array_equal(got["n_steps"], want["n_steps"])
        for key in traj:
            if key != "reward":
                np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        count = np.asarray(delivery.mask).sum(axis=1)
        last = t0 + count - 1
        kinds["full"] += int(((count == n) & ~ends_of(traj)[last, env]).sum())
        kinds["terminated"] += int(traj["terminated"][last, env].sum())
        kinds["truncated"] += int(traj["truncated"][last, env].sum())
    assert min(kinds.values()) > 20, kinds  # every kind of window was checked



def small_windows(batch=4, steps=3):
    """A padded batch of ``batch`` windows of ``steps`` steps, no episode end, and its all-True mask."""
    data = {"reward": jnp.ones((batch, steps)), "terminated": jnp.zeros((batch, steps), bool),
            "truncated": jnp.zeros((batch, steps), bool), "next_obs": jnp.zeros((batch, steps, 2)),
            "obs": jnp.zeros((batch, steps, 2))}
    return data, jnp.ones((batch, steps), bool)


@pytest.mark.parametrize("gamma", [float("nan"), -0.5, 1.5, float("inf"), None, "0.9", True, jnp.ones((2,))],
                         ids=str)
def test_n_step_gamma_must_be_a_finite_number_in_0_1(gamma):
    data, mask = small_windows()
    with pytest.raises(ConfigError, match=r"n_step\(\): gamma must be a .*in \[0, 1\]"):
        n_step(data, mask, gamma)


@pytest.mark.parametrize("gamma", [0, 1, 0.5, np.float32(0.9), jnp.float32(0.9)], ids=str)
def test_n_step_accepts_any_gamma_in_0_1(gamma):
    data, mask = small_windows()
    np.testing.assert_allclose(n_step(data, mask, gamma)["discount"], float(gamma) ** 3, rtol=1e-6)


def test_n_step_takes_a_traced_gamma():
    data, mask = small_windows()
    out = jax.jit(lambda d, m, g: n_step(d, m, g))(data, mask, jnp.float32(0.5))
    np.testing.assert_allclose(out["discount"], 0.125)


@pytest.mark.parametrize("mask, expected", [
    (jnp.ones((4,), bool), r"bool\[B, n\].*got bool\[4\]"),
    (jnp.ones((4, 0), bool), r"n >= 1.*got bool\[4, 0\]"),
    (jnp.full((4, 3), 0.5), r"bool\[B, n\].*got float32\[4, 3\]"),  # a float mask: n_steps 0, reward 0.5-weighted
    ([[True] * 3] * 4, r"bool\[B, n\].*got list"),
    (jnp.ones((4, 5), bool), r"data leaf \['next_obs'\] must have shape \[B, n, \.\.\.\] = \[4, 5, \.\.\.\] like "
                             r"mask \[4, 5\], got \[4, 3, 2\]"),
    (jnp.ones((3, 3), bool), r"= \[3, 3, \.\.\.\] like mask \[3, 3\], got \[4, 3, 2\]"),
], ids=["1d", "no-steps", "float", "list", "steps", "batch"])
def test_n_step_mask_must_be_bool_b_n_like_the_data(mask, expected):
    data, _ = small_windows()
    with pytest.raises(SpecError, match=rf"n_step\(\): .*{expected}"):
        n_step(data, mask, 0.9)
    if not isinstance(mask, list):
        with pytest.raises(SpecError, match="mask"):  # at trace time as well
            jax.jit(lambda d, m: n_step(d, m, 0.9))(data, mask)


@pytest.mark.parametrize("drop", ["reward", "next_obs", "terminated"])
def test_n_step_data_must_hold_its_leaves(drop):
    data, mask = small_windows()
    del data[drop]
    with pytest.raises(SpecError, match=f"data has no leaf '{drop}' \\(the {drop} leaf\\)"):
        n_step(data, mask, 0.9)
    del data["truncated"]
    with pytest.raises(SpecError, match=f"'{drop}'"):
        n_step(data, mask, 0.9)


def test_n_step_truncated_is_optional():
    data, mask = small_windows()
    del data["truncated"]
    assert "truncated" not in n_step(data, mask, 0.9)


@pytest.mark.parametrize("kwargs, error, expected", [
    ({"reward": "nope"}, SpecError, r"data has no leaf 'nope' \(the reward leaf\)"),
    ({"next_obs": "nope"}, SpecError, r"data has no leaf 'nope' \(the next_obs leaf\)"),
    ({"terminated": 3}, ConfigError, r"terminated must be the name of a leaf of data \(a str\), got int 3"),
], ids=str)
def test_n_step_leaf_names_must_name_leaves(kwargs, error, expected):
    data, mask = small_windows()
    with pytest.raises(error, match=expected):
        n_step(data, mask, 0.9, **kwargs)


@pytest.mark.parametrize("change, expected", [
    ("tuple", r"data must be a dict of \[B, n, \.\.\.\] leaves .*got tuple"),
    ("reward-3d", r"the reward leaf 'reward' must be \[B, n\] = \[4, 3\] \(one per step\), got \[4, 3, 1\]"),
    ("terminated-1d", r"data leaf \['terminated'\] must have shape \[B, n, \.\.\.\]"),
    ("scalar-leaf", r"data leaf \['obs'\] must have shape"),
], ids=str)
def test_n_step_data_must_be_a_dict_of_windows(change, expected):
    data, mask = small_windows()
    if change == "tuple":
        data = tuple(data.values())
    elif change == "reward-3d":
        data["reward"] = data["reward"][..., None]
    elif change == "terminated-1d":
        data["terminated"] = data["terminated"][:, 0]
    else:
        data["obs"] = jnp.float32(0)
    with pytest.raises(SpecError, match=rf"n_step\(\): {expected}"):
        n_step(data, mask, 0.9)


def test_eligible_windows_are_reported_by_the_kernels(status_reads):
    """The eligible-window count is an index read, not arithmetic on calls: each ingest and sample kernel reports it,
    so a steady ingest/sample loop never launches the status kernel (it did on every sample: ~100 us each), and the
    plane still refuses while no window is complete."""
    plane = make_plane(default_mesh(1), STREAMS * 8, samplers.sequences(8, 3, STREAMS))
    traj = trajectories(seed=0, steps=40, p_terminated=0.0, p_truncated=0.0)
    reads = status_reads(plane)
    ingest_steps(plane, traj, 0, 1)  # the one status read: the plane knew nothing yet (before staging anything)
    assert not plane.can_sample()
    ingest_steps(plane, traj, 1, 2)
    assert not plane.can_sample()  # 2 steps, no window of 3
    for t in range(2, 40):
        ingest_steps(plane, traj, t, t + 1)
        check_windows(plane.sample(), traj, t + 1, plane, pad=False)
    assert len(reads) == 1
