"""The delivery worker: a daemon thread that does a prefetching schedule's host work off the learner's thread.

Under ``overlap`` / ``deferred`` / ``adaptive`` the plane (``plane.py``) owns one ``DeliveryWorker``. The worker runs
the plane's ``poll`` while holding the plane's lock: ``poll`` does what the schedule asks for now (apply the deferred
priority updates that are due, check the rate limiter and the sampler's refusals, dispatch the next batch) and
returns what is left to wait for (a batch computing, a learner step computing the TD errors of a due update) as a
function the worker runs *without* the lock; what that returns runs under the lock again (e.g. mark the batch
ready). So ``deliver()`` on the learner's thread only hands over a batch that is already finished, and the learner's
own calls (``ingest``, ``update_priorities``) never wait for a kernel the worker waits for.

The plane wakes the worker (``kick``) after a delivery and after an ingest (right after a policy-version switch the
rollout's ingest draws the first batch itself: ``Scheduler.ingested``). After a delivery the refill waits a tenth of
a learner step (at most ``REFILL_DELAY_MAX``), so its Python does not take the GIL from the learner's thread while
that thread waits for its batch and dispatches its step; and a learner that calls ``deliver()`` at a steady pace
wakes nobody: the idle worker naps until the refill it forecasts (``Scheduler.wake_at``), and a kick that falls due
by then leaves it asleep, since waking another thread cost the learner's thread tens of microseconds on a 2-core
host. The worker also records each delivery in the plane's timeline, off the learner's thread. ``settle`` waits until
the worker has done everything it can do now, which gives calls that read the plane's host bookkeeping (``stats``,
``save``, ``held``) the state they would see without a thread. An exception raised on the worker is kept and raised
by the learner's next ``deliver()`` (``raise_error``); the worker carries on with the next kick.

Without a thread: ``Scheduler(threaded=False)`` carries the same schedules out on the caller's own thread, for a
caller that asks for one batch at a time (RLlib's replay buffers, ``adapters/conduit_rllib``): batches are drawn
ahead there, right after a delivery or right after the caller's priority update, and JAX's asynchronous dispatch
computes them while the caller goes on; a batch drawn for one request goes only to an equal one.

Lifetime: the thread holds no reference to the plane (``poll`` reaches it through a weak reference), so an unclosed
plane is collected as usual and its worker stops (``weakref.finalize`` in the plane); ``close`` stops it at once, and
an ``atexit`` hook closes every worker still running, so the interpreter never waits on one at exit.
"""

from __future__ import annotations

import atexit
import collections
import math
import threading
import time
import weakref
from typing import Callable, Optional

import jax
import numpy as np

from conduit_jax import schedule as schedule_lib
from conduit_jax.errors import ConfigError, PriorityError
from conduit_jax.spec import checked_priority_update

_running: "weakref.WeakSet[DeliveryWorker]" = weakref.WeakSet()  # workers whose thread may still run
REFILL_DELAY_MAX = 5e-4  # seconds: the longest the worker waits after a deliver() before drawing the refill


@atexit.register
def _close_all() -> None:
    for worker in list(_running):
        worker.close(timeout=1.0)


class DeliveryWorker:
    """A daemon thread that calls ``poll()`` under ``lock`` whenever it is kicked, until ``poll`` returns None.

    ``poll() -> None | outside``: None when there is nothing to do now; else ``outside()`` runs without the lock and
    returns None or ``inside``, which runs under the lock. Then the worker polls again.
    """

    def __init__(self, lock, poll: Callable[[], Optional[Callable]], name: str,
                 wake_at: Callable[[], Optional[float]] = lambda: None):
        # its own condition over the plane's lock: the plane's notifications (every ingest and sample) do not wake
        # the thread, only a kick does (on a 2-core host each needless wake-up took the GIL from the learner's thread)
        self._lock, self._poll, self._wake_at = threading.Condition(lock), poll, wake_at
        self._kicked = False  # work may be possible: poll again
        self._not_before = 0.0  # a kick with a delay: poll from this time.perf_counter() on
        self._napping_until: Optional[float] = None  # idle in a timed wait that ends then (wake_at's forecast)
        self._busy = False  # between a kick and the poll that finds nothing to do
        self._closed = False
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        _running.add(self)
        self._thread.start()

    # -- called by the plane, holding the lock ------------------------------------------------------------------------
    def kick(self, delay: float = 0.0) -> None:
        """Something changed: poll again, ``delay`` seconds from now (an earlier kick's delay is cut to this one's).
        The caller holds the lock. A worker napping until at most ``REFILL_DELAY_MAX`` after that is not woken: its
        nap's end is the wake-up, and the kicking thread keeps the GIL."""
        now = time.perf_counter()
        self._not_before = now + delay if not self._kicked else min(self._not_before, now + delay)
        self._kicked = True
        napping_until = self._napping_until
        if napping_until is None or napping_until > self._not_before + REFILL_DELAY_MAX:
            self._lock.notify_all()

    @property
    def idle(self) -> bool:
        """Whether the worker has done everything it can do now (or has stopped). The caller holds the lock."""
        return self._closed or not (self._kicked or self._busy)

    def settle(self) -> None:
        """Wait (the caller holds the lock, which the wait releases) until the worker is idle. On the worker's own
        thread (a ``poll`` that reads the plane) there is nothing to wait for."""
        if threading.current_thread() is self._thread:
            return
        if self._kicked:  # napping on a kick: the work is wanted now
            self._lock.notify_all()
        while not self.idle:
            self._lock.wait()

    def raise_error(self) -> None:
        """Raise (once) the exception the worker met since the last call, if any. The caller holds the lock."""
        error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: Optional[float] = 5.0) -> None:
        """Stop the thread (it finishes the wait it is in, if any) and join it."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        _running.discard(self)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- the thread -------------------------------------------------------------------------------------------------
    def report(self, error: BaseException) -> None:
        """Keep ``error`` for ``raise_error`` (a ``poll`` that carries on after a rejected input)."""
        if self._error is None:
            self._error = error

    def _run(self) -> None:
        after = None
        while True:
            with self._lock:
                self._guarded(after)  # what the last wait finished, recorded under the lock
                outside = None
                while not self._closed:
                    if self._kicked and not self._busy:
                        wait = self._not_before - time.perf_counter()
                        if wait > 0:  # a delayed kick: sleep it off (a kick without delay ends the wait)
                            self._lock.wait(wait)
                            continue
                    if self._kicked:
                        self._kicked, self._busy = False, True
                    if self._busy:
                        outside = self._guarded(self._poll)
                        if outside is not None:
                            break
                        self._busy = False
                        self._lock.notify_all()  # settle() waits for this
                    self._idle_wait()
                if self._closed:
                    self._busy = False
                    self._lock.notify_all()
                    return
            after = self._guarded(outside)  # without the lock: returns None or what runs under it next

    def _idle_wait(self) -> None:
        """Wait for a kick, under the lock. Where ``wake_at`` forecasts when the next kick is due (a learner that
        calls deliver() at a steady pace), nap until then instead: the kick then needs no wake-up (see ``kick``)."""
        wake_at = self._wake_at()
        nap = None if wake_at is None else wake_at - time.perf_counter()
        if nap is None or nap <= 0:
            self._lock.wait()
            return
        self._napping_until = wake_at
        try:
            self._lock.wait(nap)
        finally:
            self._napping_until = None

    def _guarded(self, step: Optional[Callable]) -> Optional[Callable]:
        """``step()``, an exception kept for ``raise_error`` (the first one until it is raised)."""
        if step is None:
            return None
        try:
            return step()
        except BaseException as error:  # noqa: BLE001 - surfaced on the learner's thread by raise_error
            self.report(error)
            return None


class Prefetched:
    """A batch the schedule dispatched ahead: the ``Delivery``, the plane's policy-version epoch when it was drawn
    (delivered from a later epoch, it is re-checked for staleness), whether it is known to be computed, its leaves
    once the worker has listed them, and the request it was drawn for (``Scheduler.deliver(request=)``)."""

    __slots__ = ("delivery", "epoch", "ready", "leaves", "request")

    def __init__(self, delivery, epoch: int, ready: bool = False, request=None):
        self.delivery, self.epoch, self.ready, self.leaves, self.request = delivery, epoch, ready, None, request

    def wait(self) -> Callable[[], None]:
        """Block until the batch is computed (without the plane's lock); returns what marks it ready (under it). A
        batch the learner took, waited for and donated meanwhile (``recycle``) is done too."""
        try:
            jax.block_until_ready(self.delivery)
        except RuntimeError:
            if not any(leaf.is_deleted() for leaf in jax.tree_util.tree_leaves(self.delivery)):
                raise
        return self._mark_ready

    def _mark_ready(self) -> None:
        self.ready = True


class DeferredUpdates:
    """The priority updates a ``deferred`` schedule queued on the host, as reported (device arrays are not read, so
    the learner never waits for its own TD errors), and checked when they are due: ``k`` deliveries later."""

    def __init__(self, k: int, capacity: int):
        self.k, self.capacity = k, capacity
        self._queue: collections.deque = collections.deque()  # (step, ids, priorities)

    def report(self, step: int, ids, priorities) -> None:
        self._queue.append((step, ids, priorities))

    def count(self) -> int:
        """Ids queued, not applied yet."""
        return sum(len(ids) for _, ids, _ in self._queue)

    def _due(self, step: int, everything: bool):
        return [entry for entry in self._queue if everything or entry[0] <= step - self.k]

    def computing(self, step: int) -> list:
        """The device arrays of the updates due at ``step`` that are still being computed (empty: taking them now
        does not wait)."""
        return [leaf for _, ids, priorities in self._due(step, False) for leaf in (ids, priorities)
                if isinstance(leaf, jax.Array) and not leaf.is_ready()]

    def take_due(self, step: int, everything: bool = False):
        """Remove the updates due at ``step`` (all with ``everything``) and check them: ``(ids, priorities)``
        concatenated over the valid ones (or None), and a ``PriorityError`` naming the step of the first rejected
        one (or None; a rejected update is dropped whole, the valid ones still apply)."""
        checked, rejected = [], None
        while self._queue and (everything or self._queue[0][0] <= step - self.k):
            reported, ids, priorities = self._queue.popleft()
            try:
                checked.append(checked_priority_update(ids, priorities, self.capacity))
            except PriorityError as error:
                rejected = rejected or PriorityError(f"{error} (deferred update reported at step {reported}, not "
                                                     f"applied)")
        if not checked:
            return None, rejected
        return (np.concatenate([ids for ids, _ in checked]), np.concatenate([p for _, p in checked])), rejected


class Scheduler:
    """A schedule carried out for one plane: its batches in flight, deferred updates, step count and prefetch depth,
    and the worker when the schedule prefetches. Every method is called holding ``lock`` (the plane's), except
    ``deliver``, ``report_update`` and ``updated``, which take it.

    The plane's side comes as callables that reach it through a weak reference (so the worker's thread keeps no
    plane alive): ``draw(recycle=, timeout=)`` dispatches one batch (``plane.sample``), ``admits()`` tells whether
    the plane would deliver one now without waiting, ``pend(checked)`` queues checked priority updates for the next
    kernel, ``refresh(delivery)`` re-checks a delivery's staleness mask against the current policy version. Each
    deliver() goes into ``timeline`` (the plane's; None: no record) when the worker next runs, or at ``settle`` /
    ``close``.

    ``threaded=False``: no worker, for a caller that asks for one batch at a time on its own thread (RLlib's buffer
    contract, ``adapters/conduit_rllib``). A prefetching schedule then dispatches its batches ahead on the caller's
    thread, and JAX's asynchronous dispatch computes them while the caller goes on: right after a ``deliver()``, or,
    with ``updates`` (the caller reports priority updates) and ``defer`` 0, right after the caller's update
    (``updated()``), so the batch sees it; ``adaptive`` moves between the two by ``schedule.draws_after_update``. A
    batch may be drawn for a request (``deliver(request=)``; ``draw`` is then called with ``request=`` too): it is
    handed over only to a deliver() of an equal request, else dropped and drawn anew. ``discard`` drops batches in
    flight that may no longer be handed over (e.g. holding an item evicted since). ``counts`` says how many batches
    were drawn ahead each way, how many a deliver() had to wait for and how many were dropped.
    """

    def __init__(self, schedule, lock: threading.RLock, capacity: int, timeline, *, draw, admits, pend, refresh,
                 threaded: bool = True, updates: bool = True):
        self.schedule, self.lock, self.timeline = schedule, lock, timeline
        self._draw, self._admits, self._pend, self._refresh = draw, admits, pend, refresh
        self.inline = not threaded  # every batch drawn on the caller's thread (deliver(), updated())
        # inline: whether the next batch is drawn ahead after the caller's update (overlap; adaptive to begin with,
        # then schedule.draws_after_update) or after the delivery, and how many were drawn after it in a row
        self.after_update, self._run = updates and (schedule.adaptive or not schedule.defer), 0
        self._updates = updates
        self._update_s = 0.0  # inline: smoothed seconds from a deliver() returning to the caller's update
        self._handed_at: Optional[float] = None
        self._kept_error: Optional[BaseException] = None  # inline: a deferred update rejected at a refill
        self.request = None  # the last deliver()'s request (inline refills draw for it)
        self.counts = {"after_update": 0, "after_delivery": 0, "waited": 0, "dropped": 0}
        self.in_flight: collections.deque = collections.deque()  # Prefetched, oldest first
        self.deferred = DeferredUpdates(schedule.defer, capacity) if schedule.defer else None
        self.depth = schedule.depth  # current prefetch depth (moves under the adaptive policy)
        self.step = 0  # deliver() calls completed
        self.epoch = 0  # policy-version switches and state assignments: an older batch is re-checked when delivered
        self.recycle = None  # a batch deliver() handed over for the worker's next draw
        self.one_ahead = False  # draw at most one batch ahead until the next deliver() (set by switched())
        self.last_delivered = None  # what the last deliver() returned (a recycle of it needs no layout check)
        self.last_delivered_leaves = None  # its leaves, when the worker listed them (the recycle check reads them)
        self._last_end: Optional[float] = None  # when the last deliver() returned
        self._smoothed = {"exposed": 0.0, "learner": 0.0}  # exponential averages (s) the adaptive policy reads
        # (start, end, thread) of each deliver() not yet in the timeline: the worker records them off the learner's
        # thread, as the learner's thread's spans
        self._handed_over: collections.deque = collections.deque()
        self.worker = DeliveryWorker(lock, self.poll, "conduit-delivery", self.wake_at) if (
            schedule.depth and threaded) else None

    # -- the plane's hooks ----------------------------------------------------------------------------------------
    def ingested(self) -> Optional[Callable[[], Callable[[], None]]]:
        """An ingest made items deliverable. Right after a policy-version switch with nothing in flight (an
        on-policy rollout: the learner asks for the epoch's first minibatch next, with nothing of its own to do
        meanwhile) that minibatch is drawn here, on the ingesting thread, and the worker draws the rest after the
        first deliver(). A worker woken for it raced that deliver() for the lock and the GIL, and the first
        deliver() after a rollout exposed more time than under sync. Then the batch's ``wait`` is returned for
        ``finish_ingest``: the ingesting thread, not the deliver(), waits for it to be computed (the learner's own
        thread in an on-policy loop: the same wait, earlier; a generator's thread: a wait the learner no longer
        sees). Otherwise the worker looks for work, if it may find some (a batch to draw: with all ``depth`` in
        flight there is none, and waking it would only take the GIL), and None is returned."""
        if self.worker is None:
            return None
        if not self.one_ahead:
            if len(self.in_flight) < self.depth:
                self.worker.kick()
        elif not self.in_flight and self._admits():
            batch = Prefetched(self._draw(), self.epoch)
            self.in_flight.append(batch)
            return batch.wait
        return None

    def finish_ingest(self, wait: Optional[Callable[[], Callable[[], None]]]) -> None:
        """Run what ``ingested`` returned, if anything: the wait without the lock (the caller has released it), then
        the batch marked computed under it."""
        if wait is not None:
            mark = wait()
            with self.lock:
                mark()

    def settle(self) -> None:
        """Wait until the worker has done what it can now: the host bookkeeping is what it would be without one."""
        if self.worker is not None:
            self.worker.settle()
        self._record_handovers()

    def switched(self) -> None:
        """The policy version may have moved: batches drawn before are re-checked when delivered."""
        self.epoch += 1
        # until the next deliver() at most one batch is drawn ahead, not depth: after an on-policy rollout the learner
        # asks for the first minibatch at once, and a second dispatch then only holds the GIL and the lock it waits
        # for (in a PPO-like probe it lengthened the first deliver() and left the later ones as they were). That one
        # batch is not the worker's either: the rollout's ingest draws it (``ingested``), or the next deliver()
        # does; a worker woken here raced both for the lock and the GIL
        self.one_ahead = True

    def holds(self, delivery) -> bool:
        """Whether ``delivery`` is still the plane's (queued, or handed over for recycling): not recyclable."""
        return any(delivery.ids is queued.delivery.ids for queued in self.in_flight) or (
            self.recycle is not None and delivery.ids is self.recycle.ids)

    def close(self) -> None:
        worker = self.worker
        if worker is not None:
            worker.close()
            with self.lock:
                self.worker, self.recycle = None, None
                self._record_handovers()

    # -- deferred priority updates ----------------------------------------------------------------------------------
    def report_update(self, ids, priorities) -> float:
        """Queue an update as reported (``deferred``). With a worker, first wait for the TD errors it applies before
        its next draw, so the learner runs at most k - 1 steps ahead of its own TD errors and that wait never lands
        in ``deliver()`` (where the next batch would queue behind them). Returns the seconds that wait took (the
        learner's own step computing, not experience-path work)."""
        with self.lock:
            self.deferred.report(self.step, ids, priorities)
            computing = self.deferred.computing(self.step + 1) if self.worker is not None else ()
        waited = 0.0
        if computing:
            start = time.perf_counter()
            jax.block_until_ready(computing)
            waited = time.perf_counter() - start
        if self.worker is None:
            self.apply_due()
        return waited

    def apply_due(self, everything: bool = False) -> None:
        """Queue for the next kernel, checked, every deferred update reported at a step <= current - k (all of them
        with ``everything``); a rejected one raises ``PriorityError`` once the valid ones are queued."""
        if self.deferred is None:
            return
        with self.lock:
            checked, rejected = self.deferred.take_due(self.step, everything)
            if checked is not None:
                self._pend(checked)
        if rejected is not None:
            raise rejected

    # -- delivery ---------------------------------------------------------------------------------------------------
    def deliver(self, timeout: Optional[float], recycle, check_recycle, request=None):
        """``plane.deliver()``: hand over the oldest batch in flight (drawn here when there is none), computed.

        When the worker keeps up, the batch is computed and of the current policy version, and this is one pass
        under the lock: a pop, the step, and a kick that the napping worker needs no wake-up for. The timeline and
        the adaptive policy's averages are brought up to date by the worker, off this thread: between the learner's
        steps every call here runs with cold caches (the step and the loop's own work evict them), at several times
        its usual cost. ``request``: see the class docstring (``threaded=False`` only)."""
        if self.inline:
            return self._deliver_inline(timeout, request)
        start = time.perf_counter()
        worker = self.worker
        with self.lock:
            if worker is not None:
                worker.raise_error()
            if recycle is not None:
                check_recycle(recycle, "deliver()")
            if not self.in_flight:  # nothing prefetched: draw on this thread, as sync does (the worker cannot draw
                # while this holds the lock, so what the plane admits now is the whole story)
                self.in_flight.append(Prefetched(self._draw(timeout=timeout, recycle=recycle), self.epoch))
                recycle = None
            batch = self.in_flight.popleft()
            self.one_ahead = False
            # the step moves as the batch leaves the queue: a draw from here on counts it (the bound k)
            self.step += 1
            self.depth = self.schedule.next_depth(self.depth, self._smoothed["exposed"], self._smoothed["learner"])
            if worker is None:  # sync, or a closed worker: the refills are dispatched here
                while len(self.in_flight) < self.depth and self._admits():
                    self.in_flight.append(Prefetched(self._draw(recycle=recycle), self.epoch))
                    recycle = None
            elif recycle is not None:
                self.recycle = recycle
            if batch.ready and batch.epoch == self.epoch:
                return self._hand_over(batch.delivery, batch, start)
        if not batch.ready:
            jax.block_until_ready(batch.delivery)
        delivery = batch.delivery if batch.epoch == self.epoch else self._refresh(batch.delivery)
        with self.lock:
            return self._hand_over(delivery, batch, start)

    def _deliver_inline(self, timeout: Optional[float], request):
        """``deliver()`` without a worker (``threaded=False``): the batch drawn ahead for ``request``, waited for (or
        drawn now, not waited for: the caller reads it); then, where the schedule draws after a delivery, the next one
        dispatched."""
        start = time.perf_counter()
        with self.lock:
            error, self._kept_error = self._kept_error, None
            if error is not None:
                raise error
            self._keep_only(request)
            drawn_ahead = bool(self.in_flight)
            batch = self.in_flight.popleft() if drawn_ahead else Prefetched(self._dispatch(timeout=timeout),
                                                                            self.epoch, request=request)
            self.step += 1
            self.depth = self.schedule.next_depth(self.depth, self._smoothed["exposed"], self._smoothed["learner"])
        waited = 0.0
        if drawn_ahead and not all(leaf.is_ready() for leaf in jax.tree_util.tree_leaves(batch.delivery)
                                   if isinstance(leaf, jax.Array)):
            begin = time.perf_counter()
            jax.block_until_ready(batch.delivery)
            waited = time.perf_counter() - begin
            self.counts["waited"] += 1
        delivery = batch.delivery if batch.epoch == self.epoch else self._refresh(batch.delivery)
        with self.lock:
            if drawn_ahead and self._updates and self.schedule.adaptive and self.schedule.defer:
                self.after_update = schedule_lib.draws_after_update(self.after_update, waited, self._update_s,
                                                                    self._run)
            self._run = 0 if self.after_update else self._run + 1
            if not self.after_update:
                self._refill("after_delivery")
            delivery = self._hand_over(delivery, batch, start)
            self._handed_at = time.perf_counter()
            return delivery

    def updated(self) -> None:
        """The caller reported a priority update (queued for the next kernel, or with ``report_update``). Without a
        worker, where the schedule draws after the update, the next batch is dispatched now, after every update
        reported so far: it sees them (sooner than a ``defer`` bound asks)."""
        with self.lock:
            if self._handed_at is not None:
                gap, self._handed_at = time.perf_counter() - self._handed_at, None
                self._update_s = 0.9 * self._update_s + 0.1 * gap if self._update_s else gap
            if self.draws_on_update:
                self._refill("after_update", everything=True)

    @property
    def draws_on_update(self) -> bool:
        """Whether ``updated()`` dispatches the next batch now (no worker, the schedule drawing after updates and
        wanting one more in flight, a request known)."""
        return self.inline and self.after_update and self.request is not None and len(self.in_flight) < self.depth

    def discard(self, unwanted: Callable[[object], bool]) -> int:
        """Drop the batches in flight for which ``unwanted(delivery)`` is true: they are never handed over (e.g. a
        batch holding an item evicted since it was drawn). Returns how many were dropped."""
        with self.lock:
            return self._drop(lambda batch: unwanted(batch.delivery))

    def _keep_only(self, request) -> None:
        """Drop the batches in flight drawn for another request than ``request``; it is the one drawn for next."""
        self.request = request
        self._drop(lambda batch: batch.request != request)

    def _drop(self, unwanted: Callable[[Prefetched], bool]) -> int:
        kept = [batch for batch in self.in_flight if not unwanted(batch)]
        dropped = len(self.in_flight) - len(kept)
        if dropped:
            self.in_flight = collections.deque(kept)
            self.counts["dropped"] += dropped
        return dropped

    def _dispatch(self, **kwargs):
        """``draw`` for the current request (none: the plane's draws take none)."""
        return self._draw(**kwargs) if self.request is None else self._draw(request=self.request, **kwargs)

    def _refill(self, way: str, everything: bool = False) -> None:
        """Inline: the due deferred updates queued (all reported ones with ``everything``), then batches drawn
        ahead while the schedule wants more and the plane admits them; counted as drawn ``way``. A rejected
        deferred update is raised by the next ``deliver()`` (the valid ones still apply)."""
        try:
            self.apply_due(everything)
        except PriorityError as error:
            self._kept_error = error
        while len(self.in_flight) < self.depth and self._admits():
            self.in_flight.append(Prefetched(self._dispatch(), self.epoch, request=self.request))
            self.counts[way] += 1

    def _hand_over(self, delivery, batch: Prefetched, start: float):
        """The end of a deliver() (under the lock): note what it returns and when, and let the worker refill."""
        self.last_delivered = delivery
        self.last_delivered_leaves = batch.leaves if delivery is batch.delivery else None
        self._handed_over.append((start, time.perf_counter(), threading.get_ident()))
        if self.worker is None:
            self._record_handovers()
        else:
            # the refill waits a tenth of a learner step (at most REFILL_DELAY_MAX): woken at once, the worker's
            # dispatch took the GIL from the learner's thread in the instant it waits for this batch and
            # dispatches its step, which lengthened the demo's exposed path (async dispatch on a 2-core host)
            self.worker.kick(delay=self._refill_delay())
        return delivery

    def _refill_delay(self) -> float:
        """How long after a deliver() the worker draws the refill."""
        return min(0.1 * self._smoothed["learner"], REFILL_DELAY_MAX)

    def _record_handovers(self) -> None:
        """Put the deliver() calls made since the last call into the timeline, if any ("learner": from the end of
        one to the start of the next; "exposed": each call), and the adaptive policy's averages. Under the lock."""
        timeline = self.timeline
        while self._handed_over:
            start, end, thread = self._handed_over.popleft()
            if self._last_end is not None:
                if timeline is not None:
                    timeline.record("learner", self._last_end, start, thread)
                self._smooth("learner", start - self._last_end)
            if timeline is not None:
                timeline.record("exposed", start, end, thread)
            self._smooth("exposed", end - start)
            self._last_end = end

    def _smooth(self, stage: str, seconds: float, weight: float = 0.1) -> None:
        self._smoothed[stage] += weight * (seconds - self._smoothed[stage])

    def wake_at(self) -> Optional[float]:
        """When the worker, idle now, will next have work: a refill delay after the next deliver(), forecast from
        the smoothed learner step (None when there is no steady pace to forecast from, or work is waiting)."""
        learner = self._smoothed["learner"]
        if self._last_end is None or learner <= 0 or len(self.in_flight) < self.depth:
            return None
        return self._last_end + learner + self._refill_delay()

    def poll(self):
        """The worker's unit of work, under the lock: due deferred updates in, then one more batch dispatched while
        the schedule wants one and the plane admits it, then the oldest batch not known to be computed waited for.
        Returns what to wait for without the lock (``DeliveryWorker``), or None when there is nothing to do."""
        self._record_handovers()
        if len(self.in_flight) < (1 if self.one_ahead else self.depth) and self._admits():
            # the due updates go in with this draw (not before: a kernel of their own would run on the learner's
            # next call that reads the state, its ingest)
            computing = self.deferred.computing(self.step) if self.deferred is not None else ()
            if computing:  # due TD errors still being computed: wait for them without the lock, then poll again
                return lambda: jax.block_until_ready(computing) and None
            try:
                self.apply_due()
            except PriorityError as error:  # raised by the learner's next deliver(); the valid updates still apply
                self.worker.report(error)
            recycle, self.recycle = self.recycle, None
            batch = Prefetched(self._draw(recycle=recycle), self.epoch)
            # XLA:CPU computes a small kernel inside its dispatch: then it is ready now, and no wait follows
            # (its leaves are listed here, off the learner's thread: a recycle of it checks them for donation)
            batch.leaves = jax.tree_util.tree_leaves(batch.delivery)
            batch.ready = all(leaf.is_ready() for leaf in batch.leaves)
            self.in_flight.append(batch)
            return _nothing  # the lock is released between dispatches, so the learner's calls get in
        batch = next((b for b in self.in_flight if not b.ready), None)
        return None if batch is None else batch.wait


def _nothing() -> None:
    return None


# -- pieces every shell's host calls share ---------------------------------------------------------------------------
class CountedLock:
    """A re-entrant lock (``threading.RLock``, usable under ``threading.Condition``) that tells how many threads are
    blocked acquiring it (``waiting``; list appends and pops are atomic under the GIL, so the count never drifts)."""

    def __init__(self):
        self._lock = threading.RLock()
        self._blocked: list = []
        self._release_save, self._acquire_restore, self._is_owned = (
            self._lock._release_save, self._lock._acquire_restore, self._lock._is_owned)
        self.release = self._lock.release

    @property
    def waiting(self) -> int:
        return len(self._blocked)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        self._blocked.append(None)
        try:
            return self._lock.acquire(True, timeout)
        finally:
            self._blocked.pop()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self._lock.release()


def weakly(plane, method: str):
    """``plane.<method>`` called through a weak reference (the delivery worker's thread must keep no plane alive)."""
    ref = weakref.ref(plane)

    def call(*args, **kwargs):
        target = ref()
        if target is None:
            raise ReferenceError("the plane was freed")
        return getattr(target, method)(*args, **kwargs)

    return call


def checked_timeout(timeout, where: str) -> Optional[float]:
    """``timeout`` as the wait loops take it: None (or infinity) waits for ever, a number >= 0 that many seconds;
    ConfigError naming it otherwise (a NaN deadline would never pass)."""
    if timeout is None:
        return None
    if type(timeout) is float and 0.0 <= timeout < math.inf:  # the common case first: deliver()'s default 0.0
        return timeout
    if not isinstance(timeout, (int, float, np.integer, np.floating)) or isinstance(timeout, bool) or \
            math.isnan(timeout) or timeout < 0:
        raise ConfigError(f"{where}: timeout must be a number of seconds >= 0 or None (wait for ever), got "
                          f"{timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def wait_until(changed: threading.Condition, refusal, timeout: Optional[float]) -> None:
    """Wait (holding ``changed``) until ``refusal()`` is None; raise its ``(error type, message)`` when ``timeout``
    runs out."""
    reason = refusal()
    if reason is None:
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    while reason is not None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            error, message = reason
            raise error(message + (f" (waited {timeout} s)" if timeout else ""))
        changed.wait(None if remaining is None else min(remaining, threading.TIMEOUT_MAX))
        reason = refusal()


def check_version(version, current: int) -> None:
    """``set_policy_version()``'s argument checked: an int in [0, 2**31) and not below ``current`` (versions only move
    forward); ConfigError naming it otherwise."""
    if not isinstance(version, (int, np.integer)) or isinstance(version, bool) or not 0 <= version < 2**31:
        raise ConfigError(f"set_policy_version(): version must be an int in [0, 2**31), got {version!r}")
    if version < current:
        raise ConfigError(f"set_policy_version(): versions only move forward; the plane is at {current}, got "
                          f"{version}")
