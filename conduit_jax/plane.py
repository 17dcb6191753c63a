"""ExperienceDataPlane: the one imperative shell, host policy over the engine's kernels.

The shell decides; the engine (``engine.py``) runs. Here: input checks before anything touches state (a rejected call
leaves the state exactly as it was), waits, rate-limit and queue decisions, the delivery schedule, deferred priority
updates. Everything that must survive a checkpoint is in ``plane.state``; the shell's own host-side values are either
derived from it (the status counters) or transient delivery bookkeeping (batches in flight, deferred updates), which
``save()`` settles first. The schedule's host side (batches in flight, deferred updates, and for a prefetching
schedule the delivery worker thread that draws them) is ``delivery.Scheduler``; it runs under this shell's lock and
reaches the plane only through the callables it is given. Code that runs inside ``jax.jit`` uses the functional API
(``functional.py``) instead.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from conduit_jax import checkpoint, functional, limits, memory, metrics, replay, runtime, samplers
from conduit_jax import schedule as schedule_lib
from conduit_jax import staging as staging_lib
from conduit_jax.delivery import CountedLock, Scheduler, check_version, checked_timeout, wait_until, weakly
from conduit_jax.engine import Engine
from conduit_jax.errors import CapacityError, ConfigError, NotEnoughDataError, RateLimitedError, SpecError
from conduit_jax.limits import LimiterState, Staleness
from conduit_jax.replay import Delivery, ReplayState
from conduit_jax.spec import checked_priority_update


class ExperienceDataPlane:
    """Sharded experience storage with a sampler, behind ``ingest`` / ``sample`` / ``deliver``.

    Args:
      spec: an ``ExperienceSpec`` or a pytree of ``jax.ShapeDtypeStruct`` describing one item.
      capacity: items the plane holds; split evenly over the shards, so a multiple of the shard count.
      sampler: a ``samplers.*`` policy; default ``samplers.uniform(256)``.
      limiter: a ``limits.*`` rate limiter; default ``limits.min_size(1)``.
      staleness: ``limits.Staleness(max_versions, key)``: deliver only items at most that many policy versions old.
      schedule: when ingests are written and how ``deliver()`` overlaps sampling with the learner
        (``schedule.staged()`` by default: ingests ride the next draw's kernel; ``schedule.sync()``: the eager
        baseline, a kernel per call). A schedule
        that prefetches runs a delivery worker thread (``delivery.py``) until ``close()`` (or the plane is collected;
        ``with ExperienceDataPlane(...) as plane:`` closes it).
      mesh: the devices to shard over (every axis of the mesh is used); default every local device on one axis.
      plan: a ``placement.Plan`` for this spec and capacity: its mesh, and a memory kind for each state part.
      seed: seeds the sampler's random stream.
      cast: accept int64/float64 leaves and narrow them to the spec's 32-bit dtypes (x64 is off in JAX).
      state: start from this state (a ``ReplayState`` of this configuration, e.g. from the functional API or a
        checkpoint) instead of an empty one.
      staging: items the host staging area holds before a kernel writes them (default: 8 MiB of packed rows, at
        most ``capacity``); an ingest that finds it full writes it first, one kernel per full area.
    """

    def __init__(self, spec, capacity: int, sampler: Optional[samplers.Sampler] = None, *,
                 limiter: Optional[limits.Limiter] = None, staleness: Optional[Staleness] = None,
                 schedule: Optional[schedule_lib.Schedule] = None, mesh: Optional[Mesh] = None, plan=None,
                 seed: int = 0, cast: bool = False, state: Optional[ReplayState] = None,
                 staging: Optional[int] = None):
        self.schedule = schedule_lib.staged() if schedule is None else schedule
        if not isinstance(self.schedule, schedule_lib.Schedule):
            raise ConfigError(f"ExperienceDataPlane(): schedule must be a schedule.* policy (e.g. "
                              f"schedule.overlap(2)), got {type(self.schedule).__name__}")
        schedule_lib.rebuilt(self.schedule, "ExperienceDataPlane()")
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise ConfigError(f"ExperienceDataPlane(): seed must be an int, got {seed!r}")
        self.config, shardings = functional.configure(spec, capacity, sampler, limiter=limiter,
                                                      staleness=staleness, mesh=mesh, plan=plan)
        self.spec, self.sampler, self.limiter = self.config.layout.spec, self.config.sampler, self.config.limiter
        self.mesh, self.plan, self.cast = self.config.mesh, plan, bool(cast)
        schedule_lib.warn_if_synchronous(self.schedule, self.mesh.devices.flat, stacklevel=3)
        staging_rows = None if staging is None else staging_lib.checked_rows(staging, self.config.capacity,
                                                                             "ExperienceDataPlane()")
        self.engine = Engine(self.config, shardings, int(seed) if state is None else None,
                             staging_rows=staging_rows, timing_dependent=self.schedule.depth > 0)
        if state is not None:
            self.engine.state = state
        self.timeline = metrics.Timeline()  # wall-clock spans per stage (see metrics.py)
        self._lock = CountedLock()  # guards state; held by every call and by the delivery worker's draws
        self._changed = threading.Condition(self._lock)  # notified after every ingest and sample
        # the schedule's host side (batches in flight, deferred updates, the delivery worker); it reaches the plane
        # through weak references, so an unclosed plane is freed as usual and its worker stops
        self._schedule = Scheduler(self.schedule, self._lock, self.capacity, self.timeline,
                                   draw=weakly(self, "sample"), admits=weakly(self, "can_sample"),
                                   pend=weakly(self, "_pend"), refresh=weakly(self, "_refreshed"))
        weakref.finalize(self, self._schedule.close)

    # -- the state ------------------------------------------------------------------------------------------------
    @property
    def state(self) -> ReplayState:
        """The whole plane as one pytree (storage, sampler, limiter, counters): what a checkpoint saves, and the
        state the functional API (``plane.buffer()``) works on."""
        with self.held():
            return self.engine.state

    @state.setter
    def state(self, value: Optional[ReplayState]) -> None:
        runtime.refuse_under_trace("plane.state = ...", "assign the state your jitted function returns")
        with self._changed:
            self._schedule.settle()
            self.engine.state = value  # what was given before goes into the state being replaced, in order
            self._schedule.switched()  # its policy version may differ

    @property
    def shardings(self):
        """Where each leaf of ``state`` lives: a ``ReplayState`` of ``NamedSharding``."""
        return self.engine.shardings

    def buffer(self) -> functional.Buffer:
        """The functional API over this plane's configuration: pure ``init / ingest / sample / update / can_sample``
        for a learner that runs its loop inside ``jax.jit`` (start from ``plane.state``, assign the result back)."""
        return functional.bind(self.config, self.engine.shardings)

    @contextlib.contextmanager
    def held(self):
        """Hold the plane still: no other call runs inside the block, and staged ingests and checked priority updates
        are in the state.
        What a consistent snapshot needs (``checkpoint.save`` reads ``state`` and ``host_side()`` under it); the
        delivery worker has done what it could first, so the block sees what a plane without one would."""
        with self._changed:
            self._schedule.settle()
            self.engine.flush()
            yield self

    def host_side(self) -> dict[str, int]:
        """What lives on the host outside ``state``: batches in flight (for a consuming sampler their items have left
        the queue) and deferred priority updates not yet applied (their id count)."""
        deferred = self._schedule.deferred
        return {"in_flight": len(self._schedule.in_flight), "deferred_updates": deferred.count() if deferred else 0}

    def block_until_ready(self) -> "ExperienceDataPlane":
        """Wait until every item ingested and every update given so far is in the state, and every kernel
        dispatched on it has finished."""
        with self._changed:
            self.engine.block_until_ready()
        return self

    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def num_shards(self) -> int:
        return self.config.num_shards

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    def __len__(self) -> int:
        with self._changed:
            return self._known()["size"]

    def __repr__(self) -> str:
        return (f"ExperienceDataPlane({self.spec}, capacity={self.capacity}, sampler={self.sampler.name}"
                f"(batch_size={self.batch_size}), shards={self.num_shards})")

    # -- ingest -------------------------------------------------------------------------------------------------
    def ingest(self, batch, *, timeout: Optional[float] = 0.0) -> None:
        """Validate a batch (leading item axis on every leaf) and take it into the plane.

        Under every schedule but ``sync`` a host batch is staged: packed into a host staging area (a copy) and
        written into the rings by the next kernel that runs anyway (a draw, the delivery worker's refill, a read of
        the state), in that kernel's dispatch; ``sync`` writes it with a kernel of its own now. Either way the items
        count from the moment ``ingest`` returns: ``len()``, the rate limiter, a queue's capacity and every later
        draw see them. Device arrays already on the plane's mesh are packed into rows on the device, by a small
        kernel that does not take the plane's state, and wait for the next kernel likewise (``sync``: written now).

        Raises ``SpecError`` for a malformed batch. When the rate limiter or a queue's capacity refuses the batch,
        waits up to ``timeout`` seconds (None: forever; 0: not at all) for a sample to make room, then raises
        ``RateLimitedError`` / ``CapacityError``. Whatever is raised, nothing was written and nothing is dropped.
        The plane keeps no reference to NumPy input: the caller may reuse its buffers once ``ingest`` returns.
        A staged ingest never releases the GIL: a thread that does nothing but ingest in a loop leaves other Python
        threads (a learner sampling) little of it; pace such producers with a rate limiter
        (``limits.sample_to_insert_ratio``), as actors stepping environments pace themselves.
        """
        runtime.refuse_under_trace("ingest()", "state = buffer.ingest(state, batch)")
        start = time.perf_counter()  # the whole call is part of the caller's exposed path (a refused one: nothing)
        timeout = checked_timeout(timeout, "ingest()")
        leaves, n = replay.checked_batch(self.config, batch, "ingest()", cast=self.cast)
        with self._changed:
            if self._ingest_gated:
                self._wait_until(lambda: self._ingest_refusal(n), timeout)
            self.engine.ingest(batch, n, staged=self.schedule.stage, leaves=leaves)
            self._changed.notify_all()
            drawn = self._schedule.ingested()  # a rollout's first minibatch is drawn as it is ingested
        self._schedule.finish_ingest(drawn)
        self.timeline.record("ingest", start, time.perf_counter())
        if self._lock.waiting:
            # a staged ingest is a copy, so a producer thread in a loop of them would take the lock again before a
            # thread blocked on it runs (CPython's locks are not fair; a kernel of its own used to release the GIL):
            # let it in
            time.sleep(0)

    def can_ingest(self, n: int = 1) -> bool:
        """Whether ``n`` items would be admitted now (rate limiter and queue capacity)."""
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"can_ingest(): n must be an int >= 1 (items), got {n!r}")
        with self._changed:
            return self._ingest_refusal(n) is None

    @property
    def _ingest_gated(self) -> bool:
        """Whether an ingest can be refused (a queue's capacity, or a limiter that limits inserts)."""
        return self.sampler.consumes or self.limiter.limits_inserts

    def _ingest_refusal(self, n: int):
        """None if an n-item ingest may run now, else (error type, message)."""
        if not self._ingest_gated:
            return None
        status = self._known()
        if self.sampler.consumes and status["deliverable"] + n > self.capacity:
            pending = status["deliverable"]
            return CapacityError, (
                f"ingest(): the {self.sampler.name} queue holds {pending} undelivered items of {self.capacity}; "
                f"{n} more would overwrite {pending + n - self.capacity} of them. Sample first, or ingest at most "
                f"{self.capacity - pending} items")
        if not self.limiter.can_insert(LimiterState(status["limiter_balance"]), status["size"]):
            return RateLimitedError, (f"ingest(): the rate limiter {self.limiter.name} admits no insert until more "
                                      f"is sampled")
        balance = status["limiter_balance"]
        if int(self.limiter.on_insert(LimiterState(balance), n).balance) > np.iinfo(np.int32).max:
            per_item = int(self.limiter.on_insert(LimiterState(0), 1).balance)
            return CapacityError, (f"ingest(): {n} items in one call would carry the rate limiter "
                                   f"{self.limiter.name}'s balance past int32; ingest at most "
                                   f"{(np.iinfo(np.int32).max - balance) // per_item} items per call")
        return None

    # -- sample -------------------------------------------------------------------------------------------------
    def sample(self, *, timeout: Optional[float] = 0.0, recycle: Optional[Delivery] = None) -> Delivery:
        """One batch: ``Delivery(data, ids, weights, mask)``, sharded over the plane's shard axes, drawn now (a
        prefetching schedule's batches in flight are ``deliver()``'s: for a queue, items in them have left it, and a
        ``sample()`` that finds too few left says so, naming them).

        When the sampler cannot deliver a full batch or the rate limiter refuses, waits up to ``timeout`` seconds
        (None: forever; 0: not at all) for an ingest, then raises ``NotEnoughDataError`` / ``RateLimitedError`` with
        the state unchanged.

        ``recycle``: an earlier ``Delivery`` of this plane that the caller is done with. The new batch is written
        into its buffers, which are donated (its arrays are deleted, as any donated argument of a jit), so a large
        batch lands in memory that is already mapped. Checked first (``SpecError`` when its structure, shapes, dtypes
        or shardings are not this plane's batches, or it was already donated).
        """
        runtime.refuse_under_trace("sample()", "state, delivery = buffer.sample(state)")
        timeout = checked_timeout(timeout, "sample()")
        with self._changed:
            self._schedule.apply_due()  # every deferred update due now is in (the priority staleness bound)
            self._wait_until(self._sample_refusal, timeout)
            self._check_recycle(recycle, "sample()")
            start = time.perf_counter()
            delivery = self.engine.sample(recycle)
            self.timeline.record("sample", start, time.perf_counter())
            self._changed.notify_all()
        return delivery

    def _check_recycle(self, recycle: Optional[Delivery], where: str) -> None:
        if recycle is None:
            return
        if not isinstance(recycle, Delivery):
            raise SpecError(f"{where}: recycle must be a Delivery this plane returned, got {type(recycle).__name__}")
        schedule = self._schedule
        if recycle is schedule.last_delivered:
            # what the last deliver() returned has the engine's layout and is no longer the schedule's (a batch in
            # flight or handed over is another object); only a donation can spoil it. Its leaves were listed by the
            # worker, so this costs the learner's thread no tree walk
            leaves = schedule.last_delivered_leaves or jax.tree_util.tree_leaves(recycle)
            if not any(leaf.is_deleted() for leaf in leaves):
                return
        elif schedule.holds(recycle):
            raise SpecError(f"{where}: recycle is a batch still queued for deliver() (or already handed over for "
                            f"recycling); only a delivered batch the learner is done with can be recycled")
        self.engine.check_recycle(recycle, where)

    def can_sample(self) -> bool:
        """Whether ``sample()`` would deliver now without waiting."""
        with self._changed:
            return self._sample_refusal() is None

    def _sample_refusal(self):
        sampler, limiter = self.sampler, self.limiter
        status = self._known(need_deliverable=True)
        if status["deliverable"] < sampler.min_items:
            what = {"fifo": "undelivered items", "sequences": "eligible windows"}.get(sampler.name, "stored items")
            if sampler.window > 1 and sampler.deliverable is None:  # uniform padded windows: counted in items
                what = f"stored items ({sampler.window} steps of each of {sampler.streams} streams)"
            prefetched = len(self._schedule.in_flight) if sampler.consumes else 0
            if prefetched:  # their items have left the queue: deliver() hands them over
                return NotEnoughDataError, (
                    f"sample(): the {sampler.name} sampler needs at least {sampler.min_items} {what} for a batch of "
                    f"{self.batch_size}, the queue has {status['deliverable']}; {prefetched * self.batch_size} more "
                    f"wait in {prefetched} batches the {self.schedule.name} schedule prefetched: take them with "
                    f"deliver(), or ingest more first")
            return NotEnoughDataError, (
                f"sample(): the {sampler.name} sampler needs at least {sampler.min_items} {what} for a batch of "
                f"{self.batch_size}, the plane has {status['deliverable']}; ingest more first (can_sample() tells "
                f"without raising)")
        if not limiter.can_sample(LimiterState(status["limiter_balance"]), status["size"], self.batch_size):
            return RateLimitedError, (f"sample(): the rate limiter {limiter.name} admits no batch of "
                                      f"{self.batch_size} now (plane holds {status['size']} items); ingest more first")
        return None

    def sample_fn(self, batches: Optional[int] = None):
        """The pure sampling step ``state -> (state, Delivery)`` for the learner's own jitted step (no dispatch of its
        own): ``plane.buffer().sample`` with ``batches`` bound. Call it on ``plane.state``, donate the state to your
        jit, store the returned state back with ``plane.state = ...``. ``Delivery.valid`` is False where the state
        could not deliver. ``batches=k`` draws k batches at once (a PPO epoch in one gather per leaf)."""
        replay.check_batches(self.config, batches, "sample_fn()")
        return functools.partial(self.buffer().sample, batches=batches)

    # -- delivery under a schedule ----------------------------------------------------------------------------------
    def deliver(self, *, timeout: Optional[float] = 0.0, recycle: Optional[Delivery] = None) -> Delivery:
        """The learner's next batch, under the plane's ``schedule`` (see schedule.py); the batch is ready (computed)
        when this returns, and the time spent here is the exposed experience-path latency.

        With ``overlap``/``deferred``/``adaptive`` the delivery worker dispatched the batch during earlier learner
        steps and waited for it; this call hands it over and lets the worker draw the next one. An error the worker
        met since the last call (e.g. a rejected deferred priority update) is raised here. ``timeout`` applies when
        no batch is in flight (as in ``sample``). ``recycle``: a delivered batch the learner is done with (as in
        ``sample``); the next batch drawn is written into its buffers (a refused draw leaves it as it is).
        """
        runtime.refuse_under_trace("deliver()", "state, delivery = buffer.sample(state)")
        timeout = checked_timeout(timeout, "deliver()")
        return self._schedule.deliver(timeout, recycle, self._check_recycle)

    def _refreshed(self, delivery: Delivery) -> Delivery:
        """``delivery`` (drawn before a policy-version switch) with its mask re-checked against the current version."""
        fresh = replay.is_fresh(self.config, delivery.data, self.state.policy_version)
        return jax.block_until_ready(delivery._replace(mask=fresh if delivery.mask is None else delivery.mask & fresh))

    def close(self) -> None:
        """Stop the delivery worker (a prefetching schedule's thread); batches in flight stay deliverable, and later
        refills are dispatched by ``deliver()`` itself. Idempotent; the plane stays usable."""
        self._schedule.close()

    def __enter__(self) -> "ExperienceDataPlane":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def in_flight(self) -> tuple[Delivery, ...]:
        """The batches the schedule dispatched and ``deliver()`` has not handed out yet, oldest first (to watch them
        compute; each is still the plane's until delivered, so it cannot be recycled)."""
        with self._changed:
            self._schedule.settle()
            return tuple(batch.delivery for batch in self._schedule.in_flight)

    @property
    def prefetch_depth(self) -> int:
        """Batches the schedule keeps in flight now (moves under ``schedule.adaptive``)."""
        return self._schedule.depth

    def _wait_until(self, refusal, timeout: Optional[float]) -> None:
        wait_until(self._changed, refusal, timeout)

    # -- priorities -----------------------------------------------------------------------------------------------
    def update_priorities(self, ids, priorities) -> None:
        """Set the priorities of delivered items: ``ids`` int32[m, 2] as in ``Delivery.ids``, ``priorities`` [m].

        NaN, infinite or negative priorities, ids of the wrong shape or out of range raise ``PriorityError`` and
        change nothing. An id whose slot has been rewritten since it was delivered is ignored (never applied to the
        new item) and counted in ``stats()['priority_updates_ignored']``. Under a ``deferred`` schedule the update
        is queued and checked when it is applied, k steps later: a bad one raises from that later call, naming the
        step it was reported at, and is dropped whole. A checked update takes effect for every later call; its kernel
        work rides in the next ``sample()``'s kernel call, or runs on its own first when another call reads the state.
        Items staged before it are written before it applies, by the same kernel, so it applies to the state they are
        in.
        """
        runtime.refuse_under_trace("update_priorities()", "state = buffer.update(state, ids, priorities)")
        start = time.perf_counter()
        waited = self._update_priorities(ids, priorities)
        # the call is part of the caller's exposed path (a refused one: nothing), except the wait for its own TD
        # errors to be computed: that is the learner's step, recorded apart
        if waited:
            self.timeline.record("td_wait", start, start + waited)
        self.timeline.record("update", start + waited, time.perf_counter())

    def _update_priorities(self, ids, priorities) -> float:
        """Check and queue the update; returns the seconds spent waiting for ``priorities`` to be computed."""
        if self.sampler.update is None:
            raise ConfigError(f"update_priorities(): the {self.sampler.name} sampler has no priorities; build the "
                              f"plane with samplers.prioritized(...) to use them")
        if self.schedule.defer:
            # queued as given (reading device arrays now would wait for the learner step that computes them);
            # checked when applied, k steps later (by the delivery worker, before its next draw)
            return self._schedule.report_update(ids, priorities)
        waited = 0.0
        if isinstance(priorities, jax.Array) and not priorities.is_deleted() and not priorities.is_ready():
            # the learner's step still computes them
            begin = time.perf_counter()
            priorities.block_until_ready()
            waited = time.perf_counter() - begin
        checked = checked_priority_update(ids, priorities, self.capacity)
        with self._changed:  # applied right after the rows ingested before it, by the kernel that writes them
            self.engine.pend(checked, after_staged=True)
        return waited

    def _pend(self, checked) -> None:
        """Queue checked priority updates for the next kernel (the schedule's deferred updates, when due)."""
        self.engine.pend(checked)

    # -- checkpoints, placement, policy version ---------------------------------------------------------------------
    def save(self, directory, **options):
        """Checkpoint the whole plane asynchronously (see ``checkpoint.save``; returns a handle with ``wait()``).

        Deferred priority updates are applied first, so the checkpoint holds them. A queue's prefetched batches have
        already left the queue: saving then would lose them, so it is refused until they are delivered."""
        with self.held():
            if self.sampler.consumes and self._schedule.in_flight:
                raise ConfigError(f"save(): {len(self._schedule.in_flight)} prefetched {self.sampler.name} batches are in "
                                  f"flight; deliver() them first (their items have left the queue and a checkpoint "
                                  f"would lose them)")
            self._schedule.apply_due(everything=True)
            return checkpoint.save(self, directory, **options)

    @classmethod
    def restore(cls, directory, **options) -> "ExperienceDataPlane":
        """A plane rebuilt from a checkpoint, bit-exact, on ``mesh``/``plan`` if given (see ``checkpoint.restore``)."""
        return checkpoint.restore(directory, cls, **options)

    def replan(self, plan) -> None:
        """Move the live state to another plan's devices and memory kinds. Every item keeps its id: the shard count
        must stay (a different count deals items to other shards and slots, i.e. renumbers them; checkpoint and
        restore onto the new mesh for that). In-flight batches stay valid."""
        from conduit_jax.placement import PlacementError

        functional.check_plan(plan, None, "replan()")
        new_mesh = plan.mesh()
        config = self.config._replace(mesh=new_mesh, axes=tuple(new_mesh.axis_names))
        functional.check_plan(plan, config, "replan()")
        if config.num_shards != self.num_shards:
            raise PlacementError(f"replan(): the plan has {config.num_shards} shards, the plane {self.num_shards}; a "
                                 f"live migration keeps the shard count so no item is renumbered")
        self._move(config, plan.shardings(config), "replan()")
        self.plan = plan

    def place(self, shardings) -> None:
        """Move the live state to other memory kinds on the same mesh (a ``ReplayState`` of ``NamedSharding``, e.g.
        ``jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), plane.shardings)``); the kernels from now on
        keep it there."""
        leaves, treedef = jax.tree_util.tree_flatten(shardings)
        if not isinstance(shardings, ReplayState) or treedef != jax.tree_util.tree_structure(self.shardings) or \
                not all(isinstance(s, NamedSharding) and s.mesh == self.mesh for s in leaves):
            raise ConfigError("place(): shardings must be a ReplayState of NamedSharding on the plane's mesh (e.g. "
                              "plane.shardings with other memory kinds); to move to another mesh use replan(plan) or "
                              f"a checkpoint, got {type(shardings).__name__}")
        self._move(self.config, shardings, "place()")

    def _move(self, config, shardings, where: str) -> None:
        memory.check_fits(self.engine.abstract, shardings, config.capacity, config.num_shards, where,
                          already=self.shardings)
        with self._changed:
            engine = Engine(config, shardings, seed=None, staging_rows=self.engine.staging.rows,
                            timing_dependent=self.engine.timing_dependent, pending=self.engine.pending)
            engine.compiles.update(self.engine.compiles)
            engine.state = self.state  # moved to the new shardings
            self.config, self.mesh, self.engine = config, config.mesh, engine
            self._schedule.last_delivered = None  # delivered in the old layout: a recycle of it is checked in full

    def set_policy_version(self, version: int) -> None:
        """Tell the plane the learner's current policy version (it never goes back). With ``staleness`` set, items
        more than ``max_versions`` behind are never delivered from now on."""
        runtime.refuse_under_trace("set_policy_version()", "state = buffer.set_policy_version(state, version)")
        check_version(version, 0)  # its type and range before held() writes what is staged
        with self.held():
            check_version(version, self.engine.status()["policy_version"])
            self.engine.set_policy_version(version)
            self._schedule.switched()  # batches drawn before this are re-checked when delivered
            self._changed.notify_all()

    # -- status -------------------------------------------------------------------------------------------------
    def _known(self, need_deliverable: bool = False) -> dict[str, Any]:
        """The engine's host copy of the status scalars (read from the device after what is staged when unknown)."""
        return self.engine.known(need_deliverable)

    def compile_counts(self) -> dict[str, int]:
        """XLA compilations per kernel so far (counted from JAX's compile events); steady state adds none."""
        return self.engine.compile_counts()

    def stats(self) -> dict[str, Any]:
        """Counters of the plane, read from the state (``Engine.stats``), plus the shell's wall-clock timings per
        call (``stages``), the kernels it dispatched (``dispatches``) and the exposed experience path (``exposed_path``:
        ingest + deliver + priority updates on the learner's thread, ``Timeline.exposed_path``)."""
        with self.held():
            out = self.engine.stats()
        out.update(schedule=self.schedule.name, prefetch_depth=self._schedule.depth, stages=self.timeline.summary(),
                   exposed_path=self.timeline.exposed_path())
        return out
