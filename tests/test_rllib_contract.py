"""RLlib's replay-buffer contract, checked the same way on RLlib's own buffers and on the Conduit ones.

The scenarios of RLlib 2.60's ``test_episode_replay_buffer.py`` and ``test_prioritized_episode_buffer.py``, written
here against the public buffer API (where RLlib's tests read a private attribute, the public behaviour it stands for is
checked instead), each run on ``EpisodeReplayBuffer`` / ``PrioritizedEpisodeReplayBuffer`` and on
``ConduitEpisodeReplayBuffer`` / ``ConduitPrioritizedEpisodeReplayBuffer`` with the same assertions.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest
from scipy import stats

pytest.importorskip("torch")
pytest.importorskip("ray.rllib")

if importlib.util.find_spec("conduit_rllib") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "adapters"))

from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer  # noqa: E402
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer  # noqa: E402
import tree  # noqa: E402

import conduit_rllib  # noqa: E402
from conduit_rllib.metrics import PushingLogger  # noqa: E402

PRIORITIZED = [PrioritizedEpisodeReplayBuffer, conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer]
UNIFORM = [EpisodeReplayBuffer, conduit_rllib.ConduitEpisodeReplayBuffer]
ROUNDS = 200  # sample calls per scenario (RLlib's tests make 1,000)


def by_name(cls):
    return cls.__name__


def episode(rng, length=None, id_=None, *, offset=0.0, extras=False):
    """An episode whose observation at step t is ``offset + t``, action ``t``, reward ``0.1 * (t + 1)`` (so the reward
    of a step is a tenth of the next observation when ``offset`` is 0), ended at random."""
    length = int(rng.integers(1, 200)) if length is None else length
    e = SingleAgentEpisode(id_=id_, observations=[offset], infos=[{}])
    for t in range(length):
        e.add_env_step(observation=offset + t + 1.0, action=t, reward=0.1 * (t + 1), infos={},
                       extra_model_outputs={k: k for k in range(2)} if extras else None)
    e.is_terminated = bool(rng.random() > 0.5)
    e.is_truncated = False if e.is_terminated else bool(rng.random() > 0.8)
    return e


def filled(cls, rng, capacity=10_000, episodes=200, **kwargs):
    buffer = cls(capacity=capacity)
    for _ in range(episodes):
        buffer.add(episode(rng, **kwargs))
    return buffer


def transition(e):
    return (e.get_observations(0), e.get_actions(-1), e.get_rewards(-1), e.get_observations(-1), e.is_terminated,
            e.is_truncated, e.get_extra_model_outputs("weights", -1), e.get_extra_model_outputs("n_step", -1))


# -- eviction ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
def test_prioritized_evicts_whole_oldest_episodes_as_rllib(cls):
    rng = np.random.default_rng(0)
    buffer = cls(capacity=100)
    steps = [("A", 50, 1, 50), ("B", 25, 2, 75), ("C", 25, 3, 100), ("D", 1, 3, 51), ("E", 200, 1, 200),
             ("F", 2, 1, 2)] + [(str(i), 10, i + 2, 2 + 10 * (i + 1)) for i in range(9)] + [("9", 10, 10, 100),
                                                                                           ("G", 21, 8, 91)]
    for id_, length, episodes, timesteps in steps:
        buffer.add(episode(rng, length, id_))
        assert (buffer.get_num_episodes(), buffer.get_num_timesteps()) == (episodes, timesteps), id_
        if id_ == "D":
            assert {e.id_ for e in buffer.episodes} == {"B", "C", "D"}
    assert {e.id_ for e in buffer.episodes} == {"3", "4", "5", "6", "7", "8", "9", "G"}
    assert buffer.get_num_episodes_evicted() == 9
    assert buffer.get_added_timesteps() == 50 + 25 + 25 + 1 + 200 + 2 + 100 + 21
    # nothing evicted is drawn: the stored episodes are at most 21 steps long
    for _ in range(20):
        for e in buffer.sample(batch_size_B=16, n_step=1):
            assert 0 <= e.get_observations(0) < 21


@pytest.mark.parametrize("cls", UNIFORM, ids=by_name)
def test_uniform_evicts_whole_oldest_episodes_as_rllib(cls):
    rng = np.random.default_rng(1)
    buffer = cls(capacity=100)
    for id_, length in (("A", 50), ("B", 25), ("C", 25)):
        buffer.add(episode(rng, length, id_))
    assert (buffer.get_num_episodes(), buffer.get_num_timesteps()) == (3, 100)
    buffer.add(episode(rng, 1, "D"))
    assert (buffer.get_num_episodes(), buffer.get_num_timesteps()) == (3, 51)
    assert {e.id_ for e in buffer.episodes} == {"B", "C", "D"}
    buffer.add(episode(rng, 200, "E"))
    assert (buffer.get_num_episodes(), buffer.get_num_timesteps()) == (1, 200)
    assert {e.id_ for e in buffer.episodes} == {"E"}
    assert buffer.get_num_episodes_evicted() == 4


@pytest.mark.parametrize("cls", UNIFORM + PRIORITIZED, ids=by_name)
def test_a_continued_episode_is_one_episode_and_evicted_whole(cls):
    """Chunks of one episode id are one stored episode; when it is the oldest, all its chunks go together and a later
    chunk of it starts a new episode."""
    rng = np.random.default_rng(2)
    buffer = cls(capacity=30)
    first = episode(rng, 10, "A")
    first.is_terminated = first.is_truncated = False
    buffer.add(first)
    buffer.add(episode(rng, 10, "B"))
    later = first.cut()
    for t in range(10):
        later.add_env_step(observation=11.0 + t, action=10 + t, reward=0.1 * (11 + t))
    buffer.add(later)
    assert (buffer.get_num_episodes(), buffer.get_num_timesteps()) == (2, 30)
    assert sorted(len(e) for e in buffer.episodes) == [10, 20]
    buffer.add(episode(rng, 5, "C"))  # 35 steps: A (20 steps, two chunks) goes
    assert (buffer.get_num_episodes(), buffer.get_num_timesteps()) == (2, 15)
    assert {e.id_ for e in buffer.episodes} == {"B", "C"} and buffer.get_num_episodes_evicted() == 1


@pytest.mark.parametrize("native, conduit, longest", [(UNIFORM[0], UNIFORM[1], 70), (PRIORITIZED[0], PRIORITIZED[1], 20)],
                         ids=["uniform", "prioritized"])
def test_adds_of_several_chunks_evict_as_rllib(native, conduit, longest):
    """Adds of several chunks at once (new episodes and chunks of stored ones) keep RLlib's episodes, counts and
    evictions, add for add. Uniform chunks may be longer than the capacity, so an add can evict an episode it opened;
    RLlib's prioritized buffer fails on an add whose new chunks alone pass the capacity, so its adds stay within."""
    rng = np.random.default_rng(4)
    buffers = [native(capacity=60), conduit(capacity=60)]
    open_chunks, next_id = [], 0
    for _ in range(60):
        chunks = []
        for _ in range(int(rng.integers(1, 4))):
            if open_chunks and rng.random() < 0.4:  # a later chunk of an episode added before
                last = open_chunks.pop(int(rng.integers(len(open_chunks))))
                chunk = last.cut()
                for t in range(int(rng.integers(1, longest))):
                    chunk.add_env_step(observation=float(t), action=t, reward=0.1)
            else:
                chunk = episode(rng, int(rng.integers(1, longest)), f"e{next_id}")
                chunk.is_terminated = chunk.is_truncated = False
                next_id += 1
            chunks.append(chunk)
        for chunk in chunks:
            if rng.random() < 0.7:
                open_chunks.append(chunk)
        for buffer in buffers:
            buffer.add([copy_of(chunk) for chunk in chunks])
        seen = [(b.get_num_episodes(), b.get_num_timesteps(), b.get_num_episodes_evicted(), b.get_added_timesteps(),
                 [e.id_ for e in b.episodes], [len(e) for e in b.episodes]) for b in buffers]
        assert seen[0] == seen[1]
    assert buffers[0].get_num_episodes_evicted() > 10


def copy_of(chunk):
    """An episode chunk each buffer gets for itself (RLlib's buffer keeps, and extends, the object it was given)."""
    return SingleAgentEpisode.from_state(chunk.get_state())


# -- sampling ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
@pytest.mark.parametrize("n", [1, 3])
def test_prioritized_n_step_transitions_as_rllib(cls, n):
    """(o_t, a_t, sum_k 0.99^k r_(t+k), o_(t+n)) with exactly n steps (a step too close to its episode's end is
    redrawn), weights 1 at the default beta 0, n_step n, and the sampled-steps counter."""
    rng = np.random.default_rng(3)
    buffer = filled(cls, rng)
    for i in range(ROUNDS):
        batch = buffer.sample(batch_size_B=16, n_step=n)
        assert buffer.get_sampled_timesteps() == 16 * (i + 1)
        for e in batch:
            obs, action, reward, next_obs, terminated, truncated, weight, n_step = transition(e)
            assert not (terminated and truncated)
            assert obs == action and next_obs == obs + n  # float64 observations come back as added
            assert reward == pytest.approx(sum(0.99 ** k * 0.1 * (obs + 1 + k) for k in range(n)), abs=1e-8)
            assert weight == pytest.approx(1.0, abs=1e-8) and n_step == n


@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
def test_prioritized_random_n_step_as_rllib(cls):
    rng = np.random.default_rng(4)
    buffer = filled(cls, rng)
    for _ in range(ROUNDS // 4):
        n_steps = [transition(e)[-1] for e in buffer.sample(batch_size_B=16, n_step=(1, 5))]
        assert all(1 <= n < 5 for n in n_steps)
        assert np.var(n_steps) > 0
    for e in buffer.sample(batch_size_B=64, n_step=(1, 5)):
        obs, _, _, next_obs, *_, n_step = transition(e)
        assert next_obs == obs + n_step


@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
def test_prioritized_infos_and_extra_model_outputs_as_rllib(cls):
    rng = np.random.default_rng(5)
    buffer = filled(cls, rng, extras=True)
    for _ in range(ROUNDS // 4):
        for e in buffer.sample(batch_size_B=16, n_step=1, include_infos=True, include_extra_model_outputs=True):
            assert len(e.get_infos()) == 2
            assert len(e.get_extra_model_outputs(0)) == 1 and len(e.get_extra_model_outputs(1)) == 1
            assert e.get_extra_model_outputs(1)[0] == 1


# -- priorities -------------------------------------------------------------------------------------------------------
def _observations(batch):
    return [float(e.get_observations(0)) for e in batch]


@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
def test_lowered_priorities_are_rarely_drawn_again(cls):
    """RLlib's ``test_update_priorities`` against the public API: steps whose priority drops to 0.01 (the rest at
    1.0) are in fewer than 15% of later batches. Observations are unique per step here, so they name the steps."""
    rng = np.random.default_rng(6)
    buffer = cls(capacity=100)
    for k in range(200):
        buffer.add(episode(rng, offset=1000.0 * k))
    batch = buffer.sample(batch_size_B=16, n_step=1)
    assert all(transition(e)[-2] == pytest.approx(1.0, abs=1e-5) for e in batch)
    lowered = set(_observations(batch))
    buffer.update_priorities(np.full(16, 0.01))
    hits = [bool(lowered & set(_observations(buffer.sample(batch_size_B=16, n_step=1)))) for _ in range(ROUNDS)]
    assert np.mean(hits) < 0.15


@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
def test_one_high_priority_step_takes_most_draws(cls):
    """One step at priority 1.0, nine at 0.01 (set through sample / update_priorities rounds): with alpha 1 over
    80% of 1,000 draws are that step (expected 1 / 1.09 = 92%)."""
    rng = np.random.default_rng(7)
    buffer = cls(capacity=10)
    buffer.add(episode(rng, 10))
    target = 2.0  # the observation of step 2
    for _ in range(30):
        batch = buffer.sample(batch_size_B=10, n_step=1)
        buffer.update_priorities(np.where(np.array(_observations(batch)) == target, 1.0, 0.01))
    for _ in range(5):
        share = np.mean(np.array(_observations(buffer.sample(1000, n_step=1))) == target)
        assert share > 0.8, share


def _steps(batch) -> np.ndarray:
    return np.array([transition(e)[0] % 1000 for e in batch])


def short_episodes(cls, low: float, high: float):
    """4-step episodes and 3-step windows: only steps 0 and 1 fit. The other steps are never drawn, so they keep the
    first (largest) priority 1.0, while 40 rounds of updates set step 0 to ``low`` and step 1 to ``high`` (alpha 1)."""
    rng = np.random.default_rng(12)
    buffer = cls(capacity=1000, alpha=1.0)
    for k in range(50):
        buffer.add(episode(rng, 4, id_=str(k), offset=1000.0 * k))
    draw_short(buffer, low, high, 40)
    return buffer


def draw_short(buffer, low: float, high: float, batches: int) -> np.ndarray:
    """The steps of ``batches`` batches of 32 (each window checked), priorities updated as ``short_episodes`` says."""
    drawn = []
    for _ in range(batches):
        batch = buffer.sample(batch_size_B=32, n_step=3)
        assert all(transition(e)[3] == transition(e)[0] + 3 for e in batch)  # o_(t+3) of the same episode
        drawn.append(_steps(batch))
        buffer.update_priorities(np.where(drawn[-1] == 0, low, high))
    return np.concatenate(drawn)


@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
def test_short_episodes_whose_unfitting_steps_hold_most_priority(cls):
    """Steps 0 / 1 at 0.05 / 0.2 (``short_episodes``): 89% of the priority mass sits on steps that never fit. Every
    window still fits, and the fitting steps are drawn by priority (step 1 in 0.2 / 0.25 = 80% of draws; binomial
    test). The Conduit buffer sizes its draw by the share that fitted before: one kernel per ``sample()``."""
    buffer = short_episodes(cls, 0.05, 0.2)
    kernels = buffer.stats()["sample_kernels"] if hasattr(buffer, "stats") else None
    drawn = draw_short(buffer, 0.05, 0.2, 20)
    assert set(drawn) <= {0, 1}
    assert stats.binomtest(int(np.sum(drawn == 1)), drawn.size, 0.8).pvalue > 1e-3
    if kernels is not None:
        assert buffer.stats()["sample_kernels"] - kernels <= 25  # 20 batches


@pytest.mark.slow
def test_fitting_steps_with_almost_no_priority_are_joined_from_several_draws():
    """Steps 0 / 1 at 1e-4 / 4e-4: the steps that fit hold 0.025% of the mass, fewer than 32 fit even in the largest
    draw kernel, so the Conduit buffer joins the fitting steps of several (RLlib's buffer resamples ~4,000 times a
    step here, so only the Conduit class runs this). Still step 1 in 80% of draws."""
    buffer = short_episodes(conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer, 1e-4, 4e-4)
    kernels = buffer.stats()["sample_kernels"]
    drawn = draw_short(buffer, 1e-4, 4e-4, 10)
    assert buffer.stats()["sample_kernels"] - kernels > 20  # several kernels per batch
    assert set(drawn) <= {0, 1}
    assert stats.binomtest(int(np.sum(drawn == 1)), drawn.size, 0.8).pvalue > 1e-3


@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
def test_weights_are_normalised_by_the_smallest_priority(cls):
    """IS weights (P(i) / P_min)^-beta over every stored step, as RLlib computes them: with priorities 1.0 for a
    sampled batch and 0.25 for one step, a step at 1.0 weighs 0.25^beta."""
    rng = np.random.default_rng(8)
    buffer = cls(capacity=16)
    buffer.add(episode(rng, 16))
    batch = buffer.sample(batch_size_B=16, n_step=1)
    priorities = np.where(np.array(_observations(batch)) == _observations(batch)[0], 0.25, 1.0)
    buffer.update_priorities(priorities)
    low = _observations(batch)[0]
    for beta in (0.0, 0.4, 1.0):
        for e in buffer.sample(batch_size_B=32, n_step=1, beta=beta):
            weight = transition(e)[-2]
            want = 1.0 if float(e.get_observations(0)) == low else 0.25 ** beta
            assert weight == pytest.approx(want, rel=1e-4), (beta, float(e.get_observations(0)))


# -- state ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
def test_state_round_trip_keeps_counts_and_contents(cls):
    """RLlib's ``test_get_state_and_set_state``: the restored buffer reports the same counts (RLlib's test also compares
    private index fields; here: it draws only steps of the episodes it reports)."""
    rng = np.random.default_rng(9)
    buffer = cls(capacity=100)
    for k in range(200):
        buffer.add(episode(rng, id_=str(k), offset=1000.0 * k))
    buffer.sample(batch_size_B=8, n_step=1)
    restored = cls(capacity=100)
    restored.set_state(buffer.get_state())
    for count in ("get_num_episodes", "get_num_episodes_evicted", "get_num_timesteps", "get_added_timesteps",
                  "get_sampled_timesteps"):
        assert getattr(restored, count)() == getattr(buffer, count)(), count
    assert [e.id_ for e in restored.episodes] == [e.id_ for e in buffer.episodes]
    stored = {int(e.id_) for e in buffer.episodes}
    for e in restored.sample(batch_size_B=64, n_step=1):
        assert e.get_observations(0) // 1000 in stored
        if cls is not PrioritizedEpisodeReplayBuffer:  # RLlib's PER gives each sampled step a fresh episode id
            assert int(e.id_) == e.get_observations(0) // 1000  # the stored episode's id, as RLlib's ERB does


# -- sequences --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", UNIFORM, ids=by_name)
def test_uniform_sequence_batches_as_rllib(cls):
    """RLlib's [B, T] batch (``sample_episodes=False``, the default): rows of consecutive entries that run into
    another episode from its first step, the final observation of each episode with its last action repeated.
    float64 observations and rewards come back exactly as added (compared exactly, as RLlib's own test does)."""
    rng = np.random.default_rng(10)
    buffer = cls(capacity=10_000)
    for _ in range(200):
        buffer.add(episode(rng))
    for _ in range(ROUNDS // 4):
        sample = buffer.sample(batch_size_B=16, batch_length_T=64)
        obs, actions, rewards = sample["obs"], sample["actions"], sample["rewards"]
        is_first, is_last = sample["is_first"], sample["is_last"]
        is_terminated, is_truncated = sample["is_terminated"], sample["is_truncated"]
        assert not np.any(is_truncated & is_terminated)
        assert np.all(is_last[:, -1]) and np.all(is_first[:, 0])
        assert obs.shape[:2] == rewards.shape == actions.shape == is_first.shape == is_last.shape
        assert np.all(obs * 0.1 == rewards)
        assert np.all(np.where(is_last, True, obs == actions))
        assert np.all(np.where(is_terminated[:, 1:], actions[:, 1:] == actions[:, :-1], True))
        assert np.all(np.where(is_terminated[:, :-1], rewards[:, 1:] == 0.0, True))
        # within a row an entry follows the previous one in its episode, or a new episode starts from its first step
        following = obs[:, 1:] == obs[:, :-1] + 1
        assert np.all(following | (is_first[:, 1:] & (obs[:, 1:] == 0)))
        assert np.all(np.where(is_first[:, 1:], is_last[:, :-1], True))
    assert buffer.get_sampled_timesteps() == 16 * 64 * (ROUNDS // 4)


@pytest.mark.parametrize("cls", UNIFORM, ids=by_name)
@pytest.mark.parametrize("lookback, min_length", [(0, 0), (1, 0), (3, 5)])
def test_uniform_sequences_of_episodes_as_rllib(cls, lookback, min_length):
    """``sample(sample_episodes=True, batch_length_T=T, lookback=L, min_batch_length_T=m)`` (what RLlib's DQN asks
    for with a stateful module): slices of stored episodes from a uniformly drawn step t, up to T steps to the
    episode's end, with up to L steps before t as lookback (clipped at the episode's first step), ``t + m`` inside
    the episode, the slices' lengths + 1 adding up to the batch size as RLlib counts."""
    rng = np.random.default_rng(11)
    buffer = cls(capacity=10_000)
    added = {}
    for _ in range(60):
        e = episode(rng, int(rng.integers(1, 40)), extras=True)
        added[e.id_] = (len(e), e.is_terminated, e.is_truncated)
        buffer.add(e)
    T, B = 8, 40
    for _ in range(ROUNDS // 4):
        sampled = buffer.sample(batch_size_B=B, batch_length_T=T, lookback=lookback, min_batch_length_T=min_length,
                                n_step=1, sample_episodes=True)
        counts = [len(e) + 1 for e in sampled]
        assert sum(counts) >= B > sum(counts[:-1])
        for e in sampled:
            length, terminated, truncated = added[e.id_]
            t = e.t_started
            assert len(e) == min(T, length - t)
            assert t + min_length < length or not min_length
            observations = e.get_observations()
            assert np.all(observations == np.arange(t, t + len(e) + 1))  # step t's observation is t
            assert np.all(e.get_actions() == np.arange(t, t + len(e)))
            assert np.allclose(e.get_rewards(), 0.1 * (np.arange(t, t + len(e)) + 1))
            assert e.observations.lookback == min(lookback, t)
            if e.observations.lookback:
                assert e.get_observations(-1, neg_index_as_lookback=True) == t - 1
            reaches_end = t + len(e) == length
            assert (e.is_terminated, e.is_truncated) == (terminated and reaches_end, truncated and reaches_end)
            assert np.all(e.get_extra_model_outputs("n_step") == 1)
            assert np.all(e.get_extra_model_outputs("weights") == 1.0)
            assert np.all(np.asarray(e.get_extra_model_outputs(0)) == 0)
            assert np.all(np.asarray(e.get_extra_model_outputs(1)) == 1)
    assert buffer.get_sampled_timesteps() == B * (ROUNDS // 4)


@pytest.mark.parametrize("cls", UNIFORM, ids=by_name)
def test_sequences_of_episodes_start_at_uniformly_drawn_steps(cls):
    """Each slice starts at a step drawn uniformly from every stored step (chi-square over the 24 steps of three
    episodes of 4, 8 and 12 steps)."""
    rng = np.random.default_rng(12)
    buffer = cls(capacity=1_000)
    lengths = {"a": 4, "b": 8, "c": 12}
    for id_, length in lengths.items():
        buffer.add(episode(rng, length, id_))
    first = dict(zip(lengths, np.cumsum([0, *lengths.values()])))  # each episode's first step among the 24
    counts = np.zeros(24)
    for _ in range(300):
        for e in buffer.sample(batch_size_B=20, batch_length_T=2, n_step=1, sample_episodes=True):
            counts[first[e.id_] + e.t_started] += 1
    assert counts.sum() > 1_500
    assert stats.chisquare(counts).pvalue > 1e-3


@pytest.mark.parametrize("cls", UNIFORM, ids=by_name)
def test_sequence_batch_rows_start_at_uniformly_drawn_steps(cls):
    """Each row of the [B, T] batch starts at a step drawn uniformly from every stored step, whatever its place in
    the batch (chi-square over the 24 steps of three episodes of 4, 8 and 12 steps, observations 0.., 100.., 200..,
    for the first and the last row)."""
    rng = np.random.default_rng(13)
    buffer = cls(capacity=1_000)
    for k, length in enumerate((4, 8, 12)):
        buffer.add(episode(rng, length, str(k), offset=100.0 * k))
    step = {100 * k + t: i for i, (k, t) in enumerate((k, t) for k, n in enumerate((4, 8, 12)) for t in range(n))}
    counts = np.zeros((2, 24))
    for _ in range(480):
        starts = buffer.sample(batch_size_B=24, batch_length_T=6)["obs"][[0, -1], 0]
        counts[[0, 1], [step[int(start)] for start in starts]] += 1
    for row in counts:
        assert stats.chisquare(row).pvalue > 1e-3


# -- the tool that runs RLlib's own test files on the Conduit classes ---------------------------------------------------
@pytest.mark.slow
def test_rllib_own_tests_tool_substitutes_every_buffer_class(tmp_path):
    """``experiments/rllib_own_tests.py`` runs a test file unmodified with the Conduit classes in RLlib's modules (a
    test file here stands for RLlib's: it checks which class each of its imports found)."""
    from experiments import rllib_own_tests

    probe = tmp_path / "test_which_class.py"
    probe.write_text(
        "from ray.rllib.utils.replay_buffers import MultiAgentPrioritizedEpisodeReplayBuffer as package_level\n"
        "from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer\n"
        "from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer\n"
        "from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import MultiAgentEpisodeReplayBuffer\n\n"
        "def test_conduit():\n"
        "    for cls in (package_level, EpisodeReplayBuffer, PrioritizedEpisodeReplayBuffer,\n"
        "                MultiAgentEpisodeReplayBuffer):\n"
        "        assert cls.__name__.startswith('Conduit'), cls\n")
    assert rllib_own_tests.run_file(probe, conduit=True) == {"test_which_class::test_conduit": "passed"}


# -- metrics ----------------------------------------------------------------------------------------------------------
class _EachValueLogged(PushingLogger):
    """Every value through ``MetricsLogger.log_value``, as RLlib's own buffers log it."""

    def log_value(self, key, value, **kwargs):
        self.logger.log_value(key, value, **kwargs)


@pytest.mark.parametrize("cls", [conduit_rllib.ConduitEpisodeReplayBuffer,
                                 conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer], ids=by_name)
def test_metrics_equal_those_logged_value_by_value(cls):
    """A Conduit buffer pushes a metric's later values onto its ``Stats`` and adds integer counts up on the host
    (``metrics.PushingLogger``); every ``Stats`` of ``get_metrics()`` (its whole state), and what ``buffer.metrics``
    shows when read directly, equal those of the same buffer logging each value through ``MetricsLogger.log_value``,
    across adds that evict, samples of a random n-step, sequence samples and a reset of the logger."""
    buffers = [cls(capacity=300, metrics_num_episodes_for_smoothing=5) for _ in range(2)]
    buffers[1]._logged.pushing = _EachValueLogged(buffers[1].metrics)
    rngs = [np.random.default_rng(3), np.random.default_rng(3)]
    for i in range(20):
        metrics, peeks = [], []
        for buffer, rng in zip(buffers, rngs):
            buffer.add([episode(rng, int(rng.integers(1, 40))) for _ in range(int(rng.integers(1, 4)))])
            if i % 2:
                buffer.sample(num_items=16, n_step=(1, 3), beta=0.5, sample_episodes=True)
                if isinstance(buffer, PrioritizedEpisodeReplayBuffer):
                    buffer.update_priorities(rng.random(16))
            elif not isinstance(buffer, PrioritizedEpisodeReplayBuffer):
                buffer.sample(batch_size_B=4, batch_length_T=3)
            if i == 10:
                buffer.metrics.reset()
            peeks.append(buffer.metrics.peek())  # read directly too: the sums added up on the host are on it
            metrics.append(tree.map_structure(lambda stats: stats.get_state(), buffer.get_metrics()))
        np.testing.assert_equal(peeks[0], peeks[1])
        assert metrics[0] == metrics[1], i
    assert buffers[0].get_num_episodes_evicted() > 0
    assert isinstance(buffers[1]._logged.pushing, _EachValueLogged)  # the reference logged value by value throughout
