"""The host-side episode index of the Conduit RLlib buffers (NumPy, no JAX): the translation between RLlib's episodes
and the steps of a ring.

* ``chunk_of``: an added episode chunk's columns, checked and narrowed to what the ring stores (a float64 column also
  bit for bit, as its ``EXACT`` twin); ``check_columns`` holds a chunk against the stored spec.
* ``EpisodeIndex``: the stored episodes in RLlib's order and RLlib's counts; RLlib's eviction rule for each class
  (``plan``); where each step goes (insertion indices, and the links to its episode's next, previous and first step);
  for each ring row its episode and its place there.
* ``transitions`` / ``episode_slice``: drawn rows as RLlib's 1-step episodes or episode slices.

Steps are numbered by insertion index (``EpisodeIndex.items``: steps ever written, the next step's index); the
functional buffer's id lookup maps an insertion index to its ring row (the store passes it in as ``rows_of``).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import gymnasium as gym
import numpy as np
from ray.rllib.core.columns import Columns
from ray.rllib.env.multi_agent_episode import MultiAgentEpisode
from ray.rllib.env.single_agent_episode import SingleAgentEpisode
from ray.rllib.env.utils.infinite_lookback_buffer import InfiniteLookbackBuffer
from ray.rllib.utils.spaces.space_utils import get_base_struct_from_space

EXACT = "exact__"  # prefix of the column that keeps a float64 column's values bit for bit
_NARROW = {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.uint64): np.dtype(np.uint32),
           np.dtype(np.float64): np.dtype(np.float32)}


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


def bits(values: np.ndarray) -> np.ndarray:
    """float64 values as their bit patterns, two uint32 words each (JAX on CPU computes in 32 bits; the words are
    only stored and gathered, so what comes back is exactly what was added)."""
    values = np.ascontiguousarray(values, np.float64)
    return values.view(np.uint32).reshape(values.shape + (2,))


def unbits(words: np.ndarray) -> np.ndarray:
    """``bits`` undone: the float64 values of their bit patterns."""
    words = np.ascontiguousarray(words, np.uint32)
    return words.view(np.float64).reshape(words.shape[:-1])


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
class Chunk:
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


def chunk_of(episode, name: str) -> Chunk:
    """An episode chunk's columns, checked (nothing is stored before every chunk of an ``add`` passed); ``name``: how
    error messages name the buffer."""
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
                columns[EXACT + column] = bits(raw[part])

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
    return Chunk(episode.id_, columns, length, bool(episode.is_terminated), bool(episode.is_truncated), origin,
                 spaces=(episode.observation_space, episode.action_space),
                 owner=(episode.agent_id, episode.module_id, episode.multi_agent_episode_id),
                 t_started=int(episode.t_started))


def check_columns(name: str, spec, chunk: Chunk) -> None:
    """``chunk``'s columns against the stored ``spec`` (an ``ExperienceSpec``: names, shapes, dtypes)."""
    if set(chunk.columns) != set(spec.names):
        raise ValueError(f"{name}.add(): episode {chunk.id_!r} has columns {sorted(chunk.columns)}, the buffer "
                         f"stores {sorted(spec.names)} (infos / extra_model_outputs keys are fixed by the first "
                         f"add; nothing was added)")
    columns = chunk.columns
    if all(columns[key].shape[1:] == shape and columns[key].dtype == dtype
           for key, shape, dtype in zip(spec.names, spec.shapes, spec.dtypes)):
        return
    # a column's bit-for-bit twin last: the message names what the user gave
    for key, shape, dtype in sorted(zip(spec.names, spec.shapes, spec.dtypes), key=lambda c: c[0].startswith(EXACT)):
        value = chunk.columns[key]
        if value.shape[1:] != tuple(shape) or value.dtype != dtype:
            raise ValueError(f"{name}.add(): episode {chunk.id_!r}: {key} is {value.dtype}{list(value.shape[1:])}"
                             f" per step, the buffer stores {dtype}{list(shape)} (nothing was added)")


class AddPlan(NamedTuple):
    """A checked add, laid out by ``EpisodeIndex.plan`` (and the store's ``prepare``) and applied by ``apply`` (and
    the store's ``commit``). It holds what changes, not a copy of the index: planning an add costs what the add
    touches, not the number of episodes stored."""

    created: list  # StoredEpisode records the add opens, in order (an evicted one too)
    oldest: Optional[StoredEpisode]  # the oldest episode kept afterwards (None: none)
    written: list  # the chunks stored (an evicted episode's new chunks are not)
    evicted: list  # StoredEpisode, in eviction order
    front: int  # how many of the oldest stored episodes are evicted (the rest of ``evicted``: given ids, or new)
    pending: dict
    timesteps: int
    added: int
    episodes_added: int
    steps_added: int
    steps_evicted: int
    spec: Any = None  # the store's ExperienceSpec (set by the store)
    keys: dict = {}
    spaces: tuple = (None, None)
    item: int = 0  # the next insertion index afterwards
    segments: dict = {}  # id(record) -> the (first item, count) chunks it gains
    links: Any = None  # int64[4, steps written]: each written step's [item, next, previous, episode's first item]
    patches: list = []  # (item, next item) of each episode's last stored step that a new chunk continues


class EpisodeIndex:
    """The stored episodes, oldest first, RLlib's counts, and where the steps are in a ring of ``storage_capacity``
    rows: for each row ``owner`` holds the insertion index of its episode's first step (``by_first`` maps it to the
    episode) and ``position`` the row's step index in its episode. ``prioritized`` picks RLlib's eviction rule."""

    def __init__(self, capacity: int, storage_capacity: int, prioritized: bool):
        self.capacity, self.storage_capacity, self.prioritized = capacity, storage_capacity, prioritized
        self.order: collections.deque = collections.deque()  # StoredEpisode, oldest first
        self.live: dict = {}  # episode id -> StoredEpisode
        self.num_timesteps = 0
        self.num_timesteps_added = 0
        self.num_episodes_evicted = 0
        self.items = 0  # steps ever written to the ring (the next step's insertion index)
        self.owner = np.full(storage_capacity, -1, np.int64)
        self.position = np.zeros(storage_capacity, np.int64)
        self.by_first: dict = {}

    def plan(self, chunks: list, evict: Optional[list] = None) -> AddPlan:
        """RLlib's eviction, planned over the index as it is (nothing changes), then where each written step goes.
        The uniform buffer follows ``EpisodeReplayBuffer.add`` (evict after each episode while more than ``capacity``
        steps and more than one episode are stored), the prioritized one ``PrioritizedEpisodeReplayBuffer.add`` (count
        every new step first, evict while over capacity and more than one episode would remain, drop the new chunks
        of an evicted episode). With ``evict`` (episode ids) the caller decided: those episodes go, nothing else does
        (the multi-agent buffers' rule). Both rules evict the oldest first, so the plan keeps how many of the stored
        episodes go from the front and which episodes it opens."""
        order, live = self.order, self.live
        created, opened, gone = [], {}, set()  # opened: id -> record this add opens; gone: ids evicted
        pending = collections.defaultdict(int)  # id(record) -> steps this add gives it
        timesteps, added = self.num_timesteps, self.num_timesteps_added
        evicted, episodes_added, steps_added = [], 0, 0
        front = 0  # stored episodes evicted from the front
        taken = 0  # opened episodes evicted from the front of ``created`` (after every stored one)

        def oldest():
            if front < len(order):
                return order[front]
            return created[taken] if taken < len(created) else None

        def count() -> int:
            return len(order) - front + len(created) - taken

        def drop_oldest():
            nonlocal front, taken
            old = oldest()
            if front < len(order):
                front += 1
            else:
                taken += 1
            drop(old)
            return old

        def drop(old):
            gone.add(old.id_)
            if opened.get(old.id_) is old:
                del opened[old.id_]
            evicted.append(old)

        def place(chunk):
            nonlocal episodes_added
            record = opened.get(chunk.id_)
            if record is None and chunk.id_ not in gone:
                record = live.get(chunk.id_)
            if record is None:
                record = StoredEpisode(chunk.id_)
                record.agent_id, record.module_id, record.multi_agent_episode_id = chunk.owner
                record.t_started = chunk.t_started
                opened[chunk.id_] = record
                created.append(record)
                episodes_added += 1
            chunk.record = record
            pending[id(record)] += chunk.length

        if evict is not None:
            for old in [live[i] for i in dict.fromkeys(evict) if i in live]:
                drop(old)
                timesteps -= old.length
            for chunk in chunks:
                timesteps += chunk.length
                added += chunk.length
                steps_added += chunk.length
                place(chunk)
            first = next((record for record in order if record.id_ not in gone), created[0] if created else None)
        else:
            if not self.prioritized:
                for chunk in chunks:
                    timesteps += chunk.length
                    added += chunk.length
                    steps_added += chunk.length
                    place(chunk)
                    while timesteps > self.capacity and count() > 1:
                        old = drop_oldest()
                        timesteps -= old.length + pending[id(old)]
            else:
                new_ids = [chunk.id_ for chunk in chunks]
                timesteps += sum(chunk.length for chunk in chunks)
                added += sum(chunk.length for chunk in chunks)
                # the distinct episodes stored or added; evicting one leaves one fewer (only stored ones go here)
                distinct = len(live) + len({i for i in new_ids if i not in live})
                while timesteps > self.capacity and front < len(order) and distinct - len(gone) != 1:
                    old = drop_oldest()
                    if old.id_ in new_ids:  # RLlib takes back the first new chunk of an episode it evicts
                        taken_back = chunks[new_ids.index(old.id_)].length
                        timesteps -= taken_back
                        added -= taken_back
                    timesteps -= old.length
                for chunk in chunks:
                    if chunk.id_ in gone:
                        continue
                    place(chunk)
                    steps_added += chunk.length
            first = oldest()
        dropped = {id(record) for record in evicted}
        # (a prioritized add skips the new chunks of an episode it evicts: they have no record)
        written = [chunk for chunk in chunks if chunk.record is not None and id(chunk.record) not in dropped]
        plan = AddPlan(created, first, written, evicted, front, pending, timesteps, added, episodes_added,
                       steps_added, sum(record.length + pending[id(record)] for record in evicted))
        return self._lay_out(plan)

    def _lay_out(self, plan: AddPlan) -> AddPlan:
        """Insertion indices of the written steps and their links within their episodes."""
        item, segments, patches = self.items, collections.defaultdict(list), []
        total = sum(chunk.length for chunk in plan.written)
        links = np.empty((4, total), np.int64)
        links[0] = np.arange(item, item + total)
        links[1] = links[0] + 1
        links[2] = links[0] - 1
        at = 0
        for chunk in plan.written:
            record = chunk.record
            before = record.segments + segments[id(record)]
            end = at + chunk.length
            links[1, end - 1] = -1
            if before:  # the episode's last stored step now continues into this chunk
                previous = before[-1][0] + before[-1][1] - 1
                patches.append((previous, item))
            else:
                previous = -1
            links[2, at] = previous
            links[3, at:end] = before[0][0] if before else item
            segments[id(record)].append((item, chunk.length))
            item += chunk.length
            at = end
        return plan._replace(item=item, segments=segments, links=links, patches=patches)

    @staticmethod
    def reach(plan: AddPlan) -> int:
        """How far back from the next insertion index the oldest step kept after ``plan`` lies (0: none kept); more
        than the ring holds means the add would overwrite a step RLlib keeps."""
        oldest = plan.oldest
        if oldest is None:
            return 0
        return plan.item - (oldest.segments or plan.segments[id(oldest)])[0][0]

    def apply(self, plan: AddPlan, rows: np.ndarray) -> None:
        """Make ``plan`` the index; ``rows``: the ring rows of its written steps, in order."""
        written = plan.written
        if written:
            # each written row names its episode by the insertion index of the episode's first step, and its place
            self.owner[rows] = plan.links[3]
            positions, reached = [], {}
            for chunk in written:
                at = reached.get(id(chunk.record), chunk.record.length)
                positions.append(np.arange(at, at + chunk.length))
                reached[id(chunk.record)] = at + chunk.length
            self.position[rows] = positions[0] if len(positions) == 1 else np.concatenate(positions)
        for chunk in written:
            record = chunk.record
            record.length += chunk.length
            record.is_terminated, record.is_truncated = chunk.is_terminated, chunk.is_truncated
        for record in {id(chunk.record): chunk.record for chunk in written}.values():
            record.segments.extend(plan.segments[id(record)])
            self.by_first[record.segments[0][0]] = record
        evicted = plan.evicted
        if evicted:
            for _ in range(plan.front):
                self.order.popleft()
            if len(evicted) > plan.front:  # given ids (anywhere in the order) or episodes this add opened
                dropped = {id(record) for record in evicted[plan.front:]}
                self.order = collections.deque(record for record in self.order if id(record) not in dropped)
            for record in evicted:
                if self.live.get(record.id_) is record:
                    del self.live[record.id_]
                if record.segments:
                    self.by_first.pop(record.segments[0][0], None)
        dropped = {id(record) for record in evicted}
        for record in plan.created:
            if id(record) not in dropped:
                self.order.append(record)
                self.live[record.id_] = record
        self.items = plan.item
        self.num_timesteps, self.num_timesteps_added = plan.timesteps, plan.added
        self.num_episodes_evicted += len(evicted)

    def records_at(self, rows) -> tuple[list, np.ndarray]:
        """The stored episode of each ring row in ``rows``, and the row's step index in it."""
        return [self.by_first[first] for first in self.owner[rows]], self.position[rows]

    def episode_at(self, row) -> tuple[StoredEpisode, int]:
        """The stored episode of one ring row, and the row's step index in it."""
        return self.by_first[self.owner[row]], int(self.position[row])

    def saved(self) -> list:
        """The episodes as ``get_state`` keeps them (JSON-able, segments as int64 arrays)."""
        return [{"id": record.id_, "length": record.length, "terminated": record.is_terminated,
                 "truncated": record.is_truncated, "segments": np.asarray(record.segments, np.int64).reshape(-1),
                 "owner": [record.agent_id, record.module_id, record.multi_agent_episode_id],
                 "t_started": record.t_started}
                for record in self.order]

    def restore(self, episodes: list, counters: dict, rows_of: Callable[[np.ndarray], np.ndarray]) -> None:
        """Fill an empty index from ``saved()``'s episodes and ``get_state``'s counters; ``rows_of``: the ring rows of
        insertion indices."""
        for saved in episodes:
            segments = [tuple(int(x) for x in pair) for pair in np.asarray(saved["segments"]).reshape(-1, 2)]
            record = StoredEpisode(saved["id"], int(saved["length"]), bool(saved["terminated"]),
                                   bool(saved["truncated"]), segments, *saved["owner"],
                                   int(saved.get("t_started", 0)))
            self.order.append(record)
            self.live[record.id_] = record
            if segments:
                self.by_first[segments[0][0]] = record
        self.num_timesteps = int(counters["num_timesteps"])
        self.num_timesteps_added = int(counters["num_timesteps_added"])
        self.num_episodes_evicted = int(counters["num_episodes_evicted"])
        self.items = int(counters["items"])
        for first, record in self.by_first.items():
            items = record.items()
            kept = items >= self.items - self.storage_capacity
            rows = rows_of(items[kept])
            self.owner[rows], self.position[rows] = first, np.arange(items.size)[kept]


def transitions(records: list, starts: np.ndarray, host: dict, keys: dict, spaces: tuple, to_numpy: bool,
                infos: bool, extras: bool) -> list:
    """RLlib's 1-step episodes (o_t, a_t, G_t, o_{t+n}) with ``weights`` and ``n_step`` model outputs from a drawn
    batch's host columns, each carrying its stored episode's id, agent, module and multi-agent episode (``records``,
    the drawn steps' places ``starts``); ``keys``: column -> the infos / extra_model_outputs key it stores.

    Each is the episode RLlib's own buffer returns, ``SingleAgentEpisode(observations=[o_t, o_{t+n}], actions=[a_t],
    rewards=[G_t], ..., len_lookback_buffer=0)`` (``.to_numpy()``'d when ``to_numpy``), attribute for attribute
    (``OneStepEpisodes``); built without the constructor's checks and space lookups, which cost most of a sample."""
    observation_space, action_space = spaces
    obs, next_obs, actions = host[Columns.OBS], host[Columns.NEXT_OBS], host[Columns.ACTIONS]
    rewards, weights, steps = host[Columns.REWARDS], host["weights"], host["n_step"]
    terminated, truncated = host[Columns.TERMINATEDS], host[Columns.TRUNCATEDS]
    extra_columns = [k for k in host if k.startswith("extra__")] if extras else []
    info_columns = [k for k in host if k.startswith("info__")] if infos else []
    build = OneStepEpisodes(observation_space, action_space)
    pairs = np.stack([obs, next_obs], axis=1)  # [B, 2, ...]: each episode's two observations
    outputs = {"weights": weights, "n_step": steps, **{keys[k]: host[k] for k in extra_columns}}
    out = []
    for i, record in enumerate(records):
        out.append(build(
            record, i, pairs, actions, rewards, outputs, bool(terminated[i]), bool(truncated[i]), int(starts[i]),
            [{keys[k]: host[k][i] for k in info_columns}, {keys[k]: host["next_" + k][i] for k in info_columns}]
            if infos else [{}, {}], to_numpy))
    return out


# What RLlib 2.60's constructor and ``to_numpy`` set on a ``SingleAgentEpisode`` and an ``InfiniteLookbackBuffer``;
# ``OneStepEpisodes`` sets exactly these, and falls back to the constructor for any other RLlib (or a space whose
# structure is nested, where the buffers' space structs are built per buffer).
EPISODE_SLOTS = frozenset({
    "actions", "agent_id", "extra_model_outputs", "id_", "infos", "is_terminated", "is_truncated", "module_id",
    "multi_agent_episode_id", "observations", "rewards", "t", "t_started", "_action_space", "_last_added_observation",
    "_last_added_infos", "_last_step_time", "_observation_space", "_start_time", "_custom_data"})
REWARDS_SPACE = gym.spaces.Box(float("-inf"), float("inf"), (), np.float32)  # the rewards buffer's, as RLlib sets it


class OneStepEpisodes:
    """Builds RLlib's 1-step ``SingleAgentEpisode`` (two observations, one action, reward and set of model outputs,
    no lookback) for row ``i`` of a drawn batch: the slots RLlib's constructor sets (and ``to_numpy`` finalises),
    set directly. ``tests/test_rllib_adapter.py`` holds every slot and buffer attribute against the constructor's."""

    def __init__(self, observation_space, action_space):
        self.spaces = {"obs": observation_space, "action": action_space, "reward": REWARDS_SPACE, "none": None}
        self.structs = {name: get_base_struct_from_space(space) for name, space in self.spaces.items()}
        self.direct = set(getattr(SingleAgentEpisode, "__slots__", ())) == EPISODE_SLOTS and all(
            struct is space for struct, space in ((self.structs["obs"], observation_space),
                                                   (self.structs["action"], action_space)))

    def __call__(self, record, i: int, pairs, actions, rewards, outputs: dict, terminated: bool, truncated: bool,
                 t_started: int, infos: list, to_numpy: bool) -> SingleAgentEpisode:
        if not self.direct:
            episode = SingleAgentEpisode(
                id_=record.id_, agent_id=record.agent_id, module_id=record.module_id,
                multi_agent_episode_id=record.multi_agent_episode_id, observations=list(pairs[i]),
                observation_space=self.spaces["obs"], infos=infos, actions=[actions[i]],
                action_space=self.spaces["action"], rewards=[rewards[i]], terminated=terminated,
                truncated=truncated, extra_model_outputs={k: [v[i]] for k, v in outputs.items()},
                len_lookback_buffer=0, t_started=t_started)
            return episode.to_numpy() if to_numpy else episode
        # finalised (to_numpy): each buffer's data is the batch of its one or two items, RLlib's ``batch`` of them
        # (np.stack: the rows of the drawn columns); else the items as a list
        rows = slice(i, i + 1)
        episode = object.__new__(SingleAgentEpisode)
        episode.id_, episode.agent_id, episode.module_id = record.id_, record.agent_id, record.module_id
        episode.multi_agent_episode_id = record.multi_agent_episode_id
        episode.observations = self._buffer(pairs[i] if to_numpy else list(pairs[i]), "obs")
        episode._observation_space = self.spaces["obs"]
        episode.infos = self._buffer(infos, "none")  # never finalised
        episode.actions = self._buffer(actions[rows] if to_numpy else [actions[i]], "action")
        episode._action_space = self.spaces["action"]
        episode.rewards = self._buffer(rewards[rows] if to_numpy else [rewards[i]], "reward")
        episode.is_terminated, episode.is_truncated = terminated, truncated
        episode.extra_model_outputs = {k: self._buffer(v[rows] if to_numpy else [v[i]], "none")
                                       for k, v in outputs.items()}
        episode.t_started, episode.t = t_started, t_started + 1
        episode._custom_data = {}
        episode._start_time = episode._last_step_time = None
        episode._last_added_observation = episode._last_added_infos = None
        return episode

    def _buffer(self, data, space: str) -> InfiniteLookbackBuffer:
        buffer = object.__new__(InfiniteLookbackBuffer)
        # the attributes in the order the constructor sets them
        buffer.__dict__ = {"data": data, "lookback": 0, "finalized": not isinstance(data, list),
                           "_space": self.spaces[space], "_space_struct": self.structs[space]}
        return buffer


def episode_slice(record: StoredEpisode, t: int, i: int, back: int, ahead: int, lookback: int, data: dict, end: dict,
                  keys: dict, spaces: tuple) -> SingleAgentEpisode:
    """Row ``i`` of a slices kernel's host output as RLlib's ``episode.slice(slice(t, t + ahead),
    len_lookback_buffer=lookback)`` (the lookback clipped at the episode's first step, as RLlib clips it: ``back``
    steps), with RLlib's ``n_step`` (1) and ``weights`` (1.0) model outputs."""
    steps = slice(lookback - back, lookback + ahead)
    infos = [k for k in data if k.startswith("info__")]
    episode = SingleAgentEpisode(
        id_=record.id_, agent_id=record.agent_id, module_id=record.module_id,
        multi_agent_episode_id=record.multi_agent_episode_id,
        observations=list(data["obs"][i, steps]) + [end["next_obs"][i]],
        observation_space=spaces[0],
        infos=[{keys[k]: data[k][i, j] for k in infos} for j in range(steps.start, steps.stop)] +
        [{keys[k]: end["next_" + k][i] for k in infos}] if infos else None,
        actions=list(data["action"][i, steps]), action_space=spaces[1],
        rewards=list(data["reward"][i, steps]), terminated=bool(end["terminated"][i]),
        truncated=bool(end["truncated"][i]),
        extra_model_outputs={keys[k]: list(data[k][i, steps]) for k in data if k.startswith("extra__")},
        len_lookback_buffer=back, t_started=record.t_started + t)
    episode.to_numpy()
    episode.extra_model_outputs["n_step"] = InfiniteLookbackBuffer(np.full(ahead + lookback, 1), lookback=lookback)
    episode.extra_model_outputs["weights"] = InfiniteLookbackBuffer(np.ones(ahead + lookback), lookback=lookback)
    return episode
