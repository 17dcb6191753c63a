"""The RLlib adapter (adapters/conduit_rllib): DLPack bridge, replay buffers, PPO staging, checkpoints, and RLlib
algorithms (DQN with PER, SAC, PPO) training with the Conduit path.

Small settings throughout (2 shared cores): rollout_fragment_length >= 16, tiny batches, one ``ray.init`` per test
session (``ray_session``) with token auth off and Ray's temp dir inside pytest's tmp path, torch on one thread.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("ray.rllib")

if importlib.util.find_spec("conduit_rllib") is None:
    # not installed: use the source tree (pip install ./adapters, or the main package's rllib extra)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "adapters"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402

import conduit_rllib  # noqa: E402
from conduit_jax.replay import default_mesh  # noqa: E402
from conduit_jax.spec import SUPPORTED_DTYPES  # noqa: E402
from conduit_rllib import dlpack  # noqa: E402
from conduit_rllib.buffers import ConduitBatch  # noqa: E402

torch.set_num_threads(1)

# ray.init forks its processes after JAX has started its threads (it execs right away: harmless)
pytestmark = pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")


# ------------------------------------------------------------------------------------------------------------------
# DLPack bridge
# ------------------------------------------------------------------------------------------------------------------
def _example(dtype, shape=(6, 5)):
    values = np.arange(int(np.prod(shape))).reshape(shape) % 7
    if np.dtype(dtype) == np.bool_:
        values = values % 2
    return jnp.asarray(values.astype(np.float32)).astype(dtype)


def _host(x):
    if isinstance(x, torch.Tensor):
        x = x.float() if x.dtype in (torch.bfloat16, torch.float16, torch.bool) or x.dtype.is_floating_point \
            else x.to(torch.int64)
        return x.numpy()
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_dlpack_round_trip_every_dtype_zero_copy(dtype):
    x = _example(dtype)
    t = dlpack.jax_to_torch(x)
    assert dlpack.shares_memory(x, t), "jax -> torch must be zero-copy for an unsharded array"
    assert dlpack.numpy_dtype(t.dtype) == np.dtype(dtype)
    np.testing.assert_array_equal(_host(t), _host(x))
    back = dlpack.torch_to_jax(t, copy=False)
    assert back.dtype == np.dtype(dtype)
    assert back.unsafe_buffer_pointer() == t.data_ptr(), "torch -> jax (copy=False, aligned) must be zero-copy"
    np.testing.assert_array_equal(_host(back), _host(x))
    copied = dlpack.torch_to_jax(t)  # default: an independent array
    assert copied.unsafe_buffer_pointer() != t.data_ptr()
    np.testing.assert_array_equal(_host(copied), _host(x))
    detached = dlpack.jax_to_torch(x, copy=True)
    assert detached.data_ptr() != x.unsafe_buffer_pointer()
    np.testing.assert_array_equal(_host(detached), _host(x))


def test_dlpack_copies_are_independent_and_writes_alias():
    t = torch.arange(16, dtype=torch.float32)
    copied = dlpack.torch_to_jax(t)
    aliased = dlpack.torch_to_jax(t, copy=False)
    t[0] = 100.0
    assert float(copied[0]) == 0.0  # jnp.array(from_dlpack(t), copy=True): a real copy
    assert float(aliased[0]) == 100.0  # copy=False: JAX reads torch's memory (the caller's promise)
    x = jnp.zeros(4, jnp.float32)
    shared = dlpack.jax_to_torch(x)
    safe = dlpack.jax_to_torch(x, copy=True)
    shared[1] = 5.0
    safe[2] = 7.0
    assert np.asarray(x).tolist() == [0.0, 5.0, 0.0, 0.0]  # the documented hazard: JAX memory is writable in torch


@pytest.mark.parametrize("wide,narrow", [(torch.int64, np.int32), (torch.float64, np.float32),
                                         (torch.uint64, np.uint32)], ids=str)
def test_dlpack_64_bit_is_narrowed_explicitly(wide, narrow):
    t = torch.arange(10).to(wide)
    x = dlpack.torch_to_jax(t, copy=False)
    assert x.dtype == np.dtype(narrow)
    np.testing.assert_array_equal(np.asarray(x), np.arange(10))
    assert x.unsafe_buffer_pointer() != t.data_ptr()
    with pytest.raises(TypeError, match="narrowed"):
        dlpack.torch_to_jax(t, narrow=False)


def test_dlpack_unaligned_and_strided_tensors_are_copied_correctly():
    base = torch.arange(64, dtype=torch.float32)
    unaligned = base[1:17]  # 4 bytes past a 64-byte boundary
    assert unaligned.data_ptr() % 64
    x = dlpack.torch_to_jax(unaligned, copy=False)
    np.testing.assert_array_equal(np.asarray(x), np.arange(1, 17))
    strided = base.reshape(8, 8)[:, ::2]
    np.testing.assert_array_equal(np.asarray(dlpack.torch_to_jax(strided, copy=False)), strided.numpy())
    grad = torch.ones(3, requires_grad=True)
    np.testing.assert_array_equal(np.asarray(dlpack.torch_to_jax(grad)), np.ones(3))


def test_dlpack_sharded_and_replicated_arrays():
    mesh = default_mesh(8)
    x = jax.device_put(jnp.arange(64, dtype=jnp.float32).reshape(16, 4), NamedSharding(mesh, P("shard")))
    t = dlpack.jax_to_torch(x)  # joined: one copy
    np.testing.assert_array_equal(t.numpy(), np.arange(64).reshape(16, 4))
    shards = dlpack.jax_shards_to_torch(x)  # per shard: zero-copy
    assert [s.data_ptr() for s in shards] == [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
    replicated = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, P()))
    r = dlpack.jax_to_torch(replicated)
    assert dlpack.shares_memory(replicated, r)
    np.testing.assert_array_equal(r.numpy(), np.arange(8))


# ------------------------------------------------------------------------------------------------------------------
# replay buffers, without Ray running
# ------------------------------------------------------------------------------------------------------------------
# chunks of episodes: (chunk index, length, end) with end in terminated / truncated / cut (episode goes on)
CHUNKS = [(0, 5, "terminated"), (1, 4, "cut"), (2, 3, "truncated"), (3, 6, "terminated"), (4, 2, "terminated"),
          (5, 7, "cut")]


def _chunk_rewards(chunk, length):
    return (np.arange(length, dtype=np.float32) + 1.0) * (chunk + 1)


def _episodes():
    """Episode chunks whose observations encode (chunk, step): obs_t = [chunk, t] (next_obs of the last step: t=len)."""
    out = []
    for chunk, length, end in CHUNKS:
        obs = [np.array([chunk, t], np.float32) for t in range(length + 1)]
        out.append(SingleAgentEpisode(
            observations=obs, actions=[np.int64(t % 2) for t in range(length)],
            rewards=list(_chunk_rewards(chunk, length).astype(np.float64)),
            terminated=end == "terminated", truncated=end == "truncated", len_lookback_buffer=0))
    return out


def _reference(chunk, t, n, gamma):
    _, length, end = CHUNKS[chunk]
    m = min(n, length - t)
    rewards = _chunk_rewards(chunk, length)[t:t + m]
    ret = float(np.sum(rewards * gamma ** np.arange(m)))
    at_end = t + m == length
    return {"n_step": m, "rewards": ret, "new_obs": [chunk, t + m], "terminateds": at_end and end == "terminated",
            "truncateds": at_end and end == "truncated", "actions": t % 2}


def _check_transitions(columns, n, gamma):
    obs = np.asarray(columns["obs"])
    for i in range(obs.shape[0]):
        chunk, t = int(obs[i, 0]), int(obs[i, 1])
        want = _reference(chunk, t, n if np.ndim(n) == 0 else int(n[i]), gamma)
        assert int(columns["n_step"][i]) == want["n_step"], (chunk, t)
        assert float(columns["rewards"][i]) == pytest.approx(want["rewards"], rel=1e-6), (chunk, t)
        assert np.asarray(columns["new_obs"][i]).tolist() == want["new_obs"], (chunk, t)
        assert bool(columns["terminateds"][i]) == want["terminateds"], (chunk, t)
        assert bool(columns["truncateds"][i]) == want["truncateds"], (chunk, t)
        assert int(columns["actions"][i]) == want["actions"], (chunk, t)
    return {(int(c), int(t)) for c, t in obs}


def _torch_columns(batch: ConduitBatch):
    """A torch learner's columns of ``batch`` (``words_to_torch``, what ``ConduitDQNTorchLearner`` takes), as NumPy."""
    columns = dlpack.words_to_torch(batch.take_words(), batch.layout, batch.names)
    return {k: v.numpy() if v.dtype != torch.bfloat16 else None for k, v in columns.items()}


def test_draw_arguments_travel_in_one_array_bit_for_bit():
    """A draw kernel's host values packed in one int32 array (``draws.draw_arguments``) come out unchanged inside
    the kernel: n per candidate, beta and gamma as the same float32, seed and counter over the whole uint32 range."""
    from conduit_rllib import draws

    n = np.array([1, 3, 2, 3], np.int32)
    packed = draws.draw_arguments(n, 0.4, 0.99, 2**32 - 1, 2**31 + 5)
    got = jax.jit(lambda a: draws.draw_arguments_in(a, 4))(packed)
    assert np.asarray(got[0]).tolist() == n.tolist()
    assert (np.float32(got[1]), np.float32(got[2])) == (np.float32(0.4), np.float32(0.99))
    assert (int(got[3]), int(got[4])) == (2**32 - 1, 2**31 + 5) and got[3].dtype == jnp.uint32


@pytest.mark.parametrize("cls", ["ConduitPrioritizedEpisodeReplayBuffer", "ConduitEpisodeReplayBuffer"])
def test_buffer_n_step_transitions_match_reference(cls):
    """n-step transitions computed by hand: the prioritized buffer draws only steps with n steps left in their
    episode (RLlib redraws the others), the uniform one clips the window at the episode's stored end (RLlib's slice)
    and says in ``n_step`` how many steps it used."""
    gamma = 0.9
    buffer = getattr(conduit_rllib, cls)(capacity=64, alpha=0.6, deliver="torch", seed=1)
    buffer.add(_episodes()[:3])
    buffer.add(_episodes()[3:])
    total = sum(length for _, length, _ in CHUNKS)
    assert len(buffer) == total and buffer.get_added_timesteps() == total
    redraws = buffer._prioritized
    seen = set()
    for _ in range(20):
        batch = buffer.sample(num_items=32, n_step=3, gamma=gamma, beta=0.4, sample_episodes=True)
        assert isinstance(batch, ConduitBatch) and len(batch) == 32
        columns = _torch_columns(batch)
        assert columns["weights"].dtype == np.float32 and np.all(columns["weights"] > 0)
        assert np.all(columns["weights"] <= 1.0)
        seen |= _check_transitions(columns, 3, gamma)
        if redraws:
            assert np.all(columns["n_step"] == 3)
            buffer.update_priorities(np.ones(32, np.float32))
    starts = {(c, t) for c, length, _ in CHUNKS for t in range(length) if not redraws or t + 3 <= length}
    assert seen == starts
    # another n-step from the same buffer (compiled for it on first use), and a per-item range
    shorter = buffer.sample(num_items=32, n_step=2, gamma=gamma, sample_episodes=True)
    _check_transitions(_torch_columns(shorter), 2, gamma)
    columns = _torch_columns(buffer.sample(num_items=32, n_step=(1, 4), gamma=gamma, sample_episodes=True))
    assert set(np.unique(columns["n_step"])) <= {1, 2, 3}
    with pytest.raises(ValueError, match="n_step"):
        buffer.sample(num_items=32, n_step=(3, 3), gamma=gamma, sample_episodes=True)


def test_a_torch_batch_crosses_in_one_dlpack_hand_over_as_views_of_its_words():
    """deliver="torch": the draw kernel packs the columns into one int32 array; ``words_to_torch`` gives each column
    as a view of that one array (zero-copy), the same values as the JAX columns ``take()`` unpacks, bit for bit, for
    4-, 2- and 1-byte columns (float16 and bool model outputs, uint8 frames) and only the columns asked for."""
    rng = np.random.default_rng(0)
    chunks = []
    for c in range(4):
        length = 6 + c
        chunks.append(SingleAgentEpisode(
            observations=[rng.integers(0, 255, (2, 3), np.uint8) for _ in range(length + 1)],
            actions=[np.int64(t % 3) for t in range(length)], rewards=list(rng.normal(size=length).astype(np.float32)),
            extra_model_outputs={"q": [np.float16(rng.normal()) for _ in range(length)],
                                 "greedy": [bool(t % 2) for t in range(length)]},
            terminated=True, len_lookback_buffer=0))
    buffer = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=64, alpha=0.6, deliver="torch", seed=2)
    buffer.add(chunks)
    batch = buffer.sample(num_items=8, n_step=2, beta=0.4, include_extra_model_outputs=True)
    assert {"obs", "new_obs", "actions", "rewards", "weights", "extra__q", "extra__greedy"} <= set(batch.names)
    words = batch.take_words()
    columns = dlpack.words_to_torch(words, batch.layout, batch.names)
    unpacked = ConduitBatch(words, batch.layout, batch.names, "default_policy", 8).take()
    assert set(columns) == set(unpacked) == set(batch.names)
    start = words.unsafe_buffer_pointer()
    for name, tensor in columns.items():
        want = np.asarray(unpacked[name])
        assert tensor.shape == want.shape and dlpack.numpy_dtype(tensor.dtype) == want.dtype, name
        assert tensor.numpy().tobytes() == want.tobytes(), name
        assert start <= tensor.data_ptr() < start + words.nbytes, name  # a view of the words
    assert columns["obs"].dtype == torch.uint8 and columns["extra__greedy"].dtype == torch.bool
    assert columns["extra__q"].dtype == torch.float16
    plain = buffer.sample(num_items=8, n_step=2, beta=0.4)
    assert not any(name.startswith("extra__") for name in plain.names)
    with pytest.raises(RuntimeError, match="already taken"):
        batch.take_words()


def test_buffer_returns_rllib_episodes_and_n_step_one():
    buffer = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=32, alpha=0.6, beta=0.4)  # n_step 1
    buffer.add(_episodes())
    episodes = buffer.sample(num_items=16, n_step=1, gamma=0.5, beta=0.4, sample_episodes=True)
    assert len(episodes) == 16 and all(isinstance(e, SingleAgentEpisode) and len(e) == 1 for e in episodes)
    columns = {"obs": np.stack([e.get_observations(0) for e in episodes]),
               "new_obs": np.stack([e.get_observations(1) for e in episodes]),
               "rewards": np.array([e.get_rewards(0) for e in episodes]),
               "actions": np.array([e.get_actions(0) for e in episodes]),
               "terminateds": np.array([e.is_terminated for e in episodes]),
               "truncateds": np.array([e.is_truncated for e in episodes]),
               "n_step": np.array([e.get_extra_model_outputs("n_step", 0) for e in episodes])}
    _check_transitions(columns, 1, 0.5)
    weights = np.array([e.get_extra_model_outputs("weights", 0) for e in episodes])
    assert np.all((weights > 0) & (weights <= 1))
    metrics = buffer.get_metrics()
    assert metrics["num_env_steps_added_lifetime"] == sum(length for _, length, _ in CHUNKS)


def _same(built, reference, where="episode"):
    """Attribute for attribute (slots, buffers' attributes, arrays by dtype, shape and bytes, containers in order)."""
    from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer

    assert type(built) is type(reference), where
    if isinstance(reference, SingleAgentEpisode):
        for slot in SingleAgentEpisode.__slots__:
            _same(getattr(built, slot), getattr(reference, slot), f"{where}.{slot}")
    elif isinstance(reference, InfiniteLookbackBuffer):
        assert list(vars(built)) == list(vars(reference)), where
        for name, value in vars(reference).items():
            _same(vars(built)[name], value, f"{where}.{name}")
    elif isinstance(reference, np.ndarray):
        assert built.dtype == reference.dtype and built.shape == reference.shape, where
        np.testing.assert_array_equal(built, reference, err_msg=where)
    elif isinstance(reference, (list, tuple, dict)):
        assert len(built) == len(reference), where
        if isinstance(reference, dict):
            assert list(built) == list(reference), where
            built, reference = list(built.values()), list(reference.values())
        for j, (a, b) in enumerate(zip(built, reference)):
            _same(a, b, f"{where}[{j}]")
    else:
        assert built == reference or (built is None and reference is None), (where, built, reference)


@pytest.mark.parametrize("to_numpy", [True, False])
def test_one_step_episodes_are_rllibs_constructor_attribute_for_attribute(to_numpy):
    """The 1-step episodes a sample returns are built without RLlib's constructor (most of a sample's cost); every
    slot and buffer attribute equals what ``SingleAgentEpisode(...)`` (and ``to_numpy``) gives for the same row."""
    import gymnasium as gym
    from ray.rllib.core.columns import Columns

    from conduit_rllib.episode_index import OneStepEpisodes, transitions

    rng = np.random.default_rng(0)
    spaces = (gym.spaces.Box(-1.0, 1.0, (3,), np.float32), gym.spaces.Discrete(4))
    n = 6
    host = {Columns.OBS: rng.standard_normal((n, 3)).astype(np.float32),
            Columns.NEXT_OBS: rng.standard_normal((n, 3)).astype(np.float32),
            Columns.ACTIONS: rng.integers(0, 4, n), Columns.REWARDS: rng.standard_normal(n),
            Columns.TERMINATEDS: rng.random(n) < 0.5, Columns.TRUNCATEDS: np.zeros(n, bool),
            "weights": rng.random(n).astype(np.float32), "n_step": rng.integers(1, 4, n).astype(np.int32),
            "extra__logp": rng.standard_normal((n, 2)).astype(np.float32), "info__x": rng.random(n),
            "next_info__x": rng.random(n)}
    keys = {"extra__logp": "action_logp", "info__x": "x"}
    records = [conduit_rllib.episode_index.StoredEpisode(f"e{i}", 10, False, False, [], f"a{i}", "m", None)
               for i in range(n)]
    starts = rng.integers(0, 9, n)
    assert OneStepEpisodes(*spaces).direct  # the direct path is the one taken for these spaces
    built = transitions(records, starts, host, keys, spaces, to_numpy, infos=True, extras=True)
    reference = OneStepEpisodes(*spaces)
    reference.direct = False  # RLlib's constructor
    pairs = np.stack([host[Columns.OBS], host[Columns.NEXT_OBS]], axis=1)
    outputs = {"weights": host["weights"], "n_step": host["n_step"], "action_logp": host["extra__logp"]}
    for i in range(n):
        expected = reference(records[i], i, pairs, host[Columns.ACTIONS], host[Columns.REWARDS], outputs,
                             bool(host[Columns.TERMINATEDS][i]), False, int(starts[i]),
                             [{"x": host["info__x"][i]}, {"x": host["next_info__x"][i]}], to_numpy)
        _same(built[i], expected, f"episode {i}")
        assert len(built[i]) == 1 and built[i].is_numpy == to_numpy
        np.testing.assert_array_equal(built[i].get_observations(-1), host[Columns.NEXT_OBS][i])


def test_n_step_longer_than_every_episode_is_refused_at_once():
    """With no stored episode of n steps RLlib's PER would resample forever; the Conduit one refuses after its first
    draw, naming n_step, and nothing changes: the sampled-steps counter stays, the next valid sample works."""
    buffer = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=64, alpha=0.6)
    buffer.add(_unique_episodes(0, 5, length=2))
    with pytest.raises(ValueError, match=r"1 draw kernel\(s\) found 0 of the 8 steps asked for with n_step=3"):
        buffer.sample(num_items=8, n_step=3)
    assert buffer.get_sampled_timesteps() == 0
    assert len(buffer.sample(num_items=8, n_step=2)) == 8 and buffer.get_sampled_timesteps() == 8


def test_prioritized_buffer_follows_priorities_and_beta():
    buffer = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=64, alpha=1.0, beta=0.5, deliver="torch")
    buffer.add(_episodes())
    batch = _torch_columns(buffer.sample(num_items=64, beta=0.5))
    # one item gets all the priority: (almost) every later draw is that item
    target = tuple(batch["obs"][0])
    priorities = np.where((batch["obs"] == target).all(axis=1), 1000.0, 1e-3)
    buffer.update_priorities(priorities)
    later = _torch_columns(buffer.sample(num_items=64, beta=1.0))
    assert np.mean((later["obs"] == target).all(axis=1)) > 0.9
    buffer.update_priorities(np.ones(64))
    with pytest.raises(ValueError, match="no batch sampled"):
        buffer.update_priorities(np.ones(64))
    # beta rescaling: w(beta) = w(beta0) ** (beta / beta0), and beta 0 gives ones
    state = buffer.get_state()
    twin = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=64, alpha=1.0, beta=0.5, deliver="torch")
    twin.set_state(state)
    w_half = _torch_columns(buffer.sample(num_items=64, beta=0.5))["weights"]
    w_one = _torch_columns(twin.sample(num_items=64, beta=1.0))["weights"]
    np.testing.assert_allclose(w_one, w_half ** 2, rtol=1e-5)
    assert np.all(_torch_columns(buffer.sample(num_items=64, beta=0.0))["weights"] == 1.0)


def test_uniform_buffer_has_unit_weights_and_no_priorities():
    buffer = conduit_rllib.ConduitEpisodeReplayBuffer(capacity=64, deliver="torch")
    buffer.add(_episodes())
    assert np.all(_torch_columns(buffer.sample(num_items=8, sample_episodes=True))["weights"] == 1.0)
    with pytest.raises(NotImplementedError):
        buffer.update_priorities(np.ones(8))


def _unique_episodes(first, count, length=10):
    """Episodes whose observation at step t is 1000 * k + t: an observation names its episode and step."""
    out = []
    for k in range(first, first + count):
        e = SingleAgentEpisode(id_=str(k), observations=[1000.0 * k], len_lookback_buffer=0)
        for t in range(length):
            e.add_env_step(observation=1000.0 * k + t + 1, action=t, reward=1.0)
        e.is_terminated = True
        out.append(e)
    return out


@pytest.mark.parametrize("schedule", ["overlap", "deferred", "adaptive"])
def test_scheduled_buffers_hand_over_batches_drawn_ahead_without_evicted_steps(schedule, monkeypatch):
    """A batch drawn ahead is handed over only to the same request, never holds a step evicted since it was drawn,
    and counts as sampled once, when it is handed over. Under overlap it is drawn after the priority update, so it
    follows it at once; under deferred one batch later (the staleness bound k = 1). Adaptive follows the core's rule
    (``schedule.draws_after_update``) on how long ``sample()`` waited for the batch drawn ahead, which depends on
    thread timing; here the rule is told the wait: 0 (it must stay on overlap), then 1 s, more than a tenth of any
    learner update of this test (it must go deferred). In the first 60 calls every batch drawn ahead is dropped by
    the add() that evicts an episode: the draws are stratified (one in each 16th of the priority mass), so each
    10-step episode holds one of them."""
    from conduit_jax import schedule as schedules

    told_wait, choices = [0.0], []
    rule = schedules.draws_after_update

    def choose(after_update, waited, update_s, run):
        choices.append("overlap" if rule(after_update, told_wait[0], update_s, run) else "deferred")
        return choices[-1] == "overlap"

    monkeypatch.setattr(schedules, "draws_after_update", choose)
    buffer = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=100, alpha=1.0, schedule=schedule,
                                                               deliver="torch", seed=3)
    buffer.add(_unique_episodes(0, 10))
    episode = 10
    for call in range(60):
        columns = _torch_columns(buffer.sample(num_items=16, n_step=1))
        live = {int(e.id_) for e in buffer.episodes}
        assert {int(o // 1000) for o in columns["obs"]} <= live, f"call {call}: an evicted step was delivered"
        assert buffer.get_sampled_timesteps() == 16 * (call + 1)
        buffer.update_priorities(np.ones(16))
        buffer.add(_unique_episodes(episode, 1))  # evicts the oldest episode (100 steps stored)
        episode += 1
    assert buffer.get_num_episodes_evicted() == 60
    stats = buffer.stats()
    like_overlap = schedule in ("overlap", "adaptive")
    assert (stats["drawn_ahead_after_update"], stats["drawn_ahead_after_sample"]) == ((60, 0) if like_overlap
                                                                                      else (0, 60)), stats
    for _ in range(2):  # rounds without add(): the second sample() hands over the batch drawn ahead
        buffer.sample(num_items=16, n_step=1)
        buffer.update_priorities(np.ones(16))
    told_wait[0] = 1.0
    # one step at priority 1000, the rest at 1: the next batch (overlap) or the one after (deferred) is mostly it
    target = float(_torch_columns(buffer.sample(num_items=16, n_step=1))["obs"][0])
    batch = _torch_columns(buffer.sample(num_items=100, n_step=1))  # another size: drawn now
    drawn_after_updates = buffer.stats()["drawn_ahead_after_update"]
    buffer.update_priorities(np.where(batch["obs"] == target, 1000.0, 1.0))
    after_this_update = buffer.stats()["drawn_ahead_after_update"] > drawn_after_updates
    assert after_this_update == (schedule == "overlap")
    shares = [np.mean(_torch_columns(buffer.sample(num_items=100, n_step=1))["obs"] == target) for _ in range(2)]
    if after_this_update:
        assert shares[0] > 0.5 and shares[1] > 0.5
    else:
        assert shares[0] < 0.5 < shares[1]
    # adaptive: told 0 at the first batch handed over, then 1 s at the target's and the shares' (the batch drawn
    # ahead for 16 steps is dropped unasked when 100 are asked for)
    assert choices == (["overlap", "deferred", "deferred", "deferred"] if schedule == "adaptive" else [])
    stats = buffer.stats()
    assert 0 <= stats["drawn_ahead_waited"] <= stats["drawn_ahead_after_update"] + stats["drawn_ahead_after_sample"]
    with pytest.raises(ValueError, match="schedule must be one of"):
        conduit_rllib.ConduitEpisodeReplayBuffer(schedule="eager")


def test_schedule_key_takes_the_core_schedules_a_buffer_runs():
    from conduit_jax import schedule

    for word, made in (("sync", schedule.sync()), ("sync", schedule.staged()), ("overlap", schedule.overlap(1)),
                       ("deferred", schedule.deferred(1, 1)), ("adaptive", schedule.adaptive(1, 1))):
        assert conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=100, schedule=made).schedule == word
    for deeper in (schedule.overlap(2), schedule.deferred(2, 1), schedule.adaptive(4, 1)):
        with pytest.raises(ValueError, match=r"schedule must be one of .*overlap\(1\).*at most one ahead"):
            conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=100, schedule=deeper)
    buffer = conduit_rllib.ConduitMultiAgentPrioritizedEpisodeReplayBuffer(capacity=100, schedule=schedule.overlap(1))
    assert buffer.schedule == "overlap"


def test_adaptive_schedule_follows_its_rule(monkeypatch):
    """The buffer draws each next batch ahead where the core's adaptive rule (``schedule.draws_after_update``) says:
    after sample() (deferred) or after the priority update (overlap), and hands it over to the next sample()."""
    from conduit_jax import schedule as schedules

    script = ["deferred", "overlap", "overlap", "deferred", "deferred", "overlap"]
    calls = iter(script)
    monkeypatch.setattr(schedules, "draws_after_update", lambda *args: next(calls) == "overlap")
    buffer = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=100, alpha=1.0, schedule="adaptive",
                                                               deliver="torch", seed=3)
    buffer.add(_unique_episodes(0, 10))
    buffer.sample(num_items=16, n_step=1)  # nothing drawn ahead yet; adaptive starts as overlap
    buffer.update_priorities(np.ones(16))
    where = []
    for _ in script:
        before = buffer.stats()
        buffer.sample(num_items=16, n_step=1)
        buffer.update_priorities(np.ones(16))
        after = buffer.stats()
        grew = [key for key in ("drawn_ahead_after_update", "drawn_ahead_after_sample") if after[key] > before[key]]
        assert len(grew) == 1 and after[grew[0]] == before[grew[0]] + 1
        where.append({"drawn_ahead_after_update": "overlap", "drawn_ahead_after_sample": "deferred"}[grew[0]])
    assert where == script
    assert buffer.get_sampled_timesteps() == 16 * (len(script) + 1)


def test_buffer_state_round_trip_and_files(tmp_path):
    buffer = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=32, n_step=2, alpha=0.6, deliver="torch")
    buffer.add(_episodes())
    buffer.sample(num_items=8, n_step=2)
    buffer.update_priorities(np.linspace(0.1, 3.0, 8))
    state = buffer.get_state()

    def leaves(value):
        if isinstance(value, dict):
            return [x for v in value.values() for x in leaves(v)]
        if isinstance(value, list):
            return [x for v in value for x in leaves(v)]
        return [value]

    assert all(isinstance(x, (np.ndarray, int, float, str, bool, type(None))) for x in leaves(state))
    conduit_rllib.save_buffer(buffer, tmp_path / "buf")
    restored = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=32, n_step=2, alpha=0.6, deliver="torch")
    conduit_rllib.load_buffer(restored, tmp_path / "buf")
    assert len(restored) == len(buffer) and restored.get_added_timesteps() == buffer.get_added_timesteps()
    again = restored.get_state()
    for key, value in state["arrays"].items():
        np.testing.assert_array_equal(again["arrays"][key], value)
    # the random stream continues: both draw the same next batch
    a = _torch_columns(buffer.sample(num_items=8, n_step=2))
    b = _torch_columns(restored.sample(num_items=8, n_step=2))
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])
    # a buffer configured differently, a corrupted file and a missing checkpoint are refused
    other = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=64, n_step=2, alpha=0.6)
    with pytest.raises(ValueError, match="configured differently"):
        other.set_state(state)
    payload = (tmp_path / "buf" / "arrays.npz").read_bytes()
    (tmp_path / "buf" / "arrays.npz").write_bytes(payload[: len(payload) // 2])
    with pytest.raises(conduit_rllib.BufferCheckpointError):
        conduit_rllib.load_buffer(restored, tmp_path / "buf")
    with pytest.raises(conduit_rllib.BufferCheckpointError):
        conduit_rllib.load_buffer(restored, tmp_path / "nothing")


# ------------------------------------------------------------------------------------------------------------------
# PPO pieces, without Ray running
# ------------------------------------------------------------------------------------------------------------------
def test_gae_matches_rllib():
    from ray.rllib.utils.postprocessing.value_predictions import compute_value_targets

    from conduit_rllib.ppo import gae

    rng = np.random.default_rng(0)
    n, size = 300, 512
    values = rng.normal(size=n).astype(np.float32)
    rewards = rng.normal(size=n).astype(np.float32)
    terminateds = rng.random(n) < 0.05
    truncateds = (rng.random(n) < 0.05) & ~terminateds
    targets_ref = compute_value_targets(values, rewards, terminateds.astype(np.float32),
                                        truncateds.astype(np.float32), gamma=0.97, lambda_=0.9)
    advantages_ref = targets_ref - values
    advantages_ref = (advantages_ref - advantages_ref.mean()) / max(1e-4, advantages_ref.std())

    def pad(x):
        out = np.zeros(size, x.dtype)
        out[:n] = x
        return out

    advantages, targets = gae(pad(values), pad(rewards), pad(terminateds), pad(truncateds), np.int32(n), gamma=0.97,
                              lambda_=0.9)
    np.testing.assert_allclose(np.asarray(targets)[:n], targets_ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(advantages)[:n], advantages_ref, rtol=1e-4, atol=1e-4)


def test_epoch_staging_covers_every_row_each_epoch():
    from ray.rllib.policy.sample_batch import SampleBatch

    from conduit_rllib.ppo import EpochStaging

    n, minibatch = 70, 16  # 5 minibatches per epoch: 80 rows, the first 10 twice
    batch = SampleBatch({"row": torch.arange(n, dtype=torch.int32), "obs": torch.randn(n, 3),
                         "loss_mask": torch.ones(n, dtype=torch.bool), "big": torch.arange(n, dtype=torch.int64)})
    staging = EpochStaging(seed=3)
    batches = list(staging.minibatches("p", batch, num_epochs=2, minibatch_size=minibatch, device=torch.device("cpu")))
    assert len(batches) == 10
    for epoch in (batches[:5], batches[5:]):
        rows = torch.cat([b.policy_batches["p"]["row"] for b in epoch]).numpy()
        counts = np.bincount(rows, minlength=n)
        assert counts[:10].tolist() == [2] * 10 and counts[10:].tolist() == [1] * (n - 10)
    first = batches[0].policy_batches["p"]
    np.testing.assert_array_equal(first["obs"].numpy(), batch["obs"][first["row"].long()].numpy())
    assert first["big"].dtype == torch.int32  # int64 narrowed (x64 off)
    # the next train batch (another size, same plane): only its rows, every one once per epoch
    n2 = 64
    batch2 = SampleBatch({k: v[:n2] + 100 if k == "row" else v[:n2] for k, v in batch.items()})
    again = list(staging.minibatches("p", batch2, num_epochs=1, minibatch_size=minibatch, device=torch.device("cpu")))
    rows = torch.cat([b.policy_batches["p"]["row"] for b in again]).numpy()
    assert len(again) == 4 and sorted(rows.tolist()) == list(range(100, 100 + n2))


# ------------------------------------------------------------------------------------------------------------------
# RLlib algorithms with the Conduit path (one Ray session)
# ------------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp_dir = tmp_path_factory.mktemp("ray")
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp_dir), log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def _dqn_config(deliver: str, store: bool = False, schedule: str = "sync", learning_starts: int = 32):
    from ray.rllib.algorithms.dqn import DQNConfig

    return (DQNConfig(algo_class=conduit_rllib.ConduitDQN)
            .environment("CartPole-v1")
            .env_runners(num_env_runners=0, rollout_fragment_length=16)
            .training(train_batch_size=32, num_steps_sampled_before_learning_starts=learning_starts, n_step=3,
                      learner_class=conduit_rllib.ConduitDQNTorchLearner, store_buffer_in_checkpoints=store,
                      replay_buffer_config={"type": "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer",
                                            "capacity": 2000, "alpha": 0.6, "beta": 0.4, "n_step": 3,
                                            "deliver": deliver, "schedule": schedule})
            .reporting(min_sample_timesteps_per_iteration=64)
            .debugging(seed=0))


def _trained_steps(result) -> int:
    return int(result["learners"]["default_policy"]["num_module_steps_trained_lifetime"])


@pytest.mark.parametrize("schedule", ["sync", "overlap", "adaptive"])
def test_dqn_prioritized_trains_through_dlpack(ray_session, schedule):
    """RLlib's DQN training_step, unchanged, on the Conduit buffer: with "overlap" the buffer hands over the batch it
    drew after the previous priority update ("adaptive": after it or after the previous sample()). Nothing is sampled
    before learning starts, and RLlib's counters see exactly the steps it asked for (a batch drawn ahead counts when
    it is handed over)."""
    algo = _dqn_config("torch", schedule=schedule, learning_starts=96).build_algo()
    try:
        result = algo.train()  # 64 env steps < 96: no learning yet
        buffer = algo.local_replay_buffer
        assert isinstance(buffer, conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer)
        assert buffer.get_sampled_timesteps() == 0 and buffer.timings["sample"] == 0
        for _ in range(2):
            result = algo.train()
        assert len(buffer) == result["num_env_steps_sampled_lifetime"] == 192
        trained = _trained_steps(result)
        assert trained > 0 and buffer.get_sampled_timesteps() == trained
        assert algo.learner_group._learner.conduit_batch_seconds > 0  # batches came through DLPack
        assert buffer.timings["update_priorities"] > 0  # RLlib called update_priorities with TD errors
        stats = buffer.stats()
        assert stats["priority_updates_ignored"] == 0
        drawn_ahead = stats["drawn_ahead_after_update"] + stats["drawn_ahead_after_sample"]
        assert (drawn_ahead == 0) == (schedule == "sync")
        assert result["replay_buffer"]["num_env_steps_added_lifetime"] == 192
    finally:
        algo.stop()


def test_multi_agent_dqn_trains_on_the_conduit_buffer(ray_session):
    """RLlib's multi-agent DQN (two policies on MultiAgentCartPole), training_step unchanged, on the multi-agent PER
    buffer with the overlap schedule: each module is sampled exactly what its learner trains on, and RLlib passes
    each module's TD errors back."""
    from ray.rllib.algorithms.dqn import DQNConfig
    from ray.rllib.examples.envs.classes.multi_agent import MultiAgentCartPole
    from ray.tune.registry import register_env

    register_env("conduit_ma_cartpole", lambda _: MultiAgentCartPole({"num_agents": 2}))
    config = (DQNConfig().environment("conduit_ma_cartpole")
              .multi_agent(policies={"p0", "p1"}, policy_mapping_fn=lambda agent_id, *_, **__: f"p{agent_id}")
              .env_runners(num_env_runners=0, rollout_fragment_length=16)
              .training(train_batch_size=32, num_steps_sampled_before_learning_starts=64, n_step=3,
                        replay_buffer_config={"type": "conduit_rllib.ConduitMultiAgentPrioritizedEpisodeReplayBuffer",
                                              "capacity": 2000, "alpha": 0.6, "beta": 0.4, "schedule": "overlap"})
              .reporting(min_sample_timesteps_per_iteration=64).debugging(seed=0))
    algo = config.build_algo()
    try:
        for _ in range(3):
            result = algo.train()
        buffer = algo.local_replay_buffer
        assert isinstance(buffer, conduit_rllib.ConduitMultiAgentPrioritizedEpisodeReplayBuffer)
        assert sorted(buffer.get_module_ids()) == ["p0", "p1"] and len(buffer) == 192
        for module_id in ("p0", "p1"):
            trained = int(result["learners"][module_id]["num_module_steps_trained_lifetime"])
            assert trained > 0 and buffer.get_sampled_timesteps(module_id) == trained
        assert buffer.timings["update_priorities"] > 0  # RLlib passed each module's TD errors
    finally:
        algo.stop()


@pytest.mark.slow
def test_sac_trains_with_conduit_buffers(ray_session):
    for deliver, buffer_type in (("episodes", "ConduitEpisodeReplayBuffer"),
                                 ("torch", "ConduitPrioritizedEpisodeReplayBuffer")):
        config = (conduit_rllib.ConduitSACConfig()
                  .environment("Pendulum-v1")
                  .env_runners(num_env_runners=0, rollout_fragment_length=16)
                  .training(train_batch_size=32, num_steps_sampled_before_learning_starts=32,
                            learner_class=conduit_rllib.ConduitSACTorchLearner,
                            replay_buffer_config={"type": f"conduit_rllib.{buffer_type}", "capacity": 2000,
                                                  "alpha": 0.6, "beta": 0.4, "deliver": deliver})
                  .reporting(min_sample_timesteps_per_iteration=32)
                  .debugging(seed=0))
        algo = config.build_algo()
        try:
            for _ in range(2):
                result = algo.train()
            assert type(algo.local_replay_buffer).__name__ == buffer_type
            assert len(algo.local_replay_buffer) > 0
            assert _trained_steps(result) > 0
            assert np.isfinite(result["learners"]["default_policy"]["qf_loss"])
        finally:
            algo.stop()


def test_ppo_trains_with_conduit_staging(ray_session):
    from ray.rllib.algorithms.ppo import PPOConfig

    config = (PPOConfig()
              .environment("CartPole-v1")
              .env_runners(num_env_runners=0, rollout_fragment_length=64)
              .training(train_batch_size=128, minibatch_size=32, num_epochs=2,
                        learner_class=conduit_rllib.ConduitPPOTorchLearner)
              .debugging(seed=0))
    algo = config.build_algo()
    try:
        for _ in range(2):
            result = algo.train()
        learner = algo.learner_group._learner
        pieces = [type(p).__name__ for p in learner._learner_connector.connectors]
        assert pieces[-1] == "ConduitGAE" and "GeneralAdvantageEstimation" not in pieces
        assert learner._conduit_gae.seconds > 0 and learner._conduit_staging.seconds > 0
        assert _trained_steps(result) >= 2 * 2 * 128  # 2 iterations x 2 epochs x >= 128 rows
        assert np.isfinite(result["learners"]["default_policy"]["policy_loss"])
    finally:
        algo.stop()


def test_buffer_survives_save_and_restore(ray_session, tmp_path):
    from ray.rllib.algorithms.algorithm import Algorithm

    config = _dqn_config("episodes", store=True)
    algo = config.build_algo()
    try:
        algo.train()
        state = algo.local_replay_buffer.get_state()
        path = algo.save(str(tmp_path / "ckpt")).checkpoint.path
        assert (pathlib.Path(path) / "conduit_replay_buffer" / "buffer.json").is_file()
    finally:
        algo.stop()
    for restored in (lambda: _restore(config, path), lambda: Algorithm.from_checkpoint(path)):
        other = restored()
        try:
            again = other.local_replay_buffer.get_state()
            for key, value in state["counters"].items():
                np.testing.assert_array_equal(again["counters"][key], value)
            for key, value in state["arrays"].items():
                np.testing.assert_array_equal(again["arrays"][key], value)
            assert len(other.local_replay_buffer) == 64
        finally:
            other.stop()


def _restore(config, path):
    algo = config.build_algo()
    algo.restore(path)
    return algo


def test_buffer_refuses_what_it_cannot_store_and_changes_nothing():
    """An add that would overwrite a step RLlib keeps (one episode longer than the 2 x capacity ring), infos that are
    not numbers, and extra_model_outputs keys that change between episodes are refused, naming what, with nothing
    stored."""
    buffer = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=10)
    buffer.add(_unique_episodes(0, 1, length=8))
    long = SingleAgentEpisode(id_="long", observations=[0.5], len_lookback_buffer=0)
    for t in range(25):
        long.add_env_step(observation=float(t), action=t, reward=1.0)
    before = (buffer.get_num_timesteps(), buffer.get_num_episodes(), buffer.get_added_timesteps(), buffer.stats())
    with pytest.raises(ValueError, match="raise capacity"):
        buffer.add(long)
    texts = SingleAgentEpisode(observations=[0.0], infos=[{"tag": "a"}], len_lookback_buffer=0)
    texts.add_env_step(observation=1.0, action=0, reward=1.0, infos={"tag": "b"})
    with pytest.raises(ValueError, match="'tag'"):
        buffer.add(texts)
    extra = SingleAgentEpisode(observations=[0.0], len_lookback_buffer=0)
    extra.add_env_step(observation=1.0, action=0, reward=1.0, extra_model_outputs={"logp": -0.5})
    with pytest.raises(ValueError, match="columns"):
        buffer.add(extra)
    assert (buffer.get_num_timesteps(), buffer.get_num_episodes(), buffer.get_added_timesteps(), buffer.stats()) == \
        before
    assert {float(e.get_observations(0)) // 1000 for e in buffer.sample(16)} == {0.0}


def test_sequences_of_episodes_refuse_bad_arguments_and_change_nothing():
    """Sequence arguments RLlib would assert on or loop forever with are refused, naming the argument; the buffer's
    counts and its random stream stay as they were (the next sample is the one it would have drawn)."""
    buffer = conduit_rllib.ConduitEpisodeReplayBuffer(capacity=100)
    buffer.add(_unique_episodes(0, 3, length=6))
    state = buffer.get_state()
    bad = [({"lookback": -1}, "lookback"), ({"batch_length_T": 2.5}, "batch_length_T"),
           ({"min_batch_length_T": 6}, "min_batch_length_T=6"), ({"n_step": 3}, "n_step=1")]
    for kwargs, named in bad:
        with pytest.raises(ValueError, match=named):
            buffer.sample(batch_size_B=8, **{"batch_length_T": 4, **kwargs}, sample_episodes=True)
    assert buffer.get_sampled_timesteps() == 0
    expected = [(e.id_, e.t_started, len(e)) for e in buffer.sample(8, batch_length_T=4, sample_episodes=True)]
    buffer.set_state(state)
    assert [(e.id_, e.t_started, len(e)) for e in buffer.sample(8, batch_length_T=4, sample_episodes=True)] == expected
    with pytest.raises(NotImplementedError, match="ConduitEpisodeReplayBuffer"):
        conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=100).sample(8, batch_length_T=4,
                                                                                 sample_episodes=True)


def test_rllib_schedules_probe_runs_every_path(tmp_path):
    """experiments/rllib_schedules.py, tiny: every buffer runs RLlib's loop, each measured round is recorded, and
    the scheduled Conduit buffers say where they drew ahead."""
    from experiments import rllib_schedules

    out = tmp_path / "probe.json"
    result = rllib_schedules.main(["--rounds", "2", "--block", "2", "--warmup", "1", "--updates", "2",
                                   "--learning-starts", "64", "--batch", "16", "--hidden", "8", "--out", str(out)])
    summary = result["results"]["updates_2"]
    assert list(summary) == [*rllib_schedules.EPISODES, *rllib_schedules.SCHEDULES]
    for path, row in summary.items():
        assert row["rounds"] == 2 and row["exposed_us"] > 0 and row["iteration_us"] >= row["exposed_us"]
    assert summary["sync"]["stats"]["drawn_ahead_after_update"] + summary["sync"]["stats"][
        "drawn_ahead_after_sample"] == 0
    assert summary["overlap"]["stats"]["drawn_ahead_after_update"] == 2 * 4  # 4 rounds of 2 updates, warm-up included
    assert summary["deferred"]["stats"]["drawn_ahead_after_sample"] == 2 * 4
    assert out.is_file()


@pytest.mark.parametrize("cls", ["ConduitEpisodeReplayBuffer", "ConduitPrioritizedEpisodeReplayBuffer"])
def test_config_keys_named_like_the_classes_own_arguments_are_ignored_as_unknown(cls, caplog):
    """``prioritized``, ``redraws``, ``label``, ``ring_advice`` are set by the class: from RLlib's
    ``replay_buffer_config`` they are unknown keys (warned about, ignored), never the store's arguments."""
    buffer_class = getattr(conduit_rllib, cls)
    with caplog.at_level("WARNING", logger="conduit_rllib.buffers"):
        buffer = buffer_class(capacity=16, prioritized="yes", redraws=False, label="mine", ring_advice="no",
                              adaptive_rule=None, colour="red")
    assert "ignoring unknown replay_buffer_config keys ['adaptive_rule', 'colour', 'label', 'prioritized', " \
           "'redraws', 'ring_advice']" in caplog.text
    assert buffer._label == cls
    assert buffer._prioritized == (cls == "ConduitPrioritizedEpisodeReplayBuffer")
    assert buffer._redraws == buffer._prioritized


@pytest.mark.parametrize("schedule", ["sync", "overlap", "deferred", "adaptive"])
def test_steps_added_before_a_priority_update_take_the_largest_priority_seen_before_it(schedule):
    """RLlib's order under every schedule: steps added between a sample() and its update_priorities() enter at the
    largest priority seen before that update; steps added after it, at the update's (the larger). Overlap and
    adaptive draw the next batch with the update, applied by the kernel that writes the adds right after them (one
    pass over the sum tree: the adds' priorities and the update's in two made XLA:CPU copy every level twice, 23 ms a
    step at capacity 1M); deferred queues the update on the host, after the adds."""
    buffer = conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer(capacity=200, alpha=1.0, schedule=schedule,
                                                               deliver="torch", seed=3)
    buffer.add(_unique_episodes(0, 5))
    for round_ in range(3):
        buffer.sample(num_items=16, n_step=1)
        before = _unique_episodes(10 + 2 * round_, 1)
        buffer.add(before)
        buffer.update_priorities(np.full(16, 10.0 ** (round_ + 2)))
        after = _unique_episodes(11 + 2 * round_, 1)
        buffer.add(after)
        leaves = buffer.get_state()["arrays"][".sampler.levels[3]"]
        previous = 1.0 if round_ == 0 else 10.0 ** (round_ + 1)
        np.testing.assert_array_equal(leaves[buffer.ring_rows(before[0].id_)], previous)
        np.testing.assert_array_equal(leaves[buffer.ring_rows(after[0].id_)], 10.0 ** (round_ + 2))
    if schedule in ("overlap", "adaptive"):
        kernels = list(buffer.compile_counts())
        assert [name for name in kernels if "+update[" in name and "rllib_draw" in name.split("+update[")[1]], kernels
