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

How: steps are items of a Conduit buffer (``samplers.prioritized``; ``alpha=0`` for the uniform class) in a ring of
``2 * capacity`` steps, so the steps RLlib keeps are always stored while evicted ones wait to be overwritten
(``Buffer.retire`` takes them out of sampling at once). Each step links to the next step of its episode; one compiled
kernel draws, follows the links for n-step windows (``Buffer.read``), redraws what RLlib would, and computes the
weights. For PER's redraw it draws more steps than the batch needs, as many as the share of fitting windows in
earlier draws asks for (``candidate_count``), so one kernel suffices even when most of the priority mass sits on
steps near an episode's end (short episodes); where even its largest draw has too few, the fitting steps of several
draws are joined, as RLlib resamples one step at a time. An ``add`` that would overwrite a step RLlib keeps (one
episode longer than ``2 * capacity``) is refused with a ``ValueError`` and changes nothing.

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
* **Schedules** (``"schedule"``): ``"sync"`` draws in ``sample()``; ``"overlap"`` draws the next batch right after
  each ``update_priorities`` (uniform: after each ``sample()``), so it runs while RLlib's training step samples the
  env and adds; ``"deferred"`` right after ``sample()`` (the priority update lands one batch later). A batch drawn
  ahead is handed over only to the same request (size, n_step, beta, gamma) and never holds a step evicted since;
  it comes from the buffer as it was when drawn (the newest add is not in it), and ``get_state`` does not hold it.
  ``"adaptive"`` (prioritized) draws ahead as overlap does while that costs ``sample()`` no noticeable wait, and as
  deferred once it does (when RLlib runs several updates back to back, nothing separates an update from the next
  ``sample()``, so the overlap draw cannot finish in time), trying overlap again every 32 batches
  (``adaptive_choice``): a batch never misses more than one priority update. ``stats()`` counts the batches drawn
  ahead each way and those ``sample()`` waited for.

* **Multi-agent** (``ConduitMultiAgentEpisodeReplayBuffer``, ``ConduitMultiAgentPrioritizedEpisodeReplayBuffer``,
  for RLlib's ``MultiAgentEpisodeReplayBuffer`` / ``MultiAgentPrioritizedEpisodeReplayBuffer``): whole oldest
  multi-agent episodes are evicted once per ``add`` while more than ``capacity`` env steps are stored (RLlib's rule),
  with RLlib's overall and per-module counts (``get_num_timesteps(module_id)`` counts that module's agent steps).
  Each module's agent steps live in their own Conduit buffer (its own sum tree, largest priority and weight
  normalisation), whose ring holds ``2 * capacity`` steps per agent the module serves (``agents_per_module``
  overrides the count taken from the first episode). ``sample()`` is RLlib's independent mode: ``B`` transitions per
  module (``modules_to_sample``), as 1-step single-agent episodes naming their agent, module and multi-agent
  episode; a window past its episode's end is redrawn, as RLlib does in both multi-agent classes.
  ``update_priorities(td, module_id)`` as RLlib's DQN calls it; the schedules work per module.

Not supported (``NotImplementedError``): sequences from the prioritized buffer and the multi-agent ones (any
``batch_length_T`` > 1 or ``lookback``; RLlib 2.60's own prioritized and multi-agent buffers ignore both and return
1-step transitions, so a refusal says so instead), the multi-agent ``replay_mode="synchronized"`` (RLlib 2.60's
never draws an episode's last transition, never marks a row terminated and returns empty ``weights`` / ``n_step``
columns; RLlib's DQN samples ``"independent"``), non-array observations (Dict / Tuple spaces); ``deliver="torch"``
is single-agent only.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from ray.rllib.core import DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
from ray.rllib.core.columns import Columns
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
from ray.rllib.utils import force_list
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger
from ray.rllib.utils.replay_buffers.episode_replay_buffer import EpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.multi_agent_episode_buffer import MultiAgentEpisodeReplayBuffer
from ray.rllib.utils.replay_buffers.multi_agent_prioritized_episode_buffer import (
    MultiAgentPrioritizedEpisodeReplayBuffer)
from ray.rllib.utils.replay_buffers.prioritized_episode_buffer import PrioritizedEpisodeReplayBuffer

from conduit_jax import ExperienceSpec, default_mesh, engine, make_buffer, samplers
from conduit_jax.replay import compile_size

logger = logging.getLogger(__name__)

STATE_FORMAT = "conduit_rllib.episode_replay_buffer"
STATE_VERSION = 3
STORAGE_FACTOR = 2  # the ring holds this many times `capacity` steps (see the module docstring)
PRIORITY_FLOOR = 1e-12  # RLlib's smallest priority
EXACT = "exact__"  # prefix of the column that keeps a float64 column's values bit for bit
_NARROW = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32),
           np.dtype(np.float64): np.dtype(np.float32)}
_KNOWN_KWARGS = {"type", "metrics_num_episodes_for_smoothing"}
SCHEDULES = ("sync", "overlap", "deferred", "adaptive")
ADAPTIVE_WAIT_SHARE = 0.1  # adaptive: overlap gives way once sample() waits more than this share of a learner update
ADAPTIVE_RETRY_AFTER = 32  # adaptive: overlap is tried again after this many batches drawn the deferred way
MOST_CANDIDATES = 1 << 14  # PER's redraw: steps one draw kernel takes by priority at most (beyond 64 x the batch)
_BUFFERS: dict = {}  # (layout, sampler batch size) -> functional Buffer; the state is each buffer's own
_KERNELS: dict = {}  # (layout, kind, static arguments) -> compiled kernel (engine.compiled, rllib_<kind>)


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


@dataclasses.dataclass
class StoredEpisode:
    """An episode the buffer keeps (what ``buffer.episodes`` lists): its id, the steps stored, whether it has ended,
    and where its chunks went (``segments``: first item index and step count of each chunk, in order)."""

    id_: Any
    length: int = 0
    is_terminated: bool = False
    is_truncated: bool = False
    segments: list = dataclasses.field(default_factory=list)
    agent_id: Any = None  # the agent, module and multi-agent episode the steps belong to (as RLlib's episode says)
    module_id: Any = None
    multi_agent_episode_id: Any = None
    t_started: int = 0  # the env step its first stored step was taken at (its first chunk's ``t_started``)

    def __len__(self) -> int:
        return self.length

    def items(self) -> np.ndarray:
        """Insertion indices of its steps, oldest first."""
        if not self.segments:
            return np.zeros((0,), np.int64)
        return np.concatenate([np.arange(first, first + count, dtype=np.int64) for first, count in self.segments])


@dataclasses.dataclass
class _Chunk:
    """One added episode chunk, its columns checked and narrowed, before anything is stored."""

    id_: Any
    columns: dict
    length: int
    is_terminated: bool
    is_truncated: bool
    keys: dict = dataclasses.field(default_factory=dict)  # extra / info column -> the key it came from
    spaces: tuple = (None, None)  # the episode's observation and action spaces
    owner: tuple = (None, None, None)  # agent_id, module_id, multi_agent_episode_id
    t_started: int = 0
    record: Optional[StoredEpisode] = None  # where it goes (set while planning the add)


class _Request(NamedTuple):
    """What a ``sample()`` call asks for; a prefetched batch is handed over only to the same request."""

    size: int
    n_range: tuple  # (low, high), inclusive
    beta: float
    gamma: float


class _Plan(NamedTuple):
    """A checked add, laid out by ``_prepare`` and applied by ``_commit``."""

    order: collections.deque  # the episode index afterwards, oldest first
    live: dict
    written: list  # the chunks stored (an evicted episode's new chunks are not)
    evicted: list  # StoredEpisode
    pending: dict
    timesteps: int
    added: int
    episodes_added: int
    steps_added: int
    steps_evicted: int
    spec: Optional[ExperienceSpec] = None
    keys: dict = {}
    spaces: tuple = (None, None)
    item: int = 0  # the next insertion index afterwards
    segments: dict = {}  # id(record) -> the (first item, count) chunks it gains
    rows: list = []
    patches: list = []


class _Drawn(NamedTuple):
    request: _Request
    columns: dict
    ids: jax.Array
    enough: jax.Array  # bool[]: enough windows fitted (PER's redraw)
    fitting: jax.Array  # int32[]: how many of the candidates' windows fitted
    candidates: int  # steps drawn by priority


def _narrowed(name: str, where: str, key: str, values) -> np.ndarray:
    """``values`` as a storable array: 64-bit narrowed to 32-bit (integers checked to fit), numbers only."""
    array = np.asarray(values)
    if array.dtype.kind not in "biuf":
        raise ValueError(f"{name}.add(): {where} {key!r} holds {array.dtype} values ({type(values).__name__}); only "
                         f"numbers and numeric arrays can be stored (nothing was added)")
    target = _NARROW.get(array.dtype, array.dtype)
    if target.kind in "iu" and target != array.dtype and array.size:
        info = np.iinfo(target)
        if array.min() < info.min or array.max() > info.max:
            raise ValueError(f"{name}.add(): {where} {key!r} holds values outside {target} ([{array.min()}, "
                             f"{array.max()}]), which the buffer stores them as (nothing was added)")
    return array.astype(target, copy=False)


def _bits(values: np.ndarray) -> np.ndarray:
    """float64 values as their bit patterns, two uint32 words each (JAX on CPU computes in 32 bits; the words are
    only stored and gathered, so what comes back is exactly what was added)."""
    values = np.ascontiguousarray(values, np.float64)
    return values.view(np.uint32).reshape(values.shape + (2,))


def _unbits(words: np.ndarray) -> np.ndarray:
    words = np.ascontiguousarray(words, np.uint32)
    return words.view(np.float64).reshape(words.shape[:-1])


def _exact_values(host: dict, gamma: float) -> dict:
    """A drawn batch's float64 columns as they were added: bit patterns back to float64, and the n-step sums of
    float64 rewards recomputed in float64 (RLlib's recursion, from the window's last reward back)."""
    for key in [k for k in host if k.startswith(EXACT)]:
        words = host.pop(key)
        if key == EXACT + "reward_window":
            rewards, used, total = _unbits(words), host["n_step"], 0.0
            for k in range(rewards.shape[1] - 1, -1, -1):
                total = np.where(k < used, rewards[:, k] + gamma * total, total)
            host[Columns.REWARDS] = np.asarray(total, np.float64)
        else:
            host[key[len(EXACT):]] = _unbits(words)
    return host


def _joined(parts: list) -> _Drawn:
    """One batch from the first ``take`` rows of each ``(draw, take)``: the rows whose window fitted, which a draw
    puts first (in random order)."""
    first = parts[0][0]
    columns = {k: jnp.concatenate([drawn.columns[k][:take] for drawn, take in parts]) for k in first.columns}
    ids = jnp.concatenate([drawn.ids[:take] for drawn, take in parts])
    return _Drawn(first.request, columns, ids, jnp.asarray(True), jnp.int32(ids.shape[0]), first.candidates)


def _to_host(tree):
    """A pytree of JAX arrays as NumPy arrays (read-only), once computed. On the CPU ``np.asarray`` reads each buffer
    in place, with less overhead per array than ``jax.device_get``; on an accelerator ``device_get`` starts every
    copy before it waits for the first."""
    if jax.default_backend() == "cpu":
        return jax.tree.map(np.asarray, tree)
    return jax.device_get(tree)


def _pieces(n: int):
    """(start, size) pieces of powers of two covering n rows: each size compiles one ingest kernel, ever."""
    start, bit = 0, 1 << max(n.bit_length() - 1, 0)
    while bit:
        if n & bit:
            yield start, bit
            start += bit
        bit >>= 1


def _shuffled(rows: jax.Array, seed, counter) -> jax.Array:
    """A drawn batch's rows in random order. The sampler's draws are stratified (draw j lands in the j-th equal
    slice of the priority mass), so a kernel that uses only some of them, or groups them, takes them in a random
    order to keep every one uniform over the buffer."""
    return jax.random.permutation(jax.random.fold_in(jax.random.key(seed), counter), rows)


def adaptive_choice(current: str, waited_s: float, learner_s: float, deferred_batches: int) -> str:
    """The ``"adaptive"`` schedule's rule: where the next prioritized batch is drawn ahead. ``"overlap"`` (after
    ``update_priorities``: the batch sees every update, as under sync) while ``sample()`` does not wait for it
    noticeably, that is, for more than ``ADAPTIVE_WAIT_SHARE`` of the learner's update (the smoothed time from
    ``sample()`` returning to ``update_priorities``); ``"deferred"`` (after ``sample()``: the draw runs during the
    learner's update and misses that one priority update) once it does; overlap again after
    ``ADAPTIVE_RETRY_AFTER`` deferred batches, in case the gap between updates has grown. ``waited_s`` is how long
    the last ``sample()`` waited for its batch drawn ahead."""
    if current == "overlap":
        return "deferred" if waited_s > ADAPTIVE_WAIT_SHARE * learner_s else "overlap"
    return "overlap" if deferred_batches >= ADAPTIVE_RETRY_AFTER else "deferred"


def candidate_count(need: int, share: float) -> int:
    """How many steps a draw takes by priority when a ``share`` of the priority mass sits on steps whose n-step window
    fits and ``need`` of those must be among them: the binomial mean at least three standard deviations (plus 4) above
    ``need``, at most ``max(64 * need, MOST_CANDIDATES)`` (a smaller share takes several draws); rounded up to a
    power of two, so a share that drifts compiles few kernel sizes (finer sizes compiled one kernel after another
    while priorities moved the share, and the compiles took much of a warm-up)."""
    target = math.ceil(min((need + 3 * math.sqrt(need) + 4) / max(share, 1e-9), max(64 * need, MOST_CANDIDATES)))
    return compile_size(target)


class _ConduitEpisodeBuffer:
    """The shared implementation; the public classes below add RLlib's base class."""

    _prioritized = False
    _redraws = False  # redraw a step whose episode ends within n steps (RLlib's PER and multi-agent buffers do)

    def __init__(self, capacity: int = 10000, *, batch_size_B: int = 16, batch_length_T: int = 1,
                 metrics_num_episodes_for_smoothing: int = 100, n_step: int = 1, alpha: float = 1.0,
                 beta: float = 0.0, num_shards: int = 1, seed: int = 0, deliver: str = "episodes",
                 schedule: str = "sync", **kwargs):
        # RLlib's parent constructors are not run on purpose (they allocate the Python episode deque and, for PER,
        # segment trees of 2 * capacity nodes); set what RLlib code reads from a buffer
        name = self._name
        unknown = set(kwargs) - _KNOWN_KWARGS
        if unknown:
            logger.warning("%s: ignoring unknown replay_buffer_config keys %s", name, sorted(unknown))
        if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"{name}: capacity must be an int >= 1 (steps), got {capacity!r}")
        if not isinstance(n_step, int) or n_step < 1:
            raise ValueError(f"{name}: n_step must be an int >= 1, got {n_step!r} (kept for older configs: sample() "
                             f"takes any n_step)")
        if deliver not in ("episodes", "torch"):
            raise ValueError(f"{name}: deliver must be 'episodes' or 'torch', got {deliver!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"{name}: schedule must be one of {SCHEDULES}, got {schedule!r}")
        for key, value in (("alpha", alpha), ("beta", beta)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value < 0:
                raise ValueError(f"{name}: {key} must be a finite number >= 0, got {value!r}")
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"{name}: num_shards must be an int >= 1, got {num_shards!r}")
        self.capacity = int(capacity)
        self.batch_size_B = int(batch_size_B)
        self.batch_length_T = batch_length_T
        self.n_step = n_step
        self.alpha = float(alpha) if self._prioritized else 0.0
        self.beta = float(beta)
        self.num_shards = num_shards
        self.seed = int(seed)
        self.deliver = deliver
        self.schedule = schedule
        self.rng = np.random.default_rng(seed)
        self.metrics = MetricsLogger(root=False)
        self._metrics_num_episodes_for_smoothing = metrics_num_episodes_for_smoothing
        self.observation_space = None
        self.action_space = None
        self.timings = collections.defaultdict(float)  # seconds spent in add / sample / update_priorities
        storage = STORAGE_FACTOR * self.capacity
        self.storage_capacity = storage + (-storage) % num_shards
        self._reset()

    @property
    def _name(self) -> str:
        """How error messages name this buffer."""
        return type(self).__name__

    @property
    def _too_small(self) -> str:
        """What an add refused for want of ring space tells the user to change."""
        return f"the ring holds {STORAGE_FACTOR} x capacity={self.capacity} steps: raise capacity"

    def _reset(self) -> None:
        self._order: collections.deque = collections.deque()  # StoredEpisode, oldest first
        self._live: dict = {}  # episode id -> StoredEpisode
        self._num_timesteps = 0
        self._num_timesteps_added = 0
        self._num_episodes_evicted = 0
        self.sampled_timesteps = 0
        self._items = 0  # steps ever written to the ring (the next step's insertion index)
        self._draws = 0  # sample kernels run (each one's candidate pick uses its own random key)
        self._spec: Optional[ExperienceSpec] = None
        self._keys: dict = {}  # extra_model_outputs / infos column -> the key it stores
        self._state = None
        # int32[3, ring]: for each stored step the row of the next step of its episode (-1: none stored yet), of the
        # previous one (-1: the episode's first), and of its episode's first stored step
        self._links = None
        # host side: for each ring row the insertion index of its episode's first step, and the episodes by it (a
        # sampled step's episode id, agent and module)
        self._owner = np.full(self.storage_capacity, -1, np.int64)
        self._position = np.zeros(self.storage_capacity, np.int64)  # each ring row's step index in its episode
        self._by_first: dict = {}
        self._last_ids = None
        self._last_request: Optional[_Request] = None
        self._prefetched: Optional[_Drawn] = None  # the next batch, drawn ahead (schedule overlap / deferred)
        # where the next batch is drawn ahead ("overlap": after update_priorities, "deferred": after sample(), None:
        # not at all); adaptive moves it with adaptive_choice
        self._ahead = {"sync": None, "adaptive": "overlap"}.get(self.schedule, self.schedule)
        self._deferred_run = 0  # batches drawn ahead the deferred way in a row (adaptive)
        self._learner_s = 0.0  # smoothed time from sample() returning to update_priorities (the learner's update)
        self._handed_at: Optional[float] = None  # when the last sample() returned
        self._ahead_counts = {"after_update": 0, "after_sample": 0, "waited": 0}
        # per n-step range (PER's redraw): the share of drawn candidates whose window fitted, smoothed; sizes the
        # next draw (1.0 until a draw says otherwise)
        self._fit_share: dict = {}

    @property
    def episodes(self) -> list:
        """The stored episodes, oldest first (``id_``, ``len()``, ``is_terminated``, ``is_truncated``)."""
        return list(self._order)

    # -- the functional buffer and its kernels --------------------------------------------------------------------
    def _buffer(self, batch: int, spec: Optional[ExperienceSpec] = None):
        """The functional buffer drawing ``batch`` items, for this buffer's spec (or ``spec``)."""
        spec = spec or self._spec
        key = (self._layout(spec), batch)
        if key not in _BUFFERS:
            # beta 1 with buffer normalisation: weights (P / P_min)^-1, raised to the beta each sample() asks for
            sampler = samplers.prioritized(batch, alpha=self.alpha, beta=1.0, eps=PRIORITY_FLOOR, normalise="buffer")
            _BUFFERS[key] = make_buffer(spec, self.storage_capacity, sampler, mesh=default_mesh(self.num_shards))
        return _BUFFERS[key]

    def _layout(self, spec: Optional[ExperienceSpec] = None) -> tuple:
        """What the functional buffer and the kernels depend on: buffers configured alike share them (and their
        compiled code), within one process."""
        return (self._prioritized, self.alpha, self.storage_capacity, self.num_shards, spec or self._spec)

    def _start(self, spec: ExperienceSpec) -> None:
        self._spec = spec
        buffer = self._buffer(self.num_shards)
        self._state = buffer.init(self.seed)
        self._links = jnp.full((3, self.storage_capacity), -1, jnp.int32)

    def _kernel(self, kind: str, *static):
        key = (self._layout(), kind) + static
        if key not in _KERNELS:  # the pure step over the core's state, compiled with the state donated
            _KERNELS[key] = engine.compiled(getattr(self, f"_make_{kind}")(*static), f"rllib_{kind}",
                                            donate_argnums=0)
        return _KERNELS[key]

    def _make_ingest(self):
        return self._buffer(self.num_shards).ingest

    def _make_link(self):
        def link(links, full, patch):
            links = links.at[:, full[0]].set(full[1:], mode="drop")
            return links.at[0, patch[0]].set(patch[1], mode="drop")

        return link

    def _make_retire(self):
        return self._buffer(self.num_shards).retire

    def _make_update(self):
        return self._buffer(self.num_shards).update

    def _make_update_draw(self, *draw_static):
        """A priority update and the draw after it in one kernel (overlap: one dispatch per ``update_priorities``)."""
        update, draw = self._buffer(self.num_shards).update, self._kernel("draw", *draw_static)

        def update_draw(state, ids, values, *draw_args):
            return draw(update(state, ids, values), *draw_args)

        return update_draw

    def _make_draw(self, candidates: int, size: int, longest: int, redraw: bool):
        """One draw: ``candidates`` steps by priority, their n-step windows followed through the links,
        the first ``size`` whose window fits (``redraw``: RLlib's PER resampling) or all of them (windows clipped at
        the episode's end), and the importance weights for ``beta``."""
        buffer = self._buffer(candidates)
        names = set(self._spec.names)
        at_start = [k for k in names if k.startswith(("extra__", "info__", EXACT + "extra__", EXACT + "info__"))]
        at_end = [k for k in names if k.startswith(("next_info__", EXACT + "next_info__"))]  # the window's last step
        exact_reward = EXACT + "reward" in names
        prioritized = self._prioritized

        def draw(state, links, n, beta, gamma, seed, counter):
            key = jax.random.fold_in(jax.random.key(seed), counter)
            state, delivery = buffer.sample(state)
            rows = delivery.ids[:, 0]
            last, going, fits = rows, jnp.ones(rows.shape, jnp.bool_), jnp.ones(rows.shape, jnp.bool_)
            ret, used = delivery.data["reward"].astype(jnp.float32), jnp.ones(rows.shape, jnp.int32)
            window = [delivery.data[EXACT + "reward"]] if exact_reward else []  # float64 rewards, bit for bit
            for k in range(1, longest):
                following = links[0, last]
                step = going & (k < n) & (following >= 0)
                fits = fits & ((k >= n) | step)
                read = buffer.read(state, jnp.where(step, following, 0))
                ret = ret + jnp.where(step, jnp.power(gamma, k) * read["reward"], 0.0)
                if exact_reward:
                    window.append(jnp.where(step[:, None], read[EXACT + "reward"], 0))
                last, used, going = jnp.where(step, following, last), used + step.astype(jnp.int32), step
            end = buffer.read(state, last)
            if redraw:
                order = jnp.argsort(jnp.where(fits, jax.random.uniform(key, rows.shape), 2.0))[:size]
                fitting = jnp.where(delivery.valid, jnp.sum(fits, dtype=jnp.int32), 0)
            else:  # every candidate, in random order: the host may drop the shard padding off the end
                order, fitting = jax.random.permutation(key, size), jnp.where(delivery.valid, size, 0)
            weights = jnp.power(delivery.weights, beta) if prioritized else jnp.ones(rows.shape, jnp.float32)
            columns = {Columns.OBS: delivery.data["obs"], Columns.NEXT_OBS: end["next_obs"],
                       Columns.ACTIONS: delivery.data["action"], Columns.REWARDS: ret,
                       Columns.TERMINATEDS: end["terminated"], Columns.TRUNCATEDS: end["truncated"],
                       "n_step": used, "weights": weights.astype(jnp.float32)}
            for source, column, data in (("obs", Columns.OBS, delivery.data), ("next_obs", Columns.NEXT_OBS, end),
                                         ("action", Columns.ACTIONS, delivery.data)):
                if EXACT + source in names:
                    columns[EXACT + column] = data[EXACT + source]
            if exact_reward:
                columns[EXACT + "reward_window"] = jnp.stack(window, axis=1)  # [B, longest, 2]
            columns.update({k: delivery.data[k] for k in at_start})
            columns.update({k: end[k] for k in at_end})
            columns = {k: v[order] for k, v in columns.items()}
            return state, columns, delivery.ids[order], (fitting >= size) & delivery.valid, fitting

        return draw

    def _make_sequences(self, size: int, length: int):
        """RLlib's ``[B, T]`` batch: each row starts at a uniformly drawn step and runs to its episode's end (the
        final observation included, with the last action repeated), then continues with another drawn step's
        episode from its first step, until T entries; ``is_first`` / ``is_last`` / ``is_terminated`` /
        ``is_truncated`` as RLlib sets them. A row needs at most T // 2 + 1 draws (an entry run is >= 2 long)."""
        draws = length // 2 + 1
        buffer = self._buffer(size * draws)
        names = set(self._spec.names)
        exact = {k: EXACT + k in names for k in ("obs", "action", "reward")}

        def pick(condition, a, b):
            return jnp.where(condition.reshape(condition.shape + (1,) * (a.ndim - 1)), a, b)

        def sequences(state, links, seed, counter):
            state, delivery = buffer.sample(state)
            pool = _shuffled(delivery.ids[:, 0], seed, counter).reshape(size, draws)
            start = pool[:, 0]
            before = links[1, start]
            first = buffer.read(state, jnp.maximum(before, 0))
            first_reward = jnp.where(before >= 0, first["reward"], 0.0)
            first_bits = jnp.where((before >= 0)[:, None], first[EXACT + "reward"], 0) if exact["reward"] else \
                jnp.zeros((size, 2), jnp.uint32)
            zeros = jnp.zeros((size,), jnp.bool_)

            def entry(carry, t):
                row, final, segment, reward, bits, first = carry
                data = buffer.read(state, row)
                out = {"obs": pick(final, data["next_obs"], data["obs"]), "actions": data["action"],
                       "rewards": reward, "is_first": first, "is_last": final | (t == length - 1),
                       "is_terminated": final & data["terminated"], "is_truncated": final & data["truncated"]}
                if exact["obs"]:  # float64 columns, bit for bit
                    out[EXACT + "obs"] = pick(final, data[EXACT + "next_obs"], data[EXACT + "obs"])
                if exact["action"]:
                    out[EXACT + "actions"] = data[EXACT + "action"]
                if exact["reward"]:
                    out[EXACT + "rewards"] = bits
                    bits = jnp.where(final[:, None], 0, data[EXACT + "reward"])
                following = links[0, row]
                segment = segment + final.astype(jnp.int32)
                fresh = links[2, jnp.take_along_axis(pool, jnp.minimum(segment, draws - 1)[:, None], 1)[:, 0]]
                row = jnp.where(final, fresh, jnp.where(following >= 0, following, row))
                reward = jnp.where(final, 0.0, data["reward"].astype(jnp.float32))
                return (row, ~final & (following < 0), segment, reward, bits, final), out

            carry = (start, zeros, jnp.zeros((size,), jnp.int32), first_reward.astype(jnp.float32), first_bits, ~zeros)
            _, out = jax.lax.scan(entry, carry, jnp.arange(length))
            return state, {k: jnp.swapaxes(v, 0, 1) for k, v in out.items()}

        return sequences

    def _make_slices(self, size: int, lookback: int, length: int):
        """RLlib's sequences of episodes: for each of ``size`` uniformly drawn steps, the ring rows of up to
        ``lookback`` steps before it and up to ``length`` steps from it, in its episode (-1 past either end, followed
        through the links), every stored column at those rows, and the window's last step's ``next_*`` columns."""
        buffer = self._buffer(size)
        names = self._spec.names
        at_end = [k for k in names if k.startswith(("next_", EXACT + "next_")) or k in ("terminated", "truncated")]
        per_step = [k for k in names if k not in at_end]

        def slices(state, links, seed, counter):
            state, delivery = buffer.sample(state)
            start = _shuffled(delivery.ids[:, 0], seed, counter)  # RLlib takes as many as its count needs

            def follow(direction: int, count: int):
                """[size, count]: the rows 1..count steps away from ``start`` (direction 0: later, 1: earlier)."""
                def step(row, _):
                    row = jnp.where(row >= 0, links[direction, jnp.maximum(row, 0)], -1)
                    return row, row

                if count == 0:
                    return jnp.zeros((size, 0), jnp.int32)
                return jax.lax.scan(step, start, None, length=count)[1].T

            rows = jnp.concatenate([follow(1, lookback)[:, ::-1], start[:, None], follow(0, length - 1)], axis=1)
            taken = jnp.sum(rows[:, lookback:] >= 0, axis=1)
            last = jnp.take_along_axis(rows, (lookback + taken - 1)[:, None], axis=1)[:, 0]
            data = buffer.read(state, jnp.maximum(rows, 0).reshape(-1))
            data = {k: data[k].reshape(rows.shape + data[k].shape[1:]) for k in per_step}
            end = buffer.read(state, last)
            return state, rows, delivery.valid, data, {k: end[k] for k in at_end}

        return slices

    # -- add ------------------------------------------------------------------------------------------------------
    def _chunk(self, episode) -> _Chunk:
        """An episode chunk's columns, checked (nothing is stored before every chunk of an ``add`` passed)."""
        name = self._name
        if isinstance(episode, MultiAgentEpisode):
            raise TypeError(f"{name}.add(): got a MultiAgentEpisode; use ConduitMultiAgentEpisodeReplayBuffer or "
                            f"ConduitMultiAgentPrioritizedEpisodeReplayBuffer for multi-agent episodes")
        length = len(episode)
        obs = episode.get_observations(slice(0, length + 1))
        if isinstance(obs, list):  # an episode not yet turned into NumPy holds lists of per-step arrays
            try:
                obs = np.asarray(obs)
            except ValueError as exc:
                raise ValueError(f"{name}.add(): episode {episode.id_!r}: its observations differ in shape ({exc}; "
                                 f"nothing was added)") from None
        if not isinstance(obs, np.ndarray) or obs.dtype == object:
            raise NotImplementedError(f"{name}: observations must be arrays (Box / Discrete spaces); got "
                                      f"{type(obs).__name__}")
        ends = np.zeros(length, np.bool_)
        columns = {"terminated": ends.copy(), "truncated": ends.copy()}
        columns["terminated"][-1] = episode.is_terminated
        columns["truncated"][-1] = episode.is_truncated

        def put(where: str, key, values, parts: dict) -> None:
            """Store ``values`` (narrowed to 32 bits) under each column of ``parts`` (column -> slice); float64 ones
            also bit for bit."""
            raw = np.asarray(values)
            narrow = _narrowed(name, where, key, raw)
            for column, part in parts.items():
                columns[column] = narrow[part]
                if raw.dtype == np.float64:
                    columns[EXACT + column] = _bits(raw[part])

        everything = slice(None)
        put("observations", "obs", obs, {"obs": slice(None, -1), "next_obs": slice(1, None)})
        put("actions", "action", episode.get_actions(slice(0, length)), {"action": everything})
        rewards = np.asarray(episode.get_rewards(slice(0, length)))
        put("rewards", "reward", rewards.astype(np.float64 if rewards.dtype == np.float64 else np.float32),
            {"reward": everything})
        origin = {}  # column -> the extra_model_outputs / infos key it holds
        for key in episode.extra_model_outputs.keys():
            origin[f"extra__{key}"] = key
            put("extra_model_outputs key", key, episode.get_extra_model_outputs(key, slice(0, length)),
                {f"extra__{key}": everything})
        infos = episode.get_infos(slice(0, length + 1))
        if any(infos):
            keys = set(infos[0]) if isinstance(infos[0], dict) else None
            for info in infos:
                if not isinstance(info, dict) or set(info) != keys:
                    raise ValueError(f"{name}.add(): every step's infos must be a dict with the same keys to be "
                                     f"stored; episode {episode.id_!r} has {sorted(map(str, keys or ()))} and "
                                     f"{info!r} (nothing was added)")
            for key in sorted(keys, key=str):
                origin[f"info__{key}"] = origin[f"next_info__{key}"] = key
                put("infos key", key, [info[key] for info in infos],
                    {f"info__{key}": slice(None, -1), f"next_info__{key}": slice(1, None)})
        return _Chunk(episode.id_, columns, length, bool(episode.is_terminated), bool(episode.is_truncated), origin,
                      spaces=(episode.observation_space, episode.action_space),
                      owner=(episode.agent_id, episode.module_id, episode.multi_agent_episode_id),
                      t_started=int(episode.t_started))

    def _check_spec(self, spec: ExperienceSpec, chunk: _Chunk) -> None:
        name = self._name
        if set(chunk.columns) != set(spec.names):
            raise ValueError(f"{name}.add(): episode {chunk.id_!r} has columns {sorted(chunk.columns)}, the buffer "
                             f"stores {sorted(spec.names)} (infos / extra_model_outputs keys are fixed by the first "
                             f"add; nothing was added)")
        # a column's bit-for-bit twin last: the message names what the user gave
        columns = sorted(zip(spec.names, spec.shapes, spec.dtypes), key=lambda column: column[0].startswith(EXACT))
        for key, shape, dtype in columns:
            value = chunk.columns[key]
            if value.shape[1:] != tuple(shape) or value.dtype != dtype:
                raise ValueError(f"{name}.add(): episode {chunk.id_!r}: {key} is {value.dtype}{list(value.shape[1:])}"
                                 f" per step, the buffer stores {dtype}{list(shape)} (nothing was added)")

    def _plan(self, chunks: list, evict: Optional[list] = None) -> "_Plan":
        """RLlib's eviction, on copies of the episode index. The uniform buffer follows ``EpisodeReplayBuffer.add``
        (evict after each episode while more than ``capacity`` steps and more than one episode are stored), the
        prioritized one ``PrioritizedEpisodeReplayBuffer.add`` (count every new step first, evict while over capacity
        and more than one episode would remain, drop the new chunks of an evicted episode). With ``evict`` (episode
        ids) the caller decided: those episodes go, nothing else does (the multi-agent buffers' rule)."""
        order, live = collections.deque(self._order), dict(self._live)
        pending = collections.defaultdict(int)  # id(record) -> steps this add gives it
        timesteps, added = self._num_timesteps, self._num_timesteps_added
        evicted, episodes_added, steps_added = [], 0, 0

        def drop(old):
            order.remove(old)
            del live[old.id_]
            evicted.append(old)
            return old

        def place(chunk):
            nonlocal episodes_added
            record = live.get(chunk.id_)
            if record is None:
                record = StoredEpisode(chunk.id_)
                record.agent_id, record.module_id, record.multi_agent_episode_id = chunk.owner
                record.t_started = chunk.t_started
                live[chunk.id_] = record
                order.append(record)
                episodes_added += 1
            chunk.record = record
            pending[id(record)] += chunk.length

        if evict is not None:
            for old in [live[i] for i in evict if i in live]:
                timesteps -= drop(old).length
            for chunk in chunks:
                timesteps += chunk.length
                added += chunk.length
                steps_added += chunk.length
                place(chunk)
        elif not self._prioritized:
            for chunk in chunks:
                timesteps += chunk.length
                added += chunk.length
                steps_added += chunk.length
                place(chunk)
                while timesteps > self.capacity and len(order) > 1:
                    old = drop(order[0])
                    timesteps -= old.length + pending[id(old)]
        else:
            new_ids = [chunk.id_ for chunk in chunks]
            timesteps += sum(chunk.length for chunk in chunks)
            added += sum(chunk.length for chunk in chunks)
            evicted_ids = set()
            while timesteps > self.capacity and order and len((set(live) | set(new_ids)) - evicted_ids) != 1:
                old = drop(order[0])
                evicted_ids.add(old.id_)
                if old.id_ in new_ids:  # RLlib takes back the first new chunk of an episode it evicts
                    first = chunks[new_ids.index(old.id_)].length
                    timesteps -= first
                    added -= first
                timesteps -= old.length
            for chunk in chunks:
                if chunk.id_ in evicted_ids:
                    continue
                place(chunk)
                steps_added += chunk.length
        gone = {id(record) for record in evicted}
        written = [chunk for chunk in chunks if id(chunk.record) not in gone]
        return _Plan(order, live, written, evicted, pending, timesteps, added, episodes_added, steps_added,
                     sum(record.length + pending[id(record)] for record in evicted))

    def add(self, episodes: Union[list, SingleAgentEpisode]) -> None:
        start = time.perf_counter()
        chunks = [self._chunk(episode) for episode in force_list(episodes) if len(episode) > 0]
        if not chunks:
            return
        plan = self._prepare(chunks)
        self._commit(plan)
        self._log_add(plan.steps_added, plan.episodes_added, len(plan.evicted), plan.steps_evicted)
        self.timings["add"] += time.perf_counter() - start

    def _prepare(self, chunks: list, evict: Optional[list] = None) -> "_Plan":
        """Everything an add does, checked and laid out, with nothing changed yet (``_commit`` applies it): the
        columns against the stored spec, RLlib's eviction (``_plan``), where each step goes and whether every step
        kept is still in the ring afterwards."""
        name = self._name
        spec = self._spec or (ExperienceSpec.from_structs({k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
                                                           for k, v in chunks[0].columns.items()}) if chunks else None)
        for chunk in chunks:
            self._check_spec(spec, chunk)
        plan = self._plan(chunks, evict)
        item, segments, rows, patches = self._items, collections.defaultdict(list), [], []
        for chunk in plan.written:
            record = chunk.record
            before = record.segments + segments[id(record)]
            steps = np.arange(item, item + chunk.length, dtype=np.int64)
            previous = before[-1][0] + before[-1][1] - 1 if before else -1
            if before:  # the episode's last stored step now continues into this chunk
                patches.append((previous, item))
            following = np.append(steps[1:], -1)
            preceding = np.insert(steps[:-1], 0, previous)
            rows.append(np.stack([steps, following, preceding, np.full_like(steps, before[0][0] if before else item)]))
            segments[id(record)].append((item, chunk.length))
            item += chunk.length
        if plan.order:
            oldest = (plan.order[0].segments or segments[id(plan.order[0])])[0][0]
            if oldest < item - self.storage_capacity:
                raise ValueError(f"{name}.add(): after this add the buffer would keep {plan.timesteps} steps, the "
                                 f"oldest of episode {plan.order[0].id_!r} {item - oldest} steps back, more than the "
                                 f"{self.storage_capacity} steps it stores; {self._too_small} (nothing was added)")
        return plan._replace(spec=spec, keys=dict(chunks[0].keys) if chunks else {},
                             spaces=chunks[0].spaces if chunks else (None, None), item=item, segments=segments,
                             rows=rows, patches=patches)

    def _commit(self, plan: "_Plan") -> None:
        """Apply a prepared add: write, link, retire the evicted steps, then the host index."""
        if self._spec is None and plan.spec is not None:
            self._start(plan.spec)
            self._keys = plan.keys
        written = plan.written
        if written:
            batch = {key: np.concatenate([chunk.columns[key] for chunk in written]) for key in self._spec.names}
            ingest = self._kernel("ingest")
            for first, count in _pieces(plan.item - self._items):
                self._state = ingest(self._state, {k: v[first:first + count] for k, v in batch.items()})
            full, patch = self._link_rows(np.concatenate(plan.rows, axis=1), plan.patches)
            self._links = self._kernel("link")(self._links, full, patch)
            # each written row names its episode by the insertion index of the episode's first step, and its place
            rows = full[0][full[0] < self.storage_capacity]
            self._owner[rows] = np.concatenate(plan.rows, axis=1)[3]
            positions, reached = [], {}
            for chunk in written:
                at = reached.get(id(chunk.record), chunk.record.length)
                positions.append(np.arange(at, at + chunk.length))
                reached[id(chunk.record)] = at + chunk.length
            self._position[rows] = np.concatenate(positions)
        gone = [record.items() for record in plan.evicted if record.segments]
        if gone:
            ids = self._ids(np.concatenate(gone))
            if self._prefetched is not None:
                # a batch drawn ahead may hold a step evicted now: it is never handed over (drawn again instead)
                drawn = np.asarray(self._prefetched.ids).astype(np.int64)
                if np.isin(drawn[:, 0] << 32 | drawn[:, 1], ids[:, 0].astype(np.int64) << 32 | ids[:, 1]).any():
                    self._prefetched = None
            ids = np.concatenate([ids, np.full((compile_size(ids.shape[0]) - ids.shape[0], 2), -1, np.int32)])
            self._state = self._kernel("retire")(self._state, ids)
        for chunk in written:
            record = chunk.record
            record.length += chunk.length
            record.is_terminated, record.is_truncated = chunk.is_terminated, chunk.is_truncated
        for record in {id(chunk.record): chunk.record for chunk in written}.values():
            record.segments.extend(plan.segments[id(record)])
            self._by_first[record.segments[0][0]] = record
        for record in plan.evicted:
            if record.segments:
                self._by_first.pop(record.segments[0][0], None)
        self._order, self._live, self._items = plan.order, plan.live, plan.item
        if self.observation_space is None:
            self.observation_space, self.action_space = plan.spaces
        self._num_timesteps, self._num_timesteps_added = plan.timesteps, plan.added
        self._num_episodes_evicted += len(plan.evicted)

    def _ids(self, items) -> np.ndarray:
        return self._buffer(self.num_shards).item_ids(items)

    def _rows(self, items: np.ndarray) -> np.ndarray:
        """Ring rows of insertion indices; -1 (no step) stays -1."""
        return np.where(items >= 0, self._ids(np.maximum(items, 0))[:, 0], -1).astype(np.int32)

    def _link_rows(self, written: np.ndarray, patches: list):
        """The link kernel's arguments: for each written step [item, next, previous, episode's first] as rows, and
        the (row, next row) of each episode's last stored step that a new chunk continues; padded to powers of two
        with rows past the ring (dropped)."""
        steps = written.shape[1]
        patch_items = np.asarray(patches, np.int64).reshape(-1, 2).T
        rows = self._rows(np.concatenate([written.reshape(-1), patch_items.reshape(-1)]))  # one id lookup
        full = np.full((written.shape[0], compile_size(steps)), -1, np.int32)
        full[:, :steps] = rows[:written.size].reshape(written.shape)
        patch = np.full((2, compile_size(max(patch_items.shape[1], 1))), -1, np.int32)
        patch[:, :patch_items.shape[1]] = rows[written.size:].reshape(patch_items.shape)
        for block in (full, patch):
            block[0] = np.where(block[0] >= 0, block[0], self.storage_capacity)
        return full, patch

    def _log_add(self, steps: int, episodes_added: int, evicted: int, steps_evicted: int) -> None:
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
               beta: float = 0.0, gamma: float = 0.99, include_infos: bool = False,
               include_extra_model_outputs: bool = False, sample_episodes: Optional[bool] = False,
               to_numpy: bool = False,
               lookback: int = 0, min_batch_length_T: int = 0, **kwargs):
        start = time.perf_counter()
        name = self._name
        if num_items is not None and batch_size_B is not None:
            raise ValueError(f"{name}.sample(): pass num_items or batch_size_B, not both")
        size = num_items or batch_size_B or self.batch_size_B
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"{name}.sample(): the batch size must be an int >= 1, got {size!r}")
        if not sample_episodes and not self._prioritized:
            return self._sample_batch(size, batch_length_T or self.batch_length_T, start)
        if batch_length_T and not self._prioritized:
            return self._sample_slices(size, batch_length_T, lookback, min_batch_length_T, n_step, start)
        if batch_length_T not in (None, 0, 1) or lookback:
            raise NotImplementedError(
                f"{name}.sample(): sequences of episodes (batch_length_T={batch_length_T}, lookback={lookback}) come "
                f"from ConduitEpisodeReplayBuffer (sample_episodes=True with batch_length_T >= 1); RLlib's "
                f"prioritized buffer samples none either, and lookback applies to sequences only")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not np.isfinite(beta) or beta < 0:
            raise ValueError(f"{name}.sample(): beta must be a finite number >= 0, got {beta!r}")
        if self._num_timesteps == 0:
            raise ValueError(f"{name}.sample(): the buffer is empty; add() episodes first")
        request = _Request(size, self._n_range(n_step), float(beta), float(gamma))
        drawn, resamples = self._take(request)
        self._log_sample(size, float(np.mean(n_step)) if isinstance(n_step, (tuple, list)) else float(n_step or 1),
                         resamples)
        if self.deliver == "torch":
            out = ConduitBatch(self._public(drawn.columns, include_infos, include_extra_model_outputs),
                               DEFAULT_MODULE_ID, size)
        else:
            out = self._episodes(drawn, to_numpy, include_infos, include_extra_model_outputs)
        self._handed_at = time.perf_counter()
        self.timings["sample"] += self._handed_at - start
        return out

    def _take(self, request: _Request) -> tuple[_Drawn, int]:
        """The batch for ``request``: the one drawn ahead if it was drawn for the same request, else drawn now
        (again while too few windows fit, RLlib's resampling); then the next one drawn ahead as the schedule says.
        Returns the batch and the number of extra draws."""
        drawn, self._prefetched = self._prefetched, None
        if drawn is not None:
            waited = self._wait_for(drawn)
            if self.schedule == "adaptive":
                self._ahead = adaptive_choice(self._ahead, waited, self._learner_s, self._deferred_run)
            if not self._fitted(drawn) or drawn.request != request:
                drawn = None  # drawn for another request (or short of fitting windows): draw now
        attempt, parts, found = 0, [], 0  # parts: (draw, its first rows that fit), while no draw alone has enough
        while drawn is None:
            candidate = self._draw(request)
            if self._fitted(candidate) and not parts:
                drawn = candidate
                break
            take = min(int(candidate.fitting), request.size - found)
            if take:
                parts.append((candidate, take))
                found += take
            if found == request.size:
                drawn = _joined(parts)
            elif attempt == 63 or (attempt == 0 and not any(record.length >= request.n_range[0]
                                                            for record in self._order)):
                low, high = request.n_range  # 64 kernels, or (checked once) no episode is long enough
                raise ValueError(f"{self._name}.sample(): {attempt + 1} draw kernel(s) found {found} of the "
                                 f"{request.size} steps asked for with n_step={low if low == high else (low, high + 1)}"
                                 f" more steps in their episode; sample a smaller n_step or add longer episodes")
            attempt += 1
        self._last_ids = drawn.ids
        self._last_request = request
        self.sampled_timesteps += request.size
        if self._ahead == "deferred" or (self._ahead == "overlap" and not self._prioritized):
            self._prefetched = self._draw(request)  # runs while the learner updates (async dispatch)
            self._ahead_counts["after_sample"] += 1
        self._deferred_run = self._deferred_run + 1 if self._ahead == "deferred" else 0
        return drawn, attempt

    def _fitted(self, drawn: _Drawn) -> bool:
        """Whether ``drawn`` has enough fitting windows (waits for its kernel). What share of its candidates fitted
        sizes the next draws of its n-step range: smoothed, or at once the observed share when too few fitted."""
        enough, observed = bool(drawn.enough), int(drawn.fitting) / drawn.candidates
        smoothed = 0.5 * self._fit_share.get(drawn.request.n_range, 1.0) + 0.5 * observed
        self._fit_share[drawn.request.n_range] = smoothed if enough else min(smoothed, observed)
        return enough

    def _wait_for(self, drawn: _Drawn) -> float:
        """Seconds spent waiting for the kernel of a batch drawn ahead (0 when it had finished)."""
        if drawn.enough.is_ready():
            return 0.0
        start = time.perf_counter()
        drawn.enough.block_until_ready()
        self._ahead_counts["waited"] += 1
        return time.perf_counter() - start

    def _sample_batch(self, size: int, length: int, start: float) -> dict:
        """RLlib's ``EpisodeReplayBuffer`` batch of ``size`` rows of ``length`` entries (NumPy, as RLlib returns it)."""
        name = self._name
        if not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"{name}.sample(): batch_length_T must be an int >= 1, got {length!r}")
        if self._num_timesteps == 0:
            raise ValueError(f"{name}.sample(): the buffer is empty; add() episodes first")
        padded = size + (-size) % self.num_shards
        self._state, out = self._kernel("sequences", padded, int(length))(self._state, self._links,
                                                                          np.uint32(self.seed), np.uint32(self._draws))
        self._draws += 1
        out = _exact_values({k: v[:size] for k, v in _to_host(out).items()}, 0.0)
        self.sampled_timesteps += size * length
        self._log_sample(size * length, None, 0)
        self.timings["sample"] += time.perf_counter() - start
        return out

    def _sample_slices(self, size: int, length, lookback, min_length, n_step, start: float) -> list:
        """RLlib's ``EpisodeReplayBuffer._sample_episodes`` with ``batch_length_T``: episode slices from uniformly
        drawn steps, until the slices' lengths + 1 add up to ``size`` (RLlib's count)."""
        name = self._name
        for key, value, low in (("batch_length_T", length, 1), ("lookback", lookback, 0),
                                ("min_batch_length_T", min_length, 0)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}.sample(): {key} must be an int >= {low}, got {value!r}")
        if n_step not in (None, 1):
            raise ValueError(f"{name}.sample(): sequences (batch_length_T={length}) take n_step=1, as RLlib's, got "
                             f"{n_step!r}")
        if self._num_timesteps == 0:
            raise ValueError(f"{name}.sample(): the buffer is empty; add() episodes first")
        if min_length and not any(record.length > min_length for record in self._order):
            raise ValueError(f"{name}.sample(): no stored episode is longer than min_batch_length_T={min_length} "
                             f"steps, so no sequence can start (the longest has "
                             f"{max(record.length for record in self._order)}); add longer episodes")
        candidates = -(-size // 2)  # a slice counts >= 2 towards size
        candidates += (-candidates) % self.num_shards
        kernel = self._kernel("slices", candidates, int(lookback), int(length))
        out, counted, steps_seen, episodes_seen = [], 0, set(), set()
        while counted < size:
            self._state, rows, valid, data, end = kernel(self._state, self._links, np.uint32(self.seed),
                                                         np.uint32(self._draws))
            self._draws += 1
            rows, valid, data, end = _to_host((rows, valid, data, end))
            if not valid:
                raise ValueError(f"{name}.sample(): the buffer has no step to draw")
            data, end = _exact_values(dict(data), 0.0), _exact_values(dict(end), 0.0)
            for i in range(candidates):
                row = rows[i, lookback]
                record = self._by_first[self._owner[row]]
                t = int(self._position[row])
                if min_length and t + min_length >= record.length:
                    continue  # RLlib draws again
                episode = self._slice(record, t, i, min(lookback, t), int(np.sum(rows[i, lookback:] >= 0)),
                                      int(lookback), data, end)
                out.append(episode)
                steps_seen.add((record.id_, t))
                episodes_seen.add(record.id_)
                counted += len(episode) + 1
                if counted >= size:
                    break
        self.sampled_timesteps += size
        self._log_sample(size, len(out) / size, 0, episodes=len(episodes_seen), unique_steps=len(steps_seen))
        self.timings["sample"] += time.perf_counter() - start
        return out

    def _slice(self, record: StoredEpisode, t: int, i: int, back: int, ahead: int, lookback: int, data: dict,
               end: dict) -> SingleAgentEpisode:
        """Row ``i`` of a slices kernel's output as RLlib's ``episode.slice(slice(t, t + ahead),
        len_lookback_buffer=lookback)`` (the lookback clipped at the episode's first step, as RLlib clips it),
        with RLlib's ``n_step`` (1) and ``weights`` (1.0) model outputs."""
        steps = slice(lookback - back, lookback + ahead)
        infos = [k for k in data if k.startswith("info__")]
        episode = SingleAgentEpisode(
            id_=record.id_, agent_id=record.agent_id, module_id=record.module_id,
            multi_agent_episode_id=record.multi_agent_episode_id,
            observations=list(data["obs"][i, steps]) + [end["next_obs"][i]],
            observation_space=self.observation_space,
            infos=[{self._keys[k]: data[k][i, j] for k in infos} for j in range(steps.start, steps.stop)] +
            [{self._keys[k]: end["next_" + k][i] for k in infos}] if infos else None,
            actions=list(data["action"][i, steps]), action_space=self.action_space,
            rewards=list(data["reward"][i, steps]), terminated=bool(end["terminated"][i]),
            truncated=bool(end["truncated"][i]),
            extra_model_outputs={self._keys[k]: list(data[k][i, steps]) for k in data if k.startswith("extra__")},
            len_lookback_buffer=back, t_started=record.t_started + t)
        episode.to_numpy()
        episode.extra_model_outputs["n_step"] = InfiniteLookbackBuffer(np.full(ahead + lookback, 1), lookback=lookback)
        episode.extra_model_outputs["weights"] = InfiniteLookbackBuffer(np.ones(ahead + lookback), lookback=lookback)
        return episode

    def _draw(self, request: "_Request", update: Optional[tuple] = None) -> "_Drawn":
        """Dispatch one draw kernel for ``request`` (JAX runs it asynchronously; reading a result waits for it),
        after the priority update ``(ids, values)`` when one is given (in the same kernel)."""
        padded = request.size + (-request.size) % self.num_shards  # a multiple of the shard count
        low, high = request.n_range
        redraw = self._redraws and high > 1
        # PER redraws a step whose episode ends within n steps: extra candidates, as many as the share of fitting
        # windows in earlier draws asks for, so one kernel almost always has enough (more, joined, when not)
        candidates = candidate_count(padded, self._fit_share.get(request.n_range, 1.0)) if redraw else padded
        candidates += (-candidates) % self.num_shards
        static = (candidates, padded, compile_size(high), redraw)
        n = self.rng.integers(low, high + 1, size=candidates, dtype=np.int32) if low < high else \
            np.full(candidates, low, np.int32)
        args = (self._links, n, np.float32(request.beta), np.float32(request.gamma), np.uint32(self.seed),
                np.uint32(self._draws))
        if update is None:
            self._state, columns, ids, enough, fitting = self._kernel("draw", *static)(self._state, *args)
        else:
            self._state, columns, ids, enough, fitting = self._kernel("update_draw", *static)(self._state, *update,
                                                                                              *args)
        self._draws += 1
        if padded != request.size:
            columns, ids = {k: v[:request.size] for k, v in columns.items()}, ids[:request.size]
        return _Drawn(request, columns, ids, enough, fitting, candidates)

    def _n_range(self, n_step) -> tuple[int, int]:
        """The n-steps to draw from, inclusive: RLlib's ``(low, high)`` draws n in ``[low, high)``."""
        name = self._name
        if isinstance(n_step, (tuple, list)):
            if len(n_step) != 2 or not all(isinstance(x, (int, np.integer)) for x in n_step) \
                    or not 1 <= n_step[0] < n_step[1]:
                raise ValueError(f"{name}.sample(): an n_step range must be (low, high) ints with 1 <= low < high, "
                                 f"got {n_step!r}")
            return int(n_step[0]), int(n_step[1]) - 1
        n = 1 if n_step is None else n_step
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name}.sample(): n_step must be an int >= 1 or a (low, high) range, got {n_step!r}")
        return int(n), int(n)

    def _public(self, columns: dict, infos: bool, extras: bool) -> dict:
        """The train-batch columns asked for: RLlib's, plus extra_model_outputs / infos columns on request."""
        return {k: v for k, v in columns.items() if not (k.startswith(("info__", "next_info__")) and not infos)
                and not (k.startswith("extra__") and not extras) and not k.startswith(EXACT)}

    def _log_sample(self, steps: int, mean_n: Optional[float], resamples: int, episodes: int = 0,
                    unique_steps: Optional[int] = None) -> None:
        """RLlib's sample metrics; ``mean_n`` None for sequence batches (RLlib logs no n-step there); ``episodes`` and
        ``unique_steps``: the distinct episodes and steps drawn, where RLlib counts them."""
        agent, module = DEFAULT_AGENT_ID, DEFAULT_MODULE_ID
        unique = steps if unique_steps is None else unique_steps
        EpisodeReplayBuffer._update_sample_metrics(
            self, num_env_steps_sampled=steps, num_episodes_per_sample=episodes, num_env_steps_per_sample=unique,
            sampled_n_step=mean_n, num_resamples=resamples, agent_to_num_steps_sampled={agent: steps},
            agent_to_num_episodes_per_sample={agent: episodes}, agent_to_num_steps_per_sample={agent: unique},
            agent_to_sampled_n_step=None if mean_n is None else {agent: mean_n},
            agent_to_num_resamples={agent: resamples}, module_to_num_steps_sampled={module: steps},
            module_to_num_episodes_per_sample={module: episodes}, module_to_num_steps_per_sample={module: unique},
            module_to_sampled_n_step=None if mean_n is None else {module: mean_n},
            module_to_num_resamples={module: resamples})

    def _episodes(self, drawn: _Drawn, to_numpy: bool, infos: bool, extras: bool) -> list:
        """RLlib's 1-step episodes (o_t, a_t, G_t, o_{t+n}) with ``weights`` and ``n_step`` model outputs, each
        carrying its stored episode's id, agent, module and multi-agent episode."""
        host = _exact_values(_to_host(drawn.columns), drawn.request.gamma)
        rows = np.asarray(drawn.ids)[:, 0]
        records, starts = [self._by_first[first] for first in self._owner[rows]], self._position[rows]
        obs, next_obs, actions = host[Columns.OBS], host[Columns.NEXT_OBS], host[Columns.ACTIONS]
        rewards, weights, steps = host[Columns.REWARDS], host["weights"], host["n_step"]
        terminated, truncated = host[Columns.TERMINATEDS], host[Columns.TRUNCATEDS]
        extra_columns = [k for k in host if k.startswith("extra__")] if extras else []
        info_columns = [k for k in host if k.startswith("info__")] if infos else []
        out = []
        for i, record in enumerate(records):
            outputs = {"weights": [weights[i]], "n_step": [steps[i]]}
            outputs.update({self._keys[k]: [host[k][i]] for k in extra_columns})
            episode = SingleAgentEpisode(
                id_=record.id_, agent_id=record.agent_id, module_id=record.module_id,
                multi_agent_episode_id=record.multi_agent_episode_id,
                observations=[obs[i], next_obs[i]], observation_space=self.observation_space,
                infos=[{self._keys[k]: host[k][i] for k in info_columns},
                       {self._keys[k]: host["next_" + k][i] for k in info_columns}] if infos else None,
                actions=[actions[i]], action_space=self.action_space, rewards=[rewards[i]],
                terminated=bool(terminated[i]), truncated=bool(truncated[i]), extra_model_outputs=outputs,
                len_lookback_buffer=0, t_started=int(starts[i]))
            if to_numpy:
                episode.to_numpy()
            out.append(episode)
        return out

    # -- priorities ---------------------------------------------------------------------------------------------
    def update_priorities(self, priorities, module_id: Optional[str] = None) -> None:
        """New priorities ``|priorities|`` (RLlib passes TD errors) for the steps of the last ``sample()``; a step
        evicted or overwritten since is skipped."""
        name = self._name
        if not self._prioritized:
            raise NotImplementedError(f"{name} samples uniformly; use ConduitPrioritizedEpisodeReplayBuffer")
        if self._last_ids is None:
            raise ValueError(f"{name}.update_priorities(): no batch sampled since the last update")
        start = time.perf_counter()
        values = np.abs(np.asarray(priorities, dtype=np.float32).reshape(-1))
        if values.shape[0] != self._last_ids.shape[0]:
            raise ValueError(f"{name}.update_priorities(): {values.shape[0]} priorities for a batch of "
                             f"{self._last_ids.shape[0]} steps")
        if not np.all(np.isfinite(values)):
            raise ValueError(f"{name}.update_priorities(): priorities must be finite, got "
                             f"{values[~np.isfinite(values)][:4].tolist()} (nothing was updated)")
        if self._handed_at is not None:
            learner = start - self._handed_at
            self._learner_s = 0.9 * self._learner_s + 0.1 * learner if self._learner_s else learner
            self._handed_at = None
        if self._ahead == "overlap" and self._last_request is not None:
            # the next batch, drawn after this update in the same kernel; runs during the env rollout
            self._prefetched = self._draw(self._last_request, update=(self._last_ids, values))
            self._ahead_counts["after_update"] += 1
        else:
            self._state = self._kernel("update")(self._state, self._last_ids, values)
        self._last_ids = None
        self.timings["update_priorities"] += time.perf_counter() - start

    # -- sizes and metrics -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.get_num_timesteps()

    def get_num_timesteps(self, module_id: Optional[str] = None) -> int:
        return self._num_timesteps

    def get_num_episodes(self, module_id: Optional[str] = None) -> int:
        return len(self._order)

    def get_num_episodes_evicted(self, module_id: Optional[str] = None) -> int:
        return self._num_episodes_evicted

    def get_added_timesteps(self, module_id: Optional[str] = None) -> int:
        return self._num_timesteps_added

    def get_sampled_timesteps(self, module_id: Optional[str] = None) -> int:
        return self.sampled_timesteps

    def get_metrics(self):
        return self.metrics.reduce()

    def stats(self) -> dict[str, int]:
        """What RLlib's counters do not say: steps written to the ring (evicted ones included), its size, priority
        updates skipped because their step was evicted or overwritten since it was sampled, and the schedule's
        batches drawn ahead: right after a priority update (``drawn_ahead_after_update``: prioritized overlap),
        right after a ``sample()`` (``drawn_ahead_after_sample``: deferred, uniform overlap), and how many of them
        ``sample()`` had to wait for (``drawn_ahead_waited``); ``sample_kernels``: draw kernels run (one per batch,
        more when PER's redraw found too few fitting windows or a batch drawn ahead was for another request)."""
        ignored = 0 if self._state is None else int(self._state.sampler.ignored_updates)
        return {"steps_written": self._items, "storage_capacity": self.storage_capacity,
                "priority_updates_ignored": ignored, "sample_kernels": self._draws,
                **{f"drawn_ahead_{where}": count for where, count in self._ahead_counts.items()}}

    # -- state ----------------------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"capacity": self.capacity, "batch_size_B": self.batch_size_B, "alpha": self.alpha,
                "num_shards": self.num_shards, "seed": self.seed, "prioritized": self._prioritized}

    def get_state(self) -> dict[str, Any]:
        """The buffer as NumPy arrays plus JSON-able metadata: nothing pickled, nothing JAX."""
        episodes = [{"id": record.id_, "length": record.length, "terminated": record.is_terminated,
                     "truncated": record.is_truncated, "segments": np.asarray(record.segments, np.int64).reshape(-1),
                     "owner": [record.agent_id, record.module_id, record.multi_agent_episode_id],
                     "t_started": record.t_started}
                    for record in self._order]
        state = {"format": STATE_FORMAT, "version": STATE_VERSION, "config": self._config(),
                 "counters": {"num_timesteps": self._num_timesteps, "num_timesteps_added": self._num_timesteps_added,
                              "num_episodes_evicted": self._num_episodes_evicted,
                              "sampled_timesteps": self.sampled_timesteps, "items": self._items,
                              "draws": self._draws,
                              "fit_share": [[*key, share] for key, share in self._fit_share.items()]},
                 "rng": self.rng.bit_generator.state, "episodes": episodes, "spec": None, "arrays": {}}
        if self._spec is None:
            return state
        spec = self._spec
        state["spec"] = {"names": list(spec.names), "shapes": [list(s) for s in spec.shapes],
                         "dtypes": [str(d) for d in spec.dtypes], "keys": [[k, v] for k, v in self._keys.items()]}
        leaves = jax.tree_util.tree_flatten_with_path(self._state)[0]
        state["arrays"] = {jax.tree_util.keystr(path): np.array(leaf) for path, leaf in leaves}
        state["arrays"]["links"] = np.array(self._links)
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore what ``get_state`` returned (from a buffer configured the same way); checked before anything
        changes."""
        name = self._name
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
        spec = restored = links = None
        if state["spec"] is not None:
            recorded = state["spec"]
            spec = ExperienceSpec.from_structs({n: jax.ShapeDtypeStruct(tuple(s), np.dtype(d)) for n, s, d in
                                                zip(recorded["names"], recorded["shapes"], recorded["dtypes"])})
            buffer = self._buffer(self.num_shards, spec)
            template = jax.eval_shape(lambda: buffer.init(0))
            leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
            shardings = jax.tree_util.tree_leaves(buffer.shardings)
            arrays = dict(state["arrays"])
            links = np.asarray(arrays.pop("links", None))
            names = [jax.tree_util.keystr(path) for path, _ in leaves]
            if sorted(names) != sorted(arrays) or links.shape != (3, self.storage_capacity):
                raise ValueError(f"{name}.set_state(): the state's arrays {sorted(arrays)} do not match this buffer's "
                                 f"{sorted(names)} + links[3, {self.storage_capacity}]")
            restored = []
            for (path, leaf), key, sharding in zip(leaves, names, shardings):
                value = np.asarray(arrays[key])
                if value.shape != leaf.shape or value.dtype != leaf.dtype:
                    raise ValueError(f"{name}.set_state(): array {key} is {value.dtype}{list(value.shape)}, the buffer "
                                     f"expects {leaf.dtype}{list(leaf.shape)}")
                restored.append(jax.device_put(value, sharding))
            restored = jax.tree_util.tree_unflatten(treedef, restored)
        counters = state["counters"]
        self._reset()
        if spec is not None:
            self._spec, self._keys = spec, {k: v for k, v in state["spec"]["keys"]}
            self._state, self._links = restored, jnp.asarray(links.astype(np.int32))
        for saved in state["episodes"]:
            segments = [tuple(int(x) for x in pair) for pair in np.asarray(saved["segments"]).reshape(-1, 2)]
            record = StoredEpisode(saved["id"], int(saved["length"]), bool(saved["terminated"]),
                                   bool(saved["truncated"]), segments, *saved["owner"],
                                   int(saved.get("t_started", 0)))
            self._order.append(record)
            self._live[record.id_] = record
            if segments:
                self._by_first[segments[0][0]] = record
        self._num_timesteps = int(counters["num_timesteps"])
        self._num_timesteps_added = int(counters["num_timesteps_added"])
        self._num_episodes_evicted = int(counters["num_episodes_evicted"])
        self.sampled_timesteps = int(counters["sampled_timesteps"])
        self._items, self._draws = int(counters["items"]), int(counters["draws"])
        self._fit_share = {(int(low), int(high)): float(share) for low, high, share in counters.get("fit_share", [])}
        for first, record in self._by_first.items():
            items = record.items()
            kept = items >= self._items - self.storage_capacity
            rows = self._rows(items[kept])
            self._owner[rows], self._position[rows] = first, np.arange(items.size)[kept]
        self.rng.bit_generator.state = state["rng"]


class ConduitEpisodeReplayBuffer(_ConduitEpisodeBuffer, EpisodeReplayBuffer):
    """Uniform replay (RLlib's ``EpisodeReplayBuffer``) in Conduit's functional core; ``weights`` are all 1."""

    _prioritized = False


class ConduitPrioritizedEpisodeReplayBuffer(_ConduitEpisodeBuffer, PrioritizedEpisodeReplayBuffer):
    """Prioritized replay (RLlib's ``PrioritizedEpisodeReplayBuffer``) in Conduit's functional core: the sum tree,
    stratified draws, new steps at the max priority, importance weights normalised by the smallest probability."""

    _prioritized = True
    _redraws = True



# -- multi-agent --------------------------------------------------------------------------------------------------
MULTI_AGENT_STATE_FORMAT = "conduit_rllib.multi_agent_episode_replay_buffer"


class _ModuleStore(_ConduitEpisodeBuffer):
    """One module's agent steps inside a multi-agent buffer: the single-agent machinery (ring, links, draw kernel),
    with eviction decided by the multi-agent buffer, which also logs RLlib's metrics."""

    _redraws = True  # RLlib's multi-agent buffers redraw a step whose episode ends within n steps, uniform ones too

    def __init__(self, capacity: int, *, prioritized: bool, label: str, **kwargs):
        self._prioritized, self._label = prioritized, label
        super().__init__(capacity, **kwargs)

    @property
    def _name(self) -> str:
        return self._label

    @property
    def _too_small(self) -> str:
        return (f"the module's ring holds {STORAGE_FACTOR} x capacity x agents_per_module = {self.storage_capacity} "
                f"agent steps: raise capacity or agents_per_module (by default the number of the module's agents in "
                f"the first episode that had one)")

    def _log_add(self, *args) -> None:
        pass

    def _log_sample(self, *args) -> None:
        pass


class AgentSteps(NamedTuple):
    """One agent's part of a stored multi-agent episode."""

    module_id: Any
    episode_id: Any  # its single-agent episode's id
    steps: int


@dataclasses.dataclass
class StoredMultiAgentEpisode:
    """A multi-agent episode the buffer keeps (what ``buffer.episodes`` lists): its id, the env steps and agent
    steps stored, and each agent's part (``agents``: agent id -> ``AgentSteps``)."""

    id_: Any
    env_steps: int = 0
    agent_steps: int = 0
    agents: dict = dataclasses.field(default_factory=dict)

    def __len__(self) -> int:
        return self.env_steps


class _ConduitMultiAgentBuffer:
    """The shared implementation of the multi-agent buffers; the public classes below add RLlib's base class."""

    _prioritized = False

    def __init__(self, capacity: int = 10000, *, batch_size_B: int = 16, batch_length_T: int = 1,
                 metrics_num_episodes_for_smoothing: int = 100, n_step: int = 1, alpha: float = 1.0,
                 beta: float = 0.0, num_shards: int = 1, seed: int = 0, deliver: str = "episodes",
                 schedule: str = "sync", agents_per_module: Optional[int] = None, **kwargs):
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
        self.metrics = MetricsLogger(root=False)
        self._metrics_num_episodes_for_smoothing = metrics_num_episodes_for_smoothing
        self.timings = collections.defaultdict(float)  # seconds spent in add / sample / update_priorities
        self._reset()

    def _new_store(self, capacity: int, module_id, seed: int, **kwargs) -> _ModuleStore:
        return _ModuleStore(capacity, prioritized=self._prioritized, label=f"{type(self).__name__}[{module_id!r}]",
                            seed=seed, **self._store_config, **kwargs)

    def _reset(self) -> None:
        self._order: collections.deque = collections.deque()  # StoredMultiAgentEpisode, oldest first
        self._live: dict = {}  # episode id -> StoredMultiAgentEpisode
        # module id -> its store (None while none of its agents has a step) and RLlib's per-module counters
        self._modules: dict = {}
        self._counts: dict = collections.defaultdict(collections.Counter)
        self._num_timesteps = self._num_timesteps_added = self._num_episodes_evicted = 0
        self._num_agent_timesteps = self._num_agent_timesteps_added = 0
        self.sampled_timesteps = 0

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
        order, live = collections.deque(self._order), dict(self._live)
        new_ids = [episode.id_ for episode in episodes]
        timesteps = self._num_timesteps + sum(episode.env_steps() for episode in episodes)
        added = self._num_timesteps_added + sum(episode.env_steps() for episode in episodes)
        evicted = []
        while timesteps > self.capacity and order and \
                len((set(live) | set(new_ids)) - {old.id_ for old in evicted}) != 1:
            old = order.popleft()
            del live[old.id_]
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
            plans[module_id] = store._prepare([store._chunk(part) for part in parts[module_id]], evict[module_id])
        # commit: the stores, then the episode index and RLlib's counters
        for module_id in touched:  # get_module_ids() lists modules in the order they first appeared, as RLlib
            self._modules.setdefault(module_id, None)
        for module_id, store in stores.items():
            store._commit(plans[module_id])
            self._modules[module_id] = store
        metrics = self._count(kept, evicted, order, live)
        self._order, self._live = order, live
        self._num_timesteps, self._num_timesteps_added = timesteps, added
        self._num_episodes_evicted += len(evicted)
        EpisodeReplayBuffer._update_add_metrics(self, **metrics)
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
               to_numpy: bool = False, lookback: int = 0, **kwargs) -> list:
        """RLlib's independent multi-agent sample: for each module (``modules_to_sample``, default all) ``B`` of its
        agent steps as 1-step single-agent episodes (``o_t, a_t, G_t, o_(t+n)``, ``weights``, ``n_step``) carrying
        their agent, module and multi-agent episode ids; a step whose episode ends within n steps is redrawn."""
        start = time.perf_counter()
        name = type(self).__name__
        if replay_mode != "independent":
            raise NotImplementedError(f"{name}.sample(): replay_mode={replay_mode!r} is not supported yet; "
                                      f"'independent' (RLlib's default) is")
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
        out, metrics = [], collections.defaultdict(dict)
        n_range = None
        for module_id in modules:
            store = self._modules[module_id]
            n_range = n_range or store._n_range(n_step)
            drawn, resamples = store._take(_Request(int(size), n_range, float(beta), float(gamma)))
            episodes = store._episodes(drawn, to_numpy, include_infos, include_extra_model_outputs)
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
        EpisodeReplayBuffer._update_sample_metrics(
            self, num_env_steps_sampled=size * len(modules),
            num_episodes_per_sample=len({e.multi_agent_episode_id for e in out}),
            num_env_steps_per_sample=len(out), sampled_n_step=float(np.mean(list(
                metrics["module_to_sampled_n_step"].values()))),
            num_resamples=sum(metrics["module_to_num_resamples"].values()), **metrics)
        self.timings["sample"] += time.perf_counter() - start
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

    def get_metrics(self):
        return self.metrics.reduce()

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
                "episodes": [{"id": record.id_, "env_steps": record.env_steps, "agent_steps": record.agent_steps,
                              "agents": [[agent_id, *part] for agent_id, part in record.agents.items()]}
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
                                             {a: AgentSteps(m, e, int(n)) for a, m, e, n in saved["agents"]})
            self._order.append(record)
            self._live[record.id_] = record
        counters = state["counters"]
        self._num_timesteps, self._num_timesteps_added = counters["num_timesteps"], counters["num_timesteps_added"]
        self._num_episodes_evicted = counters["num_episodes_evicted"]
        self._num_agent_timesteps = counters["num_agent_timesteps"]
        self._num_agent_timesteps_added = counters["num_agent_timesteps_added"]
        self.sampled_timesteps = counters["sampled_timesteps"]


class ConduitMultiAgentEpisodeReplayBuffer(_ConduitMultiAgentBuffer, MultiAgentEpisodeReplayBuffer):
    """Uniform multi-agent replay (RLlib's ``MultiAgentEpisodeReplayBuffer``, independent sampling) in Conduit's
    functional core: one store per module; ``weights`` are all 1."""

    _prioritized = False


class ConduitMultiAgentPrioritizedEpisodeReplayBuffer(_ConduitMultiAgentBuffer,
                                                      MultiAgentPrioritizedEpisodeReplayBuffer):
    """Prioritized multi-agent replay (RLlib's ``MultiAgentPrioritizedEpisodeReplayBuffer``, independent sampling):
    one sum tree per module, new steps at the module's largest priority, weights normalised per module."""

    _prioritized = True
