"""Drop-in replay buffers for RLlib's new API stack (ray 2.60) backed by a Conduit ``ExperienceDataPlane``.

Select one with an import string (RLlib 2.60 crashes on a class object; a name containing ``EpisodeReplayBuffer``
also receives ``metrics_num_episodes_for_smoothing``)::

    config.training(replay_buffer_config={
        "type": "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer",  # DQN / SAC with PER
        "capacity": 50_000, "alpha": 0.6, "beta": 0.4,
        "n_step": 3,            # the longest n-step the algorithm asks for (DQN's ``n_step``); default 1
        "deliver": "episodes",  # or "torch": the learner receives the batch through DLPack (see learners.py)
    })

``ConduitEpisodeReplayBuffer`` is the uniform variant (RLlib's ``EpisodeReplayBuffer``). The prioritized one
subclasses ``PrioritizedEpisodeReplayBuffer`` because RLlib's DQN calls ``update_priorities`` only on such buffers;
neither runs its RLlib parent's constructor (no Python episode deque, no segment trees).

What happens where:

* ``add(episodes)``: every episode chunk becomes columns, one item per env step: ``obs``, ``action``, ``reward``,
  ``terminated``, ``truncated``, ``next_obs`` and ``cut`` (True at the last step of a chunk whose episode goes on),
  concatenated into one ``plane.ingest`` (64-bit leaves narrowed to 32 bits). Chunks are stored one after another
  in a single stream; the episode ends (``terminated`` / ``truncated`` / ``cut``) keep n-step windows inside one
  chunk.
* ``sample(num_items, n_step, gamma, beta, ...)``: the plane samples windows of ``n_step`` (the buffer's) steps with
  ``samplers.sequences(pad=True)`` (with ``n_step`` 1: items, with ``samplers.prioritized`` / ``uniform``; prioritized: P ∝ (p + eps)^alpha, new items at the max priority), then one jitted
  kernel applies ``transforms.n_step`` (n-step return over the steps of the window's first episode, truncated to the
  requested n or a per-item n drawn from a ``(low, high)`` range) and builds RLlib's train-batch columns ``obs``,
  ``new_obs``, ``actions``, ``rewards``, ``terminateds``, ``truncateds``, ``n_step`` (steps actually used),
  ``weights``. Returned as RLlib expects from ``sample_episodes=True`` (a list of 1-step ``SingleAgentEpisode``) or,
  with ``deliver="torch"``, as a ``ConduitBatch`` the Conduit learners turn into torch tensors through DLPack.
* ``update_priorities(td_errors)``: ``|td|`` for the ids of the last batch, applied by the plane's kernel (an id whose
  slot was overwritten since is ignored).
* ``get_state()`` / ``set_state()``: NumPy arrays (every leaf of the plane's state), JSON-able metadata and counters;
  no pickled objects. ``checkpoint.py`` writes them as ``.npz`` + ``.json``.

Differences from RLlib's buffers, on purpose: a window that meets an episode end or a chunk cut within n steps is
used with the steps it has (``n_step`` column = steps used, bootstrapping from the last one unless terminated) where
RLlib resamples; capacity counts steps in a ring (the oldest steps are overwritten) where RLlib evicts whole episodes;
importance weights are normalised by the batch maximum (RLlib: by the global minimum priority). Not supported yet
(``NotImplementedError``): multi-agent episodes, sequence sampling for stateful modules (``batch_length_T`` > 1,
``lookback`` > 0), ``include_infos`` / ``include_extra_model_outputs``, ``sample_episodes=False``, non-array
observations (Dict / Tuple spaces).
"""

from __future__ import annotations

import collections
import functools
import logging
import time
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils import force_list
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

from conduit_jax import ExperienceDataPlane, ExperienceSpec, default_mesh, samplers, schedule, transforms

logger = logging.getLogger(__name__)

END_KEYS = ("terminated", "truncated", "cut")
STATE_FORMAT = "conduit_rllib.episode_replay_buffer"
STATE_VERSION = 1
_NARROW = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32),
           np.dtype(np.float64): np.dtype(np.float32)}
_SCHEDULES = {"sync": schedule.sync, "overlap": schedule.overlap, "deferred": schedule.deferred,
              "adaptive": schedule.adaptive}
_KNOWN_KWARGS = {"type", "metrics_num_episodes_for_smoothing"}


class ConduitBatch(list):
    """What ``sample()`` returns with ``deliver="torch"``: the train-batch columns as JAX arrays, for a Conduit
    learner (``learners.py``) to hand to torch through DLPack, instead of episodes for RLlib's learner connector.

    It is a list of ``len(batch)`` placeholders so RLlib code that counts steps with ``sum(len(e) for e in
    episodes)`` sees the batch size; any other use of a placeholder as an episode raises a message saying which
    learner to configure."""

    def __init__(self, columns: dict, module_id: str, size: int):
        super().__init__(_Placeholder() for _ in range(size))
        self.columns = columns
        self.module_id = module_id

    def take(self) -> dict:
        """The columns, once: the batch gives up its references (ownership of the memory moves to the caller)."""
        columns, self.columns = self.columns, None
        if columns is None:
            raise RuntimeError("ConduitBatch.take(): the columns were already taken")
        return columns


class _Placeholder:
    def __len__(self) -> int:
        return 1

    def __getattr__(self, name):
        raise TypeError(
            "This batch came from a Conduit replay buffer with deliver='torch': it holds JAX columns, not episodes. "
            "Train with a local Conduit learner (num_learners=0 and config.training(learner_class=conduit_rllib."
            "ConduitDQNTorchLearner or ConduitSACTorchLearner)) or set replay_buffer_config['deliver'] = 'episodes'.")


def _narrow(dtype: np.dtype) -> np.dtype:
    return _NARROW.get(np.dtype(dtype), np.dtype(dtype))


@functools.partial(jax.jit, static_argnames=("gamma",))
def _finish(data, mask, weights, n, beta_ratio, *, gamma: float):
    """Windows [B, L] (or items [B] with ``mask`` None) -> RLlib's n-step train-batch columns [B]."""
    if mask is None:
        data = jax.tree_util.tree_map(lambda x: x[:, None], data)
        mask = jnp.ones((n.shape[0], 1), jnp.bool_)
    steps = mask.shape[1]
    mask = mask & (jnp.arange(steps, dtype=jnp.int32)[None, :] < n[:, None])
    out = transforms.n_step(data, mask, gamma)
    count = jnp.sum(mask.astype(jnp.int32), axis=1)
    last = jnp.maximum(count - 1, 0)

    def at_last(x):
        return jnp.take_along_axis(x, last.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]

    if weights is None:
        weights = jnp.ones(count.shape, jnp.float32)
    else:
        weights = jnp.power(weights, beta_ratio)
    return {
        Columns.OBS: out["obs"],
        Columns.NEXT_OBS: out["next_obs"],
        Columns.ACTIONS: out["action"],
        Columns.REWARDS: out["reward"],
        Columns.TERMINATEDS: at_last(data["terminated"]),
        Columns.TRUNCATEDS: at_last(data["truncated"]),
        "n_step": count,
        "weights": weights.astype(jnp.float32),
    }


class _ConduitEpisodeBuffer:
    """The shared implementation; the public classes below add RLlib's base class."""

    _prioritized = False

    def __init__(self, capacity: int = 10000, *, batch_size_B: int = 16, batch_length_T: int = 1,
                 metrics_num_episodes_for_smoothing: int = 100, n_step: int = 1, alpha: float = 1.0,
                 beta: float = 0.4, eps: float = 1e-6, num_shards: int = 1, seed: int = 0,
                 deliver: str = "episodes", schedule: str = "sync", **kwargs):
        # RLlib's parent constructors are not run on purpose (they allocate the Python episode deque and, for PER,
        # segment trees of 2 * capacity nodes); set what RLlib code reads from a buffer
        unknown = set(kwargs) - _KNOWN_KWARGS
        if unknown:
            logger.warning("%s: ignoring unknown replay_buffer_config keys %s", type(self).__name__, sorted(unknown))
        if not isinstance(n_step, int) or n_step < 1:
            raise ValueError(f"{type(self).__name__}: n_step (the longest n-step window sampled) must be an int >= 1, "
                             f"got {n_step!r}")
        if deliver not in ("episodes", "torch"):
            raise ValueError(f"{type(self).__name__}: deliver must be 'episodes' or 'torch', got {deliver!r}")
        if schedule not in _SCHEDULES:
            raise ValueError(f"{type(self).__name__}: schedule must be one of {sorted(_SCHEDULES)}, got {schedule!r}")
        if not (isinstance(alpha, (int, float)) and alpha >= 0):
            raise ValueError(f"{type(self).__name__}: alpha must be >= 0, got {alpha!r}")
        self.capacity = int(capacity)
        self.batch_size_B = int(batch_size_B)
        self.batch_length_T = batch_length_T
        self.n_step = n_step
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.eps = float(eps)
        self.num_shards = int(num_shards)
        self.seed = int(seed)
        self.deliver = deliver
        self.schedule = schedule
        self.episodes = collections.deque()  # stays empty: RLlib code may look at it
        self.rng = np.random.default_rng(seed)
        self.metrics = MetricsLogger(root=False)
        self._metrics_num_episodes_for_smoothing = metrics_num_episodes_for_smoothing
        self.sampled_timesteps = 0
        self._num_timesteps_added = 0
        self._episodes_added = 0
        self._open_episodes: collections.OrderedDict = collections.OrderedDict()  # id -> None, episodes going on
        self._chunk_ends: collections.deque = collections.deque()  # global index of each stored chunk's last step
        self.plane: Optional[ExperienceDataPlane] = None
        self.observation_space = None
        self.action_space = None
        self._last_ids = None
        self._n_cache: dict = {}
        self.timings = collections.defaultdict(float)  # seconds spent in add / sample / update_priorities
        # the importance weights come from the plane with a fixed beta0 and are rescaled to the beta RLlib passes:
        # w(beta) = w(beta0) ** (beta / beta0), exact because the weights are normalised by the batch maximum
        self._beta0 = self.beta if self.beta > 0 else 1.0

    # -- the plane ---------------------------------------------------------------------------------------------
    def _sampler(self, batch_size: int):
        if self.n_step == 1:
            # plain items (conduit_jax's sequences(length=1, pad=True) fails in its mask: no time axis at window 1)
            return samplers.prioritized(batch_size, self.alpha, self._beta0, self.eps) if self._prioritized \
                else samplers.uniform(batch_size)
        return samplers.sequences(batch_size, self.n_step, 1, pad=True, end_keys=END_KEYS,
                                  alpha=self.alpha if self._prioritized else None, beta=self._beta0, eps=self.eps)

    def _make_plane(self, spec: ExperienceSpec, batch_size: int) -> ExperienceDataPlane:
        capacity = self.capacity
        if capacity % self.num_shards:
            capacity += self.num_shards - capacity % self.num_shards
        batch = batch_size + (-batch_size) % self.num_shards
        return ExperienceDataPlane(spec, capacity, self._sampler(batch), mesh=default_mesh(self.num_shards),
                                   seed=self.seed, cast=True, schedule=_SCHEDULES[self.schedule]())

    def _rebatch(self, batch_size: int) -> None:
        """Another batch size: a plane with the same state and a sampler for that size (compiles once)."""
        old = self.plane
        new = self._make_plane(old.spec, batch_size)
        # the sampler's state does not depend on the batch size, so the new plane takes the old state as it is
        new.state = old.state
        self.plane = new

    # -- add ------------------------------------------------------------------------------------------------------
    def add(self, episodes: Union[list, SingleAgentEpisode]) -> None:
        start = time.perf_counter()
        episodes = force_list(episodes)
        columns = collections.defaultdict(list)
        steps = episodes_added = 0
        for episode in episodes:
            if isinstance(episode, MultiAgentEpisode):
                raise NotImplementedError(f"{type(self).__name__}: multi-agent episodes are not supported yet")
            length = len(episode)
            if length == 0:
                continue
            obs = episode.get_observations(slice(0, length + 1))
            if isinstance(obs, list):  # an episode not yet turned into NumPy holds lists of per-step arrays
                obs = np.asarray(obs)
            if not isinstance(obs, np.ndarray) or obs.dtype == object:
                raise NotImplementedError(f"{type(self).__name__}: observations must be arrays (Box / Discrete "
                                          f"spaces); got {type(obs).__name__}")
            columns["obs"].append(obs[:-1])
            columns["next_obs"].append(obs[1:])
            columns["action"].append(np.asarray(episode.get_actions(slice(0, length))))
            columns["reward"].append(np.asarray(episode.get_rewards(slice(0, length)), np.float32))
            ends = {key: np.zeros(length, np.bool_) for key in END_KEYS}
            ends["terminated"][-1] = episode.is_terminated
            ends["truncated"][-1] = episode.is_truncated
            ends["cut"][-1] = not episode.is_done
            for key in END_KEYS:
                columns[key].append(ends[key])
            if episode.id_ not in self._open_episodes:
                episodes_added += 1
            if episode.is_done:
                self._open_episodes.pop(episode.id_, None)
            else:
                self._open_episodes[episode.id_] = None
                while len(self._open_episodes) > 100_000:  # ids of abandoned episodes
                    self._open_episodes.popitem(last=False)
            steps += length
            self._chunk_ends.append(self._num_timesteps_added + steps - 1)
            if self.observation_space is None:
                self.observation_space, self.action_space = episode.observation_space, episode.action_space
        if steps == 0:
            return
        batch = {key: np.concatenate(parts) for key, parts in columns.items()}
        if self.plane is None:
            spec = ExperienceSpec.from_structs({key: jax.ShapeDtypeStruct(value.shape[1:], _narrow(value.dtype))
                                                for key, value in batch.items()})
            self.plane = self._make_plane(spec, self.batch_size_B)
        self.plane.ingest(batch)
        self._num_timesteps_added += steps
        self._episodes_added += episodes_added
        evicted = 0
        oldest = self._num_timesteps_added - self.plane.capacity
        while self._chunk_ends and self._chunk_ends[0] < oldest:
            self._chunk_ends.popleft()
            evicted += 1
        self._log_add(steps, episodes_added, evicted)
        self.timings["add"] += time.perf_counter() - start

    def _log_add(self, steps: int, episodes_added: int, evicted: int) -> None:
        stored_before = min(self._num_timesteps_added - steps, self.plane.capacity)
        steps_evicted = max(0, stored_before + steps - self.plane.capacity)
        agent, module = {DEFAULT_AGENT_ID: episodes_added}, {DEFAULT_MODULE_ID: episodes_added}
        EpisodeReplayBuffer._update_add_metrics(
            self, num_episodes_added=episodes_added, num_env_steps_added=steps, num_episodes_evicted=evicted,
            num_env_steps_evicted=steps_evicted, agent_to_num_episodes_added=agent,
            agent_to_num_steps_added={DEFAULT_AGENT_ID: steps},
            agent_to_num_episodes_evicted={DEFAULT_AGENT_ID: evicted},
            agent_to_num_steps_evicted={DEFAULT_AGENT_ID: steps_evicted}, module_to_num_episodes_added=module,
            module_to_num_steps_added={DEFAULT_MODULE_ID: steps},
            module_to_num_episodes_evicted={DEFAULT_MODULE_ID: evicted},
            module_to_num_steps_evicted={DEFAULT_MODULE_ID: steps_evicted})

    # -- sample ---------------------------------------------------------------------------------------------------
    def sample(self, num_items: Optional[int] = None, *, batch_size_B: Optional[int] = None,
               batch_length_T: Optional[int] = None, n_step: Optional[Union[int, tuple]] = None,
               beta: Optional[float] = None, gamma: float = 0.99, include_infos: bool = False,
               include_extra_model_outputs: bool = False, sample_episodes: bool = True, to_numpy: bool = False,
               lookback: int = 0, min_batch_length_T: int = 0, **kwargs):
        start = time.perf_counter()
        name = type(self).__name__
        if num_items is not None and batch_size_B is not None:
            raise ValueError(f"{name}.sample(): pass num_items or batch_size_B, not both")
        size = num_items or batch_size_B or self.batch_size_B
        if batch_length_T not in (None, 0, 1) or lookback:
            raise NotImplementedError(f"{name}.sample(): sequence sampling for stateful modules (batch_length_T="
                                      f"{batch_length_T}, lookback={lookback}) is not supported yet")
        if include_infos or include_extra_model_outputs:
            raise NotImplementedError(f"{name}.sample(): include_infos / include_extra_model_outputs are not "
                                      f"supported yet (the plane stores obs, action, reward and episode ends)")
        if not sample_episodes and self.deliver == "episodes":
            raise NotImplementedError(f"{name}.sample(): sample_episodes=False (a SampleBatch) is not supported")
        if self.plane is None:
            raise ValueError(f"{name}.sample(): the buffer is empty; add() episodes first")
        padded = size + (-size) % self.num_shards  # the plane's batch is a multiple of its shard count
        n = self._n_per_item(n_step, padded)
        if self.plane.batch_size != padded:
            self._rebatch(padded)
        delivery = self.plane.deliver()
        beta = self.beta if beta is None else float(beta)
        if beta < 0:
            raise ValueError(f"{name}.sample(): beta must be >= 0, got {beta}")
        columns = _finish(delivery.data, delivery.mask, delivery.weights, n, np.float32(beta / self._beta0),
                          gamma=float(gamma))
        if delivery.ids.shape[0] != size:  # batch rounded up to the shard count
            columns = {k: v[:size] for k, v in columns.items()}
            self._last_ids = delivery.ids[:size]
        else:
            self._last_ids = delivery.ids
        self.sampled_timesteps += size
        self._log_sample(size, n_step)
        if self.deliver == "torch":
            out = ConduitBatch(columns, DEFAULT_MODULE_ID, size)
        else:
            out = self._episodes(columns, to_numpy)
        self.timings["sample"] += time.perf_counter() - start
        return out

    def _n_per_item(self, n_step, size: int):
        name = type(self).__name__
        if isinstance(n_step, (tuple, list)):
            low, high = int(n_step[0]), int(n_step[1])
            if not 1 <= low < high or high - 1 > self.n_step:
                raise ValueError(f"{name}.sample(): n_step range {tuple(n_step)} must satisfy 1 <= low < high <= "
                                 f"{self.n_step + 1} (the buffer samples windows of n_step={self.n_step}; set "
                                 f"replay_buffer_config['n_step'] to the longest n-step)")
            return self.rng.integers(low, high, size=size, dtype=np.int32)
        n = 1 if n_step is None else int(n_step)
        if not 1 <= n <= self.n_step:
            raise ValueError(f"{name}.sample(): n_step={n} but the buffer samples windows of n_step={self.n_step}; "
                             f"set replay_buffer_config['n_step'] = {n} (the algorithm's n_step)")
        key = (n, size)
        if key not in self._n_cache:
            self._n_cache[key] = jnp.full((size,), n, jnp.int32)
        return self._n_cache[key]

    def _log_sample(self, size: int, n_step) -> None:
        mean_n = float(np.mean(n_step)) if isinstance(n_step, (tuple, list)) else float(n_step or 1)
        agent, module = DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
        EpisodeReplayBuffer._update_sample_metrics(
            self, num_env_steps_sampled=size, num_episodes_per_sample=0, num_env_steps_per_sample=size,
            sampled_n_step=mean_n, num_resamples=0, agent_to_num_steps_sampled={agent: size},
            agent_to_num_episodes_per_sample={agent: 0}, agent_to_num_steps_per_sample={agent: size},
            agent_to_sampled_n_step={agent: mean_n}, agent_to_num_resamples={agent: 0},
            module_to_num_steps_sampled={module: size}, module_to_num_episodes_per_sample={module: 0},
            module_to_num_steps_per_sample={module: size}, module_to_sampled_n_step={module: mean_n},
            module_to_num_resamples={module: 0})

    def _episodes(self, columns: dict, to_numpy: bool) -> list:
        """RLlib's 1-step episodes (o_t, a_t, G_t, o_{t+n}) with ``weights`` and ``n_step`` model outputs."""
        host = {k: np.asarray(v) for k, v in jax.device_get(columns).items()}
        obs, next_obs, actions = host[Columns.OBS], host[Columns.NEXT_OBS], host[Columns.ACTIONS]
        rewards, weights, steps = host[Columns.REWARDS], host["weights"], host["n_step"]
        terminated, truncated = host[Columns.TERMINATEDS], host[Columns.TRUNCATEDS]
        out = []
        for i in range(obs.shape[0]):
            episode = SingleAgentEpisode(
                observations=[obs[i], next_obs[i]], observation_space=self.observation_space,
                actions=[actions[i]], action_space=self.action_space, rewards=[rewards[i]],
                terminated=bool(terminated[i]), truncated=bool(truncated[i]),
                extra_model_outputs={"weights": [weights[i]], "n_step": [steps[i]]},
                len_lookback_buffer=0, t_started=0)
            if to_numpy:
                episode.to_numpy()
            out.append(episode)
        return out

    # -- priorities ---------------------------------------------------------------------------------------------
    def update_priorities(self, priorities, module_id: Optional[str] = None) -> None:
        """New priorities ``|priorities|`` (RLlib passes TD errors) for the items of the last ``sample()``."""
        name = type(self).__name__
        if not self._prioritized:
            raise NotImplementedError(f"{name} samples uniformly; use ConduitPrioritizedEpisodeReplayBuffer")
        if self._last_ids is None:
            raise ValueError(f"{name}.update_priorities(): no batch sampled since the last update")
        start = time.perf_counter()
        values = np.abs(np.asarray(priorities, dtype=np.float32).reshape(-1))
        if values.shape[0] != self._last_ids.shape[0]:
            raise ValueError(f"{name}.update_priorities(): {values.shape[0]} priorities for a batch of "
                             f"{self._last_ids.shape[0]} items")
        self.plane.update_priorities(self._last_ids, values)
        self._last_ids = None
        self.timings["update_priorities"] += time.perf_counter() - start

    # -- sizes and metrics -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.get_num_timesteps()

    def get_num_timesteps(self, module_id: Optional[str] = None) -> int:
        return 0 if self.plane is None else min(self._num_timesteps_added, self.plane.capacity)

    def get_num_episodes(self, module_id: Optional[str] = None) -> int:
        """Episode chunks with at least their last step still stored."""
        return len(self._chunk_ends)

    def get_num_episodes_evicted(self, module_id: Optional[str] = None) -> int:
        return 0

    def get_added_timesteps(self, module_id: Optional[str] = None) -> int:
        return self._num_timesteps_added

    def get_sampled_timesteps(self, module_id: Optional[str] = None) -> int:
        return self.sampled_timesteps

    def get_metrics(self):
        return self.metrics.reduce()

    # -- state ----------------------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"capacity": self.capacity, "batch_size_B": self.batch_size_B, "n_step": self.n_step,
                "alpha": self.alpha, "beta": self.beta, "eps": self.eps, "num_shards": self.num_shards,
                "seed": self.seed, "prioritized": self._prioritized}

    def get_state(self) -> dict[str, Any]:
        """The buffer as NumPy arrays plus JSON-able metadata: nothing pickled, nothing JAX."""
        state = {"format": STATE_FORMAT, "version": STATE_VERSION, "config": self._config(),
                 "counters": {"num_timesteps_added": self._num_timesteps_added,
                              "sampled_timesteps": self.sampled_timesteps, "episodes_added": self._episodes_added,
                              "chunk_ends": np.fromiter(self._chunk_ends, np.int64, len(self._chunk_ends))},
                 "spec": None, "arrays": {}}
        if self.plane is None:
            return state
        spec = self.plane.spec
        state["spec"] = {"names": list(spec.names), "shapes": [list(s) for s in spec.shapes],
                         "dtypes": [str(d) for d in spec.dtypes], "batch_size": self.plane.batch_size}
        leaves = jax.tree_util.tree_flatten_with_path(self.plane.state)[0]
        state["arrays"] = {jax.tree_util.keystr(path): np.array(leaf) for path, leaf in leaves}
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        name = type(self).__name__
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"{name}.set_state(): not a Conduit buffer state (format {state.get('format')!r}; "
                             f"expected {STATE_FORMAT!r})" if isinstance(state, dict) else
                             f"{name}.set_state(): expected a dict, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"{name}.set_state(): state version {state.get('version')!r}, this code reads "
                             f"{STATE_VERSION}")
        mine, theirs = self._config(), dict(state["config"])
        differ = {k: (theirs.get(k), v) for k, v in mine.items()
                  if k not in ("batch_size_B", "seed") and theirs.get(k) != v}
        if differ:
            raise ValueError(f"{name}.set_state(): the state was saved by a buffer configured differently "
                             f"(saved, this): {differ}")
        counters = state["counters"]
        if state["spec"] is None:
            self.plane = None
        else:
            recorded = state["spec"]
            spec = ExperienceSpec.from_structs({n: jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for n, s, d in
                                                zip(recorded["names"], recorded["shapes"], recorded["dtypes"])})
            plane = self._make_plane(spec, int(recorded["batch_size"]))  # fresh: no cached sizes, no batch in flight
            leaves, treedef = jax.tree_util.tree_flatten_with_path(plane.state)
            arrays = state["arrays"]
            names = [jax.tree_util.keystr(path) for path, _ in leaves]
            if sorted(names) != sorted(arrays):
                raise ValueError(f"{name}.set_state(): the state's arrays {sorted(arrays)} do not match this plane's "
                                 f"{sorted(names)}")
            restored = []
            for (path, leaf), key in zip(leaves, names):
                value = np.asarray(arrays[key])
                if value.shape != leaf.shape or value.dtype != leaf.dtype:
                    raise ValueError(f"{name}.set_state(): array {key} is {value.dtype}{list(value.shape)}, the plane "
                                     f"expects {leaf.dtype}{list(leaf.shape)}")
                restored.append(jax.device_put(value, leaf.sharding))
            plane.state = jax.tree_util.tree_unflatten(treedef, restored)
            self.plane = plane
        self._num_timesteps_added = int(counters["num_timesteps_added"])
        self.sampled_timesteps = int(counters["sampled_timesteps"])
        self._episodes_added = int(counters["episodes_added"])
        self._chunk_ends = collections.deque(int(x) for x in np.asarray(counters["chunk_ends"]).reshape(-1))
        self._open_episodes.clear()
        self._last_ids = None
        self._n_cache.clear()


class ConduitEpisodeReplayBuffer(_ConduitEpisodeBuffer, EpisodeReplayBuffer):
    """Uniform replay (RLlib's ``EpisodeReplayBuffer``) in a Conduit plane; ``weights`` are all 1."""

    _prioritized = False


class ConduitPrioritizedEpisodeReplayBuffer(_ConduitEpisodeBuffer, PrioritizedEpisodeReplayBuffer):
    """Prioritized replay (RLlib's ``PrioritizedEpisodeReplayBuffer``) in a Conduit plane: the plane's sum tree,
    stratified draws, new items at the max priority, importance weights ``(N P)^-beta`` / batch max."""

    _prioritized = True
