"""Latency-aware scheduling policies for delivery: when the plane's kernels run relative to the learner's step.

A policy is data; the shell (``ExperienceDataPlane.deliver``) carries it out.

* ``sync()``: the eager baseline, as RLlib runs it: each ``ingest()`` writes with a kernel of its own, each
  ``deliver()`` samples and waits, on the learner's critical path.
* ``staged()`` (the plane's default): ``deliver()`` samples on demand as under ``sync``, but ``ingest()`` only copies
  the batch into a host staging area (``staging.py``); the next kernel that runs anyway (the draw) writes it into the
  rings before it draws, in the same dispatch. One dispatch per iteration for the whole path.
* ``overlap(depth)`` (stages ingests too): the plane's delivery worker (``delivery.py``, a daemon thread) keeps up to ``depth`` batches
  dispatched and finished while the learner computes; ``deliver()`` hands over the oldest one and wakes the worker
  to draw the next. The dispatch, the rate-limiter and refusal checks, the deferred updates and the wait for the
  batch all run on the worker's thread, and the worker's refill writes the staged ingests, so the learner's thread
  runs no kernel of the experience path: ``ingest()`` is a copy and ``deliver()`` a queue pop whenever the worker
  keeps up.
* ``deferred(k, depth)``: overlap, plus priority updates queued on the host and applied in one coalesced kernel call
  once they are k steps old (from ``update_priorities``, off the delivery's wait); the bound: a batch dispatched at
  step t has seen every update reported at steps <= t - k. Queued updates are validated when they are applied (by
  the worker, before its next draw), so the learner never waits for the TD errors it just reported; a bad one is
  raised by the next ``deliver()``, naming its step. ``update_priorities`` waits only for the TD errors reported
  k - 1 steps earlier (the ones the worker's next draw must see): the learner's thread runs at most k - 1 steps
  ahead of its own device work, and that wait is the learner's, never inside ``deliver()``.
* ``adaptive(max_depth, k)``: deferred whose depth follows the measured (smoothed) exposed wait and learner step
  time, within ``max_depth`` (``Schedule.next_depth``).

Without a worker (``delivery.Scheduler(threaded=False)``: a caller that asks for one batch at a time on its own
thread, such as RLlib's replay buffers in ``adapters/conduit_rllib``), the same policies draw their batches ahead on
the caller's thread and let JAX's asynchronous dispatch compute them: ``overlap`` right after the caller's priority
update (the batch sees it), ``deferred`` right after the delivery (it misses that update, within k), ``adaptive``
moving between the two (``draws_after_update``).

Semantics every policy keeps: the rate limiter sees a prefetched batch when it is dispatched (so the
samples-per-insert ratio counts it); a FIFO dispatches each item exactly once (prefetch moves the queue head once per
batch); on a policy-version switch the in-flight batches are re-checked against the new version, so an on-policy
batch never holds items older than the staleness bound allows. The worker draws under the plane's lock, and every
call that reads the plane's host bookkeeping (``stats``, ``in_flight``, ``save``, ``set_policy_version``) first lets
it finish what it can do now, so these read what they would without a thread. On-policy data (``samplers.epochs``):
the ``ingest`` of a rollout right after ``set_policy_version`` draws the new epoch's first minibatch itself (the
learner asks for it next, and a worker woken for it only raced that ``deliver()``), and the worker draws the rest
after it; an ``ingest`` without a switch wakes the worker, which stages the first ``depth`` minibatches.

Reproducibility: under ``sync`` a run is a pure function of its seed and its call sequence. The prefetching policies
draw when the worker's thread gets to it, so whether a prefetched batch includes the latest ingest or priority update
(within the bounds above) depends on timing, and a fixed seed does not give bit-identical runs; use ``sync`` to
reproduce one exactly.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

from conduit_jax import runtime
from conduit_jax.errors import ConduitWarning, ConfigError


class Schedule(NamedTuple):
    name: str
    depth: int  # batches kept in flight (0: sample on demand)
    defer: int  # priority-update staleness bound k (0: apply at once)
    adaptive: bool = False
    stage: bool = True  # ingests are staged on the host and written by the next kernel (False: a kernel per ingest)

    def arguments(self) -> tuple:
        """The arguments of the constructor (``schedule.<name>``) that makes this schedule: ``overlap(depth)``,
        ``deferred(k, depth)``, ``adaptive(max_depth, k)``; none for ``sync`` and ``staged``."""
        return {"overlap": (self.depth,), "deferred": (self.defer, self.depth),
                "adaptive": (self.depth, self.defer)}.get(self.name, ())

    def next_depth(self, depth: int, exposed_s: float, learner_s: float) -> int:
        """The adaptive rule, from smoothed stage times: one more batch in flight while the learner still waits a
        noticeable part (10%) of its step, one fewer when it waits almost never (<1%), within [1, max_depth]. The
        other policies keep their depth."""
        if not self.adaptive or learner_s <= 0:
            return depth
        if exposed_s > 0.1 * learner_s:
            return min(self.depth, depth + 1)
        if exposed_s < 0.01 * learner_s:
            return max(1, depth - 1)
        return depth


ADAPTIVE_WAIT_SHARE = 0.1  # adaptive, no worker: a draw moves off the update once deliver() waits this share
ADAPTIVE_RETRY_AFTER = 32  # adaptive, no worker: batches drawn right after their delivery before trying again


def draws_after_update(after_update: bool, waited_s: float, update_s: float, run: int) -> bool:
    """``adaptive``'s rule (k >= 1) for a scheduler without a worker (``delivery.Scheduler(threaded=False)``), which
    draws its next batch ahead on the caller's thread: right after the caller's priority update (True: the batch sees
    it, as under sync; where an adaptive schedule starts) or right after the delivery (False: it computes while the
    learner computes the update, and misses it, within the bound k). After the update while ``deliver()`` does not
    wait for that batch noticeably (``waited_s`` at most ``ADAPTIVE_WAIT_SHARE`` of ``update_s``, the smoothed time
    from a delivery to its update); after the delivery once it does (when the caller updates and samples back to
    back, nothing separates an update from the next ``deliver()``, so a draw after the update cannot finish in time);
    after the update again once ``run`` batches in a row were drawn after their delivery (``ADAPTIVE_RETRY_AFTER``),
    in case the gap has grown. ``overlap`` (k 0) always draws after the update, ``deferred`` after the delivery."""
    if after_update:
        return waited_s <= ADAPTIVE_WAIT_SHARE * update_s
    return run >= ADAPTIVE_RETRY_AFTER


def _positive(value, name: str, where: str, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"schedule.{where}(): {name} must be an int >= {low}, got {value!r}")
    return value


def sync() -> Schedule:
    return Schedule("sync", depth=0, defer=0, stage=False)


def staged() -> Schedule:
    return Schedule("staged", depth=0, defer=0)


def overlap(depth: int = 2) -> Schedule:
    return Schedule("overlap", depth=_positive(depth, "depth", "overlap"), defer=0)


def deferred(k: int = 2, depth: int = 2) -> Schedule:
    return Schedule("deferred", depth=_positive(depth, "depth", "deferred"), defer=_positive(k, "k", "deferred"))


def adaptive(max_depth: int = 4, k: int = 1) -> Schedule:
    return Schedule("adaptive", depth=_positive(max_depth, "max_depth", "adaptive"),
                    defer=_positive(k, "k", "adaptive", low=0), adaptive=True)


def rebuilt(schedule: Schedule, where: str) -> Schedule:
    """``schedule`` rebuilt through its constructor (``sync``, ``overlap``, ``deferred``, ``adaptive``), so a
    hand-made or recorded ``Schedule`` gets the constructors' checks; ConfigError naming what is wrong."""
    name = schedule.name
    made = {"sync": sync, "staged": staged, "overlap": overlap, "deferred": deferred, "adaptive": adaptive}.get(name)
    if made is None:
        raise ConfigError(f"{where}: schedule name must be sync, staged, overlap, deferred or adaptive, got {name!r}")
    result = made(*schedule.arguments())
    if result != schedule:
        raise ConfigError(f"{where}: {schedule} is not what schedule.{name}() makes ({result}); build it with "
                          f"schedule.{name}(...)")
    return result


def warn_if_synchronous(schedule: Schedule, devices, stacklevel: int = 2) -> None:
    """ConduitWarning when ``schedule`` prefetches on devices that compute each dispatch before it returns."""
    if schedule.depth and runtime.prefetch_is_synchronous(devices):
        warnings.warn(f"ExperienceDataPlane(): schedule {schedule.name} prefetches, but JAX's CPU async dispatch is "
                      f"off (jax_cpu_enable_async_dispatch=False; configure_cpu()'s default), so the delivery worker "
                      f"computes each prefetched batch while it holds the plane's lock and the learner's next call "
                      f"waits for it; use configure_cpu(async_dispatch=True) or schedule.sync()", ConduitWarning,
                      stacklevel=stacklevel + 1)
