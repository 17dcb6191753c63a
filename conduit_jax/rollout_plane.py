"""The rollout plane: a rollout buffer (``conduit_jax.rollouts``) behind host calls, for LLM-RL loops whose
generator and learner run in threads of one program.

    plane = cj.RolloutPlane(spec, token_capacity=1 << 20, group_capacity=1024, groups_per_batch=16,
                            layout=cj.rollouts.packed(rows=32, row_length=2048), max_staleness=1,
                            schedule=cj.schedule.overlap(2))
    # generator thread                              # learner thread
    plane.ingest(groups, timeout=None)              batch = plane.deliver(timeout=None)
                                                    ... learner step on batch ...
                                                    plane.set_policy_version(step)

``ingest`` checks the groups and stages them on the host (a copy): no kernel. The next kernel that runs anyway (a
batch's, dispatched by ``deliver`` or by the schedule's delivery worker) writes them first, in the same dispatch.
Back-pressure instead of loss: an ingest that would overwrite groups not yet delivered (and still fresh enough to
be) waits (``timeout``) or raises ``CapacityError``, naming them; nothing is written. ``deliver`` hands over the
next batch of whole groups, oldest first, each once; under a prefetching schedule (``overlap``, ``adaptive``) the
worker has laid it out during the learner's step. A batch drawn before ``set_policy_version`` is re-checked when
delivered: sequences now older than ``max_staleness`` versions are masked out (``loss_mask`` and ``sequence_mask``
False, advantages 0) and counted, so nothing older than the bound reaches the loss. ``learner_mesh``: where
batches go (e.g. the learner's half of the devices while the other half generates), rows split over its first axis;
the move is a transfer after the kernel, overlapped like the rest.

The plane plans every batch on the host (``rollouts.HostQueue``), so no call reads the device to decide.
``plane.save(directory)`` checkpoints it (asynchronously) and ``RolloutPlane.restore(directory)`` rebuilds it bit for
bit, delivering the batches it would have (``rollout_checkpoint``).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
import weakref
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conduit_jax import metrics, rollouts, runtime
from conduit_jax import schedule as schedule_lib
from conduit_jax.delivery import CountedLock, Scheduler, check_version, checked_timeout, wait_until, weakly
from conduit_jax.engine import RolloutEngine
from conduit_jax.errors import CapacityError, ConfigError, NotEnoughDataError
from conduit_jax.replay import compile_size

DRAWN_VERSIONS_KEPT = 64  # recent draws whose groups' versions the plane keeps (a batch older than these is re-checked
# on the device)
RELEASED_BY_DRAWS = 4  # batches a plane holds after drawing them (see RolloutPlane._released_by_draws)
STAGED_GROUPS_MAX = 256  # groups staged at most (and at most group_capacity): more are written by a kernel of their own


class RolloutPlane:
    """See the module docstring. ``spec`` and the sizes are ``rollouts.make_rollout_buffer``'s; ``schedule`` one of
    ``schedule.staged()`` (default: every batch drawn by ``deliver``), ``overlap(k)``, ``adaptive(k)``
    (``deferred`` is for priority updates, which rollouts do not have); ``learner_mesh`` the devices batches go to
    (default: where the buffer lives). ``min_fill``: a batch is drawn once it is full (its window of
    ``groups_per_batch`` groups, or in a packed layout a group it could not fit) or its sequences fill this share
    of it (tokens of the budget packed, rows padded); 0 draws whatever is deliverable. A prefetching worker then
    lays out whole batches, not a generation's leftovers. ``trim_rows``: a batch has only the rows its sequences
    fill, rounded up by the padding rule (at most 1/16 more; ``row_counts()`` lists the few shapes, for a learner
    to compile ahead), instead of the layout's whole token budget: the layout is then a budget, not a shape."""

    def __init__(self, spec: rollouts.RolloutSpec, token_capacity: int, group_capacity: int, groups_per_batch: int,
                 layout: Optional[rollouts.Layout] = None, *, max_staleness: Optional[int] = None,
                 scale_advantages: bool = True, schedule: Optional[schedule_lib.Schedule] = None, mesh=None,
                 learner_mesh=None, min_fill: float = 1.0, trim_rows: bool = False):
        where = "RolloutPlane()"
        self.schedule = schedule_lib.staged() if schedule is None else schedule
        if not isinstance(self.schedule, schedule_lib.Schedule):
            raise ConfigError(f"{where}: schedule must be a schedule.* policy (e.g. schedule.overlap(2)), got "
                              f"{type(self.schedule).__name__}")
        if self.schedule.defer:
            raise ConfigError(f"{where}: the {self.schedule.name} schedule defers priority updates, which rollouts do "
                              f"not have; use schedule.overlap(k) or schedule.adaptive(k)")
        self.buffer = rollouts.make_rollout_buffer(spec, token_capacity, group_capacity, groups_per_batch, layout,
                                                   max_staleness=max_staleness, scale_advantages=scale_advantages,
                                                   mesh=mesh)
        self.config, self.spec = self.buffer.config, self.buffer.spec
        if learner_mesh is not None and not isinstance(learner_mesh, jax.sharding.Mesh):
            raise ConfigError(f"{where}: learner_mesh must be a jax.sharding.Mesh, got {type(learner_mesh).__name__}")
        if isinstance(min_fill, bool) or not isinstance(min_fill, (int, float)) or not 0.0 <= min_fill <= 1.0:
            raise ConfigError(f"{where}: min_fill must be a number in [0, 1] (the share of a batch that must be "
                              f"filled before it is drawn), got {min_fill!r}")
        self.min_fill = float(min_fill)
        if not isinstance(trim_rows, (bool, np.bool_)):
            raise ConfigError(f"{where}: trim_rows must be a bool, got {trim_rows!r}")
        self.trim_rows = bool(trim_rows)
        self.learner_mesh = learner_mesh
        self._learner_shardings: dict = {}  # rows of a batch -> per leaf of it, built from the first such batch
        self.queue = rollouts.HostQueue(self.config)  # what is stored, staged and deliverable, known on the host
        self.engine = RolloutEngine(self.buffer)
        self.timeline = metrics.Timeline()
        self.masked_stale = 0  # sequences of prefetched batches masked at delivery (older than the bound by then)
        # (weak reference to a batch's versions array, policy version of each group it took; -1: none) of recent
        # draws, known from the host's plan: a batch re-checked at delivery after a version switch is then decided
        # without reading the device (weak: a delivered batch's memory is not held here)
        self._drawn_versions: collections.deque = collections.deque(maxlen=DRAWN_VERSIONS_KEPT)
        # the batches drawn last, held so that a batch's device buffers are freed when a later draw pushes it out:
        # on the drawing thread (the worker, under a prefetching schedule), not on the learner's thread in the
        # instant it drops the batch (freeing a batch's arrays cost the learner ~60 us a step, as much as deliver())
        self._released_by_draws: collections.deque = collections.deque(maxlen=RELEASED_BY_DRAWS)
        self._lock = CountedLock()
        self._changed = threading.Condition(self._lock)
        self._schedule = Scheduler(self.schedule, self._lock, group_capacity, self.timeline,
                                   draw=weakly(self, "_draw"), admits=weakly(self, "can_sample"),
                                   pend=weakly(self, "_pend"), refresh=weakly(self, "_refreshed"))
        weakref.finalize(self, self._schedule.close)

    # -- ingest -----------------------------------------------------------------------------------------------------
    def ingest(self, groups: rollouts.Groups, *, timeout: Optional[float] = 0.0) -> None:
        """Take ``groups`` (``rollouts.Groups``, e.g. from ``rollouts.groups_from_lists``, or a generator's padded
        device arrays, read here; checked, ``SpecError`` naming the field, prompt and response) into the plane:
        staged on the host, written by the next kernel. When they would overwrite undelivered groups, waits up to
        ``timeout`` seconds (None: for ever) for deliveries to make room, then raises ``CapacityError``; nothing is
        written. The plane keeps no reference to the caller's arrays."""
        runtime.refuse_under_trace("ingest()", "state = buffer.ingest(state, groups)")
        start = time.perf_counter()
        timeout = checked_timeout(timeout, "ingest()")
        if not isinstance(groups, rollouts.Groups):
            rollouts.check_groups(self.spec, groups)  # raises, naming what came
        # host copies (a generator's device arrays are read here: the plan needs the lengths), then every value
        # checked
        groups = rollouts.check_groups(self.spec, rollouts.Groups(
            {name: np.array(leaf) for name, leaf in groups.leaves.items()},
            *(np.array(getattr(groups, field)) for field in rollouts.Groups._fields[1:])))
        lengths = groups.lengths
        if lengths.shape[0] > self.config.group_capacity:
            raise CapacityError(f"ingest(): {lengths.shape[0]} groups at once exceed group_capacity="
                                f"{self.config.group_capacity}")
        with self._changed:
            wait_until(self._changed, lambda: self._ingest_refusal(lengths), timeout)
            if self.engine.staged_groups() + lengths.shape[0] > min(STAGED_GROUPS_MAX, self.config.group_capacity):
                self.engine.flush(self.queue.policy_version)  # a producer that never samples: one kernel per area
            self.queue.ingest(lengths, groups.policy_version)
            self.engine.staged.append(groups)
            self._changed.notify_all()
            drawn = self._schedule.ingested()  # after a version switch the next batch is drawn here
        self._schedule.finish_ingest(drawn)
        self.timeline.record("ingest", start, time.perf_counter())
        if self._lock.waiting:  # a producer looping on staged copies would starve a blocked learner (see plane.py)
            time.sleep(0)

    def _ingest_refusal(self, lengths):
        # a group already older than the staleness bound is never delivered: overwriting it loses nothing (it is
        # counted as overwritten), and holding room for it would stall the generator behind the learner for good
        retired = self.queue.retires_undelivered(lengths, fresh_only=True)
        if not retired:
            return None
        return CapacityError, (
            f"ingest(): {lengths.shape[0]} groups ({int(np.sum(lengths))} tokens) would overwrite {retired} of the "
            f"{self.queue.deliverable()} undelivered groups (token_capacity={self.config.token_capacity}, "
            f"group_capacity={self.config.group_capacity}); deliver() first, or pass a timeout to wait for the "
            f"learner")

    # -- delivery ---------------------------------------------------------------------------------------------------
    def can_sample(self) -> bool:
        """Whether a batch is deliverable now without waiting (groups not prefetched already, filling the batch as
        ``min_fill`` asks)."""
        with self._changed:
            return self._sample_refusal() is None

    def deliver(self, *, timeout: Optional[float] = 0.0) -> rollouts.RolloutBatch:
        """The learner's next batch (``rollouts.RolloutBatch``, computed), under the plane's schedule. With nothing
        deliverable, waits up to ``timeout`` seconds for an ingest, then raises ``NotEnoughDataError``."""
        runtime.refuse_under_trace("deliver()", "state, batch = buffer.sample(state)")
        timeout = checked_timeout(timeout, "deliver()")
        return self._schedule.deliver(timeout, None, lambda *_: None)

    def _draw(self, *, timeout: Optional[float] = 0.0, recycle=None) -> rollouts.RolloutBatch:
        """Plan the next batch on the host and dispatch its kernel (the staged groups go in first). Under the lock."""
        del recycle  # batches are not recycled: their layout is the learner's
        wait_until(self._changed, self._sample_refusal, timeout)
        plan = self.queue.plan()
        self.queue.commit(plan)
        rows = self._trimmed_rows(rollouts.rows_needed(plan)) if self.trim_rows else None
        with self.timeline.span("sample"):
            batch = self.engine.deliver(plan, self.queue.policy_version, rows)
        self._changed.notify_all()  # groups left the queue: an ingest waiting for room may go on
        if self.learner_mesh is not None:
            batch = jax.device_put(batch, self._shardings_on_learner(batch))
        self._drawn_versions.append((weakref.ref(batch.versions),
                                     np.where(plan.taken, self.queue.version[plan.slots], -1)))
        self._released_by_draws.append(batch)
        return batch

    def _trimmed_rows(self, needed: int) -> int:
        return compile_size(needed, steps_per_octave=8, limit=rollouts.batch_rows(self.config))

    def row_counts(self) -> tuple[int, ...]:
        """The row counts of the batches ``deliver()`` may hand over, smallest first: the layout's alone, or with
        ``trim_rows`` the few the padding rule rounds to (a learner compiles its step for each ahead of time)."""
        full = rollouts.batch_rows(self.config)
        if not self.trim_rows:
            return (full,)
        return tuple(sorted({self._trimmed_rows(needed) for needed in range(1, full + 1)}))

    def move_cost(self, topology) -> dict[str, float]:
        """What moving each batch to the learner's devices costs on ``topology`` (a ``placement.Topology`` whose
        device ids are the meshes' ``Device.id``): a whole batch's bytes (the most, with ``trim_rows``) and the
        predicted seconds (``placement.reshard_time``); 0 s without a ``learner_mesh`` or on the same devices."""
        from conduit_jax import placement

        abstract = jax.eval_shape(lambda state: self.buffer.sample(state)[1], self.engine.state)
        nbytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(abstract))
        if self.learner_mesh is None:
            return {"batch_bytes": nbytes, "seconds": 0.0}
        source = [device.id for device in self.buffer.shardings.leaves[next(iter(self.spec.token_leaves))]
                  .mesh.devices.flat]
        target = [device.id for device in self.learner_mesh.devices.flat]
        return {"batch_bytes": nbytes, "seconds": placement.reshard_time(topology, nbytes, source, target)}

    def _shardings_on_learner(self, batch):
        """Each leaf of a batch on the learner's mesh: rows split over its first axis where they divide evenly,
        replicated otherwise (scalars, odd row counts)."""
        rows = batch.segment_ids.shape[0]  # one shape per row count (trim_rows gives a few)
        if rows not in self._learner_shardings:
            mesh = self.learner_mesh
            axis, size = mesh.axis_names[0], mesh.shape[mesh.axis_names[0]]
            self._learner_shardings[rows] = jax.tree.map(
                lambda leaf: NamedSharding(mesh, P(axis) if leaf.ndim and leaf.shape[0] % size == 0 else P()), batch)
        return self._learner_shardings[rows]

    def in_flight(self) -> tuple:
        """The batches the schedule laid out and ``deliver()`` has not handed over yet, oldest first (their groups
        have left the queue: ``stats()['groups_drawn']`` counts them)."""
        with self._changed:
            self._schedule.settle()
            return tuple(batch.delivery for batch in self._schedule.in_flight)

    def _sample_refusal(self):
        deliverable = self.queue.deliverable()
        if deliverable:
            _, full, fill = self.queue.next_batch()
            if full or fill >= self.min_fill:
                return None
        prefetched = len(self._schedule.in_flight)
        held = f"; {prefetched} batches the {self.schedule.name} schedule prefetched wait for deliver()" \
            if prefetched else ""
        what = (f"{deliverable} deliverable groups fill {fill:.0%} of a batch, min_fill is {self.min_fill:.0%}"
                if deliverable else f"no group is deliverable ({int(np.sum(self.queue.undelivered()))} undelivered "
                                    f"stored, none fresh enough)")
        return NotEnoughDataError, f"deliver(): {what}{held}; ingest more first"

    def _pend(self, checked) -> None:
        raise ConfigError("rollouts have no priorities")

    def _refreshed(self, batch: rollouts.RolloutBatch) -> rollouts.RolloutBatch:
        """A batch drawn before a policy-version switch, with its sequences now older than the bound masked out."""
        eta = self.config.max_staleness
        if eta is None:
            return batch
        oldest = self.queue.policy_version - eta
        versions = next((v for drawn, v in self._drawn_versions if drawn() is batch.versions), None)
        if versions is not None and not np.any((versions >= 0) & (versions < oldest)):
            return batch  # every group it took is still fresh enough (its sequences are a subset of those groups')
        stale = batch.sequence_mask & (batch.versions < oldest)
        count = int(np.sum(np.asarray(stale)))
        if not count:
            return batch
        self.masked_stale += count
        keep = ~jnp.concatenate([jnp.zeros((1,), bool), stale])[batch.segment_ids]  # per token (segment 0: padding)
        return jax.block_until_ready(batch._replace(
            loss_mask=batch.loss_mask & keep, advantages=jnp.where(keep, batch.advantages, 0.0),
            sequence_mask=batch.sequence_mask & ~stale))

    def set_policy_version(self, version: int) -> None:
        """The learner's policy version (it never goes back): groups more than ``max_staleness`` behind are never
        delivered from now on, and prefetched batches are re-checked when delivered."""
        runtime.refuse_under_trace("set_policy_version()", "state = buffer.set_policy_version(state, version)")
        with self._changed:
            check_version(version, self.queue.policy_version)
            self.queue.set_policy_version(version)
            self._schedule.switched()
            self._changed.notify_all()

    # -- the state, status ------------------------------------------------------------------------------------------
    @property
    def state(self) -> rollouts.RolloutState:
        """The buffer's state with every staged group and the learner's policy version written (a kernel now if
        either is not yet)."""
        with self._written():
            return self.engine.state

    @state.setter
    def state(self, value: rollouts.RolloutState) -> None:
        """Replace the buffer's state with ``value`` (a ``RolloutState`` of this plane's buffer: ``plane.state``
        earlier, what the functional steps returned, a checkpoint's) and rebuild the host's bookkeeping from it:
        the plane then delivers what a plane that made that state would. Groups staged before are written into the
        state being replaced first; batches a prefetching schedule drew before stay deliverable (``in_flight()``)
        and are re-checked for staleness when delivered. ``ConfigError`` naming the leaf for a state of another
        spec or size; the plane is then as it was."""
        runtime.refuse_under_trace("plane.state = ...", "assign the state your jitted function returns")
        self.engine.state_types.check(value, "RolloutPlane.state")
        with self._written():
            queue = rollouts.HostQueue.from_state(self.config, value)
            self.engine.state, self.queue = value, queue
            self._schedule.switched()  # its policy version may differ
            self._changed.notify_all()  # a delivery worker may draw now

    @contextlib.contextmanager
    def _written(self):
        """The plane held still (its lock), the worker settled, every staged group and the learner's policy version
        in the state."""
        with self._changed:
            self._schedule.settle()
            self.engine.flush(self.queue.policy_version)
            yield

    def __len__(self) -> int:
        """Groups that would still be delivered: stored (or staged), not drawn yet, fresh enough."""
        with self._changed:
            return self.queue.deliverable()

    def stats(self) -> dict[str, Any]:
        """Counts from the host's bookkeeping (groups drawn into batches, dropped as stale or overwritten, sequences
        masked stale at delivery), the kernels dispatched and compiled, the shell's timings per call and the exposed
        path (ingest + deliver on the learner's thread)."""
        with self._changed:
            self._schedule.settle()
            queue = self.queue
            return {"groups_ingested": queue.written, "groups_drawn": queue.delivered,
                    "undelivered": int(np.sum(queue.undelivered())), "dropped_stale": queue.dropped_stale,
                    "dropped_overwritten": queue.dropped_overwritten, "masked_stale": self.masked_stale,
                    "policy_version": queue.policy_version, "schedule": self.schedule.name,
                    "dispatches": dict(self.engine.dispatches), "compiles": dict(self.engine.compiles),
                    "stages": self.timeline.summary(), "exposed_path": self.timeline.exposed_path()}

    # -- checkpoints ------------------------------------------------------------------------------------------------
    def save(self, directory, *, step: Optional[int] = None, max_to_keep: Optional[int] = 3, block: bool = False):
        """Checkpoint the plane as step ``step`` (default: one past the newest) of ``directory``, keeping the newest
        ``max_to_keep`` steps (see ``rollout_checkpoint``). The staged groups are written first and the state is
        copied under the plane's lock; a background thread writes the copy (``block=True``: done before this
        returns). Returns a ``checkpoint.SaveHandle`` (``wait()``). Batches a prefetching schedule already drew
        (``in_flight()``) are not in the state: the checkpoint does not hold them, and a ``ConduitWarning`` says how
        many."""
        from conduit_jax import rollout_checkpoint

        return rollout_checkpoint.save(self, directory, self._written, step=step, max_to_keep=max_to_keep, block=block)

    @classmethod
    def restore(cls, directory, *, step: Optional[int] = None, schedule: Optional[schedule_lib.Schedule] = None,
                mesh=None, learner_mesh=None, **expected) -> "RolloutPlane":
        """A plane rebuilt from step ``step`` (default: the newest) of a checkpoint directory, bit-exact, its host
        bookkeeping rebuilt from the state: it delivers the batches the saved plane would have. ``schedule``
        (default: the recorded one), ``mesh`` (default: one device) and ``learner_mesh`` are the new plane's; any
        other constructor argument given (``spec``, ``token_capacity``, ``layout``, ...) must equal the recorded
        one. Raises ``CheckpointError`` for a missing, unfinished, corrupted or mismatching checkpoint."""
        from conduit_jax import rollout_checkpoint

        restored = rollout_checkpoint.read(directory, step=step, schedule=schedule, mesh=mesh, **expected)
        plane = cls(**restored.settings, mesh=mesh, learner_mesh=learner_mesh)
        plane.masked_stale = restored.masked_stale
        plane.state = restored.state
        return plane

    def close(self) -> None:
        """Stop the delivery worker; prefetched batches stay deliverable. Idempotent."""
        self._schedule.close()

    def __enter__(self) -> "RolloutPlane":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
