"""The multi-agent Conduit buffers' shared implementation (``MultiAgentStore``; the public classes, in
``buffers.py``, add RLlib's ``MultiAgentEpisodeReplayBuffer`` / ``MultiAgentPrioritizedEpisodeReplayBuffer``).

Each module's agent steps live in their own ``EpisodeStore`` (its own ring, sum tree, largest priority and weight
normalisation), whose ring holds ``2 * capacity`` steps per agent the module serves; this module keeps the
multi-agent episode index (``StoredMultiAgentEpisode``, ``AgentSteps``), RLlib's eviction rule for multi-agent
episodes (once per ``add``, whole oldest episodes), RLlib's overall and per-module counts and metrics, and samples
in RLlib's two modes:

* ``"independent"``: each module's store draws its batch (a step whose window runs past its episode's end is
  redrawn, as RLlib does in both multi-agent classes).
* ``"synchronized"`` (``MultiAgentStore._sample_synchronized``; ``buffers.py`` says how it differs from RLlib
  2.60's): env steps drawn uniformly on the host among those where an agent of a module sampled has a whole n-step
  window, then one gather kernel per module (``EpisodeStore.gather``, ``draws.make_gather``) reads the agents'
  windows from the module's ring, following its links as the independent draw does. The env step -> agent step ->
  ring row mapping is host bookkeeping: each stored episode keeps, per agent, the env steps at which each of its
  stored steps acted and was observed next (``agent_env_steps``, from RLlib's ``env_t_to_agent_t``; chunks of an
  episode continue its env steps), and the windows of n env steps they give (``agent_windows``) are tabled with
  their ring rows (``EpisodeStore.ring_rows``) per n and modules until the next ``add`` (evictions included) or
  ``set_state``. Both classes draw these uniformly (weights 1); the prioritized one takes no priority update after
  a synchronized batch. An agent whose steps RLlib's episode does not map to env steps one to one gives no rows.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, NamedTuple, Optional, Union

import numpy as np
from ray.rllib.core.columns import Columns
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.utils import force_list
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from conduit_jax.replay import compile_size
from conduit_jax.schedule import Schedule
from conduit_rllib.draws import Request, exact_values, n_range, to_host
from conduit_rllib.metrics import BufferMetrics, LoggedMetrics
from conduit_rllib.store import STATE_VERSION, EpisodeStore

MULTI_AGENT_STATE_FORMAT = "conduit_rllib.multi_agent_episode_replay_buffer"
# what an add refused for want of a module's ring space tells the user to change (EpisodeStore's ring_advice)
MODULE_RING_ADVICE = ("the module's ring holds {factor} x capacity x agents_per_module = {storage_capacity} agent "
                      "steps: raise capacity or agents_per_module (by default the number of the module's agents in "
                      "the first episode that had one)")


class AgentSteps(NamedTuple):
    """One agent's part of a stored multi-agent episode."""

    module_id: Any
    episode_id: Any  # its single-agent episode's id
    steps: int


@dataclasses.dataclass
class StoredMultiAgentEpisode:
    """A multi-agent episode the buffer keeps (what ``buffer.episodes`` lists): its id, the env steps and agent
    steps stored, and each agent's part (``agents``: agent id -> ``AgentSteps``). ``env_t``: agent id ->
    int64[2, steps], for each of its stored steps the env step (from the stored episode's first) at which the agent
    acted and the one at which it was observed next (-1, -1 where RLlib's episode did not say)."""

    id_: Any
    env_steps: int = 0
    agent_steps: int = 0
    agents: dict = dataclasses.field(default_factory=dict)
    env_t: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return self.env_steps


def agent_env_steps(episode: MultiAgentEpisode, agent_id) -> np.ndarray:
    """int64[2, steps]: for each step of ``agent_id``'s chunk in ``episode`` the env step (of the chunk, from 0) at
    which the agent acted and the one at which it was observed next, from the episode's ``env_t_to_agent_t``; -1
    where that mapping does not give each of the chunk's observations one env step, in order. An agent done before
    the env has its final observation listed after the env's last step: it counts at the last step."""
    agent, last = episode.agent_episodes[agent_id], episode.env_steps()
    steps = len(agent)
    at = np.full(steps + 1, -1, np.int64)
    mapping = episode.env_t_to_agent_t.get(agent_id)
    if mapping is not None:
        for position, value in enumerate(list(mapping.data)[mapping.lookback:]):
            if str(value) != MultiAgentEpisode.SKIP_ENV_TS_TAG and 0 <= int(value) - agent.t_started <= steps:
                at[int(value) - agent.t_started] = min(position, last)
    if (at < 0).any() or (np.diff(at) <= 0).any():
        return np.full((2, steps), -1, np.int64)
    return np.stack([at[:-1], at[1:]])


def agent_windows(env_t: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The windows of n env steps an agent's stored steps give (``env_t`` as ``StoredMultiAgentEpisode.env_t``): the
    first step k of each (the agent acted at env step ``env_t[0, k]`` = t) and the steps it takes (the agent is
    observed at t + n after them, each step starting where the one before ended)."""
    start, end = env_t
    if start.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # runs of steps each starting where the one before ended; within a run the end env steps increase
    run = np.concatenate([[0], np.cumsum((start[1:] != end[:-1]) | (start[1:] < 0))])
    span = int(max(end.max(), start.max())) + n + 2
    ordered = run * span + end
    target = run * span + start + n
    j = np.minimum(np.searchsorted(ordered, target), start.size - 1)
    fits = (start >= 0) & (ordered[j] == target)
    first = np.flatnonzero(fits)
    return first, j[fits] - first + 1


class Windows(NamedTuple):
    """The synchronized draw's candidates for one n and set of modules: the fitting env steps and, for each, the
    agent windows that start there (one row each), sorted by env step, module, agent."""

    keys: np.ndarray  # int64[E]: the fitting env steps (stored episode number << 32 | env step), ascending
    first: np.ndarray  # int64[E]: each one's first window
    count: np.ndarray  # int64[E]: its windows
    module: np.ndarray  # int64[W]: the window's module (its place in the modules sampled)
    agent: np.ndarray  # int64[W]: its agent (its number in MultiAgentStore's agent_ids)
    rows: np.ndarray  # int32[W]: the ring row of its first agent step
    steps: np.ndarray  # int32[W]: its agent steps
    offsets: np.ndarray  # int64[W, n]: env steps from t to the action of each of its agent steps (0 past them)
    n: int


class Drawable(NamedTuple):
    """The ``Windows`` of every n of a sample's n-step range as one table (pick p: env step p of their concatenation,
    with its n), ``offsets`` padded to ``compile_size`` of the largest n."""

    keys: np.ndarray  # int64[E]
    first: np.ndarray  # int64[E]
    count: np.ndarray  # int64[E]
    key_n: np.ndarray  # int64[E]: the n of each env step's windows
    module: np.ndarray  # int64[W]
    agent: np.ndarray  # int64[W]
    rows: np.ndarray  # int32[W]
    steps: np.ndarray  # int32[W]
    offsets: np.ndarray  # int64[W, compile_size(high)]
    window_n: np.ndarray  # int64[W]: the n of each window


class MultiAgentStore(LoggedMetrics):
    """The shared implementation of the multi-agent buffers (see the module docstring); ``prioritized``: each
    module's store draws by priority (RLlib's ``MultiAgentPrioritizedEpisodeReplayBuffer``)."""

    def __init__(self, capacity: int = 10000, *, batch_size_B: int = 16, batch_length_T: int = 1,
                 metrics_num_episodes_for_smoothing: int = 100, n_step: int = 1, alpha: float = 1.0,
                 beta: float = 0.0, num_shards: int = 1, seed: int = 0, deliver: str = "episodes",
                 schedule: Union[str, Schedule] = "sync", agents_per_module: Optional[int] = None,
                 prioritized: bool = False, **kwargs):
        self._prioritized = bool(prioritized)
        name = type(self).__name__
        if deliver != "episodes":
            raise ValueError(f"{name}: deliver must be 'episodes' (deliver='torch' is single-agent only), got "
                             f"{deliver!r}")
        if agents_per_module is not None and (isinstance(agents_per_module, bool) or
                                              not isinstance(agents_per_module, int) or agents_per_module < 1):
            raise ValueError(f"{name}: agents_per_module must be None or an int >= 1, got {agents_per_module!r}")
        self._store_config = dict(batch_size_B=batch_size_B, batch_length_T=batch_length_T, n_step=n_step,
                                  alpha=alpha, beta=beta, num_shards=num_shards, schedule=schedule)
        # a throwaway store checks every other argument as the single-agent buffers do; its settings are this one's
        check = self._new_store(capacity, "check", seed, **kwargs)
        for key in ("capacity", "batch_size_B", "batch_length_T", "n_step", "alpha", "beta", "num_shards", "seed",
                    "schedule"):
            setattr(self, key, getattr(check, key))
        self.deliver, self.agents_per_module = deliver, agents_per_module
        self.rng = np.random.default_rng(seed)
        self._logged = BufferMetrics(MetricsLogger(root=False))  # RLlib's metrics (self.metrics), at less cost
        self._metrics_num_episodes_for_smoothing = metrics_num_episodes_for_smoothing
        self.timings = collections.defaultdict(float)  # seconds spent in add / sample / update_priorities
        self._reset()

    def _new_store(self, capacity: int, module_id, seed: int, **kwargs) -> EpisodeStore:
        """A module's store: eviction decided here (RLlib's multi-agent buffers redraw a step whose episode ends
        within n steps, uniform ones too)."""
        return EpisodeStore(capacity, prioritized=self._prioritized, redraws=True,
                            label=f"{type(self).__name__}[{module_id!r}]", ring_advice=MODULE_RING_ADVICE, seed=seed,
                            **self._store_config, **kwargs)

    def _reset(self) -> None:
        self._order: collections.deque = collections.deque()  # StoredMultiAgentEpisode, oldest first
        self._live: dict = {}  # episode id -> StoredMultiAgentEpisode
        # module id -> its store (None while none of its agents has a step) and RLlib's per-module counters
        self._modules: dict = {}
        self._counts: dict = collections.defaultdict(collections.Counter)
        self._num_timesteps = self._num_timesteps_added = self._num_episodes_evicted = 0
        self._num_agent_timesteps = self._num_agent_timesteps_added = 0
        self.sampled_timesteps = 0
        # (n, modules) -> Windows and (n range, modules) -> Drawable, for the episodes stored now (emptied by add)
        self._windows_cache: dict = {}
        self._agent_ids: dict = {}  # agent id -> its number in Windows.agent
        self._last_synchronized = False  # the last sample was synchronized (no priorities to update)

    @property
    def episodes(self) -> list:
        """The stored multi-agent episodes, oldest first (``id_``, ``len()`` in env steps, ``agents``)."""
        return list(self._order)

    # -- add ------------------------------------------------------------------------------------------------------
    def add(self, episodes: Union[list, MultiAgentEpisode]) -> None:
        """Store multi-agent episodes; a chunk of a stored episode is appended to it. Whole oldest episodes are
        evicted as RLlib's multi-agent buffers do: once per ``add``, while more than ``capacity`` env steps are stored
        and more than one episode would remain, dropping the new chunks of an episode it evicts. Each agent's steps
        go to its module's store; everything is checked before anything is stored."""
        start = time.perf_counter()
        name = type(self).__name__
        episodes = force_list(episodes)
        for episode in episodes:
            if not isinstance(episode, MultiAgentEpisode):
                raise TypeError(f"{name}.add(): expected MultiAgentEpisode, got {type(episode).__name__} (use "
                                f"ConduitEpisodeReplayBuffer for single-agent episodes; nothing was added)")
        # RLlib's eviction, planned over the index as it is (the oldest go first; nothing changes before every store
        # took its part): the distinct episodes stored or added, one fewer per eviction (only stored ones go)
        order, live = self._order, self._live
        new_ids = [episode.id_ for episode in episodes]
        timesteps = self._num_timesteps + sum(episode.env_steps() for episode in episodes)
        added = self._num_timesteps_added + sum(episode.env_steps() for episode in episodes)
        distinct = len(live) + len({i for i in new_ids if i not in live})
        evicted = []
        while timesteps > self.capacity and len(evicted) < len(order) and distinct - len(evicted) != 1:
            old = order[len(evicted)]
            evicted.append(old)
            if old.id_ in new_ids:  # RLlib takes back the first new chunk of an episode it evicts
                first = episodes[new_ids.index(old.id_)].env_steps()
                timesteps -= first
                added -= first
            timesteps -= old.env_steps
        gone = {old.id_ for old in evicted}
        kept = [episode for episode in episodes if episode.id_ not in gone]
        # each module's chunks and evictions, checked by its store before any store changes
        parts, agents = collections.defaultdict(list), collections.defaultdict(set)
        for episode in kept:
            for agent_id, agent_episode in episode.agent_episodes.items():
                module_id = episode.module_for(agent_id)
                agents[module_id].add(agent_id)
                if len(agent_episode) > 0:
                    parts[module_id].append(agent_episode)
        evict = collections.defaultdict(list)
        for old in evicted:
            for part in old.agents.values():
                evict[part.module_id].append(part.episode_id)
        stores, plans, created = {}, {}, sum(store is not None for store in self._modules.values())
        touched = list(dict.fromkeys([*agents, *evict]))  # modules in the order they first appear
        for module_id in [m for m in touched if parts.get(m) or self._modules.get(m) is not None]:
            store = self._modules.get(module_id)
            if store is None:  # a new module: its ring holds 2 x capacity steps per agent it serves; its seed
                created += 1  # follows the modules' order, the same in every process
                store = self._new_store(self.capacity * (self.agents_per_module or len(agents[module_id])),
                                        module_id, self.seed + 7919 * created)
            stores[module_id] = store
            plans[module_id] = store.prepare(parts[module_id], evict[module_id])
        # commit: the stores, then the episode index and RLlib's counters
        for module_id in touched:  # get_module_ids() lists modules in the order they first appeared, as RLlib
            self._modules.setdefault(module_id, None)
        for module_id, store in stores.items():
            store.commit(plans[module_id])
            self._modules[module_id] = store
        for old in evicted:
            order.popleft()
            del live[old.id_]
        metrics = self._count(kept, evicted, order, live)
        self._windows_cache = {}
        self._num_timesteps, self._num_timesteps_added = timesteps, added
        self._num_episodes_evicted += len(evicted)
        self._logged.update_add(self, **metrics)
        self.timings["add"] += time.perf_counter() - start

    def _count(self, kept: list, evicted: list, order: collections.deque, live: dict) -> dict:
        """Update the episode index and RLlib's counters for an add (as its multi-agent buffers define them);
        returns the add metrics."""
        per = {key: collections.Counter() for key in ("episodes_added", "steps_added", "episodes_evicted",
                                                       "steps_evicted")}  # (agent id, module id) -> count
        for old in evicted:
            self._num_agent_timesteps -= old.agent_steps
            for agent_id, part in old.agents.items():
                counts = self._counts[part.module_id]
                counts["timesteps"] -= part.steps
                counts["episodes"] -= 1
                counts["evicted"] += 1
                per["episodes_evicted"][agent_id, part.module_id] += 1
                per["steps_evicted"][agent_id, part.module_id] += part.steps
        episodes_added = 0
        for episode in kept:
            record = live.get(episode.id_)
            if record is None:
                record = live[episode.id_] = StoredMultiAgentEpisode(episode.id_)
                order.append(record)
                episodes_added += 1
                for agent_id in episode.agent_episodes:
                    per["episodes_added"][agent_id, episode.module_for(agent_id)] += 1
            for agent_id, agent_episode in episode.agent_episodes.items():
                if len(agent_episode) > 0:  # the env steps of its steps, from the stored episode's first
                    env_t = agent_env_steps(episode, agent_id)
                    env_t = np.where(env_t >= 0, env_t + record.env_steps, -1)
                    before = record.env_t.get(agent_id)
                    record.env_t[agent_id] = env_t if before is None else np.concatenate([before, env_t], axis=1)
            record.env_steps += episode.env_steps()
            record.agent_steps += episode.agent_steps()
            self._num_agent_timesteps += episode.agent_steps()
            self._num_agent_timesteps_added += episode.agent_steps()
            for agent_id, agent_episode in episode.agent_episodes.items():
                module_id, steps = episode.module_for(agent_id), len(agent_episode)
                counts = self._counts[module_id]
                part = record.agents.get(agent_id)
                if part is None:
                    part = AgentSteps(module_id, agent_episode.id_, 0)
                    counts["episodes"] += 1
                record.agents[agent_id] = part._replace(steps=part.steps + steps)
                counts["timesteps"] += steps
                counts["added"] += steps
                per["steps_added"][agent_id, module_id] += steps

        def by(counter: collections.Counter, which: int) -> dict:
            out = collections.defaultdict(int)
            for key, value in counter.items():
                out[key[which]] += value
            return dict(out)

        metrics = {"num_episodes_added": episodes_added, "num_env_steps_added": sum(e.env_steps() for e in kept),
                   "num_episodes_evicted": len(evicted), "num_env_steps_evicted": sum(o.env_steps for o in evicted)}
        for key, counter in per.items():
            metrics[f"agent_to_num_{key}"], metrics[f"module_to_num_{key}"] = by(counter, 0), by(counter, 1)
        return metrics

    # -- sample ---------------------------------------------------------------------------------------------------
    def sample(self, num_items: Optional[int] = None, *, batch_size_B: Optional[int] = None,
               batch_length_T: Optional[int] = None, n_step: Optional[Union[int, tuple]] = 1, gamma: float = 0.99,
               include_infos: bool = False, include_extra_model_outputs: bool = False,
               replay_mode: str = "independent", modules_to_sample: Optional[list] = None, beta: float = 0.0,
               to_numpy: bool = False, lookback: int = 0, **kwargs) -> Union[list, dict]:
        """RLlib's multi-agent sample. ``replay_mode="independent"``: for each module (``modules_to_sample``, default
        all) ``B`` of its agent steps as 1-step single-agent episodes (``o_t, a_t, G_t, o_(t+n)``, ``weights``,
        ``n_step``) carrying their agent, module and multi-agent episode ids; a step whose episode ends within n
        steps is redrawn. ``"synchronized"``: ``B`` env steps, each agent's transition there (``_sample_synchronized``),
        as a dict module id -> columns."""
        start = time.perf_counter()
        name = type(self).__name__
        if replay_mode not in ("independent", "synchronized"):
            raise ValueError(f"{name}.sample(): replay_mode must be 'independent' or 'synchronized', got "
                             f"{replay_mode!r}")
        if batch_length_T not in (None, 0, 1) or lookback:
            raise NotImplementedError(f"{name}.sample(): sequences (batch_length_T={batch_length_T}, "
                                      f"lookback={lookback}) are not supported for multi-agent episodes; RLlib's "
                                      f"multi-agent buffers ignore both and return 1-step transitions, which is what "
                                      f"batch_length_T=1 gives here")
        if num_items is not None and batch_size_B is not None:
            raise ValueError(f"{name}.sample(): pass num_items or batch_size_B, not both")
        size = num_items or batch_size_B or self.batch_size_B
        if not isinstance(size, (int, np.integer)) or isinstance(size, bool) or size < 1:
            raise ValueError(f"{name}.sample(): the batch size must be an int >= 1, got {size!r}")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not np.isfinite(beta) or beta < 0:
            raise ValueError(f"{name}.sample(): beta must be a finite number >= 0, got {beta!r}")
        modules = list(self._modules) if modules_to_sample is None else list(modules_to_sample)
        unknown = [m for m in modules if m not in self._modules]
        if unknown:
            raise ValueError(f"{name}.sample(): modules_to_sample {unknown!r} are not stored; the buffer holds "
                             f"{list(self._modules)!r}")
        empty = [m for m in modules if self._modules[m] is None or self._counts[m]["timesteps"] <= 0]
        if empty:
            raise ValueError(f"{name}.sample(): no steps stored for module(s) {empty!r}; add() episodes first or "
                             f"pass modules_to_sample")
        n_steps = n_range(f"{name}", n_step)
        if replay_mode == "synchronized":
            out = self._sample_synchronized(int(size), n_steps, float(gamma), modules, include_infos,
                                            include_extra_model_outputs)
            self.timings["sample"] += time.perf_counter() - start
            return out
        self._last_synchronized = False
        out, metrics = [], collections.defaultdict(dict)
        for module_id in modules:
            store = self._modules[module_id]
            drawn, resamples = store.take(Request(int(size), n_steps, float(beta), float(gamma)))
            episodes = store.episodes_of(drawn, to_numpy, include_infos, include_extra_model_outputs)
            out.extend(episodes)
            self._counts[module_id]["sampled"] += size
            mean_n = float(np.mean(np.asarray(drawn.columns["n_step"])))
            for agent_id in {e.agent_id for e in episodes}:
                picked = [e for e in episodes if e.agent_id == agent_id]
                metrics["agent_to_num_steps_sampled"][agent_id] = len(picked)
                metrics["agent_to_num_episodes_per_sample"][agent_id] = len({e.id_ for e in picked})
                metrics["agent_to_num_steps_per_sample"][agent_id] = len(picked)
                metrics["agent_to_sampled_n_step"][agent_id] = mean_n
                metrics["agent_to_num_resamples"][agent_id] = resamples
            metrics["module_to_num_steps_sampled"][module_id] = size
            metrics["module_to_num_episodes_per_sample"][module_id] = len({e.id_ for e in episodes})
            metrics["module_to_num_steps_per_sample"][module_id] = size
            metrics["module_to_sampled_n_step"][module_id] = mean_n
            metrics["module_to_num_resamples"][module_id] = resamples
        self.sampled_timesteps += size  # RLlib counts the batch size once, whatever the number of modules
        self._logged.update_sample(
            self, num_env_steps_sampled=size * len(modules),
            num_episodes_per_sample=len({e.multi_agent_episode_id for e in out}),
            num_env_steps_per_sample=len(out), sampled_n_step=float(np.mean(list(
                metrics["module_to_sampled_n_step"].values()))),
            num_resamples=sum(metrics["module_to_num_resamples"].values()), **metrics)
        self.timings["sample"] += time.perf_counter() - start
        return out

    def _windows(self, n: int, modules: list) -> Windows:
        """The agent windows of n env steps in the stored episodes for ``modules`` (``Windows``), from the episodes'
        env steps (``StoredMultiAgentEpisode.env_t``) and the module stores' ring rows; kept until the next add."""
        key = (n, tuple(modules))
        if key in self._windows_cache:
            return self._windows_cache[key]
        place = {module_id: i for i, module_id in enumerate(modules)}
        keys, module, order, agents, rows, steps, offsets = [], [], [], [], [], [], []
        for number, record in enumerate(self._order):
            for rank, (agent_id, part) in enumerate(record.agents.items()):
                env_t = record.env_t.get(agent_id)
                if part.module_id not in place or env_t is None:
                    continue
                # the steps stored under the agent's single-agent episode id (RLlib gives an agent a new one when
                # a chunk starts while its action hangs; the steps filed under that one have no env steps, -1)
                ring = self._modules[part.module_id].ring_rows(part.episode_id)
                if env_t.shape[1] < ring.size:
                    continue
                env_t = env_t[:, :ring.size]
                first, taken = agent_windows(env_t, n)
                if not first.size:
                    continue
                keys.append(number << 32 | env_t[0, first])
                module.append(np.full(first.size, place[part.module_id]))
                order.append(np.full(first.size, rank))
                agents.append(np.full(first.size, self._agent_ids.setdefault(agent_id, len(self._agent_ids))))
                rows.append(ring[first])
                steps.append(taken)
                # agent step k + j of a window acted j' env steps after its first: j' = env_t[0, k + j] - t
                later = np.minimum(first[:, None] + np.arange(n), env_t.shape[1] - 1)
                offsets.append(np.where(np.arange(n) < taken[:, None], env_t[0, later] - env_t[0, first][:, None], 0))
        if not keys:
            windows = Windows(*(np.zeros(0, np.int64),) * 5, np.zeros(0, np.int32), np.zeros(0, np.int32),
                              np.zeros((0, n), np.int64), n)
        else:
            keys, module, order = np.concatenate(keys), np.concatenate(module), np.concatenate(order)
            by = np.lexsort((order, module, keys))  # by env step, then module, then agent
            unique, first, count = np.unique(keys[by], return_index=True, return_counts=True)
            windows = Windows(unique, first, count, module[by], np.concatenate(agents)[by],
                              np.concatenate(rows)[by].astype(np.int32), np.concatenate(steps)[by].astype(np.int32),
                              np.concatenate(offsets)[by], n)
        self._windows_cache[key] = windows
        return windows

    def _drawable(self, n_steps: tuple, modules: list) -> Drawable:
        """The windows of every n in ``n_steps`` (inclusive) for ``modules`` as one table (``Drawable``); kept until
        the next add, as ``_windows`` are."""
        key = (n_steps, tuple(modules))
        if key in self._windows_cache:
            return self._windows_cache[key]
        tables = [self._windows(n, modules) for n in range(n_steps[0], n_steps[1] + 1)]
        longest = compile_size(n_steps[1])
        base = np.cumsum([0] + [table.module.size for table in tables])[:-1]
        joined = Drawable(
            np.concatenate([table.keys for table in tables]),
            np.concatenate([table.first + at for table, at in zip(tables, base)]),
            np.concatenate([table.count for table in tables]),
            np.concatenate([np.full(table.keys.size, table.n) for table in tables]),
            *(np.concatenate([getattr(table, f) for table in tables]) for f in ("module", "agent", "rows", "steps")),
            np.concatenate([np.pad(table.offsets, ((0, 0), (0, longest - table.n))) for table in tables]),
            np.concatenate([np.full(table.module.size, table.n) for table in tables]))
        self._windows_cache[key] = joined
        return joined

    def _sample_synchronized(self, size: int, n_steps: tuple, gamma: float, modules: list, infos: bool,
                             extras: bool) -> dict:
        """RLlib's synchronized multi-agent sample, without its 2.60 bugs: ``size`` env steps drawn uniformly (with
        replacement; for an n-step range, uniformly over the (env step, n) pairs) among the stored env steps t at
        which an agent of a module sampled acted and is observed again n env steps later; each such agent gives its
        module one row ``o_t, a_t, G, o_(t+n)`` with ``G`` the sum of its agent steps' rewards in the window, each
        discounted by gamma to the env steps from t to the one the agent acted at (the n-step return when it acts at
        every env step), terminated / truncated when ``o_(t+n)`` ends its episode, ``weights`` 1 and ``n_step`` n.
        Returns module id -> NumPy columns (rows in draw order; a module without rows is left out, as RLlib does).
        One gather kernel per module over the agent steps' ring rows; the host only maps env steps to ring rows."""
        name = type(self).__name__
        low, high = n_steps
        table = self._drawable(n_steps, modules)
        if not table.keys.size:
            raise ValueError(f"{name}.sample(): no stored env step has an agent of modules_to_sample {modules!r} "
                             f"that acted there and is observed n_step={low if low == high else (low, high + 1)} "
                             f"env steps later; sample a smaller n_step, other modules, or add longer episodes")
        longest = compile_size(high)
        picks = self.rng.integers(table.keys.size, size=size)
        keys, first, count = table.keys[picks], table.first[picks], table.count[picks]
        # every picked env step's windows, in draw order
        taken = np.repeat(first - np.cumsum(count) + count, count) + np.arange(int(count.sum()))
        module, agents, rows, steps = table.module[taken], table.agent[taken], table.rows[taken], table.steps[taken]
        offsets, n_of = table.offsets[taken], table.window_n[taken]
        episode_of = np.repeat(keys >> 32, count)  # each row's stored episode (its number)
        out, metrics = {}, collections.defaultdict(dict)
        for place, module_id in enumerate(modules):
            mine = np.flatnonzero(module == place)
            if not mine.size:
                continue
            store = self._modules[module_id]
            # at least the batch size (a module whose agents act less often compiles no smaller kernels)
            padded = compile_size(max(mine.size, size), multiple=self.num_shards)
            ring, span = np.zeros(padded, np.int32), np.ones(padded, np.int32)  # padding rows: row 0, dropped
            ring[:mine.size], span[:mine.size] = rows[mine], steps[mine]
            discounts = np.zeros((padded, longest), np.float64)
            discounts[:mine.size] = np.power(gamma, offsets[mine].astype(np.float64))
            gathered = store.gather(ring, span, discounts.astype(np.float32))
            host = {k: v[:mine.size] for k, v in to_host(gathered).items()}
            host = exact_values(host, gamma, discounts[:mine.size])
            columns = {key: host[key] for key in (Columns.OBS, Columns.ACTIONS, Columns.REWARDS, Columns.NEXT_OBS,
                                                  Columns.TERMINATEDS)}
            # an agent episode can be both (RLlib's episode sets both flags when only truncateds are given):
            # terminated wins, as in RLlib's synchronized rows
            columns[Columns.TRUNCATEDS] = host[Columns.TRUNCATEDS] & ~host[Columns.TERMINATEDS]
            columns["weights"] = np.ones(mine.size, np.float32)
            columns["n_step"] = n_of[mine].astype(np.int32)
            if infos:  # the infos of o_(t+n), as RLlib picks them
                named = [k for k in host if k.startswith("next_info__")]
                columns[Columns.INFOS] = [{k[len("next_info__"):]: host[k][i] for k in named}
                                          for i in range(mine.size)]
            if extras:  # those of step t, one column per key
                columns.update({k[len("extra__"):]: host[k] for k in host if k.startswith("extra__")})
            out[module_id] = columns
            self._counts[module_id]["sampled"] += int(mine.size)
            names = list(self._agent_ids)
            for kind, owner, rows_of in [("module", module_id, mine)] + [
                    ("agent", names[number], mine[agents[mine] == number])
                    for number in dict.fromkeys(agents[mine].tolist())]:
                metrics[f"{kind}_to_num_steps_sampled"][owner] = len(rows_of)
                metrics[f"{kind}_to_num_steps_per_sample"][owner] = len(rows_of)
                metrics[f"{kind}_to_num_episodes_per_sample"][owner] = len(set(episode_of[rows_of].tolist()))
                metrics[f"{kind}_to_sampled_n_step"][owner] = float(np.mean(n_of[rows_of]))
                metrics[f"{kind}_to_num_resamples"][owner] = 0
        self.sampled_timesteps += size
        self._last_synchronized = True
        self._logged.update_sample(
            self, num_env_steps_sampled=size, num_episodes_per_sample=len(set((keys >> 32).tolist())),
            num_env_steps_per_sample=len(set(keys.tolist())), sampled_n_step=float(np.mean(table.key_n[picks])),
            num_resamples=0, **metrics)
        return out

    def update_priorities(self, priorities, module_id) -> None:
        """New priorities ``|priorities|`` for the steps of ``module_id``'s last sample (RLlib's DQN passes each
        module's TD errors)."""
        name = type(self).__name__
        if not self._prioritized:
            raise NotImplementedError(f"{name} samples uniformly; use ConduitMultiAgentPrioritizedEpisodeReplayBuffer")
        if self._modules.get(module_id) is None:
            raise ValueError(f"{name}.update_priorities(): module {module_id!r} is not stored; the buffer holds "
                             f"{list(self._modules)!r}")
        if self._last_synchronized:
            raise ValueError(f"{name}.update_priorities(): the last sample was replay_mode='synchronized', which "
                             f"draws env steps uniformly (weights 1); priorities follow an 'independent' sample")
        start = time.perf_counter()
        self._modules[module_id].update_priorities(priorities)
        self.timings["update_priorities"] += time.perf_counter() - start

    # -- sizes --------------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.get_num_timesteps()

    def get_module_ids(self) -> list:
        return list(self._modules)

    def get_num_timesteps(self, module_id=None) -> int:
        """Env steps stored, or ``module_id``'s agent steps."""
        return self._counts[module_id]["timesteps"] if module_id else self._num_timesteps

    def get_num_episodes(self, module_id=None) -> int:
        return self._counts[module_id]["episodes"] if module_id else len(self._order)

    def get_num_episodes_evicted(self, module_id=None) -> int:
        return self._counts[module_id]["evicted"] if module_id else self._num_episodes_evicted

    def get_added_timesteps(self, module_id=None) -> int:
        return self._counts[module_id]["added"] if module_id else self._num_timesteps_added

    def get_sampled_timesteps(self, module_id=None) -> int:
        return self._counts[module_id]["sampled"] if module_id else self.sampled_timesteps

    def get_num_agent_timesteps(self) -> int:
        return self._num_agent_timesteps

    def get_added_agent_timesteps(self) -> int:
        return self._num_agent_timesteps_added

    # -- state ----------------------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"capacity": self.capacity, "alpha": self.alpha, "num_shards": self.num_shards,
                "prioritized": self._prioritized}

    def get_state(self) -> dict[str, Any]:
        """The buffer as NumPy arrays plus JSON-able metadata (each module's store as the single-agent buffers
        save theirs): nothing pickled, nothing JAX."""
        return {"format": MULTI_AGENT_STATE_FORMAT, "version": STATE_VERSION, "config": self._config(),
                "counters": {"num_timesteps": self._num_timesteps, "num_timesteps_added": self._num_timesteps_added,
                             "num_episodes_evicted": self._num_episodes_evicted,
                             "num_agent_timesteps": self._num_agent_timesteps,
                             "num_agent_timesteps_added": self._num_agent_timesteps_added,
                             "sampled_timesteps": self.sampled_timesteps},
                "rng": self.rng.bit_generator.state,  # synchronized draws continue where they were
                "episodes": [{"id": record.id_, "env_steps": record.env_steps, "agent_steps": record.agent_steps,
                              "agents": [[agent_id, *part] for agent_id, part in record.agents.items()],
                              "env_t": [[agent_id, env_t] for agent_id, env_t in record.env_t.items()]}
                             for record in self._order],
                # lists of pairs, not dicts: module ids need not be strings
                "modules": [[module_id, None if store is None else store.capacity,
                             dict(self._counts[module_id]), None if store is None else store.get_state()]
                            for module_id, store in self._modules.items()]}

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore what ``get_state`` returned (from a buffer configured the same way); checked before anything
        changes."""
        name = type(self).__name__
        if not isinstance(state, dict) or state.get("format") != MULTI_AGENT_STATE_FORMAT:
            raise ValueError(f"{name}.set_state(): not a Conduit multi-agent buffer state (format "
                             f"{state.get('format')!r}; expected {MULTI_AGENT_STATE_FORMAT!r})"
                             if isinstance(state, dict) else f"{name}.set_state(): expected a dict, got "
                             f"{type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"{name}.set_state(): state version {state.get('version')!r}, this code reads "
                             f"{STATE_VERSION}")
        differ = {k: (state["config"].get(k), v) for k, v in self._config().items() if state["config"].get(k) != v}
        if differ:
            raise ValueError(f"{name}.set_state(): the state was saved by a buffer configured differently "
                             f"(saved, this): {differ}")
        modules = {}
        for module_id, capacity, _, saved in state["modules"]:
            if saved is not None:
                store = self._new_store(int(capacity), module_id, int(saved["config"]["seed"]))
                store.set_state(saved)  # checks its arrays before changing anything
                modules[module_id] = store
            else:
                modules[module_id] = None
        self._reset()
        self._modules = modules
        for module_id, _, counts, _ in state["modules"]:
            self._counts[module_id].update(counts)
        for saved in state["episodes"]:
            record = StoredMultiAgentEpisode(saved["id"], int(saved["env_steps"]), int(saved["agent_steps"]),
                                             {a: AgentSteps(m, e, int(n)) for a, m, e, n in saved["agents"]},
                                             {a: np.asarray(env_t, np.int64).reshape(2, -1)
                                              for a, env_t in saved.get("env_t", [])})
            self._order.append(record)
            self._live[record.id_] = record
        counters = state["counters"]
        self._num_timesteps, self._num_timesteps_added = counters["num_timesteps"], counters["num_timesteps_added"]
        self._num_episodes_evicted = counters["num_episodes_evicted"]
        self._num_agent_timesteps = counters["num_agent_timesteps"]
        self._num_agent_timesteps_added = counters["num_agent_timesteps_added"]
        self.sampled_timesteps = counters["sampled_timesteps"]
        if "rng" in state:  # states saved before it was kept restart the synchronized draws from the seed
            self.rng.bit_generator.state = state["rng"]
