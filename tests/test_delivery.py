"""The delivery worker (delivery.py): a prefetching schedule's host work runs on the plane's own thread, and the
thread's life is the plane's. What it must not change (rate limiter, FIFO, staleness, priority bound k) is tested for
every schedule in test_schedule.py; what hides how much is measured by experiments/scheduling.py, never asserted.
"""

import gc
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from conduit_jax import ExperienceDataPlane, ExperienceSpec, PriorityError, default_mesh, limits, metrics, samplers
from conduit_jax import schedule as schedule_lib
from conduit_jax.delivery import Scheduler

SPEC = ExperienceSpec.from_example({"x": np.int32(0)})


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "conduit-delivery"]


def _sample_threads(plane) -> list[int]:
    """The thread id of every ``sample`` span (each dispatch of a batch), in order."""
    return [e["tid"] for e in plane.timeline.chrome_trace()["traceEvents"] if e["name"] == "sample"]


def test_refills_are_drawn_and_finished_off_the_learners_thread():
    """deliver() hands over a batch the worker dispatched and waited for; the learner's thread dispatches none."""
    plane = ExperienceDataPlane(SPEC, 64, samplers.uniform(8), schedule=schedule_lib.overlap(2), mesh=default_mesh(1))
    assert plane._schedule.worker is not None and plane._schedule.worker.alive
    plane.ingest({"x": np.arange(64, dtype=np.int32)})
    for _ in range(4):
        plane.deliver()
        queued = plane.in_flight()  # waits until the worker has done what it can: two batches, both computed
        assert len(queued) == 2 and all(leaf.is_ready() for leaf in queued[0].data.values())
    # the first batch: nothing was in flight, so deliver() drew it; every refill came from the worker
    assert threading.get_ident() not in _sample_threads(plane)[1:]
    assert len(ExperienceDataPlane(SPEC, 64, samplers.uniform(8), mesh=default_mesh(1))._schedule.in_flight) == 0
    plane.close()


def test_the_first_minibatches_of_a_rollout_are_staged_as_it_is_ingested():
    """PPO's pattern (epochs sampler, one rollout per capacity): the ingest wakes the worker, which draws the first
    `depth` minibatches of the epoch before the learner asks; every item still comes once per epoch."""
    rollout, batch, epochs = 32, 8, 2
    plane = ExperienceDataPlane(SPEC, rollout, samplers.epochs(batch), schedule=schedule_lib.deferred(1, 2),
                                limiter=limits.sample_to_insert_ratio(epochs, 1, (epochs + batch) / 2),
                                mesh=default_mesh(1))
    for it in range(2):
        drawn = len(_sample_threads(plane))
        plane.ingest({"x": np.arange(rollout, dtype=np.int32)})
        assert len(plane.in_flight()) == 2  # staged with no deliver() called, by the worker
        assert threading.get_ident() not in _sample_threads(plane)[drawn:]
        # (a learner faster than the worker draws a refill itself: deliver() never waits for the worker)
        seen = np.concatenate([np.asarray(plane.deliver().data["x"]) for _ in range(epochs * rollout // batch)])
        assert (np.bincount(seen, minlength=rollout) == epochs).all()
    plane.close()


def test_after_a_policy_switch_the_rollouts_ingest_draws_the_first_minibatch_itself():
    """PPO's loop (set_policy_version, ingest the rollout, deliver at once): the ingest draws the epoch's first
    minibatch on its own thread, as the learner would next, and nothing else is drawn before that deliver(); every
    item of the new rollout still comes once per epoch."""
    rollout, batch, epochs = 32, 8, 2
    plane = ExperienceDataPlane(SPEC, rollout, samplers.epochs(batch), schedule=schedule_lib.overlap(2),
                                limiter=limits.sample_to_insert_ratio(epochs, 1, (epochs + batch) / 2),
                                mesh=default_mesh(1))
    for version in range(2):
        drawn = len(_sample_threads(plane))
        plane.set_policy_version(version)
        plane.ingest({"x": np.arange(rollout, dtype=np.int32) + 100 * version})
        assert len(plane.in_flight()) == 1 and _sample_threads(plane)[drawn:] == [threading.get_ident()]
        # (the refills are the worker's, unless this loop, with no learner step, asks before the worker drew)
        seen = [np.asarray(plane.deliver().data["x"]) for _ in range(epochs * rollout // batch)]
        counts = np.bincount(np.concatenate(seen) - 100 * version, minlength=rollout)
        assert counts.shape == (rollout,) and (counts == epochs).all()
    plane.close()


def test_a_rejected_deferred_update_surfaces_in_the_next_deliver():
    """The worker applies due deferred updates before its draws; a bad one (NaN) is raised by the learner's next
    deliver(), naming the step it was reported at, and the valid ones of the same batch still apply."""
    plane = ExperienceDataPlane(SPEC, 64, samplers.prioritized(8), schedule=schedule_lib.deferred(1, 2),
                                mesh=default_mesh(1))
    plane.ingest({"x": np.arange(64, dtype=np.int32)})
    delivery = plane.deliver()
    plane.update_priorities(delivery.ids[:1], np.array([np.nan]))  # reported at step 1, due at step 2
    plane.update_priorities(delivery.ids[1:2], np.array([50.0]))
    plane.deliver()  # step 2: the worker applies both when it draws next
    plane.in_flight()
    with pytest.raises(PriorityError, match="reported at step 1"):
        plane.deliver()
    plane.deliver()  # raised once; the worker carries on
    assert float(plane.state.sampler.max_priority) == 50.0
    plane.close()


def test_close_stops_the_worker_and_the_plane_keeps_delivering():
    # this plane's own thread (a count of every worker thread would include earlier tests' planes, whose threads
    # end whenever their planes are collected)
    with ExperienceDataPlane(SPEC, 64, samplers.fifo(4), schedule=schedule_lib.overlap(2),
                             mesh=default_mesh(1)) as plane:
        plane.ingest({"x": np.arange(32, dtype=np.int32)})
        got = [np.asarray(plane.deliver().data["x"])]
        thread = plane._schedule.worker._thread
        assert thread.is_alive() and thread in _workers()
    assert not thread.is_alive() and thread not in _workers() and plane._schedule.worker is None
    got += [np.asarray(plane.deliver().data["x"]) for _ in range(7)]  # refills dispatched by deliver() itself
    np.testing.assert_array_equal(np.concatenate(got), np.arange(32))  # FIFO order, each item once
    plane.close()  # idempotent


def test_an_unclosed_plane_is_freed_and_its_worker_stops():
    plane = ExperienceDataPlane(SPEC, 64, samplers.uniform(8), schedule=schedule_lib.adaptive(2, 1),
                                mesh=default_mesh(1))
    plane.ingest({"x": np.arange(64, dtype=np.int32)})
    plane.deliver()
    thread = plane._schedule.worker._thread
    del plane
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_the_interpreter_exits_with_a_busy_unclosed_plane():
    code = ("import numpy as np, conduit_jax as cj\n"
            "spec = cj.ExperienceSpec.from_example({'x': np.int32(0)})\n"
            "plane = cj.ExperienceDataPlane(spec, 64, cj.samplers.uniform(8), schedule=cj.schedule.overlap(2),"
            " mesh=cj.default_mesh(1))\n"
            "plane.ingest({'x': np.arange(64, dtype=np.int32)})\n"
            "keep = [plane.deliver() for _ in range(3)]\n"
            "print('done')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr[-2000:]


def _napping_worker(nap_s: float):
    """A DeliveryWorker over a poll that only counts, napping on a forecast ``nap_s`` from now, and a count of the
    wake-ups (notifications) sent to it."""
    from conduit_jax.delivery import DeliveryWorker

    polls, notified = [], []
    wake_at = time.perf_counter() + nap_s
    worker = DeliveryWorker(threading.RLock(), lambda: polls.append(time.perf_counter()), "test-worker",
                            wake_at=lambda: wake_at if not polls else None)
    notify_all = worker._lock.notify_all
    worker._lock.notify_all = lambda: notified.append(1) or notify_all()
    deadline = time.monotonic() + 10
    while worker._napping_until is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert worker._napping_until == wake_at
    return worker, wake_at, polls, notified


def test_a_kick_due_when_the_napping_worker_wakes_anyway_sends_no_wake_up():
    """deliver()'s delayed kick that falls due about when the worker's forecast nap ends leaves it asleep (a wake-up
    took the GIL from the learner's thread); the nap's end is the wake-up, and the poll comes no earlier than due."""
    worker, wake_at, polls, notified = _napping_worker(1.0)  # time enough to start napping
    with worker._lock:
        worker.kick(delay=wake_at - time.perf_counter())
        assert notified == [] and polls == []
        worker.settle()  # wants the work now: wakes it, then waits for the poll
        assert len(polls) == 1 and polls[0] >= wake_at - 1e-3
    worker.close()
    assert not worker.alive


def test_a_kick_due_before_the_nap_ends_wakes_the_worker():
    worker, wake_at, polls, notified = _napping_worker(30.0)
    with worker._lock:
        worker.kick()
        assert len(notified) == 1
        worker.settle()
        assert len(polls) == 1 and polls[0] < wake_at
    worker.close()
    assert not worker.alive


PREFETCHING = {"overlap": lambda: schedule_lib.overlap(2), "deferred": lambda: schedule_lib.deferred(1, 2),
               "adaptive": lambda: schedule_lib.adaptive(3), "staged": schedule_lib.staged, "sync": schedule_lib.sync}


@pytest.mark.parametrize("name", sorted(PREFETCHING))
def test_a_mix_of_sample_and_deliver_keeps_fifo_exactly_once_and_epochs_once_per_epoch(mesh, name):
    """Any mix of sample() and deliver(): a queue delivers every item exactly once; when its items wait in prefetched
    batches, sample() (and can_sample()) refuse and name them; an epoch delivers each item once."""
    from conduit_jax.errors import NotEnoughDataError

    queue = ExperienceDataPlane(SPEC, 256, samplers.fifo(16), schedule=PREFETCHING[name](), mesh=mesh)
    epochs = ExperienceDataPlane(SPEC, 64, samplers.epochs(16), schedule=PREFETCHING[name](), mesh=mesh)
    try:
        got = []
        queue.ingest({"x": np.arange(48, dtype=np.int32)})
        got += np.asarray(queue.deliver().data["x"]).tolist()
        queue.in_flight()  # the worker has drawn what it will: the other 32 items, where it prefetches
        if queue.prefetch_depth:
            assert not queue.can_sample()
            with pytest.raises(NotEnoughDataError, match=r"\d+ more wait in \d+ batches .* take them with deliver"):
                queue.sample()
        for start in range(48, 48 + 16 * 6, 16):
            queue.ingest({"x": np.arange(start, start + 16, dtype=np.int32)})
            for take in (queue.sample, queue.deliver) if start % 32 else (queue.deliver, queue.sample):
                try:
                    got += np.asarray(take().data["x"]).tolist()
                except NotEnoughDataError:
                    pass
        for take in (queue.deliver, queue.sample):  # what is left, in flight and in the queue
            while True:
                try:
                    got += np.asarray(take().data["x"]).tolist()
                except NotEnoughDataError:
                    break
        assert sorted(got) == list(range(48 + 16 * 6))  # each exactly once

        epochs.ingest({"x": np.arange(64, dtype=np.int32)})
        seen = []
        for step in range(8):  # two epochs of four minibatches
            take = epochs.sample if step % 3 == 1 else epochs.deliver
            seen.append(np.asarray(take().data["x"]).tolist())
        # every draw so far: the ones returned and the ones still in flight (a worker's draws are handed over later
        # than the calls in between, so the epochs are counted, not cut in order)
        seen += [np.asarray(d.data["x"]).tolist() for d in epochs.in_flight()]
        counts = np.bincount([x for batch in seen for x in batch], minlength=64)
        full = len(seen) // 4
        assert set(counts.tolist()) <= {full, full + 1} and counts.sum() == 16 * len(seen)
        if not epochs.prefetch_depth:
            for epoch in (seen[:4], seen[4:]):
                assert sorted(x for batch in epoch for x in batch) == list(range(64))
    finally:
        queue.close()
        epochs.close()


class _Caller:
    """The caller's side of a ``Scheduler(threaded=False)``: each draw is a numbered device scalar, noted with its
    request; updates are noted as they reach the kernel queue (``pend``)."""

    def __init__(self, policy, updates: bool):
        self.events = []  # ("draw", number, request) / ("pend", ids)
        self.scheduler = Scheduler(policy, threading.RLock(), 64, metrics.Timeline(), draw=self.draw,
                                   admits=lambda: True, pend=self.pend, refresh=lambda delivery: delivery,
                                   threaded=False, updates=updates)

    def draw(self, request=None, timeout=None, recycle=None):
        self.events.append(("draw", len(self.events), request))
        return jnp.asarray(len(self.events) - 1)

    def pend(self, checked):
        self.events.append(("pend", checked[0][:, 0].tolist()))

    def deliver(self, request):
        return int(self.scheduler.deliver(None, None, None, request=request))


def test_without_a_worker_a_batch_drawn_ahead_goes_only_to_its_request():
    """Drawn right after each deliver() (no updates reported) on the caller's thread, for that deliver()'s request;
    handed over to the next deliver() of the same request, dropped for another one (drawn anew), or by discard()."""
    caller = _Caller(schedule_lib.overlap(1), updates=False)
    scheduler = caller.scheduler
    assert scheduler.worker is None and scheduler.inline
    assert caller.deliver("a") == 0  # nothing ahead: drawn now, then the next one ahead
    assert [e[2] for e in caller.events] == ["a", "a"]
    assert caller.deliver("a") == 1
    assert caller.deliver("b") == 3  # batch 2 was drawn for "a": dropped
    assert scheduler.discard(lambda batch: int(batch) == 4) == 1  # the one ahead for "b"
    assert caller.deliver("b") == 5
    assert scheduler.counts == {"after_update": 0, "after_delivery": 4, "waited": 0, "dropped": 2}


@pytest.mark.parametrize("name", ["overlap", "deferred"])
def test_without_a_worker_the_batch_ahead_is_drawn_after_the_update_or_the_delivery(name):
    """overlap (k 0): the next batch is drawn when the caller reports its update, after it (it sees it); deferred
    (k 1): right after the delivery, before that update, which the draw after the next delivery applies first."""
    policy = schedule_lib.overlap(1) if name == "overlap" else schedule_lib.deferred(1, 1)
    caller = _Caller(policy, updates=True)
    scheduler, ids = caller.scheduler, np.array([[3, 1]], np.int32)
    for step in range(3):
        caller.deliver("r")
        if name == "overlap":
            caller.pend((ids + step, None))  # the caller queues a k-0 update itself
        else:
            scheduler.report_update(ids + step, np.ones(1, np.float32))
        scheduler.updated()
    kinds = [e[0] if e[0] == "draw" else f"pend {e[1][0]}" for e in caller.events]
    if name == "overlap":
        assert kinds == ["draw", "pend 3", "draw", "pend 4", "draw", "pend 5", "draw"]
    else:
        assert kinds == ["draw", "draw", "pend 3", "draw", "pend 4", "draw"]  # update 5 is not due yet
    way = "after_update" if name == "overlap" else "after_delivery"
    assert scheduler.counts[way] == 3 and scheduler.counts["dropped"] == 0
