"""Drop-in replay buffers for RLlib's new API stack (ray 2.60) that keep RLlib's buffer contract, backed by Conduit's
functional core (``conduit_jax.make_buffer``).

Select one with an import string (RLlib 2.60 crashes on a class object; a name containing ``EpisodeReplayBuffer``
also receives ``metrics_num_episodes_for_smoothing``)::

    config.training(replay_buffer_config={
        "type": "conduit_rllib.ConduitPrioritizedEpisodeReplayBuffer",  # DQN / SAC with PER
        "capacity": 50_000, "alpha": 0.6, "beta": 0.4,
        "deliver": "episodes",  # or "torch": the learner receives the batch through DLPack (see learners.py)
    })

``ConduitEpisodeReplayBuffer`` stands for RLlib's ``EpisodeReplayBuffer``, ``ConduitPrioritizedEpisodeReplayBuffer``
for ``PrioritizedEpisodeReplayBuffer`` (it subclasses it because RLlib's DQN calls ``update_priorities`` only on such
buffers). Neither runs its RLlib parent's constructor (no Python episode deque, no segment trees).

What RLlib users can rely on, as RLlib defines it:

* **Episodes and eviction.** ``add(episodes)`` stores every step; a chunk whose episode id is stored already is
  appended to that episode. When more than ``capacity`` steps are stored, whole oldest episodes are evicted (never
  the last one left), with RLlib's rule for each class: the uniform buffer checks after each added episode, the
  prioritized one once per ``add`` and drops the new chunks of an episode it evicts. ``get_num_timesteps``,
  ``get_num_episodes``, ``get_num_episodes_evicted``, ``get_added_timesteps``, ``get_sampled_timesteps`` and the
  metrics count as RLlib counts; ``buffer.episodes`` lists the stored episodes (``id_`` and ``len()``). An evicted
  step is never sampled again.
* **n-step transitions.** ``sample(num_items, n_step=n, gamma=...)`` returns ``(o_t, a_t, sum_k gamma^k r_(t+k),
  o_(t+n))``, terminated / truncated when ``t + n`` is the episode's end. The prioritized buffer redraws a step whose
  episode ends within n steps (RLlib's resampling); the uniform one uses the steps the episode has (RLlib's clipped
  slice). Its ``n_step`` column then says how many steps were used, where RLlib reports the requested n although
  its own reward sum covers fewer: we follow the formula. ``n_step=(low, high)`` draws n per item in ``[low, high)``.
* **Priorities.** Drawn with probability ``p^alpha / sum p^alpha`` (RLlib's default ``alpha`` is 1.0), new steps at
  the largest priority seen, ``update_priorities(td)`` sets ``|td|`` (+1e-12, RLlib's floor) for the last batch.
  Importance weights are ``(N P(i))^-beta / (N P_min)^-beta`` with ``P_min`` the smallest probability of any stored
  step, ``beta`` given to ``sample`` (default 0.0, as RLlib: all weights 1). The ``beta`` key of the config is
  accepted because RLlib passes it; DQN hands it to every ``sample`` call.
* **infos and extra_model_outputs.** Stored as columns when they are array-like (numbers or arrays with the same
  keys and shapes in every step); ``include_infos`` returns the infos of ``o_t`` and ``o_(t+n)``,
  ``include_extra_model_outputs`` those of step t. Anything else (strings, nested dicts, keys that change between
  episodes) is refused at ``add`` with the key named, before anything is stored.
* **Dtypes.** What ``sample()`` returns is what was added: a float64 leaf (rewards given as Python floats, float64
  observations) is stored twice, as float32 for the kernels and as its 64-bit pattern (two uint32 words, gathered,
  never computed on), and comes back bit for bit; n-step sums of float64 rewards are computed in float64 on the host
  from the window's exact rewards. int64 leaves are stored as int32 (values outside int32 are refused at ``add``).
  ``deliver="torch"`` hands the learner the float32 columns (float64 -> float32: relative error <= 6e-8).
* ``get_state()`` / ``set_state()``: NumPy arrays and JSON-able metadata, nothing pickled (``checkpoint.py``).

How (``store.py``, ``draws.py``, ``episode_index.py``): steps are items of a Conduit buffer in a ring of
``2 * capacity`` steps, so the steps RLlib keeps are always stored while evicted ones wait to be overwritten; one
compiled kernel draws a batch, follows each step's links to its episode's next steps for n-step windows, redraws what
RLlib would and computes the weights. An ``add`` that would overwrite a step RLlib keeps (one episode longer than
``2 * capacity``) is refused with a ``ValueError`` and changes nothing.

* **Sequences** (uniform buffer, ``sample_episodes=False``, RLlib's default there): RLlib's ``[B, T]`` batch of
  ``obs``, ``actions``, ``rewards``, ``is_first``, ``is_last``, ``is_terminated``, ``is_truncated`` (rows that run
  into another episode from its first step), as NumPy arrays.
* **Sequences of episodes** (uniform buffer, ``sample_episodes=True`` with ``batch_length_T=T``, what RLlib's DQN asks
  for with a stateful module): RLlib's ``episode.slice(t, t + T)`` of a stored episode from a uniformly drawn step t
  (cut at the episode's end; ``t_started`` is the stored episode's plus t), with ``lookback`` steps before t (fewer
  near the episode's start, as RLlib clips them) and every stored column, infos and extra_model_outputs included;
  a draw with ``t + min_batch_length_T`` past the episode's end is drawn again; slices are drawn until their lengths
  + 1 add up to the batch size (RLlib's count). ``n_step`` must be 1, as in RLlib. These are drawn in ``sample()``
  whatever the schedule.
* **Schedules** (``"schedule"``): the core's schedules, carried out by the core's ``delivery.Scheduler`` without a
  worker thread (RLlib calls its buffer on its own thread; a batch drawn ahead is dispatched there and computes while
  RLlib goes on), by RLlib-friendly names (``SCHEDULES``): ``"sync"`` (``conduit_jax.schedule.staged()``; ``sync()``
  is taken too) draws in ``sample()``; ``"overlap"`` (``overlap(1)``) draws the next batch right after each
  ``update_priorities`` (uniform: after each ``sample()``), so it runs while RLlib's training step samples the env
  and adds; ``"deferred"`` (``deferred(1, 1)``) right after ``sample()`` (the priority update lands one batch later).
  A batch drawn ahead is handed over only to the same request (size, n_step, beta, gamma) and never holds a step
  evicted since; it comes from the buffer as it was when drawn (the newest add is not in it), and ``get_state`` does
  not hold it. ``"adaptive"`` (``adaptive(1, 1)``, prioritized) draws ahead as overlap does while that costs
  ``sample()`` no noticeable wait, and as deferred once it does (when RLlib runs several updates back to back,
  nothing separates an update from the next ``sample()``, so the overlap draw cannot finish in time), trying overlap
  again every 32 batches (``conduit_jax.schedule.draws_after_update``): a batch never misses more than one priority
  update. ``stats()`` counts the batches drawn ahead each way and those ``sample()`` waited for. Adds are staged
  under every schedule (a copy, written by the next draw's kernel). RLlib asks for one batch at a time and may
  change its request between calls, so a buffer draws at most one batch ahead; deeper schedules are refused.

* **Multi-agent** (``ConduitMultiAgentEpisodeReplayBuffer``, ``ConduitMultiAgentPrioritizedEpisodeReplayBuffer``,
  for RLlib's ``MultiAgentEpisodeReplayBuffer`` / ``MultiAgentPrioritizedEpisodeReplayBuffer``): whole oldest
  multi-agent episodes are evicted once per ``add`` while more than ``capacity`` env steps are stored (RLlib's rule),
  with RLlib's overall and per-module counts (``get_num_timesteps(module_id)`` counts that module's agent steps).
  Each module's agent steps live in their own Conduit buffer (its own sum tree, largest priority and weight
  normalisation), whose ring holds ``2 * capacity`` steps per agent the module serves (``agents_per_module``
  overrides the count taken from the first episode). ``sample()`` is RLlib's independent mode by default: ``B``
  transitions per module (``modules_to_sample``), as 1-step single-agent episodes naming their agent, module and
  multi-agent episode; a window past its episode's end is redrawn, as RLlib does in both multi-agent classes.
  ``update_priorities(td, module_id)`` as RLlib's DQN calls it; the schedules work per module.
* **Synchronized multi-agent sampling** (``replay_mode="synchronized"``, both multi-agent classes): ``B`` env steps
  drawn uniformly (with replacement) among the stored env steps t at which an agent of a module sampled acted and is
  observed again n env steps later; each such agent gives its module one row ``o_t, a_t, G, o_(t+n)`` (``G``: its
  rewards in the window, each agent step's discounted by gamma to the env steps from t to the one it acted at: the
  n-step return for an agent that acts at every env step), terminated / truncated when ``o_(t+n)`` ends the
  agent's episode, ``weights`` 1, ``n_step`` n. It returns RLlib's dict module id -> NumPy columns (``obs``,
  ``actions``, ``rewards``, ``new_obs``, ``terminateds``, ``truncateds``, ``weights``, ``n_step``; ``infos`` of
  ``o_(t+n)`` and the extra_model_outputs of step t as their own columns when asked), rows in draw order, a module
  without rows left out; ``get_sampled_timesteps()`` grows by ``B``, each module's count by its rows. Where RLlib
  2.60's differs: it never draws an episode's last transition (so never marks a row terminated), counts an env
  step whose agents are all in other modules towards ``B``, and returns empty ``weights`` / ``n_step`` columns. The
  prioritized class draws these batches uniformly too (weights 1 whatever ``beta``) and refuses an
  ``update_priorities`` after one.

Not supported (``NotImplementedError``): sequences from the prioritized buffer and the multi-agent ones (any
``batch_length_T`` > 1 or ``lookback``; RLlib 2.60's own prioritized and multi-agent buffers ignore both and return
1-step transitions, so a refusal says so instead), non-array observations (Dict / Tuple spaces); ``deliver="torch"``
is single-agent only.
"""


from __future__ import annotations

from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import MultiAgentEpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.multi_agent_prioritized_episode_buffer import (
    MultiAgentPrioritizedEpisodeReplayBuffer)
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

from conduit_rllib.batch import ConduitBatch
from conduit_rllib.draws import MOST_CANDIDATES, candidate_count
from conduit_rllib.episode_index import EXACT, StoredEpisode
from conduit_rllib.multi_agent import (MULTI_AGENT_STATE_FORMAT, AgentSteps, MultiAgentStore,
                                       StoredMultiAgentEpisode)
from conduit_rllib.store import (CLASS_ARGUMENTS, PRIORITY_FLOOR, SCHEDULES, STATE_FORMAT, STATE_VERSION,
                                 STORAGE_FACTOR, EpisodeStore)

__all__ = [
    "EXACT", "MOST_CANDIDATES", "MULTI_AGENT_STATE_FORMAT", "PRIORITY_FLOOR", "SCHEDULES", "STATE_FORMAT",
    "STATE_VERSION", "STORAGE_FACTOR", "AgentSteps", "ConduitBatch",
    "ConduitEpisodeReplayBuffer", "ConduitMultiAgentEpisodeReplayBuffer",
    "ConduitMultiAgentPrioritizedEpisodeReplayBuffer", "ConduitPrioritizedEpisodeReplayBuffer", "StoredEpisode",
    "StoredMultiAgentEpisode", "candidate_count",
]


def _from_config(kwargs: dict) -> dict:
    """A single-agent class's ``replay_buffer_config`` for its store: a key named like an argument the class sets
    (``CLASS_ARGUMENTS``) never reaches it; the store ignores it with the unknown keys' warning."""
    return {"config_ignored": tuple(sorted(k for k in kwargs if k in CLASS_ARGUMENTS)),
            **{k: v for k, v in kwargs.items() if k not in CLASS_ARGUMENTS}}


class ConduitEpisodeReplayBuffer(EpisodeStore, EpisodeReplayBuffer):
    """Uniform replay (RLlib's ``EpisodeReplayBuffer``) in Conduit's functional core; ``weights`` are all 1."""

    def __init__(self, capacity: int = 10000, **kwargs):
        super().__init__(capacity, prioritized=False, redraws=False, **_from_config(kwargs))


class ConduitPrioritizedEpisodeReplayBuffer(EpisodeStore, PrioritizedEpisodeReplayBuffer):
    """Prioritized replay (RLlib's ``PrioritizedEpisodeReplayBuffer``) in Conduit's functional core: the sum tree,
    stratified draws, new steps at the max priority, importance weights normalised by the smallest probability."""

    def __init__(self, capacity: int = 10000, **kwargs):
        super().__init__(capacity, prioritized=True, redraws=True, **_from_config(kwargs))


class ConduitMultiAgentEpisodeReplayBuffer(MultiAgentStore, MultiAgentEpisodeReplayBuffer):
    """Uniform multi-agent replay (RLlib's ``MultiAgentEpisodeReplayBuffer``, independent or synchronized sampling)
    in Conduit's functional core: one store per module; ``weights`` are all 1."""

    def __init__(self, capacity: int = 10000, **kwargs):
        super().__init__(capacity, prioritized=False, **kwargs)


class ConduitMultiAgentPrioritizedEpisodeReplayBuffer(MultiAgentStore, MultiAgentPrioritizedEpisodeReplayBuffer):
    """Prioritized multi-agent replay (RLlib's ``MultiAgentPrioritizedEpisodeReplayBuffer``, independent sampling):
    one sum tree per module, new steps at the module's largest priority, weights normalised per module; its
    synchronized batches are drawn uniformly over env steps (weights 1) and take no priority update."""

    def __init__(self, capacity: int = 10000, **kwargs):
        super().__init__(capacity, prioritized=True, **kwargs)
