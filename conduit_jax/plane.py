"""ExperienceDataPlane: the one imperative shell around the pure data plane in ``replay.py``.

The shell owns the state pytree, the compiled kernels (one ingest kernel per batch-size bucket, one sample kernel)
and donation. Its kernels take and return the state in a ``LeafBundle`` form, the large leaves plus every scalar
counter in one small vector (each array through a jit boundary costs dispatch time); ``plane.state`` is the pytree
itself, assembled from that form when it is read. The shell validates every input on the host before anything
touches state, so a rejected call leaves the state exactly as it was. Everything that must survive a checkpoint is
in ``plane.state``; the shell's own host-side values are either derived from it (the status counters) or transient
delivery bookkeeping (batches in flight, deferred updates), which ``save()`` settles first.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import warnings
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh

from conduit_jax import limits, metrics, replay, runtime, samplers, storage
from conduit_jax import schedule as schedule_lib
from conduit_jax.errors import (CapacityError, ConduitWarning, ConfigError, NotEnoughDataError, PriorityError,
                                RateLimitedError, SpecError)
from conduit_jax._pytree import LeafBundle
from conduit_jax._pytree import replace as _replace
from conduit_jax.limits import LimiterState, Staleness
from conduit_jax.replay import Delivery, ReplayConfig, ReplayState
from conduit_jax.spec import ExperienceSpec

DEFAULT_AXIS = "shard"


def default_mesh(num_devices: Optional[int] = None, axis: str = DEFAULT_AXIS) -> Mesh:
    """A 1-D mesh over the first ``num_devices`` local devices (all by default), axis type Auto."""
    devices = jax.local_devices()
    num = len(devices) if num_devices is None else num_devices
    if not 1 <= num <= len(devices):
        raise ConfigError(f"default_mesh(): num_devices must be in [1, {len(devices)}], got {num_devices}")
    return jax.make_mesh((num,), (axis,), axis_types=(AxisType.Auto,), devices=devices[:num])


class ExperienceDataPlane:
    """Sharded experience storage with a sampler, behind ``ingest`` / ``sample``.

    Args:
      spec: an ``ExperienceSpec`` or a pytree of ``jax.ShapeDtypeStruct`` describing one item.
      capacity: items the plane holds; split evenly over the shards, so a multiple of the shard count.
      sampler: a ``samplers.*`` policy; default ``samplers.uniform(256)``.
      limiter: a ``limits.*`` rate limiter; default ``limits.min_size(1)``.
      staleness: ``limits.Staleness(max_versions, key)``: deliver only items at most that many policy versions old.
      schedule: how ``deliver()`` overlaps sampling with the learner (``schedule.sync()`` by default).
      mesh: the devices to shard over (every axis of the mesh is used); default every local device on one axis.
      plan: a ``placement.Plan`` for this spec and capacity: its mesh, and a memory kind for each state part.
      seed: seeds the sampler's random stream.
      cast: accept int64/float64 leaves and narrow them to the spec's 32-bit dtypes (x64 is off in JAX).
    """

    def __init__(self, spec, capacity: int, sampler: Optional[samplers.Sampler] = None, *,
                 limiter: Optional[limits.Limiter] = None, staleness: Optional[Staleness] = None,
                 schedule: Optional[schedule_lib.Schedule] = None, mesh: Optional[Mesh] = None, plan=None,
                 seed: int = 0, cast: bool = False):
        self.spec = spec if isinstance(spec, ExperienceSpec) else ExperienceSpec.from_structs(spec)
        self.sampler = samplers.uniform(256) if sampler is None else sampler
        if not isinstance(self.sampler, samplers.Sampler):
            raise ConfigError(f"ExperienceDataPlane(): sampler must be a samplers.Sampler (e.g. "
                              f"samplers.uniform(256)), got {type(self.sampler).__name__}")
        self.limiter = limits.min_size(1) if limiter is None else limiter
        if not isinstance(self.limiter, limits.Limiter):
            raise ConfigError(f"ExperienceDataPlane(): limiter must be a limits.Limiter (e.g. "
                              f"limits.sample_to_insert_ratio(...)), got {type(self.limiter).__name__}")
        self.limiter.check(self.sampler.batch_size)
        self.schedule = schedule_lib.sync() if schedule is None else schedule
        if not isinstance(self.schedule, schedule_lib.Schedule):
            raise ConfigError(f"ExperienceDataPlane(): schedule must be a schedule.* policy (e.g. "
                              f"schedule.overlap(2)), got {type(self.schedule).__name__}")
        if plan is not None and mesh is not None:
            raise ConfigError("ExperienceDataPlane(): pass mesh or plan, not both (a plan brings its mesh: "
                              "plan.mesh())")
        self.mesh = plan.mesh() if plan is not None else default_mesh() if mesh is None else mesh
        if self.schedule.depth and runtime.prefetch_is_synchronous(self.mesh.devices.flat):
            warnings.warn(f"ExperienceDataPlane(): schedule {self.schedule.name} prefetches, but JAX's CPU async "
                          f"dispatch is off (jax_cpu_enable_async_dispatch=False; configure_cpu()'s default), so each "
                          f"prefetched batch is computed inside the deliver() that dispatches it and nothing hides "
                          f"behind the learner; use configure_cpu(async_dispatch=True) or schedule.sync()",
                          ConduitWarning, stacklevel=2)
        self.cast = bool(cast)
        config = ReplayConfig(storage.RowLayout.of(self.spec), self.sampler, self.limiter, staleness, self.mesh,
                              tuple(self.mesh.axis_names), capacity if isinstance(capacity, int) else -1)
        _check_config(config, capacity)
        if plan is not None:
            _check_plan(plan, config)
        self.config = config
        self._shardings = replay.shardings(config) if plan is None else plan.shardings(config)
        self.plan = plan
        # the status scalars the shell decides on (size, deliverable, limiter balance), kept in step on the host by
        # the same arithmetic the kernels do; reading them from the device would wait for every batch in flight.
        # None: unknown (fresh state assigned from outside), read from the device once.
        self._counters: Optional[dict[str, Any]] = None
        # a sampler whose deliverable count is an index (windows or items with mass), not arithmetic on calls: each
        # kernel that can change it also returns it, and the shell reads that scalar only when a check needs it,
        # by then long computed (a status kernel of its own cost ~100 us on every sample)
        self._reports_deliverable = self.sampler.deliverable is not None and not self.sampler.consumes
        # XLA:CPU runs the collectives of an emulated multi-device mesh in-process; with many multi-device programs
        # queued on few cores one device's part can miss the rendezvous and XLA aborts the process (seen here after
        # ~300 back-to-back priority updates on 8 emulated devices). There, each kernel completes before the next.
        self._one_at_a_time = self.num_shards > 1 and self.mesh.devices.flat[0].platform == "cpu"
        self._build_kernels()
        # the state, in one or both of two forms that agree: the pytree (``_tree``: what ``plane.state`` returns and
        # accepts) and the kernels' form (``_form``: storage's large leaves, the rest's large leaves, the small
        # leaves' vector; see _pytree.LeafBundle). Kernels produce the form; reading plane.state joins it once.
        bundle = self._bundle
        self._tree: Optional[ReplayState] = None
        self._keep_form(*jax.jit(lambda: bundle.split(replay.init(config, seed)),
                                 out_shardings=(bundle.large_shardings, bundle.small_sharding))())
        self._compiles: collections.Counter = collections.Counter()  # kernel name -> XLA compilations
        self.timeline = metrics.Timeline()  # wall-clock spans per stage (see metrics.py)
        self._changed = threading.Condition()  # guards state; notified after every ingest and sample
        self._in_flight: collections.deque = collections.deque()  # dispatched, not yet delivered batches
        self._queued_updates: collections.deque = collections.deque()  # (step, ids, priorities), deferred policy
        # checked priority updates not yet in the state: the next sample applies them in its own kernel call (one
        # dispatch for both); anything else that reads the state applies them first (_flush_updates)
        self._pending_updates: list[tuple[np.ndarray, np.ndarray]] = []
        # (host array, an output of the ingest that read it): reused for the next batch once that ingest is done
        self._last_staging: Optional[tuple[np.ndarray, jax.Array]] = None
        self._depth = self.schedule.depth  # current prefetch depth (moves under the adaptive policy)
        self._step = 0  # deliver() calls so far
        self._last_delivery_end: Optional[float] = None
        self._smoothed = {"exposed": 0.0, "learner": 0.0}  # exponential averages (s) the adaptive policy reads

    def _build_kernels(self) -> None:
        """Compile-on-first-use kernels for the current config and shardings (a replan builds new ones)."""
        config, shardings = self.config, self._shardings
        abstract = jax.eval_shape(functools.partial(replay.init, config, 0))
        self._bundle = bundle = LeafBundle(abstract, shardings)
        self._storage_large = bundle.count_large(len(jax.tree_util.tree_leaves(abstract.storage)))
        self._ingest_kernels: dict[tuple[int, bool], Any] = {}  # (rows, host-packed) -> kernel
        # + the deliverable count, for samplers that keep it in an index; a draw changes it only where it retires
        # items, so the sample kernels report it only then
        reports, sample_reports = self._reports_deliverable, self._reports_deliverable and self.sampler.sampling_retires

        def update_sample(state, updates):
            return replay.sample(config, _replace(state, sampler=replay.update(config, state, *_unpacked(updates))))

        sample_step = self._reporting(functools.partial(replay.sample, config), sample_reports)
        update_sample_step = self._reporting(update_sample, sample_reports)
        reading = functools.partial(_reading_storage, bundle=bundle, storage_large=self._storage_large)
        deliver = functools.partial(reading,
                                    compiler_options=runtime.delivery_compiler_options(config.mesh.devices.flat))
        self._sample_kernel = deliver(sample_step, num_outputs=1 + sample_reports)
        self._update_sample_kernel = deliver(update_sample_step, num_outputs=1 + sample_reports)
        # the same two with a finished Delivery donated: XLA writes the new batch into its buffers (sample(recycle=))
        self._recycling_kernels = {
            pending: deliver(step, num_outputs=1 + sample_reports, recycles=True)
            for pending, step in ((False, sample_step), (True, update_sample_step))}
        self._delivery_layout = None  # (treedef, [(shape, dtype, sharding)]) of the batches these kernels deliver
        self._version_kernel = reading(self._reporting(lambda state, version: (
            replay.set_policy_version(config, state, version),), reports), num_outputs=int(reports))
        self._update_kernel = reading(lambda state, updates: (
            _replace(state, sampler=replay.update(config, state, *_unpacked(updates))),), num_outputs=0)
        self._status_kernel = jax.jit(lambda *form: replay.status(config, _joined(bundle, *form)))

    def _reporting(self, step, reports: bool):
        """``step(state, *args) -> (state', *outputs)``, with the deliverable count after it as one more output when
        ``reports``."""
        if not reports:
            return step
        config = self.config

        def reporting_step(state, *args):
            new_state, *outputs = step(state, *args)
            return (new_state, *outputs, replay.deliverable(config, new_state))

        return reporting_step

    # -- properties ---------------------------------------------------------------------------------------------
    @property
    def state(self) -> ReplayState:
        """The whole plane as one pytree (storage, sampler, limiter, counters): what a checkpoint saves."""
        with self._changed:
            self._flush_updates()
            if self._tree is None and self._form is not None:
                storage_large, rest_large, small = self._form
                self._tree = self._bundle.to_tree(storage_large + rest_large, small)
            return self._tree

    @state.setter
    def state(self, value: ReplayState) -> None:
        with self._changed:
            self._flush_updates()  # they were reported against the state being replaced; keep the order of calls
            self._set_tree(value)
            self._counters = None

    def block_until_ready(self) -> "ExperienceDataPlane":
        """Wait until every kernel dispatched on the state so far has finished (``jax.block_until_ready`` on
        ``plane.state``, without assembling the state from the kernels' form)."""
        with self._changed:
            jax.block_until_ready(self._form)
        return self

    def _keep_form(self, large, small) -> None:
        """A new state in the kernels' form (all its large leaves, the small leaves' vector), kept as ``_form``; the
        pytree is assembled again only if someone reads it."""
        self._form = (tuple(large[:self._storage_large]), tuple(large[self._storage_large:]), small)
        self._tree = None

    def _set_tree(self, tree: Optional[ReplayState]) -> None:
        """A state assigned from outside, split into the kernels' form now (its large leaves are shared, so the
        pytree stays valid too). None frees the state (a restore does, before reading the saved one)."""
        self._form = None
        if tree is not None:
            self._keep_form(*self._bundle.from_tree(tree))
        self._tree = tree

    def _run_reading(self, name: str, kernel, *args) -> list:
        """Call a kernel built by ``_reading_storage`` on the state (its compilations counted under ``name``), keep
        the state it returns, return its outputs. Callers hold ``self._changed``."""
        storage_large, rest_large, small = self._form
        with self._counting_compiles(name):
            rest_large, small, *outputs = self._settled(kernel(storage_large, rest_large, small, *args))
        self._keep_form(storage_large + tuple(rest_large), small)
        return outputs

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
        """Validate a batch (leading item axis on every leaf) and write it into the rings.

        Raises ``SpecError`` for a malformed batch. When the rate limiter or a queue's capacity refuses the batch,
        waits up to ``timeout`` seconds (None: forever; 0: not at all) for a sample to make room, then raises
        ``RateLimitedError`` / ``CapacityError``. Whatever is raised, nothing was written and nothing is dropped.
        The plane keeps no reference to NumPy input: the caller may reuse its buffers once ``ingest`` returns.
        """
        n = self.spec.validate(batch, cast=self.cast)
        if n % self.sampler.streams:
            raise SpecError(f"ingest(): the {self.sampler.name} sampler takes whole steps of {self.sampler.streams} "
                            f"streams (time-major), so a batch must hold a multiple of {self.sampler.streams} items; "
                            f"got {n}")
        leaves = jax.tree_util.tree_leaves(batch)
        with self._changed:
            self._wait_until(lambda: self._ingest_refusal(n), timeout)
            self._flush_updates()
            start_time = time.perf_counter()
            chunk = self.capacity  # one kernel call writes at most a full ring per shard
            for start in range(0, n, chunk):
                m = min(chunk, n - start)
                rows = self.num_shards * storage.bucket_size(m, self.num_shards, self.config.shard_capacity)
                whole = start == 0 and m == rows
                if whole and all(isinstance(leaf, jax.Array) for leaf in leaves):
                    # device arrays of exactly a bucket's size go in as they are and are packed on the device
                    block, packed = batch, False
                else:
                    # everything else is packed on the host into one array: one transfer instead of one per leaf,
                    # the caller's buffers are never aliased, and no op runs on the unpadded shape (which would
                    # compile once per batch size)
                    block, packed = self.config.layout.pack_host(leaves, start, m, rows, self._staging(rows)), True
                with self._counting_compiles(f"ingest[{rows}{',packed' if packed else ''}]"):
                    large, small, finished, *reported = self._settled(self._ingest_kernel(rows, packed)(
                        *self._form, self.config.layout.to_ring(block) if packed else block, np.int32(m)))
                self._keep_form(large, small)
                if packed:
                    self._last_staging = (block, finished)
            self._count_ingest(n, reported)
            self.timeline.record("ingest", start_time, time.perf_counter())
            self._changed.notify_all()

    def _staging(self, rows: int) -> np.ndarray:
        """The host array a batch is packed into: the last one again when its shape fits and the ingest that read it
        has finished (JAX reads it in place), else a fresh one. Fresh pages fault on first write, which made packing
        a 4.5 MB PPO rollout take 2x as long."""
        if self._last_staging is not None:
            block, finished = self._last_staging
            if block.shape[0] == rows and finished.is_ready():
                return block
        return storage.aligned_empty((rows, self.config.layout.row_words))

    def can_ingest(self, n: int = 1) -> bool:
        """Whether ``n`` items would be admitted now (rate limiter and queue capacity)."""
        with self._changed:
            return self._ingest_refusal(n) is None

    def _ingest_refusal(self, n: int):
        """None if an n-item ingest may run now, else (error type, message)."""
        if not (self.sampler.consumes or self.limiter.limits_inserts):
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
        return None

    def _ingest_kernel(self, rows: int, packed: bool):
        """The compiled ingest for one bucket of batch rows, for host-packed rows or a pytree of device arrays."""
        kernel = self._ingest_kernels.get((rows, packed))
        if kernel is None:
            config, bundle = self.config, self._bundle

            def ingest_step(state, batch, n):
                new_state = replay.ingest(config, state, batch, n, packed=packed)
                # a scalar of its own that is ready once this ingest has finished, even after the state has been
                # donated to another jit: the staging array this ingest read is packed again only then
                return new_state, jnp.sum(new_state.storage.cursor)

            step = self._reporting(ingest_step, self._reports_deliverable)

            def ingest_kernel(storage_large, rest_large, small, batch, n):
                new_state, *outputs = step(_joined(bundle, storage_large, rest_large, small), batch, n)
                return (*bundle.split(new_state), *outputs)

            kernel = jax.jit(ingest_kernel, donate_argnums=(0, 1, 2),
                             out_shardings=(bundle.large_shardings, bundle.small_sharding, None)
                             + (None,) * int(self._reports_deliverable))
            self._ingest_kernels[(rows, packed)] = kernel
        return kernel

    # -- sample -------------------------------------------------------------------------------------------------
    def sample(self, *, timeout: Optional[float] = 0.0, recycle: Optional[Delivery] = None) -> Delivery:
        """One batch: ``Delivery(data, ids, weights, mask)``, sharded over the plane's shard axes.

        When the sampler cannot deliver a full batch or the rate limiter refuses, waits up to ``timeout`` seconds
        (None: forever; 0: not at all) for an ingest, then raises ``NotEnoughDataError`` / ``RateLimitedError`` with
        the state unchanged.

        ``recycle``: an earlier ``Delivery`` of this plane that the caller is done with. The new batch is written
        into its buffers, which are donated (its arrays are deleted, as any donated argument of a jit). A large
        batch then lands in memory that is already mapped: a fresh 7 MB output can take ~1,700 page faults on XLA:CPU,
        which can double the time of an Atari-sized batch (benchmarks W3), unless malloc keeps freed blocks
        (``runtime.configure_cpu()`` does by default). Checked first (``SpecError`` when its
        structure, shapes, dtypes or shardings are not this plane's batches, or it was already donated).
        """
        with self._changed:
            self._wait_until(self._sample_refusal, timeout)
            recycled = self._checked_recycle(recycle, "sample()")
            start_time = time.perf_counter()
            pending = self._take_pending_updates()
            donated = () if recycled is None else (recycled,)
            if pending is None:
                kernel = self._sample_kernel if recycled is None else self._recycling_kernels[False]
                delivery, *reported = self._run_reading("sample" if recycled is None else "sample[recycle]", kernel,
                                                        *donated)
            else:
                kernel = self._update_sample_kernel if recycled is None else self._recycling_kernels[True]
                delivery, *reported = self._run_reading(
                    f"update+sample[{pending.shape[0]}{'' if recycled is None else ',recycle'}]", kernel, *donated,
                    pending)
            if self._delivery_layout is None:
                self._delivery_layout = _layout_of(delivery)
            self._count_sample(reported)
            self.timeline.record("sample", start_time, time.perf_counter())
            self._changed.notify_all()
        return delivery

    def _checked_recycle(self, recycle: Optional[Delivery], where: str) -> Optional[Delivery]:
        """``recycle`` if its buffers can hold this plane's next batch, else SpecError (nothing changed)."""
        if recycle is None:
            return None
        if not isinstance(recycle, Delivery):
            raise SpecError(f"{where}: recycle must be a Delivery this plane returned, got {type(recycle).__name__}")
        if self._delivery_layout is None:
            raise SpecError(f"{where}: recycle takes a Delivery this plane returned, and it has delivered none yet")
        if any(recycle.ids is queued.ids for queued in self._in_flight):
            raise SpecError(f"{where}: recycle is a batch still queued for deliver(); only a delivered batch the "
                            f"learner is done with can be recycled")
        treedef, expected = self._delivery_layout
        leaves, got_treedef = jax.tree_util.tree_flatten(recycle)
        if got_treedef != treedef:
            raise SpecError(f"{where}: recycle must have the structure of this plane's batches, {treedef}; got "
                            f"{got_treedef}")
        for index, (leaf, (shape, dtype, sharding)) in enumerate(zip(leaves, expected)):
            if not (isinstance(leaf, jax.Array) and not leaf.is_deleted() and leaf.shape == shape
                    and leaf.dtype == dtype and leaf.sharding == sharding):
                raise _recycle_error(where, recycle, index, shape, dtype, sharding)
        return recycle

    # -- delivery under a schedule ----------------------------------------------------------------------------------
    def deliver(self, *, timeout: Optional[float] = 0.0, recycle: Optional[Delivery] = None) -> Delivery:
        """The learner's next batch, under the plane's ``schedule`` (see schedule.py); the batch is ready (computed)
        when this returns, and the time spent waiting here is the exposed experience-path latency.

        With ``overlap``/``deferred``/``adaptive`` the batch was dispatched during earlier learner steps and the next
        ones are dispatched before this returns. ``timeout`` applies when no batch is in flight (as in ``sample``).
        ``recycle``: a delivered batch the learner is done with (as in ``sample``); the first batch this call
        dispatches is written into its buffers. When this call dispatches none, it is left as it is.
        """
        with self._changed:
            self._checked_recycle(recycle, "deliver()")
        start = time.perf_counter()
        if self._last_delivery_end is not None:
            self.timeline.record("learner", self._last_delivery_end, start)
            self._smooth("learner", start - self._last_delivery_end)
        self._apply_due_updates()
        if not self._in_flight:
            self._in_flight.append(self.sample(timeout=timeout, recycle=recycle))
            recycle = None
        delivery = self._in_flight.popleft()
        self._step += 1
        self._depth = self.schedule.next_depth(self._depth, self._smoothed["exposed"], self._smoothed["learner"])
        while len(self._in_flight) < self._depth and self.can_sample():
            self._in_flight.append(self.sample(recycle=recycle))
            recycle = None
        if self.config.staleness is not None:
            delivery = self._recheck_staleness(delivery)
        jax.block_until_ready(delivery)
        self._last_delivery_end = time.perf_counter()
        self.timeline.record("exposed", start, self._last_delivery_end)
        self._smooth("exposed", self._last_delivery_end - start)
        return delivery

    def _smooth(self, stage: str, seconds: float, weight: float = 0.1) -> None:
        self._smoothed[stage] += weight * (seconds - self._smoothed[stage])

    def sample_fn(self, batches: Optional[int] = None):
        """The pure sampling step ``state -> (state, Delivery)`` for use inside the learner's own jitted step (the
        fused path: no dispatch of its own). Call it on ``plane.state``, donate the state to your jit, and store the
        returned state back with ``plane.state = ...``; the host-side checks of ``sample()`` do not run there.

        ``batches=k``: the step draws k batches at once, the draws of k successive steps with a leading [k] axis on
        every field, and gathers them in one pass (a PPO epoch of minibatches in one gather per leaf). Not for
        samplers with importance weights."""
        replay.check_batches(self.config, batches, "sample_fn()")
        return functools.partial(replay.sample, self.config, batches=batches)

    def _apply_due_updates(self, everything: bool = False) -> None:
        """Deferred policy: apply, in one kernel call, every queued update reported at a step <= current - k (all of
        them with ``everything``)."""
        due = []
        with self._changed:
            while self._queued_updates and (everything or
                                            self._queued_updates[0][0] <= self._step - self.schedule.defer):
                due.append(self._queued_updates.popleft())
        checked, rejected = [], None
        for step, ids, priorities in due:
            try:
                checked.append(_checked_priority_update(ids, priorities, self.capacity))
            except PriorityError as error:  # this update is dropped; the valid ones still apply
                rejected = rejected or PriorityError(f"{error} (deferred update reported at step {step}, not "
                                                     f"applied)")
        if checked:
            self._apply_updates(np.concatenate([ids for ids, _ in checked]),
                                np.concatenate([prio for _, prio in checked]))
        if rejected is not None:
            raise rejected

    def _recheck_staleness(self, delivery: Delivery) -> Delivery:
        """A batch dispatched before a policy-version switch may hold items the new version makes too old."""
        version = delivery.data
        for part in self.config.staleness.key.split("/"):
            version = version[part]
        fresh = version >= self.state.policy_version - self.config.staleness.max_versions
        mask = fresh if delivery.mask is None else delivery.mask & fresh
        return delivery._replace(mask=mask)

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
            return NotEnoughDataError, (
                f"sample(): the {sampler.name} sampler needs at least {sampler.min_items} {what} for a batch of "
                f"{self.batch_size}, the plane has {status['deliverable']}; ingest more first (can_sample() tells "
                f"without raising)")
        if not limiter.can_sample(LimiterState(status["limiter_balance"]), status["size"], self.batch_size):
            return RateLimitedError, (f"sample(): the rate limiter {limiter.name} admits no batch of "
                                      f"{self.batch_size} now (plane holds {status['size']} items); ingest more first")
        return None

    def _settled(self, outputs):
        """``outputs`` of a kernel call, waited for on an emulated CPU mesh (see ``_one_at_a_time``)."""
        return jax.block_until_ready(outputs) if self._one_at_a_time else outputs

    def _known(self, need_deliverable: bool = False) -> dict[str, Any]:
        """The host copy of the status scalars, read from the device only when unknown. A sampler whose deliverable
        count is not plain arithmetic on inserts and samples (an eligibility index) has it reported by the last kernel
        that changed it, as a device scalar read here when needed."""
        if self._counters is None or (need_deliverable and self._counters["deliverable"] is None):
            status = self._status()
            self._counters = {key: status[key] for key in ("size", "deliverable", "limiter_balance")}
        if need_deliverable and isinstance(self._counters["deliverable"], jax.Array):
            self._counters["deliverable"] = int(self._counters["deliverable"])  # reported by the last kernel
        return self._counters

    def _count_ingest(self, n: int, reported: list) -> None:
        counters = self._counters
        if counters is None:
            return
        counters["size"] = min(counters["size"] + n, self.capacity)
        counters["limiter_balance"] = int(self.limiter.on_insert(LimiterState(counters["limiter_balance"]), n).balance)
        if self.sampler.deliverable is None:
            counters["deliverable"] = counters["size"]
        elif self.sampler.consumes:
            counters["deliverable"] += n
        else:
            counters["deliverable"] = reported[0]

    def _count_sample(self, reported: list) -> None:
        counters = self._counters
        if counters is None:
            return
        counters["limiter_balance"] = int(
            self.limiter.on_sample(LimiterState(counters["limiter_balance"]), self.batch_size).balance)
        if self.sampler.consumes:
            counters["deliverable"] -= self.batch_size
        elif reported:
            counters["deliverable"] = reported[0]

    def _wait_until(self, refusal, timeout: Optional[float]) -> None:
        """Wait (holding the condition) until ``refusal()`` is None; raise its error when ``timeout`` runs out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        reason = refusal()
        while reason is not None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                error, message = reason
                raise error(message + (f" (waited {timeout} s)" if timeout else ""))
            self._changed.wait(remaining)
            reason = refusal()

    # -- priorities -----------------------------------------------------------------------------------------------
    def update_priorities(self, ids, priorities) -> None:
        """Set the priorities of delivered items: ``ids`` int32[m, 2] as in ``Delivery.ids``, ``priorities`` [m].

        NaN, infinite or negative priorities, ids of the wrong shape or out of range raise ``PriorityError`` and
        change nothing. An id whose slot has been rewritten since it was delivered is ignored (never applied to the
        new item) and counted in ``stats()['priority_updates_ignored']``. Under a ``deferred`` schedule the update
        is queued and checked when it is applied, k steps later: a bad one raises from that later call, naming the
        step it was reported at, and is dropped whole.

        A checked update takes effect for every later call; its kernel work rides in the next ``sample()``'s kernel
        call (one dispatch for both), or runs on its own first when another call reads the state.
        """
        if self.sampler.update is None:
            raise ConfigError(f"update_priorities(): the {self.sampler.name} sampler has no priorities; build the "
                              f"plane with samplers.prioritized(...) to use them")
        if self.schedule.defer:
            # queued as given (reading device arrays now would wait for the learner step that computes them);
            # checked when applied, k steps later
            with self._changed:
                self._queued_updates.append((self._step, ids, priorities))
            self._apply_due_updates()
            return
        self._apply_updates(*_checked_priority_update(ids, priorities, self.capacity))

    def _apply_updates(self, ids_np: np.ndarray, prio_np: np.ndarray) -> None:
        """Queue checked updates for the next kernel call. Every later call sees them exactly as if they had been
        applied now: the next sample applies them first in its own kernel, anything else flushes them before."""
        with self._changed:
            self._pending_updates.append((ids_np, prio_np))

    def _take_pending_updates(self) -> Optional[np.ndarray]:
        """The queued updates as one int32[bucket, 4] array, a row (id row, id generation, priority bits, valid) per
        update, padded to a power of two (one kernel per bucket, one transfer instead of three), or None; the queue
        is emptied. ``_unpacked`` reads it in the kernel."""
        if not self._pending_updates:
            return None
        m = sum(ids.shape[0] for ids, _ in self._pending_updates)
        packed = np.zeros((1 << max(0, (m - 1).bit_length()), 4), np.int32)
        at = 0
        for ids, priorities in self._pending_updates:
            packed[at:at + ids.shape[0], :2] = ids
            packed[at:at + ids.shape[0], 2] = priorities.view(np.int32)
            at += ids.shape[0]
        packed[:m, 3] = 1
        self._pending_updates.clear()
        return packed

    def _flush_updates(self) -> None:
        """Apply queued priority updates in a kernel of their own (before a call other than sample reads the
        state). Callers hold ``self._changed``."""
        pending = self._take_pending_updates()
        if pending is None:
            return
        start_time = time.perf_counter()
        self._run_reading("update", self._update_kernel, pending)
        self.timeline.record("update", start_time, time.perf_counter())

    # -- checkpoints --------------------------------------------------------------------------------------------------
    def save(self, directory, **options):
        """Checkpoint the whole plane asynchronously (see ``checkpoint.save``; returns a handle with ``wait()``).

        Deferred priority updates are applied first, so the checkpoint holds them. A queue's prefetched batches have
        already left the queue: saving then would lose them, so it is refused until they are delivered."""
        from conduit_jax import checkpoint

        with self._changed:
            if self.sampler.consumes and self._in_flight:
                raise ConfigError(f"save(): {len(self._in_flight)} prefetched {self.sampler.name} batches are in "
                                  f"flight; deliver() them first (their items have left the queue and a checkpoint "
                                  f"would lose them)")
            self._apply_due_updates(everything=True)
            return checkpoint.save(self, directory, **options)

    @classmethod
    def restore(cls, directory, **options) -> "ExperienceDataPlane":
        """A plane rebuilt from a checkpoint, bit-exact, on ``mesh``/``plan`` if given (see ``checkpoint.restore``)."""
        from conduit_jax import checkpoint

        return checkpoint.restore(directory, **options)

    # -- placement ----------------------------------------------------------------------------------------------------
    def replan(self, plan) -> None:
        """Move the live state to another plan's devices and memory kinds. Every item keeps its id: the shard count
        must stay (a different count deals items to other shards and slots, i.e. renumbers them; checkpoint and
        restore onto the new mesh for that). In-flight batches stay valid."""
        from conduit_jax.placement import PlacementError

        new_mesh = plan.mesh()
        config = self.config._replace(mesh=new_mesh, axes=tuple(new_mesh.axis_names))
        _check_plan(plan, config)
        if config.num_shards != self.num_shards:
            raise PlacementError(f"replan(): the plan has {config.num_shards} shards, the plane {self.num_shards}; a "
                                 f"live migration keeps the shard count so no item is renumbered")
        shardings = plan.shardings(config)
        with self._changed:
            moved = jax.device_put(self.state, shardings)
            self.config, self.mesh, self.plan, self._shardings = config, new_mesh, plan, shardings
            self._build_kernels()
            self._set_tree(moved)

    # -- policy version ---------------------------------------------------------------------------------------------
    def set_policy_version(self, version: int) -> None:
        """Tell the plane the learner's current policy version (it never goes back). With ``staleness`` set, items
        more than ``max_versions`` behind are never delivered from now on."""
        if not isinstance(version, (int, np.integer)) or isinstance(version, bool) or not 0 <= version < 2**31:
            raise ConfigError(f"set_policy_version(): version must be an int in [0, 2**31), got {version!r}")
        with self._changed:
            current = self._status()["policy_version"]
            if version < current:
                raise ConfigError(f"set_policy_version(): versions only move forward; the plane is at {current}, "
                                  f"got {version}")
            reported = self._run_reading("version", self._version_kernel, np.int32(version))
            if self._counters is not None and reported:
                self._counters["deliverable"] = reported[0]  # retired items can empty an eligibility index
            self._changed.notify_all()

    # -- status -------------------------------------------------------------------------------------------------
    def _status(self) -> dict[str, int]:
        with self._changed:
            self._flush_updates()
            with self._counting_compiles("status"):
                status = self._status_kernel(*self._form)
        return {k: int(v) for k, v in jax.device_get(status).items()}

    def compile_counts(self) -> dict[str, int]:
        """XLA compilations per kernel so far (counted from JAX's compile events); steady state adds none."""
        return dict(sorted(self._compiles.items()))

    def _counting_compiles(self, kernel: str):
        return _CompileScope(self._compiles, kernel)

    def stats(self) -> dict[str, Any]:
        """Counters of the plane, read from the state, plus the shell's wall-clock timings per call."""
        with self._changed:
            status = self._status()
            cursor, laps = jax.device_get((self.state.storage.cursor, self.state.storage.laps))
        inserted = sum(int(l) * self.config.shard_capacity + int(c) for c, l in zip(cursor, laps))
        out = {
            "size": status["size"],
            "capacity": self.capacity,
            "num_shards": self.num_shards,
            "items_inserted": inserted,
            "items_overwritten": inserted - status["size"],
            "sampler": self.sampler.name,
            "limiter": self.limiter.name,
            "compiled": self.compile_counts(),
        }
        if self.sampler.deliverable is not None:
            out["deliverable"] = status["deliverable"]
        if "priority_updates_ignored" in status:
            out["priority_updates_ignored"] = status["priority_updates_ignored"]
        out["policy_version"] = status["policy_version"]
        if self.config.staleness is not None:
            out["stale_draws"] = status["stale_draws"]
        out["schedule"] = self.schedule.name
        out["prefetch_depth"] = self._depth
        out["stages"] = self.timeline.summary()
        return out


_compile_scope = threading.local()  # the kernel whose call is running on this thread, if any


def _count_compile(event: str, duration: float, **kwargs) -> None:
    counter = getattr(_compile_scope, "counter", None)
    if event == "/jax/core/compile/backend_compile_duration" and counter is not None:
        counter[_compile_scope.kernel] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class _CompileScope:
    """While a kernel is called, attribute the XLA compilations JAX reports on this thread to it."""

    def __init__(self, counter: collections.Counter, kernel: str):
        self.counter, self.kernel = counter, kernel

    def __enter__(self):
        self.saved = getattr(_compile_scope, "counter", None), getattr(_compile_scope, "kernel", None)
        _compile_scope.counter, _compile_scope.kernel = self.counter, self.kernel
        self.counter.setdefault(self.kernel, 0)

    def __exit__(self, *exc):
        _compile_scope.counter, _compile_scope.kernel = self.saved
        return False


def _unpacked(updates):
    """(ids int32[m, 2], priorities float32[m], valid bool[m]) from ``_take_pending_updates``' packed array."""
    return updates[:, :2], lax.bitcast_convert_type(updates[:, 2], jnp.float32), updates[:, 3] != 0


def _reading_storage(step, bundle: LeafBundle, storage_large: int, num_outputs: int, recycles: bool = False,
                     compiler_options: Optional[dict] = None):
    """Jit ``step(state, *args) -> (state', *outputs)`` for steps that only read storage, over the state's bundled
    form ``(storage's large leaves, the rest's large leaves, small leaves' vector)``: storage's large leaves (the ring)
    go in undonated and do not come out, the rest is donated and keeps its placement. Returning the unchanged ring
    from a jitted function would make XLA copy the whole buffer on every call. The kernel returns ``(rest's large
    leaves, small vector, *outputs)``; storage's small leaves ride in the vector unchanged.

    ``recycles``: the kernel takes one more donated argument after the state, a finished output of the same shapes,
    which it never reads: XLA writes the outputs into its buffers (``keep_unused``, or jit would drop it).
    ``compiler_options``: XLA options of this kernel (see ``runtime.delivery_compiler_options``)."""

    def kernel(storage_leaves, rest_leaves, small, *args):
        new_state, *outputs = step(_joined(bundle, storage_leaves, rest_leaves, small),
                                   *args[1:] if recycles else args)
        large, small = bundle.split(new_state)
        return (large[storage_large:], small, *outputs)

    return jax.jit(kernel, donate_argnums=(1, 2, 3) if recycles else (1, 2), keep_unused=recycles,
                   out_shardings=(bundle.large_shardings[storage_large:], bundle.small_sharding)
                   + (None,) * num_outputs, compiler_options=compiler_options)


def _joined(bundle: LeafBundle, storage_leaves, rest_leaves, small):
    """Inside a kernel: the state from its bundled form, every leaf computable (see ``_computable``)."""
    return _computable(bundle.join(tuple(storage_leaves) + tuple(rest_leaves), small), bundle.shardings)


def _recycle_error(where: str, recycle: Delivery, index: int, shape, dtype, sharding) -> SpecError:
    """What is wrong with leaf ``index`` of a recycled Delivery (named by its path)."""
    path, leaf = jax.tree_util.tree_flatten_with_path(recycle)[0][index]
    name = "recycle" + jax.tree_util.keystr(path)
    if not isinstance(leaf, jax.Array):
        return SpecError(f"{where}: {name} must be a jax.Array, got {type(leaf).__name__}")
    if leaf.is_deleted():
        return SpecError(f"{where}: {name} was deleted (already recycled or donated to a jit)")
    if leaf.shape != shape or leaf.dtype != dtype:
        return SpecError(f"{where}: {name} must be {dtype}{list(shape)} as in this plane's batches; got "
                         f"{leaf.dtype}{list(leaf.shape)}")
    return SpecError(f"{where}: {name} must be placed as this plane's batches, {sharding}; got {leaf.sharding}")


def _layout_of(delivery: Delivery):
    """(treedef, [(shape, dtype, sharding)]) of a delivered batch: what a recycled one must match."""
    leaves, treedef = jax.tree_util.tree_flatten(delivery)
    return treedef, [(leaf.shape, leaf.dtype, leaf.sharding) for leaf in leaves]


def _computable(state, shardings):
    """Inside a kernel: leaves placed in ``pinned_host`` memory moved to ``device`` memory (XLA cannot compute on
    pinned host memory directly). Leaves in ``device`` or ``unpinned_host`` memory are used where they are."""
    def move(leaf, sharding):
        if getattr(sharding, "memory_kind", None) != "pinned_host":
            return leaf
        return jax.device_put(leaf, sharding.with_memory_kind("device"))

    return jax.tree_util.tree_map(move, state, shardings)


def checked_priorities(priorities, count: int, where: str = "update_priorities()") -> np.ndarray:
    """``priorities`` as float32[count] after checking them (shape, real numbers, finite, >= 0); else PriorityError."""
    prio_np = np.asarray(priorities)
    if prio_np.shape != (count,):
        raise PriorityError(f"{where}: priorities must have shape ({count},), one per id, got {list(prio_np.shape)}")
    if count == 0:
        raise PriorityError(f"{where}: ids is empty; pass at least one id")
    if prio_np.dtype.kind not in "iuf":  # real numbers (dtype kinds: numpy's issubdtype costs ~1.5 us a call)
        raise PriorityError(f"{where}: priorities must be real numbers, got dtype {prio_np.dtype}")
    prio_np = prio_np.astype(np.float32)
    bad = ~np.isfinite(prio_np) | (prio_np < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise PriorityError(f"{where}: priorities must be finite and >= 0; {int(bad.sum())} are not, the first at "
                            f"index {i} is {prio_np[i]}")
    return prio_np


def _checked_priority_update(ids, priorities, capacity: int):
    where = "update_priorities()"
    ids_np = np.asarray(ids)
    if ids_np.ndim != 2 or ids_np.shape[1] != 2 or ids_np.dtype.kind not in "iu":
        raise PriorityError(f"{where}: ids must be an integer array of shape (m, 2) as in Delivery.ids, got "
                            f"{ids_np.dtype}{list(ids_np.shape)}")
    prio_np = checked_priorities(priorities, ids_np.shape[0], where)
    rows, generations = ids_np[:, 0], ids_np[:, 1]
    unknown = (rows < 0) | (rows >= capacity) | (generations < 1)
    if unknown.any():
        i = int(np.argmax(unknown))
        raise PriorityError(f"{where}: ids[{i}] = {ids_np[i].tolist()} is not an id of this plane (rows are in "
                            f"[0, {capacity}), generations >= 1)")
    return ids_np.astype(np.int32), prio_np


def _check_plan(plan, config: ReplayConfig) -> None:
    from conduit_jax.placement import Plan

    if not isinstance(plan, Plan):
        raise ConfigError(f"ExperienceDataPlane(): plan must be a placement.Plan, got {type(plan).__name__}")
    if plan.capacity != config.capacity or plan.row_bytes != config.layout.row_bytes:
        raise ConfigError(f"ExperienceDataPlane(): the plan was made for capacity {plan.capacity} with "
                          f"{plan.row_bytes}-byte rows, this plane has capacity {config.capacity} with "
                          f"{config.layout.row_bytes}-byte rows; plan for this spec and capacity")


def _check_config(config: ReplayConfig, capacity) -> None:
    shards = config.num_shards
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ConfigError(f"ExperienceDataPlane(): capacity must be a positive int, got {capacity!r}")
    if capacity % shards:
        lower, upper = capacity - capacity % shards, capacity + shards - capacity % shards
        raise ConfigError(f"ExperienceDataPlane(): capacity {capacity} is not a multiple of the {shards} shards of "
                          f"mesh axes {config.axes}; use {upper}" + (f" or {lower}" if lower else ""))
    batch = config.sampler.batch_size
    if batch % shards:
        raise ConfigError(f"ExperienceDataPlane(): batch_size {batch} of the {config.sampler.name} sampler is not a "
                          f"multiple of the {shards} shards (the batch is delivered sharded); use "
                          f"{batch + shards - batch % shards}")
    if config.sampler.min_items > capacity:
        raise ConfigError(f"ExperienceDataPlane(): the {config.sampler.name} sampler needs {config.sampler.min_items} "
                          f"items per batch but capacity is {capacity}")
    sampler = config.sampler
    if sampler.streams > 1 or sampler.window > 1:
        stride = sampler.streams // shards
        if sampler.streams % shards:
            raise ConfigError(f"ExperienceDataPlane(): the {sampler.name} sampler's streams ({sampler.streams}) must be "
                              f"a multiple of the {shards} shards so each stream lives in one shard")
        if config.shard_capacity % stride or config.shard_capacity // stride < sampler.window:
            raise ConfigError(f"ExperienceDataPlane(): each shard holds {config.shard_capacity} slots for {stride} "
                              f"streams; it must be a multiple of {stride} and hold at least {sampler.window} steps "
                              f"per stream (capacity >= {sampler.window * sampler.streams}, a multiple of "
                              f"{sampler.streams})")
    spec = config.layout.spec
    for key in sampler.needs:
        if key not in spec.names or spec.dtypes[spec.names.index(key)] != np.bool_ or \
                spec.shapes[spec.names.index(key)] != ():
            raise ConfigError(f"ExperienceDataPlane(): the {sampler.name} sampler needs a per-item bool leaf '{key}' "
                              f"(episode ends); the spec is {spec}")
    staleness = config.staleness
    if staleness is not None:
        if not isinstance(staleness, Staleness) or not isinstance(staleness.max_versions, int) or \
                staleness.max_versions < 0:
            raise ConfigError(f"ExperienceDataPlane(): staleness must be limits.Staleness(max_versions >= 0, key), "
                              f"got {staleness!r}")
        if staleness.key not in spec.names or spec.dtypes[spec.names.index(staleness.key)] != np.int32 or \
                spec.shapes[spec.names.index(staleness.key)] != ():
            raise ConfigError(f"ExperienceDataPlane(): staleness needs a per-item int32 leaf '{staleness.key}' (the "
                              f"policy version each item was produced with); the spec is {spec}")
    if capacity >= 2**31:
        raise ConfigError(f"ExperienceDataPlane(): capacity must be below 2**31 (int32 row ids), got {capacity}")
