"""``EpisodeStore``: the shared implementation of the Conduit RLlib buffers, one ring of steps over Conduit's
functional core. A single-agent buffer is a store plus RLlib's base class (``buffers.py``); a multi-agent buffer keeps
a store per module (``multi_agent.py``).

A store keeps the functional buffer's state in a core ``engine.Engine``, the links of its steps beside it and the
host ``EpisodeIndex``, and does what RLlib's buffer contract asks: add, sample (under a schedule), update priorities,
counts, metrics and state. An add dispatches no kernel: its rows are staged (``Engine.ingest(..., staged=True)``: a
host copy), its links and the retirement of the steps it evicts wait on the host, and the next kernel that runs
anyway (a draw) writes them all before it draws, in one dispatch: the draws are engine steps (``Engine.add_step`` /
``Engine.call``), compiled once per layout and static arguments and shared by stores configured alike in a process.
Priority updates wait in the engine too (``Engine.pend(after_staged=True)``: the kernel that writes the adds given
before an update applies it right after them, in one pass over the sum tree).

How: steps are items of a Conduit buffer (``samplers.prioritized``; ``alpha=0`` for the uniform class) in a ring of
``2 * capacity`` steps, so the steps RLlib keeps are always stored while evicted ones wait to be overwritten
(``Buffer.retire`` takes them out of sampling at once). Each step links to the next step of its episode; one
compiled kernel draws, follows the links for n-step windows (``Buffer.read``), redraws what RLlib would, and computes
the weights (``draws.py``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.utils import force_list
from ray.rllib.utils.metrics.metrics_logger import MetricsLogger

from conduit_jax import ExperienceSpec, default_mesh, engine, make_buffer, replay, samplers
from conduit_jax import schedule as schedules
from conduit_jax.delivery import Scheduler
from conduit_jax.replay import compile_size
from conduit_rllib import draws
from conduit_rllib.batch import ConduitBatch, train_columns
from conduit_rllib.draws import Drawn, Request, candidate_count, exact_values, joined, to_host
from conduit_rllib.episode_index import AddPlan, EpisodeIndex, check_columns, chunk_of, episode_slice, transitions
from conduit_rllib.metrics import BufferMetrics, LoggedMetrics

logger = logging.getLogger("conduit_rllib.buffers")  # a buffer's warnings come from its public module

STATE_FORMAT = "conduit_rllib.episode_replay_buffer"
STATE_VERSION = 4  # 4: the sampler state holds the smallest-mass tree
STORAGE_FACTOR = 2  # the ring holds this many times `capacity` steps (see the module docstring)
PRIORITY_FLOOR = 1e-12  # RLlib's smallest priority
RING_ADVICE = "the ring holds {factor} x capacity={capacity} steps: raise capacity"
_KNOWN_KWARGS = {"type", "metrics_num_episodes_for_smoothing"}
# the store's arguments that the buffer classes set: a replay_buffer_config key so named is unknown to RLlib's config
CLASS_ARGUMENTS = ("prioritized", "redraws", "label", "ring_advice", "config_ignored")
_BUFFERS: dict = {}  # (layout, sampler batch size) -> functional Buffer; the state is each buffer's own
_KERNELS: dict = {}  # layout -> the compiled kernels of its stores' engines (one cache, shared)
_TRAIN_LAYOUTS: dict = {}  # layout -> the RowLayout a deliver="torch" draw packs its columns in (draws.train_layout)


# the words RLlib's "schedule" key takes, for the core's schedules (``conduit_jax.schedule``) a store runs through
# ``delivery.Scheduler`` without a worker (RLlib calls the buffer on its own thread). RLlib's sample() asks for one
# batch at a time and may change its request (size, n_step, beta) from one call to the next, so a store draws at most
# one batch ahead (depth 1) and a batch misses at most one priority update (k 1). Adds are staged (a copy, written by
# the next draw's kernel) under every schedule, so the core's sync() runs as staged().
SCHEDULES = {"sync": schedules.staged(), "overlap": schedules.overlap(1), "deferred": schedules.deferred(1, 1),
             "adaptive": schedules.adaptive(1, 1)}


def schedule_word(schedule, where: str) -> str:
    """The word in ``SCHEDULES`` a store runs for RLlib's ``"schedule"`` key: that word, or a ``conduit_jax.schedule``
    value of ``SCHEDULES`` (``sync()`` too). ValueError naming what came and what is taken otherwise."""
    if isinstance(schedule, str) and schedule in SCHEDULES:
        return schedule
    if isinstance(schedule, schedules.Schedule):
        if schedule == schedules.sync():
            return "sync"
        for word, runs in SCHEDULES.items():
            if schedule == runs:
                return word
    taken = ", ".join(["sync()"] + [f"{s.name}({', '.join(map(str, s.arguments()))})" for s in SCHEDULES.values()])
    raise ValueError(f"{where}: schedule must be one of {tuple(SCHEDULES)} or one of the core's schedules {taken} "
                     f"(RLlib asks for one batch at a time, so a buffer draws at most one ahead and a batch misses at "
                     f"most one priority update), got {schedule!r}")


class EpisodeStore(LoggedMetrics):
    """One ring of RLlib steps in Conduit's functional core, with RLlib's buffer contract (see the module docstring).

    Besides RLlib's buffer arguments: ``prioritized`` draws by priority (else uniformly, alpha 0) and evicts by
    ``PrioritizedEpisodeReplayBuffer``'s rule; ``redraws`` redraws a step whose episode ends within n steps (RLlib's
    prioritized and multi-agent buffers do); ``label`` names the store in messages (default: its class name);
    ``ring_advice`` is what an add refused for want of ring space tells the user to change (``{factor}``,
    ``{capacity}`` and ``{storage_capacity}`` are filled in); ``config_ignored``: keys of RLlib's config that a
    buffer class set aside because they name one of these (``CLASS_ARGUMENTS``), ignored with a warning as any unknown
    key."""

    def __init__(self, capacity: int = 10000, *, batch_size_B: int = 16, batch_length_T: int = 1,
                 metrics_num_episodes_for_smoothing: int = 100, n_step: int = 1, alpha: float = 1.0,
                 beta: float = 0.0, num_shards: int = 1, seed: int = 0, deliver: str = "episodes",
                 schedule: Union[str, schedules.Schedule] = "sync", prioritized: bool = False, redraws: bool = False,
                 label: Optional[str] = None, ring_advice: str = RING_ADVICE, config_ignored: tuple = (), **kwargs):
        # RLlib's parent constructors are not run on purpose (they allocate the Python episode deque and, for PER,
        # segment trees of 2 * capacity nodes); set what RLlib code reads from a buffer
        self._prioritized, self._redraws = bool(prioritized), bool(redraws)
        self._label = name = label or type(self).__name__
        unknown = set(kwargs) - _KNOWN_KWARGS | set(config_ignored)
        if unknown:
            logger.warning("%s: ignoring unknown replay_buffer_config keys %s", name, sorted(unknown))
        if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"{name}: capacity must be an int >= 1 (steps), got {capacity!r}")
        if not isinstance(n_step, int) or n_step < 1:
            raise ValueError(f"{name}: n_step must be an int >= 1, got {n_step!r} (kept for older configs: sample() "
                             f"takes any n_step)")
        if deliver not in ("episodes", "torch"):
            raise ValueError(f"{name}: deliver must be 'episodes' or 'torch', got {deliver!r}")
        schedule = schedule_word(schedule, name)
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
        self._logged = BufferMetrics(MetricsLogger(root=False))  # RLlib's metrics (self.metrics), at less cost
        self._metrics_num_episodes_for_smoothing = metrics_num_episodes_for_smoothing
        self.observation_space = None
        self.action_space = None
        self.timings = collections.defaultdict(float)  # seconds spent in add / sample / update_priorities
        storage = STORAGE_FACTOR * self.capacity
        self.storage_capacity = storage + (-storage) % num_shards
        self._ring_advice = ring_advice.format(factor=STORAGE_FACTOR, capacity=self.capacity,
                                               storage_capacity=self.storage_capacity)
        self._reset()

    def _reset(self) -> None:
        self._index = EpisodeIndex(self.capacity, self.storage_capacity, self._prioritized)
        self.sampled_timesteps = 0
        self._draws = 0  # sample kernels run (each one's candidate pick uses its own random key)
        self._spec: Optional[ExperienceSpec] = None
        self._keys: dict = {}  # extra_model_outputs / infos column -> the key it stores
        self._engine: Optional[engine.Engine] = None  # the core's state and kernels (see the module docstring)
        self._given: set = set()  # steps given to this engine (add_step)
        self._links = None  # int32[3, ring]: see draws.py
        self._adds: list = []  # (full, patch) of draws.link for each add whose links no kernel has written yet
        self._adds_steps = 0  # the steps those adds wrote
        self._retiring: list = []  # int32[k, 2]: ids of evicted steps no kernel has retired yet
        self._last_ids = None
        # the schedule: the batches drawn ahead (for a request), where they are drawn, the deferred updates
        self._scheduler = Scheduler(SCHEDULES[self.schedule], threading.RLock(), self.storage_capacity, None,
                                    draw=self._draw, admits=lambda: len(self._index.order) > 0, pend=self._pend,
                                    refresh=lambda drawn: drawn, threaded=False, updates=self._prioritized)
        # per n-step range (PER's redraw): the share of drawn candidates whose window fitted, smoothed; sizes the
        # next draw (1.0 until a draw says otherwise)
        self._fit_share: dict = {}
        self._names: dict = {}  # (infos, extras) -> (packed layout, the columns handed over): _train_names

    @property
    def episodes(self) -> list:
        """The stored episodes, oldest first (``id_``, ``len()``, ``is_terminated``, ``is_truncated``)."""
        return list(self._index.order)

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

    def _start(self, spec: ExperienceSpec, state=None) -> None:
        """An engine over an empty state (or ``state``, checked by the engine) and empty links for ``spec``."""
        self._spec = spec
        buffer = self._buffer(self.num_shards)
        self._engine = engine.Engine(buffer.config, buffer.shardings, self.seed if state is None else None,
                                     kernels=_KERNELS.setdefault(self._layout(), {}), mirror_status=False)
        if state is not None:
            self._engine.state = state
        self._given = set()
        self._links = jnp.full((3, self.storage_capacity), -1, jnp.int32)
        self._adds_fill = draws.adds_fill(self.storage_capacity)[:, None]  # _waiting_adds' padding, per row

    _OUTPUTS = {"settle": 0, "draw": 3, "sequences": 1, "slices": 4, "gather": 1}  # after links

    def _call(self, kind: str, static: tuple, *args) -> list:
        """Run step ``kind`` for ``static`` in the engine's kernel: the pending priority updates, the staged rows,
        the adds' links and retirements (``draws.with_adds``), then the step; returns the step's outputs."""
        retires = bool(self._retiring)  # a variant without the O(capacity) retirement when nothing was evicted
        name = f"rllib_{kind}{list(static)}{'' if retires else '-kept'}"
        if name not in self._given:
            step = (lambda state, links: (state,)) if kind == "settle" else self._step(kind, static)
            # a retiring step scatters into the sum tree: the engine writes staged rows in a kernel of their own first
            self._engine.add_step(name, draws.with_adds(self._buffer(self.num_shards), step, retires),
                                  1 + self._OUTPUTS[kind], donates=(0,), rows_apart=retires)
            self._given.add(name)
        self._links, *outputs = self._engine.call(name, self._links, self._waiting_adds(), *args)
        return outputs

    def _step(self, kind: str, static: tuple):
        """The pure draw ``kind`` over the core's state and the links (``draws.py``)."""
        if kind == "draw":
            draw = draws.make_draw(self._buffer, self._spec.names, self._prioritized, *static)
            return draws.packed_draw(draw, self._train_layout(draw, static)) if self.deliver == "torch" else draw
        make = {"sequences": draws.make_sequences, "slices": draws.make_slices, "gather": draws.make_gather}[kind]
        return make(self._buffer, self._spec.names, *static)

    def _train_layout(self, draw, static: tuple):
        """The layout a deliver="torch" draw packs its columns in (the same for every draw of this layout)."""
        layout = _TRAIN_LAYOUTS.get(self._layout())
        if layout is None:
            layout = _TRAIN_LAYOUTS[self._layout()] = draws.train_layout(
                self._buffer(static[0]), draw, (3, self.storage_capacity), static[0])
        return layout

    def _train_names(self, infos: bool, extras: bool) -> tuple:
        """The packed layout of this store's deliver="torch" draws and the columns a sample asking for ``infos`` /
        ``extras`` hands over (``train_columns``), kept per request kind."""
        names = self._names.get((infos, extras))
        if names is None:
            layout = _TRAIN_LAYOUTS[self._layout()]
            names = self._names[infos, extras] = (layout, tuple(train_columns(dict.fromkeys(layout.spec.names),
                                                                              infos, extras)))
        return names

    def _waiting_adds(self) -> np.ndarray:
        """The links and retirements of the adds since the last kernel as ``draws.with_adds``' packed argument, taken:
        the three blocks padded to the staged block's rows for the widest (``engine.staged_rows``; past a ring
        ``compile_size``), with rows past the ring (links, dropped) and -1 ids (retire, ignored). The written steps'
        links are as many as the staged rows, patches and retirements mostly fewer: one variant per staged bucket."""
        adds, gone = self._adds, self._retiring
        self._adds, self._adds_steps, self._retiring = [], 0, []
        blocks = ([f for f, _ in adds], [p for _, p in adds], [ids.T for ids in gone])
        widths = [sum(block.shape[1] for block in parts) for parts in blocks]
        size = engine.staged_rows(max(widths), self.num_shards, self._engine.config.shard_capacity)
        size = size if size >= max(widths) else compile_size(max(widths))  # retirements of more than a ring
        packed = np.empty((sum(draws.ADDS_ROWS), size), np.int32)
        packed[:] = self._adds_fill
        top = 0
        for parts, width, rows in zip(blocks, widths, draws.ADDS_ROWS):
            if len(parts) == 1:
                packed[top:top + rows, :width] = parts[0]
            elif parts:
                np.concatenate(parts, axis=1, out=packed[top:top + rows, :width])
            top += rows
        return packed

    def _settle(self) -> None:
        """Write everything given so far into the state (the schedule's deferred priority updates too): one kernel,
        when anything waits."""
        self._scheduler.apply_due(everything=True)
        if self._adds or self._retiring:
            self._call("settle", ())
        elif self._engine is not None:
            self._engine.flush()

    # -- add ------------------------------------------------------------------------------------------------------
    def add(self, episodes: Union[list, SingleAgentEpisode]) -> None:
        start = time.perf_counter()
        episodes = [episode for episode in force_list(episodes) if len(episode) > 0]
        if not episodes:
            return
        plan = self.prepare(episodes)
        self.commit(plan)
        self._logged.added(self, plan.steps_added, plan.episodes_added, len(plan.evicted),
                           plan.steps_evicted)
        self.timings["add"] += time.perf_counter() - start

    def prepare(self, episodes: list, evict: Optional[list] = None) -> AddPlan:
        """Everything an add of ``episodes`` (non-empty chunks) does, checked and laid out, with nothing changed yet
        (``commit`` applies it): each chunk's columns (``chunk_of``) against the stored spec, RLlib's eviction
        (``EpisodeIndex.plan``; with ``evict``, episode ids, the caller's), where each step goes and whether every
        step kept is still in the ring afterwards."""
        name = self._label
        chunks = [chunk_of(episode, name) for episode in episodes]
        spec = self._spec or (ExperienceSpec.from_structs({k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype)
                                                           for k, v in chunks[0].columns.items()}) if chunks else None)
        for chunk in chunks:
            check_columns(name, spec, chunk)
        plan = self._index.plan(chunks, evict)
        back = self._index.reach(plan)
        if back > self.storage_capacity:
            raise ValueError(f"{name}.add(): after this add the buffer would keep {plan.timesteps} steps, the "
                             f"oldest of episode {plan.oldest.id_!r} {back} steps back, more than the "
                             f"{self.storage_capacity} steps it stores; {self._ring_advice} (nothing was added)")
        return plan._replace(spec=spec, keys=dict(chunks[0].keys) if chunks else {},
                             spaces=chunks[0].spaces if chunks else (None, None))

    def commit(self, plan: AddPlan) -> None:
        """Apply a prepared add: stage its rows, keep its links and the evicted steps' retirement for the next
        kernel (no kernel runs here), then the host index."""
        if self._spec is None and plan.spec is not None:
            self._start(plan.spec)
            self._keys = plan.keys
        written, rows = plan.written, None
        if written:
            names = self._spec.names  # in the spec's leaf order
            leaves = ([written[0].columns[key] for key in names] if len(written) == 1 else
                      [np.concatenate([chunk.columns[key] for chunk in written]) for key in names])
            count = plan.item - self._index.items
            if self._adds_steps + count > self.storage_capacity:
                self._settle()  # the waiting links would name a ring row twice (one scatter): written first
            self._engine.ingest(dict(zip(names, leaves)), count, staged=True, leaves=leaves)
            full, patch = self._link_rows(plan.links, plan.patches)
            self._adds.append((full, patch))
            self._adds_steps += full.shape[1]
            rows = full[0]
        gone = [record.items() for record in plan.evicted if record.segments]
        if gone:
            ids = self._ids(np.concatenate(gone))
            evicted = ids[:, 0].astype(np.int64) << 32 | ids[:, 1]

            def holds_evicted(drawn: Drawn) -> bool:
                held = np.asarray(drawn.ids).astype(np.int64)
                return bool(np.isin(held[:, 0] << 32 | held[:, 1], evicted).any())

            # a batch drawn ahead that holds a step evicted now is never handed over (drawn again instead)
            self._scheduler.discard(holds_evicted)
            self._retiring.append(ids)
        self._index.apply(plan, rows)
        if self.observation_space is None:
            self.observation_space, self.action_space = plan.spaces

    def _ids(self, items) -> np.ndarray:
        return self._buffer(self.num_shards).item_ids(items)

    def _rows(self, items: np.ndarray) -> np.ndarray:
        """Ring rows of insertion indices; -1 (no step) stays -1."""
        return replay.item_rows(self._engine.config, items)

    def _link_rows(self, written: np.ndarray, patches: list):
        """``draws.link``'s arguments for an add (unpadded): for each written step [item, next, previous, episode's
        first] as rows, and the (row, next row) of each episode's last stored step that a new chunk continues."""
        patch_items = np.asarray(patches, np.int64).reshape(-1, 2).T
        rows = self._rows(np.concatenate([written.reshape(-1), patch_items.reshape(-1)]))  # one id lookup
        return rows[:written.size].reshape(written.shape), rows[written.size:].reshape(patch_items.shape)

    # -- sample ---------------------------------------------------------------------------------------------------
    def sample(self, num_items: Optional[int] = None, *, batch_size_B: Optional[int] = None,
               batch_length_T: Optional[int] = None, n_step: Optional[Union[int, tuple]] = None,
               beta: float = 0.0, gamma: float = 0.99, include_infos: bool = False,
               include_extra_model_outputs: bool = False, sample_episodes: Optional[bool] = False,
               to_numpy: bool = False, lookback: int = 0, min_batch_length_T: int = 0, **kwargs):
        start = time.perf_counter()
        name = self._label
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
        if self._index.num_timesteps == 0:
            raise ValueError(f"{name}.sample(): the buffer is empty; add() episodes first")
        request = Request(size, self.n_range(n_step), float(beta), float(gamma))
        drawn, resamples = self.take(request)
        mean_n = float(np.mean(n_step)) if isinstance(n_step, (tuple, list)) else float(n_step or 1)
        self._logged.sampled(self, size, mean_n, resamples)
        if self.deliver == "torch":
            layout, names = self._train_names(bool(include_infos), bool(include_extra_model_outputs))
            out = ConduitBatch(drawn.columns[draws.PACKED], layout, names, DEFAULT_MODULE_ID, size)
        else:
            out = self.episodes_of(drawn, to_numpy, include_infos, include_extra_model_outputs)
        self.timings["sample"] += time.perf_counter() - start
        return out

    def take(self, request: Request) -> tuple[Drawn, int]:
        """The batch for ``request`` from the schedule (``delivery.Scheduler``: the one drawn ahead for the same
        request, else drawn now; the next one is drawn ahead where the schedule says), drawn again while too few
        windows fit (RLlib's resampling). Returns the batch and the number of extra draws."""
        candidate, drawn = self._scheduler.deliver(None, None, None, request=request), None
        attempt, parts, found = 0, [], 0  # parts: (draw, its first rows that fit), while no draw alone has enough
        while drawn is None:
            if attempt:
                candidate = self._draw(request)
            if self._fitted(candidate) and not parts:
                drawn = candidate
                break
            take = min(int(candidate.fitting), request.size - found)
            if take:
                parts.append((candidate, take))
                found += take
            if found == request.size:
                drawn = joined(parts)
            elif attempt == 63 or (attempt == 0 and not any(record.length >= request.n_range[0]
                                                            for record in self._index.order)):
                low, high = request.n_range  # 64 kernels, or (checked once) no episode is long enough
                raise ValueError(f"{self._label}.sample(): {attempt + 1} draw kernel(s) found {found} of the "
                                 f"{request.size} steps asked for with n_step={low if low == high else (low, high + 1)}"
                                 f" more steps in their episode; sample a smaller n_step or add longer episodes")
            attempt += 1
        self._last_ids = drawn.ids
        self.sampled_timesteps += request.size
        return drawn, attempt

    def _fitted(self, drawn: Drawn) -> bool:
        """Whether ``drawn`` has enough fitting windows (waits for its kernel). What share of its candidates fitted
        sizes the next draws of its n-step range: smoothed, or at once the observed share when too few fitted."""
        fitting, size = int(drawn.fitting), drawn.request.size
        enough, observed = fitting >= size + (-size) % self.num_shards, fitting / drawn.candidates
        smoothed = 0.5 * self._fit_share.get(drawn.request.n_range, 1.0) + 0.5 * observed
        self._fit_share[drawn.request.n_range] = smoothed if enough else min(smoothed, observed)
        return enough

    def _sample_batch(self, size: int, length: int, start: float) -> dict:
        """RLlib's ``EpisodeReplayBuffer`` batch of ``size`` rows of ``length`` entries (NumPy, as RLlib returns it)."""
        name = self._label
        if not isinstance(length, (int, np.integer)) or length < 1:
            raise ValueError(f"{name}.sample(): batch_length_T must be an int >= 1, got {length!r}")
        if self._index.num_timesteps == 0:
            raise ValueError(f"{name}.sample(): the buffer is empty; add() episodes first")
        padded = size + (-size) % self.num_shards
        out, = self._call("sequences", (padded, int(length)), draws.stream_argument(self.seed, self._draws))
        self._draws += 1
        out = exact_values({k: v[:size] for k, v in to_host(out).items()}, 0.0)
        self.sampled_timesteps += size * length
        self._logged.sampled(self, size * length, None, 0)
        self.timings["sample"] += time.perf_counter() - start
        return out

    def _sample_slices(self, size: int, length, lookback, min_length, n_step, start: float) -> list:
        """RLlib's ``EpisodeReplayBuffer._sample_episodes`` with ``batch_length_T``: episode slices from uniformly
        drawn steps, until the slices' lengths + 1 add up to ``size`` (RLlib's count)."""
        name = self._label
        for key, value, low in (("batch_length_T", length, 1), ("lookback", lookback, 0),
                                ("min_batch_length_T", min_length, 0)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}.sample(): {key} must be an int >= {low}, got {value!r}")
        if n_step not in (None, 1):
            raise ValueError(f"{name}.sample(): sequences (batch_length_T={length}) take n_step=1, as RLlib's, got "
                             f"{n_step!r}")
        if self._index.num_timesteps == 0:
            raise ValueError(f"{name}.sample(): the buffer is empty; add() episodes first")
        if min_length and not any(record.length > min_length for record in self._index.order):
            raise ValueError(f"{name}.sample(): no stored episode is longer than min_batch_length_T={min_length} "
                             f"steps, so no sequence can start (the longest has "
                             f"{max(record.length for record in self._index.order)}); add longer episodes")
        candidates = -(-size // 2)  # a slice counts >= 2 towards size
        candidates += (-candidates) % self.num_shards
        static = (candidates, int(lookback), int(length))
        spaces = (self.observation_space, self.action_space)
        out, counted, steps_seen, episodes_seen = [], 0, set(), set()
        while counted < size:
            rows, valid, data, end = self._call("slices", static, draws.stream_argument(self.seed, self._draws))
            self._draws += 1
            rows, valid, data, end = to_host((rows, valid, data, end))
            if not valid:
                raise ValueError(f"{name}.sample(): the buffer has no step to draw")
            data, end = exact_values(dict(data), 0.0), exact_values(dict(end), 0.0)
            for i in range(candidates):
                record, t = self._index.episode_at(rows[i, lookback])
                if min_length and t + min_length >= record.length:
                    continue  # RLlib draws again
                episode = episode_slice(record, t, i, min(lookback, t), int(np.sum(rows[i, lookback:] >= 0)),
                                        int(lookback), data, end, self._keys, spaces)
                out.append(episode)
                steps_seen.add((record.id_, t))
                episodes_seen.add(record.id_)
                counted += len(episode) + 1
                if counted >= size:
                    break
        self.sampled_timesteps += size
        self._logged.sampled(self, size, len(out) / size, 0, episodes=len(episodes_seen),
                             unique_steps=len(steps_seen))
        self.timings["sample"] += time.perf_counter() - start
        return out

    def _pend(self, checked: tuple) -> None:
        """Queue checked priority updates (the scheduler's deferred ones) for the next kernel."""
        self._engine.pend(checked)

    def _draw(self, request: Request, timeout=None, recycle=None) -> Drawn:
        """Dispatch one draw kernel for ``request`` (JAX runs it asynchronously; reading a result waits for it),
        after the pending priority updates and the adds given since the last kernel (the scheduler's ``draw``)."""
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
        columns, ids, fitting = self._call("draw", static, draws.draw_arguments(n, request.beta, request.gamma,
                                                                                 self.seed, self._draws))
        self._draws += 1
        if padded != request.size:
            columns, ids = {k: v[:request.size] for k, v in columns.items()}, ids[:request.size]
        return Drawn(request, columns, ids, fitting, candidates)

    def n_range(self, n_step) -> tuple[int, int]:
        """The n-steps to draw from, inclusive (``draws.n_range``)."""
        return draws.n_range(self._label, n_step)

    def episodes_of(self, drawn: Drawn, to_numpy: bool, infos: bool, extras: bool) -> list:
        """``drawn`` as RLlib's 1-step episodes (``episode_index.transitions``)."""
        host = exact_values(to_host(drawn.columns), drawn.request.gamma)
        records, starts = self._index.records_at(np.asarray(drawn.ids)[:, 0])
        return transitions(records, starts, host, self._keys, (self.observation_space, self.action_space), to_numpy,
                           infos, extras)

    def ring_rows(self, episode_id) -> np.ndarray:
        """The ring rows of a stored episode's steps, oldest first (they stay put until the episode is evicted)."""
        return self._rows(self._index.live[episode_id].items())

    def gather(self, rows: np.ndarray, steps: np.ndarray, discounts: np.ndarray) -> dict:
        """``draws.make_gather``'s columns for ring ``rows`` (int32[R]: R a ``compile_size``), after what waits."""
        return self._call("gather", (rows.shape[0], discounts.shape[1]), rows, steps, discounts)[0]

    # -- priorities ---------------------------------------------------------------------------------------------
    def update_priorities(self, priorities, module_id: Optional[str] = None) -> None:
        """New priorities ``|priorities|`` (RLlib passes TD errors) for the steps of the last ``sample()``; a step
        evicted or overwritten since is skipped."""
        name = self._label
        if not self._prioritized:
            raise NotImplementedError(f"{name} samples uniformly; use ConduitPrioritizedEpisodeReplayBuffer")
        if self._last_ids is None:
            raise ValueError(f"{name}.update_priorities(): no batch sampled since the last update")
        start = time.perf_counter()
        values = np.abs(np.asarray(priorities, dtype=np.float32).reshape(-1))
        if values.shape[0] != self._last_ids.shape[0]:
            raise ValueError(f"{name}.update_priorities(): {values.shape[0]} priorities for a batch of "
                             f"{self._last_ids.shape[0]} steps")
        if not np.isfinite(values).all():
            raise ValueError(f"{name}.update_priorities(): priorities must be finite, got "
                             f"{values[~np.isfinite(values)][:4].tolist()} (nothing was updated)")
        ids = np.asarray(self._last_ids)
        named = (ids[:, 0] >= 0) & (ids[:, 1] >= 1)  # a refused draw's -1 ids name no step (skipped, as there)
        update = (ids, values) if named.all() else (ids[named], values[named])
        # RLlib's order: an add made before this update is in the buffer first (its new steps take the largest
        # priority seen before the update; the steps it evicted are gone, their updates skipped)
        scheduler = self._scheduler
        # applied now (with the next kernel) where the schedule draws after it or does not defer, else deferred
        now = scheduler.draws_on_update or not scheduler.schedule.defer
        if self._retiring or not now:
            self._settle()
        if now:
            # right after the adds' staged rows, by the kernel that writes them (one pass over the sum tree: the rows
            # and an update in two made XLA:CPU copy every level twice), or by the next kernel
            self._engine.pend(update, after_staged=True)
        else:
            scheduler.report_update(*update)  # applied by the draw after the next sample() at the latest
        scheduler.updated()  # where the schedule draws after an update: the next batch now (during the env rollout)
        self._last_ids = None
        self.timings["update_priorities"] += time.perf_counter() - start

    # -- sizes and metrics -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.get_num_timesteps()

    def get_num_timesteps(self, module_id: Optional[str] = None) -> int:
        return self._index.num_timesteps

    def get_num_episodes(self, module_id: Optional[str] = None) -> int:
        return len(self._index.order)

    def get_num_episodes_evicted(self, module_id: Optional[str] = None) -> int:
        return self._index.num_episodes_evicted

    def get_added_timesteps(self, module_id: Optional[str] = None) -> int:
        return self._index.num_timesteps_added

    def get_sampled_timesteps(self, module_id: Optional[str] = None) -> int:
        return self.sampled_timesteps

    def stats(self) -> dict[str, int]:
        """What RLlib's counters do not say: steps written to the ring (evicted ones included), its size, priority
        updates skipped because their step was evicted or overwritten since it was sampled, and the schedule's
        batches drawn ahead: right after a priority update (``drawn_ahead_after_update``: prioritized overlap),
        right after a ``sample()`` (``drawn_ahead_after_sample``: deferred, uniform overlap), and how many of them
        ``sample()`` had to wait for (``drawn_ahead_waited``); ``sample_kernels``: draw kernels run (one per batch,
        more when PER's redraw found too few fitting windows or a batch drawn ahead was for another request)."""
        self._settle()
        ignored = 0 if self._engine is None else int(self._engine.state.sampler.ignored_updates)
        counts = self._scheduler.counts
        return {"steps_written": self._index.items, "storage_capacity": self.storage_capacity,
                "priority_updates_ignored": ignored, "sample_kernels": self._draws,
                "drawn_ahead_after_update": counts["after_update"],
                "drawn_ahead_after_sample": counts["after_delivery"], "drawn_ahead_waited": counts["waited"]}

    def compile_counts(self) -> dict[str, int]:
        """XLA compilations per kernel so far (the core engine's ``compile_counts``); a steady loop adds none."""
        return {} if self._engine is None else self._engine.compile_counts()

    # -- state ----------------------------------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"capacity": self.capacity, "batch_size_B": self.batch_size_B, "alpha": self.alpha,
                "num_shards": self.num_shards, "seed": self.seed, "prioritized": self._prioritized}

    def get_state(self) -> dict[str, Any]:
        """The buffer as NumPy arrays plus JSON-able metadata: nothing pickled, nothing JAX."""
        index = self._index
        state = {"format": STATE_FORMAT, "version": STATE_VERSION, "config": self._config(),
                 "counters": {"num_timesteps": index.num_timesteps, "num_timesteps_added": index.num_timesteps_added,
                              "num_episodes_evicted": index.num_episodes_evicted,
                              "sampled_timesteps": self.sampled_timesteps, "items": index.items,
                              "draws": self._draws,
                              "fit_share": [[*key, share] for key, share in self._fit_share.items()]},
                 "rng": self.rng.bit_generator.state, "episodes": index.saved(), "spec": None, "arrays": {}}
        if self._spec is None:
            return state
        spec = self._spec
        state["spec"] = {"names": list(spec.names), "shapes": [list(s) for s in spec.shapes],
                         "dtypes": [str(d) for d in spec.dtypes], "keys": [[k, v] for k, v in self._keys.items()]}
        self._settle()  # staged rows, pending updates, links and retirements: in the state first
        leaves = jax.tree_util.tree_flatten_with_path(self._engine.state)[0]
        state["arrays"] = {jax.tree_util.keystr(path): np.array(leaf) for path, leaf in leaves}
        state["arrays"]["links"] = np.array(self._links)
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        """Restore what ``get_state`` returned (from a buffer configured the same way); checked before anything
        changes."""
        name = self._label
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
            self._start(spec, restored)
            self._links = jnp.asarray(links.astype(np.int32))
        self.sampled_timesteps = int(counters["sampled_timesteps"])
        self._draws = int(counters["draws"])
        self._fit_share = {(int(low), int(high)): float(share) for low, high, share in counters.get("fit_share", [])}
        self._index.restore(state["episodes"], counters, self._rows)
        self.rng.bit_generator.state = state["rng"]
