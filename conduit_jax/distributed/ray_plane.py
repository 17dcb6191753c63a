"""Shards as Ray actors: ``ShardServer`` hosts an ``ExperienceDataPlane`` over its node's devices; the driver-side
``DistributedPlane`` has the local plane's API (``ingest``, ``sample`` / ``deliver``, ``update_priorities``, ``stats``,
``save`` / ``restore``) over several of them.

Ingestion. A batch goes whole to one shard: a shard on the producer's node when there is one (``node_id``, default the
caller's node), else the next live shard round robin. Calls are pipelined (at most ``max_pending_ingests`` in flight);
a batch whose shard died before acknowledging it is sent to another shard, never dropped silently.

Sampling is globally correct across actors. The driver knows each live shard's mass (item count for uniform sampling,
sum-tree root for prioritized), refreshed by the replies of every call it makes (one round trip to all shards when
nothing is known yet); it splits the batch over shards by a stratified (or multinomial) draw over the masses, so shard
``a`` is asked for ``n_a`` items with E[n_a] = B * M_a / M, and each shard draws its share from its own distribution
(uniform over its items, or p_i^alpha / M_a). An item's probability per draw is then (M_a / M) * (p_i^alpha / M_a) =
p_i^alpha / M, the declared distribution over the union. Importance weights use the global item count N and the
probabilities the split actually used: w_i = (N * (M_a / M) * p_i^alpha / M_a_now)^-beta, normalised by the batch
maximum (M_a_now is the shard's mass when it drew, equal to M_a unless it changed in between). One request is one
actor call per shard with a nonzero share; ``deliver()`` keeps ``prefetch`` requests in flight, so shard round trips
run while the learner computes. With prefetch the split uses the masses known when the request is issued (the
replies of earlier calls; ingests and priority updates still in flight are not waited for): a shard's freshly
ingested items join the distribution one request later. ``sample()`` waits for them (exact masses).

Transport. A shard returns its share as one packed ``uint32[n_a, row_words + 3]`` array (the item rows as the plane
stores them, plus row, generation and sum-tree leaf columns) through Ray's object store; the driver reads the replies
zero-copy, copies them once into a 64-byte-aligned staging array with the actor, incarnation and weight columns, and
makes one ``jax.device_put`` (aliased, not copied, on CPU) followed by one jitted unpack into the spec's pytree.

Ids. ``Delivery.ids`` is ``int32[B, 4]``: (actor, incarnation, row, generation). ``update_priorities`` routes each id to
its actor; ids of an earlier incarnation of a restarted actor (a "lost shard generation"), or of an actor that is down,
are ignored and counted (``stats()['priority_updates_lost_shard']``), never applied to what now sits in that slot.

Fault tolerance. Each shard snapshots its plane to its own checkpoint directory (``conduit_jax.checkpoint``, async
orbax writes) every ``checkpoint_every_s`` seconds / ``checkpoint_every_items`` items, and keeps a small JSON record
(``shard.json``: incarnation, items ever inserted, items lost) that it rewrites after every ingest. With
``durable=True`` (the default) it also appends every ingested batch to a write-ahead log (``wal.py``) before it
acknowledges the ingest. Ray restarts a dead shard (``max_restarts``); its constructor restores the newest finished
checkpoint and replays the log from there, so an acknowledged item survives the crash of its shard's process. The
log is not fsynced per ingest by default, so a crash of the whole host can lose what the OS had not written yet;
``durable="fsync"`` flushes each logged batch to the disk before the acknowledgement and survives that too. With
``durable=False`` the items ingested since that checkpoint are lost; either way the shard counts what it could not
bring back (recorded inserted - restored inserted) and reports it. While a
shard is down the driver samples from the live shards only (``stats()['degraded']``; the distribution is then the
declared one over the live shards' items) and routes ingests elsewhere; it probes the shard and takes it back when it
answers. For multi-node clusters the checkpoint directory must be on storage every node sees (a restarted actor may
land on another node).

Threading: a ``DistributedPlane`` is driven from one thread (the learner's).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
import tempfile
import time
import warnings
from typing import Any, Optional, Sequence

import numpy as np

from conduit_jax.errors import ConduitError, ConduitWarning, ConfigError, NotEnoughDataError, PriorityError
from conduit_jax import engine
from conduit_jax.replay import Delivery, compile_size
from conduit_jax.spec import ExperienceSpec, checked_priorities

SUPPORTED_SAMPLERS = ("uniform", "prioritized")
ID_COLUMNS = ("actor", "incarnation", "row", "generation")
META_FILE = "shard.json"
WAL_DIR = "wal"  # the shard's write-ahead log of acknowledged ingests (wal.py)
MANIFEST = "distributed.json"


class ShardUnavailableError(ConduitError):
    """No live shard actor can take the call (all are down or restarting)."""


# ------------------------------------------------------------------------------------------------------------------
# Pure helpers (no ray): the split of a batch over shards and the ingest route
# ------------------------------------------------------------------------------------------------------------------
def split_counts(batch_size: int, masses, rng: np.random.Generator, method: str = "stratified") -> np.ndarray:
    """How many of ``batch_size`` draws each shard makes, given the shards' masses (>= 0, some positive).

    ``stratified``: draw j's target is uniform in [j, j+1) * M / B and belongs to the shard whose cumulative mass range
    holds it (the same stratification the local prioritized sampler uses over items, applied to shards);
    ``multinomial``: independent draws. Both give E[count_a] = B * M_a / M; stratified has less variance."""
    masses = np.asarray(masses, np.float64)
    total = float(masses.sum())
    if masses.ndim != 1 or not np.all(masses >= 0) or not total > 0:
        raise NotEnoughDataError(f"split_counts(): the shards' masses must be >= 0 with a positive sum, got "
                                 f"{masses.tolist()}")
    if method == "multinomial":
        return rng.multinomial(batch_size, masses / total).astype(np.int64)
    if method != "stratified":
        raise ConfigError(f"split_counts(): method must be 'stratified' or 'multinomial', got {method!r}")
    targets = (np.arange(batch_size) + rng.random(batch_size)) * (total / batch_size)
    owner = np.searchsorted(np.cumsum(masses), targets, side="right")
    owner = np.minimum(owner, int(np.flatnonzero(masses > 0)[-1]))  # float rounding at the top end
    return np.bincount(owner, minlength=masses.shape[0]).astype(np.int64)


def route(node_id: Optional[str], actor_nodes: Sequence[Optional[str]], alive: Sequence[bool], turn: int) -> int:
    """The shard an ingest from ``node_id`` goes to: the ``turn``-th (round robin) live shard on that node, else the
    ``turn``-th live shard of all. Raises ``ShardUnavailableError`` when no shard is live."""
    live = [i for i, ok in enumerate(alive) if ok]
    if not live:
        raise ShardUnavailableError("ingest(): every shard actor is down; nothing can take the batch now")
    local = [i for i in live if node_id is not None and actor_nodes[i] == node_id]
    pool = local or live
    return pool[turn % len(pool)]


def _draws(n: int, shards: int) -> int:
    """Draws the shard's compiled sample kernel makes for a share of ``n``, a multiple of the plane's device shards:
    at most 8 compiled sizes per octave, under 1/8 of the draws wasted (``replay.compile_size``). A shard's share of a
    stratified split moves by a couple of items from batch to batch, so it keeps to one or two compiled sizes."""
    return compile_size(n, steps_per_octave=8, multiple=shards)


def _aligned_uint32(rows: int, cols: int) -> np.ndarray:
    """An uninitialised uint32[rows, cols] whose data starts on a 64-byte boundary (JAX's CPU client then aliases it
    on ``device_put`` instead of copying)."""
    size = rows * cols
    raw = np.empty(size + 16, np.uint32)
    offset = (-raw.ctypes.data % 64) // 4
    return raw[offset:offset + size].reshape(rows, cols)


def _is_actor_failure(exc: BaseException) -> bool:
    import ray.exceptions

    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError))


# ------------------------------------------------------------------------------------------------------------------
# The shard actor (a plain class; DistributedPlane wraps it with ray.remote)
# ------------------------------------------------------------------------------------------------------------------
class ShardServer:
    """One shard of a ``DistributedPlane``: an ``ExperienceDataPlane`` over this process's devices, its checkpoint
    directory and its record of what it holds. Ray restarts re-run this constructor, which restores the newest
    finished checkpoint of ``directory`` (else of ``restore_from``, else starts empty).

    Every mutating call returns a status dict (incarnation, mass, size, inserted, ...) so the driver's view of the
    shard's mass is refreshed by the calls it makes anyway."""

    def __init__(self, index: int, spec, capacity: Optional[int], sampler, *, directory: str,
                 devices: Optional[int] = None, seed: int = 0, limiter=None, cast: bool = False,
                 checkpoint_every_s: Optional[float] = None, checkpoint_every_items: Optional[int] = None,
                 restore_from: Optional[str] = None, incremental: bool = False, max_to_keep: int = 2,
                 jax_config: Optional[dict] = None, durable=True):
        import jax

        for key, value in (jax_config or {}).items():
            jax.config.update(key, value)
        from conduit_jax import checkpoint
        from conduit_jax.plane import ExperienceDataPlane
        from conduit_jax.replay import default_mesh

        self.index = int(index)
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._checkpoint = checkpoint
        self.mesh = default_mesh(devices)
        self.checkpoint_every_s = checkpoint_every_s
        self.checkpoint_every_items = checkpoint_every_items
        self.incremental, self.max_to_keep = bool(incremental), int(max_to_keep)
        record = self._read_meta()
        source = None
        if checkpoint.latest_step(self.directory) is not None:
            source = self.directory
        elif restore_from and os.path.isdir(restore_from) and checkpoint.latest_step(restore_from) is not None:
            source = restore_from
        if source is not None:
            self.plane = ExperienceDataPlane.restore(source, mesh=self.mesh, sampler=sampler, limiter=limiter,
                                                     spec=spec, capacity=capacity)
            restored = int(self.plane.stats()["items_inserted"])
        elif spec is None:
            raise ConfigError(f"ShardServer({index}): no checkpoint in {self.directory} or {restore_from!r} to "
                              f"restore, and no spec to build an empty shard")
        else:
            self.plane = ExperienceDataPlane(spec, capacity, sampler, limiter=limiter, mesh=self.mesh,
                                             seed=seed + 7919 * self.index, cast=cast)
            restored = 0
        self.restored_from = source
        self.log = None
        replayed = 0
        if durable:  # the acknowledged ingests since that checkpoint, from this shard's write-ahead log
            from conduit_jax.distributed.wal import IngestLog

            self.log = IngestLog(os.path.join(self.directory, WAL_DIR), self.plane.spec, fsync=durable == "fsync")
            for _, batch, n in self.log.replay(restored):
                try:
                    self.plane.ingest(batch)
                except ConduitError:  # a rate limiter that refuses the batch now: the rest is counted lost
                    break
                replayed += n
            self.log.rotate(restored + replayed)
        self.replayed = replayed
        restored += replayed
        self.incarnation = 0 if record is None else int(record["incarnation"]) + 1
        self.lost_last = 0 if record is None else max(0, int(record["inserted"]) - restored)
        self.lost = (0 if record is None else int(record.get("lost", 0))) + self.lost_last
        self.inserted = restored
        self.checkpointed = restored - replayed
        self.ignored_lost = 0  # priority updates that named an earlier incarnation's items
        self.checkpoint_error: Optional[str] = None
        self._save = None  # (handle, inserted at the save) of the save in progress
        self._last_save_time, self._last_save_items = time.monotonic(), self.checkpointed
        self._write_meta()
        self._rng = np.random.default_rng([seed, self.index, self.incarnation])
        self._build_kernels()
        import ray

        context = ray.get_runtime_context() if ray.is_initialized() else None
        self.node_id = context.get_node_id() if context is not None else None

    # -- kernels -------------------------------------------------------------------------------------------------
    def _build_kernels(self) -> None:
        import jax.numpy as jnp
        from jax import lax

        from conduit_jax import replay

        plane = self.plane
        config = plane.config
        self.priority = plane.sampler.name == "prioritized"
        self.row_words = config.layout.row_words
        self._kernels: dict[int, Any] = {}
        shards, shard_capacity = config.num_shards, config.shard_capacity

        def mass_and_size(state):
            size = replay.size(config, state)
            if self.priority:
                return jnp.sum(state.sampler.levels[0]), size
            return size.astype(jnp.float32), size

        def status(state):
            mass, size = mass_and_size(state)
            ignored = getattr(state.sampler, "ignored_updates", jnp.zeros((), jnp.int32))
            return mass, size, ignored

        self._status_kernel = engine.compiled(status, "shard_status")
        deliver = functools.partial(plane.engine.reading_kernel, num_outputs=3, delivery=True)

        def make(k: int):
            from conduit_jax import samplers

            params = dict(plane.sampler.params)
            params["batch_size"] = k
            if self.priority and params.get("beta") is None:
                params["beta"] = 0.0  # a schedule: the shard's own weights are not used (the driver weighs)
            resized = samplers.from_params(plane.sampler.name, params)
            cfg = config._replace(sampler=resized)

            def step(state):
                new_state, delivery = replay.sample(cfg, state)
                columns = [cfg.layout.pack(delivery.data), lax.bitcast_convert_type(delivery.ids, jnp.uint32)]
                if self.priority:
                    leaves = new_state.sampler.levels[-1]
                    per_shard = leaves.shape[0] // shards
                    row = delivery.ids[:, 0]
                    leaf = leaves[(row // shard_capacity) * per_shard + row % shard_capacity]
                    columns.append(lax.bitcast_convert_type(leaf, jnp.uint32)[:, None])
                mass, size = mass_and_size(state)
                return new_state, jnp.concatenate(columns, axis=1), mass, size

            return deliver(step)

        self._make_kernel = make

    # -- bookkeeping ----------------------------------------------------------------------------------------------
    def _meta_path(self) -> str:
        return os.path.join(self.directory, META_FILE)

    def _read_meta(self) -> Optional[dict]:
        try:
            with open(self._meta_path()) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def _write_meta(self) -> None:
        tmp = self._meta_path() + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"index": self.index, "incarnation": self.incarnation, "inserted": self.inserted,
                       "lost": self.lost, "checkpointed": self.checkpointed}, f)
        os.replace(tmp, self._meta_path())

    def _status(self, **extra) -> dict:
        import jax

        with self.plane.held():
            mass, size, ignored = jax.device_get(self._status_kernel(self.plane.state))
        return {"incarnation": self.incarnation, "mass": float(mass), "size": int(size), "inserted": self.inserted,
                "ignored": int(ignored), "ignored_lost": self.ignored_lost, "checkpointed": self.checkpointed,
                "durable": self.log is not None, "lost": self.lost, **extra}

    def _poll_save(self) -> None:
        if self._save is not None and self._save[0].done():
            handle, inserted = self._save
            self._save = None
            try:
                handle.wait(0)
                self._covered(inserted)
            except Exception as exc:  # a failed save leaves the previous checkpoint in place; say so in info()
                self.checkpoint_error = f"{type(exc).__name__}: {exc}"

    def _covered(self, inserted: int) -> None:
        """A checkpoint of the first ``inserted`` items is on disk: the log before it is not needed any more."""
        self.checkpointed = inserted
        if self.log is not None:
            self.log.drop_before(inserted)

    def _maybe_checkpoint(self) -> None:
        self._poll_save()
        if self._save is not None:
            return
        due = (self.checkpoint_every_s is not None and
               time.monotonic() - self._last_save_time >= self.checkpoint_every_s)
        due |= (self.checkpoint_every_items is not None and
                self.inserted - self._last_save_items >= self.checkpoint_every_items)
        if due and self.inserted > self._last_save_items:
            self._start_save(self.directory, block=False)

    def _start_save(self, directory: str, block: bool):
        handle = self._checkpoint.save(self.plane, directory, max_to_keep=self.max_to_keep, block=block,
                                       incremental=self.incremental and directory == self.directory)
        self._last_save_time, self._last_save_items = time.monotonic(), self.inserted
        if directory == self.directory:
            if self.log is not None:
                self.log.rotate(self.inserted)  # the save holds the first `inserted` items: a segment from there
            if block:
                self._covered(self.inserted)
            else:
                self._save = (handle, self.inserted)
        return handle

    # -- calls ------------------------------------------------------------------------------------------------------
    def ping(self) -> int:
        return self.incarnation

    def info(self) -> dict:
        self._maybe_checkpoint()
        import os as _os

        return self._status(index=self.index, node_id=self.node_id, pid=_os.getpid(), capacity=self.plane.capacity,
                            num_shards=self.plane.num_shards, devices=[str(d) for d in self.mesh.devices.flat],
                            lost_last=self.lost_last, replayed=self.replayed, restored_from=self.restored_from,
                            checkpoint_error=self.checkpoint_error, compiled=self.plane.compile_counts(),
                            share_kernels=sorted(self._kernels), sampler=self.plane.sampler.name,
                            row_words=self.row_words)

    def spec(self):
        return self.plane.spec.structs

    def ingest(self, batch) -> dict:
        n = self.plane.spec.validate(batch, cast=self.plane.cast, where=f"shard {self.index} ingest()")
        self.plane.ingest(batch)
        if self.log is not None:  # logged before the reply acknowledges it (a refused ingest is never logged)
            self.log.append(self.inserted, batch, n)
        self.inserted += n
        self._write_meta()
        self._maybe_checkpoint()
        return self._status()

    def sample(self, n: int):
        """``n`` draws from this shard's distribution: (packed rows uint32[n, row_words + 2 (+1 leaf mass)], status).
        An empty shard returns no rows."""
        n = int(n)
        if n < 1 or min(self.inserted, self.plane.capacity) == 0:
            return np.zeros((0, self.row_words + 2 + self.priority), np.uint32), self._status()
        k = _draws(n, self.plane.num_shards)
        kernel = self._kernels.get(k)
        if kernel is None:
            kernel = self._kernels[k] = self._make_kernel(k)
        with self.plane.held():  # the engine reads its status counters again after a kernel of another batch size
            packed, mass, size = self.plane.engine.run(f"shard-sample[{k}]", kernel)
        rows = np.asarray(packed)
        if n < k:
            # iid uniform draws: any n of them are n iid draws; stratified priority draws: a random subset keeps every
            # draw's marginal distribution p_i / M_a
            rows = rows[:n] if not self.priority else rows[np.sort(self._rng.choice(k, n, replace=False))]
        import jax

        mass, size = jax.device_get((mass, size))
        return np.ascontiguousarray(rows), {"incarnation": self.incarnation, "mass": float(mass), "size": int(size),
                                            "inserted": self.inserted}

    def warmup(self, shares) -> list:
        """Compile the sample kernels for these share sizes now (each runs once; the draws are discarded)."""
        sizes = sorted({_draws(int(n), self.plane.num_shards) for n in shares if int(n) > 0})
        for k in sizes:
            if k not in self._kernels:
                self.sample(k)
        return sizes

    def update_priorities(self, ids, priorities, incarnation: int) -> dict:
        """Priorities for ids ``int32[m, 2]`` (row, generation) of incarnation ``incarnation``; ids of another
        incarnation are ignored and counted."""
        if int(incarnation) != self.incarnation:
            self.ignored_lost += int(np.asarray(ids).shape[0])
        elif np.asarray(ids).shape[0]:
            self.plane.update_priorities(ids, priorities)
        self._maybe_checkpoint()
        return self._status()

    def checkpoint(self, directory: Optional[str] = None) -> int:
        """Save now and wait until it is on disk; returns the step. ``directory`` None: the shard's own directory."""
        self._poll_save()
        if self._save is not None:
            self._save[0].wait()
            self._poll_save()
        handle = self._start_save(os.path.abspath(directory) if directory else self.directory, block=True)
        return handle.step

    def items(self) -> dict:
        """Every stored item, for tests and inspection: {'rows': int32[n], 'generations': int32[n], 'data': pytree of
        numpy [n, ...]} in row order."""
        import jax

        plane = self.plane
        with plane.held():
            rows, cursor, laps = jax.device_get((plane.state.storage.rows, plane.state.storage.cursor,
                                                 plane.state.storage.laps))
        cap = plane.config.shard_capacity
        ids, gens = [], []
        for s, (c, lap) in enumerate(zip(cursor, laps)):
            count = cap if lap > 0 else int(c)
            slots = np.arange(count)
            ids.append(s * cap + slots)
            gens.append(lap + (slots < c).astype(np.int32))
        ids = np.concatenate(ids).astype(np.int32)
        ring_rows = (ids // cap) * cap + plane.config.ring_row(ids % cap)
        layout = plane.config.layout
        data = jax.device_get(layout.unpack(jax.numpy.asarray(layout.to_words(rows[ring_rows]))))
        return {"rows": ids, "generations": np.concatenate(gens).astype(np.int32), "data": data}

    def die(self) -> None:
        """Exit the process abruptly (a crash, for tests); Ray restarts the actor if it has restarts left."""
        os._exit(1)


# ------------------------------------------------------------------------------------------------------------------
# Driver side
# ------------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Shard:
    index: int
    handle: Any
    directory: str
    node_id: Optional[str] = None
    alive: bool = True
    incarnation: int = 0
    mass: float = 0.0
    size: int = 0
    seq: int = -1  # the call whose reply set mass/size (calls run in submission order on an actor)
    inserted: int = 0
    checkpointed: int = 0
    durable: bool = False  # it logs every acknowledged ingest: nothing it acknowledged is at risk while it is down
    lost: int = 0
    ignored: int = 0
    ignored_lost: int = 0
    restarts_seen: int = 0
    down_since: Optional[float] = None
    probe: Any = None
    probe_time: float = 0.0
    probe_seq: int = 0
    failures: int = 0


@dataclasses.dataclass
class _Piece:
    shard: _Shard
    count: int
    ref: Any
    incarnation: int
    fraction: float  # M_a / M at the split
    seq: int = 0


@dataclasses.dataclass
class _Request:
    pieces: list
    size: int  # N: items of the live shards at the split
    step: int
    issued: float


@dataclasses.dataclass
class _PendingCall:
    ref: Any
    shard: _Shard
    seq: int
    batch_ref: Any = None  # ingests: the batch in the object store (resent elsewhere if the shard died)
    items: int = 0
    node_id: Optional[str] = None


UNAUTHENTICATED = "Ray's token authentication is off"  # the start of the warning below (tests filter on it)


def warn_if_unauthenticated(stacklevel: int = 2) -> None:
    """A ``ConduitWarning`` when this process runs Ray with token authentication turned off (``RAY_AUTH_MODE=
    disabled``): Ray 2.60's servers listen on every interface, so anyone who reaches the host can run code in the
    cluster. The tests' throwaway clusters turn it off and filter the warning."""
    if os.environ.get("RAY_AUTH_MODE", "").strip().lower() == "disabled":
        warnings.warn(f"{UNAUTHENTICATED} (RAY_AUTH_MODE=disabled) and Ray's servers (GCS, raylets, workers) listen "
                      f"on every interface: anyone who reaches this host can run code in the cluster. Keep "
                      f"RAY_AUTH_MODE=token (Ray's default) and a private network (README, 'Network exposure')",
                      ConduitWarning, stacklevel=stacklevel)



def _schedule_of(schedule, prefetch):
    """The plane's ``Schedule`` from ``schedule=`` or the older ``prefetch=`` (see ``DistributedPlane``)."""
    from conduit_jax import schedule as schedule_lib

    if schedule is not None and prefetch is not None:
        raise ConfigError("DistributedPlane(): pass schedule= or prefetch=, not both (prefetch=k is "
                          "schedule=schedule.overlap(k))")
    if schedule is None:
        if prefetch is None:
            return schedule_lib.overlap(2)
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
            raise ConfigError(f"DistributedPlane(): prefetch must be an int >= 0, got {prefetch!r}")
        return schedule_lib.overlap(prefetch) if prefetch else schedule_lib.sync()
    if not isinstance(schedule, schedule_lib.Schedule):
        raise ConfigError(f"DistributedPlane(): schedule must be a schedule.* policy (sync, staged, overlap), got "
                          f"{type(schedule).__name__}")
    if schedule.defer or schedule.adaptive:
        raise ConfigError(f"DistributedPlane(): the {schedule.name} schedule is not supported across shards (priority "
                          f"updates go to their shard at once, and the request depth is fixed); use "
                          f"schedule.overlap(k)")
    return schedule


class DistributedPlane:
    """An experience plane whose shards are Ray actors (see the module docstring).

    Args:
      spec, capacity, sampler, limiter, cast: as for ``ExperienceDataPlane``; ``capacity`` is the total, split evenly
        over the actors. Samplers: ``uniform`` and ``prioritized``.
      num_actors: shard actors to start.
      devices_per_actor: devices of each actor's mesh (None: every local device of its process).
      checkpoint_dir: where shard i keeps its checkpoints (``<checkpoint_dir>/actor_<i>``); default a fresh temp dir
        (single-node only). A directory that already holds shard checkpoints is resumed.
      checkpoint_every_s / checkpoint_every_items: periodic snapshot interval of each shard (None: not on that axis);
        a shard checks it at each call it serves (ingest, priority update, stats) and snapshots in the background.
      durable: each shard logs every batch it ingests before acknowledging it and replays the log after a restart,
        so no acknowledged item is lost to a crash of its process (see the module docstring; the log's cost on an
        ingest is in ``benchmarks/bench_wal.py``). ``"fsync"``: the same, and each logged batch is flushed to the
        disk before the acknowledgement, so it also survives a crash or power loss of the host (one disk flush per
        ingest). False: items since a shard's last snapshot are lost with it.
      max_restarts: Ray restarts per actor.
      schedule: when ``deliver()`` requests batches, in the core's vocabulary: ``schedule.sync()`` or
        ``schedule.staged()`` (each request at its call) or ``schedule.overlap(k)`` (k requests in flight, so shard
        round trips run while the learner computes; the default is ``overlap(2)``). ``deferred`` and ``adaptive`` are
        refused (priority updates route to their shard at once; no adaptive depth across shards).
        ``prefetch=k``: the same as ``schedule=schedule.overlap(k)`` (``prefetch=0``: ``sync()``).
      split: 'stratified' or 'multinomial' split of a batch over shards.
      placement: None (Ray's default scheduling), or a placement-group strategy ('PACK', 'SPREAD', 'STRICT_SPREAD')
        with one bundle per actor of ``actor_options`` resources.
      actor_options: Ray options of each actor (default ``{'num_cpus': 0.25}``), e.g. ``{'num_gpus': 1}``.
      sharding: where delivered batches go (a ``jax.sharding.Sharding``; default the first local device).
      beta: IS exponent override (a number or ``step -> beta``); default the prioritized sampler's beta.
      restore_from: a directory written by ``save(directory)``: each shard starts from its checkpoint there.
      actor_env: environment variables of the actor processes (Ray runtime_env).
    """

    def __init__(self, spec, capacity: Optional[int] = None, sampler=None, *, num_actors: int = 2,
                 devices_per_actor: Optional[int] = None, checkpoint_dir: Optional[str] = None,
                 checkpoint_every_s: Optional[float] = 30.0, checkpoint_every_items: Optional[int] = None,
                 max_restarts: int = 3, prefetch: Optional[int] = None, split: str = "stratified", seed: int = 0,
                 placement: Optional[str] = None, actor_options: Optional[dict] = None, limiter=None,
                 cast: bool = False, sharding=None, beta=None, restore_from: Optional[str] = None,
                 max_pending_ingests: int = 8, incremental_checkpoints: bool = False,
                 jax_config: Optional[dict] = None, actor_env: Optional[dict] = None, probe_interval_s: float = 0.2,
                 durable=True, schedule=None):
        import ray

        from conduit_jax import samplers as samplers_lib

        if not (isinstance(durable, bool) or durable == "fsync"):
            raise ConfigError(f"DistributedPlane(): durable must be True, False or 'fsync', got {durable!r}")
        self.schedule = _schedule_of(schedule, prefetch)
        if not ray.is_initialized():
            raise ConfigError("DistributedPlane(): call ray.init(...) first (the plane starts actors on that cluster)")
        warn_if_unauthenticated(stacklevel=3)
        manifest = None
        if restore_from is not None:
            manifest = _read_manifest(restore_from)
            num_actors = manifest["num_actors"]
            capacity = manifest["capacity"] if capacity is None else capacity
            if sampler is None:
                sampler = samplers_lib.from_params(manifest["sampler"], manifest["sampler_params"])
        if not isinstance(num_actors, int) or isinstance(num_actors, bool) or num_actors < 1:
            raise ConfigError(f"DistributedPlane(): num_actors must be an int >= 1, got {num_actors!r}")
        self.sampler = samplers_lib.uniform(256) if sampler is None else sampler
        if not isinstance(self.sampler, samplers_lib.Sampler) or self.sampler.name not in SUPPORTED_SAMPLERS:
            raise ConfigError(f"DistributedPlane(): sampler must be one of samplers.{SUPPORTED_SAMPLERS}, got "
                              f"{getattr(self.sampler, 'name', type(self.sampler).__name__)}")
        params = dict(self.sampler.params)
        if params.get("max_times_sampled") is not None:
            raise ConfigError("DistributedPlane(): max_times_sampled is not supported across actors (a shard cannot "
                              "see the other shards' deliveries of a batch)")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < num_actors or \
                capacity % num_actors:
            raise ConfigError(f"DistributedPlane(): capacity must be a positive multiple of num_actors={num_actors}, "
                              f"got {capacity!r}")
        if split not in ("stratified", "multinomial"):
            raise ConfigError(f"DistributedPlane(): split must be 'stratified' or 'multinomial', got {split!r}")
        prefetch = self.schedule.depth
        self.priority = self.sampler.name == "prioritized"
        beta = params.get("beta") if beta is None else beta
        if self.priority and beta is None:
            raise ConfigError("DistributedPlane(): the sampler's beta is a schedule the plane cannot read back; pass "
                              "beta=<number or step -> beta> to DistributedPlane")
        self._beta = beta if callable(beta) else (lambda step, b=float(beta or 0.0): b)
        self.capacity, self.num_actors, self.cast = capacity, num_actors, bool(cast)
        self.batch_size = self.sampler.batch_size
        self.prefetch, self.split, self.max_pending_ingests = prefetch, split, max(1, int(max_pending_ingests))
        self.probe_interval_s = probe_interval_s
        self._rng = np.random.default_rng(seed)
        self.checkpoint_dir = os.path.abspath(checkpoint_dir) if checkpoint_dir else tempfile.mkdtemp(
            prefix="conduit-shards-")
        self._placement_group = None
        options = {"num_cpus": 0.25, **(actor_options or {})}
        strategies = [None] * num_actors
        if placement is not None:
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            bundle = {"CPU": options.get("num_cpus", 0.25)}
            if options.get("num_gpus"):
                bundle["GPU"] = options["num_gpus"]
            self._placement_group = placement_group([dict(bundle) for _ in range(num_actors)], strategy=placement)
            ray.get(self._placement_group.ready(), timeout=120)
            strategies = [PlacementGroupSchedulingStrategy(self._placement_group, placement_group_bundle_index=i)
                          for i in range(num_actors)]
        remote = ray.remote(ShardServer)
        spec_arg = None if spec is None else (spec if not isinstance(spec, ExperienceSpec) else spec.structs)
        self._shards: list[_Shard] = []
        for i in range(num_actors):
            opts = dict(options, max_restarts=max_restarts, max_task_retries=0)
            if strategies[i] is not None:
                opts["scheduling_strategy"] = strategies[i]
            if actor_env:
                opts["runtime_env"] = {"env_vars": dict(actor_env)}
            directory = os.path.join(self.checkpoint_dir, f"actor_{i}")
            handle = remote.options(**opts).remote(
                i, spec_arg, capacity // num_actors, self.sampler, directory=directory, devices=devices_per_actor,
                seed=seed, limiter=limiter, cast=cast, checkpoint_every_s=checkpoint_every_s,
                checkpoint_every_items=checkpoint_every_items,
                restore_from=None if restore_from is None else os.path.join(restore_from, f"actor_{i}"),
                incremental=incremental_checkpoints, jax_config=jax_config, durable=durable)
            self._shards.append(_Shard(i, handle, directory))
        try:
            infos = ray.get([s.handle.info.remote() for s in self._shards])
        except Exception:
            self.close()
            raise
        for shard, info in zip(self._shards, infos):
            self._take_info(shard, info, seq=0)
        self._seq = 1
        if spec is None:
            spec = ray.get(self._shards[0].handle.spec.remote())
        self.spec = spec if isinstance(spec, ExperienceSpec) else ExperienceSpec.from_structs(spec)
        from conduit_jax import storage

        self._layout = storage.RowLayout.of(self.spec)
        self._words = self._layout.row_words
        self._sharding = sharding
        self._unpack = self._build_unpack()
        self._turn = 0
        self._node_id = ray.get_runtime_context().get_node_id()  # this process's node: where its ingests come from
        self._pending_ingests: collections.deque = collections.deque()
        self._pending_updates: collections.deque = collections.deque()
        self._in_flight: collections.deque = collections.deque()
        self._step = 0
        self.counters = collections.Counter()
        self._latency: collections.deque = collections.deque(maxlen=1024)  # request -> batch ready (s)
        self._exposed: collections.deque = collections.deque(maxlen=1024)  # time deliver() waited (s)
        self._closed = False

    # -- construction helpers ------------------------------------------------------------------------------------
    def _build_unpack(self):
        import jax.numpy as jnp
        from jax import lax

        words, layout, priority = self._words, self._layout, self.priority

        def unpack(stage):
            data = layout.unpack(stage[:, :words])
            ids = lax.bitcast_convert_type(stage[:, words:words + 4], jnp.int32)
            weights = lax.bitcast_convert_type(stage[:, words + 4], jnp.float32) if priority else None
            return data, ids, weights

        return engine.compiled(unpack, "shard_unpack")

    @classmethod
    def restore(cls, directory: str, **kwargs) -> "DistributedPlane":
        """A plane whose shards start from a ``save(directory)``; the spec, capacity, actor count and sampler come
        from there (a sampler with a beta schedule must be passed). New periodic checkpoints go to
        ``checkpoint_dir`` (default: a fresh temp dir)."""
        kwargs.setdefault("spec", None)
        return cls(restore_from=directory, **kwargs)

    # -- properties -------------------------------------------------------------------------------------------------
    @property
    def actors(self) -> list:
        """The Ray actor handles, shard order."""
        return [s.handle for s in self._shards]

    def __len__(self) -> int:
        self._settle(exact=True)
        return sum(s.size for s in self._shards if s.alive)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self) -> str:
        return (f"DistributedPlane({self.spec}, capacity={self.capacity}, sampler={self.sampler.name}"
                f"(batch_size={self.batch_size}), actors={self.num_actors})")

    # -- health ---------------------------------------------------------------------------------------------------
    def _take_info(self, shard: _Shard, status: dict, seq: int) -> None:
        """Fold a shard's reply into the driver's view of it."""
        if status["incarnation"] > shard.incarnation:
            # the actor restarted (and restored its last checkpoint) since we last heard from it
            shard.restarts_seen += status["incarnation"] - shard.incarnation
            shard.incarnation = status["incarnation"]
            shard.seq = -1
        elif status["incarnation"] < shard.incarnation:
            return  # a late reply of an earlier incarnation
        if "node_id" in status:
            shard.node_id = status["node_id"]
        for key in ("inserted", "checkpointed", "durable", "lost", "ignored", "ignored_lost"):
            if key in status:
                setattr(shard, key, status[key])
        if seq >= shard.seq:
            shard.mass, shard.size, shard.seq = status["mass"], status["size"], seq
        if not shard.alive:
            shard.alive, shard.down_since, shard.probe = True, None, None
            self.counters["revived"] += 1

    def _mark_down(self, shard: _Shard) -> None:
        if shard.alive:
            shard.alive, shard.down_since = False, time.monotonic()
            shard.failures += 1
            self.counters["failures"] += 1
        shard.probe = None

    def _poll(self) -> None:
        """Probe shards that are down (a restarting actor answers once its constructor has restored)."""
        import ray

        now = time.monotonic()
        for shard in self._shards:
            if shard.alive:
                continue
            if shard.probe is not None:
                ready, _ = ray.wait([shard.probe], timeout=0)
                if not ready:
                    continue
                try:
                    info = ray.get(shard.probe)
                except Exception as exc:
                    if not _is_actor_failure(exc):
                        raise
                    shard.probe = None
                    continue
                self._take_info(shard, info, seq=shard.probe_seq)
                continue
            if now - shard.probe_time >= self.probe_interval_s:
                shard.probe, shard.probe_time, shard.probe_seq = shard.handle.info.remote(), now, self._next_seq()

    def wait_for_shards(self, timeout: float = 120.0) -> bool:
        """Block until every shard answers (e.g. after a restart); returns whether they all did in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._poll()
            if all(s.alive for s in self._shards):
                return True
            time.sleep(0.05)
        return False

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- ingest ---------------------------------------------------------------------------------------------------
    def ingest(self, batch, *, node_id: Optional[str] = None, block: bool = False,
               timeout: Optional[float] = 0.0) -> int:
        """Validate a batch (leading item axis) and send it to one shard: one on ``node_id`` (default: this
        process's node) when there is one, else the next live shard. Returns the shard's index. At most
        ``max_pending_ingests`` calls are in flight; ``block=True`` (or ``flush()``) waits for them. When every
        shard is down, waits up to ``timeout`` seconds (None: forever) for one to come back, then raises
        ``ShardUnavailableError`` (nothing was sent)."""
        import jax
        import ray

        n = self.spec.validate(batch, cast=self.cast)
        self._poll()
        host = jax.tree_util.tree_map(np.asarray, batch)
        if node_id is None:
            node_id = self._node_id
        batch_ref = ray.put(host)
        shard = self._waiting(lambda: self._send_ingest(batch_ref, n, node_id), timeout)
        while len(self._pending_ingests) > self.max_pending_ingests:
            self._settle_call(self._pending_ingests.popleft(), self._pending_ingests)
        if block:
            self.flush()
        return shard.index

    def _send_ingest(self, batch_ref, n: int, node_id: Optional[str]) -> _Shard:
        index = route(node_id, [s.node_id for s in self._shards], [s.alive for s in self._shards], self._turn)
        self._turn += 1
        shard = self._shards[index]
        ref = shard.handle.ingest.remote(batch_ref)
        self._pending_ingests.append(_PendingCall(ref, shard, self._next_seq(), batch_ref, n, node_id))
        self.counters["ingest_calls"] += 1
        return shard

    def _settle_call(self, call: _PendingCall, queue: collections.deque) -> None:
        """Wait for one ingest / priority-update call; a shard that died before answering gets marked down and an
        ingest goes to another shard (queued at the back of ``queue``)."""
        import ray

        try:
            status = ray.get(call.ref)
        except Exception as exc:
            if not _is_actor_failure(exc):
                raise
            self._mark_down(call.shard)
            if call.batch_ref is not None:
                self.counters["ingests_rerouted"] += 1
                try:
                    self._send_ingest(call.batch_ref, call.items, call.node_id)
                except ShardUnavailableError:
                    self.counters["items_dropped"] += call.items
                    raise ShardUnavailableError(
                        f"ingest(): shard {call.shard.index} died before storing a batch of {call.items} items and "
                        f"no other shard is up to take it: the batch is dropped (counted in "
                        f"stats()['counters']['items_dropped'])") from None
            else:
                self.counters["priority_updates_lost_shard"] += call.items
            return
        if call.batch_ref is not None:
            self.counters["items_ingested"] += call.items
        self._take_info(call.shard, status, call.seq)

    def _settle(self, exact: bool) -> None:
        """Fold in the replies of ingests and updates: all of them (``exact``) or those already back."""
        import ray

        for queue in (self._pending_ingests, self._pending_updates):
            if exact:
                while queue:
                    self._settle_call(queue.popleft(), queue)
            elif queue:
                ready, _ = ray.wait([c.ref for c in queue], num_returns=len(queue), timeout=0)
                ready = set(ready)
                keep = collections.deque()
                done = []
                while queue:
                    call = queue.popleft()
                    (done if call.ref in ready else keep).append(call)
                queue.extend(keep)
                for call in done:
                    self._settle_call(call, queue)

    def flush(self) -> None:
        """Wait until every ingest and priority update sent so far is applied (or rerouted and applied)."""
        self._settle(exact=True)

    def shard_for(self, node_id: Optional[str] = None):
        """The actor handle a producer on ``node_id`` should ingest into directly (``handle.ingest.remote(batch)``;
        the shard validates the batch, and its replies to the driver's later calls carry its new mass)."""
        index = route(node_id, [s.node_id for s in self._shards], [s.alive for s in self._shards], self._turn)
        self._turn += 1
        return self._shards[index].handle

    # -- sample / deliver --------------------------------------------------------------------------------------------
    def _issue(self, exact: bool) -> _Request:
        self._poll()
        self._settle(exact)
        live = [s for s in self._shards if s.alive and s.mass > 0]
        if not live:
            if not any(s.alive for s in self._shards):
                raise ShardUnavailableError("sample(): every shard actor is down")
            raise NotEnoughDataError(f"sample(): the plane's live shards hold no items; ingest first (a batch of "
                                     f"{self.batch_size} needs at least one)")
        masses = np.array([s.mass for s in live])
        counts = split_counts(self.batch_size, masses, self._rng, self.split)
        total = float(masses.sum())
        pieces = [_Piece(s, int(c), s.handle.sample.remote(int(c)), s.incarnation, s.mass / total, self._next_seq())
                  for s, c in zip(live, counts) if c > 0]
        self.counters["sample_calls"] += len(pieces)
        self.counters["requests"] += 1
        request = _Request(pieces, sum(s.size for s in live), self._step, time.perf_counter())
        self._step += 1
        return request

    def _collect(self, request: _Request, retries: int = 3):
        """Wait for a request's shares and assemble the delivery; a share lost to a dead shard (or a shard that came
        back empty) makes the whole batch be drawn again from the live shards."""
        import jax
        import ray

        replies, failed = [], False
        try:  # one get for every share (the common case); one by one when some shard failed
            results = ray.get([piece.ref for piece in request.pieces])
        except Exception as exc:
            if not _is_actor_failure(exc):
                raise
            results = [None] * len(request.pieces)
        for piece, result in zip(request.pieces, results):
            try:
                rows, status = ray.get(piece.ref) if result is None else result
            except Exception as exc:
                if not _is_actor_failure(exc):
                    raise
                self._mark_down(piece.shard)
                failed = True
                continue
            self._take_info(piece.shard, status, piece.seq)
            if rows.shape[0] != piece.count or status["incarnation"] != piece.incarnation:
                failed = True  # the shard restarted between the split and its draw
                continue
            replies.append((piece, rows, status))
        if failed:
            self.counters["requests_redrawn"] += 1
            if retries <= 0:
                raise ShardUnavailableError("sample(): shards kept failing while a batch was drawn")
            return self._collect(self._issue(exact=True), retries - 1)
        words = self._words
        stage = _aligned_uint32(self.batch_size, words + 4 + self.priority)
        start = 0
        probability = np.empty(self.batch_size, np.float64) if self.priority else None
        for piece, rows, status in replies:
            end = start + rows.shape[0]
            stage[start:end, :words] = rows[:, :words]
            stage[start:end, words] = piece.shard.index
            stage[start:end, words + 1] = piece.incarnation
            stage[start:end, words + 2:words + 4] = rows[:, words:words + 2]
            if self.priority:
                # P(draw = i) = P(the draw went to shard a) * P(shard a drew i) = (M_a / M) * leaf_i / M_a_now
                leaf = rows[:, words + 2].view(np.float32).astype(np.float64)
                probability[start:end] = piece.fraction * leaf / max(status["mass"], np.finfo(np.float32).tiny)
            start = end
        if self.priority:
            beta = float(self._beta(request.step))
            weights = np.power(np.maximum(request.size * probability, np.finfo(np.float64).tiny), -beta)
            weights = (weights / weights.max()).astype(np.float32)
            stage[:, words + 4] = weights.view(np.uint32)
        staged = jax.device_put(stage, self._sharding) if self._sharding is not None else jax.device_put(stage)
        data, ids, weights = self._unpack(staged)
        delivery = Delivery(data, ids, weights, None)
        jax.block_until_ready(delivery)
        self._latency.append(time.perf_counter() - request.issued)
        return delivery

    def _waiting(self, call, timeout: Optional[float]):
        """``call()``, retried while it raises ``NotEnoughDataError`` / ``ShardUnavailableError`` for up to
        ``timeout`` seconds (None: forever; 0: once), polling the shards in between."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return call()
            except (NotEnoughDataError, ShardUnavailableError):
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            time.sleep(0.01)
            self._poll()

    def sample(self, *, timeout: Optional[float] = 0.0) -> Delivery:
        """One batch drawn now over every live shard, with exact masses (waits for ingests and updates in flight).
        ``Delivery(data, ids int32[B, 4], weights, None)``. With no item on any live shard (or no live shard) waits
        up to ``timeout`` seconds (None: forever) for one, then raises ``NotEnoughDataError`` /
        ``ShardUnavailableError``."""
        return self._waiting(lambda: self._collect(self._issue(exact=True)), timeout)

    def can_sample(self) -> bool:
        """Whether some live shard holds items (by the replies seen so far; nothing is waited for)."""
        self._poll()
        self._settle(exact=False)
        return any(s.alive and s.mass > 0 for s in self._shards)

    def deliver(self, *, timeout: Optional[float] = 0.0) -> Delivery:
        """The learner's next batch: drawn during earlier learner steps when ``prefetch`` > 0 (the next requests are
        sent before this one is assembled, so shard round trips overlap the learner's compute). ``timeout`` as for
        ``sample`` when nothing is in flight."""
        start = time.perf_counter()
        if not self._in_flight:
            self._in_flight.append(self._waiting(lambda: self._issue(exact=True), timeout))
        request = self._in_flight.popleft()
        while len(self._in_flight) < self.prefetch:
            try:
                self._in_flight.append(self._issue(exact=False))
            except NotEnoughDataError:
                break
        delivery = self._collect(request)
        self._exposed.append(time.perf_counter() - start)
        return delivery

    def discard_prefetched(self) -> int:
        """Drop the batches ``deliver`` requested ahead (draws only: no item leaves a shard), e.g. before measuring
        another ``prefetch`` depth. Returns how many were dropped."""
        dropped = len(self._in_flight)
        self._in_flight.clear()
        return dropped

    def warmup(self) -> dict:
        """Compile every live shard's sample kernels for the share sizes a split of the current masses gives (a
        stratified share stays within 2 of its expectation), so the first batches do not wait for compilation.
        Returns {actor index: compiled sizes}."""
        import ray

        self._settle(exact=True)
        live = [s for s in self._shards if s.alive and s.mass > 0]
        if not live:
            return {}
        total = sum(s.mass for s in live)
        refs = {}
        for shard in live:
            expected = self.batch_size * shard.mass / total
            shares = range(max(1, int(np.floor(expected)) - 2), min(self.batch_size, int(np.ceil(expected)) + 2) + 1)
            refs[shard.index] = shard.handle.warmup.remote(list(shares))
        return {index: ray.get(ref) for index, ref in refs.items()}

    # -- priorities ---------------------------------------------------------------------------------------------------
    def update_priorities(self, ids, priorities) -> None:
        """Priorities for delivered items: ``ids`` int32[m, 4] as in ``Delivery.ids``, ``priorities`` [m] finite and
        >= 0. Each actor gets its ids in one call; ids of a lost shard generation (an earlier incarnation of a
        restarted actor, or an actor that is down) are ignored and counted."""
        if not self.priority:
            raise ConfigError(f"update_priorities(): the {self.sampler.name} sampler has no priorities")
        ids_np = np.asarray(ids)
        if ids_np.ndim != 2 or ids_np.shape[1] != 4 or not np.issubdtype(ids_np.dtype, np.integer):
            raise PriorityError(f"update_priorities(): ids must be an integer array of shape (m, 4) (actor, "
                                f"incarnation, row, generation) as in Delivery.ids, got {ids_np.dtype}"
                                f"{list(ids_np.shape)}")
        prio_np = checked_priorities(priorities, ids_np.shape[0])
        per_actor = self.capacity // self.num_actors
        out = (ids_np[:, 0] < 0) | (ids_np[:, 0] >= self.num_actors) | (ids_np[:, 2] < 0) | \
            (ids_np[:, 2] >= per_actor) | (ids_np[:, 3] < 1)
        if out.any():
            i = int(np.argmax(out))
            raise PriorityError(f"update_priorities(): ids[{i}] = {ids_np[i].tolist()} is not an id of this plane")
        self._poll()
        for index in np.unique(ids_np[:, 0]):
            shard = self._shards[int(index)]
            mine = ids_np[:, 0] == index
            current = mine & (ids_np[:, 1] == shard.incarnation)
            lost = int(mine.sum() - current.sum())
            if not shard.alive:
                lost, current = int(mine.sum()), np.zeros_like(mine)
            self.counters["priority_updates_lost_shard"] += lost
            if current.any():
                ref = shard.handle.update_priorities.remote(ids_np[current][:, 2:4].astype(np.int32),
                                                            prio_np[current], shard.incarnation)
                self._pending_updates.append(_PendingCall(ref, shard, self._next_seq(), None, int(current.sum())))
        while len(self._pending_updates) > self.max_pending_ingests:
            self._settle_call(self._pending_updates.popleft(), self._pending_updates)

    # -- status ---------------------------------------------------------------------------------------------------
    def compile_counts(self) -> dict:
        """XLA compilations per kernel of each live shard's plane: {actor index: {kernel: count}} (one round trip).
        The shards' own share-sized sample kernels are not XLA-counted there; ``stats()['shards']`` lists them."""
        return {s["index"]: s["compiled"] for s in self.stats()["shards"] if s["alive"]}

    def stats(self, timeout: float = 30.0) -> dict:
        """Counters over the shards (one round trip to the live ones), the driver's routing and fault counters, and
        request latencies. ``degraded``: some shard is down, sampling runs on the others; ``items_lost``: items
        ingested after a restarted shard's last checkpoint that it could not replay (gone); ``items_at_risk``: for
        shards down now that keep no log (``durable=False``), items not yet in their last checkpoint."""
        import ray

        self._poll()
        self._settle(exact=False)
        live = [s for s in self._shards if s.alive]
        refs = [(s.handle.info.remote(), self._next_seq()) for s in live]
        per_actor = {}
        for shard, (ref, seq) in zip(live, refs):
            try:
                info = ray.get(ref, timeout=timeout)
            except Exception as exc:
                if not _is_actor_failure(exc) and not isinstance(exc, ray.exceptions.GetTimeoutError):
                    raise
                self._mark_down(shard)
                continue
            self._take_info(shard, info, seq)
            per_actor[shard.index] = info
        shards = []
        for s in self._shards:
            info = per_actor.get(s.index, {})
            shards.append({"index": s.index, "alive": s.alive, "incarnation": s.incarnation, "node_id": s.node_id,
                           "size": s.size, "mass": s.mass, "inserted": s.inserted, "checkpointed": s.checkpointed,
                           "lost": s.lost, "restarts_seen": s.restarts_seen, "failures": s.failures,
                           "down_for_s": None if s.alive else time.monotonic() - s.down_since,
                           "pid": info.get("pid"), "checkpoint_error": info.get("checkpoint_error"),
                           "compiled": info.get("compiled"), "share_kernels": info.get("share_kernels")})
        down = [s.index for s in self._shards if not s.alive]

        def ms(values):
            if not values:
                return None
            return {"median_ms": 1e3 * float(np.median(values)), "p99_ms": 1e3 * float(np.percentile(values, 99)),
                    "count": len(values)}

        return {
            "num_actors": self.num_actors,
            "alive": self.num_actors - len(down),
            "down": down,
            "degraded": bool(down),
            "size": sum(s.size for s in self._shards if s.alive),
            "capacity": self.capacity,
            "sampler": self.sampler.name,
            "items_inserted": sum(s.inserted for s in self._shards),
            "items_lost": sum(s.lost for s in self._shards),
            "items_at_risk": sum(s.inserted - s.checkpointed for s in self._shards if not s.alive and not s.durable),
            "priority_updates_ignored": sum(s.ignored for s in self._shards),
            "priority_updates_lost_shard": self.counters["priority_updates_lost_shard"] + sum(
                s.ignored_lost for s in self._shards),
            "restarts": sum(s.restarts_seen for s in self._shards),
            "counters": dict(self.counters),
            "prefetch": self.prefetch, "schedule": self.schedule.name,
            "in_flight": len(self._in_flight),
            "request_latency": ms(list(self._latency)),
            "exposed": ms(list(self._exposed)),
            "shards": shards,
            "checkpoint_dir": self.checkpoint_dir,
        }

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def save(self, directory: Optional[str] = None, timeout: float = 300.0) -> dict:
        """Snapshot every live shard now and wait until the snapshots are on disk. ``directory`` None: each shard's
        own checkpoint directory (what a restart restores); else ``<directory>/actor_<i>`` plus a manifest, which
        ``DistributedPlane.restore(directory)`` reads. Returns {actor index: step}; a shard that is down is left out
        (and named in the manifest)."""
        import ray

        self.flush()
        if directory is not None:
            directory = os.path.abspath(directory)
            os.makedirs(directory, exist_ok=True)
        live = [s for s in self._shards if s.alive]
        refs = [s.handle.checkpoint.remote(None if directory is None else os.path.join(directory, f"actor_{s.index}"))
                for s in live]
        steps = {}
        for shard, ref in zip(live, refs):
            try:
                steps[shard.index] = ray.get(ref, timeout=timeout)
                shard.checkpointed = shard.inserted
            except Exception as exc:
                if not _is_actor_failure(exc):
                    raise
                self._mark_down(shard)
        if directory is not None:
            manifest = {"format": "conduit-distributed/1", "num_actors": self.num_actors, "capacity": self.capacity,
                        "sampler": self.sampler.name,
                        "sampler_params": {k: (list(v) if isinstance(v, tuple) else v)
                                           for k, v in self.sampler.params},
                        "steps": {str(k): v for k, v in steps.items()},
                        "missing": [s.index for s in self._shards if s.index not in steps]}
            tmp = os.path.join(directory, MANIFEST + ".tmp")
            with open(tmp, "w") as f:
                json.dump(manifest, f, indent=1)
            os.replace(tmp, os.path.join(directory, MANIFEST))
        return steps

    def shard_items(self, index: int) -> dict:
        """Every item shard ``index`` holds (for tests and inspection; reads the whole shard)."""
        import ray

        return ray.get(self._shards[index].handle.items.remote())

    def close(self) -> None:
        """Stop the shard actors (no restart) and release the placement group. Checkpoints stay on disk."""
        import ray

        if getattr(self, "_closed", False):
            return
        self._closed = True
        for shard in getattr(self, "_shards", []):
            try:
                ray.kill(shard.handle, no_restart=True)
            except Exception:
                pass
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._placement_group)
            except Exception:
                pass


def _read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"DistributedPlane.restore(): {path} does not exist; save(directory) writes it") from None
    if manifest.get("format") != "conduit-distributed/1":
        raise ConfigError(f"DistributedPlane.restore(): {path} is not a conduit-distributed/1 manifest")
    params = manifest["sampler_params"]
    manifest["sampler_params"] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in params.items()}
    return manifest
