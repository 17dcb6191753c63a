"""RLlib's multi-agent replay-buffer contract, checked the same way on RLlib's own buffers and on the Conduit ones.

The scenarios of RLlib 2.60's multi-agent buffer tests (eviction and per-module counts, independent sampling, state),
written here against the public API and run with the same assertions on ``MultiAgentEpisodeReplayBuffer`` /
``MultiAgentPrioritizedEpisodeReplayBuffer`` and their Conduit counterparts (RLlib's multi-agent DQN on the Conduit
buffer is in test_rllib_adapter.py, with the other algorithms).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("ray.rllib")

if importlib.util.find_spec("conduit_rllib") is None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "adapters"))

from ray.rllib.env.multi_agent_episode import MultiAgentEpisode  # noqa: E402
from ray.rllib.env.single_agent_episode import SingleAgentEpisode  # noqa: E402
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import MultiAgentEpisodeReplayBuffer  # noqa: E402
from ray.rllib.utils.replay_buffers.multi_agent_prioritized_episode_buffer import (  # noqa: E402
    MultiAgentPrioritizedEpisodeReplayBuffer)

import conduit_rllib  # noqa: E402

UNIFORM = [MultiAgentEpisodeReplayBuffer, conduit_rllib.ConduitMultiAgentEpisodeReplayBuffer]
PRIORITIZED = [MultiAgentPrioritizedEpisodeReplayBuffer, conduit_rllib.ConduitMultiAgentPrioritizedEpisodeReplayBuffer]
CONDUIT = [conduit_rllib.ConduitMultiAgentEpisodeReplayBuffer,
           conduit_rllib.ConduitMultiAgentPrioritizedEpisodeReplayBuffer]
MODULES = {"agent_1": "module_1", "agent_2": "module_2"}
ROUNDS = 20  # sample calls per scenario (RLlib's tests make 1,000)
TOLERANCE = 1e-8  # as RLlib's tests: float64 values come back from the Conduit buffers as they were added


def by_name(cls):
    return cls.__name__


def episode(rng, length=None, id_=None, *, offset=0.0, agents=MODULES):
    """A multi-agent episode in which every agent's observation at step t is ``offset + t``, its action ``t`` and its
    reward ``0.1 * (t + 1)``."""
    length = int(rng.integers(1, 200)) if length is None else length
    e = MultiAgentEpisode(id_=id_, observations=[{a: offset for a in agents}], infos=[{a: {} for a in agents}],
                          agent_module_ids=dict(agents))
    for t in range(length):
        e.add_env_step(observations={a: offset + t + 1.0 for a in agents}, actions={a: t for a in agents},
                       rewards={a: 0.1 * (t + 1) for a in agents}, infos={a: {} for a in agents})
    return e


def filled(cls, seed, episodes, length=None, *, offsets=False, capacity=10_000, **kwargs):
    """A buffer holding ``episodes`` episodes ``E0``, ``E1``, ... (observations offset by 1000 k with ``offsets``)."""
    rng = np.random.default_rng(seed)
    buffer = cls(capacity=capacity, **kwargs)
    for k in range(episodes):
        buffer.add(episode(rng, length, f"E{k}", offset=1000.0 * k if offsets else 0.0))
    return buffer


def counts(buffer):
    modules = sorted(buffer.get_module_ids())
    return (buffer.get_num_episodes(), buffer.get_num_timesteps(), buffer.get_num_agent_timesteps(),
            buffer.get_added_agent_timesteps(), buffer.get_num_episodes_evicted(),
            [(m, buffer.get_num_episodes(m), buffer.get_num_timesteps(m), buffer.get_added_timesteps(m),
              buffer.get_num_episodes_evicted(m)) for m in modules])


# -- eviction and counts ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", UNIFORM + PRIORITIZED, ids=by_name)
def test_evicts_whole_oldest_episodes_and_counts_per_module_as_rllib(cls):
    rng = np.random.default_rng(0)
    buffer = cls(capacity=100)
    steps = [("A", 50, 1, 50), ("B", 25, 2, 75), ("C", 25, 3, 100), ("D", 1, 3, 51), ("E", 200, 1, 200),
             ("F", 2, 1, 2)] + [(str(i), 10, i + 2, 2 + 10 * (i + 1)) for i in range(9)] + [("9", 10, 10, 100),
                                                                                           ("G", 21, 8, 91)]
    added = 0
    for id_, length, episodes, timesteps in steps:
        buffer.add(episode(rng, length, id_))
        added += length
        assert (buffer.get_num_episodes(), buffer.get_num_timesteps()) == (episodes, timesteps), id_
        assert buffer.get_num_agent_timesteps() == 2 * timesteps and buffer.get_added_agent_timesteps() == 2 * added
        for module_id in ("module_1", "module_2"):
            assert (buffer.get_num_episodes(module_id), buffer.get_num_timesteps(module_id),
                    buffer.get_added_timesteps(module_id)) == (episodes, timesteps, added), (id_, module_id)
    assert {e.id_ for e in buffer.episodes} == {"3", "4", "5", "6", "7", "8", "9", "G"}
    assert buffer.get_num_episodes_evicted() == buffer.get_num_episodes_evicted("module_1") == 9
    # nothing evicted is drawn: the stored episodes are at most 21 steps long
    for e in buffer.sample(batch_size_B=64, n_step=1):
        assert e.get_observations(0) < 21


@pytest.mark.parametrize("cls", UNIFORM + PRIORITIZED, ids=by_name)
def test_continued_episodes_and_agents_of_one_module_count_as_rllib(cls):
    """Chunks of one episode (``cut()``) are one episode; two agents on one module give it two episodes per
    multi-agent episode; an agent that never acted adds no steps. Native and Conduit report the same counts."""
    rng = np.random.default_rng(1)
    buffer = cls(capacity=60)
    shared = {"a": "shared", "b": "shared", "c": "solo"}
    first = episode(rng, 20, "X", agents=shared)
    buffer.add(first)
    rest = first.cut()
    for t in range(20, 30):
        rest.add_env_step(observations={a: t + 1.0 for a in shared}, actions={a: t for a in shared},
                          rewards={a: 0.1 for a in shared}, infos={a: {} for a in shared})
    buffer.add(rest)
    assert (buffer.get_num_episodes(), buffer.get_num_timesteps()) == (1, 30)
    assert (buffer.get_num_episodes("shared"), buffer.get_num_timesteps("shared")) == (2, 60)
    assert (buffer.get_num_episodes("solo"), buffer.get_num_timesteps("solo")) == (1, 30)
    buffer.add(episode(rng, 40, "Y", agents=shared))  # over capacity: X goes whole
    assert [e.id_ for e in buffer.episodes] == ["Y"]
    assert buffer.get_num_episodes_evicted("shared") == 2 and buffer.get_num_timesteps("shared") == 80
    # X's continuation is one episode: a 3-step window starting at step 18 runs into the second chunk
    assert counts(buffer)[:2] == (1, 40)


# -- sampling ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", UNIFORM + PRIORITIZED, ids=by_name)
def test_independent_sample_as_rllib(cls):
    """RLlib's ``test_buffer_independent_sample_logic``: each module gets B of its agents' transitions; the
    overall counter grows by B per call, each module's by B; weights 1 at beta 0, n_step 1; and each transition
    names its agent, module and multi-agent episode."""
    rng = np.random.default_rng(2)
    buffer = cls(capacity=10_000)
    stored = {}
    for k in range(60):
        e = episode(rng, id_=f"E{k}", offset=1000.0 * k)
        stored[e.id_] = {a: sa.id_ for a, sa in e.agent_episodes.items()}
        buffer.add(e)
    for i in range(ROUNDS):
        sample = buffer.sample(batch_size_B=16, n_step=1)
        assert len(sample) == 32 and all(isinstance(e, SingleAgentEpisode) for e in sample)
        assert buffer.get_sampled_timesteps() == 16 * (i + 1)
        for module_id in ("module_1", "module_2"):
            assert sum(e.module_id == module_id for e in sample) == 16
            assert buffer.get_sampled_timesteps(module_id) == 16 * (i + 1)
        for e in sample:
            obs, action, reward, next_obs, terminated, truncated, weight, n = (
                e.get_observations(0), e.get_actions(-1), e.get_rewards(-1), e.get_observations(-1), e.is_terminated,
                e.is_truncated, e.get_extra_model_outputs("weights", -1), e.get_extra_model_outputs("n_step", -1))
            assert not (terminated and truncated)
            offset = 1000.0 * int(e.multi_agent_episode_id[1:])
            assert abs((obs - offset) - action) < TOLERANCE
            assert abs(next_obs - obs - 1) < TOLERANCE
            assert abs(reward * 10 - (next_obs - offset)) < TOLERANCE
            assert abs(weight - 1.0) < TOLERANCE and n == 1
            assert MODULES[e.agent_id] == e.module_id and stored[e.multi_agent_episode_id][e.agent_id] == e.id_


@pytest.mark.parametrize("cls", UNIFORM + PRIORITIZED, ids=by_name)
def test_n_step_windows_stay_in_the_agents_episode(cls):
    """3-step transitions: o_(t+3), the discounted reward sum, and no window past an episode's end (redrawn)."""
    rng = np.random.default_rng(3)
    buffer = cls(capacity=10_000)
    for k in range(40):
        buffer.add(episode(rng, int(rng.integers(3, 30)), f"E{k}", offset=1000.0 * k))
    gamma = 0.9
    for _ in range(4):
        for e in buffer.sample(batch_size_B=32, n_step=3, gamma=gamma):
            obs, next_obs = e.get_observations(0), e.get_observations(-1)
            t = obs - 1000.0 * int(e.multi_agent_episode_id[1:])
            expected = sum(gamma ** k * 0.1 * (t + k + 1) for k in range(3))
            assert abs(next_obs - obs - 3) < TOLERANCE
            assert abs(e.get_rewards(-1) - expected) < TOLERANCE
            assert e.get_extra_model_outputs("n_step", -1) == 3


@pytest.mark.parametrize("cls", UNIFORM + PRIORITIZED, ids=by_name)
def test_modules_to_sample(cls):
    buffer = filled(cls, 4, 20)
    sample = buffer.sample(batch_size_B=8, modules_to_sample=["module_1"])
    assert {e.module_id for e in sample} == {"module_1"} and len(sample) == 8
    assert buffer.get_sampled_timesteps("module_2") == 0 and buffer.get_sampled_timesteps("module_1") == 8


@pytest.mark.parametrize("cls", PRIORITIZED, ids=by_name)
def test_priorities_are_per_module(cls):
    """A module's priority update steers that module's draws only; weights at beta 1 are (P / P_min)^-1 within the
    module (the rarely drawn steps weigh 1, the favoured one less)."""
    buffer = filled(cls, 5, 10, 10, offsets=True, alpha=1.0)
    for _ in range(20):  # drive every module_1 step sampled to a tiny priority, except the first observation 0
        sample = buffer.sample(batch_size_B=64, n_step=1, modules_to_sample=["module_1"])
        buffer.update_priorities(np.array([5.0 if e.get_observations(0) == 0.0 else 1e-3 for e in sample]),
                                 "module_1")
    hits = {m: 0 for m in MODULES.values()}
    weights = []
    for _ in range(10):
        for e in buffer.sample(batch_size_B=64, n_step=1, beta=1.0):
            hits[e.module_id] += e.get_observations(0) == 0.0
            if e.module_id == "module_1":
                weights.append((e.get_observations(0), e.get_extra_model_outputs("weights", -1)))
    # module_1: observation 0 holds ~5 / (5 + 99e-3) of the mass; module_2 draws it ~1 time in 100
    assert hits["module_1"] > 0.9 * 640 and hits["module_2"] < 0.05 * 640
    favoured = [w for o, w in weights if o == 0.0]
    others = [w for o, w in weights if o != 0.0]
    assert max(favoured) < 0.01 and others and np.allclose(others, 1.0, atol=1e-3)


# -- state and refusals -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", UNIFORM + PRIORITIZED, ids=by_name)
def test_state_round_trip_keeps_counts(cls):
    """RLlib's ``test_get_state_and_set_state`` on public counts (RLlib's test also compares a private index)."""
    buffer = filled(cls, 6, 30)
    buffer.sample(batch_size_B=8)
    restored = cls(capacity=10_000)
    restored.set_state(buffer.get_state())
    assert counts(restored) == counts(buffer)
    assert restored.get_sampled_timesteps() == buffer.get_sampled_timesteps()
    for module_id in buffer.get_module_ids():
        assert restored.get_sampled_timesteps(module_id) == buffer.get_sampled_timesteps(module_id)
    assert [e.id_ for e in restored.episodes] == [e.id_ for e in buffer.episodes]


@pytest.mark.parametrize("cls", CONDUIT, ids=by_name)
def test_restored_buffer_draws_what_the_original_draws(cls, tmp_path):
    buffer = filled(cls, 7, 30, offsets=True)
    buffer.sample(batch_size_B=8, replay_mode="synchronized")  # advances the buffer's own generator
    restored = cls(capacity=10_000)
    conduit_rllib.load_buffer(restored, conduit_rllib.save_buffer(buffer, tmp_path / "buffer"))
    for _ in range(3):
        a, b = buffer.sample(batch_size_B=16, n_step=2), restored.sample(batch_size_B=16, n_step=2)
        assert [(e.id_, e.get_observations(0), e.get_rewards(-1)) for e in a] == \
            [(e.id_, e.get_observations(0), e.get_rewards(-1)) for e in b]
        if buffer._prioritized:
            priorities = np.linspace(0.1, 2.0, 16)
            for target in (buffer, restored):
                target.update_priorities(priorities, "module_2")
    a, b = (target.sample(batch_size_B=8, replay_mode="synchronized") for target in (buffer, restored))
    assert a.keys() == b.keys()
    for module_id in a:
        assert a[module_id].keys() == b[module_id].keys()
        for column in a[module_id]:
            np.testing.assert_array_equal(np.asarray(a[module_id][column]), np.asarray(b[module_id][column]))


@pytest.mark.parametrize("cls", CONDUIT, ids=by_name)
def test_refusals_name_the_problem_and_change_nothing(cls):
    rng = np.random.default_rng(8)
    buffer = cls(capacity=10_000)  # the sampling tests' layout: their compiled kernels
    buffer.add(episode(rng, 20, "A"))
    before = counts(buffer)
    single = SingleAgentEpisode(observations=[0.0, 1.0], actions=[0], rewards=[1.0])
    with pytest.raises(TypeError, match="expected MultiAgentEpisode"):
        buffer.add([episode(rng, 5, "B"), single])
    ragged = episode(rng, 5, "C")
    ragged.agent_episodes["agent_1"].observations.data[0] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="observations differ in shape"):
        buffer.add([episode(rng, 5, "D"), ragged])
    wider = episode(rng, 5, "E")
    wider.agent_episodes["agent_2"].observations.data[:] = [np.zeros(3)] * 6
    with pytest.raises(ValueError, match=r"obs is float32\[3\] per step, the buffer stores float32\[\]"):
        buffer.add([episode(rng, 5, "F"), wider])
    assert counts(buffer) == before
    with pytest.raises(ValueError, match="replay_mode must be"):
        buffer.sample(batch_size_B=4, replay_mode="sideways")
    with pytest.raises(NotImplementedError, match="batch_length_T=8"):
        buffer.sample(batch_size_B=4, batch_length_T=8, replay_mode="synchronized")
    with pytest.raises(ValueError, match="modules_to_sample.*'nope'"):
        buffer.sample(batch_size_B=4, replay_mode="synchronized", modules_to_sample=["nope"])
    with pytest.raises(ValueError, match="no stored env step .* n_step=21"):  # A has 20 env steps
        buffer.sample(batch_size_B=4, replay_mode="synchronized", n_step=21)
    with pytest.raises(ValueError, match="n_step"):
        buffer.sample(batch_size_B=4, replay_mode="synchronized", n_step=(3, 3))
    with pytest.raises(NotImplementedError, match="RLlib's multi-agent buffers ignore both"):
        buffer.sample(batch_size_B=4, batch_length_T=8)
    with pytest.raises(ValueError, match="nope"):
        buffer.sample(batch_size_B=4, modules_to_sample=["nope"])
    with pytest.raises(ValueError, match="deliver"):
        cls(capacity=10, deliver="torch")
    with pytest.raises(ValueError, match="capacity"):
        cls(capacity=0)
    assert counts(buffer) == before and buffer.get_sampled_timesteps() == 0



@pytest.mark.parametrize("cls", CONDUIT, ids=by_name)
def test_a_module_outgrowing_its_ring_is_refused_naming_agents_per_module(cls):
    """A module's ring is sized by its agents in the first episode that had one (2 x capacity steps each): more
    agents later can keep more steps than it holds; that add is refused, nothing changes, and the message says what
    to raise. With ``agents_per_module`` it fits."""
    rng = np.random.default_rng(9)
    buffer = cls(capacity=10)
    buffer.add(episode(rng, 5, "A", agents={"a": "shared"}))
    before = counts(buffer)
    with pytest.raises(ValueError, match="agents_per_module"):
        buffer.add(episode(rng, 11, "B", agents={"a": "shared", "b": "shared"}))
    assert counts(buffer) == before
    roomy = cls(capacity=10, agents_per_module=2)
    roomy.add(episode(rng, 5, "A", agents={"a": "shared"}))
    roomy.add(episode(rng, 11, "B", agents={"a": "shared", "b": "shared"}))
    assert roomy.get_num_timesteps("shared") == 22 and [e.id_ for e in roomy.episodes] == ["B"]


def test_rllibs_synchronized_mode_drops_every_last_transition():
    """Why the Conduit buffers' replay_mode="synchronized" does not copy RLlib's: RLlib 2.60's own synchronized
    sampler never draws an episode's last transition, so no row is ever terminated, and its weights / n_step columns
    come back empty; ours draws every env step whose window fits (``test_synchronized_sample_...``). (A ray upgrade
    that fixes it makes this test fail: then compare the two modes' rows directly.)"""
    agents = MODULES
    native = MultiAgentEpisodeReplayBuffer(capacity=1_000)
    for k in range(5):
        e = MultiAgentEpisode(id_=str(k), observations=[{a: 0.0 for a in agents}], agent_module_ids=dict(agents))
        for t in range(6):
            last = t == 5
            e.add_env_step(observations={a: t + 1.0 for a in agents}, actions={a: t for a in agents},
                           rewards={a: 1.0 for a in agents}, terminateds={a: last for a in agents} | {"__all__": last})
        native.add([e])
    rows = [native.sample(batch_size_B=8, replay_mode="synchronized")["module_1"] for _ in range(100)]
    next_obs = np.concatenate([r["new_obs"] for r in rows])
    assert set(next_obs.tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}  # never 6.0, the terminal observation
    assert not np.concatenate([r["terminateds"] for r in rows]).any()
    assert all(len(r["weights"]) == 0 and len(r["n_step"]) == 0 for r in rows)


# -- synchronized sampling --------------------------------------------------------------------------------------------
# Both tests below build buffers of one layout (capacity 30, the same columns), add one episode at a time and sample
# batches of 16 with n_step=2 and one module at a time or both: they share two compiled gather kernels.
SYNC = {"a": "module_1", "b": "module_2"}
GAMMA = 0.9


def reward(agent, s):
    """The reward an agent receives for env step s -> s + 1."""
    return 0.01 * (s + 1) * (1 if agent == "a" else 3)


def scheduled(k, length, end, cut=None):
    """Episode ``S<k>``: agent a acts at every env step, b is observed at the even env steps and the last one and
    acts at each of them but the last; every observation is ``100 k + env step``, every action the env step, and
    the episode ends ``end`` ("terminated" / "truncated") at env step ``length``. With ``cut`` (an even env step)
    the list of its two chunks (``cut()`` there)."""
    e = MultiAgentEpisode(id_=f"S{k}", observations=[{a: 100.0 * k for a in SYNC}], agent_module_ids=dict(SYNC))
    chunks = []
    for s in range(length):
        if s == cut:
            chunks.append(e)
            e = e.cut()
        last = s == length - 1
        seen = [a for a in SYNC if a == "a" or (s + 1) % 2 == 0 or last]
        done = {a: last for a in SYNC} | {"__all__": last}  # (RLlib calls an episode whose agents are all
        e.add_env_step(observations={a: 100.0 * k + s + 1 for a in seen},  # truncated terminated: "__all__" only)
                       actions={a: s for a in SYNC if a == "a" or s % 2 == 0},
                       rewards={a: reward(a, s) for a in SYNC}, infos={a: {} for a in seen},
                       terminateds=done if end == "terminated" else {},
                       truncateds={"__all__": last} if end == "truncated" else {})
    return e if cut is None else chunks + [e]


def reference_row(agent, k, t, n, length, end):
    """What a synchronized row of ``agent`` at env step t of episode ``S<k>`` holds, from the schedule alone: None
    unless the agent acts at t and is observed at t + n; else obs, action, reward (each agent step's rewards
    discounted by gamma to the env steps from t to the step it acted at), next obs, terminated, truncated."""
    observed = [s for s in range(length + 1) if agent == "a" or s % 2 == 0 or s == length]
    if t not in observed or t == length or t + n not in observed:
        return None
    steps = [s for s in observed if t <= s <= t + n]
    total = sum(GAMMA ** (begin - t) * sum(reward(agent, s) for s in range(begin, after))
                for begin, after in zip(steps, steps[1:]))
    final = t + n == length
    return (100.0 * k + t, t, total, 100.0 * k + t + n, final and end == "terminated", final and end == "truncated")


def test_synchronized_sample_against_a_reference():
    """``replay_mode="synchronized"``: B env steps drawn among those whose 2-step window fits for a module sampled;
    every agent of a module sampled that acts there and is observed 2 env steps later gives one row, in draw order
    (b skips odd env steps, so its windows of one agent step hold two env steps' rewards); terminal transitions are
    drawn and marked; weights 1, n_step 2; counters as RLlib's test expects; evicted episodes never drawn; windows
    run across the chunks of an episode added in two."""
    rng = np.random.default_rng(11)
    buffer = conduit_rllib.ConduitMultiAgentEpisodeReplayBuffer(capacity=30)
    stored, sampled, terminal = {}, {"module_1": 0, "module_2": 0}, set()
    for k in range(9):
        length, end = int(rng.integers(9, 13)), ("terminated", "truncated")[k % 2]
        stored[k] = (length, end)
        buffer.add(scheduled(k, length, end, cut=4 if k == 5 else None))
        live = {int(e.id_[1:]) for e in buffer.episodes}
        for modules in (["module_1"], ["module_2"], None):
            out = buffer.sample(batch_size_B=16, n_step=2, gamma=GAMMA, replay_mode="synchronized",
                                modules_to_sample=modules)
            assert set(out) <= set(modules or SYNC.values()) and (modules is None or set(out) == set(modules))
            drawn = {}
            for module_id, columns in out.items():
                agent = {v: a for a, v in SYNC.items()}[module_id]
                rows = len(columns["obs"])
                assert all(len(columns[key]) == rows for key in ("actions", "rewards", "new_obs", "terminateds",
                                                                  "truncateds", "weights", "n_step"))
                sampled[module_id] += rows
                drawn[module_id] = []
                for i in range(rows):
                    episode_k, t = divmod(int(columns["obs"][i]), 100)
                    assert episode_k in live
                    expected = reference_row(agent, episode_k, t, 2, *stored[episode_k])
                    assert expected is not None, (module_id, episode_k, t)
                    got = (columns["obs"][i], columns["actions"][i], columns["rewards"][i], columns["new_obs"][i],
                           bool(columns["terminateds"][i]), bool(columns["truncateds"][i]))
                    assert got[1:2] + got[4:] == expected[1:2] + expected[4:], (module_id, episode_k, t)
                    assert np.allclose(got[:1] + got[2:4], expected[:1] + expected[2:4], atol=TOLERANCE, rtol=0)
                    assert columns["weights"][i] == 1.0 and columns["n_step"][i] == 2
                    drawn[module_id].append((episode_k, t))
                    if got[4] or got[5]:
                        terminal.add(module_id)
            if modules is None:  # a acts at every env step: one module_1 row per draw, module_2's where b fits
                assert len(drawn["module_1"]) == 16
                fits = [(e, t) for e, t in drawn["module_1"] if reference_row("b", e, t, 2, *stored[e])]
                assert drawn.get("module_2", []) == fits
            elif modules == ["module_2"]:
                assert len(drawn["module_2"]) == 16
        assert buffer.get_sampled_timesteps() == 16 * 3 * (k + 1)
        assert {m: buffer.get_sampled_timesteps(m) for m in sampled} == sampled
    assert buffer.get_num_episodes_evicted() > 0 and terminal == {"module_1", "module_2"}


def test_synchronized_draws_env_steps_uniformly():
    """Every env step whose 2-step window fits for agent a is drawn with the same probability, whatever its
    episode's length (chi-square over 1,600 draws, fixed seed; p > 0.001)."""
    rng = np.random.default_rng(12)
    buffer = conduit_rllib.ConduitMultiAgentEpisodeReplayBuffer(capacity=30, seed=3)
    for k in range(5):
        buffer.add(scheduled(k, int(rng.integers(9, 13)), "terminated"))
        buffer.sample(batch_size_B=16, n_step=2, replay_mode="synchronized", modules_to_sample=["module_1"])
    cells = {(int(e.id_[1:]), t): 0 for e in buffer.episodes for t in range(len(e) - 1)}
    for _ in range(100):
        out = buffer.sample(batch_size_B=16, n_step=2, replay_mode="synchronized", modules_to_sample=["module_1"])
        for obs in out["module_1"]["obs"]:
            cells[divmod(int(obs), 100)] += 1
    observed = np.array(list(cells.values()), np.float64)
    expected = observed.sum() / observed.size
    chi2 = float(np.sum((observed - expected) ** 2 / expected))
    from scipy import stats
    assert observed.sum() == 1600 and stats.chi2.sf(chi2, observed.size - 1) > 1e-3, (chi2, observed)


def test_synchronized_prioritized_draws_uniformly_and_updates_no_priorities():
    """The prioritized class draws synchronized batches as the uniform one (weights 1 whatever beta) and refuses a
    priority update after one (it would name no independent batch)."""
    buffer = conduit_rllib.ConduitMultiAgentPrioritizedEpisodeReplayBuffer(capacity=30)
    buffer.add(scheduled(0, 9, "terminated"))
    out = buffer.sample(batch_size_B=16, n_step=2, beta=1.0, replay_mode="synchronized",
                        modules_to_sample=["module_1"])
    assert np.all(out["module_1"]["weights"] == 1.0) and len(out["module_1"]["obs"]) == 16
    with pytest.raises(ValueError, match="synchronized"):
        buffer.update_priorities(np.ones(16), "module_1")
