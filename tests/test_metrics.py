"""The timeline's exposed path (metrics.Timeline.exposed_path): per delivered batch, the learner thread's ingest and
priority-update time since its previous batch plus the deliver() that handed the batch over."""

import threading
import time

import numpy as np
import pytest

from conduit_jax import ExperienceDataPlane, ExperienceSpec, default_mesh, samplers, schedule
from conduit_jax.metrics import Timeline


def test_each_batch_carries_the_learner_threads_ingests_and_updates_since_the_last_one():
    timeline, learner, actor = Timeline(), 1, 2
    t = time.perf_counter()
    # batch 0 (left out of the statistics: it carries what came before learning started) then two batches
    for stage, start, end, thread in [("ingest", 0, 5, learner), ("exposed", 5, 6, learner),
                                      ("ingest", 10, 12, learner), ("ingest", 12, 13, actor),  # not the learner's
                                      ("update", 14, 15, learner), ("exposed", 16, 20, learner),
                                      ("sample", 17, 19, actor),  # the worker's draw: hidden
                                      ("ingest", 21, 23, learner), ("exposed", 23, 24, learner)]:
        timeline.record(stage, t + start * 1e-6, t + end * 1e-6, thread)
    path = timeline.exposed_path()
    # stamps are perf_counter() values: on a host up for hours (6.6e4 s) a float64 stamp resolves ~1.5e-11 s, more
    # than a relative 1e-6 of these microsecond spans, so they compare to within a nanosecond
    assert path["batches"] == 3
    assert path["median_us"] == pytest.approx(np.median([2 + 1 + 4, 2 + 1]), abs=1e-3)
    assert path["mean_us"] == pytest.approx(5.0, abs=1e-3)
    assert path["parts_s"]["ingest"] == pytest.approx(9e-6, abs=1e-9)
    assert path["parts_s"]["exposed"] == pytest.approx(6e-6, abs=1e-9)


def test_the_plane_counts_ingests_on_the_thread_that_delivers_under_a_worker():
    """Under overlap the worker records each deliver() span; it is still counted as the learner thread's, so that
    thread's ingests are part of its exposed path (and an actor thread's are not)."""
    spec = ExperienceSpec.from_example({"x": np.int32(0)})
    plane = ExperienceDataPlane(spec, 256, samplers.fifo(8), mesh=default_mesh(1), schedule=schedule.overlap(2))
    try:
        actor = threading.Thread(target=plane.ingest, args=({"x": np.arange(64, dtype=np.int32)},))
        actor.start()
        actor.join()
        for step in range(6):
            plane.ingest({"x": np.arange(8, dtype=np.int32)})
            plane.deliver(timeout=5.0)
        plane.in_flight()  # the worker has recorded every handover
        path = plane.stats()["exposed_path"]
        ingests = plane.stats()["stages"]["ingest"]
        assert path["batches"] == 6
        # the learner's six ingests, not the actor's: its share of the ingest total
        assert 0 < path["parts_s"]["ingest"] < ingests["total_s"]
    finally:
        plane.close()


def test_waiting_for_the_learners_own_td_errors_is_not_the_exposed_path(td_errors_computing):
    """update_priorities() with TD errors still being computed waits for the learner's step: that wait is recorded
    as td_wait, and the update span (part of the exposed path) holds only the call's own work."""
    spec = ExperienceSpec.from_example({"x": np.int32(0)})
    plane = ExperienceDataPlane(spec, 64, samplers.prioritized(8), mesh=default_mesh(1))
    plane.ingest({"x": np.arange(64, dtype=np.int32)})
    delivery = plane.deliver()

    priorities = td_errors_computing(delivery.ids, 0.2)  # the learner's step: ~0.2 s still to run
    plane.update_priorities(delivery.ids, priorities)
    stages = plane.stats()["stages"]
    assert stages["td_wait"]["calls"] == 1 and stages["td_wait"]["total_s"] > 0.05
    assert stages["update"]["total_s"] < stages["td_wait"]["total_s"]
